"""Plug-in use must not fail silently: models built apart, a forgotten head,
the user's own metrics.

Each run drives a fedlr strategy with Flower's own ``strategy.start()`` on
an in-process grid, with a ClientApp written as a plug-in user writes it
(``apply_round`` on the user's model, the user's metric names).
"""

from __future__ import annotations

import logging
import math
import re
import shlex
from collections.abc import Callable, Mapping

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Result
from peft import LoraConfig, TaskType, get_peft_model
from transformers import GPT2Config, GPT2ForSequenceClassification

from fedlr import (
    SorfVeraSettings,
    apply_round,
    build_sorf_vera_model,
    get_method,
)
from fedlr.adapters.plugin import adapted, unsaved_heads
from fedlr.adapters.roles import Role
from fedlr.errors import BaseMismatchError, NoValidRepliesError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig
from fedlr.round.instructions import instruction_config
from fedlr.strategies import FedAvgLoRA
from fedlr.wire import protocol
from fedlr.wire.fingerprint import (
    PROBES,
    BaseFingerprint,
    check_model,
    fingerprint_roles,
    model_fingerprint,
)
from tests.conftest import ROOT
from tests.plugin_app.task import MLP, build_model, load_data, score
from tests.strategies.conftest import reply

NODES = 3
Builder = Callable[[int], torch.nn.Module]


def _lora(seed: int = 0, *, adapter_seed: int | None = None, head: bool = True):
    """The plug-in app's LoRA model; ``adapter_seed``: LoRA's own init seed
    (the base stays that of ``seed``, as with a pretrained checkpoint)."""
    torch.manual_seed(seed)
    base = MLP()
    if adapter_seed is not None:
        torch.manual_seed(adapter_seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["fc1", "fc2"],
        modules_to_save=["classifier"] if head else None,
    )
    return get_peft_model(base, config)


