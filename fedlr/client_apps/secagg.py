"""The node's side of secure aggregation: Flower's ``secaggplus_mod``, adapted.

:func:`secagg_mod` wraps the ClientApp's ``train`` handler. A train message
without the SecAgg+ ConfigRecord (``secaggplus_configs``) passes straight
through, so a plain run is unchanged. With it, Flower's
``flwr.client.mod.secaggplus_mod`` runs the protocol's four stages (key
set-up, encrypted Shamir shares, masked vector, unmasking shares); at the
masked-vector stage it calls the fedlr handler through :func:`_as_fit_reply`,
which turns the fedlr reply into what that mod reads (Flower's legacy
``FitRes`` records):

* the summands of :func:`fedlr.privacy.secagg.flatten_summands`: the main
  record's arrays times ``n_i / s`` (``s`` sent by the server as
  ``weight-scale``), extra records as they are, with ``num_examples = 1`` and
  ``max_weight = 1``, so Flower's weighting multiplies by exactly 1;
* in plain, the reply's MetricRecord (``num-examples``, the loss, as in
  Flower's SecAgg+) and a manifest (``record/key``, shape, dtype per summand,
  and how many entries the clipping range cut).

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
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedlr import protocol
from fedlr.config import RunConfig
from fedlr.privacy.secagg import flatten_summands

__all__ = [
    "FEDLR_RECORD",
    "MANIFEST_RECORD",
    "secagg_mod",
]

FEDLR_RECORD = "fedlr-secagg"
"""ConfigRecord of a masked-vector instruction: ``weight-scale`` (``s``),
``weighted-record`` (the record whose mean is weighted by examples) and
``clipping-range`` (``c``, to count the clipped entries)."""
MANIFEST_RECORD = "fedlr-secagg-manifest"
"""ConfigRecord of a masked-vector reply: ``names``, ``shapes`` (flat, with
``ndims``), ``dtypes`` of the summands, and ``clipped``."""
WEIGHT_SCALE = "weight-scale"
WEIGHTED_RECORD = "weighted-record"
CLIPPING_RANGE = "clipping-range"
_FIT = ("fitres.parameters", "fitres.num_examples", "fitres.metrics", "fitres.status")


def secagg_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Run Flower's SecAgg+ client stages around fedlr's train handler."""
    if (
        msg.metadata.message_type != MessageType.TRAIN
        or not msg.has_content()
        or RECORD_KEY_CONFIGS not in msg.content.config_records
    ):
        return call_next(msg, ctxt)
    saved: list[Any] = []

    def train(inner: Message, context: Context) -> Message:
        return _as_fit_reply(inner, context, call_next, saved)

    try:
        reply = secaggplus_mod(msg, ctxt, train)
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
    scale = float(cast(float, options[WEIGHT_SCALE]))
    weighted = str(options[WEIGHTED_RECORD])
    limit = float(cast(float, options[CLIPPING_RANGE]))
    # the fedlr handler sees the instruction of a plain round
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
    records = {
        name: {key: record[key].numpy() for key in record}
        for name, record in out.array_records.items()
    }
    manifest, values = flatten_summands(
        records, weighted=weighted, weight=examples / scale
    )
    clipped = int(sum(int((np.abs(v) > limit).sum()) for v in values))

    saved.append(np.random.get_state())
    config = RunConfig.from_mapping(ctxt.run_config)
    round_config = content.config_records.get(protocol.CONFIG, ConfigRecord())
    server_round = int(cast(int, round_config.get(protocol.SERVER_ROUND, 0)))
    partition = int(cast(int, ctxt.node_config.get(protocol.PARTITION_ID, 0)))
    seed = np.random.SeedSequence([config.seed, server_round, partition])
    np.random.seed(int(seed.generate_state(1)[0]))

    fit = RecordDict(
        {
            name: record
            for name, record in out.items()
            if not isinstance(record, ArrayRecord)
        }
    )
    fit["fitres.parameters"] = ArrayRecord(
        {str(i): Array.from_numpy_ndarray(value) for i, value in enumerate(values)}
    )
    fit["fitres.num_examples"] = MetricRecord({"num_examples": 1})
    fit["fitres.metrics"] = ConfigRecord({})
    fit["fitres.status"] = ConfigRecord({"code": 0, "message": "Success"})
    fit[MANIFEST_RECORD] = ConfigRecord(
        {
            "names": [s.name for s in manifest],
            "ndims": [len(s.shape) for s in manifest],
            "shapes": [int(n) for s in manifest for n in s.shape],
            "dtypes": [s.dtype for s in manifest],
            "clipped": clipped,
        }
    )
    return Message(fit, reply_to=msg)
