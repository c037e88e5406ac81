"""Real rounds of the causal-LM task, in process (no Ray): folds, metrics, options.

The acceptance check of the Conv1D FedEx fold: after a real round of
``fedex-lora`` on the tiny GPT-2 (every adapted layer a ``Conv1D``), each
folded base weight equals ``W0 + s * sum_i w_i (B_i A_i)^T - s * (B A)^T`` of
the published factors, i.e. the global layer's effective weight is the
weighted mean of the clients' effective weights, to 1e-6 in float32.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from flwr.app import Message

from fedlr.flower.records import record_to_state
from fedlr.launch.local import run_in_process
from fedlr.runs.checkpoint import load_checkpoint
from fedlr.strategies.registry import get_method, registered_methods, resolve
from fedlr.tasks.text import text_task
from fedlr.wire import protocol

F64 = torch.float64

LM = {
    "model": "tiny-gpt2",
    "dataset": "arith-instruct",
    "num-partitions": 2,
    "partitioner": "iid",
    "num-server-rounds": 1,
    "local-steps": 2,
    "batch-size": 4,
    "max-length": 96,
    "max-eval-examples": 8,
    "max-new-tokens": 4,
    "lora-rank": 4,
    "lora-alpha": 8.0,
    "target-modules": "all-linear",
    "seed": 3,
}


def _capture() -> tuple[list[dict[str, Any]], Any]:
    seen: list[dict[str, Any]] = []

    def hook(node_id: int, instruction: Message, reply: Message) -> Message:
        if instruction.metadata.message_type.startswith("train"):
            content = reply.content
            seen.append(
                {
                    "sent": record_to_state(
                        instruction.content.array_records["arrays"]
                    ),
                    "arrays": record_to_state(content.array_records["arrays"]),
                    "examples": float(
                        content.metric_records["metrics"][protocol.NUM_EXAMPLES]
                    ),
                }
            )
        return reply

    return seen, hook


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_fedex_fold_on_gpt2_conv1d_after_a_real_round(
    precision: str, tmp_path: Path
) -> None:
    """The server folds in float32 also for a bfloat16 base (which travels as
    float32, exactly: numpy has no bfloat16); nodes round it when loading."""
    config = {
        **LM,
        "method": "fedex-lora",
        "robust": "none",  # the fold of the clients' factors alone
        "precision": precision,
        "output-dir": str(tmp_path),
    }
    seen, hook = _capture()
    run_dir = run_in_process(config, reply_hook=hook)
    new = load_checkpoint(run_dir)["arrays"]
    layout = text_task(resolve(config).run).build_lora_model().layout
    conv1d = [m for m in layout.modules if m.fan_in_fan_out]
    # all-linear on GPT-2: c_attn, c_proj (attention and MLP), c_fc; all Conv1D
    assert len(conv1d) == len(layout.modules) == 8
    assert len(seen) == 2
    weights = torch.tensor([s["examples"] for s in seen], dtype=F64)
    weights /= weights.sum()
    for m in layout.modules:
        sent = seen[0]["sent"][m.base_key]
        assert sent.dtype == torch.float32  # bfloat16 values travel as float32
        if precision == "bfloat16":
            assert torch.equal(sent.to(torch.bfloat16).to(torch.float32), sent)
        w0 = sent.to(F64)  # round 1: every node got W0
        assert torch.equal(seen[1]["sent"][m.base_key], seen[0]["sent"][m.base_key])
        assert w0.shape == (m.d_in, m.d_out)  # Conv1D stores (in, out)
        mean = sum(
            float(w) * (s["arrays"][m.b_key].to(F64) @ s["arrays"][m.a_key].to(F64))
            for w, s in zip(weights, seen, strict=True)
        )
        assert isinstance(mean, torch.Tensor)
        published = new[m.b_key].to(F64) @ new[m.a_key].to(F64)
        want = w0 + m.scaling * (mean - published).T
        got = new[m.base_key]
        assert got.dtype == torch.float32
        err = float((got.to(F64) - want).abs().max() / want.abs().max())
        assert err < 1e-6, (m.name, err)
        # the fold is not trivial: the residual moved the weight
        assert float((got.to(F64) - w0).abs().max()) > 1e-5
        # the untransposed fold would be wrong (a Conv1D layer of GPT-2 here
        # is never square, so its shape already differs)
        assert mean.T.shape == w0.shape != mean.shape or m.d_in == m.d_out


@pytest.mark.parametrize("method", ["fedavg-lora", "vera-fedex"])
def test_lm_round_reports_perplexity_and_exact_match(
    method: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    config = {
        **LM,
        "method": method,
        "model": "tiny-llama",
        "target-modules": "auto",
        "output-dir": str(tmp_path),
        "vera-rank": 16,
    }
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_dir = run_in_process(config)
    frame = pd.read_csv(run_dir / "results.csv")
    row = frame.iloc[-1]
    # the round's line names the metric for what it is, once
    line = next(m for m in caplog.messages if m.startswith("fedlr [round 1/"))
    assert line.split("] ")[1].startswith("exact-match ")
    assert "accuracy" not in line and line.count("exact-match") == 1
    assert "perplexity" in line
    assert math.isclose(row["perplexity"], math.exp(row["loss"]), rel_tol=1e-9)
    assert row["accuracy"] == row["exact-match"]
    assert 0.0 <= row["exact-match"] <= 1.0
    # exact match over 8 examples is a multiple of 1/8
    assert abs(row["exact-match"] * 8 - round(row["exact-match"] * 8)) < 1e-9
    assert 1.0 < row["perplexity"] < 512  # at most the vocabulary size


def test_bf16_and_gradient_checkpointing_train_the_adapters_only() -> None:
    config = resolve(
        {
            **LM,
            "method": "fedavg-lora",
            "model": "tiny-llama",
            "target-modules": "auto",
            "precision": "bfloat16",
            "gradient-checkpointing": True,
        }
    ).run
    task = text_task(config)
    lm = task.build_lora_model()
    base = {k: v.detach().clone() for k, v in lm.pristine_base.items()}
    assert all(v.dtype == torch.bfloat16 for v in base.values())
    assert lm.model.base_model.model.is_gradient_checkpointing
    before = {
        k: v.detach().clone() for k, v in lm.model.named_parameters() if v.requires_grad
    }
    assert before and all(v.dtype == torch.float32 for v in before.values())
    from fedlr.client.train import TrainSettings, train_steps

    data = task.partition(0, 2)
    loss = train_steps(
        lm.model,
        data,
        TrainSettings(local_steps=2, lr=1e-2, batch_size=4),
        seed=0,
        device=torch.device("cpu"),
    )
    assert math.isfinite(loss)
    params = dict(lm.model.named_parameters())
    moved = [k for k, v in before.items() if not torch.equal(params[k], v)]
    assert len(moved) == len(before)  # every LoRA factor (B leaves zero first)
    for key, value in base.items():
        assert torch.equal(params[key], value)


TEXT_KINDS = ("lora", "vera", "sorf-vera")
LM_METHODS = sorted(
    s.name for s in registered_methods() if s.payload.name in TEXT_KINDS
)


def test_every_lora_and_vera_method_is_covered() -> None:
    """The list is the registry's: every text payload kind has methods in it."""
    kinds = {get_method(name).payload.name for name in LM_METHODS}
    assert kinds == set(TEXT_KINDS) and len(LM_METHODS) >= 15
    fast = {get_method(name).payload.name for name in FAST_LM_METHODS}
    assert set(LM_METHODS) >= FAST_LM_METHODS and fast == set(TEXT_KINDS)