def _client_app(
    build: Builder,
    *,
    train_metrics: Callable[[float], Mapping[str, float]] = lambda loss: {
        "train-loss": loss
    },
    eval_metrics: Callable[[float, float, int], Mapping[str, float]] = (
        lambda acc, loss, partition: {"accuracy": acc, "loss": loss}
    ),
) -> ClientApp:
    """A user's ClientApp: ``build(partition)`` is the node's own model."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        job = apply_round(build(partition), message, context)
        x, y = load_data(partition)
        optimizer = torch.optim.SGD(job.parameters(), lr=job.lr)
        for _ in range(5):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(job.model(x), y) + job.penalty()
            loss.backward()
            optimizer.step()
        return job.reply(num_examples=len(y), metrics=train_metrics(loss.item()))

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        job = apply_round(build(partition), message, context)
        x, y = load_data(partition, split="test", n=32 * (partition + 1))
        accuracy, loss = score(job.model, x, y)
        return job.reply(
            num_examples=len(y), metrics=eval_metrics(accuracy, loss, partition)
        )

    return app


def _start(
    method: str,
    server_model: torch.nn.Module,
    app: ClientApp,
    *,
    rounds: int = 2,
    hook: Callable[[int, Message, Message], Message] | None = None,
    **kwargs: object,
) -> Result:
    """``strategy.start()`` as a plug-in ServerApp runs it, on an in-process grid."""
    strategy = get_method(method).strategy.for_model(
        server_model, min_available_nodes=NODES, min_train_nodes=NODES, **kwargs
    )

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        strategy.load_into(server_model, arrays)
        accuracy, loss = score(server_model, *load_data(None, split="test"))
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    grid = InProcessGrid(
        app, num_nodes=NODES, run_config={"method": method}, reply_hook=hook
    )
    return strategy.start(
        grid=grid,
        initial_arrays=strategy.initial_arrays(server_model),
        num_rounds=rounds,
        train_config=ConfigRecord({"lr": 0.1}),
        evaluate_fn=evaluate_fn,
    )


def _fedlr_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "fedlr" and r.levelno >= logging.WARNING
    ]


# ------------------------------------------------------------ fingerprint
@pytest.mark.parametrize(
    "method", ["fedavg-lora", "ffa-lora", "fedavg-vera", "sorf-vera"]
)
def test_the_fingerprint_is_the_same_for_the_same_seed(method):
    strategy = get_method(method).strategy.for_model(build_model(method))
    fingerprint = strategy.base_fingerprint
    assert fingerprint is not None
    view = adapted(build_model(method))
    assert fingerprint.keys == tuple(view.layout.keys(Role.BASE, *_frozen(method)))
    again = model_fingerprint(view, fingerprint_roles(view.layout, *_roles(strategy)))
    assert again == fingerprint  # bit for bit: the same seed, the same numbers
    assert len(fingerprint.values) == PROBES * len(fingerprint.keys)
    config = instruction_config(strategy, 1)
    assert BaseFingerprint.from_config(config) == fingerprint
    other = adapted(build_model(method, seed=1))
    if method == "sorf-vera":  # the same projections, another base
        torch.manual_seed(1)
        settings = SorfVeraSettings(
            rank=4, projection_seed=0, target_modules=("fc1", "fc2")
        )
        other = build_sorf_vera_model(MLP(), settings)
    with pytest.raises(BaseMismatchError, match="another seed or checkpoint"):
        check_model(fingerprint, other, what="the model")


def _frozen(method: str) -> tuple[Role, ...]:
    """The adapter factors each method never sends, trains or keeps."""
    return (Role.LORA_A,) if method == "ffa-lora" else ()


def _roles(strategy) -> tuple:
    return (
        strategy.send_roles,
        strategy.train_roles,
        getattr(strategy, "keep_roles", ()),
    )


def test_rounding_to_bfloat16_passes_and_a_small_drift_does_not():
    view = adapted(_lora())
    fingerprint = model_fingerprint(view, (Role.BASE,))
    half = _lora()
    with torch.no_grad():
        for name, param in half.named_parameters():
            if name.endswith("base_layer.weight"):
                param.copy_(param.to(torch.bfloat16).float())
    check_model(fingerprint, adapted(half), what="the model")  # no error
    drifted = _lora()
    with torch.no_grad():
        weight = drifted.base_model.model.fc2.base_layer.weight
        weight.add_(0.05 * weight.norm() / math.sqrt(weight.numel()))
    with pytest.raises(BaseMismatchError, match=r"layer 'base_model.model.fc2'"):
        check_model(fingerprint, adapted(drifted), what="the model")


@pytest.mark.parametrize("method", ["fedavg-lora", "ffa-lora"])
def test_a_client_built_with_another_seed_is_refused_and_dropped(method, caplog):
    def build(partition: int) -> torch.nn.Module:
        return _lora(1 if partition == 1 else 0)

    with caplog.at_level(logging.WARNING):
        result = _start(method, _lora(), _client_app(build))
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["dropped"] == 1 and metrics["clients"] == NODES - 1
    refused = [m for m in caplog.messages if "BaseMismatchError" in m]
    assert refused and all(
        "built with another seed or checkpoint" in m for m in refused
    )
    assert any("base_model.model.fc1" in m for m in refused)


def test_an_ffa_client_whose_lora_init_differs_is_refused(caplog):
    """The same base weights (a checkpoint), another seed for LoRA's init:
    FFA-LoRA's frozen A, which never travels, differs."""

    def build(partition: int) -> torch.nn.Module:
        return _lora(0, adapter_seed=1 if partition == 2 else 0)

    with caplog.at_level(logging.WARNING):
        result = _start("ffa-lora", _lora(0, adapter_seed=0), _client_app(build))
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["dropped"] == 1
        assert metrics["frobenius-gap"] < 1e-5  # the kept replies share A
    refused = [m for m in caplog.messages if "BaseMismatchError" in m]
    assert refused and all("lora_A" in m for m in refused)
    # FedAvg-LoRA sends A: another LoRA init is no error there.
    result = _start("fedavg-lora", _lora(0, adapter_seed=0), _client_app(build))
    assert all(m["dropped"] == 0 for m in result.train_metrics_clientapp.values())


