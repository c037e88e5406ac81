"""Sample-level DP-SGD (fedlr.privacy.dp_sgd): clipping, accounting, budget, runs.

* Opacus's per-example gradients on real LoRA layers (``nn.Linear`` targets of
  a tiny BERT classifier, ``Conv1D`` targets of a tiny GPT-2) equal the
  gradients of one-example losses computed by plain autograd, and the clipped
  sum is ``sum_i min(1, C / ||g_i||) g_i`` with every clipped ``||g_i|| <= C``;
* the ``epsilon`` a node reports, and the round's ``dp-epsilon`` column (the
  largest), equal Opacus's accountants run independently on the same
  ``(sigma, q, steps)``; with a budget and no multiplier the run ends within it;
* a node past its budget refuses with an error naming ``dp-epsilon``;
* fedavg-lora, ffa-lora and fedsvd run end to end in process;
* the same seed trains the same adapters.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from typing import Any

import pandas as pd
import pytest
import torch
from flwr.app import Message, RecordDict
from opacus.accountants import PRVAccountant, RDPAccountant
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.utils import logging as hf_logging

from fedlr.adapters import LoraSettings, apply_lora
from fedlr.client.train import TrainSettings, train_steps
from fedlr.errors import (
    ConfigError,
    NoValidRepliesError,
    PrivacyBudgetError,
    PrivacyUnsupportedError,
)
from fedlr.launch.local import run_in_process
from fedlr.privacy.accounting import epsilon
from fedlr.privacy.dp_sgd import PrivateLoop, node_history, sample_mean_loss
from fedlr.privacy.node_policy import NodePolicy
from fedlr.privacy.settings import DpSgdSettings, PrivacyConfig, default_delta
from fedlr.strategies.registry import resolve
from tests.conftest import ROOT, tiny_run_config

hf_logging.set_verbosity_error()


# ------------------------------------------------------------------ models
def _gpt2_lora() -> torch.nn.Module:
    """A tiny random GPT-2 with LoRA on its ``Conv1D`` layers."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=100,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: fan_in_fan_out for Conv1D
        view = apply_lora(
            GPT2LMHeadModel(config),
            LoraSettings(rank=2, alpha=4.0, target_modules=("c_attn", "c_proj")),
        )
    return view.model


def _bert_lora() -> torch.nn.Module:
    """A tiny random BERT classifier with LoRA on ``nn.Linear`` and its head."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    view = apply_lora(
        BertForSequenceClassification(config),
        LoraSettings(rank=2, alpha=4.0, target_modules=("query", "value")),
        head_modules=("classifier",),
    )
    return view.model


def _batch(kind: str, size: int = 6, length: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (size, length), generator=g)
    if kind == "gpt2":
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt that is not predicted
        return {"input_ids": ids, "labels": labels}
    labels = torch.randint(0, 3, (size,), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


class _Data:
    """TrainData over fixed batches' rows (no tokenizer)."""

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows["input_ids"].shape[0])

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        return {k: v[list(indices)] for k, v in self.rows.items()}


# ------------------------------------------------------------------ clipping
@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_per_example_gradients_are_real_and_clipped_to_the_bound(kind):
    model = _gpt2_lora() if kind == "gpt2" else _bert_lora()
    model.train()  # Opacus records in training mode; every dropout is 0
    batch = _batch(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    size = batch["input_ids"].shape[0]
    # 1. Each example's gradient by plain autograd, one example at a time.
    reference = []
    for i in range(size):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        loss = sample_mean_loss(model(**one).logits, one["labels"])
        reference.append(torch.autograd.grad(loss, params))
    norms = torch.stack(
        [torch.sqrt(sum(g.double().square().sum() for g in gs)) for gs in reference]
    )
    clip = float(norms.median())  # about half the examples are clipped
    # 2. Opacus's per-example gradients through the DP-SGD loop's hooks.
    control = PrivateLoop(
        DpSgdSettings(max_grad_norm=clip, noise_multiplier=1.0), RecordDict()
    )
    settings = TrainSettings(local_steps=1, lr=0.1, batch_size=size)
    private, _ = control.make_private(
        model, torch.optim.SGD(params, lr=0.1), _Data(batch), settings, seed=0
    )
    loss = control.loss(model(**batch), batch)
    private.zero_grad()
    loss.backward()
    for j, p in enumerate(params):
        got = p.grad_sample
        want = torch.stack([reference[i][j] for i in range(size)])
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), j
    # 3. Clipping: each clipped example within C, the sum as the formula says.
    private.clip_and_accumulate()
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    clipped_norms = factors * norms
    assert float(clipped_norms.max()) <= clip * (1 + 1e-6)
    assert int((norms > clip * (1 + 1e-6)).sum()) >= 1  # some were clipped
    for j, p in enumerate(params):
        want = sum(float(factors[i]) * reference[i][j] for i in range(size))
        assert torch.allclose(p.summed_grad, want, atol=1e-6, rtol=1e-4)
    control.stop()
    assert not hasattr(model, "autograd_grad_sample_hooks")
    assert not any(hasattr(p, "grad_sample") for p in params)


