"""Sample-level DP-SGD on the clients, through Opacus.

DP-SGD [1]_ protects each training example of a client: every local step
clips each example's gradient to L2 norm ``C`` (``dp-max-grad-norm``), sums
the clipped gradients, adds Gaussian noise of standard deviation ``sigma C``
(``dp-noise-multiplier``) and divides by the expected batch size, over
batches drawn by Poisson sampling (each example joins a step with
probability ``q = batch-size / n``, ``n`` the client's examples, as the
subsampled-Gaussian accountants assume). The per-example gradients come from
Opacus's hooks (``GradSampleHooks``) on the trained modules: LoRA's ``lora_A``
and ``lora_B`` are ``nn.Linear`` whether the adapted layer is an
``nn.Linear`` or GPT-2's ``Conv1D``, and so is the classifier head; the step
is Opacus's ``DPOptimizer`` around the round's AdamW.

A node's privacy loss is accounted across rounds: the ``(sigma, q, steps)``
of every round it trained are kept in ``context.state`` and Opacus's RDP or
PRV accountant (``dp-accountant``) turns them into ``epsilon`` at ``delta``
(``dp-delta``; 0: ``min(1e-5, 1 / (10 n))``). The reply reports it
(``dp-epsilon-spent``; the server's ``dp-epsilon`` column is the largest over
the round's clients). With a budget ``dp-epsilon`` and no
``dp-noise-multiplier``, ``sigma`` is Opacus's ``get_noise_multiplier`` for
``dp-rounds`` x local steps at ``q``; a node whose next round would spend
more than the budget refuses to train (:class:`~fedlr.errors.PrivacyBudgetError`,
an error reply naming ``dp-epsilon``).

The feature is a *common* client feature (:func:`fedlr.client.features.common_feature`):
every method gets it when its instruction carries ``dp-max-grad-norm`` > 0.
It serves LoRA models (VeRA and SORF-VeRA are refused with
:class:`~fedlr.errors.PrivacyUnsupportedError`); the vision payloads run the
same loop (:func:`private_loop`, :func:`fedlr.tasks.image.train_images`), and a
layer that mixes a batch's examples (BatchNorm) is refused by name.

Loss terms that read no data. A client feature's loss term that is a function
of the parameters and of what the node received or kept, not of its examples
(FedProx's proximal term ``(mu / 2) ||w - w_g||^2``, HetLoRA's tail
regulariser; :attr:`fedlr.client.features.ClientFeature.loss_reads_data` ``False``),
composes with DP-SGD: each step's update direction is

    (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / (q n) + grad R(w),

the noised mean of the clipped per-example gradients of the data loss
(Opacus's ``DPOptimizer``), then the regulariser's gradient at the current
parameters, added after the noise and before the optimizer's step
(:meth:`PrivateLoop.make_private`, Opacus's step hook; the term runs once per
step, there, and is not added to the loss). Given the released noised
gradients, ``grad R(w)`` is a function of public and already-released
quantities (``w_g`` from the server, the node's previous iterate), so the
step is post-processing of the Gaussian mechanism and the accountant's
``(sigma, q, steps)`` are unchanged. A term that reads the data, or a
gradient transform (SCAFFOLD's correction), is refused: the clipping would
not bound it (at configuration, :func:`fedlr.strategies.refusals.check_privacy`,
and again on the node, :meth:`fedlr.client.round.ClientRound.loop_control`).

References
----------
.. [1] Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Context, RecordDict

from fedlr.adapters.lora import LoraModel
from fedlr.client.features import ClientFeature, Record, RoundJob, common_feature
from fedlr.client.train import TrainData, TrainSettings
from fedlr.errors import (
    ConfigError,
    PrivacyBudgetError,
    PrivacyUnsupportedError,
    ProtocolError,
)
from fedlr.flower.records import config_float, config_int
from fedlr.privacy.accounting import History, epsilon, noise_multiplier_for
from fedlr.privacy.backend import opacus_api
from fedlr.privacy.budget import data_key
from fedlr.privacy.dp_evaluation import reserve
from fedlr.privacy.node_policy import NodePolicy, node_policy
from fedlr.privacy.settings import DpSgdSettings
from fedlr.randomness import secure_generator, seeded_generator
from fedlr.wire.protocol import SERVER_ROUND

__all__ = [
    "DP_ACCOUNTANT",
    "DP_DELTA",
    "DP_EPSILON",
    "DP_EPSILON_RUN",
    "DP_EPSILON_SPENT",
    "DP_MAX_GRAD_NORM",
    "DP_NOISE_MULTIPLIER",
    "DP_NOISE_REPRODUCIBLE",
    "DP_REPRODUCIBLE",
    "DP_ROUNDS",
    "DP_SAMPLE_RATE",
    "DpSgd",
    "PrivateLoop",
    "node_history",
    "private_loop",
    "sample_mean_loss",
]

DP_MAX_GRAD_NORM = "dp-max-grad-norm"
DP_NOISE_MULTIPLIER = "dp-noise-multiplier"
DP_EPSILON = "dp-epsilon"
DP_DELTA = "dp-delta"
DP_ACCOUNTANT = "dp-accountant"
DP_ROUNDS = "dp-rounds"
DP_REPRODUCIBLE = "dp-reproducible-noise"
"""Instruction keys (the run-config keys of the same names; ``dp-rounds`` is
the run's ``num-server-rounds``)."""

DP_EPSILON_SPENT = "dp-epsilon-spent"
DP_SAMPLE_RATE = "dp-sample-rate"
DP_EPSILON_RUN = "dp-epsilon-run"
DP_NOISE_REPRODUCIBLE = "dp-noise-reproducible"
"""Reply metrics: the node's epsilon over its ledger (every run) and over this
run, the sampling rate, and whether the noise came from the run seed, beside
``dp-noise-multiplier`` and ``dp-delta`` (the values the node used)."""

_NODE_HISTORY = "fedlr-dp-sgd"
"""``context.state`` ConfigRecord: the node's ``(sigma, q, steps)`` history."""

IGNORE_INDEX = -100

# Opacus's backward hooks sit on the first trained module too, whose inputs
# need no gradient; torch warns about that on every step, harmlessly.
warnings.filterwarnings(
    "ignore",
    message="Full backward hook is firing when gradients are computed with "
    "respect to module outputs",
    category=UserWarning,
)


def node_history(state: RecordDict) -> History:
    """The ``(sigma, q, steps)`` rounds a node's ``context.state`` records."""
    record = state.config_records.get(_NODE_HISTORY)
    if record is None:
        return []
    try:
        sigmas = [float(v) for v in record["noise-multipliers"]]  # type: ignore[union-attr]
        rates = [float(v) for v in record["sample-rates"]]  # type: ignore[union-attr]
        steps = [int(v) for v in record["steps"]]  # type: ignore[union-attr]
        return list(zip(sigmas, rates, steps, strict=True))
    except (KeyError, TypeError, ValueError) as exc:
        # Restarting the account at zero would under-report; refuse instead.
        raise ProtocolError(
            f"the node's DP-SGD history ('{_NODE_HISTORY}' in context.state) is "
            f"unreadable ({exc}); the node cannot account its privacy"
        ) from None


def _save_history(state: RecordDict, history: History) -> None:
    state[_NODE_HISTORY] = ConfigRecord(
        {
            "noise-multipliers": [float(s) for s, _, _ in history],
            "sample-rates": [float(q) for _, q, _ in history],
            "steps": [int(n) for _, _, n in history],
        }
    )


def sample_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The batch's mean of per-example losses (each example's gradient its own).

    A transformers model's own loss over a causal-LM batch is the mean over
    all the batch's tokens, which weights an example by the others' lengths;
    DP-SGD needs each example's loss to depend on that example only.

    Parameters
    ----------
    logits : (B, K) or (B, T, V) torch.Tensor
        A classifier's logits, or a causal LM's.
    labels : (B,) or (B, T) torch.Tensor of int64
        Class labels; or token labels (``-100``: ignored), predicted from the
        previous position as transformers' causal LMs do.

    Returns
    -------
    torch.Tensor
        Scalar: ``mean_i loss_i``, a causal example's loss the mean over its
        labelled tokens.
    """
    if labels.dim() == 1:
        return F.cross_entropy(logits.float(), labels)
    if labels.dim() == 2 and logits.dim() == 3:
        shifted = logits[:, :-1].float()
        target = labels[:, 1:]
        tokens = F.cross_entropy(
            shifted.reshape(-1, shifted.shape[-1]),
            target.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).view(target.shape)
        mask = (target != IGNORE_INDEX).to(tokens.dtype)
        per_example = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
        return per_example.mean()
    raise PrivacyUnsupportedError(
        f"DP-SGD computes per-example losses for class labels (B,) or token "
        f"labels (B, T); got logits {tuple(logits.shape)} and labels "
        f"{tuple(labels.shape)}"
    )


class PrivateLoop:
    """DP-SGD's :class:`~fedlr.client.train.LoopControl`: one node's training loop.

    Parameters
    ----------
    settings : DpSgdSettings
        The instruction's settings.
    state : flwr.app.RecordDict
        The node's ``context.state``: this run's privacy history is read from
        it and the round's steps are appended to it when the loop stops.
    policy : NodePolicy, optional
        The node's own limits (default: none but the ledger in the default
        state directory).
    run_id, server_round : int
        Recorded with the round's release in the node's ledger.
    """

    def __init__(
        self,
        settings: DpSgdSettings,
        state: RecordDict,
        policy: NodePolicy | None = None,
        *,
        run_id: int = 0,
        server_round: int = 0,
    ) -> None:
        self.settings = settings
        self.regulariser: Callable[[], torch.Tensor] | None = None
        self.state = state
        self.policy = policy or NodePolicy()
        self.run_id = int(run_id)
        self.server_round = int(server_round)
        self.history: History = node_history(state)
        self.lifetime: History = []
        self.sigma = settings.noise_multiplier
        self.delta = settings.delta
        self.sample_rate = 1.0
        self.reproducible = False
        self.taken = 0
        self._n = 0
        self._hooks: Any = None  # Opacus's GradSampleHooks while a round trains
        self._params: list[torch.nn.Parameter] = []
        self._sampler = torch.Generator()

    def make_private(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: TrainData,
        settings: TrainSettings,
        seed: int,
        *,
        regulariser: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[torch.optim.Optimizer, Iterator[list[int]]]:
        """DP-SGD's entry point, as Opacus's ``make_private``: check the
        limits, reserve the round in the ledger, attach Opacus's hooks to
        ``model``; the private optimizer and the Poisson batches over ``data``.

        Every training loop of a node reaches DP-SGD here, through
        :func:`fedlr.client.train.train_steps` (``control=``).

        ``regulariser``: ``R()``, a scalar function of the trained parameters
        that reads no data (the round's data-independent loss terms,
        :meth:`fedlr.client.round.ClientRound.penalty`): its gradient at the
        current parameters is added to each step's noised gradient, after the
        clipping and noise, before the optimizer's step (the module
        docstring); it runs once per step, here only. ``None``: none.

        ``q = min(1, batch-size / n)``; ``sigma`` is the instruction's, or
        derived from ``dp-epsilon`` for ``dp-rounds`` x local steps. The noise
        and the Poisson batches come from OS-seeded generators
        (:func:`fedlr.randomness.secure_generator`), unless the
        instruction asks for reproducible noise *and* the node's policy allows
        it (then from ``seed`` and ``seed + 1``).

        Raises
        ------
        PrivacyUnsupportedError
            A layer that mixes the examples of a batch (BatchNorm in training
            mode): no per-example gradient exists to clip.
        NodePolicyError
            A delta above the node's, or not below ``1 / n``; more steps than
            the node's ``dp-max-steps-per-round``.
        PrivacyBudgetError
            If this round's steps would spend more than the instruction's
            ``dp-epsilon`` (this run) or the node's ``dp-epsilon-budget``
            (its ledger, every run).
        """
        _check_per_example(model)
        self._reserve(data, settings.batch_size, settings.local_steps)
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        api = opacus_api()
        private = api.DPOptimizer(
            optimizer,
            noise_multiplier=self.sigma,
            max_grad_norm=self.settings.max_grad_norm,
            expected_batch_size=max(1, round(self.sample_rate * self._n)),
            loss_reduction="mean",
            generator=self._generators(seed),
        )
        self.regulariser = regulariser
        if regulariser is not None:
            # after the clipping, the noise and the 1 / (q n) scaling
            private.attach_step_hook(self._add_regulariser)
        self._hooks = api.GradSampleHooks(
            model, batch_first=True, loss_reduction="mean", strict=False
        )
        return private, self._poisson()

    def _reserve(self, data: TrainData, batch_size: int, steps: int) -> None:
        """The round's ``q``, ``delta`` and ``sigma``, checked against this
        run's budget and the node's limits, and reserved in its ledger."""
        s = self.settings
        n = len(data)
        self._n = n
        self.sample_rate = min(1.0, batch_size / n)
        self.delta = self.policy.delta_for(s.delta, n)
        self.policy.check_steps(steps)  # dp-max-steps-per-round, before the ledger
        if self.sigma <= 0:
            self.sigma = noise_multiplier_for(
                s.epsilon, self.delta, self.sample_rate, s.rounds * steps, s.accountant
            )
        release = (self.sigma, self.sample_rate, steps)
        if s.epsilon > 0:
            self._check_run_budget(release)
        self.lifetime = reserve(
            self.policy,
            self.policy.dp_ledger_id or data_key(data),
            release,
            delta=self.delta,
            run_id=self.run_id,
            server_round=self.server_round,
            what=f"this round (noise multiplier {self.sigma:.4g}, sample rate "
            f"{self.sample_rate:.4g}, {steps} steps)",
        )
        self.lifetime.append(release)

    def _generators(self, seed: int) -> torch.Generator:
        """The noise generator (returned) and the Poisson sampler's: OS-seeded,
        or from ``seed`` and ``seed + 1`` where reproducible noise is asked
        for and allowed."""
        device = self._params[0].device if self._params else torch.device("cpu")
        self.reproducible = (
            self.settings.reproducible and self.policy.dp_allow_reproducible_noise
        )
        if self.reproducible:
            noise = seeded_generator([seed], device)
            self._sampler = seeded_generator([seed + 1])
        else:
            noise = secure_generator(device)
            self._sampler = secure_generator()
        return noise

    def _add_regulariser(self, optimizer: Any) -> None:
        """``p.grad += dR/dp`` at the current parameters (Opacus's step hook:
        ``p.grad`` already holds the noised mean of the clipped per-example
        gradients)."""
        if self.regulariser is None:
            return
        params = [p for p in self._params if p.grad is not None]
        with torch.enable_grad():
            value = self.regulariser()
        if not value.requires_grad:  # constant in the parameters
            return
        grads = torch.autograd.grad(value, params, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                if g is not None and p.grad is not None:
                    p.grad.add_(g.to(p.grad.dtype))

    def _check_run_budget(self, release: tuple[float, float, int]) -> None:
        s = self.settings
        after = epsilon([*self.history, release], self.delta, s.accountant)
        if after > s.epsilon:
            spent = epsilon(self.history, self.delta, s.accountant)
            raise PrivacyBudgetError(
                f"{DP_EPSILON} {s.epsilon:g} would be exceeded: this node has "
                f"spent epsilon {spent:.4g} (delta {self.delta:.3g}) in "
                f"{len(self.history)} rounds of this run and this round would "
                f"reach {after:.4g}; it trains no more (raise {DP_EPSILON} or "
                f"{DP_NOISE_MULTIPLIER}, or plan fewer rounds)"
            )

    def _poisson(self) -> Iterator[list[int]]:
        """Poisson sampling: each example joins a step with probability ``q``."""
        while True:
            drawn = torch.rand(self._n, generator=self._sampler) < self.sample_rate
            yield drawn.nonzero().flatten().tolist()

    def loss(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """:func:`sample_mean_loss` of the model's logits (``output.logits``,
        or ``output`` itself for a model that returns its logits)."""
        self.taken += 1
        logits = output if isinstance(output, torch.Tensor) else output.logits
        return sample_mean_loss(logits, batch["labels"])

    def empty_step(self) -> None:
        """No example drawn: zero per-example gradients, so the step is noise."""
        self.taken += 1
        for p in self._params:
            empty = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            setattr(p, "grad_sample", empty)  # noqa: B010 (Opacus's attribute)

    def stop(self) -> None:
        """Remove the hooks and the per-example gradients; record the steps."""
        if self._hooks is not None:
            self._hooks.remove_hooks()
            self._hooks = None
        for p in self._params:
            for name in ("grad_sample", "summed_grad"):
                if hasattr(p, name):
                    delattr(p, name)
        if self.taken:
            self.history.append((self.sigma, self.sample_rate, self.taken))
            _save_history(self.state, self.history)
            self.taken = 0

    def spent(self) -> float:
        """The node's ``epsilon`` at ``delta`` over every round its ledger
        records (every run), by the instruction's accountant."""
        rounds = self.lifetime or self.history
        return epsilon(rounds, self.delta, self.settings.accountant)

    def metrics(self) -> dict[str, float]:
        """The reply's DP-SGD metrics (:attr:`DpSgd.metrics`), after the loop."""
        return {
            DP_EPSILON_SPENT: self.spent(),
            # this run's rounds alone (context.state)
            DP_EPSILON_RUN: epsilon(self.history, self.delta, self.settings.accountant),
            DP_NOISE_MULTIPLIER: float(self.sigma),
            DP_DELTA: float(self.delta),
            DP_SAMPLE_RATE: float(self.sample_rate),
            DP_NOISE_REPRODUCIBLE: float(self.reproducible),
        }