@pytest.mark.parametrize("method", ["fedavg-lora", "ffa-lora"])
def test_a_server_model_built_with_another_seed_stops_the_run(method):
    with pytest.raises(NoValidRepliesError, match="built with another seed"):
        _start(method, _lora(1), _client_app(lambda partition: _lora(0)))
    strategy = get_method(method).strategy.for_model(_lora(0))
    other = _lora(1)
    with pytest.raises(BaseMismatchError, match="initial_arrays"):
        strategy.initial_arrays(other)
    with pytest.raises(BaseMismatchError, match="load_into"):
        strategy.load_into(other, strategy.initial_arrays(_lora(0)))


def test_fedex_checks_the_built_base_while_the_base_is_folded():
    """FedEx folds its residual into W0 every round; the fingerprint is of the
    model as built, so honest nodes and the server's load_into pass."""
    checked: list[str] = []

    def hook(partition: int, instruction: Message, answer: Message) -> Message:
        config = instruction.content["config"]
        checked.append(instruction.metadata.message_type)
        assert len(config[protocol.BASE_FINGERPRINT_KEYS]) == 2  # fc1, fc2
        return answer

    result = _start(
        "fedex-lora",
        _lora(),
        _client_app(lambda partition: _lora()),
        rounds=3,
        hook=hook,
    )
    assert checked.count("train") == 3 * NODES  # every instruction carried it
    assert checked.count("evaluate") == 3 * NODES
    assert all(m["dropped"] == 0 for m in result.train_metrics_clientapp.values())
    final = record_to_state(result.arrays)
    model = _lora()
    base = model.base_model.model.fc1.base_layer.weight
    key = next(k for k in final if k.endswith("fc1.base_layer.weight"))
    assert not torch.equal(final[key], base.detach())  # the base moved
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3]


# ------------------------------------------------------------------ heads
def test_a_forgotten_head_is_named_once_through_start(caplog):
    build = lambda partition: _lora(head=False)  # noqa: E731
    with caplog.at_level(logging.INFO):
        result = _start("fedavg-lora", _lora(head=False), _client_app(build))
    warnings = [m for m in _fedlr_warnings(caplog) if "modules_to_save" in m]
    assert len(warnings) == 1, warnings
    assert "'base_model.model.classifier'" in warnings[0]
    assert "modules_to_save=['classifier']" in warnings[0]
    assert not any(k.startswith("base_model.model.classifier") for k in result.arrays)
    assert any("sends ['lora_A', 'lora_B']" in m for m in caplog.messages)
    # With the head saved there is nothing to say.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        FedAvgLoRA.for_model(_lora())
    assert not [m for m in _fedlr_warnings(caplog) if "modules_to_save" in m]


def test_a_transformers_classification_head_is_found():
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, num_labels=2
    )
    torch.manual_seed(0)
    plain = get_peft_model(
        GPT2ForSequenceClassification(config),
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True),
    )
    assert unsaved_heads(plain) == ["base_model.model.score"]
    torch.manual_seed(0)
    saved = get_peft_model(
        GPT2ForSequenceClassification(config),
        LoraConfig(
            r=2,
            target_modules=["c_attn"],
            fan_in_fan_out=True,
            task_type=TaskType.SEQ_CLS,
        ),
    )
    assert unsaved_heads(saved) == []
    # A trainable module that is neither adapted nor saved is named too.
    saved.base_model.model.transformer.ln_f.weight.requires_grad_(True)
    assert unsaved_heads(saved) == ["base_model.model.transformer.ln_f"]


# ------------------------------------------------------ the user's metrics
@pytest.mark.parametrize("method", ["fedsa-lora", "global-svd"])
def test_personalised_methods_pass_the_users_metrics_to_the_aggregation(method):
    calls: list[int] = []

    def aggregate(records, weighted_by_key):
        calls.append(len(records))
        total = sum(float(r["metrics"][weighted_by_key]) for r in records)
        return MetricRecord(
            {
                "my-f1": sum(
                    float(r["metrics"]["my-f1"]) * float(r["metrics"][weighted_by_key])
                    for r in records
                )
                / total,
                "accuracy": -1.0,  # fedlr's mean over clients wins
            }
        )

    app = _client_app(
        lambda partition: _lora(),
        eval_metrics=lambda acc, loss, partition: {
            "accuracy": acc,
            "loss": loss,
            "my-f1": 0.1 * (partition + 1),
        },
    )
    result = _start(method, _lora(), app, evaluate_metrics_aggr_fn=aggregate)
    assert calls == [NODES, NODES]
    # Partition p evaluates on 32 (p + 1) examples: weights 1, 2, 3.
    want = (0.1 * 1 + 0.2 * 2 + 0.3 * 3) / 6
    for metrics in result.evaluate_metrics_clientapp.values():
        assert metrics["my-f1"] == pytest.approx(want)
        assert 0.0 <= metrics["accuracy"] <= 1.0
        assert metrics["evaluated-clients"] == NODES


