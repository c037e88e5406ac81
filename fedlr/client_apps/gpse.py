"""GPSE ClientApp payload: local SGD on the current task, sketches at boundaries.

Protocol (see docs/methods/fot.md):

* instruction: ArrayRecord ``arrays`` with every weight of the vision model;
  ConfigRecord ``config`` with ``server-round``, ``task``, ``task-round``,
  ``lr``, ``local-steps``, ``batch-size``, and for ``fot`` ``gpse-task``
  (the finished task to sketch, -1 for none) and ``sketch-dim``; at a
  boundary also ArrayRecord ``bases`` (layer name -> ``(d, k)`` basis; a layer
  without an entry has none yet).
* reply: ArrayRecord ``arrays`` with every weight after local training;
  MetricRecord ``metrics`` with ``num-examples``, ``train-loss``,
  ``partition-id``; at a boundary also ArrayRecord ``sketches`` (layer name
  -> ``Y_l = R_l G_l`` of shape ``(d, m)``), and metrics
  ``gpse-fraction.<layer>`` (``r_l``) and ``gpse-examples`` (``b_l``).

The sketch is computed before local training, with the received global model
(the final model of the finished task) on the client's data of that task;
``G_l`` is drawn from a generator seeded by the run seed, the partition id
and the task, and never leaves the client.
"""

from __future__ import annotations

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.app import MetricRecordValues as Values

from fedlr.client.checks import NodeLimits, decode_checked
from fedlr.client.train import client_seed
from fedlr.client_apps.common import (
    checked_arrays,
    image_evaluate_reply,
    partition_key,
    partition_of,
    train_images,
)
from fedlr.config.run import RunConfig
from fedlr.data.continual import ContinualStream
from fedlr.data.images import ImageData
from fedlr.errors import InstructionError
from fedlr.flower.records import config_int, config_record, state_to_record
from fedlr.models.vision import VisionModel
from fedlr.tasks.continual import (
    ContinualOptions,
    build_continual_model,
    sketch_layer_inputs,
    stream_from_config,
    task_view,
)
from fedlr.wire import protocol

__all__ = ["evaluate_message", "train_message"]

_MODELS: dict[tuple[object, ...], VisionModel] = {}
_STREAMS: dict[tuple[object, ...], ContinualStream] = {}


def _model(config: RunConfig) -> VisionModel:
    """The process's model for this config (a Ray actor serves many clients)."""
    key = (config.model, config.dataset, config.seed)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = build_continual_model(config)
    return _MODELS[key]


def _stream(config: RunConfig, options: ContinualOptions, num: int) -> ContinualStream:
    key = partition_key(config, options.num_tasks, options.task_examples, num)
    if key not in _STREAMS:
        _STREAMS.clear()
        _STREAMS[key] = stream_from_config(config, options, num)
    return _STREAMS[key]


def _input_dims(model: VisionModel) -> dict[str, int]:
    """Input dimension ``d`` of every layer FOT projects (conv: ``c k k``)."""
    return {
        name: int(model.get_parameter(f"{name}.weight")[0].numel())
        for name in model.projected_layers()
    }


def _checked(
    model: VisionModel, message: Message, context: Context, options: ContinualOptions
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], NodeLimits]:
    """The instruction's weights and bases, checked before anything is decoded.

    The ConfigRecord and ``arrays`` by
    :func:`~fedlr.client_apps.common.checked_arrays` (``sketch-dim`` at most
    the widest projected layer's ``d``, tasks within the run's; ``arrays``
    exactly the model's state); ``bases`` one ``(d, k)`` basis, ``1 <= k <= d``, per
    projected layer at most.
    """
    dims = _input_dims(model)
    limits = NodeLimits.of_node(
        context.node_config,
        widest_input=max(dims.values(), default=0),
        last_task=options.num_tasks - 1,
    )
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    state = checked_arrays(message, shapes, limits)
    bases: dict[str, torch.Tensor] = {}
    record = message.content.array_records.get(protocol.BASES)
    if record is not None:
        expected: dict[str, tuple[int, ...]] = {}
        for layer in record:
            declared = tuple(int(n) for n in record[layer].shape)
            d = dims.get(layer)
            if d is None:
                raise InstructionError(
                    layer, f"(in '{protocol.BASES}') is not a layer FOT projects"
                )
            if not (len(declared) == 2 and declared[0] == d and 1 <= declared[1] <= d):
                raise InstructionError(
                    layer,
                    f"(in '{protocol.BASES}') has shape {declared}, expected "
                    f"({d}, k) with 1 <= k <= {d}",
                )
            expected[layer] = declared
        bases = decode_checked(record, expected, name=protocol.BASES)
    return state, bases, limits


