"""The run config ``flwr run`` would start, resolved and checked before it starts.

:func:`check_run_config` resolves the app's ``[tool.flwr.app.config]`` plus
the overrides through the same registry the ServerApp uses, so a typo is one
line in seconds, not a traceback after the SuperLink and Ray started;
:func:`check_before_start` makes, before anything starts, the refusals the
ServerApp or the simulation would make at start (the data set, the tracker,
secure aggregation, ``min-replies``, CUDA, ``resume-from``);
:func:`check_nodes` makes the refusals the simulated nodes would make of
every round, from their own settings (the nodes' file, checked key by key by
:func:`fedlr.privacy.node_policy.check_node_config_file`) and ledgers.
:func:`format_run_config` and :func:`parse_run_config` write and read
``--run-config`` text as Flower does.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from flwr.common.config import flatten_dict, parse_config_args

from fedlr.errors import ConfigError, NodePolicyError
from fedlr.privacy.node_policy import NodePolicy, node_policy
from fedlr.strategies.registry import MethodConfig, resolve

__all__ = [
    "app_run_config",
    "check_before_start",
    "check_consent",
    "check_cuda",
    "check_nodes",
    "check_run_config",
    "format_run_config",
    "is_fedlr_app",
    "node_policies",
    "parse_run_config",
    "unparsed_text",
]


def format_run_config(values: Mapping[str, bool | int | float | str]) -> str:
    """Render ``{key: value}`` as ``flwr run --run-config`` TOML pairs."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _app_table(app_dir: Path | str) -> dict[str, Any]:
    """The app's ``[tool.flwr.app]`` table.

    Raises
    ------
    ConfigError
        If ``APP_DIR/pyproject.toml`` is missing or not TOML.
    """
    path = Path(app_dir) / "pyproject.toml"
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--app", f"cannot read {path}: {exc}") from None
    return dict(data.get("tool", {}).get("flwr", {}).get("app", {}))


