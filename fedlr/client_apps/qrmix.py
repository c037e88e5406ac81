"""QR-Mix ClientApp payload: local SGD on a vision model, plus FC eigenpairs in stage 2.

Protocol (methods ``fedavg`` and ``qrmix``):

* instruction: ArrayRecord ``arrays`` with every parameter of the vision model
  (``model.named_parameters()`` keys), ConfigRecord ``config`` with
  ``server-round``, ``lr``, ``local-steps``, ``batch-size`` and
  ``qrmix-stage`` (1: train only; 2: also eigenpairs);
* reply: ArrayRecord ``arrays`` with every parameter after local SGD,
  MetricRecord ``metrics`` with ``num-examples``, ``train-loss``,
  ``partition-id`` (and ``eigen-seconds`` in stage 2); in stage 2 also
  ArrayRecord ``eigen`` with ``vectors`` (P, k) orthonormal eigenvectors and
  ``values`` (k,) eigenvalues of the FC layer's cross-entropy Hessian on the
  local data (at the locally trained weights), and ``delta`` (P,) the FC
  update (local minus global), all in the bias-first order of
  :func:`fedlr.linalg.fc_flatten`. ``k``, ``s`` and ``q`` come from the run
  config (``qrmix-k``, ``qrmix-oversample``, ``qrmix-power-iters``).
"""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

from fedlr.client.checks import NodeLimits
from fedlr.client.train import client_seed
from fedlr.client_apps.common import (
    checked_arrays,
    image_evaluate_reply,
    partition_key,
    partition_of,
    train_images,
)
from fedlr.config.run import RunConfig
from fedlr.data.images import ImageData
from fedlr.flower.records import config_int, config_record, state_to_record
from fedlr.linalg.qrmix import fc_flatten, fc_hessian_eigenpairs
from fedlr.models.vision import VisionModel
from fedlr.tasks.image import EigenOptions, ImageTask
from fedlr.wire import protocol

__all__ = ["evaluate_message", "head_features", "train_message"]

_MODELS: dict[tuple[object, ...], VisionModel] = {}
_DATA: dict[tuple[object, ...], ImageData] = {}


def _model(config: RunConfig) -> VisionModel:
    """The process's model for this config (a Ray actor serves many clients)."""
    key = (config.model, config.dataset, config.seed)
    if key not in _MODELS:
        _MODELS.clear()  # one model per process at a time
        _MODELS[key] = ImageTask(config).build_model()
    return _MODELS[key]


def _partition(config: RunConfig, pid: int, num: int) -> ImageData:
    key = partition_key(config, pid, num)
    if key not in _DATA:
        _DATA[key] = ImageTask(config).partition(pid, num)
    return _DATA[key]


@torch.no_grad()
def head_features(
    model: VisionModel, data: ImageData, batch_size: int = 512
) -> torch.Tensor:
    """Inputs of the head layer for every sample, (N, F), in eval mode."""
    model.eval()
    parts = [
        model.features(data.x[start : start + batch_size])
        for start in range(0, len(data), batch_size)
    ]
    return torch.cat(parts)


def train_message(message: Message, context: Context) -> Message:
    """Handle a ``train`` instruction for ``fedavg`` / ``qrmix``."""
    config = RunConfig.from_mapping(context.run_config)
    options = EigenOptions.from_run_config(context.run_config)
    pid, num = partition_of(context, config)
    round_config = config_record(message.content)
    model = _model(config)
    limits = NodeLimits.of_node(context.node_config)
    global_state = checked_arrays(message, model.parameter_shapes(), limits)
    model.load_parameters(global_state)
    data = _partition(config, pid, num)
    server_round = config_int(round_config, protocol.SERVER_ROUND, 0)
    seed = client_seed(config.seed, server_round, pid)
    metrics = train_images(
        model,
        data,
        context,
        round_config,
        config,
        limits=limits,
        momentum=options.momentum,
        seed=seed,
    )
    metrics[protocol.PARTITION_ID] = pid
    model.to("cpu")
    state = model.parameter_state()
    reply = RecordDict({protocol.ARRAYS: state_to_record(state)})
    if config_int(round_config, protocol.QRMIX_STAGE, 1) == 2:
        start = time.perf_counter()
        reply[protocol.EIGEN] = _eigen(model, data, state, global_state, options, seed)
        metrics["eigen-seconds"] = time.perf_counter() - start
    reply[protocol.METRICS] = MetricRecord(metrics)
    return Message(reply, reply_to=message)


def _eigen(
    model: VisionModel,
    data: ImageData,
    state: dict[str, torch.Tensor],
    global_state: dict[str, torch.Tensor],
    options: EigenOptions,
    seed: int,
) -> ArrayRecord:
    """Stage 2's record: the head's Hessian eigenpairs at the trained model
    and the head's update (trained minus received), flattened."""
    head = model.head_layer()
    values, vectors = fc_hessian_eigenpairs(
        head_features(model, data),
        head.weight.detach(),
        head.bias.detach(),
        options.qrmix_k,
        oversample=options.qrmix_oversample,
        power_iters=options.qrmix_power_iters,
        seed=seed,
    )
    w_key, b_key = f"{model.head}.weight", f"{model.head}.bias"
    delta = fc_flatten(
        state[w_key] - global_state[w_key], state[b_key] - global_state[b_key]
    )
    eigen = (vectors, values, delta)
    return state_to_record(
        {
            key: tensor.to(torch.float32)
            for key, tensor in zip(protocol.EIGEN_KEYS, eigen, strict=True)
        }
    )


def evaluate_message(message: Message, context: Context) -> Message:
    """Handle an ``evaluate`` instruction: the global model on local data."""
    config = RunConfig.from_mapping(context.run_config)
    pid, num = partition_of(context, config)
    model = _model(config)
    limits = NodeLimits.of_node(context.node_config)
    model.load_parameters(checked_arrays(message, model.parameter_shapes(), limits))
    return image_evaluate_reply(
        message, context, model, _partition(config, pid, num), config
    )
