"""Typed run configuration: ``[tool.flwr.app.config]`` -> :class:`RunConfig`.

The run config is read once at the app boundary (ServerApp and ClientApp) and
turned into this frozen dataclass; per-round values travel to clients in the
``ConfigRecord``. ``RunConfig`` holds the keys every method shares; the keys of
one method or payload kind (FedSpec's threshold, VeRA's projection rank, ...)
are that method's :class:`~fedlr.options.Options`, registered with it
(:mod:`fedlr.strategies.registry`). ``pyproject.toml``'s run config lists
both, with the same defaults (checked by the tests).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlr.errors import ConfigError
from fedlr.method_options import method_option_keys
from fedlr.options import Options, kebab
from fedlr.robust import RobustConfig

__all__ = ["PARTITIONERS", "RunConfig"]

PARTITIONERS = ("iid", "dirichlet", "pathological")
PRECISIONS = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "8bit", "4bit")
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class RunConfig(Options):
    """Every run setting, validated.

    Build it with :meth:`from_mapping` from a Flower ``run_config``; each field's
    metadata holds its help text (shown in ``docs/configuration.md``).
    """

    method: str = field(
        default="fedex-lora", metadata={"help": "aggregation method (registry name)"}
    )
    num_server_rounds: int = field(default=15, metadata={"help": "federated rounds"})
    local_steps: int = field(
        default=5, metadata={"help": "optimiser steps per client per round"}
    )
    lr: float = field(default=3e-3, metadata={"help": "client AdamW learning rate"})
    lr_decay: float = field(
        default=0.85,
        metadata={"help": "per-round factor on lr: round t uses lr * lr-decay^(t-1)"},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    batch_size: int = field(default=16, metadata={"help": "client batch size"})
    eval_batch_size: int = field(
        default=64,
        metadata={
            "help": "batch size of evaluations (0: the largest that fits, halved on "
            "out-of-memory)"
        },
    )
    eval_every: int = field(
        default=1,
        metadata={"help": "server evaluation every n rounds (and always the last)"},
    )
    max_length: int = field(default=64, metadata={"help": "tokens per example"})
    model: str = field(
        default="minilm",
        metadata={
            "help": "text: minilm (offline), tiny-bert (tests) or a hub model id; "
            "vision: cnn, mlp, alexnet or resnet"
        },
    )
    pooling: str = field(
        default="mean",
        metadata={"help": "classifier head: mean (masked mean pooling) or cls"},
    )
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r"})
    client_ranks: str = field(
        default="",
        metadata={
            "help": "comma-separated LoRA ranks cycled over the partitions "
            "(partition p trains rank ranks[p % len]) for the methods that "
            "accept heterogeneous ranks (flexlora, hetlora, flora, fedspec); empty: "
            "every client trains lora-rank"
        },
    )
    lora_alpha: float = field(
        default=16.0, metadata={"help": "LoRA alpha; scaling is alpha / r"}
    )
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    target_modules: str = field(
        default="auto",
        metadata={
            "help": "comma-separated names of the modules to adapt (nn.Linear, "
            "or transformers' Conv1D in GPT-2); auto: the attention query and "
            "value projections; all-linear: every linear layer but the output"
        },
    )
    max_new_tokens: int = field(
        default=8,
        metadata={"help": "causal LM: tokens generated per answer (exact match)"},
    )
    prompt_template: str = field(
        default="### Instruction:\n{instruction}\n\n### Response:\n",
        metadata={
            "help": "causal LM: prompt with {instruction}; a tokenizer's chat "
            "template, when it has one, is used instead"
        },
    )
    precision: str = field(
        default="float32",
        metadata={"help": "dtype of the base weights: float32, bfloat16, float16"},
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "causal LM: recompute activations in backward (memory)"},
    )
    quantization: str = field(
        default="none",
        metadata={
            "help": "causal LM: bitsandbytes base, none, 8bit or 4bit (CUDA; "
            "methods that fold into the base refuse it)"
        },
    )
    dataset: str = field(default="polarity", metadata={"help": "dataset registry name"})
    partitioner: str = field(
        default="dirichlet", metadata={"help": "iid, dirichlet or pathological"}
    )
    dirichlet_alpha: float = field(
        default=0.5, metadata={"help": "Dirichlet concentration (smaller: more skew)"}
    )
    classes_per_partition: int = field(
        default=2, metadata={"help": "classes per client for 'pathological'"}
    )
    num_partitions: int = field(
        default=4,
        metadata={"help": "partitions when a node's config does not say (simulation)"},
    )
    min_partition_size: int = field(
        default=10,
        metadata={
            "help": "fewest training rows a partition may have; the split fails "
            "below it (many partitions of a small data set need less)"
        },
    )
    eval_fraction: float = field(
        default=0.2, metadata={"help": "held-out fraction for the server's evaluation"}
    )
    max_eval_examples: int = field(
        default=0, metadata={"help": "cap on evaluated examples per round (0: all)"}
    )
    fraction_train: float = field(
        default=1.0, metadata={"help": "fraction of nodes sampled per round"}
    )
    min_replies: int = field(
        default=1, metadata={"help": "valid replies needed to aggregate a round"}
    )
    seed: int = field(default=42, metadata={"help": "seed of data, model and sampling"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda[:N], mps"})
    output_dir: str = field(
        default="",
        metadata={"help": "absolute results directory ('' = ~/fedlr-outputs)"},
    )
    resume_from: str = field(
        default="",
        metadata={
            "help": "run directory whose checkpoint.pt to continue from ('' = new run)"
        },
    )
    keep_checkpoints: int = field(
        default=2,
        metadata={
            "help": "checkpoints kept in the run directory (the newest good one "
            "is resumed from)"
        },
    )
    round_timeout: float = field(
        default=3600.0,
        metadata={
            "help": "seconds to wait for replies per round; late clients are dropped"
        },
    )
    robust: str = field(
        default="none",
        metadata={"help": "robust aggregation: none, norm-clip, trimmed-mean, median"},
    )
    clip_norm: float = field(
        default=0.0,
        metadata={"help": "norm-clip bound on an update norm (0: the round median)"},
    )
    trim_fraction: float = field(
        default=0.2,
        metadata={"help": "trimmed-mean: share of clients left out, in [0, 0.5)"},
    )
    max_client_weight: float = field(
        default=1.0,
        metadata={"help": "cap on a client's share of the total weight (1: none)"},
    )
    max_num_examples: int = field(
        default=0,
        metadata={
            "help": "replies claiming more num-examples are dropped (0: the largest "
            "partition, when the server knows the partitions)"
        },
    )
    max_update_ratio: float = field(
        default=0.0,
        metadata={
            "help": "reject a round whose global update norm exceeds this times the "
            "current global norm (0: no bound)"
        },
    )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_mapping(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Parse the common keys of a Flower ``run_config`` (kebab-case keys).

        Keys of a registered method's options (``fedspec-threshold``, ...) are
        accepted (:func:`fedlr.method_options.method_option_keys`) and left to
        that method's :class:`~fedlr.options.Options`
        (:func:`fedlr.strategies.registry.resolve` parses both).

        Raises
        ------
        ConfigError
            On a key no method knows, a value of the wrong type or out of range.
        """
        own = cls.option_fields()
        unknown = sorted(set(run_config) - set(own))
        if unknown:
            others = method_option_keys()
            for key in unknown:
                if key not in others:
                    known = sorted({*own, *others})
                    raise ConfigError(
                        key, f"unknown key; known keys: {', '.join(known)}"
                    )
        return cls.from_run_config(run_config)

    # --------------------------------------------------------------- validation
    def check(self) -> None:
        positive_ints = (
            "num_server_rounds",
            "local_steps",
            "batch_size",
            "lora_rank",
            "num_partitions",
            "min_replies",
            "classes_per_partition",
            "min_partition_size",
            "keep_checkpoints",
            "eval_every",
        )
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(
                    kebab(name), f"must be >= 1, got {getattr(self, name)}"
                )
        positive_floats = ("lr", "lora_alpha", "dirichlet_alpha", "round_timeout")
        for name in positive_floats:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(kebab(name), f"must be finite and > 0, got {value}")
        if not 8 <= self.max_length <= 4096:
            raise ConfigError(
                "max-length", f"must be in [8, 4096], got {self.max_length}"
            )
        if not 0.0 < self.lr_decay <= 1.0:
            raise ConfigError("lr-decay", f"must be in (0, 1], got {self.lr_decay}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(
                "lora-dropout", f"must be in [0, 1), got {self.lora_dropout}"
            )
        if not 0.0 <= self.weight_decay < 1.0:
            raise ConfigError(
                "weight-decay", f"must be in [0, 1), got {self.weight_decay}"
            )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(
                "eval-fraction", f"must be in (0, 1), got {self.eval_fraction}"
            )
        if not 0.0 < self.fraction_train <= 1.0:
            raise ConfigError(
                "fraction-train", f"must be in (0, 1], got {self.fraction_train}"
            )
        if self.eval_batch_size < 0:
            raise ConfigError(
                "eval-batch-size", f"must be >= 0, got {self.eval_batch_size}"
            )
        if self.max_eval_examples < 0:
            raise ConfigError(
                "max-eval-examples", f"must be >= 0, got {self.max_eval_examples}"
            )
        if not 0 <= self.seed < 2**32:
            raise ConfigError("seed", f"must be in [0, 2**32), got {self.seed}")
        if self.partitioner not in PARTITIONERS:
            raise ConfigError(
                "partitioner",
                f"'{self.partitioner}' is not one of {', '.join(PARTITIONERS)}",
            )
        if self.pooling not in ("mean", "cls"):
            raise ConfigError("pooling", f"'{self.pooling}' is not one of mean, cls")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(
                "device",
                f"'{self.device}' is not one of auto, cpu, mps, cuda, cuda:<index>",
            )
        if not self.targets:
            raise ConfigError("target-modules", "names no module")
        if not 1 <= self.max_new_tokens <= 1024:
            raise ConfigError(
                "max-new-tokens", f"must be in [1, 1024], got {self.max_new_tokens}"
            )
        if "{instruction}" not in self.prompt_template:
            raise ConfigError(
                "prompt-template",
                f"must contain {{instruction}}, got {self.prompt_template!r}",
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                "precision",
                f"'{self.precision}' is not one of {', '.join(PRECISIONS)}",
            )
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                "quantization",
                f"'{self.quantization}' is not one of {', '.join(QUANTIZATIONS)}",
            )
        if self.output_dir and not Path(self.output_dir).expanduser().is_absolute():
            raise ConfigError(
                "output-dir",
                f"must be an absolute path (apps run from a copied bundle), "
                f"got '{self.output_dir}'",
            )
        if not self.method:
            raise ConfigError("method", "is empty")
        if self.max_num_examples < 0:
            raise ConfigError(
                "max-num-examples", f"must be >= 0, got {self.max_num_examples}"
            )
        if not (math.isfinite(self.max_update_ratio) and self.max_update_ratio >= 0):
            raise ConfigError(
                "max-update-ratio",
                f"must be finite and >= 0, got {self.max_update_ratio}",
            )
        self.robust_config  # noqa: B018 (validates robust, clip-norm, ...)
        self.rank_list  # noqa: B018 (validates client-ranks)

    # ---------------------------------------------------------------- derived
    @property
    def robust_config(self) -> RobustConfig:
        """The robust-aggregation options (:class:`~fedlr.robust.RobustConfig`)."""
        return RobustConfig(
            rule=self.robust,
            clip_norm=self.clip_norm,
            trim_fraction=self.trim_fraction,
            max_client_weight=self.max_client_weight,
        )

    @property
    def rank_list(self) -> tuple[int, ...]:
        """``client-ranks`` as integers (empty: every client at ``lora-rank``).

        Raises
        ------
        ConfigError
            If an entry is not a positive integer.
        """
        ranks: list[int] = []
        for text in self.client_ranks.split(","):
            if not text.strip():
                continue
            try:
                rank = int(text)
            except ValueError:
                raise ConfigError(
                    "client-ranks", f"'{text.strip()}' is not an integer"
                ) from None
            if rank < 1:
                raise ConfigError("client-ranks", f"ranks must be >= 1, got {rank}")
            ranks.append(rank)
        return tuple(ranks)

    def rank_for(self, partition: int) -> int:
        """The LoRA rank partition ``partition`` trains."""
        ranks = self.rank_list
        return ranks[partition % len(ranks)] if ranks else self.lora_rank

    @property
    def global_rank(self) -> int:
        """The server's adapter rank: the largest client rank, or ``lora-rank``."""
        return max(self.rank_list, default=self.lora_rank)

    @property
    def targets(self) -> tuple[str, ...]:
        """``target-modules`` split into names."""
        return tuple(t.strip() for t in self.target_modules.split(",") if t.strip())

    @property
    def output_path(self) -> Path:
        """Absolute results directory."""
        if self.output_dir:
            return Path(self.output_dir).expanduser()
        return Path.home() / "fedlr-outputs"
