"""Every registered method through one shared tester (PEFT's ``TEST_CASES``).

``CASES`` has one :class:`Case` per registered method: the run-config
overrides that build the method's server plan cheaply (tiny BERT for the text
families, a small CNN or MLP for the vision ones), what the method shares with
its clients (its *effective* model) and the extra records a valid reply
carries. Every property is parametrised over ``available_methods()``, not over
the table, so a method registered without a row fails every test here. A
property that does not apply to a method is skipped with the row's reason; a
known deviation of the library is a strict ``xfail`` with the row's reason
(it fails as soon as the library changes, so the row gets updated).

Properties
----------
1. Reduces to FedAvg when all clients agree: three clients send the same
   update (the global arrays plus a seeded perturbation) with different
   ``num-examples``; the new global effective model equals the clients', and
   ``frobenius-gap`` is ~0 where the method reports one.
2. A reply missing an expected key and a reply with an unexpected key are
   dropped with reasons naming the node and the key; the valid replies are
   aggregated exactly as if the bad ones had never been sent. Both rounds
   compared are rounds of the same five nodes (same instructions): in one,
   two of them reply with the bad replies, in the other they send nothing.
3. ``state_dict`` round-trips: a fresh strategy given the saved state behaves
   as the one that ran (reply shapes, round config, instructions, aggregation,
   state after the round); unknown state keys raise ``ValueError``.
4. The method's options extend its payload kind's, parse from a bare
   ``{"method": name}``, carry help texts, and a bad value of every numeric
   key is a ``ConfigError`` naming the key.
5. A rejected round changes nothing the method keeps.
6. A row with a ``reference`` implementation (FedAdam-LoRA: Flower's own
   ``FedAdam``) publishes its arrays, round after round of disagreeing
   clients, on the same replies.

Tolerances follow scipy: ``K * eps * max(shape)`` in the dtype the arrays
travel in (float32), relative to the compared tensor's largest entry.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedYogi
from flwr.serverapp.strategy.fedopt import FedOpt

from fedlr.adapters import Role
from fedlr.adapters.sorf_vera import layer_signs
from fedlr.errors import ConfigError, FedLRError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.linalg.sorf import build_lambda_d_rot
from fedlr.server_apps.builtin_plans import build_plan
from fedlr.server_apps.plans import ServerPlan
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.lora_svd import PERSONAL_GRAM
from fedlr.strategies.registry import available_methods, get_method, resolve
from fedlr.wire import protocol
from tests.conftest import tiny_run_config
from tests.strategies.conftest import reply

F64 = torch.float64
K = 4
"""Safety factor of the ``eps * max(shape)`` tolerances."""
SEED = 20240611
NODES = (1000, 1001, 1002)
"""Node ids of an ``InProcessGrid`` of three nodes."""
WEIGHTS = (5, 17, 40)
"""Different ``num-examples`` per client: agreeing clients must not care."""
MISSING_NODE, EXTRA_NODE = 1003, 1004
ROUND_NODES = (*NODES, MISSING_NODE, EXTRA_NODE)
"""The population of property 2's round, the same in both rounds it compares."""
EXTRA_KEY = "not-a-parameter.weight"
METHODS = available_methods()
PROPERTIES = ("fedavg", "wrong-keys", "state", "options")

State = dict[str, torch.Tensor]
Effective = Callable[[FedLRStrategy, Mapping[str, torch.Tensor], int], State]
Records = dict[str, State]
Extras = Callable[
    [Any, int, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], int],
    tuple[Records, dict[str, float]],
]
Step = Callable[[int, State, list[Message]], State]
"""A reference's round: ``(round, current global state, replies) -> new state``."""
Reference = Callable[[Any], Step]


# ----------------------------------------------------------- effective models
def raw(strategy: Any, state: Mapping[str, torch.Tensor], node: int) -> State:
    """The arrays the clients train and the server averages, as they are.

    For a personalised method that keeps ``B`` on the clients (FedSA-LoRA,
    Local SVD) these are exactly what it shares: ``A`` and the head.
    """
    return {k: state[k].double() for k in strategy.reply_shapes() if k in state}


def lora_products(strategy: Any, state: Mapping[str, torch.Tensor], node: int) -> State:
    """Every layer's ``W0 + (alpha / r) B A`` (``W0`` where sent) and the head.

    ``A`` not in ``state`` is the seeded one the server bound (FFA-LoRA);
    ``B`` not in ``state`` is the node's own one the server delivers (Global
    SVD). ``alpha / r`` uses the rank of the arrays (FedSpec grows it).
    """
    out: State = {}
    for m in strategy.layout.modules:
        a = state.get(m.a_key)
        if a is None:
            a = strategy.initial_state[m.a_key]
        b = state.get(m.b_key)
        if b is None:
            b = strategy.personal[node][m.b_key]
        alpha = m.scaling * m.rank
        delta = (alpha / a.shape[0]) * (b.double() @ a.double())
        if m.base_key in state:
            delta = state[m.base_key].double() + delta
        out[m.name] = delta
    out.update({k: state[k].double() for k in strategy.layout.keys(Role.HEAD)})
    return out


def fresh_adapter_products(
    strategy: Any, state: Mapping[str, torch.Tensor], node: int
) -> State:
    """FLoRA: ``W0 (+ (alpha / r) B A`` where a trained adapter is present).

    The server sends no adapter (every client starts a fresh one, ``B = 0``),
    so its effective model is ``W0`` with the sum of the updates folded in.
    """
    out: State = {}
    for m in strategy.layout.modules:
        weight = state[m.base_key].double()
        if m.a_key in state and m.b_key in state:
            a, b = state[m.a_key].double(), state[m.b_key].double()
            weight = weight + (m.scaling * m.rank / a.shape[0]) * (b @ a)
        out[m.name] = weight
    out.update({k: state[k].double() for k in strategy.layout.keys(Role.HEAD)})
    return out


def _dense_gamma(b_real: torch.Tensor, b_imag: torch.Tensor) -> torch.Tensor:
    """``Gamma(b)``: 2x2 blocks ``[[a, -c], [c, a]]`` of ``b_j = a_j + i c_j``."""
    g = torch.zeros(2 * b_real.numel(), 2 * b_real.numel(), dtype=F64)
    for j, (a, c) in enumerate(zip(b_real.tolist(), b_imag.tolist(), strict=True)):
        g[2 * j, 2 * j], g[2 * j, 2 * j + 1] = a, -c
        g[2 * j + 1, 2 * j], g[2 * j + 1, 2 * j + 1] = c, a
    return g


def sorf_updates(strategy: Any, state: Mapping[str, torch.Tensor], node: int) -> State:
    """Every layer's dense ``S Gamma(b) B m G(theta) A`` and the head."""
    out: State = {}
    for m in strategy.layout.modules:
        s = layer_signs(m.d_out, strategy.projection_seed).dense().to(F64)
        gamma = _dense_gamma(state[m.b_real_key], state[m.b_imag_key])
        b = strategy.projection_b[: m.d_out].double()
        a = strategy.projection_a[:, : m.d_in].double()
        lam = build_lambda_d_rot(
            state[m.d_scale_key].double(), state[m.d_angles_key].double(), m.rank
        )
        out[m.name] = s @ gamma @ b @ lam @ a
    out.update({k: state[k].double() for k in strategy.layout.keys(Role.HEAD)})
    return out


