"""One ClientApp body for the text payload kinds (``lora``, ``vera``, ``sorf-vera``).

The three kinds differ only in the model they build and the options they
read; the round itself is the public client side a plug-in user has
(:func:`fedlr.client.round.apply_round`): load the instruction's arrays into the
model (rank and scaling, personal arrays, projection check, what trains),
train on the node's partition with fedlr's loop, reply with
:meth:`~fedlr.client.round.ClientRound.reply`. So fedlr's own clients and a user's
follow one protocol (:mod:`fedlr.wire.protocol`) by construction.

Data: a node trains on its whole partition, or, when the strategy asks for
``personal-split`` (personalised methods), on its own train part, and
evaluates on its own held-out part (capped by ``max-eval-examples``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Generic, TypeVar, cast

import torch
import torch.nn.functional as F
from flwr.app import Context, Message

from fedlr.adapters.roles import AdaptedModel
from fedlr.client.round import ClientRound, apply_round
from fedlr.client.train import EncodedText, client_seed, in_batches, pick_device
from fedlr.client_apps.common import (
    partition_key,
    partition_of,
    private_evaluation,
    train_reply,
)
from fedlr.config.run import RunConfig
from fedlr.errors import InstructionError, PrivacyUnsupportedError
from fedlr.options import Options
from fedlr.privacy.budget import raw_data_key
from fedlr.privacy.node_policy import node_policy
from fedlr.tasks.lm import EncodedInstructions
from fedlr.tasks.text import text_task
from fedlr.wire import protocol

__all__ = ["TextClient"]

O = TypeVar("O", bound=Options)  # noqa: E741

_DATA: dict[tuple[object, ...], EncodedText | EncodedInstructions] = {}


def _partition(
    config: RunConfig, pid: int, num: int, part: str
) -> EncodedText | EncodedInstructions:
    """A node's data: its whole partition (``all``) or its own ``train``/``eval``."""
    key = partition_key(
        config,
        part,
        config.model,
        config.max_length,
        config.max_eval_examples,
        config.prompt_template,
        pid,
        num,
    )
    if key not in _DATA:
        task = text_task(config)
        split = task.split(num)
        # the node's ledger is its raw data's, whatever part of it a round reads
        held_key = raw_data_key(split.partition(pid))
        if part == "all":
            data = split.partition(pid)
        else:
            train, held = split.client_split(pid, config.eval_fraction)
            data = train if part == "train" else held
            cap = config.max_eval_examples
            if part == "eval" and cap and len(data) > cap:
                data = data.select(range(cap))
        _DATA[key] = replace(task.encode(data), ledger_key=held_key)
    return _DATA[key]


