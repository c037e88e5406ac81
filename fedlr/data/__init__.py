"""Data: offline assets, the dataset registry, client partitioning, image tensors.

Public names are imported lazily (PEP 562), so ``import fedlr.data`` is cheap
and ``python -m fedlr.data.assets`` runs without importing ``datasets``.

>>> from fedlr.data import PartitionConfig, load_dataset, split_dataset
>>> ds = load_dataset("polarity", seed=0)
>>> split = split_dataset(ds, PartitionConfig("dirichlet", num_partitions=4, seed=0))
>>> split.partition(0), split.heldout
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedlr.data.assets import (
        AssetFetchError,
        AssetMissingError,
        cache_dir,
        ensure_assets,
        minilm_path,
        require_asset,
    )
    from fedlr.data.hub import DatasetUnavailableError
    from fedlr.data.images import ImageData, to_image_data
    from fedlr.data.partition import (
        FederatedSplit,
        PartitionConfig,
        PartitionIndexError,
        split_dataset,
    )
    from fedlr.data.registry import (
        DATASETS,
        DatasetSpec,
        UnknownDatasetError,
        available_datasets,
        clear_dataset_cache,
        dataset_info,
        load_dataset,
        offline_datasets,
        register_dataset,
    )
    from fedlr.data.splits import dataset_split, partition_config

_EXPORTS: dict[str, str] = {
    "AssetFetchError": "assets",
    "AssetMissingError": "assets",
    "cache_dir": "assets",
    "ensure_assets": "assets",
    "minilm_path": "assets",
    "require_asset": "assets",
    "FederatedSplit": "partition",
    "PartitionConfig": "partition",
    "PartitionIndexError": "partition",
    "split_dataset": "partition",
    "DATASETS": "registry",
    "DatasetSpec": "registry",
    "DatasetUnavailableError": "hub",
    "UnknownDatasetError": "registry",
    "available_datasets": "registry",
    "clear_dataset_cache": "registry",
    "dataset_info": "registry",
    "load_dataset": "registry",
    "offline_datasets": "registry",
    "register_dataset": "registry",
    "ImageData": "images",
    "to_image_data": "images",
    "dataset_split": "splits",
    "partition_config": "splits",
}

__all__ = [
    "DATASETS",
    "AssetFetchError",
    "AssetMissingError",
    "DatasetSpec",
    "DatasetUnavailableError",
    "FederatedSplit",
    "ImageData",
    "PartitionConfig",
    "PartitionIndexError",
    "UnknownDatasetError",
    "available_datasets",
    "cache_dir",
    "clear_dataset_cache",
    "dataset_info",
    "dataset_split",
    "ensure_assets",
    "load_dataset",
    "minilm_path",
    "offline_datasets",
    "partition_config",
    "register_dataset",
    "require_asset",
    "split_dataset",
    "to_image_data",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedlr.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fedlr.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