# ------------------------------------------------------------- reply extras
def no_extras(
    strategy: Any, server_round: int, arrays: Any, current: Any, seed: int
) -> tuple[Records, dict[str, float]]:
    """The extra records the strategy declares (``reply_records``), seeded."""
    g = torch.Generator().manual_seed(seed)
    records = {
        name: {k: 0.01 * torch.randn(shape, generator=g) for k, shape in shapes.items()}
        for name, shapes in strategy.replies.records().items()
    }
    return records, {}


def personal_gram(
    strategy: Any, server_round: int, arrays: Any, current: Any, seed: int
) -> tuple[Records, dict[str, float]]:
    """``personal-gram``: ``B^T B`` of the client's own (kept, never sent) ``B``."""
    g = torch.Generator().manual_seed(seed)
    grams = {}
    for m in strategy.layout.modules:
        b = torch.randn(m.d_out, m.rank, generator=g)
        grams[m.b_key] = b.T @ b
    return {PERSONAL_GRAM: grams}, {}


def projection_echo(
    strategy: Any, server_round: int, arrays: Any, current: Any, seed: int
) -> tuple[Records, dict[str, float]]:
    """The VeRA family's echo of the shared projection seed and rank."""
    return {}, {
        protocol.PROJECTION_SEED: strategy.projection_seed,
        protocol.PROJECTION_RANK: strategy.projection_rank,
    }


def qrmix_eigen(
    strategy: Any, server_round: int, arrays: Any, current: Any, seed: int
) -> tuple[Records, dict[str, float]]:
    """Stage 2: orthonormal vectors, non-negative values, the head's delta."""
    if strategy.stage(server_round) == 1:
        return {}, {}
    g = torch.Generator().manual_seed(seed)
    p, k = strategy.head_dim, strategy.k
    vectors = torch.linalg.qr(torch.randn(p, k, generator=g, dtype=F64)).Q
    values = torch.rand(k, generator=g, dtype=F64).sort(descending=True).values
    local = strategy.head_vector({**current, **arrays}).double()
    delta = local - strategy.head_vector(current).double()
    eigen = {"vectors": vectors, "values": values, "delta": delta}
    return {protocol.EIGEN: {k: v.float() for k, v in eigen.items()}}, {}


def fot_sketches(
    strategy: Any, server_round: int, arrays: Any, current: Any, seed: int
) -> tuple[Records, dict[str, float]]:
    """At a task boundary: a sketch per projected layer and its fractions."""
    if strategy.boundary_task(server_round) < 0:
        return {}, {}
    g = torch.Generator().manual_seed(seed)
    sketches = {
        layer: torch.randn(*strategy.sketch_shape(layer), generator=g)
        for layer in strategy.dims
    }
    metrics = {protocol.gpse_fraction_key(layer): 0.6 for layer in strategy.dims}
    metrics[protocol.GPSE_EXAMPLES] = 30
    return {protocol.SKETCHES: sketches}, metrics


# ------------------------------------------------- reference implementations
def flower_steps(flower: FedOpt) -> Step:
    """Flower's own adaptive strategy ``flower`` (``FedAdam``, ``FedYogi``,
    ``FedAdagrad``), driven through its Message API: ``configure_train``
    (which keeps the current arrays) on a grid of the round's nodes, then
    ``aggregate_train`` on the same replies. It keeps its ``m`` and ``v``
    from round to round."""
    name = type(flower).__name__

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        grid = InProcessGrid(ClientApp(), num_nodes=len(replies), run_config={})
        flower.configure_train(
            server_round, ArrayRecord(dict(current)), ConfigRecord({}), grid
        )
        arrays, _ = flower.aggregate_train(server_round, replies)
        assert arrays is not None, f"Flower's {name} aggregated nothing"
        return record_to_state(arrays)

    return step


def flower_fedadam(strategy: Any) -> Step:
    """Flower's own ``FedAdam`` with the strategy's options."""
    opts = strategy.method_options
    return flower_steps(
        FedAdam(
            eta=opts.server_lr,
            beta_1=opts.server_beta1,
            beta_2=opts.server_beta2,
            tau=opts.server_tau,
        )
    )


def flower_fedyogi(strategy: Any) -> Step:
    """Flower's own ``FedYogi`` with the strategy's options."""
    opts = strategy.method_options
    return flower_steps(
        FedYogi(
            eta=opts.server_lr,
            beta_1=opts.server_beta1,
            beta_2=opts.server_beta2,
            tau=opts.server_tau,
        )
    )


def flower_fedadagrad(strategy: Any) -> Step:
    """Flower's own ``FedAdagrad`` (``beta_1 = 0``) with the strategy's options."""
    opts = strategy.method_options
    return flower_steps(FedAdagrad(eta=opts.server_lr, tau=opts.server_tau))


def feddyn_server(strategy: Any) -> Step:
    """FedDyn's server (Acar et al., ICLR 2021, Algorithm 1) in float64, the
    paper's uniform means weighted by the replies' ``num-examples`` shares
    ``w_k``: ``h <- h - alpha (|P| / m) sum_k w_k (theta_k - theta)`` and
    ``theta <- sum_k w_k theta_k - h / alpha``, ``m`` the grid's nodes (the
    reference test instructs ``NODES``), ``h`` kept from round to round."""
    alpha = strategy.method_options.feddyn_alpha
    h: State = {}

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        thetas = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        assert all(isinstance(n, int) for n in examples), examples
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        share = len(replies) / len(NODES)
        new = dict(current)
        for key in thetas[0]:
            x = current[key].double()
            stacked = torch.stack([t[key].double() for t in thetas])
            mean = torch.tensordot(w, stacked, dims=1)
            h[key] = h.get(key, torch.zeros_like(x)) - alpha * share * (mean - x)
            new[key] = mean - h[key] / alpha
        return new

    return step


def weighted_mean_server(strategy: Any) -> Step:
    """``sum_i w_i x_i`` of every trained tensor in float64, ``w_i`` the
    ``num-examples`` shares: the server of FedRot-LoRA (Zhang et al., ICML
    2026; the clients reply already rotated ``R_i^T A_i``, ``B_i R_i``:
    tests/strategies/test_fedrot_lora.py) and of FedDPA's global adapter (Yang
    et al., NeurIPS 2024; the local adapter: tests/strategies/test_feddpa.py)."""

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        new = dict(current)
        for key in arrays[0]:
            stacked = torch.stack([a[key].double() for a in arrays])
            new[key] = torch.tensordot(w, stacked, dims=1)
        return new

    return step


