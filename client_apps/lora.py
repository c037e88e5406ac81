"""LoRA ClientApp payload: train the roles the strategy asks for, send them back.

Protocol (see docs/architecture.md):

* instruction: ArrayRecord ``arrays`` with the global tensors keyed as in the
  adapter layout (A, B, head, and for FedEx the base weights), ConfigRecord
  ``config`` with ``server-round``, ``lr``, ``local-steps``, ``batch-size`` and
  ``train-roles`` (comma-separated role names);
* reply: ArrayRecord ``arrays`` with exactly the tensors of ``train-roles``,
  MetricRecord ``metrics`` with ``num-examples``, ``train-loss``,
  ``partition-id``.

Base weights that a round does not send are restored to their pristine values,
so a cached model never carries another run's FedEx updates.
"""

from __future__ import annotations

from logging import WARNING, getLogger

from flwr.app import (
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

from fedlr.adapters import Role, adapter_state
from fedlr.config import RunConfig
from fedlr.errors import ConfigError
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.tasks import LoraModel, TextTask
from fedlr.train import EncodedText, TrainSettings, evaluate, pick_device, train_steps

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
    if "partition-id" not in node:
        raise ConfigError(
            "partition-id",
            "missing from the node config; start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'",
        )
    pid = int(node["partition-id"])
    num = int(node.get("num-partitions", config.num_partitions))
    if num != config.num_partitions:
        _LOG.log(
            WARNING,
            "node config has num-partitions=%d, run config %d; using the node's",
            num,
            config.num_partitions,
        )
    if not 0 <= pid < num:
        raise ConfigError("partition-id", f"{pid} is outside [0, {num})")
    return pid, num


_MODELS: dict[tuple[object, ...], LoraModel] = {}
_DATA: dict[tuple[object, ...], EncodedText] = {}


def _lora_model(config: RunConfig) -> LoraModel:
    """The process's model for this config (a Ray actor serves many clients)."""
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
        _MODELS[key] = TextTask(config).build_lora_model()
    return _MODELS[key]


def _partition(config: RunConfig, pid: int, num: int) -> EncodedText:
    key = (
        config.model,
        config.dataset,
        config.seed,
        config.partitioner,
        config.dirichlet_alpha,
        config.classes_per_partition,
        config.eval_fraction,
        config.max_length,
        pid,
        num,
    )
    if key not in _DATA:
        _DATA[key] = TextTask(config).partition(pid, num)
    return _DATA[key]


def _parse_roles(config: ConfigRecord) -> tuple[Role, ...]:
    raw = str(config.get("train-roles", "lora_A,lora_B,head"))
    try:
        return tuple(Role(name) for name in raw.split(",") if name)
    except ValueError as exc:
        known = ", ".join(r.value for r in Role)
        raise ValueError(
            f"ConfigRecord 'train-roles' = '{raw}' names an unknown role ({known})"
        ) from exc


def train_message(message: Message, context: Context) -> Message:
    """Handle a ``train`` instruction for a LoRA method."""
    config = RunConfig.from_mapping(context.run_config)
    pid, num = partition_of(context, config)
    round_config = message.content["config"]
    lm = _lora_model(config)
    lm.load(record_to_state(message.content["arrays"]))
    roles = _parse_roles(round_config)
    lm.train_only(roles)
    data = _partition(config, pid, num)
    server_round = int(round_config.get("server-round", 0))
    settings = TrainSettings(
        local_steps=int(round_config.get("local-steps", config.local_steps)),
        lr=float(round_config.get("lr", config.lr)),
        batch_size=int(round_config.get("batch-size", config.batch_size)),
        weight_decay=config.weight_decay,
    )
    loss = train_steps(
        lm.model,
        data,
        settings,
        seed=config.seed * 1_000_003 + server_round * 1_009 + pid,
        device=pick_device(config.device),
    )
    lm.model.to("cpu")
    reply = RecordDict(
        {
            "arrays": state_to_record(adapter_state(lm.model, lm.layout, roles)),
            "metrics": MetricRecord(
                {"num-examples": len(data), "train-loss": loss, "partition-id": pid}
            ),
        }
    )
    return Message(reply, reply_to=message)


def evaluate_message(message: Message, context: Context) -> Message:
    """Handle an ``evaluate`` instruction: the global model on local data."""
    config = RunConfig.from_mapping(context.run_config)
    pid, num = partition_of(context, config)
    lm = _lora_model(config)
    lm.load(record_to_state(message.content["arrays"]))
    data = _partition(config, pid, num)
    accuracy, loss = evaluate(
        lm.model,
        data,
        batch_size=config.eval_batch_size,
        device=pick_device(config.device),
    )
    lm.model.to("cpu")
    reply = RecordDict(
        {
            "metrics": MetricRecord(
                {"num-examples": len(data), "accuracy": accuracy, "loss": loss}
            )
        }
    )
    return Message(reply, reply_to=message)
