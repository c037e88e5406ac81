"""Asynchronous federated fine-tuning: FedAsync-LoRA, FedBuff-LoRA, the
virtual clock and the engine (:mod:`fedlr.server_apps.asynchronous`).

1. FedBuff-LoRA with ``K`` = the sampled nodes and equal speeds (no
   staleness) publishes FedAvg-LoRA's arrays bit for bit, round after round.
2. FedBuff's and FedAsync's server updates against float64 references of the
   papers' equations, with stale updates from several base versions.
3. The virtual clock releases replies in virtual-time order, ties together.
4. ``max-staleness`` drops staler replies with a reason, in ``updates.csv``
   and the ``dropped-stale`` column.
"""

from __future__ import annotations

import csv
import math
import time
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedlr.errors import ConfigError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_nbytes, state_to_record
from fedlr.flower.virtual_clock import (
    LOST_REPLY,
    NodeSpeed,
    VirtualClockGrid,
    generated_trace,
    read_trace,
    write_trace,
)
from fedlr.launch.client_app import app as fedlr_app
from fedlr.launch.local import run_in_process
from fedlr.runs.results import read_results
from fedlr.server_apps.asynchronous import UPDATE_COLUMNS
from fedlr.server_apps.builtin_plans import build_plan
from fedlr.server_apps.runner import run_server
from fedlr.strategies.async_lora import (
    StaleUpdate,
    staleness_weight,
    with_staleness,
)
from fedlr.strategies.fedasync_lora import FedAsyncOptions
from fedlr.strategies.fedbuff_lora import FedBuffOptions
from fedlr.strategies.registry import resolve
from fedlr.wire.updates import ClientUpdate
from tests.conftest import tiny_run_config

F64 = torch.float64


@pytest.fixture(scope="module")
def strategies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """FedBuff-LoRA and FedAsync-LoRA as fedlr's tiny plan builds them."""
    from fedlr.data.assets import ensure_assets

    ensure_assets(["polarity", "minilm"], quiet=True)
    out = tmp_path_factory.mktemp("async-plans")
    return {
        name: build_plan(resolve(tiny_run_config(out, method=name, **extra))).strategy
        for name, extra in (
            ("fedbuff-lora", {"buffer-size": 4, "server-lr": 0.7}),
            ("fedasync-lora", {"async-alpha": 0.8, "staleness-fn": "hinge"}),
        )
    }


def _state(strategy: Any, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: scale * torch.randn(shape, generator=g)
        for k, shape in strategy.reply_shapes().items()
    }


def _update(
    node: int,
    arrays: dict[str, torch.Tensor],
    examples: int,
    *,
    version: int,
    staleness: int,
    base: dict[str, torch.Tensor],
) -> StaleUpdate:
    plain = ClientUpdate(
        node_id=node,
        arrays=arrays,
        num_examples=examples,
        metrics={"partition-id": float(node - 1000)},
        content=RecordDict(),
        nbytes=0,
    )
    return with_staleness(plain, version=version, staleness=staleness, base=base)