def rolora_server(strategy: Any) -> Step:
    """RoLoRA's server (Chen et al., NeurIPS 2025) in float64: odd rounds
    ``B <- sum_i w_i B_i`` with ``A`` kept, even rounds ``A <- sum_i w_i A_i``
    with ``B`` kept, the head averaged every round, ``w_i`` the
    ``num-examples`` shares; each round's published ``B A`` is checked to be
    ``sum_i w_i B_i A_i`` (the frozen factor the global one)."""

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        factor = Role.LORA_B if server_round % 2 == 1 else Role.LORA_A
        keys = strategy.layout.keys(factor, Role.HEAD)
        assert all(set(a) == set(keys) for a in arrays), "one factor a round"
        new = {k: v.double() for k, v in current.items()}
        for key in keys:
            stacked = torch.stack([a[key].double() for a in arrays])
            new[key] = torch.tensordot(w, stacked, dims=1)
        for m in strategy.layout.modules:
            products = [
                {**new, **a}[m.b_key].double() @ {**new, **a}[m.a_key].double()
                for a in arrays
            ]
            mean = torch.tensordot(w, torch.stack(products), dims=1)
            exact = new[m.b_key] @ new[m.a_key]
            assert float((exact - mean).abs().max()) <= 1e-12 * max(
                float(mean.abs().max()), 1.0
            ), m.name
        return new

    return step


def slora_server(strategy: Any) -> Step:
    """SLoRA's server (Babakniya et al., 2023) in float64: while ``t <= T1``
    ``W <- W + M (sum_i w_i W_i - W)`` per adapted weight (``M`` its seeded
    mask) and the head's mean; after round ``T1``, with ``Delta = W - W0``,
    ``W <- W0``, ``B = U_r sqrt(S_r / s)``, ``A = sqrt(S_r / s) V_r^T`` (each
    column of ``U_r`` with a positive largest entry); then FedAvg of ``A``,
    ``B`` and the head. ``W0`` is round 1's ``current``."""
    from fedlr.strategies.slora import warmup_mask

    opts = strategy.method_options
    warmup = opts.slora_warmup_rounds
    modules = strategy.layout.modules
    masks = {
        m.base_key: warmup_mask(
            (m.d_out, m.d_in), opts.slora_density, strategy.seed, m.base_key
        )
        for m in modules
    }
    w0: State = {}

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        new = {k: v.double() for k, v in current.items()}
        if server_round == 1:
            w0.update({k: current[k].double() for k in masks})
        for key in arrays[0]:
            mean = torch.tensordot(
                w, torch.stack([a[key].double() for a in arrays]), dims=1
            )
            new[key] = torch.where(masks[key], mean, new[key]) if key in masks else mean
        if server_round == warmup:
            for m in modules:
                u, s, vh = torch.linalg.svd(new[m.base_key] - w0[m.base_key])
                u, s, vh = u[:, : m.rank], s[: m.rank], vh[: m.rank]
                for j in range(m.rank):
                    if u[int(u[:, j].abs().argmax()), j] < 0:
                        u[:, j], vh[j] = -u[:, j], -vh[j]
                root = torch.sqrt(s / m.scaling)
                new[m.b_key], new[m.a_key] = u * root, root[:, None] * vh
                new[m.base_key] = w0[m.base_key]
        return new

    return step


