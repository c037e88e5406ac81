"""Slow: the causal-LM task through the real `flwr run` CLI (SuperLink, Ray).

The in-process tests (tests/strategies/test_causal_lm_rounds.py) cover every
method; this one checks that the decoder task survives the deployment path:
the run config travels to Ray workers, the warmed-up tiny-llama and the
instruction data load there, adapters of all-linear targets (LLaMA's Linear,
GPT-2's Conv1D) cross the wire both ways, and the server's evaluation writes
perplexity and exact match.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

LM = {
    "dataset": "arith-instruct",
    "num-server-rounds": 2,
    "local-steps": 6,
    "batch-size": 8,
    "lr": 0.01,
    "vera-lr": 0.05,
    "vera-rank": 16,
    "lora-rank": 4,
    "lora-alpha": 8.0,
    "max-length": 96,
    "max-new-tokens": 6,
    "max-eval-examples": 48,
    "partitioner": "iid",
    "target-modules": "all-linear",
    "device": "cpu",
    "seed": 0,
}


@pytest.mark.early(seconds=47)
@pytest.mark.parametrize(
    ("method", "model"),
    [
        ("fedex-lora", "tiny-llama"),
        ("vera-fedex", "tiny-llama"),
        ("fedex-lora", "tiny-gpt2"),
    ],
)
def test_causal_lm_task_runs_under_flwr_run(method, model, tmp_path, flwr_home):
    from fedlr.launch.flwr_run import flwr_run

    output = tmp_path / "out"
    config = {**LM, "method": method, "model": model, "output-dir": str(output)}
    outcome = flwr_run(
        ROOT,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": 2},
        timeout=600,
    )
    assert outcome.status == "finished:completed", (method, model)
    (results,) = output.glob("*/results.csv")
    frame = pd.read_csv(results)
    assert frame["round"].tolist() == [1, 2]
    assert (frame["clients"] == 2).all() and (frame["dropped"] == 0).all()
    for _, row in frame.iterrows():
        assert math.isclose(row["perplexity"], math.exp(row["loss"]), rel_tol=1e-9)
        assert row["accuracy"] == row["exact-match"]
        # exact match over 48 problems is a multiple of 1/48
        assert abs(row["exact-match"] * 48 - round(row["exact-match"] * 48)) < 1e-9
    summary = json.loads((results.parent / "summary.json").read_text())
    assert summary["status"] == "finished"
    before, after = summary["initial-perplexity"], summary["final-perplexity"]
    assert math.isfinite(after) and 1.0 < after < before, (method, model, before, after)
    if model == "tiny-llama":  # warmed up: the tuned template lowers it a lot
        assert after < 0.5 * before, (method, before, after)