# ---------------------------------------------------------------- 1. FedAvg
def test_fedbuff_without_staleness_equals_fedavg_lora_bit_for_bit(tmp_path):
    """K = the 3 sampled nodes, equal speeds: every buffer is one synchronous
    round; the final arrays and every round's metrics are FedAvg-LoRA's."""
    common = {"num-server-rounds": 2}
    sync = run_in_process(tiny_run_config(tmp_path, method="fedavg-lora", **common))
    buffered = run_in_process(
        tiny_run_config(
            tmp_path,
            method="fedbuff-lora",
            **common,
            **{"buffer-size": 3, "speed-spread": 1.0},
        )
    )
    want = torch.load(sync / "final_arrays.pt")
    got = torch.load(buffered / "final_arrays.pt")
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    a, b = read_results(sync), read_results(buffered)
    for column in ("accuracy", "loss", "train-loss", "frobenius-gap", "bytes-up"):
        assert a[column].tolist() == b[column].tolist(), column
    assert b["staleness-max"].tolist() == [0.0, 0.0]
    assert b["virtual-time"].is_monotonic_increasing
    with (buffered / "updates.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["applied-version"] for r in rows] == ["1"] * 3 + ["2"] * 3


# ------------------------------------------------------ 2. float64 references
def test_fedbuff_server_step_matches_the_paper_with_staleness(strategies):
    """``x + eta sum_k w_k s(d_k) (y_k - x_{tau_k})``, ``s = 1/sqrt(1 + d)``,
    four replies from three base versions (two fresh, one 1 and one 3 stale)."""
    strategy = strategies["fedbuff-lora"]
    opts: FedBuffOptions = strategy.method_options
    assert (opts.staleness_fn, opts.staleness_exponent) == ("polynomial", 0.5)
    current = _state(strategy, 1)
    bases = {3: current, 2: _state(strategy, 2), 0: _state(strategy, 3)}
    plan = [(1000, 5, 3), (1001, 17, 2), (1002, 40, 0), (1003, 9, 3)]
    updates = [
        _update(
            node,
            {
                k: v + 0.1 * w
                for (k, v), w in zip(
                    bases[tau].items(), _state(strategy, 10 + i).values(), strict=True
                )
            },
            n,
            version=tau,
            staleness=3 - tau,
            base=bases[tau],
        )
        for i, (node, n, tau) in enumerate(plan)
    ]
    state, report = strategy.aggregate_updates(4, updates, current)
    total = sum(n for _, n, _ in plan)
    for key in current:
        want = current[key].double().clone()
        for u, (_, n, tau) in zip(updates, plan, strict=True):
            s = 1.0 / math.sqrt(1.0 + (3 - tau))
            delta = u.arrays[key].double() - bases[tau][key].double()
            want += opts.server_lr * (n / total) * s * delta
        tol = 4 * torch.finfo(torch.float32).eps * max(float(want.abs().max()), 1.0)
        assert float((state[key].double() - want).abs().max()) <= tol, key
        assert state[key].dtype == current[key].dtype
    assert report.metrics["staleness-max"] == 3.0
    assert report.metrics["staleness-mean"] == pytest.approx(1.0)


def test_fedasync_mixes_each_reply_by_its_staleness(strategies):
    """``x <- (1 - a_t) x + a_t y``, ``a_t = alpha s(t - tau)``, hinge ``s``
    (a = 10, b = 4): staleness 0, 6 and 4 in turn."""
    strategy = strategies["fedasync-lora"]
    opts: FedAsyncOptions = strategy.method_options
    current = _state(strategy, 5)
    stalenesses = [0, 6, 4]
    updates = [
        _update(
            1000 + i,
            _state(strategy, 20 + i),
            10 + i,
            version=0,
            staleness=d,
            base=current,
        )
        for i, d in enumerate(stalenesses)
    ]
    state, _ = strategy.aggregate_updates(1, updates, current)
    hinge = {0: 1.0, 4: 1.0, 6: 1.0 / (10.0 * 2 + 1.0)}
    for key in current:
        want = current[key].double()
        for u, d in zip(updates, stalenesses, strict=True):
            a = 0.8 * hinge[d]
            want = (1 - a) * want + a * u.arrays[key].double()
        tol = 4 * torch.finfo(torch.float32).eps * max(float(want.abs().max()), 1.0)
        assert float((state[key].double() - want).abs().max()) <= tol, key
    assert opts.async_alpha == 0.8


def test_fedasync_staleness_counts_versions_missed_not_the_papers_index():
    """docs/methods/fedasync-lora.md: a reply on the latest version has
    staleness 0 and weight alpha (the paper's t - tau is 1 for it); the
    paper's hinge weights are fedlr's at threshold b - 1."""
    from fedlr.strategies.fedasync_lora import mixing_weight

    default = FedAsyncOptions()
    assert default.async_alpha == 0.6
    assert mixing_weight(0, default) == 0.6
    assert mixing_weight(1, default) == pytest.approx(0.6 * 2**-0.5, rel=1e-15)
    paper = FedAsyncOptions(staleness_fn="hinge", hinge_slope=10.0, hinge_threshold=4)
    shifted = FedAsyncOptions(staleness_fn="hinge", hinge_slope=10.0, hinge_threshold=3)
    for missed in range(10):
        assert mixing_weight(missed, shifted) == mixing_weight(missed + 1, paper)


@pytest.mark.parametrize(
    ("fn", "staleness", "want"),
    [
        ("polynomial", 0, 1.0),
        ("polynomial", 3, 0.5),  # (1 + 3) ** -0.5
        ("polynomial", 8, 1.0 / 3.0),
        ("hinge", 4, 1.0),
        ("hinge", 5, 1.0 / 11.0),
        ("constant", 50, 1.0),
    ],
)
def test_staleness_functions(fn, staleness, want):
    opts = FedAsyncOptions(staleness_fn=fn)
    assert staleness_weight(staleness, opts) == pytest.approx(want, rel=1e-15)


# ----------------------------------------------------------- 3. the clock
def _echo_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Any) -> Message:
        node = int(context.node_config["partition-id"])
        content = RecordDict({"metrics": MetricRecord({"partition-id": node})})
        return Message(content, reply_to=message)

    return app