def app_run_config(app_dir: Path | str) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]`` table, flattened as Flower does.

    Raises
    ------
    ConfigError
        If ``APP_DIR/pyproject.toml`` is missing or not TOML.
    """
    return dict(flatten_dict(_app_table(app_dir).get("config", {})))


def is_fedlr_app(app_dir: Path | str) -> bool:
    """Whether the app's ServerApp is fedlr's (so its run config is fedlr's)."""
    try:
        components = _app_table(app_dir).get("components", {})
    except ConfigError:
        return False
    return str(components.get("serverapp", "")).startswith(("server_apps.", "fedlr."))


def parse_run_config(text: str | None) -> dict[str, Any]:
    """``--run-config`` text (``'k=v k2="s"'`` or a ``.toml`` path) as Flower parses it.

    Raises
    ------
    ConfigError
        On text that is not ``key=value`` TOML: naming the key whose value
        does not parse (e.g. ``lora-rank=four``), else ``--run-config``.
    """
    if not text or not text.strip():
        return {}
    try:
        return dict(parse_config_args([text]))
    except click.ClickException as exc:
        bad = _unparsable_pair(text)
        if bad is not None:
            key, value = bad
            raise ConfigError(
                key,
                f"{value} is not a TOML value: write a number, true or false, "
                f'or a quoted string ({key}="{value.strip(_QUOTES)}")',
            ) from None
        raise ConfigError("--run-config", exc.message) from None
    except (ValueError, OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--run-config", str(exc).splitlines()[0]) from None


_QUOTES = "'\""


#: One ``key=value`` pair of ``--run-config``, as Flower's parser splits them.
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def unparsed_text(text: str) -> str:
    """What of ``--run-config`` text is no ``key=value`` pair (Flower's parser
    skips it without a word)."""
    return _PAIR.sub(" ", text).strip()


def _unparsable_pair(text: str) -> tuple[str, str] | None:
    """The first ``(key, value)`` of ``text`` whose value is not TOML."""
    for key, value in _PAIR.findall(text):
        try:
            tomllib.loads(f"{key} = {value}")
        except tomllib.TOMLDecodeError:
            return key, value
    return None


def check_run_config(
    app_dir: Path | str, run_config: Mapping[str, Any] | str | None = None
) -> MethodConfig:
    """Resolve the run config ``flwr run`` would start, here and now.

    The app's defaults plus the overrides go through
    :func:`fedlr.strategies.registry.resolve`, the ServerApp's own parsing, so
    a method typo, an unknown key or a value of the wrong type is reported
    before any SuperLink, Ray or model starts.

    Raises
    ------
    ConfigError
        On an unknown key (with the closest key), a bad type or value.
    fedlr.errors.UnknownMethodError
        On a method no one registered (with the closest name).
    """
    overrides = (
        parse_run_config(run_config)
        if run_config is None or isinstance(run_config, str)
        else dict(run_config)
    )
    defaults = app_run_config(app_dir)
    method = resolve({**defaults, **overrides})
    stale = sorted(set(overrides) - set(defaults))
    if stale:  # fedlr knows the key, the app's table does not: Flower refuses it
        raise ConfigError(
            stale[0],
            "missing from the app's [tool.flwr.app.config]; regenerate it with "
            "`python -m fedlr.configdoc write`",
        )
    return method


def check_before_start(
    method: MethodConfig,
    *,
    num_supernodes: int | None = None,
    client_gpus: float = 0.0,
) -> None:
    """Make, now, the refusals the ServerApp or the simulation would make at start.

    Each is cheap and builds no model: the data set against the data
    registry (and the task's kind of data set), the tracker's package, secure
    aggregation's eligibility and share count (with client-level DP: the
    quantiser's room for the noise), ``min-replies`` against the nodes a round
    samples, CUDA for ``quantization`` or ``client_gpus``, and in a local
    simulation ``resume-from``: a run directory with a good checkpoint whose
    settings this run repeats (the ServerApp's own checks at start, made
    here; the checkpoint's strategy state is checked by the ServerApp, which
    builds the strategy). The run-config
    checks of :func:`check_run_config` (the method, keys, types, privacy) come
    first.

    Parameters
    ----------
    method : MethodConfig
        The resolved run config (:func:`check_run_config`).
    num_supernodes : int, optional
        The local simulation's node count; ``None`` for a deployment, whose
        node count, GPUs and server packages are not known here (those
        checks are skipped).
    client_gpus : float
        Share of a GPU per simulated client (``--client-gpus``).

    Raises
    ------
    ConfigError
        Naming the key (or the ``--option``) that would be refused.
    """
    from fedlr.runs.tracking import check_tracker_installed

    run = method.run
    _check_dataset(method)
    if num_supernodes is None:  # a deployment: its server has its own packages
        if run.secure_aggregation:
            _check_secure(method, None)
        return
    check_tracker_installed(run.tracker)
    sampled = max(int(num_supernodes * run.fraction_train), 1)
    if run.min_replies > sampled:
        raise ConfigError(
            "min-replies",
            f"{run.min_replies} valid replies are needed per round but a "
            f"round samples {sampled} of the {num_supernodes} simulated nodes "
            f"(fraction-train {run.fraction_train}); lower min-replies or "
            "raise --num-supernodes",
        )
    if run.secure_aggregation:
        _check_secure(method, sampled)
    check_cuda(run.quantization, client_gpus)
    if run.resume_from:  # a deployment's checkpoint is on its server
        _check_resume(method)


def _check_resume(method: MethodConfig) -> None:
    """``resume-from`` names a run directory with a good checkpoint of a run
    with these settings (:func:`fedlr.runs.checkpoint.check_resumable`)."""
    from fedlr.runs.checkpoint import check_resumable, load_checkpoint

    saved = load_checkpoint(method.run.resume_from)
    check_resumable(saved["config"], method.to_mapping(), method.defaults())


def _check_dataset(method: MethodConfig) -> None:
    """The data set is registered and of the kind the method's task reads."""
    import difflib

    from fedlr.data import UnknownDatasetError, dataset_info
    from fedlr.models.causal import CAUSAL_MODELS
    from fedlr.models.text import TEXT_MODELS

    run = method.run
    try:
        spec = dataset_info(run.dataset)
    except UnknownDatasetError as exc:
        close = difflib.get_close_matches(run.dataset, exc.known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            "dataset",
            f"unknown data set '{run.dataset}'; {hint}known: {', '.join(exc.known)}",
        ) from None
    image_task = method.spec.payload.name == "qrmix"  # the image ServerPlan
    if image_task != (spec.kind == "image"):
        task = "an image method" if image_task else f"method '{method.spec.name}'"
        need = "image" if image_task else "text or instruction"
        raise ConfigError(
            "dataset",
            f"'{spec.name}' is a data set of kind {spec.kind}; {task} needs an "
            f"{need} data set",
        )
    if spec.kind == "instruct" and run.model in TEXT_MODELS:
        raise ConfigError(
            "model",
            f"'{run.model}' is an encoder classifier; instruction tuning on "
            f"'{spec.name}' needs a decoder ({', '.join(CAUSAL_MODELS)} or a hub id)",
        )
    if spec.kind == "text" and run.model in CAUSAL_MODELS:
        raise ConfigError(
            "model",
            f"'{run.model}' is a decoder; classifying '{spec.name}' needs an "
            f"encoder ({', '.join(TEXT_MODELS)} or a hub id)",
        )


def _check_secure(method: MethodConfig, sampled: int | None) -> None:
    """SecAgg+'s refusals of :func:`fedlr.server_apps.secagg.secure_exchange`
    that need no model, as the one-line error a typo gets."""
    from fedlr.errors import SecureAggregationError
    from fedlr.server_apps.secagg_checks import check_secure_config, check_secure_method

    try:
        if sampled is None:  # a deployment: the node count is not known here
            check_secure_method(method)
        else:
            check_secure_config(method, sampled)
    except SecureAggregationError as exc:
        raise ConfigError("secure-aggregation", str(exc)) from None


def check_cuda(quantization: str, client_gpus: float) -> None:
    """A GPU share or a bitsandbytes base needs CUDA (and bitsandbytes)."""
    import importlib.util

    import torch

    if client_gpus < 0:
        raise ConfigError("--client-gpus", f"must be >= 0, got {client_gpus}")
    cuda = torch.cuda.is_available()
    if client_gpus > 0 and not cuda:
        raise ConfigError(
            "--client-gpus",
            f"{client_gpus} of a GPU per client, but torch sees no CUDA GPU on "
            "this machine: use --client-gpus 0 (CLIENT_GPUS=0)",
        )
    if quantization != "none" and not cuda:
        raise ConfigError(
            "quantization",
            f"'{quantization}' needs CUDA (bitsandbytes kernels); this machine "
            'has none: use quantization="none"',
        )
    if quantization != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "quantization",
            f"'{quantization}' needs the bitsandbytes package "
            "(pip install bitsandbytes)",
        )


def node_policies(
    num_nodes: int,
    node_config: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> dict[int, NodePolicy]:
    """Each simulated node's policy: its nodes' file (``FEDLR_NODE_CONFIG`` of
    ``environ``, default ``os.environ``) overlaid by ``node_config``, as the
    node reads it.

    Raises
    ------
    fedlr.errors.NodeConfigError
        An unknown key, or a value of the wrong type or out of range.
    """
    return {
        pid: node_policy(
            {**(node_config or {}), "partition-id": pid, "num-partitions": num_nodes},
            environ,
        )
        for pid in range(num_nodes)
    }


def _nodes(pids: list[int]) -> str:
    if len(pids) > 1 and pids == list(range(pids[0], pids[-1] + 1)):
        return f"the nodes of partitions {pids[0]}-{pids[-1]}"
    plural = "s" if len(pids) > 1 else ""
    return f"the node{plural} of partition{plural} " + ", ".join(map(str, pids))


def check_consent(method: MethodConfig, policies: Mapping[int, NodePolicy]) -> None:
    """``reproducible-noise`` only from nodes whose own settings consent.

    The nodes draw noise under DP-SGD and under distributed DP (client-level
    DP under SecAgg+); a node whose own ``dp-allow-reproducible-noise`` is
    not true would draw secure noise, so the run would not repeat as asked.

    Raises
    ------
    ConfigError
        Naming ``reproducible-noise`` and the nodes that did not consent.
    """
    run = method.run
    privacy = run.privacy
    draws = privacy.dp_sgd is not None or (
        privacy.client_dp is not None and run.secure_aggregation
    )
    if not (run.reproducible_noise and draws):
        return
    refused = [pid for pid, p in policies.items() if not p.dp_allow_reproducible_noise]
    if refused:
        raise ConfigError(
            "reproducible-noise",
            f"asks the nodes for noise drawn from the run seed, but "
            f"{_nodes(sorted(refused))} did not consent: set "
            "dp-allow-reproducible-noise = true in their own settings (the "
            "nodes' file, --node-config-file); fedlr never sets it for them",
        )


def check_nodes(
    method: MethodConfig,
    policies: Mapping[int, NodePolicy],
    *,
    num_nodes: int | None = None,
) -> None:
    """Make, before start, the refusals the nodes would make of every round.

    From each node's own settings: DP-SGD required but off, SecAgg+ required
    but off, a clip above its ceiling, a delta above its own, more DP-SGD
    steps than its ``dp-max-steps-per-round``, reproducible noise it did not
    consent to (:func:`check_consent`), and a ``dp-epsilon`` larger than its
    ``dp-epsilon-budget`` less what its ledger already holds (where the
    ledger can be read here: an explicit ``dp-ledger-id``, or a text data
    set's default id).

    Parameters
    ----------
    method : MethodConfig
        The resolved run config.
    policies : mapping of int to NodePolicy
        Partition id -> the node's policy (:func:`node_policies`).
    num_nodes : int, optional
        The federation's node count (default: ``len(policies)``).

    Raises
    ------
    ConfigError
        One line naming the run-config key and the nodes that would refuse.
    """
    check_consent(method, policies)
    num = len(policies) if num_nodes is None else num_nodes
    found: dict[tuple[str, str], list[int]] = {}
    for pid, policy in policies.items():
        reason = _node_refusal(method, policy, pid, num)
        if reason is not None:
            found.setdefault(reason, []).append(pid)
    for (key, why), pids in found.items():  # the first, naming its every node
        raise ConfigError(key, why.replace("{nodes}", _nodes(sorted(pids))))


def _node_refusal(
    method: MethodConfig, policy: NodePolicy, pid: int, num: int
) -> tuple[str, str] | None:
    """``(key, reason)`` of the first refusal a node's settings make, or None."""
    run = method.run
    dp = run.privacy.dp_sgd
    try:
        policy.check_instruction(dp)
        if policy.secure_aggregation_required and not run.secure_aggregation:
            raise NodePolicyError(
                "secure-aggregation",
                "is off, but this node trains only under SecAgg+ (node config "
                "secure-aggregation-required = true)",
            )
        if dp is not None:
            policy.check_steps(run.local_steps)
            policy.delta_for(dp.delta, 1)  # a delta above every node's own
    except NodePolicyError as exc:
        return exc.key, f"{{nodes}} would refuse every round: '{exc.key}' {exc.reason}"
    if dp is not None and dp.epsilon > 0 and policy.dp_epsilon_budget > 0:
        spent = _spent(method, policy, pid, num)
        left = policy.dp_epsilon_budget - spent
        if dp.epsilon > left:
            return (
                "dp-epsilon",
                f"{dp.epsilon:g} is more than {{nodes}} can still spend: "
                f"dp-epsilon-budget {policy.dp_epsilon_budget:g} less the "
                f"{spent:.4g} its ledger holds leaves {max(left, 0.0):.4g}",
            )
    return None


def _spent(method: MethodConfig, policy: NodePolicy, pid: int, num: int) -> float:
    """The epsilon a node's ledger holds, at the largest delta it may use
    (so never more than the node counts); 0 where it cannot be read here."""
    from fedlr.privacy.accounting import epsilon
    from fedlr.privacy.budget import PrivacyLedger
    from fedlr.privacy.settings import DEFAULT_DELTA

    folder = policy.state_path() / "dp-ledger"
    if not folder.is_dir() or not any(folder.glob("*.json")):
        return 0.0
    ledger_id = policy.dp_ledger_id or _default_ledger_id(method, pid, num)
    if not ledger_id:
        return 0.0
    history = PrivacyLedger(policy.state_path(), ledger_id).history()
    dp = method.run.privacy.dp_sgd
    delta = (dp.delta if dp is not None else 0.0) or policy.dp_delta or DEFAULT_DELTA
    return epsilon(history, delta, policy.dp_accountant)


def _default_ledger_id(method: MethodConfig, pid: int, num: int) -> str:
    """A text node's default ledger id (the digest of its raw partition, as
    :mod:`fedlr.client_apps.text` computes it); ``""`` for other data."""
    from fedlr.data import dataset_info
    from fedlr.privacy.budget import raw_data_key
    from fedlr.tasks.text import text_task

    if dataset_info(method.run.dataset).kind == "image":
        return ""
    return raw_data_key(text_task(method.run).split(num).partition(pid))
