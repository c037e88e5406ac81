"""Prompts, answer scoring and an offline tokenizer for instruction data.

The text side of :mod:`fedlr.data.instructions`:

- :func:`format_prompt` / :func:`format_example` / :func:`encode_example`:
  the prompt (an Alpaca-style template, or the tokenizer's chat template) and
  the (prompt, response) pair, with the loss masked to the response;
- :func:`extract_answer` / :func:`exact_match`: score a greedily generated
  answer;
- :func:`build_tokenizer`: a byte-level BPE tokenizer trained on the
  generated corpus, cached under ``<cache>/arith-instruct/tokenizer-<key>/``
  (``<cache>`` as in :mod:`fedlr.data.assets`; ``<key>`` hashes the generator
  and tokenizer settings).

``tokenizers`` and ``transformers`` are imported by the functions that need
them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlr.data.assets import cache_dir
from fedlr.data.instructions import (
    DATASET_NAME,
    InstructionConfig,
    _digest,
    _is_int,
    make_splits,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_TEMPLATE",
    "DEFAULT_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "encode_example",
    "exact_match",
    "extract_answer",
    "format_example",
    "format_prompt",
    "tokenizer_path",
    "train_tokenizer",
]

logger = logging.getLogger("fedlr")

DEFAULT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
"""Prompt template without a chat template; ``{instruction}`` is replaced."""

DEFAULT_VOCAB_SIZE = 512
"""Default vocabulary size of :func:`build_tokenizer` (256 bytes, 3 special
tokens and the merges learnt from the corpus)."""

SPECIAL_TOKENS: Mapping[str, str] = {
    "pad_token": "<|pad|>",
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
}
"""Special tokens of :func:`build_tokenizer`, ids 0, 1, 2 in this order."""

_TOKENIZER_FORMAT = 1  # bump when the tokenizer recipe changes: new cache key
_BYTE_ALPHABET = 256


# ------------------------------------------------------------------ answers


def extract_answer(generated: str) -> str:
    """Return the answer part of a generated continuation.

    The first non-empty line, stripped of surrounding whitespace and of a
    trailing full stop (``"42."`` -> ``"42"``); for a worked solution with
    GSM8K's ``#### <answer>`` marker, what follows the last marker (thousands
    separators dropped).

    Parameters
    ----------
    generated : str
        The decoded continuation of the prompt (special tokens skipped).

    Returns
    -------
    str
    """
    if "####" in generated:
        return generated.rsplit("####", 1)[-1].strip().split("\n")[0].replace(",", "")
    for line in generated.splitlines():
        line = line.strip()
        if line:
            return line.rstrip(".!").strip()
    return ""


def exact_match(generated: str, reference: str) -> bool:
    """Return whether a generated answer matches the reference exactly.

    Compares :func:`extract_answer` of ``generated`` with ``reference``,
    ignoring case (names) and surrounding whitespace.

    Parameters
    ----------
    generated, reference : str

    Returns
    -------
    bool
    """
    return extract_answer(generated).casefold() == reference.strip().casefold()


# ------------------------------------------------------------------- prompts


def _has_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def format_prompt(
    instruction: str,
    template: str = DEFAULT_TEMPLATE,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> str:
    """Return the prompt a model continues with the response.

    Parameters
    ----------
    instruction : str
    template : str
        Contains ``{instruction}`` once or more; every occurrence is replaced
        (other braces are kept as they are).
    tokenizer : transformers tokenizer, optional
        If it has a chat template (``tokenizer.chat_template`` set), the prompt
        is ``tokenizer.apply_chat_template([{"role": "user", "content":
        instruction}], tokenize=False, add_generation_prompt=True)`` and
        ``template`` is not used.

    Returns
    -------
    str

    Raises
    ------
    ValueError
        If ``template`` has no ``{instruction}`` (and no chat template is used).
    """
    if tokenizer is not None and _has_chat_template(tokenizer):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if not isinstance(prompt, str):
            raise TypeError(
                f"apply_chat_template returned {type(prompt).__name__}, not str"
            )
        return prompt
    if "{instruction}" not in template:
        raise ValueError(f"template must contain '{{instruction}}', got {template!r}")
    return template.replace("{instruction}", instruction)


def format_example(
    example: Mapping[str, Any],
    template: str = DEFAULT_TEMPLATE,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[str, str]:
    """Return ``(prompt, response)`` so a trainer can mask the prompt's loss.

    Parameters
    ----------
    example : mapping
        With ``instruction`` and ``response`` (an :class:`Example` or a
        dataset row).
    template, tokenizer
        As :func:`format_prompt`.

    Returns
    -------
    (str, str)
        The prompt and the response; ``prompt + response`` is the training
        text (the end-of-sequence token is appended by token id, see
        :func:`encode_example`).
    """
    prompt = format_prompt(str(example["instruction"]), template, tokenizer=tokenizer)
    return prompt, str(example["response"])


def encode_example(
    example: Mapping[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    template: str = DEFAULT_TEMPLATE,
    *,
    max_length: int | None = None,
) -> dict[str, list[int]]:
    """Tokenize an example for causal-LM training, loss on the response only.

    ``input_ids`` = prompt tokens + response tokens + ``eos_token_id``; the
    ``labels`` are -100 over the prompt (ignored by the cross-entropy) and the
    token ids over the response and the end-of-sequence token. Prompt and
    response are tokenized separately without special tokens, so the
    boundary is exact.

    Parameters
    ----------
    example : mapping
        With ``instruction`` and ``response``.
    tokenizer : transformers tokenizer
        Must have an ``eos_token_id``.
    template : str
        As :func:`format_prompt` (the tokenizer's chat template wins).
    max_length : int, optional
        Cut ``input_ids`` and ``labels`` to this many tokens (from the right).

    Returns
    -------
    dict
        ``input_ids``, ``labels`` and ``attention_mask``, lists of equal length.

    Raises
    ------
    ValueError
        If the tokenizer has no end-of-sequence token.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; set tokenizer.eos_token")
    prompt, response = format_example(example, template, tokenizer=tokenizer)
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    response_ids = [*tokenizer(response, add_special_tokens=False)["input_ids"], eos]
    input_ids = prompt_ids + response_ids
    labels = [-100] * len(prompt_ids) + response_ids
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": [1] * len(input_ids),
    }