def private_loop(config: ConfigRecord, context: Context) -> PrivateLoop | None:
    """The DP-SGD loop of a ``train`` instruction, or ``None`` without DP-SGD.

    How every payload decides DP-SGD on a node: the LoRA family
    (:class:`DpSgd`) and the vision payloads
    (:func:`fedlr.tasks.image.train_images`) hand the loop it returns to
    :func:`fedlr.client.train.train_steps`, which makes the round private
    with :meth:`PrivateLoop.make_private`. The instruction's settings are
    checked, then the node's own limits
    (:meth:`~fedlr.privacy.node_policy.NodePolicy.check_instruction`).

    Raises
    ------
    NodePolicyError
        No DP-SGD on a ``dp-required`` node, or settings past its limits.
    ProtocolError
        DP-SGD settings that do not decode or are out of range.
    """
    policy = node_policy(context.node_config)
    if config_float(config, DP_MAX_GRAD_NORM, 0.0) <= 0:
        policy.check_instruction(None)
        return None
    try:
        settings = DpSgdSettings(
            max_grad_norm=config_float(config, DP_MAX_GRAD_NORM),
            noise_multiplier=config_float(config, DP_NOISE_MULTIPLIER, 0.0),
            epsilon=config_float(config, DP_EPSILON, 0.0),
            delta=config_float(config, DP_DELTA, 0.0),
            accountant=str(config.get(DP_ACCOUNTANT, "prv")),
            rounds=config_int(config, DP_ROUNDS, 1),
            reproducible=bool(config.get(DP_REPRODUCIBLE, False)),
        )
    except ConfigError as exc:
        raise ProtocolError(f"the instruction's DP-SGD settings: {exc}") from None
    policy.check_instruction(settings)
    return PrivateLoop(
        settings,
        context.state,
        policy,
        run_id=int(context.run_id),
        server_round=config_int(config, SERVER_ROUND, 0),
    )


