"""Causal language models: offline tiny decoders and any hub decoder.

``tiny-llama``
    A LLaMA-architecture decoder (4 layers, hidden 128, 4 heads, vocabulary of
    the offline ``arith-instruct`` tokenizer, about 0.9 M parameters). No
    package on the registry ships pretrained decoder weights that
    ``transformers`` can load, so this model is *warmed up* once on this
    machine: :func:`warm_up` trains it from a fixed seed on the ``train``
    split of the generated arithmetic problems written as plain text
    (``"<instruction> Answer: <response>"``, never the instruction template,
    never a test problem) and caches it under
    ``<cache>/arith-instruct/tiny-llama-<key>/``. The first use does this
    (about four minutes on 2 CPU cores, a progress line every 100 steps),
    under a file lock: of several processes that need it at once (a
    simulation's clients, the SuperNodes of a shared cache) one trains, the
    others say so and wait for its files. ``make setup-llm`` does it ahead of
    time. Federated instruction tuning then teaches it the prompt template
    and the answer format on top of what it knows.
``tiny-gpt2``
    A GPT-2 decoder (2 layers, hidden 64) with the same tokenizer, randomly
    initialised from the run seed: GPT-2 stores its projections as ``Conv1D``
    ((d_in, d_out) weights), so tests use it to check every fold and layout
    in that orientation. It is not trained; its answers are noise.
any other name
    A Hugging Face hub id (``Qwen/Qwen2.5-0.5B-Instruct``, ``gpt2``, ...)
    loaded with ``AutoModelForCausalLM``; needs network. ``precision``,
    ``gradient-checkpointing`` and ``quantization`` apply to it as to the
    offline models.

Run ``python -m fedlr.models.causal`` to warm up ``tiny-llama`` ahead of time.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from fedlr.client.train import pad_rows
from fedlr.config.run import PRECISIONS, QUANTIZATIONS
from fedlr.data.assets import cache_dir
from fedlr.data.instruct_text import build_tokenizer, tokenizer_path
from fedlr.data.instructions import DATASET_NAME, _digest, make_splits
from fedlr.errors import ConfigError

__all__ = [
    "CAUSAL_MODELS",
    "WarmUp",
    "build_causal_lm",
    "load_causal_tokenizer",
    "warm_up",
    "warm_up_path",
]

logger = logging.getLogger("fedlr")

CAUSAL_MODELS = ("tiny-llama", "tiny-gpt2")
"""Offline decoders (no hub needed)."""


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class WarmUp:
    """The tiny-llama architecture and its warm-up schedule (the cache key).

    Attributes
    ----------
    hidden, layers, heads, intermediate, max_positions : int
        LLaMA config (``hidden_size``, ``num_hidden_layers``, attention
        heads, MLP width, ``max_position_embeddings``).
    steps, batch_size : int
        AdamW steps and sequences per step.
    lr : float
        Peak learning rate (linear warm-up over 5% of the steps, cosine decay).
    seed : int
    """

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 384
    max_positions: int = 256
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0
    format: int = 1  # bump when the recipe changes


def load_causal_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of decoder ``name``, with a padding token.

    The offline models share the ``arith-instruct`` byte-level BPE tokenizer
    (:func:`fedlr.data.instruct_text.build_tokenizer`). A hub tokenizer
    without a padding token pads with its end-of-sequence token.

    Raises
    ------
    ConfigError
        (key ``model``) when a hub id cannot be loaded.
    """
    return _tokenizer(name)


