"""A node's releases charged to its ledger; DP-noised evaluation on its data.

:func:`reserve` is the one way a release enters a node's privacy ledger
(:mod:`fedlr.privacy.budget`): under the ledger's lock the release is checked
against the node's lifetime budget (``dp-epsilon-budget``) and appended,
durably, before anything is computed. DP-SGD's rounds
(:class:`fedlr.privacy.dp_sgd.PrivateLoop`) and noised evaluations go
through it.

An ``evaluate`` reply releases the mean loss, the accuracy and the number
of examples, computed on the node's data. Under ``dp-required`` that is a
release from data the node's budget protects: the node refuses it
(:mod:`fedlr.client_apps.gate`) unless its operator sets
``dp-evaluation-noise-multiplier`` = ``sigma`` > 0. Then (:func:`noised_metrics`)
each example contributes

    u_i = (min(l_i, C) / C, 1[correct_i], 1) / sqrt(3),    ||u_i|| <= 1,

(``l_i >= 0`` its cross-entropy, ``C`` = :data:`LOSS_CLIP` nats), and the
node releases ``sum_i u_i + N(0, sigma^2 I)`` drawn from the OS's secure
source (:func:`fedlr.randomness.secure_generator`): the Gaussian
mechanism with L2 sensitivity 1 under adding or removing one example, the
same mechanism as one DP-SGD step at sampling rate 1. It is charged to the
ledger as the entry ``(sigma, 1, 1)`` at the node's delta, so the
accountant composes evaluations with the training rounds. The reply's
``num-examples``, ``loss`` and ``accuracy`` are post-processing of the noised
sums: the noised count (at least 1), ``C`` times the noised loss sum over
it, the noised correct count over it (clamped to [0, 1]).
"""

from __future__ import annotations

import math

import torch

from fedlr.errors import PrivacyBudgetError
from fedlr.privacy.accounting import History, epsilon
from fedlr.privacy.budget import PrivacyLedger
from fedlr.privacy.node_policy import NodePolicy
from fedlr.randomness import secure_generator

__all__ = ["LOSS_CLIP", "noised_metrics", "reserve"]

LOSS_CLIP = 10.0
"""``C``: an example's cross-entropy is clipped to ``[0, C]`` nats before it
is summed (10 nats: a probability of 4.5e-5 on the true class)."""


def reserve(
    policy: NodePolicy,
    ledger_id: str,
    release: tuple[float, float, int],
    *,
    delta: float,
    run_id: int,
    server_round: int,
    what: str,
) -> History:
    """Check ``release`` against the node's budget and append it to its ledger.

    Parameters
    ----------
    policy : NodePolicy
        The node's limits (its budget, accountant and state directory).
    ledger_id : str
        The ledger's name (``dp-ledger-id``, else a digest of the data).
    release : (sigma, q, steps)
    delta : float
        The release's delta.
    run_id, server_round : int
        Recorded with the entry.
    what : str
        The release in words, for the refusal (``"this round (noise
        multiplier 1.2, sample rate 0.1, 5 steps)"``).

    Returns
    -------
    History
        The ledger's releases before this one (every run).

    Raises
    ------
    PrivacyBudgetError
        If the ledger's epsilon with ``release`` would pass
        ``dp-epsilon-budget``; nothing is appended.
    """
    ledger = PrivacyLedger(policy.state_path(), ledger_id)
    with ledger.locked():
        lifetime = ledger.history()
        budget = policy.dp_epsilon_budget
        if budget > 0:
            kind = policy.dp_accountant
            after = epsilon([*lifetime, release], delta, kind)
            if after > budget:
                spent = epsilon(lifetime, delta, kind)
                raise PrivacyBudgetError(
                    f"dp-epsilon-budget {budget:g} (node config) would be "
                    f"exceeded: this node's data has spent epsilon {spent:.4g} "
                    f"(delta {delta:.3g}, {kind}) over {len(lifetime)} releases "
                    f"of every run, and {what} would reach {after:.4g}; it "
                    "answers no more"
                )
        ledger.append(release, run_id=run_id, server_round=server_round, delta=delta)
    return lifetime


def noised_metrics(
    losses: torch.Tensor,
    correct: torch.Tensor,
    sigma: float,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """``num-examples``, ``loss`` and ``accuracy`` of one noised evaluation.

    Parameters
    ----------
    losses : (n,) torch.Tensor
        Each example's cross-entropy (clipped to ``[0, LOSS_CLIP]`` here).
    correct : (n,) torch.Tensor
        1 where the prediction was right, else 0.
    sigma : float
        The noise multiplier (> 0), charged by the caller (:func:`reserve`).
    generator : torch.Generator, optional
        The noise's source; default a fresh OS-seeded one.
    """
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be finite and > 0, got {sigma}")
    per_example = torch.stack(
        [
            losses.detach().double().nan_to_num(LOSS_CLIP).clamp(0.0, LOSS_CLIP)
            / LOSS_CLIP,
            correct.detach().double().clamp(0.0, 1.0),
            torch.ones(len(losses), dtype=torch.float64),
        ],
        dim=1,
    ) / math.sqrt(3.0)
    source = generator or secure_generator()
    noise = torch.randn(3, generator=source, dtype=torch.float64)
    loss_sum, correct_sum, count = (
        (per_example.sum(dim=0) + sigma * noise) * math.sqrt(3.0)
    ).tolist()
    examples = max(1.0, count)
    return {
        "num-examples": max(1, round(count)),
        "loss": max(0.0, LOSS_CLIP * loss_sum / examples),
        "accuracy": min(1.0, max(0.0, correct_sum / examples)),
    }
