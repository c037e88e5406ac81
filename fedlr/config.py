"""Typed run configuration: ``[tool.flwr.app.config]`` -> :class:`RunConfig`.

The run config is read once at the app boundary (ServerApp and ClientApp) and
turned into this frozen dataclass; per-round values travel to clients in the
``ConfigRecord``. Every key of ``pyproject.toml``'s run config is a field here
(kebab-case there, snake_case here) with the same default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedlr.errors import ConfigError

__all__ = ["PARTITIONERS", "RunConfig"]

PARTITIONERS = ("iid", "dirichlet", "pathological")
_DEVICES = ("auto", "cpu", "cuda", "mps")


def _kebab(name: str) -> str:
    return name.replace("_", "-")


@dataclass(frozen=True)
class RunConfig:
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
        default=64, metadata={"help": "batch size of the server's evaluation"}
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
    lora_alpha: float = field(
        default=16.0, metadata={"help": "LoRA alpha; scaling is alpha / r"}
    )
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    target_modules: str = field(
        default="query,value",
        metadata={"help": "comma-separated names of the nn.Linear modules to adapt"},
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
    round_timeout: float = field(
        default=3600.0,
        metadata={
            "help": "seconds to wait for replies per round; late clients are dropped"
        },
    )
    # --- SVD family methods
    fedspec_threshold: float = field(
        default=0.05,
        metadata={
            "help": "fedspec: grow the rank by 2 while the tail energy fraction "
            "beyond it exceeds this"
        },
    )
    fedspec_max_rank: int = field(
        default=16, metadata={"help": "fedspec: cap of the adaptive rank"}
    )
    # --- qrmix methods (vision models, local SGD)
    momentum: float = field(
        default=0.9, metadata={"help": "SGD momentum of vision clients"}
    )
    warmup_rounds: int = field(
        default=5,
        metadata={"help": "qrmix: FedAvg rounds before the QR-Mix head update"},
    )
    qrmix_tau: float = field(
        default=1.0, metadata={"help": "qrmix: ridge tau of (H + tau I)"}
    )
    qrmix_gamma: float = field(
        default=1.0, metadata={"help": "qrmix: step scale gamma of the head update"}
    )
    qrmix_k: int = field(
        default=10, metadata={"help": "qrmix: Hessian eigenpairs per client"}
    )
    qrmix_oversample: int = field(
        default=10, metadata={"help": "qrmix: oversampling s of subspace iteration"}
    )
    qrmix_power_iters: int = field(
        default=2, metadata={"help": "qrmix: power iterations q"}
    )
    qrmix_form: str = field(
        default="fisher",
        metadata={
            "help": "qrmix: fisher = gamma (H + tau I)^-1 b; literal = the "
            "source's gamma (tau Q z + b - Q Q^T b)"
        },
    )
    qrmix_warmup_checkpoint: str = field(
        default="",
        metadata={
            "help": "qrmix: absolute path of a final_arrays.pt to start at stage 2"
        },
    )
    # --- continual (FOT) methods
    num_tasks: int = field(
        default=3, metadata={"help": "tasks of a continual stream (dataset = stream)"}
    )
    rounds_per_task: int = field(
        default=5,
        metadata={"help": "rounds per task; num-server-rounds = num-tasks x this"},
    )
    task_examples: int = field(
        default=0,
        metadata={"help": "rows per continual task before the held-out split (0: all)"},
    )
    fot_eps: float = field(
        default=0.95,
        metadata={"help": "FOT energy threshold ε of the first task boundary"},
    )
    fot_eps_inc: float = field(
        default=0.01, metadata={"help": "FOT: ε grows by this after each boundary"}
    )
    fot_sketch_dim: int = field(
        default=0,
        metadata={"help": "GPSE sketch columns m per layer (0: the layer's d)"},
    )
    fot_activation_examples: int = field(
        default=125,
        metadata={"help": "GPSE: local examples whose activations a client sketches"},
    )
    # --- VeRA family methods (fedavg-vera, vera-fedex, sorf-vera)
    vera_rank: int = field(
        default=256, metadata={"help": "VeRA rank r of the shared projections"}
    )
    projection_seed: int = field(
        default=0,
        metadata={"help": "seed of the shared frozen VeRA / SORF-VeRA projections"},
    )
    vera_d_initial: float = field(
        default=0.1, metadata={"help": "initial value of VeRA's lambda_d entries"}
    )
    vera_lr: float = field(
        default=0.01,
        metadata={"help": "client learning rate of the VeRA-family methods"},
    )
    fedex_lr: float = field(
        default=1.0,
        metadata={"help": "vera-fedex: fraction of the residual folded into W0"},
    )
    sorf_rank: int = field(
        default=16,
        metadata={"help": "SORF-VeRA rank r (r(r-1)/2 Givens angles per layer)"},
    )
    sorf_d_scale_initial: float = field(
        default=0.0, metadata={"help": "SORF-VeRA initial scale m of Lambda_d"}
    )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_mapping(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Parse a Flower ``run_config`` (kebab-case keys).

        Raises
        ------
        ConfigError
            On an unknown key, a value of the wrong type or out of range.
        """
        by_key = {_kebab(f.name): f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in run_config.items():
            if key not in by_key:
                raise ConfigError(
                    key, f"unknown key; known keys: {', '.join(sorted(by_key))}"
                )
            f = by_key[key]
            values[f.name] = _coerce(key, raw, f.type)
        return cls(**values)

    def to_mapping(self) -> dict[str, Any]:
        """Inverse of :meth:`from_mapping`."""
        return {_kebab(f.name): getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (snake_case names), validated again."""
        return dataclasses.replace(self, **changes)

    # --------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        positive_ints = (
            "num_server_rounds",
            "local_steps",
            "batch_size",
            "eval_batch_size",
            "lora_rank",
            "num_partitions",
            "min_replies",
            "classes_per_partition",
        )
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(
                    _kebab(name), f"must be >= 1, got {getattr(self, name)}"
                )
        positive_floats = ("lr", "lora_alpha", "dirichlet_alpha", "round_timeout")
        for name in positive_floats:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(_kebab(name), f"must be finite and > 0, got {value}")
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
        if self.device.split(":")[0] not in _DEVICES:
            raise ConfigError(
                "device", f"'{self.device}' is not one of {', '.join(_DEVICES)}"
            )
        if not self.targets:
            raise ConfigError("target-modules", "names no module")
        if self.output_dir and not Path(self.output_dir).expanduser().is_absolute():
            raise ConfigError(
                "output-dir",
                f"must be an absolute path (apps run from a copied bundle), "
                f"got '{self.output_dir}'",
            )
        if not self.method:
            raise ConfigError("method", "is empty")
        if not 0.0 <= self.fedspec_threshold < 1.0:
            raise ConfigError(
                "fedspec-threshold", f"must be in [0, 1), got {self.fedspec_threshold}"
            )
        if self.fedspec_max_rank < 1:
            raise ConfigError(
                "fedspec-max-rank", f"must be >= 1, got {self.fedspec_max_rank}"
            )
        self._validate_qrmix()
        self._validate_fot()
        self._validate_vera()

    def _validate_qrmix(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("momentum", f"must be in [0, 1), got {self.momentum}")
        if self.warmup_rounds < 0:
            raise ConfigError(
                "warmup-rounds", f"must be >= 0, got {self.warmup_rounds}"
            )
        for name in ("qrmix_tau", "qrmix_gamma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(_kebab(name), f"must be finite and > 0, got {value}")
        if self.qrmix_k < 1:
            raise ConfigError("qrmix-k", f"must be >= 1, got {self.qrmix_k}")
        for name in ("qrmix_oversample", "qrmix_power_iters"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    _kebab(name), f"must be >= 0, got {getattr(self, name)}"
                )
        if self.qrmix_form not in ("fisher", "literal"):
            raise ConfigError(
                "qrmix-form", f"'{self.qrmix_form}' is not one of fisher, literal"
            )
        checkpoint = self.qrmix_warmup_checkpoint
        if checkpoint and not Path(checkpoint).expanduser().is_absolute():
            raise ConfigError(
                "qrmix-warmup-checkpoint",
                f"must be an absolute path (apps run from a copied bundle), "
                f"got '{checkpoint}'",
            )

    def _validate_fot(self) -> None:
        for name in ("num_tasks", "rounds_per_task", "fot_activation_examples"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    _kebab(name), f"must be >= 1, got {getattr(self, name)}"
                )
        for name in ("task_examples", "fot_sketch_dim"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    _kebab(name), f"must be >= 0, got {getattr(self, name)}"
                )
        if not 0.0 <= self.fot_eps <= 1.0:
            raise ConfigError("fot-eps", f"must be in [0, 1], got {self.fot_eps}")
        if not (math.isfinite(self.fot_eps_inc) and 0.0 <= self.fot_eps_inc <= 1.0):
            raise ConfigError(
                "fot-eps-inc", f"must be in [0, 1], got {self.fot_eps_inc}"
            )

    def _validate_vera(self) -> None:
        for name in ("vera_rank", "sorf_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    _kebab(name), f"must be >= 1, got {getattr(self, name)}"
                )
        if self.sorf_rank > 64:
            raise ConfigError(
                "sorf-rank",
                f"must be <= 64 (r(r-1)/2 Givens angles), got {self.sorf_rank}",
            )
        if not 0 <= self.projection_seed < 2**32:
            raise ConfigError(
                "projection-seed", f"must be in [0, 2**32), got {self.projection_seed}"
            )
        if not (math.isfinite(self.vera_lr) and self.vera_lr > 0):
            raise ConfigError("vera-lr", f"must be finite and > 0, got {self.vera_lr}")
        if not (math.isfinite(self.fedex_lr) and 0 < self.fedex_lr <= 1):
            raise ConfigError("fedex-lr", f"must be in (0, 1], got {self.fedex_lr}")
        for name in ("vera_d_initial", "sorf_d_scale_initial"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(
                    _kebab(name), f"must be finite, got {getattr(self, name)}"
                )

    # ---------------------------------------------------------------- derived
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


def _coerce(key: str, raw: Any, annotation: Any) -> Any:
    kind = annotation if isinstance(annotation, str) else annotation.__name__
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        raise ConfigError(key, f"expected true/false, got {raw!r}")
    if kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(key, f"expected an integer, got {raw!r}")
        return raw
    if kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(key, f"expected a number, got {raw!r}")
        return float(raw)
    if kind == "str":
        if not isinstance(raw, str):
            raise ConfigError(key, f"expected a string, got {raw!r}")
        return raw
    raise ConfigError(key, f"unsupported field type {kind}")  # pragma: no cover