# ----------------------------------------------------------------- tokenizer


def _tokenizer_settings(
    config: InstructionConfig, vocab_size: int, template: str
) -> dict[str, Any]:
    return {
        "format": _TOKENIZER_FORMAT,
        "generator": asdict(config),
        "vocab_size": vocab_size,
        "template": template,
        "special_tokens": dict(SPECIAL_TOKENS),
    }


def _check_vocab_size(vocab_size: int) -> None:
    low = _BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if not _is_int(vocab_size) or vocab_size < low:
        raise ValueError(
            f"vocab_size must be an integer >= {low} (256 byte tokens and "
            f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}"
        )


def tokenizer_path(
    config: InstructionConfig | None = None,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    template: str = DEFAULT_TEMPLATE,
) -> Path:
    """Return the cache folder of the tokenizer for these settings.

    Returns
    -------
    pathlib.Path
        ``<cache>/arith-instruct/tokenizer-<key>``, ``<key>`` a hash of the
        generator config, the vocabulary size, the template and the special
        tokens; it may not exist yet.
    """
    config = config or InstructionConfig()
    key = _digest(_tokenizer_settings(config, vocab_size, template))
    return cache_dir() / DATASET_NAME / f"tokenizer-{key}"


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (no cache).

    Digits are split into single tokens before BPE (as in Llama), so numbers
    are spelt digit by digit; every byte is in the vocabulary, so any text
    encodes and ``decode(encode(x)) == x``. No special token is added by
    ``encode``; ``<|pad|>``, ``<|bos|>``, ``<|eos|>`` have ids 0, 1, 2.

    Parameters
    ----------
    texts : iterable of str
    vocab_size : int
        At most this many tokens (fewer when the corpus has fewer merges),
        >= 259.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        With ``pad_token``, ``bos_token`` and ``eos_token`` set.
    """
    _check_vocab_size(vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def _load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def build_tokenizer(
    config: InstructionConfig | None = None,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    template: str = DEFAULT_TEMPLATE,
    cache: bool = True,
) -> PreTrainedTokenizerFast:
    """Return the offline tokenizer of the generated set, cached on disk.

    Trained (:func:`train_tokenizer`) on ``prompt + response`` of the train
    split of ``make_splits(config)``, formatted with ``template``, on first
    use; saved with ``save_pretrained`` to :func:`tokenizer_path` (written to
    a temporary folder, then renamed) and loaded from there afterwards, also
    with ``transformers.AutoTokenizer.from_pretrained(tokenizer_path(...))``.
    The same settings give the same tokenizer.

    Parameters
    ----------
    config : InstructionConfig, optional
        Generator settings; ``InstructionConfig()`` by default.
    vocab_size : int
        See :func:`train_tokenizer`.
    template : str
        Prompt template of the training corpus.
    cache : bool
        Read and write the cache (default); ``False`` always trains afresh.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
    """
    config = config or InstructionConfig()
    _check_vocab_size(vocab_size)
    path = tokenizer_path(config, vocab_size=vocab_size, template=template)
    if cache and (path / "tokenizer.json").is_file():
        logger.debug("%s: loading the tokenizer from %s", DATASET_NAME, path)
        return _load_tokenizer(path)
    train = make_splits(config).train
    texts = (
        format_prompt(ex["instruction"], template) + ex["response"] for ex in train
    )
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    if not cache:
        return tokenizer
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        tokenizer.save_pretrained(str(tmp))
        settings = _tokenizer_settings(config, vocab_size, template)
        (tmp / "fedlr-settings.json").write_text(json.dumps(settings, indent=2))
        for item in (tmp, *tmp.iterdir()):
            item.chmod(0o755 if item.is_dir() else 0o644)  # mkdtemp creates 0700
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "tokenizer.json").is_file():
                raise  # else a concurrent build won the race: use its files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "%s: trained a %d-token tokenizer, cached at %s",
        DATASET_NAME,
        len(tokenizer),
        path,
    )
    return _load_tokenizer(path)
