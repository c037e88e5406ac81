"""Operator mistakes get named errors that say what to do, before harm is done.

* A full disk while a checkpoint is written: :class:`CheckpointWriteError`,
  no partial ``*.tmp`` or unlisted file, the manifest unchanged and the
  previous checkpoint loadable.
* ``output-dir`` that is a file or a symbolic link to nothing: a
  :class:`ConfigError` on ``output-dir`` before the server builds its model.
* A ``resume-from`` checkpoint (valid hash) whose arrays fit another layout:
  :class:`CheckpointLayoutError` before round 1, naming the first key that
  does not fit and both shapes (or dtypes).

The disk-full cases write through the real ``os.write`` until the file has
received some bytes, then fail with ``ENOSPC`` as a full file system does.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedlr.errors import CheckpointLayoutError, CheckpointWriteError, ConfigError
from fedlr.runs.checkpoint import (
    MANIFEST,
    check_checkpoint_arrays,
    checkpoint_name,
    get_rng_state,
    load_checkpoint,
    save_checkpoint,
)
from fedlr.runs.results import ensure_output_dir

needs_proc_fd = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the disk-full fake finds a descriptor's file through /proc/self/fd",
)


def _payload(round_: int) -> dict:
    gen = torch.Generator().manual_seed(round_)
    return {
        "round": round_,
        # 3 MB: several 1 MiB writes, so the failure comes after some bytes.
        "arrays": {"w": torch.randn(750_000, generator=gen)},
        "strategy": {"rank": 4},
        "rng": get_rng_state(),
        "config": {"method": "fedavg-lora", "seed": 1},
    }


def _disk_full_after(monkeypatch, name_part: str, nbytes: int) -> list[int]:
    """``os.write`` to a file whose name contains ``name_part`` fails with
    ENOSPC once ``nbytes`` have been written to it; other files are untouched.
    Returns the list of bytes written before the failure (filled in)."""
    real_write = os.write
    written = [0]

    def write(fd: int, data) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if name_part not in Path(target).name:
            return real_write(fd, data)
        room = nbytes - written[0]
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done = real_write(fd, bytes(data[:room]))
        written[0] += done
        return done

    monkeypatch.setattr(os, "write", write)
    return written


@needs_proc_fd
def test_disk_full_while_writing_a_checkpoint_keeps_the_previous_one(
    tmp_path, monkeypatch
):
    save_checkpoint(tmp_path, _payload(1))
    save_checkpoint(tmp_path, _payload(2))
    manifest = (tmp_path / MANIFEST).read_bytes()
    with monkeypatch.context() as patch:
        written = _disk_full_after(patch, checkpoint_name(3), 1 << 20)
        with pytest.raises(CheckpointWriteError) as info:
            save_checkpoint(tmp_path, _payload(3))
    assert written[0] == 1 << 20  # the failure came after some bytes
    message = str(info.value)
    assert f"no space left writing {tmp_path / checkpoint_name(3)}" in message
    assert "needed ~3.0" in message  # the 3 MB payload
    assert "free space or set output-dir elsewhere" in message
    assert "the previous checkpoint (round 2) is intact" in message
    assert info.value.previous_round == 2
    assert "\n" not in message
    assert isinstance(info.value, OSError)
    # Nothing partial, the manifest untouched, the previous checkpoint loads.
    assert {p.name for p in tmp_path.iterdir()} == {
        MANIFEST,
        checkpoint_name(1),
        checkpoint_name(2),
    }
    assert (tmp_path / MANIFEST).read_bytes() == manifest
    loaded = load_checkpoint(tmp_path)
    assert loaded["round"] == 2
    assert torch.equal(loaded["arrays"]["w"], _payload(2)["arrays"]["w"])
    # Space freed: the next round saves as usual.
    save_checkpoint(tmp_path, _payload(3))
    assert load_checkpoint(tmp_path)["round"] == 3


@needs_proc_fd
def test_disk_full_while_writing_the_manifest_removes_the_unlisted_checkpoint(
    tmp_path, monkeypatch
):
    save_checkpoint(tmp_path, _payload(1))
    manifest = (tmp_path / MANIFEST).read_bytes()
    with monkeypatch.context() as patch:
        _disk_full_after(patch, MANIFEST, 10)
        with pytest.raises(CheckpointWriteError, match=r"round 1\) is intact"):
            save_checkpoint(tmp_path, _payload(2))
    assert {p.name for p in tmp_path.iterdir()} == {MANIFEST, checkpoint_name(1)}
    assert (tmp_path / MANIFEST).read_bytes() == manifest
    assert load_checkpoint(tmp_path)["round"] == 1


def test_the_first_checkpoint_failing_says_no_earlier_one_exists(tmp_path, monkeypatch):
    def refuse(fd: int, data) -> int:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", refuse)
        with pytest.raises(
            CheckpointWriteError,
            match=r"cannot write .*checkpoint-00000\.pt \(needed ~.* MB\): "
            r"Permission denied: .*; no earlier checkpoint exists",
        ):
            save_checkpoint(tmp_path, _payload(0))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ output-dir
def test_output_dir_that_is_a_file_or_a_dangling_link_is_named(tmp_path):
    a_file = tmp_path / "results"
    a_file.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"'output-dir'.*is a file, not a directory"):
        ensure_output_dir(a_file)
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "gone")
    with pytest.raises(
        ConfigError, match=r"'output-dir'.*symbolic link to '.*gone', which does not"
    ):
        ensure_output_dir(dangling)
    with pytest.raises(ConfigError, match=r"'output-dir': cannot create .*results/x"):
        ensure_output_dir(a_file / "x")  # below a file
    made = ensure_output_dir(tmp_path / "new" / "deeper")
    assert made.is_dir()
    linked = tmp_path / "good-link"
    linked.symlink_to(made)
    assert ensure_output_dir(linked) == linked  # a link to a directory is fine


def test_a_run_into_a_bad_output_dir_fails_before_the_model_is_built(
    tmp_path, monkeypatch
):
    from fedlr.launch.local import run_in_process
    from fedlr.server_apps import runner

    def no_plan(*args, **kwargs):
        raise AssertionError("the plan must not be built")

    monkeypatch.setattr(runner, "build_plan", no_plan)
    a_file = tmp_path / "out"
    a_file.write_text("")
    config = {"method": "fedavg", "model": "cnn", "dataset": "digits"}
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run_in_process({**config, "output-dir": str(a_file)})
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        run_in_process({**config, "output-dir": str(dangling)})


# ---------------------------------------------------------- resume and layout
def test_checkpoint_arrays_are_checked_key_by_key():
    expected = {
        "a": ((4, 8), torch.float32),
        "b": ((8, 4), torch.float32),
    }
    good = {"a": torch.zeros(4, 8), "b": torch.zeros(8, 4)}
    check_checkpoint_arrays(good, expected)
    with pytest.raises(
        CheckpointLayoutError,
        match=r"do not fit this run's layout: 'a' has shape \(6, 8\) float32 in the "
        r"checkpoint, this run's layout \(4, 8\) float32",
    ):
        check_checkpoint_arrays({**good, "a": torch.zeros(6, 8)}, expected)
    with pytest.raises(CheckpointLayoutError, match=r"'b' .* float64 .* float32"):
        check_checkpoint_arrays({**good, "b": torch.zeros(8, 4).double()}, expected)
    with pytest.raises(CheckpointLayoutError, match=r"'b' \(\(8, 4\), float32\)|'b'"):
        check_checkpoint_arrays({"a": good["a"]}, expected)
    with pytest.raises(CheckpointLayoutError, match=r"'c' .* not an array of this"):
        check_checkpoint_arrays({**good, "c": torch.zeros(1)}, expected)


def _resaved(run_dir: Path, change) -> None:
    """Re-save the newest checkpoint with ``change`` applied to its arrays
    (``save_checkpoint`` writes a valid hash, as a hand-edited manifest would)."""
    payload = load_checkpoint(run_dir)
    change(payload["arrays"])
    save_checkpoint(run_dir, payload, keep=2)


def test_resuming_from_arrays_of_another_model_is_refused_before_round_1(tmp_path):
    """Vision FedAvg (no declared roles): the layout is the built model's."""
    from fedlr.launch.local import run_in_process

    config = {
        "method": "fedavg",
        "model": "cnn",
        "dataset": "digits",
        "num-partitions": 3,
        "num-server-rounds": 2,
        "seed": 3,
        "device": "cpu",
        "output-dir": str(tmp_path),
    }
    run_dir = run_in_process(config)
    key = sorted(load_checkpoint(run_dir)["arrays"])[-1]
    _resaved(run_dir, lambda arrays: arrays.update({key: torch.zeros(3, 3)}))
    resumed = {**config, "num-server-rounds": 3, "resume-from": str(run_dir)}
    with pytest.raises(CheckpointLayoutError) as info:
        run_in_process(resumed)
    message = str(info.value)
    assert f"'{key}' has shape (3, 3) float32 in the checkpoint" in message
    assert "do not fit this run's layout" in message
    assert pd.read_csv(run_dir / "results.csv")["round"].tolist() == [1, 2]
    # Another precision is another layout too.
    _resaved(
        run_dir,
        lambda arrays: arrays.update({k: v.double() for k, v in arrays.items()}),
    )
    with pytest.raises(CheckpointLayoutError, match=r"float64 in the checkpoint"):
        run_in_process(resumed)