def _instruction(node: int, steps: int) -> Message:
    arrays = state_to_record({"x": torch.zeros(250, dtype=torch.float32)})
    config = ConfigRecord({"local-steps": steps})
    return Message(
        RecordDict({"arrays": arrays, "config": config}),
        message_type="train",
        dst_node_id=node,
    )


def test_virtual_clock_releases_replies_in_virtual_time_order():
    """Node 0 trains 2 steps of 1 s over a fast link; nodes 1 and 2 take
    3 s each, one by its steps, the other by its link; replies come back
    earliest first, equal times together, and the clock stands at each
    release."""
    inner = InProcessGrid(_echo_app(), num_nodes=3, run_config={})
    nbytes = sum(
        record_nbytes(r) for r in _instruction(0, 1).content.array_records.values()
    )
    speeds = {
        1000: NodeSpeed(1.0, 1e12),
        1001: NodeSpeed(2.0, nbytes / 1.0),  # 2 s of steps, 1 s of download
        1002: NodeSpeed(1.0, nbytes / 2.0),  # 1 s of steps, 2 s of download
    }
    grid = VirtualClockGrid(inner, speeds)
    ids = list(
        grid.push_messages(
            [_instruction(1000, 2), _instruction(1001, 1), _instruction(1002, 1)]
        )
    )
    assert grid.now == 0.0
    order = []
    while True:
        got = list(grid.pull_messages(ids))
        if not got:
            break
        order.append(
            (round(grid.now, 6), sorted(int(m.metadata.src_node_id) for m in got))
        )
    assert order == [(2.0, [1000]), (3.0, [1001, 1002])]


def test_virtual_clock_releases_a_lost_reply_as_an_error():
    inner = InProcessGrid(
        _echo_app(), num_nodes=1, run_config={}, reply_hook=lambda p, i, r: None
    )
    grid = VirtualClockGrid(inner, {1000: NodeSpeed(2.0, 1e12)})
    ids = list(grid.push_messages([_instruction(1000, 1)]))
    (reply,) = list(grid.pull_messages(ids))
    assert reply.has_error() and reply.error.reason == LOST_REPLY
    assert grid.now == pytest.approx(2.0)


def test_generated_trace_spans_the_spread_and_round_trips(tmp_path):
    speeds = generated_trace(100, spread=10.0, seed=3)
    steps = [s.step_seconds for s in speeds.values()]
    links = [s.bytes_per_second for s in speeds.values()]
    assert max(steps) / min(steps) == pytest.approx(10.0)
    assert max(links) / min(links) == pytest.approx(10.0)
    assert generated_trace(100, spread=10.0, seed=3) == speeds
    assert generated_trace(100, spread=10.0, seed=4) != speeds
    path = tmp_path / "trace.csv"
    write_trace(path, speeds)
    assert read_trace(path, 100) == speeds
    with pytest.raises(ConfigError, match=r"async-trace.*no row for partitions \[100"):
        read_trace(path, 101)


