"""What every fedlr ClientApp does the same way: its partition, its settings, replies.

The vision payload kinds (``qrmix``, ``gpse``) also answer an ``evaluate``
instruction the same way (:func:`image_evaluate_reply`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from logging import WARNING, getLogger
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app import MetricRecordValues as Values
from torch import nn

from fedlr.client.checks import NodeLimits, check_config, check_value, decode_checked
from fedlr.client.round import ClientRound
from fedlr.client.train import (
    LOCAL_OPTIMIZER,
    OPTIMIZERS,
    EncodedText,
    TrainData,
    TrainSettings,
    default_optimizer,
    pick_device,
    train_steps,
)
from fedlr.config.run import RunConfig
from fedlr.data.images import ImageData
from fedlr.errors import ConfigError, InstructionError, NodePolicyError, RecordTypeError
from fedlr.flower.records import (
    array_record,
    config_float,
    config_int,
    config_record,
    config_str,
)
from fedlr.privacy.budget import data_key
from fedlr.privacy.dp_evaluation import noised_metrics, reserve
from fedlr.privacy.dp_sgd import private_loop
from fedlr.privacy.node_policy import node_policy
from fedlr.tasks.image import ImageRows, evaluate_images, image_scores, train_sgd
from fedlr.tasks.lm import EncodedInstructions
from fedlr.wire import protocol

__all__ = [
    "checked_arrays",
    "image_evaluate_reply",
    "partition_key",
    "partition_of",
    "private_evaluation",
    "train_images",
    "train_reply",
    "train_settings",
]

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


def partition_key(config: RunConfig, *more: object) -> tuple[object, ...]:
    """What a node's data depends on (a cache key): the data set, the seed
    and the partitioning of ``config``, then ``more``."""
    return (
        config.dataset,
        config.seed,
        config.partitioner,
        config.dirichlet_alpha,
        config.classes_per_partition,
        config.min_partition_size,
        config.eval_fraction,
        *more,
    )


def checked_arrays(
    message: Message, shapes: Mapping[str, tuple[int, ...]], limits: NodeLimits
) -> dict[str, torch.Tensor]:
    """A vision instruction's ``arrays``, checked before anything is decoded.

    Its ConfigRecord (if any) against :data:`BOUNDS
    <fedlr.client.checks.BOUNDS>` within the node's ``limits``; ``arrays``
    must hold exactly the keys of ``shapes``, with those shapes
    (:func:`~fedlr.client.checks.decode_checked`).
    """
    if protocol.CONFIG in message.content.config_records:
        check_config(config_record(message.content), limits)
    return decode_checked(array_record(message.content), shapes, required=True)


def train_settings(
    round_config: ConfigRecord,
    config: RunConfig,
    *,
    default_lr: float,
    limits: NodeLimits,
) -> TrainSettings:
    """Local training settings of a round: the ConfigRecord's, else the run config's.

    The values used, wherever they come from, are within the node's
    ``limits`` (:data:`fedlr.client.checks.BOUNDS`). The local solver is the
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


def train_images(
    model: nn.Module,
    data: ImageData,
    context: Context,
    round_config: ConfigRecord,
    config: RunConfig,
    *,
    limits: NodeLimits,
    momentum: float,
    seed: int,
) -> dict[str, Values]:
    """A vision payload's local SGD on ``data``: the reply's training metrics.

    The round's settings come from its ConfigRecord within the node's
    ``limits`` (:func:`train_settings`); DP-SGD when the instruction asks
    (:func:`fedlr.privacy.dp_sgd.private_loop`, the same loop as the text
    payloads'). The metrics: ``num-examples`` (``len(data)``),
    ``train-loss``, and DP-SGD's (:attr:`fedlr.privacy.dp_sgd.DpSgd.metrics`).
    """
    settings = train_settings(round_config, config, default_lr=config.lr, limits=limits)
    control = private_loop(round_config, context)  # DP-SGD, if asked
    loss = train_sgd(
        model,
        data,
        steps=settings.local_steps,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=seed,
        momentum=momentum,
        weight_decay=settings.weight_decay,
        device=pick_device(config.device),
        control=control,
    )
    metrics: dict[str, Values] = {
        protocol.NUM_EXAMPLES: len(data),
        protocol.TRAIN_LOSS: loss,
    }
    if control is not None:
        metrics.update(control.metrics())
    return metrics


def private_evaluation(
    message: Message,
    context: Context,
    rows: TrainData,
    scores: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Values] | None:
    """The evaluate reply's metrics, noised and charged, when the node's
    operator set ``dp-evaluation-noise-multiplier`` > 0; else ``None``.

    The evaluation (the Gaussian mechanism on the sums of
    :func:`~fedlr.privacy.dp_evaluation.noised_metrics`) is charged to the
    ledger of ``rows`` (or ``dp-ledger-id``) before ``scores()`` computes
    each example's loss and correctness.

    Raises
    ------
    NodePolicyError
        A noise multiplier that is not finite, or a delta not below ``1 / n``.
    PrivacyBudgetError
        If the evaluation would pass the node's ``dp-epsilon-budget``.
    """
    policy = node_policy(context.node_config)
    sigma = policy.dp_evaluation_noise_multiplier
    if not (math.isfinite(sigma) and sigma >= 0):
        raise NodePolicyError(
            "dp-evaluation-noise-multiplier", f"must be finite and >= 0, got {sigma}"
        )
    if sigma == 0:
        return None
    round_config = message.content.config_records.get(protocol.CONFIG, ConfigRecord())
    reserve(
        policy,
        policy.dp_ledger_id or data_key(rows),
        (sigma, 1.0, 1),
        delta=policy.delta_for(0.0, len(rows)),
        run_id=int(context.run_id),
        server_round=config_int(round_config, protocol.SERVER_ROUND, 0),
        what=f"this evaluation (noise multiplier {sigma:g})",
    )
    return dict(noised_metrics(*scores(), sigma))


def image_evaluate_reply(
    message: Message,
    context: Context,
    model: nn.Module,
    data: ImageData,
    config: RunConfig,
) -> Message:
    """The reply to an ``evaluate`` instruction: ``model`` on the local ``data``.

    Evaluates in eval mode on ``device`` (in batches of ``eval-batch-size``),
    moves ``model`` back to the CPU and replies with a MetricRecord
    ``metrics`` of ``num-examples`` (``len(data)``), ``accuracy`` and
    ``loss`` (mean cross-entropy); noised and charged to the node's ledger
    when its operator asks (:func:`private_evaluation`).

    Parameters
    ----------
    message : Message
        The instruction replied to.
    context : Context
        The node's (its policy, its ledger).
    model : nn.Module
        Maps (N, C, H, W) to logits over ``data``'s labels (a task view of
        the global model, or the model itself).
    data : ImageData
    config : RunConfig
    """
    device = pick_device(config.device)
    batch = config.eval_batch_size
    private = private_evaluation(
        message,
        context,
        ImageRows(data),
        lambda: image_scores(model, data, batch_size=batch, device=device),
    )
    if private is None:
        accuracy, loss = evaluate_images(model, data, batch_size=batch, device=device)
        private = {protocol.NUM_EXAMPLES: len(data), "accuracy": accuracy, "loss": loss}
    model.to("cpu")
    reply = RecordDict({protocol.METRICS: MetricRecord(private)})
    return Message(reply, reply_to=message)