class TextClient(Generic[O]):
    """``train`` and ``evaluate`` handlers of a text payload kind.

    Parameters
    ----------
    build : callable
        ``build(config, options) -> AdaptedModel``: the seeded classifier with
        the kind's adapters, the same on every node and on the server.
    options : type of Options
        The payload kind's run-config keys.
    lr : callable
        ``lr(config, options)``: the learning rate when the round's
        ConfigRecord carries none.
    """

    def __init__(
        self,
        *,
        build: Callable[[RunConfig, O], AdaptedModel],
        options: type[O],
        lr: Callable[[RunConfig, O], float],
    ) -> None:
        self.build = build
        self.options = options
        self.lr = lr
        self._models: dict[tuple[object, ...], AdaptedModel] = {}

    def model(self, config: RunConfig, options: O) -> AdaptedModel:
        """The process's model for this run (a Ray actor serves many nodes).

        One model per configuration, at most one per client rank (4 at most
        kept; the oldest goes first).
        """
        key = self._key(config, options)
        if key not in self._models:
            keep = min(max(len(config.rank_list), 1), 4)
            while len(self._models) >= keep:
                self._models.pop(next(iter(self._models)))
            self._models[key] = self.build(config, options)
        return self._models[key]

    def forget(self, config: RunConfig, options: O) -> None:
        """Drop the process's model for this run (it is rebuilt when next asked)."""
        self._models.pop(self._key(config, options), None)

    @staticmethod
    def _key(config: RunConfig, options: O) -> tuple[object, ...]:
        return tuple(sorted({**config.to_mapping(), **options.to_mapping()}.items()))

    def _round(
        self, message: Message, context: Context
    ) -> tuple[RunConfig, O, ClientRound, int, int]:
        config = RunConfig.from_mapping(context.run_config)
        options = self.options.from_run_config(context.run_config)
        pid, num = partition_of(context, config)
        # The node's own rank (its client-ranks entry, else lora-rank): the
        # model is cached per configured rank. The rank the round trains at
        # is decided by apply_round (fedlr.client.pruning.round_rank), whatever an
        # earlier node served by this model was given or pruned itself to.
        rank = config.rank_for(pid)
        model_config = config.replace(lora_rank=rank) if config.rank_list else config
        model = self.model(model_config, options)
        try:
            job = apply_round(model, message, context, rank=rank)
        except InstructionError:
            raise  # refused before anything changed
        except Exception:
            # A round that failed half-way may have left the model at
            # another rank or scaling: the next round builds it afresh.
            self.forget(model_config, options)
            raise
        return config, options, job, pid, num

    def train(self, message: Message, context: Context) -> Message:
        """Handle a ``train`` instruction: local steps on the node's data."""
        config, options, job, pid, num = self._round(message, context)
        data = _partition(config, pid, num, "train" if job.personal_split else "all")
        return train_reply(
            job,
            data,
            config,
            default_lr=self.lr(config, options),
            node_config=context.node_config,
            seed=client_seed(config.seed, job.server_round, pid),
        )

    def evaluate(self, message: Message, context: Context) -> Message:
        """Handle an ``evaluate`` instruction: the (personal) model on local
        data; noised and charged to the node's ledger when its operator asks
        (:func:`~fedlr.client_apps.common.private_evaluation`; classifiers only).

        Raises
        ------
        PrivacyUnsupportedError
            A noised evaluation of a causal LM (its exact match and perplexity
            have no per-example bound here).
        """
        config, _, job, pid, num = self._round(message, context)
        data = _partition(config, pid, num, "eval" if job.personal_split else "all")
        device = pick_device(config.device)
        model = job.model
        if isinstance(data, EncodedText):
            private = private_evaluation(
                message,
                context,
                data,
                lambda: _scores(model, data, config.eval_batch_size, device),
            )
        elif node_policy(context.node_config).dp_evaluation_noise_multiplier > 0:
            raise PrivacyUnsupportedError(
                "dp-evaluation-noise-multiplier: a noised evaluation serves "
                "classifiers; this node's causal LM would release its perplexity "
                "and exact match un-noised, so it does not evaluate"
            )
        else:
            private = None
        if private is not None:
            examples = round(cast(float, private.pop(protocol.NUM_EXAMPLES)))  # noised
            job.model.to("cpu")
            return job.reply(num_examples=examples, metrics=private)
        metrics = text_task(config).evaluate(model, data, device)
        job.model.to("cpu")
        return job.reply(num_examples=len(data), metrics=metrics)


@torch.no_grad()
def _scores(
    model: torch.nn.Module, data: EncodedText, batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's cross-entropy and whether it was classified right."""
    model.to(device).eval()
    losses: list[torch.Tensor] = []
    correct: list[torch.Tensor] = []

    def step(start: int, stop: int) -> None:
        batch = {
            k: v.to(device) for k, v in data.batch(list(range(start, stop))).items()
        }
        logits = model(**batch).logits.float()
        labels = batch["labels"]
        losses.append(F.cross_entropy(logits, labels, reduction="none").cpu())
        correct.append((logits.argmax(-1) == labels).float().cpu())

    in_batches(len(data), batch_size, step)
    if not losses:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(losses), torch.cat(correct)