#: One method per text payload kind and aggregation style runs in the fast
#: stage (`make unit`); every other method's round (8-43 s each on 2 cores)
#: runs in the slow stage, so the fast stage stays near its 4-minute budget.
FAST_LM_METHODS = frozenset({"fedavg-lora", "fedex-lora", "fedavg-vera", "sorf-vera"})


@pytest.mark.parametrize(
    "method",
    [
        m if m in FAST_LM_METHODS else pytest.param(m, marks=pytest.mark.slow)
        for m in LM_METHODS
    ],
)
def test_every_text_method_instruction_tunes_tiny_llama(
    method: str, tmp_path: Path
) -> None:
    """One real round of each LoRA/VeRA-family method on the causal-LM task:
    the response perplexity falls below the base model's."""
    config = {
        **LM,
        "method": method,
        "model": "tiny-llama",
        "target-modules": "auto",
        "local-steps": 6,
        "lr": 0.01,
        "vera-lr": 0.05,
        "vera-rank": 16,
        # scaffold-lora's plain SGD: 0.5 (its default, for the classifier)
        # raises tiny-llama's perplexity (80.7 -> 92.0); 0.1 lowers it (51.6)
        "scaffold-lr": 0.1,
        "output-dir": str(tmp_path),
    }
    run_dir = run_in_process(config)
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["initial-perplexity"], summary["final-perplexity"]
    assert math.isfinite(after) and 1.0 < after < before, (before, after)
    assert 0.0 <= summary["final-exact-match"] <= 1.0
