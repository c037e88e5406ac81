"""Server plan of the ``lora`` client kind: text classifier with LoRA.

The global model is evaluated on the server's held-out split after every round.
For a personalised method (the registry's ``traits.personalised``) there is
no single global
model: each client evaluates its own model on its own held-out part in the
round's federated evaluation (which Flower runs before this plan's evaluate),
and the round reports the strategy's mean and spread of those accuracies.
When the strategy changes the LoRA rank (FedSpec), the evaluation model is
rebuilt at the rank of the arrays it receives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, cast

import torch
from flwr.app import Context, Message, RecordDict

from fedlr.adapters import Role, adapter_state
from fedlr.adapters.lora import LoraModel
from fedlr.client.round import apply_round
from fedlr.client.train import client_seed, pick_device
from fedlr.client_apps.common import train_reply
from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError
from fedlr.privacy.dp_sgd import DpSgd
from fedlr.privacy.node_policy import NodePolicy
from fedlr.robust.heldout import HELDOUT_COLUMNS, HeldOutCheck
from fedlr.robust.server_update import (
    SERVER_NODE,
    SERVER_UPDATE_COLUMNS,
    ServerUpdate,
    check_server_update_strategy,
    server_instruction,
)
from fedlr.server_apps.plans import (
    ServerPlan,
    check_strategy,
    heldout_plan,
    register_plan,
)
from fedlr.strategies.async_lora import AsyncLoraStrategy
from fedlr.strategies.lora import LoraStrategy
from fedlr.strategies.registry import (
    MethodConfig,
    MethodSpec,
    available_methods,
    get_method,
)
from fedlr.tasks.text import (
    CausalLMTask,
    TextTask,
    published_rank,
    server_config,
    text_task,
)

__all__ = ["lora_plan", "server_context", "server_update"]


@register_plan("lora")
def lora_plan(method: MethodConfig) -> ServerPlan:
    """Seeded LoRA classifier, its strategy and held-out evaluation.

    Raises
    ------
    ConfigError
        For ``lora-rank`` larger than a target layer's smaller side (from the
        model build, before any training).
    """
    config, spec = method.run, method.spec
    traits = spec.traits
    check_strategy(spec, LoraStrategy)  # type: ignore[type-abstract]
    strategy_cls = cast(
        "type[LoraStrategy]", spec.strategy_for(client_ranks=bool(config.rank_list))
    )
    if config.rank_list:
        _check_heterogeneous(spec)
    config = server_config(config)
    task = text_task(config)
    lm = task.build_lora_model()
    strategy = strategy_cls.from_run_config(config, lm.layout, method.options)
    initial = strategy.initial_global_state(
        adapter_state(lm.model, lm.layout, strategy.send_roles)
    )
    strategy.bind_initial(
        adapter_state(lm.model, lm.layout, (Role.LORA_A, Role.LORA_B, Role.HEAD))
    )
    heldout = task.heldout()
    device = pick_device(config.device)
    evaluate_on = _PublishedModel(task, config, lm, device)
    note = (
        "; personalised: each client evaluates on its own held-out part"
        if traits.personalised
        else ""
    )
    note += _server_checks(method, strategy, task, evaluate_on)
    return heldout_plan(
        config,
        strategy=strategy,
        initial_arrays=initial,
        evaluate=_global_evaluation(
            strategy, traits.personalised, evaluate_on, heldout
        ),
        heldout_examples=len(heldout),
        device=device,
        columns=(
            *task.metric_columns,
            *strategy.extra_columns,
            *(HELDOUT_COLUMNS if config.heldout_check else ()),
            *(SERVER_UPDATE_COLUMNS if config.server_update_share > 0 else ()),
        ),
        note=note,
    )


def _global_evaluation(
    strategy: LoraStrategy,
    personalised: bool,
    evaluate_on: _PublishedModel,
    heldout: Any,
) -> Callable[[int, Mapping[str, torch.Tensor]], dict[str, float]]:
    """The plan's evaluation: the published model on ``heldout``; after a
    round of a personalised method, the clients' own evaluations instead."""

    def evaluate_global(
        server_round: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, float]:
        if server_round > 0 and personalised:
            result = dict(strategy.last_evaluation)
            if not result:
                nan = float("nan")
                return {"accuracy": nan, "loss": nan}
            return {k: v for k, v in result.items() if k != "evaluated-clients"}
        return evaluate_on(state, heldout)

    return evaluate_global


