"""The node's side of secure aggregation: Flower's ``secaggplus_mod``, adapted.

:func:`secagg_mod` wraps the ClientApp's ``train`` handler. A train message
without the SecAgg+ ConfigRecord (``secaggplus_configs``) passes straight
through, so a plain run is unchanged. With it, Flower's
``flwr.client.mod.secaggplus_mod`` runs the protocol's four stages (key
set-up, encrypted Shamir shares, masked vector, unmasking shares; the guard
answers fedlr's consistency round between the last two); at the
masked-vector stage it calls the fedlr handler through :func:`_as_fit_reply`,
which turns the fedlr reply into what that mod reads (Flower's legacy
``FitRes`` records):

* the summands of :func:`fedlr.privacy.secagg.flatten_summands`: the main
  record's arrays times ``n_i / s`` (``s`` sent by the server as
  ``weight-scale``), extra records as they are, with ``num_examples = 1`` and
  ``max_weight = 1``, so Flower's weighting multiplies by exactly 1;
* before that, the update of the main record (its arrays minus the ones
  the instruction sent) scaled down to ``secagg-client-clip`` times the
  received arrays' norm, the bound read from the node's own run config
  (:func:`fedlr.privacy.secagg.clip_update`; a non-finite update is not
  masked: the node's reply is an error and it counts as a dropout). It
  stops a faulty client (a diverged step); a malicious client runs its own
  code and skips it;
* a last summand of the per-client scalars the server asks for
  (``scalar-keys``, :class:`fedlr.privacy.secagg.SecureScalars`):
  ``num-examples``, ``n_i`` times the loss, the entries the clipping range
  cut, FOT's ``gpse-examples`` and weighted ``gpse-fraction.*``, summed
  exactly inside the masked vector; under distributed client DP only the
  clipping counts (:data:`DP_RELEASED`).

Nothing else leaves the node in the clear: no MetricRecord, no
``partition-id``, no names, shapes or dtypes of the arrays (the server
derives them from what it sent). Every stage message first passes the
node's guard (:func:`fedlr.client_apps.secagg_guard.secagg_guard`).

The mod masks and quantises the summands; its reply carries the masked
vector and none of the arrays. The stochastic rounding draws from NumPy's
global generator, seeded here by the run's ``seed``, the round and the
partition, and restored after the mod, so a run is reproducible and the
node's other uses of NumPy see what they would in a plain run.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from numpy.typing import NDArray

from fedlr.client_apps.secagg_guard import secagg_guard, secagg_stage
from fedlr.config.run import RunConfig
from fedlr.errors import ProtocolError
from fedlr.privacy import distributed_dp as ddp
from fedlr.privacy.node_policy import node_policy
from fedlr.privacy.secagg import SecureScalars, clip_update, flatten_summands
from fedlr.wire import protocol

__all__ = ["DP_THRESHOLD", "FEDLR_RECORD", "secagg_mod"]

FEDLR_RECORD = "fedlr-secagg"
"""ConfigRecord of a masked-vector instruction: ``weight-scale`` (``s``),
``weighted-record`` (the record whose mean is weighted by examples),
``clipping-range`` (``c``, to count the clipped entries) and the secure
scalars: ``scalar-keys``, ``scalar-weights``, ``scalar-base``."""
WEIGHT_SCALE = "weight-scale"
WEIGHTED_RECORD = "weighted-record"
CLIPPING_RANGE = "clipping-range"
SCALAR_KEYS = "scalar-keys"
SCALAR_WEIGHTS = "scalar-weights"
SCALAR_BASE = "scalar-base"
CLIPPED = "secagg-clipped"
"""Secure scalar: the summand entries the clipping range cut."""
DP_THRESHOLD = "dp-threshold"
"""Distributed client DP (:mod:`fedlr.privacy.distributed_dp`): the survivors
``t`` the node's Skellam noise is sized for; absent without it."""
DP_RELEASED = (CLIPPED, ddp.DP_CLIPPED)
"""Under distributed client DP the only secure scalars a node releases: the
clipping counts. ``num-examples`` and the loss are functions of its data
that the Skellam noise does not cover, so a key the server asks beyond
these sums a 0 (the release is ``x + S / m`` and needs no weight)."""
LOSS_EXAMPLES = "train-loss-examples"
"""Secure scalar: ``num-examples`` of a client that reported a loss (the
weight of ``train-loss``)."""
_FIT = ("fitres.parameters", "fitres.num_examples", "fitres.metrics", "fitres.status")


