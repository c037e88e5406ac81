"""Secure aggregation (SecAgg+) under the real ``flwr run`` (Ray simulation).

1. FedAvg-LoRA on three nodes with ``secure-aggregation = true`` under
   ``flwr run``, against the same run plain in process: round 1's new
   global arrays (its checkpoint) equal the plain weighted mean within the
   round's stated bound (``secagg-bound``), the clients' training losses are
   identical, the final accuracies agree, and the costs (bytes, seconds per
   round) are printed.
2. A node that fails after sharing its keys (partition 0 raises at the
   masked-vector stage, in a ClientApp that wraps fedlr's): the round goes
   on with the other two, and the global arrays equal those of a plain
   in-process run in which partition 0's reply is lost, within the bound.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.conftest import ROOT, tiny_run_config

pytestmark = pytest.mark.slow

NODES = 3
_CONFIG_TABLE = re.compile(r"\[tool\.flwr\.app\.config\]\n(.*?)(?:\n\[|\Z)", re.DOTALL)

_FAILING_APP = '''"""fedlr's ClientApp; partition 0 fails after sharing its keys."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from fedlr.launch.client_app import refuse_bad_instructions, train as fedlr_train
from fedlr.client_apps.secagg import secagg_mod


def fail_at_masked_vector(
    msg: Message, ctxt: Context, call_next: ClientAppCallable
) -> Message:
    configs = msg.content.config_records.get("secaggplus_configs", {})
    if int(ctxt.node_config["partition-id"]) == 0 and "ctxts" in configs:
        raise RuntimeError("partition 0 fails after sharing its keys")
    return call_next(msg, ctxt)


app = ClientApp(mods=[refuse_bad_instructions])


@app.train(mods=[fail_at_masked_vector, secagg_mod])
def train(message: Message, context: Context) -> Message:
    return fedlr_train(message, context)