def test_causal_per_example_loss_is_the_models_loss_for_one_example():
    model = _gpt2_lora().eval()
    batch = _batch("gpt2", size=1)
    out = model(**batch)
    assert torch.allclose(sample_mean_loss(out.logits, batch["labels"]), out.loss)


def test_unsupported_labels_are_refused_by_name():
    with pytest.raises(PrivacyUnsupportedError, match="per-example losses"):
        sample_mean_loss(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4))


# ------------------------------------------------------------------ reproducible
def _train(seed: int, *, reproducible: bool = True) -> dict[str, torch.Tensor]:
    model = _gpt2_lora()
    state = RecordDict()
    settings = DpSgdSettings(
        max_grad_norm=0.5, noise_multiplier=1.0, reproducible=reproducible
    )
    policy = NodePolicy(dp_allow_reproducible_noise=True)
    control = PrivateLoop(settings, state, policy)
    train_steps(
        model,
        _Data(_batch("gpt2", size=12)),
        TrainSettings(local_steps=3, lr=0.05, batch_size=4),
        seed=seed,
        device=torch.device("cpu"),
        control=control,
    )
    assert node_history(state) == [(1.0, 4 / 12, 3)]
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}


def test_the_same_seed_trains_the_same_adapters_and_another_does_not():
    """Only with reproducible noise asked for *and* allowed by the node."""
    first, again, other = _train(3), _train(3), _train(4)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_secure_noise_differs_between_runs_of_the_same_seed():
    """The default: noise and batches from OS-seeded generators."""
    first, again = _train(3, reproducible=False), _train(3, reproducible=False)
    assert any(not torch.equal(first[k], again[k]) for k in first)


# ------------------------------------------------------------------ budget
def test_a_node_past_its_budget_refuses_naming_dp_epsilon():
    state = RecordDict()
    settings = DpSgdSettings(max_grad_norm=1.0, noise_multiplier=1.5, epsilon=2.0)
    loop = TrainSettings(local_steps=5, lr=0.1, batch_size=4)
    spent = []
    model = _gpt2_lora()
    params = [p for p in model.parameters() if p.requires_grad]
    data = _Data(_batch("gpt2", size=40))
    for _ in range(50):
        control = PrivateLoop(settings, state)
        try:
            control.make_private(
                model, torch.optim.SGD(params, lr=0.1), data, loop, seed=0
            )
        except PrivacyBudgetError as exc:
            assert "dp-epsilon 2 would be exceeded" in str(exc)
            break
        control.taken = 5  # the round's steps, as the loop counts them
        control.stop()
        spent.append(control.spent())
    else:
        pytest.fail("the node never refused")
    # It trained while the next round fitted, and refused the one that did not.
    history = node_history(state)
    assert len(history) == len(spent) >= 3 and spent[-1] <= 2.0
    beyond = epsilon([*history, (1.5, 0.1, 5)], default_delta(40), settings.accountant)
    assert beyond > 2.0