def secagg_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Run Flower's SecAgg+ client stages around fedlr's train handler."""
    if secagg_stage(msg) is None:
        return call_next(msg, ctxt)
    saved: list[Any] = []

    def train(inner: Message, context: Context) -> Message:
        return _as_fit_reply(inner, context, call_next, saved)

    def secure(inner: Message, context: Context) -> Message:
        return secaggplus_mod(inner, context, train)

    try:
        reply = secagg_guard(msg, ctxt, secure)
    finally:
        if saved:
            np.random.set_state(saved[0])
    if reply.has_content():
        for name in _FIT:
            if name in reply.content:
                del reply.content[name]
    return reply


def _as_fit_reply(
    msg: Message, ctxt: Context, call_next: ClientAppCallable, saved: list[Any]
) -> Message:
    """fedlr's train reply as the summands ``secaggplus_mod`` masks."""
    content = msg.content
    options = content.config_records[FEDLR_RECORD]
    limit = float(cast(float, options[CLIPPING_RANGE]))
    metrics, records = _plain_reply(msg, ctxt, call_next)
    examples = float(cast(float, metrics[protocol.NUM_EXAMPLES]))
    config = RunConfig.from_mapping(ctxt.run_config)
    round_config = content.config_records.get(protocol.CONFIG, ConfigRecord())
    server_round = int(cast(int, round_config.get(protocol.SERVER_ROUND, 0)))
    partition = int(cast(int, ctxt.node_config.get(protocol.PARTITION_ID, 0)))
    weighted = str(options[WEIGHTED_RECORD])
    received = content.array_records.get(weighted)
    base = {key: received[key].numpy() for key in received} if received else {}
    cut = 0.0
    if DP_THRESHOLD in options:  # distributed client DP: the noised update
        where = (int(cast(int, options[DP_THRESHOLD])), server_round, partition)
        allow = node_policy(ctxt.node_config).dp_allow_reproducible_noise
        values, cut = _noised_update(
            records, base, weighted, config, limit, where, allow
        )
    else:
        if weighted in records and received is not None:
            records[weighted], _ = clip_update(
                records[weighted], base, config.secagg.client_clip
            )
        scale = float(cast(float, options[WEIGHT_SCALE]))
        _, values = flatten_summands(
            records, weighted=weighted, weight=examples / scale
        )
    clipped = int(sum(int((np.abs(v) > limit).sum()) for v in values))
    values.append(_scalars(options, metrics, clipped, cut))

    saved.append(np.random.get_state())
    seed = np.random.SeedSequence([config.seed, server_round, partition])
    np.random.seed(int(seed.generate_state(1)[0]))
    return Message(_fit_content(values), reply_to=msg)


def _plain_reply(
    msg: Message, ctxt: Context, call_next: ClientAppCallable
) -> tuple[MetricRecord, dict[str, dict[str, Any]]]:
    """The fedlr handler's reply to the instruction of a plain round: its one
    MetricRecord and its arrays (NumPy), its weight checked against the
    round's ``weight-scale``."""
    content = msg.content
    scale = float(cast(float, content.config_records[FEDLR_RECORD][WEIGHT_SCALE]))
    msg.content = RecordDict(
        {
            name: record
            for name, record in content.items()
            if name not in (RECORD_KEY_CONFIGS, FEDLR_RECORD)
        }
    )
    reply = call_next(msg, ctxt)
    if reply.has_error():
        raise RuntimeError(f"the train handler failed: {reply.error.reason}")
    out = reply.content
    metrics = list(out.metric_records.values())
    if len(metrics) != 1 or protocol.NUM_EXAMPLES not in metrics[0]:
        raise RuntimeError(
            f"a secure reply needs one MetricRecord with '{protocol.NUM_EXAMPLES}'"
        )
    examples = float(cast(float, metrics[0][protocol.NUM_EXAMPLES]))
    if not 0 < examples <= scale:
        raise ProtocolError(
            f"num-examples {examples:g} is outside (0, weight-scale {scale:g}]: "
            "the node does not send a weight above the scale"
        )
    records = {
        name: {key: record[key].numpy() for key in record}
        for name, record in out.array_records.items()
    }
    return metrics[0], records