'''


def _config(out: Path, secure: bool) -> dict:
    config = tiny_run_config(
        out,
        method="fedavg-lora",
        **{"num-server-rounds": 2, "secure-aggregation": secure},
    )
    config.pop("num-partitions")  # the node config says how many (3)
    return config


def _run_dir(out: Path) -> Path:
    (run_dir,) = sorted(p.parent for p in out.glob("*/results.csv"))
    return run_dir


def _arrays(path: Path) -> dict[str, torch.Tensor]:
    payload = torch.load(path, weights_only=True)
    return payload.get("arrays", payload)


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    assert a.keys() == b.keys()
    gap = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    scale = max(float(b[k].abs().max()) for k in b)
    return gap, scale


@pytest.mark.early(seconds=64)
def test_secure_fedavg_lora_equals_plain_within_the_bound(tmp_path, assets, flwr_home):
    from fedlr.launch.flwr_run import flwr_run
    from fedlr.launch.local import run_in_process

    outcome = flwr_run(
        ROOT,
        flwr_home=flwr_home,
        run_config=_config(tmp_path / "secure", True),
        federation_config={"num-supernodes": NODES},
        timeout=600,
    )
    assert outcome.status == "finished:completed"
    # The plain run in process: the same apps, the same numbers as `flwr run`
    # (tests/integration/test_simulation.py), one flwr run start-up less.
    plain_config = {**_config(tmp_path / "plain", False), "num-partitions": NODES}
    runs = {True: _run_dir(tmp_path / "secure"), False: run_in_process(plain_config)}
    plain = pd.read_csv(runs[False] / "results.csv")
    secure = pd.read_csv(runs[True] / "results.csv")
    assert secure["clients"].tolist() == [NODES, NODES]
    assert (secure["secagg-clipped"] == 0).all()

    # Round 1: both rounds start from the same arrays and the clients train
    # identically; only the aggregation differs.
    # (the secure loss is the secure sum's example-weighted mean, fixed point 1e-6)
    assert secure["train-loss"][0] == pytest.approx(plain["train-loss"][0], abs=1e-6)
    bound = float(secure["secagg-bound"][0])
    eps = torch.finfo(torch.float32).eps
    gap, scale = _gap(
        _arrays(runs[True] / "checkpoint-00001.pt"),
        _arrays(runs[False] / "checkpoint-00001.pt"),
    )
    assert 0 < gap <= bound + 2 * eps * scale
    assert bound < 1e-4
    # Round 2 starts from arrays within the bound: the run's results agree.
    final_gap, final_scale = _gap(
        _arrays(runs[True] / "final_arrays.pt"),
        _arrays(runs[False] / "final_arrays.pt"),
    )
    assert final_gap <= 1e-3 * final_scale
    assert secure["accuracy"].tolist() == pytest.approx(
        plain["accuracy"].tolist(), abs=0.02
    )
    # What it costs: every stage's bytes (keys, shares, int64 masked vector).
    up = secure["bytes-up"] / plain["bytes-up"]
    down = secure["bytes-down"] / plain["bytes-down"]
    assert (up > 1.5).all() and (down > 1.0).all()
    for name, frame in (("plain", plain), ("secure", secure)):
        print(
            f"{name}: bytes-up {frame['bytes-up'].tolist()} bytes-down "
            f"{frame['bytes-down'].tolist()} train-seconds "
            f"{[round(s, 3) for s in frame['train-seconds']]} seconds "
            f"{[round(s, 3) for s in frame['seconds']]}"
        )


def _failing_app(root: Path) -> Path:
    """fedlr's ServerApp and the failing ClientApp as a user's own app."""
    package = root / "failing"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "client_app.py").write_text(_FAILING_APP)
    (table,) = _CONFIG_TABLE.findall((ROOT / "pyproject.toml").read_text())
    (root / "pyproject.toml").write_text(
        "[build-system]\n"
        'requires = ["hatchling"]\n'
        'build-backend = "hatchling.build"\n\n'
        "[project]\n"
        'name = "failing"\n'
        'version = "1.0.0"\n'
        "dependencies = []\n\n"
        "[tool.flwr.app]\n"
        'publisher = "fedlr-tests"\n\n'
        "[tool.flwr.app.components]\n"
        'serverapp = "fedlr.server_apps.app:app"\n'
        'clientapp = "failing.client_app:app"\n\n'
        "[tool.flwr.app.config]\n" + table
    )
    return root


def _lose_partition_0(partition, instruction, reply):
    return None if partition == 0 else reply


def test_a_node_failing_after_sharing_keys_is_tolerated(tmp_path, assets, flwr_home):
    from fedlr.launch.flwr_run import flwr_run
    from fedlr.launch.local import run_in_process

    app = _failing_app(tmp_path / "app")
    config = _config(tmp_path / "out", True)
    config["num-server-rounds"] = 1
    outcome = flwr_run(
        app,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": NODES},
        timeout=600,
    )
    assert outcome.status == "finished:completed"
    run_dir = _run_dir(tmp_path / "out")
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["clients"].tolist() == [NODES - 1]
    assert frame["dropped"].tolist() == [1]
    bound = float(frame["secagg-bound"][0])

    reference = {**config, "output-dir": str(tmp_path / "ref")}
    reference.update({"secure-aggregation": False, "num-partitions": NODES})
    ref_dir = run_in_process(reference, reply_hook=_lose_partition_0)
    gap, scale = _gap(
        _arrays(run_dir / "final_arrays.pt"), _arrays(ref_dir / "final_arrays.pt")
    )
    eps = torch.finfo(torch.float32).eps
    assert 0 < gap <= bound + 2 * eps * scale
    shutil.rmtree(tmp_path / "app")


def test_distributed_dp_with_a_node_failing_after_its_keys(tmp_path, assets, flwr_home):
    """Distributed client-level DP under SecAgg+ through `flwr run`: partition
    0 fails at the masked-vector stage of every round; the run completes, each
    round sums the 2 survivors' noised updates, and the epsilon is the one an
    in-process run with the same dropout reports (the Skellam accountant for
    k = 2 survivors of threshold 2)."""
    from fedlr.launch.flwr_run import flwr_run
    from fedlr.launch.local import run_in_process

    app = _failing_app(tmp_path / "app")
    config = _config(tmp_path / "out", True)
    config.update(
        {
            "client-dp-clip": 1.0,
            "client-dp-noise-multiplier": 1.0,
            "secagg-clipping-range": 16.0,
        }
    )
    outcome = flwr_run(
        app,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": NODES},
        timeout=600,
    )
    assert outcome.status == "finished:completed"
    frame = pd.read_csv(_run_dir(tmp_path / "out") / "results.csv")
    assert frame["clients"].tolist() == [NODES - 1, NODES - 1]
    assert (frame["secagg-clipped"] == 0).all()
    epsilons = frame["client-dp-epsilon"].tolist()
    assert 0 < epsilons[0] < epsilons[1] < 100

    reference = {**config, "output-dir": str(tmp_path / "ref"), "num-partitions": NODES}
    ref_dir = run_in_process(reference, reply_hook=_lose_partition_0)
    in_process = pd.read_csv(ref_dir / "results.csv")["client-dp-epsilon"].tolist()
    assert epsilons == pytest.approx(in_process, rel=1e-9)
    seconds = [round(s, 2) for s in frame["seconds"]]
    print(
        f"distributed DP under flwr run: epsilon {epsilons}, bytes-up "
        f"{frame['bytes-up'].tolist()}, seconds {seconds}"
    )
    shutil.rmtree(tmp_path / "app")
