"""The table of registered data sets: name -> :class:`DatasetSpec`.

The table and its lookups live here, below the loaders that fill it: the
offline loaders and the built-in registrations are in
:mod:`fedlr.data.registry`, the hub loaders in :mod:`fedlr.data.hub` (whose
error names the offline alternatives, read from this table). Import the
public names from :mod:`fedlr.data` or :mod:`fedlr.data.registry`, which
registers the built-in sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import datasets

from fedlr.errors import FedLRError

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "UnknownDatasetError",
    "available_datasets",
    "dataset_info",
    "offline_datasets",
    "register_dataset",
]

Kind = Literal["text", "image", "instruct"]
Loader = Callable[[], datasets.Dataset]


class UnknownDatasetError(FedLRError, KeyError, ValueError):
    """The requested dataset name is not registered.

    Parameters
    ----------
    name : str
        The requested name.
    known : list of str
        The registered names.
    """

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        super().__init__(
            f"unknown dataset '{name}'; known datasets: {', '.join(known)}"
        )

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence.
        return str(self.args[0])


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset.

    Attributes
    ----------
    name : str
        Registry name (``dataset`` in the run config).
    kind : {"text", "image", "instruct"}
        Which feature column the dataset has besides ``label``: ``text``,
        ``image``, or for instruction data (the causal-LM task)
        ``instruction`` and ``response`` (with ``text`` = the instruction and
        ``label`` a grouping such as the problem family).
    num_classes : int
        Number of classes of ``label``.
    offline : bool
        Whether it loads without the Hugging Face hub.
    loader : callable
        ``loader() -> datasets.Dataset`` in the registry's schema, source order.
    description : str
        One line: what it is and where it comes from.
    """

    name: str
    kind: Kind
    num_classes: int
    offline: bool
    loader: Loader
    description: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty string")
        if self.kind not in ("text", "image", "instruct"):
            raise ValueError(
                f"kind must be 'text', 'image' or 'instruct', got {self.kind!r}"
            )
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")


_REGISTRY: dict[str, DatasetSpec] = {}

DATASETS: Mapping[str, DatasetSpec] = MappingProxyType(_REGISTRY)
"""Read-only view of the registry, name -> :class:`DatasetSpec`."""


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    """Add a dataset to the registry.

    Parameters
    ----------
    spec : DatasetSpec

    Returns
    -------
    DatasetSpec
        ``spec``, unchanged.

    Raises
    ------
    ValueError
        If the name is already registered.
    """
    if spec.name in _REGISTRY:
        raise ValueError(f"dataset '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def available_datasets() -> tuple[str, ...]:
    """Return the registered dataset names, sorted."""
    return tuple(sorted(_REGISTRY))


def offline_datasets() -> tuple[str, ...]:
    """Return the names of datasets that load without the hub, sorted."""
    return tuple(sorted(n for n, s in _REGISTRY.items() if s.offline))


def dataset_info(name: str) -> DatasetSpec:
    """Return the spec of a registered dataset.

    Parameters
    ----------
    name : str

    Returns
    -------
    DatasetSpec

    Raises
    ------
    UnknownDatasetError
        If ``name`` is not registered (the message lists the known names).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownDatasetError(name, list(available_datasets())) from None