def _signed_qr(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced QR in float64 with ``diag(R) >= 0`` (the unique one)."""
    q, r = torch.linalg.qr(matrix.double(), mode="reduced")
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).double()
    return q * signs, signs[:, None] * r


def ilora_server(strategy: Any) -> Step:
    """ILoRA's server (Zhou, Liu, Shang, 2025) in float64 on the dense matrices:
    ``M = sum_i w_i s B_i A_i``, ``M = Q Rm`` (``diag(Rm) >= 0``), ``B = Q[:, :R]``,
    ``A = Rm[:R] / s``, the head's mean, ``W`` kept; round 1 also checks the QR
    initialisation: ``B_1 = Q_R``, ``s A_1 = Rm_R`` of ``W0 = W_1 + s B_1 A_1``."""

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        new = {k: v.double() for k, v in current.items()}
        for key in strategy.layout.keys(Role.HEAD):
            stacked = torch.stack([a[key].double() for a in arrays])
            new[key] = torch.tensordot(w, stacked, dims=1)
        for m in strategy.layout.modules:
            s, r = m.scaling, m.rank
            if server_round == 1:
                b0, a0 = new[m.b_key], new[m.a_key]
                q, rm = _signed_qr(new[m.base_key] + s * b0 @ a0)
                eps = torch.finfo(current[m.b_key].dtype).eps
                assert float((b0 - q[:, :r]).abs().max()) <= K * eps * max(b0.shape)
                assert float((s * a0 - rm[:r]).abs().max()) <= K * eps * max(
                    a0.shape
                ) * float(rm.abs().max())
            products = [s * a[m.b_key].double() @ a[m.a_key].double() for a in arrays]
            q, rm = _signed_qr(torch.tensordot(w, torch.stack(products), dims=1))
            new[m.b_key], new[m.a_key] = q[:, :r], rm[:r] / s
        return new

    return step


def ravan_server(strategy: Any) -> Step:
    """RAVAN's server (Raje et al., NeurIPS 2025) in float64: per adapted
    layer and head ``h``, ``H_h <- sum_i w_i C_i,h`` (``C_i,h = s_i,h H_i,h``
    from the ``ravan-cores`` record) with ``s_h <- 1``, published as
    ``B[:, h] = B_h H_h`` over the seeded orthonormal bases; the head's
    weighted mean; ``w_i`` the ``num-examples`` shares. Each published
    ``B A`` is checked to be ``sum_i w_i sum_h B_h C_i,h A_h``."""
    from fedlr.strategies.ravan import RAVAN_CORES, head_bases

    heads = strategy.method_options.ravan_heads

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        cores = [record_to_state(r.content.array_records[RAVAN_CORES]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        new = {k: v.double() for k, v in current.items()}
        for key in arrays[0]:
            stacked = torch.stack([a[key].double() for a in arrays])
            new[key] = torch.tensordot(w, stacked, dims=1)
        for m in strategy.layout.modules:
            r = m.rank // heads
            bases = head_bases(strategy.seed, m.name, m.d_out, m.rank)
            a0 = strategy.initial_state[m.a_key].double()
            blocks, clients = [], torch.zeros(m.d_out, m.d_in, dtype=F64)
            for h in range(heads):
                b_h, a_h = bases[:, h * r : (h + 1) * r], a0[h * r : (h + 1) * r]
                pairs = zip(w, cores, strict=True)
                mean = sum(wi * c[m.name][h].double() for wi, c in pairs)
                blocks.append(b_h @ mean)
                for wi, c in zip(w, cores, strict=True):
                    clients += wi * (b_h @ c[m.name][h].double() @ a_h)
            new[m.b_key] = torch.cat(blocks, dim=1)
            exact = new[m.b_key] @ a0
            assert float((exact - clients).abs().max()) <= 1e-12 * max(
                float(clients.abs().max()), 1.0
            ), m.name
        return new

    return step


def fedbuff_server(strategy: Any) -> Step:
    """FedBuff's server step (Nguyen et al., AISTATS 2022, Algorithm 1) in
    float64 on fresh replies (a synchronous call: staleness 0, ``s = 1``):
    ``x <- x + eta_g sum_k w_k (y_k - x)``, ``w_k`` the ``num-examples``
    shares; stale buffers are checked in tests/strategies/test_async.py."""
    eta = strategy.method_options.server_lr

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        new = {k: v.double() for k, v in current.items()}
        for key in arrays[0]:
            deltas = torch.stack([a[key].double() - new[key] for a in arrays])
            new[key] = new[key] + eta * torch.tensordot(w, deltas, dims=1)
        return new

    return step


def fedasync_server(strategy: Any) -> Step:
    """FedAsync's server (Xie et al., 2019, Algorithm 1) in float64 on fresh
    replies, mixed in turn in node order: ``x <- (1 - alpha) x + alpha y_k``
    (``s(0) = 1``); stale replies are checked in tests/strategies/test_async.py."""
    alpha = strategy.method_options.async_alpha

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        new = {k: v.double() for k, v in current.items()}
        ordered = sorted(replies, key=lambda r: int(r.metadata.src_node_id))
        for r in ordered:
            arrays = record_to_state(r.content.array_records["arrays"])
            for key, value in arrays.items():
                new[key] = (1.0 - alpha) * new[key] + alpha * value.double()
        return new

    return step


def hilora_server(strategy: Any) -> Step:
    """HiLoRA's server (Peng et al., CVPR 2026) in float64, the published
    arrays: root rounds ``B = U_r``, ``A = S_r V_r^T`` from the dense SVD of
    ``sum_i w_i B_i A_i`` (each column of ``U_r`` with a positive peak); from
    the cluster stage the root stays as it is (the cluster adapters and the
    leaf ones are checked in tests/strategies/test_hilora.py); the head's
    weighted mean every round; ``w_i`` the ``num-examples`` shares."""

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        examples = [
            r.content.metric_records["metrics"]["num-examples"] for r in replies
        ]
        w = torch.tensor(examples, dtype=F64)
        w = w / w.sum()
        new = {k: v.double() for k, v in current.items()}
        for key in strategy.layout.keys(Role.HEAD):
            stacked = torch.stack([a[key].double() for a in arrays])
            new[key] = torch.tensordot(w, stacked, dims=1)
        if server_round <= strategy.method_options.hilora_root_rounds:
            for m in strategy.layout.modules:
                mean = sum(
                    wi * a[m.b_key].double() @ a[m.a_key].double()
                    for wi, a in zip(w, arrays, strict=True)
                )
                u, s, vh = torch.linalg.svd(mean, full_matrices=False)
                u, s, vh = u[:, : m.rank], s[: m.rank], vh[: m.rank]
                for j in range(m.rank):
                    if u[int(u[:, j].abs().argmax()), j] < 0:
                        u[:, j], vh[j] = -u[:, j], -vh[j]
                new[m.b_key], new[m.a_key] = u, s[:, None] * vh
        return new

    return step


def fedlease_server(strategy: Any) -> Step:
    """FedLEASE's server (Wang et al., NeurIPS 2025) in float64. Published:
    warm-up rounds the weighted means of ``A``, ``B`` and the head (FedAvg-LoRA);
    later rounds the head's mean only. Kept, checked at the next round: after
    the last warm-up round the clustering of the clients by
    ``d(i, j) = mean_l (1 - cos(B_i^l - B^l, B_j^l - B^l))`` (scipy's average
    linkage cut at ``k`` clusters, scikit-learn's silhouette, the best ``k`` in
    ``2 .. min(M_max, n - 1)``, one cluster unless it is positive), each
    expert the weighted mean of its cluster's ``A``, ``B``; later rounds each
    expert and each cluster's router the weighted means of its members'
    replies; ``w_i`` the ``num-examples`` shares within the group."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform
    from sklearn.metrics import silhouette_score

    from fedlr.strategies.fedlease import FEDLEASE_ROUTER, initial_router

    opts = strategy.method_options
    a_keys = strategy.layout.keys(Role.LORA_A)
    b_keys = strategy.layout.keys(Role.LORA_B)
    kept: dict[str, Any] = {}

    def mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        w = torch.tensor(weights, dtype=F64)
        return torch.tensordot(w / w.sum(), torch.stack(tensors).double(), dims=1)

    def check_kept() -> None:
        if not kept:
            assert not strategy.experts
            return
        assert strategy.assignment == kept["assignment"]
        for got, want in zip(strategy.experts, kept["experts"], strict=True):
            assert_close(got, want, 1e-6, "expert")
        for got, want in zip(strategy.routers, kept["routers"], strict=True):
            assert_close(got, want, 1e-6, "router")

    def cluster(deltas: list[State]) -> list[int]:
        n = len(deltas)
        d = torch.zeros(n, n, dtype=F64)
        for i in range(n):
            for j in range(n):
                cos = [
                    torch.dot(deltas[i][k].reshape(-1), deltas[j][k].reshape(-1))
                    / (deltas[i][k].norm() * deltas[j][k].norm())
                    for k in b_keys
                ]
                d[i, j] = sum(1.0 - c for c in cos) / len(cos)
        d.fill_diagonal_(0.0)
        d = 0.5 * (d + d.T)
        best: tuple[float, list[int]] | None = None
        for k in range(2, min(opts.fedlease_max_experts, n - 1) + 1):
            tree = linkage(squareform(d.numpy(), checks=False), method="average")
            labels = [int(x) for x in fcluster(tree, k, criterion="maxclust")]
            score = float(silhouette_score(d.numpy(), labels, metric="precomputed"))
            if best is None or score > best[0]:
                best = (score, labels)
        if best is None or best[0] <= 0.0:
            return [0] * n
        order: dict[int, int] = {}
        return [order.setdefault(x, len(order)) for x in best[1]]

    def step(server_round: int, current: State, replies: list[Message]) -> State:
        check_kept()
        replies = sorted(replies, key=lambda r: int(r.metadata.src_node_id))
        nodes = [int(r.metadata.src_node_id) for r in replies]
        arrays = [record_to_state(r.content.array_records["arrays"]) for r in replies]
        w = [
            float(r.content.metric_records["metrics"]["num-examples"]) for r in replies
        ]
        new = {k: v.double() for k, v in current.items()}
        heads = strategy.layout.keys(Role.HEAD)
        if not kept:  # warm-up: FedAvg-LoRA
            for key in arrays[0]:
                new[key] = mean([a[key] for a in arrays], w)
            if server_round >= opts.fedlease_warmup_rounds:
                deltas = [
                    {k: a[k].double() - current[k].double() for k in b_keys}
                    for a in arrays
                ]
                labels = cluster(deltas)
                count = max(labels) + 1
                kept["assignment"] = dict(zip(nodes, labels, strict=True))
                kept["experts"] = [
                    {
                        k: mean(
                            [
                                a[k]
                                for a, c in zip(arrays, labels, strict=True)
                                if c == e
                            ],
                            [x for x, c in zip(w, labels, strict=True) if c == e],
                        )
                        for k in (*a_keys, *b_keys)
                    }
                    for e in range(count)
                ]
                # the routers start from a seeded draw (no math to re-derive)
                kept["routers"] = [
                    {
                        m.name: initial_router(
                            strategy.seed, e, m.name, 2 * count - 1, m.d_in
                        ).double()
                        for m in strategy.layout.modules
                    }
                    for e in range(count)
                ]
            return new
        for key in heads:
            new[key] = mean([a[key] for a in arrays], w)
        routers = [
            record_to_state(r.content.array_records[FEDLEASE_ROUTER]) for r in replies
        ]
        for e in range(len(kept["experts"])):
            members = [i for i, n in enumerate(nodes) if strategy.expert_of(n) == e]
            if not members:
                continue
            ws = [w[i] for i in members]
            for k in (*a_keys, *b_keys):
                kept["experts"][e][k] = mean([arrays[i][k] for i in members], ws)
            for name in kept["routers"][e]:
                kept["routers"][e][name] = mean([routers[i][name] for i in members], ws)
        return new

    return step


# -------------------------------------------------------------------- table
TEXT, VISION, CONTINUAL = "text", "vision", "continual"
ASSETS = {TEXT: ["polarity", "minilm"], VISION: [], CONTINUAL: ["mnist"]}


@dataclass(frozen=True)
class Case:
    """One registered method as the shared tester needs it.

    Attributes
    ----------
    method : str
    family : str
        ``text`` (tiny BERT on polarity), ``vision`` (CNN on digits) or
        ``continual`` (MLP on permuted MNIST): the base run config.
    effective : callable
        ``(strategy, global_state, node) -> tensors`` compared in property 1.
    overrides : mapping
        Run-config keys on top of the family's.
    extras : callable
        ``(strategy, round, arrays, current, seed) -> (records, metrics)``:
        the extra ArrayRecords and metrics of a valid reply.
    fixed_roles : tuple of Role
        Server-held arrays that agreeing clients must leave unchanged.
    reports_gap : bool
        Whether the round's metrics carry ``frobenius-gap``.
    warm_rounds : int
        Rounds of disagreeing clients before the round of properties 2 and 3.
    state_matters : bool
        A fresh strategy without the saved state must behave differently
        after ``warm_rounds`` (so the round-trip test can fail).
    skip : mapping of str to str
        Property (one of ``PROPERTIES``) -> why it does not apply.
    xfail : mapping of str to str
        Property -> the known library deviation (a strict xfail).
    reference : callable, optional
        The method's reference implementation (property 6): given the
        strategy (its options), a :data:`Step` ``(round, current, replies) ->
        expected new global state``, called once per round in order (it may
        keep state across rounds).
    """

    method: str
    family: str
    effective: Effective
    overrides: Mapping[str, Any] = field(default_factory=dict)
    extras: Extras = no_extras
    fixed_roles: tuple[Role, ...] = ()
    reports_gap: bool = True
    warm_rounds: int = 1
    state_matters: bool = False
    skip: Mapping[str, str] = field(default_factory=dict)
    xfail: Mapping[str, str] = field(default_factory=dict)
    reference: Reference | None = None


VERA_RANKS = {"vera-rank": 8, "sorf-rank": 4}
QRMIX = {"warmup-rounds": 1, "qrmix-k": 4}
STREAM = {"num-tasks": 3, "rounds-per-task": 1, "num-server-rounds": 3}
SORF_REFIT = (
    "known deviation: SorfVeRA.aggregate_updates always refits b (least squares "
    "to U_r Sigma_r) and d (polar fit to V_r^T) from the truncated SVD of the "
    "averaged update, even when the clients' agreed (b, m, theta) represent it "
    "exactly; on this plan the refit misses the agreed update by relative-gap "
    "~0.78 (refit_layer in fedlr/linalg/sorf_refit.py)"
)
ADAM_STEP = (
    "Adam's step is normalised: agreeing clients' update Delta moves each entry "
    "by about eta_t sign(Delta), not by Delta (see its reference test instead)"
)
ADAPTIVE_STEP = (
    "the adaptive step is normalised: in round 1 m_1 / sqrt(v_1) = c sign(Delta), "
    "so agreeing clients' update Delta moves each entry by about eta c sign(Delta) "
    "(c = 1 for FedAdagrad, (1 - beta1) / sqrt(1 - beta2) = 1 for FedYogi's "
    "defaults), not by Delta (see its reference test instead)"
)
FEDDYN_SHIFT = (
    "FedDyn's server state h moves the model beyond the clients' mean by design: "
    "agreeing clients' update Delta moves round 1's model by (1 + |P| / m) Delta "
    "(2 Delta when every node replies), not by Delta (see its reference test)"
)

SLORA_MASK = (
    "SLoRA's warm-up publishes only the masked entries of the adapted weights: "
    "agreeing clients' dense update moves the model by its masked part (see its "
    "reference test and tests/strategies/test_slora.py)"
)

RAVAN_CORES_UP = (
    "RAVAN's clients send their update as the ravan-cores record (s_h H_h), "
    "which the shared effective model of the arrays cannot see; agreeing "
    "clients are checked in tests/strategies/test_ravan.py and its reference here"
)

FEDASYNC_MIX = (
    "FedAsync mixes each reply in with weight alpha < 1 by design: agreeing "
    "clients' update Delta moves the model by (1 - (1 - alpha)^k) Delta after "
    "k replies, not by Delta (see its reference and tests/strategies/test_async.py)"
)

CASES: dict[str, Case] = {
    c.method: c
    for c in [
        Case("fedavg-lora", TEXT, lora_products),
        Case("fedprox-lora", TEXT, lora_products),
        Case("fedrot-lora", TEXT, lora_products, reference=weighted_mean_server),
        # server momentum / control variates: state the next round depends on
        Case("fedavgm-lora", TEXT, lora_products, state_matters=True),
        Case("scaffold-lora", TEXT, lora_products, state_matters=True),
        Case(
            "fedadam-lora",
            TEXT,
            lora_products,
            state_matters=True,
            skip={"fedavg": ADAM_STEP},
            reference=flower_fedadam,
        ),
        Case(
            "fedyogi-lora",
            TEXT,
            lora_products,
            state_matters=True,
            skip={"fedavg": ADAPTIVE_STEP},
            reference=flower_fedyogi,
        ),
        Case(
            "fedadagrad-lora",
            TEXT,
            lora_products,
            state_matters=True,
            skip={"fedavg": ADAPTIVE_STEP},
            reference=flower_fedadagrad,
        ),
        Case(
            "feddyn-lora",
            TEXT,
            lora_products,
            state_matters=True,
            skip={"fedavg": FEDDYN_SHIFT},
            reference=feddyn_server,
        ),
        Case("fedex-lora", TEXT, lora_products, fixed_roles=(Role.BASE,)),
        # disagreeing clients grow FedSpec's rank from 4 to 6 in the warm round
        Case("fedspec", TEXT, lora_products, state_matters=True),
        Case("fedsvd", TEXT, lora_products),
        Case("ffa-lora", TEXT, lora_products),
        # the update travels as cores in the ravan-cores record (see its reference)
        Case(
            "ravan",
            TEXT,
            lora_products,
            skip={"fedavg": RAVAN_CORES_UP},
            reference=ravan_server,
        ),
        # odd rounds train B, even rounds A: the row's rounds 1-3 cover both
        Case("rolora", TEXT, lora_products, reference=rolora_server),
        # two warm-up rounds: round 1 is stage 1, round 2 switches, 3 is LoRA
        Case(
            "slora",
            TEXT,
            lora_products,
            {"slora-warmup-rounds": 2, "slora-density": 0.05},
            skip={"fedavg": SLORA_MASK},
            reference=slora_server,
        ),
        # the global adapter is shared; the local one never leaves the node
        Case("feddpa", TEXT, lora_products, reference=weighted_mean_server),
        # round 1 warms up and allocates the experts; rounds 2, 3 mix them
        Case(
            "fedlease",
            TEXT,
            lora_products,
            state_matters=True,
            reference=fedlease_server,
        ),
        # one round per stage: 1 root (then the clustering), 2 cluster, 3 leaf
        Case(
            "hilora",
            TEXT,
            lora_products,
            {"hilora-root-rounds": 1, "hilora-cluster-rounds": 1},
            state_matters=True,
            reference=hilora_server,
        ),
        Case("fedsa-lora", TEXT, raw, extras=personal_gram),
        Case("local-svd", TEXT, raw, extras=personal_gram),
        # the server holds each node's lora_B until it delivers it
        Case("global-svd", TEXT, lora_products, state_matters=True),
        # heterogeneous-rank methods, here with every client at one rank
        Case("flexlora", TEXT, lora_products),
        Case("hetlora", TEXT, lora_products),
        Case("flora", TEXT, fresh_adapter_products),
        # asynchronous: a synchronous call's replies are fresh (staleness 0)
        Case("fedbuff-lora", TEXT, lora_products, reference=fedbuff_server),
        Case(
            "fedasync-lora",
            TEXT,
            lora_products,
            skip={"fedavg": FEDASYNC_MIX},
            reference=fedasync_server,
        ),
        Case(
            "ilora",
            TEXT,
            lora_products,
            fixed_roles=(Role.BASE,),
            reference=ilora_server,
        ),
        Case("fedavg-vera", TEXT, raw, VERA_RANKS, projection_echo),
        Case(
            "vera-fedex",
            TEXT,
            raw,
            VERA_RANKS,
            projection_echo,
            fixed_roles=(Role.BASE,),
        ),
        Case(
            "sorf-vera",
            TEXT,
            sorf_updates,
            VERA_RANKS,
            projection_echo,
            xfail={"fedavg": SORF_REFIT},
        ),
        Case("fedavg", VISION, raw, reports_gap=False),
        # property 1 runs in round 1, a warm-up (FedAvg) round; stage 2 (the
        # round of properties 2 and 3, with 'eigen' records) moves the head by
        # the ridge step gamma (H + tau I)^-1 b by design, see test_qrmix.py
        Case("qrmix", VISION, raw, QRMIX, qrmix_eigen, reports_gap=False),
        Case("fedavg-continual", CONTINUAL, raw, STREAM, reports_gap=False),
        # property 1 runs in task 0 (no bases: FedProject removes nothing);
        # tasks of one round make rounds 2 and 3 boundaries (sketches, bases)
        Case(
            "fot",
            CONTINUAL,
            raw,
            {**STREAM, "fot-sketch-dim": 16},
            fot_sketches,
            reports_gap=False,
            warm_rounds=2,
            state_matters=True,
        ),
    ]
}
"""One row per registered method."""


def params(prop: str) -> list[Any]:
    """``METHODS`` with the rows' known deviations of ``prop`` as strict xfails."""
    out: list[Any] = []
    for method in METHODS:
        reason = CASES[method].xfail.get(prop) if method in CASES else None
        mark = pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)
        out.append(pytest.param(method, marks=mark) if reason else method)
    return out


