"""LoRA ClientApp payload: train the roles the strategy asks for, send them back.

Protocol (see docs/architecture.md):

* instruction: ArrayRecord ``arrays`` with the global tensors keyed as in the
  adapter layout (A, B, head, and for FedEx the base weights), ConfigRecord
  ``config`` with ``server-round``, ``lr``, ``local-steps``, ``batch-size`` and
  ``train-roles`` (comma-separated role names);
* reply: ArrayRecord ``arrays`` with exactly the tensors of ``train-roles``,
  MetricRecord ``metrics`` with ``num-examples``, ``train-loss``,
  ``partition-id`` and ``personal-loaded`` (1 if the client started from
  personal arrays it kept or received, else 0).

Optional ConfigRecord keys of the SVD family of methods:

* ``lora-rank``: the adapter's rank this round (FedSpec grows it); the client
  rebuilds its adapter at that rank when it differs from the run config's;
* ``keep-roles``: roles trained but kept in the client's ``context.state``
  (record ``personal``) instead of being sent (FedSA-LoRA's ``B``); the reply
  then also carries an ArrayRecord ``personal-gram`` with ``B^T B`` (r x r) per
  adapted layer, keyed by the layer's ``B`` key, from which the server measures
  how much aggregation changed the client's update;
* ``client-svd``: before replying, rewrite each layer's ``(B, A)`` as balanced
  singular factors (Local SVD) so the sent ``A`` is the input-side factor;
* ``personal-split``: train on the client's own train part and evaluate on its
  own held-out part (personalised evaluation).

An instruction may carry an ArrayRecord ``personal`` (Global SVD's
client-specific factor); it is loaded over the global arrays and stored in
``context.state``. Every load starts from the adapter's seeded initial values,
so a process serving many clients never leaks one client's tensors to another.

Base weights that a round does not send are restored to their pristine values,
so a cached model never carries another run's FedEx updates.
"""

from __future__ import annotations

from logging import WARNING, getLogger

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

from fedlr import protocol
from fedlr.adapters import Role, adapter_state
from fedlr.adapters.lora import LoraModel
from fedlr.config import RunConfig
from fedlr.errors import ConfigError
from fedlr.flower.records import (
    array_record,
    config_float,
    config_int,
    record_to_state,
    state_to_record,
)
from fedlr.linalg import local_svd_factors
from fedlr.tasks import TextTask
from fedlr.train import (
    EncodedText,
    TrainSettings,
    client_seed,
    evaluate,
    pick_device,
    proximal_term,
    train_steps,
)

__all__ = ["evaluate_message", "partition_of", "train_message"]

_LOG = getLogger("fedlr")


def partition_of(context: Context, config: RunConfig) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from the node config.

    Raises
    ------
    ConfigError
        If the node config has no ``partition-id`` or it is out of range.
    """
    node = context.node_config
    if protocol.PARTITION_ID not in node:
        raise ConfigError(
            protocol.PARTITION_ID,
            "missing from the node config; start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'",
        )
    pid = int(node[protocol.PARTITION_ID])
    num = int(node.get("num-partitions", config.num_partitions))
    if num != config.num_partitions:
        _LOG.log(
            WARNING,
            "node config has num-partitions=%d, run config %d; using the node's",
            num,
            config.num_partitions,
        )
    if not 0 <= pid < num:
        raise ConfigError(protocol.PARTITION_ID, f"{pid} is outside [0, {num})")
    return pid, num


_MODELS: dict[tuple[object, ...], tuple[LoraModel, dict[str, torch.Tensor]]] = {}
_DATA: dict[tuple[object, ...], EncodedText] = {}
_ADAPTER_ROLES = (Role.LORA_A, Role.LORA_B, Role.HEAD)


def _lora_model(config: RunConfig) -> tuple[LoraModel, dict[str, torch.Tensor]]:
    """The process's model for this config and its initial adapter state.

    A Ray actor serves many clients; the seeded initial A, B and head are kept
    so every load starts from them.
    """
    key = (
        config.model,
        config.pooling,
        config.dataset,
        config.lora_rank,
        config.lora_alpha,
        config.lora_dropout,
        config.targets,
        config.seed,
    )
    if key not in _MODELS:
        _MODELS.clear()  # one model per process at a time
        lm = TextTask(config).build_lora_model()
        _MODELS[key] = (lm, adapter_state(lm.model, lm.layout, _ADAPTER_ROLES))
    return _MODELS[key]


def _partition(config: RunConfig, pid: int, num: int, part: str = "all") -> EncodedText:
    """A client's data: its whole partition, or its own ``train``/``eval`` part."""
    key = (
        part,
        config.model,
        config.dataset,
        config.seed,
        config.partitioner,
        config.dirichlet_alpha,
        config.classes_per_partition,
        config.eval_fraction,
        config.max_length,
        config.max_eval_examples,
        pid,
        num,
    )
    if key not in _DATA:
        task = TextTask(config)
        if part == "all":
            _DATA[key] = task.partition(pid, num)
        else:
            train, held = task.split(num).client_split(pid, config.eval_fraction)
            data = train if part == "train" else held
            cap = config.max_eval_examples
            if part == "eval" and cap and len(data) > cap:
                data = data.select(range(cap))
            _DATA[key] = task.encode(list(data["text"]), list(data["label"]))
    return _DATA[key]