def _not_a_decoder(name: str, exc: OSError) -> ConfigError:
    return ConfigError(
        "model",
        f"'{name}' is not an offline decoder ({', '.join(CAUSAL_MODELS)}) and "
        f"could not be loaded as a Hugging Face hub id: {exc}",
    )


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str) -> PreTrainedTokenizerBase:
    if name in CAUSAL_MODELS:
        return build_tokenizer()
    try:
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise _not_a_decoder(name, exc) from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _llama_config(spec: WarmUp, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        intermediate_size=spec.intermediate,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def _gpt2_config(tokenizer: PreTrainedTokenizerBase) -> GPT2Config:
    return GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def warm_up_path(spec: WarmUp | None = None) -> Path:
    """The cache folder of the warmed-up tiny-llama for ``spec`` (may not exist)."""
    spec = spec or WarmUp()
    key = _digest({"warm-up": asdict(spec), "tokenizer": tokenizer_path().name})
    return cache_dir() / DATASET_NAME / f"tiny-llama-{key}"


def _warm_up_texts() -> list[str]:
    return [
        f"{ex['instruction']} Answer: {ex['response']}" for ex in make_splits().train
    ]


def _is_warm(path: Path) -> bool:
    return (path / "config.json").is_file()


@contextmanager
def _progress_log() -> Iterator[None]:
    """Make the ``fedlr`` logger's INFO lines visible for the block.

    A process whose logging nobody configured (a Flower app) would drop
    them; there a handler to stderr is attached for the block only.
    """
    if logger.hasHandlers() and logger.getEffectiveLevel() <= logging.INFO:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def warm_up(spec: WarmUp | None = None, *, progress: bool = True) -> Path:
    """The warmed-up tiny-llama's folder: cached, or trained now (once).

    A present cache is reused (one ``stat``). Otherwise the process takes
    the file lock ``<folder>.lock`` beside the cache folder and trains
    (:func:`_train`); a process that finds the lock taken logs that it waits
    for another process's warm-up and uses its files once the lock is
    released. An interrupted warm-up leaves nothing half-written (the model
    is written to a temporary folder and renamed) and releases the lock.

    Parameters
    ----------
    spec : WarmUp, optional
        Architecture and schedule (the default is the one every fedlr
        process uses).
    progress : bool
        Log a line every 100 steps.

    Returns
    -------
    pathlib.Path
        The folder (``save_pretrained`` layout plus ``fedlr-warm-up.json``
        with the settings, the final loss and the seconds it took).
    """
    spec = spec or WarmUp()
    path = warm_up_path(spec)
    if _is_warm(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path.parent / f"{path.name}.lock"))
    with _progress_log():
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.warning(
                "tiny-llama: another process is warming it up (lock %s); "
                "waiting for it",
                lock.lock_file,
            )
            lock.acquire()
        try:
            if _is_warm(path):
                return path  # the other process finished it
            logger.warning(
                "tiny-llama is not in the cache yet: warming it up once "
                "(%d AdamW steps, about 4 min on 2 CPU cores; `make setup-llm` "
                "does it ahead of time), into %s",
                spec.steps,
                path,
            )
            return _train(spec, path, progress=progress)
        finally:
            lock.release()


