"""Local training and evaluation loops for text classifiers (plain torch).

Nothing here knows about Flower: the client apps call :func:`train_steps` and
:func:`evaluate`, the server app calls :func:`evaluate`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from fedlr.errors import ConfigError
from fedlr.wire.protocol import LOCAL_OPTIMIZER, OPTIMIZERS

_LOG = logging.getLogger("fedlr")


def default_optimizer(choice: str, method_default: str = "adamw") -> str:
    """The local solver a run-config value ``choice`` names: itself, or for
    ``auto`` the method's own (``method_default``: AdamW unless the method's
    server says otherwise in the instruction)."""
    return method_default if choice == "auto" else choice


__all__ = [
    "LOCAL_OPTIMIZER",
    "OPTIMIZERS",
    "EncodedText",
    "LoopControl",
    "TrainData",
    "TrainSettings",
    "default_optimizer",
    "encode_text",
    "evaluate",
    "model_loss",
    "model_output",
    "pad_rows",
    "pick_device",
    "train_steps",
]


def pick_device(preference: str = "auto") -> torch.device:
    """``auto`` picks CUDA, then MPS, then CPU; otherwise the named device.

    Raises
    ------
    ConfigError
        (key ``device``) if the named device is not on this machine: CUDA or
        MPS unavailable, or a CUDA index beyond the devices there are.
    """
    if preference.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(preference.split(":")[1]) if ":" in preference else 0
        if index >= count:
            raise ConfigError(
                "device",
                f"'{preference}' was asked for but this machine has "
                f"{count} CUDA device(s); use 'auto' or 'cpu'",
            )
    if preference == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "device", "'mps' was asked for but MPS is not available on this machine"
        )
    if preference != "auto":
        return torch.device(preference)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class TrainData(Protocol):
    """What :func:`train_steps` trains on: a length and padded batches."""

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class EncodedText:
    """Token ids of a text data set, unpadded, with labels.

    Attributes
    ----------
    input_ids : list of list of int
    labels : (N,) torch.Tensor of int64
    ledger_key : str
        The digest of the raw data the node holds, its default privacy-ledger
        id (:func:`fedlr.privacy.budget.raw_data_key`); ``""``: none given.
    """

    input_ids: list[list[int]]
    labels: torch.Tensor
    pad_id: int
    ledger_key: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Pad the selected examples to the longest among them."""
        ids, mask = pad_rows([self.input_ids[i] for i in indices], self.pad_id)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": self.labels[list(indices)],
        }


def pad_rows(
    rows: Sequence[Sequence[int]], pad: int, *, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded to the longest: ``(ids, attention_mask)``, int64.

    Padding goes on the right (training, teacher forcing) or, with ``left``,
    on the left (batched generation continues every row at the same column).
    """
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[j, cols] = torch.tensor(row, dtype=torch.long)
        mask[j, cols] = 1
    return ids, mask


def encode_text(
    texts: Sequence[str],
    labels: Sequence[int],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
) -> EncodedText:
    """Tokenize ``texts`` (truncated to ``max_length`` tokens)."""
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    enc = tokenizer(list(texts), truncation=True, max_length=max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return EncodedText(
        input_ids=[list(x) for x in enc["input_ids"]],
        labels=torch.as_tensor(list(labels), dtype=torch.long),
        pad_id=int(pad_id),
    )


@dataclass(frozen=True)
class TrainSettings:
    """Local optimisation settings of one round.

    Attributes
    ----------
    local_steps : int
        Optimiser steps per round.
    lr : float
        The local solver's learning rate.
    batch_size : int
    weight_decay : float
    max_grad_norm : float
        Gradient clipping threshold (0 disables).
    optimizer : {"adamw", "sgd"}
        The local solver (:data:`OPTIMIZERS`): AdamW, or SGD, each with ``lr``
        and ``weight_decay``.
    momentum : float
        SGD's momentum (0: plain SGD; the vision clients' ``momentum``).
    """

    local_steps: int
    lr: float
    batch_size: int
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optimizer: str = "adamw"
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                LOCAL_OPTIMIZER,
                f"'{self.optimizer}' is not one of {', '.join(OPTIMIZERS)}",
            )


class LoopControl(Protocol):
    """A client feature that runs :func:`train_steps`' batches, loss and step.

    Sample-level DP-SGD (:class:`fedlr.privacy.dp_sgd.PrivateLoop`) is one:
    Poisson batches, a loss whose per-example gradients Opacus can clip, and
    an optimizer that clips each example's gradient and adds noise.
    """

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
        """Prepare the loop (hooks on ``model``, over ``data``), as Opacus's
        ``make_private``: the optimizer to step with and the example indices
        of each step (possibly empty).

        ``regulariser``: the round's loss terms that read no data; the
        control adds their gradient to each step itself (they are not added
        to the loss). May raise to refuse the round (a spent privacy budget).
        """
        ...

    def loss(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step's loss from the model's output and the batch."""
        ...

    def empty_step(self) -> None:
        """Prepare a step over an empty batch (before ``optimizer.step()``)."""
        ...

    def stop(self) -> None:
        """Undo :meth:`make_private` (remove hooks) and record the steps taken."""
        ...