def case_of(method: str, prop: str) -> Case:
    """The method's row (none: the test fails); skip if ``prop`` does not apply."""
    if method not in CASES:
        pytest.fail(
            f"method '{method}' is registered but has no row in CASES of {__file__}"
        )
    case = CASES[method]
    if prop in case.skip:
        pytest.skip(case.skip[prop])
    return case


def run_config(case: Case, output_dir: Path) -> dict[str, Any]:
    """The case's flat run config (the family's base plus the overrides)."""
    if case.family == TEXT:
        return tiny_run_config(output_dir, method=case.method, **case.overrides)
    common = {"seed": 3, "device": "cpu", "output-dir": str(output_dir)}
    if case.family == VISION:
        base = {"model": "cnn", "dataset": "digits", "num-partitions": 3, "lr": 0.05}
    else:
        base = {
            "model": "mlp",
            "dataset": "permuted-mnist",
            "num-partitions": 3,
            "task-examples": 200,
            "lr": 0.1,
        }
    return {"method": case.method, **common, **base, **case.overrides}


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ServerPlan]:
    """Each method's server plan, built once per module from its row.

    No round ever runs on a cached plan's strategy: :func:`fresh` hands out
    deep copies of it (the strategy as the plan built it).
    """
    from fedlr.data.assets import ensure_assets

    built: dict[str, ServerPlan] = {}

    def plan(method: str) -> ServerPlan:
        if method not in built:
            case = CASES[method]
            ensure_assets(ASSETS[case.family], quiet=True)
            config = resolve(run_config(case, tmp_path_factory.mktemp(method)))
            built[method] = build_plan(config)
        return built[method]

    return plan