def test_personalised_metrics_without_accuracy_still_arrive():
    app = _client_app(
        lambda partition: _lora(),
        eval_metrics=lambda acc, loss, partition: {"my-f1": 0.5},
    )
    result = _start("fedsa-lora", _lora(), app)
    for metrics in result.evaluate_metrics_clientapp.values():
        assert metrics["my-f1"] == pytest.approx(0.5)


def test_no_train_loss_is_made_up_when_the_client_names_its_loss_otherwise():
    app = _client_app(
        lambda partition: _lora(), train_metrics=lambda loss: {"ce": loss}
    )
    result = _start("fedavg-lora", _lora(), app)
    for metrics in result.train_metrics_clientapp.values():
        assert "train-loss" not in metrics
        assert math.isfinite(metrics["ce"]) and metrics["ce"] > 0


def test_trimmed_clients_are_counted_and_their_metrics_reported_apart():
    model = _lora()
    strategy = FedAvgLoRA.for_model(
        model, robust=RobustConfig(rule="trimmed-mean", trim_fraction=0.2)
    )
    initial = strategy.initial_arrays(model)
    strategy.begin_round(1, initial, ConfigRecord({}))
    state = record_to_state(initial)
    g = torch.Generator().manual_seed(0)
    replies = []
    for i in range(5):
        scale = 0.01 if i < 4 else 0.05  # node 5 is far from the others
        arrays = {
            k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()
        }
        replies.append(reply(i + 1, arrays, {"num-examples": 10, "my-f1": float(i)}))
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["robust-trimmed"] == 1 and metrics["dropped"] == 0
    assert metrics["clients"] == 5 and metrics["num-examples"] == 40
    assert metrics["my-f1"] == pytest.approx(1.5)  # nodes 1-4
    assert metrics["trimmed-my-f1"] == pytest.approx(4.0)  # node 5


def test_build_sorf_vera_model_is_a_module():
    model = build_model("sorf-vera")
    assert isinstance(model, torch.nn.Module)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), model.model(x))
    assert {id(p) for p in model.parameters()} == {
        id(p) for p in model.model.parameters()
    }
    assert adapted(model) is model
    bound = get_method("sorf-vera").strategy.for_model(model)
    assert protocol.BASE_FINGERPRINT in instruction_config(bound, 1)


# ---------------------------------------------------------------------- docs
_PYTHON = re.compile(r"(<!-- [^>]* -->\n)?```python\n(.*?)```", flags=re.DOTALL)
_STOP = re.compile(r"```bash\n(python -c \"[^\n]*stop_local_superlinks[^\n]*)\n```")


def test_every_python_snippet_of_the_plugin_page_runs():
    """Blocks marked as files of the app are compared with the app in
    test_plugin.py; every other one runs here as it is, on its own."""
    text = (ROOT / "docs" / "plugin.md").read_text(encoding="utf-8")
    blocks = [body for marker, body in _PYTHON.findall(text) if not marker]
    assert len(blocks) >= 6
    for body in blocks:
        exec(compile(body, "docs/plugin.md", "exec"), {"__name__": "snippet"})


def test_the_superlink_stop_command_of_the_page_runs(tmp_path, monkeypatch, capsys):
    """The page's `python -c` line, run in this process from a fresh directory:
    no SuperLink lives under its FLWR_HOME, so it signals nobody."""
    text = (ROOT / "docs" / "plugin.md").read_text(encoding="utf-8")
    (command,) = _STOP.findall(text)
    assert "pgrep" not in text.split("## Try it")[1].split("Avoid")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-c"] and len(argv) == 3
    monkeypatch.chdir(tmp_path)
    exec(compile(argv[2], "docs/plugin.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip() == "[]"