Forward = Callable[[torch.nn.Module, dict[str, torch.Tensor]], Any]
"""One training batch through a model: its output."""

Loss = Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]
"""A step's loss from the model's output and the batch."""


def model_output(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """A transformers model's forward on ``batch`` (labels included)."""
    return model(**batch)


def model_loss(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A transformers model's own loss (``output.loss``)."""
    return output.loss


def _batches(
    n: int, batch_size: int, generator: torch.Generator
) -> Iterator[list[int]]:
    while True:
        order = torch.randperm(n, generator=generator).tolist()
        for start in range(0, n, batch_size):
            chunk = order[start : start + batch_size]
            if chunk:
                yield chunk


def client_seed(seed: int, server_round: int, partition: int) -> int:
    """The seed of one client's local training in one round.

    A function of the run seed, the round and the partition only, so a round
    trains identically whatever happened before it (a resumed run reproduces
    an uninterrupted one).
    """
    return seed * 1_000_003 + server_round * 1_009 + partition


def train_steps(
    model: torch.nn.Module,
    data: TrainData,
    settings: TrainSettings,
    *,
    seed: int,
    device: torch.device,
    penalty: Callable[[], torch.Tensor] | None = None,
    after_backward: Callable[[], None] | None = None,
    wrap_optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]
    | None = None,
    control: LoopControl | None = None,
    forward: Forward = model_output,
    loss: Loss = model_loss,
) -> float:
    """Run ``settings.local_steps`` optimiser steps on the trainable parameters.

    The optimiser is ``settings.optimizer``: AdamW (the default) or SGD.

    Parameters
    ----------
    model, data, settings
        The model (its trainable parameters are optimised), the client's
        data and the round's settings.
    seed : int
        Seed of the batch order and of dropout.
    device : torch.device
    penalty : callable, optional
        A term that reads no data, added once per step (the round's client
        features' loss terms, :meth:`fedlr.client.round.ClientRound.penalty`),
        called after the model moved to ``device``: to every step's loss, or
        under ``control`` by the control after its clipping and noise.
    after_backward : callable, optional
        Called after every ``backward`` and before gradient clipping and the
        step (:meth:`fedlr.client.round.ClientRound.after_backward`: gradient
        transforms such as SCAFFOLD's correction).
    wrap_optimizer : callable, optional
        Given the optimizer, returns the one to step with
        (:meth:`fedlr.client.round.ClientRound.optimizer`).
    control : LoopControl, optional
        A feature that runs the loop's batches, loss and step itself
        (:meth:`fedlr.client.round.ClientRound.loop_control`: sample-level DP-SGD's
        Poisson batches, per-sample clipping and noise). It replaces the
        ``max_grad_norm`` clipping of the batch gradient.
    forward, loss : callable, optional
        The model's output on a batch and the step's loss from it (default
        :func:`model_output`, :func:`model_loss`: a transformers model's own
        loss); under ``control`` the loss is the control's, from the output.

    Returns
    -------
    float
        Mean training loss over the steps (without the penalty; NaN if every
        step drew no example).
    """
    if len(data) == 0:
        raise ValueError("cannot train on an empty partition")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(params, settings, wrap_optimizer)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    model.to(device).train()
    batches = _batches(len(data), settings.batch_size, generator)
    if control is not None:
        optimizer, batches = control.make_private(
            model, optimizer, data, settings, seed, regulariser=penalty
        )
        penalty = None  # the control adds its gradient, once per step
    losses: list[float] = []
    try:
        for _ in range(settings.local_steps):
            indices = next(batches)
            if not indices:  # a Poisson draw of no example: the step is noise
                _empty_step(optimizer, control)
                continue
            batch = {k: v.to(device) for k, v in data.batch(indices).items()}
            value = _step_loss(model, batch, forward, loss, control)
            objective = value if penalty is None else value + penalty()
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            if after_backward is not None:
                after_backward()
            if settings.max_grad_norm > 0 and control is None:
                torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
            optimizer.step()
            losses.append(float(value.detach()))
    finally:
        if control is not None:
            control.stop()
    return sum(losses) / len(losses) if losses else math.nan


def _optimizer(
    params: list[torch.nn.Parameter],
    settings: TrainSettings,
    wrap: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None,
) -> torch.optim.Optimizer:
    """The round's local solver over ``params`` (:attr:`TrainSettings.optimizer`),
    as ``wrap`` wraps it."""
    optimizer: torch.optim.Optimizer
    if settings.optimizer == "sgd":
        optimizer = torch.optim.SGD(
            params,
            lr=settings.lr,
            momentum=settings.momentum,
            weight_decay=settings.weight_decay,
        )
    else:
        optimizer = torch.optim.AdamW(
            params, lr=settings.lr, weight_decay=settings.weight_decay
        )
    return optimizer if wrap is None else wrap(optimizer)


def _step_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    forward: Forward,
    loss: Loss,
    control: LoopControl | None,
) -> torch.Tensor:
    """The step's loss from the model's output: ``loss``, or under ``control``
    the control's (DP-SGD's per-example mean)."""
    output = forward(model, batch)
    return loss(output, batch) if control is None else control.loss(output, batch)