def fresh(plan: ServerPlan) -> FedLRStrategy:
    """A strategy as the plan built it (nothing aggregated yet)."""
    return copy.deepcopy(plan.strategy)


# ------------------------------------------------------------------ helpers
def configure(
    strategy: FedLRStrategy,
    plan: ServerPlan,
    server_round: int,
    state: Mapping[str, torch.Tensor],
    num_nodes: int = len(NODES),
) -> dict[int, Message]:
    """The round's instructions to nodes ``1000 ..``, by node."""
    grid = InProcessGrid(ClientApp(), num_nodes=num_nodes, run_config={})
    messages = strategy.configure_train(
        server_round, ArrayRecord(dict(state)), ConfigRecord(plan.train_config), grid
    )
    return {int(m.metadata.dst_node_id): m for m in messages}


def trained(strategy: Any, current: Mapping[str, torch.Tensor], seed: int) -> State:
    """A client's trained arrays: the ones it was sent plus a seeded update.

    Keys it was not sent start from the seeded initial state the server bound
    (the adapter every node builds), else from zero.
    """
    g = torch.Generator().manual_seed(seed)
    initial = getattr(strategy, "initial_state", {})
    out: State = {}
    for key, shape in sorted(strategy.reply_shapes().items()):
        if key in current:
            base = current[key]
        elif key in initial:
            base = initial[key]
        else:
            base = torch.zeros(shape)
        out[key] = base + 0.1 * torch.randn(shape, generator=g, dtype=base.dtype)
    return out


def make_reply(
    case: Case,
    strategy: FedLRStrategy,
    server_round: int,
    node: int,
    arrays: Mapping[str, torch.Tensor],
    num_examples: int,
    current: Mapping[str, torch.Tensor],
    seed: int,
) -> Message:
    """A reply of ``node`` carrying ``arrays`` and the case's (valid) extras."""
    records, metrics = case.extras(strategy, server_round, arrays, current, seed)
    message = reply(
        node,
        dict(arrays),
        {protocol.NUM_EXAMPLES: num_examples, protocol.TRAIN_LOSS: 0.5, **metrics},
    )
    for name, tensors in records.items():
        message.content[name] = state_to_record(tensors)
    return message


def distinct_replies(
    case: Case,
    strategy: FedLRStrategy,
    server_round: int,
    current: Mapping[str, torch.Tensor],
) -> list[Message]:
    """Valid replies of nodes ``NODES`` that disagree (seeded by round and node)."""
    out = []
    for node, n in zip(NODES, WEIGHTS, strict=True):
        seed = SEED + 100 * server_round + node
        arrays = trained(strategy, current, seed)
        out.append(
            make_reply(case, strategy, server_round, node, arrays, n, current, seed)
        )
    return out


