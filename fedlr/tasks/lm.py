"""Instruction data for causal LMs, and their evaluation (plain torch).

:class:`EncodedInstructions` is what :func:`fedlr.client.train.train_steps` trains
on for the causal-LM task: ``batch`` gives right-padded ``input_ids``,
``attention_mask`` and ``labels`` with -100 over the prompt and the padding,
so a ``transformers`` causal LM's own loss is the response-only next-token
loss. :func:`evaluate_lm` scores a model on held-out instructions: the
response tokens' perplexity (teacher forcing) and the exact match of a
greedily generated answer (:func:`fedlr.data.instruct_text.exact_match`).
Nothing here knows about Flower.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fedlr.client.train import in_batches, pad_rows
from fedlr.data.instruct_text import encode_example, exact_match, format_prompt

__all__ = ["EncodedInstructions", "encode_instructions", "evaluate_lm"]

_LOG = logging.getLogger("fedlr")
IGNORE = -100


@dataclass(frozen=True)
class EncodedInstructions:
    """Tokenized instructions: training sequences, prompts and reference answers.

    Attributes
    ----------
    input_ids : list of list of int
        Prompt + response + end-of-sequence tokens, cut to ``max-length``.
    labels : list of list of int
        The same length; -100 over the prompt.
    prompts : list of list of int
        The prompt tokens alone (what generation continues).
    answers : list of str
        Reference answers for exact match.
    pad_id : int
    ledger_key : str
        The digest of the raw data the node holds, its default privacy-ledger
        id (:func:`fedlr.privacy.budget.raw_data_key`); ``""``: none given.
    """

    input_ids: list[list[int]]
    labels: list[list[int]]
    prompts: list[list[int]]
    answers: list[str]
    pad_id: int
    ledger_key: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Right-pad the selected sequences; padding is masked and labelled -100."""
        ids, mask = pad_rows([self.input_ids[i] for i in indices], self.pad_id)
        labels, _ = pad_rows([self.labels[i] for i in indices], IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def prompt_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Left-pad the selected prompts (for batched generation)."""
        rows = [self.prompts[i] for i in indices]
        ids, mask = pad_rows(rows, self.pad_id, left=True)
        return {"input_ids": ids, "attention_mask": mask}


def encode_instructions(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str,
    max_length: int,
) -> EncodedInstructions:
    """Tokenize rows with ``instruction`` and ``response`` (and optional ``answer``).

    The prompt is :func:`~fedlr.data.instruct_text.format_prompt`'s: the
    tokenizer's chat template when it has one, else ``template``. The
    reference answer is the row's ``answer`` when the data set has one (a
    GSM8K final number), else its ``response``.

    Raises
    ------
    ValueError
        If a row's prompt alone fills ``max_length`` tokens (nothing of its
        response would be trained on); the message says how long it is.
    """
    ids, labels, prompts, answers = [], [], [], []
    for n, row in enumerate(rows):
        enc = encode_example(row, tokenizer, template, max_length=max_length)
        # the prompt is the masked prefix (labels -100), unless it fills the cut
        masked = next(
            (i for i, label in enumerate(enc["labels"]) if label != IGNORE),
            len(enc["labels"]),
        )
        if masked >= max_length:
            prompt = format_prompt(
                str(row["instruction"]), template, tokenizer=tokenizer
            )
            length = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            raise ValueError(
                f"row {n}: the prompt has {length} tokens, max-length is "
                f"{max_length}; raise max-length so responses are trained on"
            )
        ids.append(enc["input_ids"])
        labels.append(enc["labels"])
        prompts.append(enc["input_ids"][:masked])
        answer = row.get("answer") or row["response"]
        answers.append(str(answer))
    pad = tokenizer.pad_token_id
    return EncodedInstructions(
        input_ids=ids,
        labels=labels,
        prompts=prompts,
        answers=answers,
        pad_id=int(pad if pad is not None else tokenizer.eos_token_id),
    )


@torch.no_grad()
def evaluate_lm(
    model: torch.nn.Module,
    data: EncodedInstructions,
    tokenizer: PreTrainedTokenizerBase,
    *,
    batch_size: int,
    device: torch.device,
    max_new_tokens: int,
) -> dict[str, float]:
    """Response perplexity and exact match of greedy answers.

    Returns
    -------
    dict
        ``loss``: mean next-token cross-entropy over every response token of
        ``data`` (end-of-sequence included); ``perplexity``: ``exp(loss)``;
        ``exact-match``: share of examples whose greedily generated answer
        (at most ``max_new_tokens`` tokens, stopped at end-of-sequence)
        matches the reference; ``accuracy``: the same share (the column every
        fedlr task reports).
    """
    nan = math.nan
    if len(data) == 0:
        return {"accuracy": nan, "loss": nan, "perplexity": nan, "exact-match": nan}
    model.to(device).eval()
    order = sorted(range(len(data)), key=lambda i: len(data.input_ids[i]))
    nll = _response_nll(model, data, order, batch_size, device)
    hits = _exact_matches(
        model, data, tokenizer, order, batch_size, device, max_new_tokens
    )
    loss = nll[0] / max(nll[1], 1)
    em = hits / len(data)
    return {
        "accuracy": em,
        "loss": loss,
        "perplexity": math.exp(min(loss, 80.0)),
        "exact-match": em,
    }


def _response_nll(
    model: torch.nn.Module,
    data: EncodedInstructions,
    order: list[int],
    batch_size: int,
    device: torch.device,
) -> tuple[float, int]:
    """The summed next-token cross-entropy over every response token of
    ``data``, and the number of those tokens (batches taken in ``order``)."""
    nll = [0.0, 0]  # summed loss, tokens

    def score(start: int, stop: int) -> None:
        idx = order[start:stop]
        batch = {k: v.to(device) for k, v in data.batch(idx).items()}
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
        target = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        nll[0] += float(loss)
        nll[1] += int((target != IGNORE).sum())

    in_batches(len(data), batch_size, score)
    return float(nll[0]), int(nll[1])


def _exact_matches(
    model: torch.nn.Module,
    data: EncodedInstructions,
    tokenizer: PreTrainedTokenizerBase,
    order: list[int],
    batch_size: int,
    device: torch.device,
    max_new_tokens: int,
) -> int:
    """How many greedily generated answers (at most ``max_new_tokens``
    tokens, stopped at end-of-sequence) match their reference."""
    hits = [0]

    def generate(start: int, stop: int) -> None:
        idx = order[start:stop]
        batch = {k: v.to(device) for k, v in data.prompt_batch(idx).items()}
        generate_fn: Any = model.generate
        out = generate_fn(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=data.pad_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        width = batch["input_ids"].shape[1]
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        hits[0] += sum(
            exact_match(text, data.answers[i])
            for text, i in zip(texts, idx, strict=True)
        )

    in_batches(len(data), batch_size, generate)
    return hits[0]