def _empty_step(optimizer: torch.optim.Optimizer, control: LoopControl | None) -> None:
    """A step over no example (a Poisson draw of none): under DP-SGD, noise."""
    optimizer.zero_grad(set_to_none=True)
    if control is not None:
        control.empty_step()
    optimizer.step()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: EncodedText, *, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``data``."""
    if len(data) == 0:
        return math.nan, math.nan
    model.to(device).eval()
    totals = [0, 0.0]  # correct, loss sum
    # Batches of similar length waste no compute on padding; the result does
    # not depend on the order.
    order = sorted(range(len(data)), key=lambda i: len(data.input_ids[i]))

    def step(start: int, stop: int) -> None:
        idx = order[start:stop]
        batch = {k: v.to(device) for k, v in data.batch(idx).items()}
        out = model(**batch)
        loss = float(out.loss) * len(idx)
        totals[0] += int((out.logits.argmax(-1) == batch["labels"]).sum())
        totals[1] += loss

    in_batches(len(data), batch_size, step)
    return totals[0] / len(data), totals[1] / len(data)


AUTO_EVAL_BATCH = 1024
"""The first batch size tried by ``eval-batch-size = 0`` (halved on OOM)."""


def in_batches(n: int, batch_size: int, step: Callable[[int, int], None]) -> int:
    """Call ``step(start, stop)`` over ``range(n)`` in batches; the size used.

    ``batch_size = 0`` chooses the largest batch that fits: it starts at
    ``min(n, AUTO_EVAL_BATCH)`` and halves the batch whenever the device runs
    out of memory (``torch.OutOfMemoryError``), retrying the same batch, so
    ``step`` must only accumulate once it has succeeded. A fixed
    ``batch_size`` never changes and an OOM propagates.
    """
    size = batch_size or max(1, min(n, AUTO_EVAL_BATCH))
    start = 0
    with torch.no_grad():
        while start < n:
            stop = min(start + size, n)
            try:
                step(start, stop)
            except torch.OutOfMemoryError:
                if batch_size or size == 1:
                    raise
                size //= 2
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                _LOG.info("evaluation batch halved to %d (out of memory)", size)
                continue
            start = stop
    return size
