"""What every fedlr ClientApp does the same way: its partition, its settings, replies.

The vision payload kinds (``qrmix``, ``gpse``) also answer an ``evaluate``
instruction the same way (:func:`image_evaluate_reply`).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING, getLogger
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app import MetricRecordValues as Values
from torch import nn

from fedlr.client.round import ClientRound
from fedlr.client.train import (
    LOCAL_OPTIMIZER,
    OPTIMIZERS,
    EncodedText,
    TrainSettings,
    default_optimizer,
    pick_device,
    train_steps,
)
from fedlr.config.run import RunConfig
from fedlr.data.images import ImageData
from fedlr.errors import ConfigError, InstructionError, RecordTypeError
from fedlr.flower.records import config_float, config_int, config_str
from fedlr.tasks.image import evaluate_images
from fedlr.tasks.lm import EncodedInstructions
from fedlr.wire import protocol
from fedlr.wire.checks import NodeLimits, check_value

__all__ = ["image_evaluate_reply", "partition_of", "train_reply", "train_settings"]

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


def train_settings(
    round_config: ConfigRecord,
    config: RunConfig,
    *,
    default_lr: float,
    limits: NodeLimits,
) -> TrainSettings:
    """Local training settings of a round: the ConfigRecord's, else the run config's.

    The values used, wherever they come from, are within the node's
    ``limits`` (:data:`fedlr.wire.checks.BOUNDS`). The local solver is the
    ConfigRecord's ``local-optimizer``, else the run config's, else AdamW
    (``auto`` in the run config: the method's own, which its server sends).

    Raises
    ------
    InstructionError
        Naming ``local-steps``, ``lr`` or ``batch-size`` if one is out of range,
        or ``local-optimizer`` if it is not one of ``adamw``, ``sgd``.
    """
    try:
        optimizer = config_str(
            round_config, LOCAL_OPTIMIZER, default_optimizer(config.local_optimizer)
        )
    except RecordTypeError:
        optimizer = repr(round_config[LOCAL_OPTIMIZER])
    if optimizer not in OPTIMIZERS:
        raise InstructionError(
            LOCAL_OPTIMIZER,
            f"is {optimizer!r}, expected one of {', '.join(OPTIMIZERS)}",
        )
    settings = TrainSettings(
        local_steps=config_int(round_config, protocol.LOCAL_STEPS, config.local_steps),
        lr=config_float(round_config, protocol.LR, default_lr),
        batch_size=config_int(round_config, protocol.BATCH_SIZE, config.batch_size),
        weight_decay=config.weight_decay,
        optimizer=optimizer,
    )
    check_value(protocol.LOCAL_STEPS, settings.local_steps, limits)
    check_value(protocol.LR, settings.lr, limits)
    check_value(protocol.BATCH_SIZE, settings.batch_size, limits)
    return settings


def train_reply(
    job: ClientRound,
    data: EncodedText | EncodedInstructions,
    config: RunConfig,
    *,
    default_lr: float,
    node_config: Mapping[str, Any],
    seed: int,
) -> Message:
    """A loaded ``train`` round (:func:`fedlr.client.round.apply_round`)
    trained on ``data`` with fedlr's loop and answered.

    The round's settings come from its ConfigRecord within the node's limits
    (:func:`train_settings`); the method's client features add their loss
    terms, gradient hooks and loop control. The reply's weight is
    ``len(data)`` and its metrics carry ``train-loss``. The same body serves
    a node and the server's own update (:mod:`fedlr.robust.server_update`).

    Raises
    ------
    InstructionError
        If a training setting of the round is outside the node's limits.
    """
    settings = train_settings(
        job.config,
        config,
        default_lr=default_lr,
        limits=NodeLimits.of_layout(node_config, job.adapted.layout),
    )
    loss = train_steps(
        job.model,
        data,
        settings,
        seed=seed,
        device=pick_device(config.device),
        penalty=job.penalty if job.has_penalty else None,
        after_backward=job.after_backward if job.has_gradient_hooks else None,
        wrap_optimizer=job.optimizer if job.has_gradient_hooks else None,
        control=job.loop_control(),
    )
    job.model.to("cpu")
    return job.reply(num_examples=len(data), metrics={protocol.TRAIN_LOSS: loss})


def image_evaluate_reply(
    message: Message, model: nn.Module, data: ImageData, config: RunConfig
) -> Message:
    """The reply to an ``evaluate`` instruction: ``model`` on the local ``data``.

    Evaluates in eval mode on ``device`` (in batches of ``eval-batch-size``),
    moves ``model`` back to the CPU and replies with a MetricRecord
    ``metrics`` of ``num-examples`` (``len(data)``), ``accuracy`` and
    ``loss`` (mean cross-entropy).

    Parameters
    ----------
    message : Message
        The instruction replied to.
    model : nn.Module
        Maps (N, C, H, W) to logits over ``data``'s labels (a task view of
        the global model, or the model itself).
    data : ImageData
    config : RunConfig
    """
    accuracy, loss = evaluate_images(
        model,
        data,
        batch_size=config.eval_batch_size,
        device=pick_device(config.device),
    )
    model.to("cpu")
    metrics: dict[str, Values] = {
        protocol.NUM_EXAMPLES: len(data),
        "accuracy": accuracy,
        "loss": loss,
    }
    reply = RecordDict({protocol.METRICS: MetricRecord(metrics)})
    return Message(reply, reply_to=message)