def _prepare(
    message: Message, context: Context, config: RunConfig
) -> tuple[LoraModel, ConfigRecord, bool]:
    """Model at this round's rank with initial, global, then personal arrays.

    Returns the model, the round's ConfigRecord and whether personal arrays
    (from the instruction or the node's state) were loaded.
    """
    round_config = message.content.config_records.get(protocol.CONFIG, ConfigRecord())
    rank = config_int(round_config, protocol.LORA_RANK, config.lora_rank)
    if rank != config.lora_rank:
        config = config.replace(lora_rank=rank)
    lm, initial = _lora_model(config)
    state = dict(initial)
    state.update(record_to_state(array_record(message.content)))
    if protocol.PERSONAL in message.content.array_records:
        context.state[protocol.PERSONAL] = message.content.array_records[
            protocol.PERSONAL
        ]
    loaded = False
    if protocol.PERSONAL in context.state.array_records:
        personal = record_to_state(context.state.array_records[protocol.PERSONAL])
        if all(
            k in state and tuple(v.shape) == tuple(state[k].shape)
            for k, v in personal.items()
        ):
            state.update(personal)
            loaded = True
        else:  # the rank changed since it was stored
            _LOG.log(WARNING, "personal arrays have another rank; not loaded")
    lm.load(state)
    return lm, round_config, loaded


def _local_svd(lm: LoraModel, arrays: dict[str, torch.Tensor]) -> None:
    """Rewrite every layer's (B, A) in ``arrays`` as balanced singular factors."""
    for module in lm.layout.modules:
        arrays[module.b_key], arrays[module.a_key] = local_svd_factors(
            arrays[module.b_key], arrays[module.a_key]
        )


def train_settings(
    round_config: ConfigRecord, config: RunConfig, *, default_lr: float
) -> TrainSettings:
    """Local training settings of a round: the ConfigRecord's, else the run config's."""
    return TrainSettings(
        local_steps=config_int(round_config, protocol.LOCAL_STEPS, config.local_steps),
        lr=config_float(round_config, protocol.LR, default_lr),
        batch_size=config_int(round_config, protocol.BATCH_SIZE, config.batch_size),
        weight_decay=config.weight_decay,
    )


def train_message(message: Message, context: Context) -> Message:
    """Handle a ``train`` instruction for a LoRA method."""
    config = RunConfig.from_mapping(context.run_config)
    pid, num = partition_of(context, config)
    lm, round_config, loaded = _prepare(message, context, config)
    roles = protocol.decode_roles(round_config, protocol.TRAIN_ROLES, _ADAPTER_ROLES)
    keep = protocol.decode_roles(round_config, protocol.KEEP_ROLES)
    lm.train_only(roles + keep)
    personal_split = bool(round_config.get(protocol.PERSONAL_SPLIT, False))
    data = _partition(config, pid, num, "train" if personal_split else "all")
    server_round = config_int(round_config, protocol.SERVER_ROUND, 0)
    settings = train_settings(round_config, config, default_lr=config.lr)
    mu = config_float(round_config, protocol.PROXIMAL_MU, 0.0)
    loss = train_steps(
        lm.model,
        data,
        settings,
        seed=client_seed(config.seed, server_round, pid),
        device=pick_device(config.device),
        penalty=proximal_term(lm.model, mu) if mu > 0 else None,
    )
    lm.model.to("cpu")
    trained = adapter_state(lm.model, lm.layout, roles + keep)
    if bool(round_config.get(protocol.CLIENT_SVD, False)):
        _local_svd(lm, trained)
    reply = RecordDict(
        {
            protocol.ARRAYS: state_to_record(trained, lm.layout.keys(*roles)),
            protocol.METRICS: MetricRecord(
                {
                    protocol.NUM_EXAMPLES: len(data),
                    protocol.TRAIN_LOSS: loss,
                    protocol.PARTITION_ID: pid,
                    protocol.PERSONAL_LOADED: int(loaded),
                }
            ),
        }
    )
    if keep:
        context.state[protocol.PERSONAL] = state_to_record(
            trained, lm.layout.keys(*keep)
        )
    if Role.LORA_B in keep:
        reply[protocol.PERSONAL_GRAM] = ArrayRecord(
            {
                m.b_key: (trained[m.b_key].T @ trained[m.b_key]).contiguous()
                for m in lm.layout.modules
            }
        )
    return Message(reply, reply_to=message)


def evaluate_message(message: Message, context: Context) -> Message:
    """Handle an ``evaluate`` instruction: the (personalised) model on local data."""
    config = RunConfig.from_mapping(context.run_config)
    pid, num = partition_of(context, config)
    lm, round_config, _ = _prepare(message, context, config)
    personal_split = bool(round_config.get(protocol.PERSONAL_SPLIT, False))
    data = _partition(config, pid, num, "eval" if personal_split else "all")
    accuracy, loss = evaluate(
        lm.model,
        data,
        batch_size=config.eval_batch_size,
        device=pick_device(config.device),
    )
    lm.model.to("cpu")
    reply = RecordDict(
        {
            protocol.METRICS: MetricRecord(
                {
                    protocol.NUM_EXAMPLES: len(data),
                    "accuracy": accuracy,
                    "loss": loss,
                    protocol.PARTITION_ID: pid,
                }
            )
        }
    )
    return Message(reply, reply_to=message)