def _scalars(
    options: ConfigRecord, metrics: MetricRecord, clipped: int, cut: float
) -> NDArray[np.float64]:
    """The reply's scalar metrics, encoded as one more masked summand (under
    distributed client DP, the clipping counts only)."""
    scalars = SecureScalars(
        tuple(cast(list[str], options.get(SCALAR_KEYS, []))),
        tuple(cast(list[str], options.get(SCALAR_WEIGHTS, []))),
        int(cast(int, options.get(SCALAR_BASE, 2))),
        float(cast(float, options[CLIPPING_RANGE])),
    )
    plain = {
        key: float(cast(float, value))
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    loss = protocol.train_loss_of(metrics)
    examples = float(cast(float, metrics[protocol.NUM_EXAMPLES]))
    plain[protocol.TRAIN_LOSS] = loss
    plain[LOSS_EXAMPLES] = examples if np.isfinite(loss) else 0.0
    plain[CLIPPED] = float(clipped)
    plain[ddp.DP_CLIPPED] = cut
    if DP_THRESHOLD in options:  # nothing un-noised of the data: counts only
        plain = {key: plain[key] for key in DP_RELEASED}
    return scalars.encode(plain)


def _fit_content(values: list[Any]) -> RecordDict:
    """The summands as Flower's legacy ``fitres`` records, which
    ``secaggplus_mod`` masks (nothing of the handler's reply in the clear)."""
    fit = RecordDict()
    fit["fitres.parameters"] = ArrayRecord(
        {str(i): Array.from_numpy_ndarray(value) for i, value in enumerate(values)}
    )
    fit["fitres.num_examples"] = MetricRecord({"num_examples": 1})
    fit["fitres.metrics"] = ConfigRecord({})
    fit["fitres.status"] = ConfigRecord({"code": 0, "message": "Success"})
    return fit


def _noised_update(
    records: dict[str, dict[str, Any]],
    base: dict[str, Any],
    weighted: str,
    config: RunConfig,
    limit: float,
    where: tuple[int, int, int],
    allow: bool,
) -> tuple[list[Any], float]:
    """Distributed client DP's summands: the update (reply minus the arrays
    received, ``base``) clipped to ``client-dp-clip``, plus Skellam noise on the
    quantiser's grid (:mod:`fedlr.privacy.distributed_dp`); 1.0 if clipped.

    ``where`` is ``(t, round, partition)``. The clip, ``z``, the step and the
    noise source come from the node's own run config (reproducible noise
    only with its own ``dp-allow-reproducible-noise``, ``allow``); only the
    threshold ``t`` comes from the server, and the node's guard
    (:mod:`fedlr.client_apps.secagg_guard`) refuses one that is not the
    round's set-up threshold (``t > share_num / 2``, which the unmasking needs
    from surviving nodes, so the sum always holds at least ``t`` shares of
    noise).

    Raises
    ------
    ProtocolError
        If the node's config has no client DP, ``t`` is below 2, the reply
        has records besides ``weighted`` or arrays the instruction lacks.
    """
    threshold, server_round, partition = where
    settings = config.privacy.client_dp
    if settings is None or threshold < 2:
        raise ProtocolError(
            f"the server asked for distributed client DP (t = {threshold}) but "
            "this node's run config has client-dp-clip = 0 or t < 2"
        )
    extra = sorted(set(records) - {weighted})
    arrays = records.get(weighted, {})
    if extra or any(
        k not in base or base[k].shape != a.shape for k, a in arrays.items()
    ):
        raise ProtocolError(
            f"distributed client DP clips the update of '{weighted}' only: the "
            f"reply has records {extra} or arrays the instruction did not send"
        )
    update = {weighted: {k: a.astype(np.float64) - base[k] for k, a in arrays.items()}}
    _, values = flatten_summands(update, weighted=weighted, weight=1.0)
    values, cut = ddp.clip_update(values, settings.clip)
    step = 2.0 * limit / config.secagg.quantization_range
    mu = ddp.client_mu(settings.noise_multiplier, settings.clip, step, threshold)
    generator = ddp.noise_generator(
        settings.reproducible and allow, settings.seed, server_round, partition
    )
    noised = [v + ddp.skellam(v.shape, mu, generator) * step for v in values]
    return noised, 1.0 if cut else 0.0