def test_a_fedspec_run_resumes_at_its_grown_rank_and_another_rank_is_refused(
    tmp_path, assets
):
    from fedlr.launch.local import run_in_process
    from tests.conftest import tiny_run_config

    config = tiny_run_config(
        tmp_path,
        method="fedspec",
        **{"fedspec-threshold": 0.0, "fedspec-max-rank": 8, "local-steps": 1},
    )
    run_dir = run_in_process(config)
    saved = load_checkpoint(run_dir)
    assert saved["strategy"]["rank"] == 8  # 4 -> 6 -> 8
    a_key = next(k for k in saved["arrays"] if "lora_A" in k)
    assert saved["arrays"][a_key].shape[0] == 8
    resumed = {**config, "num-server-rounds": 3, "resume-from": str(run_dir)}
    run_in_process(resumed)  # the grown rank is this run's layout
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["round"].tolist() == [1, 2, 3]
    assert frame["rank"].tolist() == [6, 8, 8]

    # The same file with rank-4 factors (another run's) is refused.
    def to_rank_4(arrays):
        for key in [k for k in arrays if "lora_A" in k]:
            arrays[key] = arrays[key][:4]
        for key in [k for k in arrays if "lora_B" in k]:
            arrays[key] = arrays[key][:, :4]

    _resaved(run_dir, to_rank_4)
    manifest = json.loads((run_dir / MANIFEST).read_text())
    assert manifest["round"] == 3
    resumed = {**config, "num-server-rounds": 4, "resume-from": str(run_dir)}
    with pytest.raises(CheckpointLayoutError, match=r"\(4, 32\) float32 in the "):
        run_in_process(resumed)


def test_final_arrays_on_a_full_disk_leave_no_partial_file(tmp_path, monkeypatch):
    import errno as _errno

    import torch

    import fedlr.runs.checkpoint as checkpoint
    from fedlr.errors import CheckpointWriteError

    real = checkpoint.os.write
    calls = {"n": 0}

    def full_after_first_chunk(fd, data):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(_errno.ENOSPC, "No space left on device")
        return real(fd, data)

    arrays = {"w": torch.randn(600, 600)}  # 1.44 MB: more than one 1 MiB chunk
    monkeypatch.setattr(checkpoint.os, "write", full_after_first_chunk)
    with pytest.raises(CheckpointWriteError, match="no space left writing") as info:
        checkpoint.save_arrays(tmp_path / "final_arrays.pt", arrays)
    assert "no partial file was left" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(checkpoint.os, "write", real)
    checkpoint.save_arrays(tmp_path / "final_arrays.pt", arrays)
    assert torch.equal(torch.load(tmp_path / "final_arrays.pt")["w"], arrays["w"])