def train_message(message: Message, context: Context) -> Message:
    """Handle a ``train`` instruction of a continual method."""
    config = RunConfig.from_mapping(context.run_config)
    options = ContinualOptions.from_run_config(context.run_config)
    pid, num = partition_of(context, config)
    round_config = config_record(message.content)
    stream = _stream(config, options, num)
    model = _model(config)
    state, bases, limits = _checked(model, message, context, options)
    model.load_state_dict(state)
    task = config_int(round_config, protocol.TASK, 0)
    gpse_task = config_int(round_config, protocol.GPSE_TASK, -1)
    metrics: dict[str, Values] = {protocol.PARTITION_ID: pid}
    content = RecordDict()

    # 1. GPSE on the finished task, with the received global model
    if gpse_task >= 0:
        data = stream.partition(gpse_task, pid)
        data = data.select(range(min(len(data), options.fot_activation_examples)))
        seed = (config.seed * 1_000_003 + pid) * 1_009 + gpse_task
        content[protocol.SKETCHES] = _sketches(
            model, data, bases, round_config, config, seed, metrics
        )

    # 2. local SGD on the current task
    server_round = config_int(round_config, protocol.SERVER_ROUND, 0)
    data = stream.partition(task, pid)
    module, view = task_view(model, data, stream.task_classes(task), stream.num_classes)
    metrics |= train_images(
        module,
        view,
        context,
        round_config,
        config,
        limits=limits,
        momentum=options.momentum,
        seed=client_seed(config.seed, server_round, pid),
    )
    model.to("cpu")
    content[protocol.ARRAYS] = state_to_record(model.state_dict())
    content[protocol.METRICS] = MetricRecord(metrics)
    return Message(content, reply_to=message)


def _sketches(
    model: VisionModel,
    data: ImageData,
    bases: dict[str, torch.Tensor],
    round_config: ConfigRecord,
    config: RunConfig,
    seed: int,
    metrics: dict[str, Values],
) -> ArrayRecord:
    """GPSE on ``data`` (the node's examples of the finished task) with the
    received global model: the random-projected residual activations of each
    projected layer; each layer's kept fraction and the examples go into
    ``metrics``."""
    sketches = sketch_layer_inputs(
        model,
        model.projected_layers(),
        data,
        bases,
        sketch_dim=config_int(round_config, protocol.SKETCH_DIM, 0),
        seed=seed,
        batch_size=config.eval_batch_size or 256,
    )
    sketch_arrays = {}
    for layer, sketch in sketches.items():
        if sketch.sketch is None:
            raise ValueError(f"layer '{layer}' saw no activations")
        sketch_arrays[layer] = sketch.sketch.to(
            model.get_parameter(f"{layer}.weight").dtype
        )
        metrics[protocol.gpse_fraction_key(layer)] = sketch.fraction
    metrics[protocol.GPSE_EXAMPLES] = len(data)
    return state_to_record(sketch_arrays)


def evaluate_message(message: Message, context: Context) -> Message:
    """Handle an ``evaluate`` instruction: the global model on the local task data."""
    config = RunConfig.from_mapping(context.run_config)
    options = ContinualOptions.from_run_config(context.run_config)
    pid, num = partition_of(context, config)
    stream = _stream(config, options, num)
    model = _model(config)
    model.load_state_dict(_checked(model, message, context, options)[0])
    round_config = message.content.config_records.get(protocol.CONFIG, ConfigRecord())
    task = config_int(round_config, protocol.TASK, 0)
    module, view = task_view(
        model,
        stream.partition(task, pid),
        stream.task_classes(task),
        stream.num_classes,
    )
    return image_evaluate_reply(message, context, module, view, config)