def warm(case: Case, plan: ServerPlan) -> tuple[FedLRStrategy, State]:
    """A fresh strategy after ``case.warm_rounds`` rounds of disagreeing clients."""
    strategy = fresh(plan)
    state = dict(plan.initial_arrays)
    for server_round in range(1, case.warm_rounds + 1):
        configure(strategy, plan, server_round, state)
        replies = distinct_replies(case, strategy, server_round, state)
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        assert arrays is not None and metrics is not None
        assert metrics["dropped"] == 0, strategy.round.dropped
        state = record_to_state(arrays)
    return strategy, state


def tolerance(want: torch.Tensor, eps: float) -> float:
    """``K eps max(shape)`` relative to the largest entry of ``want``."""
    scale = max(float(want.abs().max()), eps) if want.numel() else eps
    return K * eps * max(want.shape, default=1) * scale


def assert_close(got: State, want: State, eps: float, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        assert got[key].shape == want[key].shape, (what, key)
        err = float((got[key].double() - want[key].double()).abs().max())
        bound = tolerance(want[key].double(), eps)
        assert err <= bound, f"{what} '{key}': max error {err:.3g} > {bound:.3g}"


def assert_same_messages(a: dict[int, Message], b: dict[int, Message]) -> None:
    """Same nodes, and per node the same records with equal contents."""
    assert a.keys() == b.keys()
    for node in a:
        ca, cb = a[node].content, b[node].content
        assert set(ca.array_records) == set(cb.array_records), node
        for name in ca.array_records:
            assert_same(
                record_to_state(ca.array_records[name]),
                record_to_state(cb.array_records[name]),
                f"node {node} '{name}'",
            )
        assert set(ca.config_records) == set(cb.config_records), node
        for name in ca.config_records:
            assert dict(ca.config_records[name]) == dict(cb.config_records[name])
        assert not ca.metric_records and not cb.metric_records


def assert_same(a: Any, b: Any, path: str) -> None:
    """Equal nested state: tensors bit for bit, NaN equal to NaN."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, path
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), (path, set(a), set(b))
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, (path, a, b)


# ---------------------------------------------------------------- the table
def test_every_registered_method_has_a_row():
    assert sorted(CASES) == METHODS
    for name, case in CASES.items():
        assert case.family in ASSETS, name
        assert set(case.skip) | set(case.xfail) <= set(PROPERTIES), name
        assert not set(case.skip) & set(case.xfail), name
        assert case.warm_rounds >= 1, name


# -------------------------------------------------- 1. reduces to FedAvg
@pytest.mark.parametrize("method", params("fedavg"))
def test_reduces_to_fedavg_when_all_clients_agree(method, plans):
    case = case_of(method, "fedavg")
    plan = plans(method)
    strategy = fresh(plan)
    current = dict(plan.initial_arrays)
    assert configure(strategy, plan, 1, current).keys() == set(NODES)
    common = trained(strategy, current, SEED)
    replies = [
        make_reply(case, strategy, 1, node, common, n, current, SEED)
        for node, n in zip(NODES, WEIGHTS, strict=True)
    ]
    start = _effective_before(case, strategy, current)
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None
    assert metrics["clients"] == 3 and metrics["dropped"] == 0, strategy.round.dropped
    new = record_to_state(arrays)
    eps = torch.finfo(next(iter(common.values())).dtype).eps
    client = {**current, **common}
    for node in NODES:
        want = case.effective(strategy, client, node)
        assert want, "the effective model compares nothing"
        assert_close(case.effective(strategy, new, node), want, eps, method)
    # not vacuous: the agreed update moved the effective model
    assert any(
        float((want[k] - start[k]).abs().max()) > tolerance(want[k], eps)
        for k in want.keys() & start.keys()
    ), "the common update did not change the effective model"
    fixed = strategy.layout.keys(*case.fixed_roles) if case.fixed_roles else []
    assert all(k in current for k in fixed)
    assert_close(
        {k: new[k] for k in fixed}, {k: current[k] for k in fixed}, eps, "fixed"
    )
    assert ("frobenius-gap" in metrics) == case.reports_gap
    if case.reports_gap:
        width = max(max(s) for s in strategy.reply_shapes().values())
        assert metrics["frobenius-gap"] >= 0.0
        assert metrics["relative-gap"] <= K * eps * width, dict(metrics)


def _effective_before(case: Case, strategy: FedLRStrategy, state: State) -> State:
    """The effective model of the initial arrays, where it is defined."""
    try:
        return case.effective(strategy, state, NODES[0])
    except KeyError:  # Global SVD: no personal lora_B before round 1
        return raw(strategy, state, NODES[0])


# ---------------------------------------------------- 2. wrong keys dropped
@pytest.mark.parametrize("method", params("wrong-keys"))
def test_reply_with_a_missing_or_an_extra_key_is_dropped(method, plans):
    case = case_of(method, "wrong-keys")
    plan = plans(method)
    server_round = case.warm_rounds + 1
    with_bad, state = warm(case, plan)
    only_valid, _ = warm(case, plan)
    # equal populations: both strategies instruct the same nodes; the bad
    # replies take the place of two nodes' replies, they are not added
    sent = configure(with_bad, plan, server_round, state, len(ROUND_NODES))
    assert sent.keys() == set(ROUND_NODES)
    clean_sent = configure(only_valid, plan, server_round, state, len(ROUND_NODES))
    assert_same_messages(sent, clean_sent)

    valid = distinct_replies(case, with_bad, server_round, state)
    missing_key = sorted(with_bad.reply_shapes())[0]
    short = trained(with_bad, state, SEED + MISSING_NODE)
    del short[missing_key]
    longer = trained(with_bad, state, SEED + EXTRA_NODE)
    longer[EXTRA_KEY] = torch.zeros(2)
    bad = [
        make_reply(case, with_bad, server_round, node, arrays, 9, state, SEED + node)
        for node, arrays in ((MISSING_NODE, short), (EXTRA_NODE, longer))
    ]
    replies = [*valid[:2], *bad, valid[2]]
    arrays, metrics = with_bad.aggregate_train(server_round, replies)
    assert arrays is not None and metrics is not None
    assert metrics["dropped"] == 2 and metrics["clients"] == 3
    assert metrics[protocol.NUM_EXAMPLES] == sum(WEIGHTS)
    reasons = with_bad.round.dropped
    assert len(reasons) == 2, reasons
    (short_reason,) = [r for r in reasons if f"node {MISSING_NODE} " in r]
    (extra_reason,) = [r for r in reasons if f"node {EXTRA_NODE} " in r]
    assert f"1 missing ['{missing_key}']" in short_reason
    assert f"1 unexpected ['{EXTRA_KEY}']" in extra_reason

    expected, clean = only_valid.aggregate_train(
        server_round, distinct_replies(case, only_valid, server_round, state)
    )
    assert expected is not None and clean is not None
    # the two silent nodes are dropped as silent; the same three are aggregated
    assert clean["clients"] == 3 and clean["dropped"] == 2
    assert clean[protocol.NUM_EXAMPLES] == metrics[protocol.NUM_EXAMPLES]
    silent = sorted(only_valid.round.dropped)
    assert [r.split(":")[0] for r in silent] == [
        f"node {n}" for n in (MISSING_NODE, EXTRA_NODE)
    ]
    assert all("no reply" in r for r in silent), silent
    assert_same(record_to_state(arrays), record_to_state(expected), "arrays")


# ------------------------------------------------ 3. state_dict round-trip
@pytest.mark.parametrize("method", params("state"))
def test_state_dict_round_trips(method, plans):
    case = case_of(method, "state")
    plan = plans(method)
    server_round = case.warm_rounds + 1
    ran, state = warm(case, plan)
    saved = copy.deepcopy(ran.state_dict())
    resumed = fresh(plan)
    resumed.load_state_dict(copy.deepcopy(saved))

    def next_round(strategy: FedLRStrategy) -> dict[str, Any]:
        behaviour = {
            "reply_shapes": strategy.reply_shapes(),
            "round_config": strategy.round_config(server_round),
            "messages": configure(strategy, plan, server_round, state),
        }
        replies = distinct_replies(case, strategy, server_round, state)
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        assert arrays is not None and metrics is not None
        assert metrics["dropped"] == 0, strategy.round.dropped
        behaviour["arrays"] = record_to_state(arrays)
        behaviour["metrics"] = dict(metrics)
        behaviour["state_dict"] = strategy.state_dict()
        return behaviour

    def assert_same_behaviour(a: dict[str, Any], b: dict[str, Any]) -> None:
        assert_same_messages(a.pop("messages"), b.pop("messages"))
        assert_same(a, b, "next round")

    expected = next_round(ran)
    assert_same_behaviour(next_round(resumed), dict(expected))

    if case.state_matters:  # not vacuous: without the state it diverges
        try:
            assert_same_behaviour(next_round(fresh(plan)), dict(expected))
        except (AssertionError, FedLRError):  # FedSpec: arrays at another rank
            pass
        else:
            pytest.fail("the saved state changed nothing: state_matters is wrong")

    for bad in ({"no-such-state": 1}, {**saved, "no-such-state": 1}):
        with pytest.raises(ValueError, match="no-such-state"):
            fresh(plan).load_state_dict(bad)


# ----------------------------------------------------------- 4. the options
def _bad_values(kind: str) -> list[Any]:
    """Values of the wrong type, and out of the range of every numeric key."""
    if kind == "int":
        return ["not-a-number", 2.5, True, -1]
    return ["not-a-number", True, float("nan"), float("inf")]


@pytest.mark.parametrize("method", params("options"))
def test_options_are_typed_documented_and_validated(method, plans):
    case_of(method, "options")
    spec = get_method(method)
    assert spec.name == method
    assert issubclass(spec.options, spec.payload.options)
    bare = resolve({"method": method})
    assert bare.spec is spec
    assert type(bare.options) is spec.options and bare.options == spec.options()
    assert type(plans(method).strategy) is spec.strategy
    with pytest.raises(ConfigError, match="no-such-key"):
        resolve({"method": method, "no-such-key": 1})
    for key, f in spec.options.option_fields().items():
        assert str(f.metadata.get("help", "")).strip(), f"'{key}' has no help text"
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        assert kind in ("int", "float", "str", "bool"), (key, kind)
        if kind not in ("int", "float"):
            continue  # string keys: their values are checked per key elsewhere
        assert resolve({"method": method, key: f.default}).options == spec.options()
        for value in _bad_values(kind):
            with pytest.raises(ConfigError) as info:
                resolve({"method": method, key: value})
            assert info.value.key == key, (key, value, str(info.value))
            assert f"'{key}'" in str(info.value)


# -------------------------------------------------------- 5. rejected rounds
BOOKKEEPING = frozenset({"round"})
"""What a rejected round must change: the round's value (its rejection, the
run's count of rejected rounds, its report)."""
CACHES = frozenset({("BaseLedger", "_source")})
"""Caches a restored state may forget: the ledger's ``_source`` (the objects
it last checksummed; forgetting it costs one checksum pass)."""


def _plain(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """``value`` as nested dicts, lists and tensors (objects by their
    attributes), copied, for :func:`assert_same`."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if id(value) in seen:
        return "<cycle>"
    seen = seen | {id(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v, seen) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return [_plain(v, seen) for v in sorted(value, key=repr)]
    if isinstance(value, (list, tuple)):
        return [_plain(v, seen) for v in value]
    if callable(value) and not hasattr(value, "__dict__"):
        return repr(type(value))
    if hasattr(value, "__dict__") and not isinstance(value, type):
        name = type(value).__name__
        kept = {k: v for k, v in vars(value).items() if (name, k) not in CACHES}
        return {"<type>": name, **_plain(kept, seen)}
    return copy.deepcopy(value)


def _attributes(strategy: FedLRStrategy) -> dict[str, Any]:
    return {
        name: _plain(value)
        for name, value in vars(strategy).items()
        if name not in BOOKKEEPING and name != "replies"
    }


@pytest.mark.parametrize("method", params("state"))
def test_a_rejected_round_changes_nothing_the_method_keeps(method, plans):
    """Every attribute the method's aggregation changed is put back when the
    publish check refuses the result (here: ``max_update_ratio`` ~ 0)."""
    case = case_of(method, "state")
    plan = plans(method)
    server_round = case.warm_rounds + 1
    strategy, state = warm(case, plan)
    configure(strategy, plan, server_round, state)
    replies = distinct_replies(case, strategy, server_round, state)
    before: dict[str, Any] = {}
    aggregate = strategy.aggregate_updates

    def spy(*args: Any, **kwargs: Any) -> Any:  # the state the method starts from
        before.update(_attributes(strategy))
        return aggregate(*args, **kwargs)

    strategy.aggregate_updates = spy  # type: ignore[method-assign]
    strategy.max_update_ratio = 1e-300
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    assert arrays is None and metrics is not None and metrics["rejected"] == 1.0
    assert before, "the method never ran"
    after = _attributes(strategy)
    after.pop("max_update_ratio"), before.pop("max_update_ratio")
    assert_same(after, before, type(strategy).__name__)


# ------------------------------------------ 6. the reference implementation
REFERENCE_ROUNDS = 3
"""Rounds compared: the first (moments from zero) and two that carry them."""


@pytest.mark.parametrize(
    "method", [m for m in METHODS if m in CASES and CASES[m].reference is not None]
)
def test_the_method_matches_its_reference_implementation(
    method: str, plans: Callable[[str], ServerPlan]
) -> None:
    case = CASES[method]
    assert case.reference is not None
    plan = plans(method)
    strategy = fresh(plan)
    reference = case.reference(strategy)
    state = dict(plan.initial_arrays)
    for server_round in range(1, REFERENCE_ROUNDS + 1):
        configure(strategy, plan, server_round, state)
        replies = distinct_replies(case, strategy, server_round, state)
        want = reference(server_round, dict(state), replies)
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        assert arrays is not None and metrics is not None
        assert metrics["dropped"] == 0, strategy.round.dropped
        got = record_to_state(arrays)
        eps = torch.finfo(next(iter(state.values())).dtype).eps
        assert_close(got, want, eps, f"{method} round {server_round}")
        # not vacuous: the round moved the arrays beyond the tolerance
        assert any(
            float((got[k].double() - state[k].double()).abs().max())
            > tolerance(want[k].double(), eps)
            for k in got.keys() & state.keys()
        ), f"round {server_round} changed nothing"
        state = got