# -------------------------------------------------------- 4. max-staleness
def test_max_staleness_drops_staler_replies_with_a_reason(tmp_path):
    """FedAsync, 3 nodes at a 10x spread, every reply a version: with
    max-staleness 0 a reply that was overtaken is dropped, never applied."""
    run_dir = run_in_process(
        tiny_run_config(
            tmp_path,
            method="fedasync-lora",
            **{
                "num-server-rounds": 4,
                "local-steps": 1,
                "max-staleness": 0,
                "speed-spread": 10.0,
                "eval-every": 4,
            },
        )
    )
    with (run_dir / "updates.csv").open() as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames or ()) == UPDATE_COLUMNS
        rows = list(reader)
    applied = [r for r in rows if r["event"] == "applied"]
    dropped = [r for r in rows if r["event"] == "dropped"]
    assert [int(r["applied-version"]) for r in applied] == [1, 2, 3, 4]
    assert all(r["staleness"] == "0" for r in applied)
    assert dropped, "a 10x spread with 3 busy nodes must overtake some reply"
    for r in dropped:
        assert int(r["staleness"]) > 0
        assert "exceeds max-staleness 0" in r["reason"]
    frame = read_results(run_dir)
    assert frame["dropped-stale"].iloc[-1] == len(dropped)
    assert frame["virtual-time"].is_monotonic_increasing


def test_async_methods_refuse_robust_rules(tmp_path):
    config = resolve(tiny_run_config(tmp_path, method="fedbuff-lora", robust="median"))
    with pytest.raises(ConfigError, match=r"robust.*asynchronous"):
        build_plan(config)


class _PlainGrid(Grid):
    """An in-process grid behind Flower's plain ``Grid`` interface: the
    engine takes the ``flwr run`` path (push, poll ``pull_messages``, real
    time)."""

    def __init__(self, inner: InProcessGrid) -> None:
        self.inner = inner

    def set_run(self, run: Any) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Any:
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Any:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Any) -> Any:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Any) -> Any:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Any, *, timeout: Any = None) -> Any:
        return self.inner.send_and_receive(messages, timeout=timeout)


def test_the_same_loop_runs_on_a_grid_without_a_virtual_clock(tmp_path):
    """As under ``flwr run``: instructions pushed, replies polled; every
    version applied, ``virtual-time`` the real seconds since the start."""
    config = resolve(
        tiny_run_config(
            tmp_path,
            method="fedbuff-lora",
            **{"num-server-rounds": 2, "buffer-size": 2, "local-steps": 1},
        )
    ).to_mapping()
    grid = _PlainGrid(InProcessGrid(fedlr_app, num_nodes=3, run_config=config))
    started = time.monotonic()
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    run_dir = run_server(grid, context)
    elapsed = time.monotonic() - started
    frame = read_results(run_dir)
    assert frame["round"].tolist() == [1, 2]
    assert 0 < frame["virtual-time"].iloc[-1] <= elapsed
    with (run_dir / "updates.csv").open() as handle:
        applied = [r for r in csv.DictReader(handle) if r["event"] == "applied"]
    assert len(applied) == 4


def test_an_async_run_refuses_to_resume(strategies):
    """In-flight jobs are not checkpointed: ``resume-from`` is refused
    before any instruction goes out."""
    from types import SimpleNamespace

    from fedlr.server_apps.asynchronous import run_async

    run = SimpleNamespace(
        strategy=strategies["fedbuff-lora"],
        resume={"round": 3},
        exchange=None,
        config=SimpleNamespace(method="fedbuff-lora"),
    )
    grid = InProcessGrid(ClientApp(), num_nodes=2, run_config={})
    with pytest.raises(ConfigError, match=r"resume-from.*in-flight jobs"):
        run_async(run, grid)
    assert grid.messages_sent == 0