def test_refused_rounds_reach_the_server_as_named_errors(tmp_path, assets):
    config = tiny_run_config(
        tmp_path,
        method="fedavg-lora",
        **{
            "num-server-rounds": 1,
            "dp-max-grad-norm": 1.0,
            "dp-noise-multiplier": 0.5,
            "dp-epsilon": 0.1,
        },
    )
    with pytest.raises(NoValidRepliesError) as caught:
        run_in_process(config)
    text = str(caught.value)
    # an error reply naming the budget from each of the 3 nodes, not an exception
    assert text.count("client error: dp-epsilon 0.1 would be exceeded") == 3
    assert "PrivacyBudgetError" not in text and "Traceback" not in text


# ------------------------------------------------------------------ runs
def _independent_epsilon(kind: str, rounds: list[tuple[float, float, int]], delta):
    accountant = RDPAccountant() if kind == "rdp" else PRVAccountant()
    for sigma, q, steps in rounds:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accountant.get_epsilon(delta=delta)


@pytest.mark.parametrize(
    ("method", "privacy"),
    [
        ("fedavg-lora", {"dp-noise-multiplier": 1.1, "dp-accountant": "rdp"}),
        ("ffa-lora", {"dp-noise-multiplier": 0.9, "dp-accountant": "prv"}),
        ("fedsvd", {"dp-epsilon": 3.0, "dp-delta": 1e-6}),
        # a loss term that reads no data: the accountant is unchanged
        ("fedprox-lora", {"dp-noise-multiplier": 1.0, "proximal-mu": 0.5}),
    ],
)
def test_runs_report_the_epsilon_opacus_computes(tmp_path, assets, method, privacy):
    seen: list[dict[str, float]] = []

    def hook(partition: int, message: Message, reply: Message) -> Message:
        if message.metadata.message_type.startswith("train"):
            metrics = dict(reply.content["metrics"])
            metrics["round"] = int(message.content["config"]["server-round"])
            metrics["partition"] = partition
            seen.append(metrics)
        return reply

    settings = {"dp-max-grad-norm": 1.0, **privacy}
    config = tiny_run_config(tmp_path, method=method, **settings)
    privacy = {k: v for k, v in privacy.items() if k.startswith("dp-")}
    run_dir = run_in_process(config, reply_hook=hook)
    frame = pd.read_csv(run_dir / "results.csv")
    assert (frame["clients"] == 3).all() and (frame["dropped"] == 0).all()
    assert frame["accuracy"].between(0, 1).all()
    kind = privacy.get("dp-accountant", "prv")
    steps = config["local-steps"]
    history: dict[int, list[tuple[float, float, int]]] = {}
    for reply in sorted(seen, key=lambda r: (r["round"], r["partition"])):
        n = int(reply["num-examples"])
        q = config["batch-size"] / n
        assert reply["dp-sample-rate"] == pytest.approx(q, rel=1e-12)
        delta = privacy.get("dp-delta", min(1e-5, 1 / (10 * n)))
        assert reply["dp-delta"] == pytest.approx(delta, rel=1e-12)
        sigma = privacy.get("dp-noise-multiplier", reply["dp-noise-multiplier"])
        assert reply["dp-noise-multiplier"] == pytest.approx(sigma, rel=1e-12)
        history.setdefault(reply["partition"], []).append((sigma, q, steps))
        want = _independent_epsilon(kind, history[reply["partition"]], delta)
        assert reply["dp-epsilon-spent"] == pytest.approx(want, rel=1e-9)
        reply["want"] = want
    for server_round, row in frame.set_index("round").iterrows():
        largest = max(r["want"] for r in seen if r["round"] == server_round)
        assert row["dp-epsilon"] == pytest.approx(largest, rel=1e-9)
    assert frame["dp-epsilon"].is_monotonic_increasing
    assert frame["client-dp-epsilon"].isna().all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dp-epsilon"] == pytest.approx(frame["dp-epsilon"].max())
    if "dp-epsilon" in privacy:  # sigma from the budget: spent within it
        budget = privacy["dp-epsilon"]
        assert budget * 0.95 < summary["dp-epsilon"] <= budget
        assert not math.isnan(summary["dp-epsilon"])


