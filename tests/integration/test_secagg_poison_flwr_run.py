"""One poisoned secure sum under the real ``flwr run`` (issue 35, item 4).

FedAvg-LoRA on three nodes with ``secure-aggregation = true`` and the
default aggregate check, four rounds; partition 0's node runs a mod outside
fedlr's (as a malicious node runs its own code). In round 2 it adds 7 to the
weight entry of its masked vector: the sum does not unmask, the round is
rejected by name and round 3 runs (nothing one client sends ends the run).
In round 4 it adds 2**31 to one entry: the aggregate check rejects the
round. Rounds 1 and 3 are accepted (their check ratios are the clean
margin), and the final global arrays are round 3's, bit for bit.
"""

from __future__ import annotations

import math
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

_POISON_APP = '''"""fedlr's ClientApp; partition 0 poisons round 3's masked vector."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import bytes_to_ndarray, ndarray_to_bytes

from fedlr.launch.client_app import refuse_bad_instructions, train as fedlr_train
from fedlr.client_apps.secagg import secagg_mod


def poison(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    config = msg.content.config_records.get("config", {})
    attacker = int(ctxt.node_config["partition-id"]) == 0
    number = int(config.get("server-round", 0))
    reply = call_next(msg, ctxt)
    out = reply.content.config_records.get("secaggplus_configs", {})
    if attacker and number in (2, 4) and "masked_params" in out:
        vector = [bytes_to_ndarray(b) for b in out["masked_params"]]
        if number == 2:
            vector[0] = vector[0] + 7  # the weight entry
        else:
            vector[1].flat[0] += 2**31
        out["masked_params"] = [ndarray_to_bytes(a) for a in vector]
    return reply


app = ClientApp(mods=[refuse_bad_instructions])


@app.train(mods=[poison, secagg_mod])
def train(message: Message, context: Context) -> Message:
    return fedlr_train(message, context)
'''


def _poison_app(root: Path) -> Path:
    """fedlr's ServerApp and the poisoning ClientApp as a user's own app."""
    package = root / "poisoning"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "client_app.py").write_text(_POISON_APP)
    (table,) = _CONFIG_TABLE.findall((ROOT / "pyproject.toml").read_text())
    (root / "pyproject.toml").write_text(
        "[build-system]\n"
        'requires = ["hatchling"]\n'
        'build-backend = "hatchling.build"\n\n'
        "[project]\n"
        'name = "poisoning"\n'
        'version = "1.0.0"\n'
        "dependencies = []\n\n"
        "[tool.flwr.app]\n"
        'publisher = "fedlr-tests"\n\n'
        "[tool.flwr.app.components]\n"
        'serverapp = "fedlr.server_apps.app:app"\n'
        'clientapp = "poisoning.client_app:app"\n\n'
        "[tool.flwr.app.config]\n" + table
    )
    return root


def _arrays(path: Path) -> dict[str, torch.Tensor]:
    payload = torch.load(path, weights_only=True)
    return payload.get("arrays", payload)


@pytest.mark.early(seconds=86)
def test_a_poisoned_masked_vector_is_rejected_under_flwr_run(
    tmp_path, assets, flwr_home
):
    from fedlr.launch.flwr_run import flwr_run

    app = _poison_app(tmp_path / "app")
    config = tiny_run_config(
        tmp_path / "out",
        method="fedavg-lora",
        **{"num-server-rounds": 4, "secure-aggregation": True},
    )
    config.pop("num-partitions")  # the node config says how many (3)
    outcome = flwr_run(
        app,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": NODES},
        timeout=600,
    )
    assert outcome.status == "finished:completed"
    (run_dir,) = sorted(p.parent for p in (tmp_path / "out").glob("*/results.csv"))
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["rejected-rounds"].tolist() == [0, 1, 1, 2]
    checks = frame["secagg-check"].tolist()
    assert checks[0] < 0.5 and checks[2] < 4.0  # the clean rounds pass
    assert math.isnan(checks[1])  # not unmasked: nothing to compare
    assert checks[3] > 4.0 and math.isfinite(checks[3])
    third = _arrays(run_dir / "checkpoint-00003.pt")
    final = _arrays(run_dir / "final_arrays.pt")
    assert third.keys() == final.keys()
    assert all(torch.equal(third[k], final[k]) for k in final)
    print(
        f"secure run, secagg-check per round: {checks} (bounds 0.5 x the global "
        "norm in round 1, 4 x the median after)"
    )
    shutil.rmtree(tmp_path / "app")