def _check_per_example(model: torch.nn.Module) -> None:
    """Refuse a layer that mixes a batch's examples (BatchNorm in training mode):
    its examples have no gradients of their own to clip."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            raise PrivacyUnsupportedError(
                f"{DP_MAX_GRAD_NORM}: DP-SGD clips each example's gradient, but "
                f"layer '{name}' ({type(module).__name__}) normalises each "
                "example by the others of its batch; use a model with GroupNorm "
                f"or LayerNorm, or set {DP_MAX_GRAD_NORM} = 0"
            )


@common_feature
class DpSgd(ClientFeature):
    """The client side of sample-level DP-SGD (see the module docstring).

    On for a ``train`` instruction with ``dp-max-grad-norm`` > 0. It does not
    change the arrays; it runs the training loop (:meth:`loop`, a
    :class:`PrivateLoop`, given the round's data-independent loss terms) and
    reports the node's ``epsilon``.

    Its keys are checked together when the settings are built
    (:class:`~fedlr.privacy.settings.DpSgdSettings`, then the node's own
    limits), so they are declared by name, without a bound each.
    """

    keys = (
        DP_MAX_GRAD_NORM,
        DP_NOISE_MULTIPLIER,
        DP_EPSILON,
        DP_DELTA,
        DP_ACCOUNTANT,
        DP_ROUNDS,
        DP_REPRODUCIBLE,
    )
    node_state = (
        Record(
            _NODE_HISTORY,
            "this run's `(σ, q, steps)` per round (the node's ledger of every "
            "run is a file in its state directory)",
        ),
    )
    metrics = (
        Record(DP_EPSILON_SPENT, "the node's ε over its ledger (every run)"),
        Record(DP_EPSILON_RUN, "the node's ε over this run"),
        Record(DP_NOISE_MULTIPLIER, "the σ it used"),
        Record(DP_DELTA, "the δ it used"),
        Record(DP_SAMPLE_RATE, "`q = batch-size / n` (reveals `n`)"),
        Record(DP_NOISE_REPRODUCIBLE, "1 if the noise came from the run seed"),
    )
    order = 90

    def __init__(self, control: PrivateLoop) -> None:
        self.control = control
        self.rounds_before = len(self.control.history)

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if not job.is_train:
            return None
        control = private_loop(job.config, job.context)
        if control is None:
            return None
        if not isinstance(job.adapted, LoraModel):
            raise PrivacyUnsupportedError(
                f"{DP_MAX_GRAD_NORM}: DP-SGD serves LoRA adapters; this model is "
                f"a {type(job.adapted.layout).__name__} (VeRA-family layers have "
                "no per-example gradient sampler); use a LoRA method or set "
                f"{DP_MAX_GRAD_NORM} = 0"
            )
        return cls(control)

    def loop(self, job: RoundJob) -> PrivateLoop:
        """The private loop; :func:`fedlr.client.train.train_steps` hands it the
        round's loss terms as its regulariser (their gradient is added after
        the clipping and noise).

        :meth:`fedlr.client.round.ClientRound.loop_control` refuses a round whose
        terms read the data before the loop starts.
        """
        return self.control

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, Any],
        content: RecordDict,
    ) -> None:
        control = self.control
        if len(control.history) == self.rounds_before:
            raise ProtocolError(
                f"{DP_MAX_GRAD_NORM} is set but no private step ran: train with "
                "fedlr.client.train.train_steps(..., control=job.loop_control())"
            )
        metrics.update(control.metrics())