def test_a_causal_lm_round_on_gpt2_conv1d_layers_is_private(tmp_path):
    sizes: list[int] = []

    def hook(partition: int, message: Message, reply: Message) -> Message:
        if message.metadata.message_type.startswith("train"):
            sizes.append(int(reply.content["metrics"]["num-examples"]))
        return reply

    config = {
        "method": "fedavg-lora",
        "model": "tiny-gpt2",  # every adapted layer a Conv1D
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
        "device": "cpu",
        "output-dir": str(tmp_path),
        "dp-max-grad-norm": 1.0,
        "dp-noise-multiplier": 1.0,
    }
    frame = pd.read_csv(run_in_process(config, reply_hook=hook) / "results.csv")
    assert frame["clients"].tolist() == [2] and frame["dropped"].tolist() == [0]
    want = max(
        _independent_epsilon("prv", [(1.0, 4 / n, 2)], min(1e-5, 1 / (10 * n)))
        for n in sizes
    )
    assert frame["dp-epsilon"].iloc[0] == pytest.approx(want, rel=1e-9)


# ------------------------------------------------------------------ config
def test_dp_sgd_is_refused_for_a_vera_method_by_name():
    with pytest.raises(PrivacyUnsupportedError, match="dp-max-grad-norm: DP-SGD"):
        resolve({"method": "fedavg-vera", "dp-max-grad-norm": 1.0, "dp-epsilon": 4.0})


DP = {"dp-max-grad-norm": 1.0, "dp-epsilon": 4.0}
HETERO = {"client-ranks": "4,8"}


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"method": "scaffold-lora"}, "SCAFFOLD's control-variate"),
    ],
)
def test_dp_sgd_with_a_gradient_change_is_refused_at_config(config, named):
    # At configuration time, not in every client's first round.
    with pytest.raises(PrivacyUnsupportedError, match=named) as caught:
        resolve({**config, **DP})
    assert "dp-max-grad-norm: DP-SGD clips" in str(caught.value)
    resolve(config)  # the same method without DP-SGD is fine


@pytest.mark.parametrize(
    "config",
    [
        {"method": "fedprox-lora", "proximal-mu": 0.0},  # no proximal term
        {"method": "hetlora", **HETERO, "hetlora-prune-gamma": 1.0},  # no pruning
        {"method": "fedavg-lora"},
        # loss terms that read no data: added after the clipping and noise
        # (tests/unit/test_dp_sgd_loss_terms.py)
        {"method": "fedprox-lora"},
        {"method": "hetlora", **HETERO, "hetlora-prune-gamma": 0.9},
    ],
)
def test_dp_sgd_is_accepted_where_the_features_leave_the_clipping_whole(config):
    assert resolve({**config, **DP}).run.privacy.dp_sgd is not None


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"dp_noise_multiplier": 1.0}, "dp-max-grad-norm"),
        ({"dp_max_grad_norm": 1.0}, "dp-max-grad-norm"),
        ({"dp_max_grad_norm": 1.0, "dp_epsilon": -1.0}, "dp-epsilon"),
        ({"dp_max_grad_norm": 1.0, "dp_epsilon": 1.0, "dp_delta": 1.0}, "dp-delta"),
    ],
)
def test_inconsistent_dp_sgd_settings_name_their_key(values, key):
    with pytest.raises(ConfigError) as caught:
        PrivacyConfig.from_values(**values)
    assert caught.value.key == key


def test_the_default_delta_is_below_one_over_n():
    assert default_delta(50) == 1e-5
    assert default_delta(1_000_000) == pytest.approx(1e-7)
    assert all(default_delta(n) < 1 / n for n in (1, 10, 10**5, 10**7))


# ------------------------------------------------------------------ docs
def test_every_snippet_of_the_privacy_page_runs(capsys):
    page = (ROOT / "docs" / "privacy.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        # in this process (the imports are already paid), each in its own namespace
        exec(compile(block, f"docs/privacy.md block {i}", "exec"), {})
        assert capsys.readouterr().out.strip(), f"block {i} prints nothing"
