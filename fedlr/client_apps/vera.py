"""VeRA ClientApp payload (client kind ``vera``), shared with SORF-VeRA.

Protocol:

* instruction: ArrayRecord ``arrays`` with the global tensors keyed as in the
  layout (VeRA: ``vera_lambda_b``, ``vera_lambda_d``, head and, for
  VeRA-FedEx, base weights), ConfigRecord ``config`` with ``server-round``,
  ``lr``, ``local-steps``, ``batch-size``, ``train-roles``,
  ``projection-seed`` and ``projection-rank``;
* the node checks that it built its frozen projections from the same seed and
  rank (else :class:`~fedlr.errors.ProjectionMismatchError`: the reply is an
  error and the server drops it);
* reply: ArrayRecord ``arrays`` with exactly the tensors of ``train-roles``,
  MetricRecord ``metrics`` with ``num-examples``, ``train-loss``,
  ``partition-id``, ``projection-seed`` and ``projection-rank``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.app import Context, Message, MetricRecord, RecordDict

from fedlr import protocol
from fedlr.adapters import Role
from fedlr.adapters.roles import RoleLayout
from fedlr.adapters.sorf_vera import SorfVeraLayout
from fedlr.adapters.vera import VeraLayout, VeraModel, check_projection
from fedlr.client_apps.lora import partition_of, train_settings
from fedlr.config import RunConfig
from fedlr.flower.records import (
    array_record,
    config_int,
    config_record,
    record_to_state,
    state_to_record,
)
from fedlr.tasks import TextTask
from fedlr.train import (
    EncodedText,
    client_seed,
    evaluate,
    pick_device,
    train_steps,
)
from fedlr.vera_tasks import SorfVeraOptions, VeraOptions, build_vera_text_model

__all__ = [
    "Handler",
    "Handlers",
    "evaluate_message",
    "make_handlers",
    "train_message",
]

Builder = Callable[[RunConfig, Any], VeraModel]
Handler = Callable[[Message, Context], Message]

_DATA: dict[tuple[object, ...], EncodedText] = {}


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


def _projection(layout: RoleLayout) -> tuple[int, int]:
    """``(projection-seed, rank)`` the node's VeRA-family layout was built from."""
    if not isinstance(layout, (VeraLayout, SorfVeraLayout)):
        raise TypeError(
            f"VeRA client needs a VeraLayout or SorfVeraLayout, "
            f"got {type(layout).__name__}"
        )
    return int(layout.projection_seed), int(layout.rank)


class Handlers:
    """Train and evaluate handlers of a VeRA-family client kind.

    Parameters
    ----------
    builder : callable
        ``builder(config, options) -> VeraModel`` (the same on every node and
        the server).
    options : type of VeraOptions or SorfVeraOptions
        The payload kind's run-config keys (rank, projection seed, lr).
    default_roles : tuple of Role
        ``train-roles`` when the ConfigRecord does not say.
    """

    def __init__(
        self,
        builder: Builder,
        options: type[VeraOptions] | type[SorfVeraOptions],
        default_roles: tuple[Role, ...],
    ) -> None:
        self.builder = builder
        self.options = options
        self.default_roles = default_roles
        self._models: dict[tuple[object, ...], VeraModel] = {}

    def model(
        self, config: RunConfig, options: VeraOptions | SorfVeraOptions
    ) -> VeraModel:
        """The process's model for this config (a Ray actor serves many clients)."""
        key = tuple(sorted({**config.to_mapping(), **options.to_mapping()}.items()))
        if key not in self._models:
            self._models.clear()
            self._models[key] = self.builder(config, options)
        return self._models[key]

    def train(self, message: Message, context: Context) -> Message:
        """Handle a ``train`` instruction."""
        config = RunConfig.from_mapping(context.run_config)
        options = self.options.from_run_config(context.run_config)
        pid, num = partition_of(context, config)
        round_config = config_record(message.content)
        vm = self.model(config, options)
        seed, rank = _projection(vm.layout)
        check_projection(
            seed,
            rank,
            config_int(round_config, protocol.PROJECTION_SEED, seed),
            config_int(round_config, protocol.PROJECTION_RANK, rank),
        )
        vm.load(record_to_state(array_record(message.content)))
        roles = protocol.decode_roles(
            round_config, protocol.TRAIN_ROLES, self.default_roles
        )
        vm.train_only(roles)
        data = _partition(config, pid, num)
        server_round = config_int(round_config, protocol.SERVER_ROUND, 0)
        settings = train_settings(round_config, config, default_lr=options.vera_lr)
        loss = train_steps(
            vm.model,
            data,
            settings,
            seed=client_seed(config.seed, server_round, pid),
            device=pick_device(config.device),
        )
        vm.model.to("cpu")
        reply = RecordDict(
            {
                protocol.ARRAYS: state_to_record(vm.state(roles)),
                protocol.METRICS: MetricRecord(
                    {
                        protocol.NUM_EXAMPLES: len(data),
                        protocol.TRAIN_LOSS: loss,
                        protocol.PARTITION_ID: pid,
                        protocol.PROJECTION_SEED: seed,
                        protocol.PROJECTION_RANK: rank,
                    }
                ),
            }
        )
        return Message(reply, reply_to=message)

    def evaluate(self, message: Message, context: Context) -> Message:
        """Handle an ``evaluate`` instruction: the global model on local data."""
        config = RunConfig.from_mapping(context.run_config)
        options = self.options.from_run_config(context.run_config)
        pid, num = partition_of(context, config)
        vm = self.model(config, options)
        vm.load(record_to_state(array_record(message.content)))
        data = _partition(config, pid, num)
        accuracy, loss = evaluate(
            vm.model,
            data,
            batch_size=config.eval_batch_size,
            device=pick_device(config.device),
        )
        vm.model.to("cpu")
        reply = RecordDict(
            {
                protocol.METRICS: MetricRecord(
                    {
                        protocol.NUM_EXAMPLES: len(data),
                        "accuracy": accuracy,
                        "loss": loss,
                    }
                )
            }
        )
        return Message(reply, reply_to=message)


def make_handlers(
    builder: Builder,
    options: type[VeraOptions] | type[SorfVeraOptions],
    default_roles: tuple[Role, ...],
) -> Handlers:
    """Handlers for a VeRA-family client kind."""
    return Handlers(builder, options, default_roles)


_VERA = make_handlers(
    build_vera_text_model,
    VeraOptions,
    (Role.VERA_LAMBDA_B, Role.VERA_LAMBDA_D, Role.HEAD),
)
train_message: Handler = _VERA.train
evaluate_message: Handler = _VERA.evaluate