class _PublishedModel:
    """The server's LoRA model at the rank of the arrays it published
    (:func:`fedlr.tasks.text.published_rank`), one model kept in memory."""

    def __init__(
        self,
        task: TextTask | CausalLMTask,
        config: RunConfig,
        model: LoraModel,
        device: torch.device,
    ) -> None:
        self.task, self.config, self.device = task, config, device
        self.layout = model.layout
        self.models = {config.lora_rank: model}

    def model_at(self, rank: int) -> LoraModel:
        if rank not in self.models:
            self.models.clear()  # keep one model (and the initial one's rank) in memory
            rebuilt = text_task(self.config.replace(lora_rank=rank))
            self.models[rank] = rebuilt.build_lora_model()
        return self.models[rank]

    def __call__(
        self, state: Mapping[str, torch.Tensor], data: Any
    ) -> dict[str, float]:
        """The model of the published arrays ``state`` evaluated on ``data``."""
        model = self.model_at(published_rank(self.layout, state, self.config.lora_rank))
        model.load(state)
        result = self.task.evaluate(model.model, data, self.device)
        model.model.to("cpu")
        return result


def _check_heterogeneous(spec: MethodSpec) -> None:
    """Refuse ``client-ranks`` for a method that trains one rank everywhere."""
    if not spec.traits.heterogeneous_ranks:
        ranked = [
            name
            for name in available_methods()
            if get_method(name).traits.heterogeneous_ranks
        ]
        raise ConfigError(
            "client-ranks",
            f"method '{spec.name}' trains one rank on every client; "
            f"heterogeneous ranks need one of {', '.join(ranked)}",
        )


def _server_checks(
    method: MethodConfig,
    strategy: LoraStrategy,
    task: TextTask | CausalLMTask,
    evaluate_on: Callable[[Mapping[str, torch.Tensor], Any], dict[str, float]],
) -> str:
    """Attach the held-out check and the server's own update the run config
    asks for (the rest is refused at configuration, personalised methods
    too); their part of the plan's note."""
    config, note = method.run, ""
    checked = task.check_examples()  # None unless the check or the server's update
    if config.heldout_check:

        def validation_loss(state: Mapping[str, torch.Tensor]) -> float:
            return float(evaluate_on(state, checked)["loss"])

        strategy.heldout_check = HeldOutCheck(
            validation_loss, config.heldout_check_margin, len(checked)
        )
        note += (
            f"; held-out check on {len(checked)} other examples "
            f"(margin {config.heldout_check_margin:g})"
        )
    if config.server_update_share > 0:
        check_server_update_strategy(
            method.spec.name,
            sorted(strategy.replies.records()),
            asynchronous=isinstance(strategy, AsyncLoraStrategy),
        )
        strategy.server_update = server_update(task, config, checked)
        note += (
            f"; the server's own update on {strategy.server_update.examples} "
            f"other examples (share {config.server_update_share:g})"
        )
    return note


def server_update(
    task: TextTask | CausalLMTask, config: RunConfig, examples: Any
) -> ServerUpdate:
    """The server's own update (:mod:`fedlr.robust.server_update`): each
    round's train instruction applied to a model of the server's own and
    trained on its validation ``examples`` (:meth:`check_examples`) as a node trains
    (:func:`~fedlr.client.round.apply_round`,
    :func:`~fedlr.client_apps.common.train_reply`), with the node limits'
    defaults and a seed of the run seed and the round. The model keeps its
    node state across rounds like a node's; the same instruction asked
    again returns the same reply, not a second round.

    It trains as the server, in a context of its own
    (:func:`server_context`), on the instruction addressed to the server
    (:func:`~fedlr.robust.server_update.server_instruction`): never a
    node's id, policy, state directory or privacy ledger. It trains without
    DP-SGD (the instruction's :attr:`~fedlr.privacy.dp_sgd.DpSgd.keys` left
    out): the examples are the server's own, which it does not protect from
    itself, and DP-SGD there would spend a budget and write a ledger that no
    node owns."""
    model = task.build_lora_model()  # its own: a round changes the model
    context = server_context()

    last: list[tuple[Message, Message]] = []  # an instruction is trained once

    def train(instruction: Message) -> Message:
        if last and last[0][0] is instruction:
            return last[0][1]
        job = apply_round(model, server_instruction(instruction, DpSgd.keys), context)
        reply = train_reply(
            job,
            examples,
            config,
            default_lr=config.lr,
            node_config={},
            seed=client_seed(config.seed, job.server_round, -1),
        )
        last[:] = [(instruction, reply)]
        return reply

    return ServerUpdate(train, config.server_update_share, len(examples))


def server_context() -> Context:
    """The context the server's own update trains in: node
    :data:`SERVER_NODE`, a ``state`` of its own, and a node config that sets
    every node-policy key (:class:`~fedlr.privacy.node_policy.NodePolicy`)
    to the policy's default, so that no nodes' file (``FEDLR_NODE_CONFIG``,
    which a simulation's nodes read from the process the server shares)
    applies to the server: nothing required of it, no budget, no ledger."""
    own = NodePolicy()
    policy = {f.name.replace("_", "-"): getattr(own, f.name) for f in fields(own)}
    return Context(
        run_id=0,
        node_id=SERVER_NODE,
        node_config=policy,
        state=RecordDict(),
        run_config={},
    )