def _train(spec: WarmUp, path: Path, *, progress: bool) -> Path:
    """Train tiny-llama on the generated problems as plain text; cache it.

    Next-token loss on ``"<instruction> Answer: <response><eos>"`` for every
    ``train`` problem of the default ``arith-instruct`` set, AdamW with a
    linear warm-up and cosine decay. The caller holds the lock.
    """
    tok = _tokenizer("tiny-llama")
    hf_logging.set_verbosity_error()
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_llama_config(spec, tok))
    rows = [
        [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        for text in _warm_up_texts()
    ]
    rows = [r[: spec.max_positions] for r in rows]
    started = time.perf_counter()
    loss_avg = _warm_up_steps(model, rows, spec, int(tok.pad_token_id), progress)
    info = {
        "settings": asdict(spec),
        "examples": len(rows),
        "final-loss": loss_avg,
        "seconds": time.perf_counter() - started,
    }
    _save_warm(model, path, info)
    logger.info("tiny-llama warmed up (loss %.3f), cached at %s", loss_avg, path)
    return path


def _warm_up_steps(
    model: PreTrainedModel,
    rows: list[list[int]],
    spec: WarmUp,
    pad: int,
    progress: bool,
) -> float:
    """``spec.steps`` AdamW steps on random batches of ``rows`` (linear warm-up,
    cosine decay); the loss's running average at the end."""
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    ramp = max(1, spec.steps // 20)

    def schedule(step: int) -> float:
        if step < ramp:
            return (step + 1) / ramp
        frac = (step - ramp) / max(1, spec.steps - ramp)
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    started = time.perf_counter()
    loss_avg = float("nan")
    for step in range(spec.steps):
        pick = torch.randint(len(rows), (spec.batch_size,), generator=generator)
        batch = [rows[i] for i in pick.tolist()]
        ids, mask = pad_rows(batch, pad)
        labels, _ = pad_rows(batch, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        value = float(loss.detach())
        loss_avg = value if step == 0 else 0.98 * loss_avg + 0.02 * value
        if progress and (step + 1) % 100 == 0:
            logger.info(
                "tiny-llama warm-up: step %d/%d, loss %.3f, %.0f s",
                step + 1,
                spec.steps,
                loss_avg,
                time.perf_counter() - started,
            )
    return loss_avg


def _save_warm(model: PreTrainedModel, path: Path, info: dict[str, Any]) -> None:
    """Write the warmed-up model and ``info`` to ``path`` atomically (a
    temporary directory beside it, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        model.save_pretrained(str(tmp))
        (tmp / "fedlr-warm-up.json").write_text(json.dumps(info, indent=2))
        for item in (tmp, *tmp.iterdir()):
            item.chmod(0o755 if item.is_dir() else 0o644)
        try:
            os.rename(tmp, path)
        except OSError:
            if not _is_warm(path):
                raise  # else a warm-up without the lock (an older fedlr) won
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_quantization(quantization: str) -> Any:
    """bitsandbytes settings for ``quantization``, or a ConfigError saying why not."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            "quantization",
            f"must be one of {', '.join(QUANTIZATIONS)}, got '{quantization}'",
        )
    if quantization == "none":
        return None
    if not torch.cuda.is_available():
        raise ConfigError(
            "quantization",
            f"'{quantization}' needs CUDA (bitsandbytes kernels); this machine has "
            'none: use quantization="none"',
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "quantization",
            f"'{quantization}' needs the bitsandbytes package "
            "(pip install bitsandbytes)",
        ) from exc
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _load_decoder(
    name: str, seed: int, dtype: torch.dtype, quant: Any
) -> PreTrainedModel:
    """Decoder ``name``'s weights in ``dtype`` (``quant``: bitsandbytes
    settings, hub models only)."""
    model: PreTrainedModel
    if name in CAUSAL_MODELS and quant is not None:
        raise ConfigError(
            "quantization", f"the offline {name} is not quantised; use a hub model"
        )
    if name == "tiny-llama":
        model = LlamaForCausalLM.from_pretrained(str(warm_up()), dtype=dtype)
    elif name == "tiny-gpt2":
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(_gpt2_config(_tokenizer(name)))
        for param in model.parameters():
            param.data = param.data.to(dtype)
    else:
        kwargs: dict[str, Any] = {"dtype": dtype}
        if quant is not None:
            kwargs["quantization_config"] = quant
        try:
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        except OSError as exc:
            raise _not_a_decoder(name, exc) from exc
    return model


def build_causal_lm(
    name: str,
    seed: int,
    *,
    precision: str = "float32",
    gradient_checkpointing: bool = False,
    quantization: str = "none",
) -> PreTrainedModel:
    """Build decoder ``name`` with its weights, the same on every node.

    Parameters
    ----------
    name : str
        ``tiny-llama``, ``tiny-gpt2`` or a hub id.
    seed : int
        Seeds ``tiny-gpt2``'s initial weights (the others load theirs).
    precision : {"float32", "bfloat16", "float16"}
        dtype of the base weights (adapters stay float32, peft's default).
    gradient_checkpointing : bool
        Recompute activations in the backward pass (less memory, more time).
    quantization : {"none", "8bit", "4bit"}
        A bitsandbytes base; hub models on CUDA only.

    Raises
    ------
    ConfigError
        For an unknown precision, a quantised offline model or a quantised base
        without CUDA/bitsandbytes, or a hub id that cannot be loaded.
    """
    if precision not in PRECISIONS:
        raise ConfigError(
            "precision", f"must be one of {', '.join(PRECISIONS)}, got '{precision}'"
        )
    quant = _check_quantization(quantization)
    hf_logging.set_verbosity_error()
    model = _load_decoder(name, seed, _DTYPES[precision], quant)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        model.config.use_cache = False
    return model


def main() -> int:
    """``python -m fedlr.models.causal``: warm up tiny-llama unless cached."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = warm_up()
    sys.stdout.write(f"tiny-llama\t{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
