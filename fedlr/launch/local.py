"""Run the ServerApp and the ClientApp in one process, without Ray or a SuperLink.

:func:`run_in_process` drives the same ``run_server`` that ``flwr run`` starts,
on a :class:`~fedlr.flower.InProcessGrid` whose nodes call the dispatching
ClientApp directly (node ``i`` gets ``partition-id = i``). The round path is
the same, message for message, so the numbers are the same as under the Ray
engine for the same run config (the simulation tests check this); what is
saved is the start-up of a SuperLink and a Ray cluster per run, about 40 s on
a 2-core machine. Clients train one after another, each with every core.

Used by ``python -m fedlr.launch.compare run --engine inprocess`` for sweeps on a
small machine, and by the kill-and-resume tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp

from fedlr.flower.grid import InProcessGrid, ReplyHook, RoundHook
from fedlr.launch.client_app import app as fedlr_app
from fedlr.launch.run_config import check_consent, node_policies
from fedlr.server_apps.runner import run_server
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.registry import resolve

__all__ = ["run_in_process"]


def run_in_process(
    run_config: Mapping[str, Any],
    *,
    num_nodes: int | None = None,
    run_id: int = 1,
    reply_hook: ReplyHook | None = None,
    round_hook: RoundHook | None = None,
    client_app: ClientApp | None = None,
    node_config: Mapping[str, Any] | None = None,
    observe: Callable[[FedLRStrategy], None] | None = None,
) -> Path:
    """Run a whole federation in this process; return its results directory.

    Parameters
    ----------
    run_config : mapping
        Run-config keys (any subset; the rest take their defaults): the
        common keys and the method's options, validated
        (:func:`~fedlr.strategies.registry.resolve`) before anything runs.
    num_nodes : int, optional
        Simulated nodes; defaults to ``num-partitions``.
    run_id : int
        Run id (it appears in the run directory's name).
    reply_hook : callable, optional
        Passed to :class:`~fedlr.flower.InProcessGrid` (tests use it to lose
        or corrupt replies).
    round_hook : callable, optional
        Passed to :class:`~fedlr.flower.InProcessGrid`: sees all the replies
        of a round at once (``benchmarks/robustness.py``'s colluding
        attackers).
    client_app : flwr.clientapp.ClientApp, optional
        The app every node runs; default fedlr's own
        (:mod:`fedlr.launch.client_app`).
    node_config : mapping, optional
        Node-config values of every node (its operator's settings, declared
        in :mod:`fedlr.privacy.node_policy`), passed on as they are, over the
        nodes' file of ``FEDLR_NODE_CONFIG``. Nothing here writes them:
        ``reproducible-noise = true`` needs every node's own
        ``dp-allow-reproducible-noise = true``, else the run is refused
        before it starts.
    observe : callable, optional
        ``observe(strategy)`` once the server's strategy is built
        (:func:`~fedlr.server_apps.runner.run_server`;
        ``benchmarks/robustness.py``'s check-aware attacker).

    Raises
    ------
    fedlr.errors.ConfigError
        On an unknown key or a bad value (of the run config or the nodes'
        settings), or reproducible noise asked of nodes that did not consent,
        before any client is built.
    """
    if client_app is None:
        client_app = fedlr_app

    method = resolve(run_config)
    config = method.to_mapping()
    if method.auto:  # the ServerApp resolves it again, to the same, and says so
        config["robust"] = "auto"
    nodes = int(config["num-partitions"]) if num_nodes is None else num_nodes
    check_consent(method, node_policies(nodes, node_config))
    grid = InProcessGrid(
        client_app,
        num_nodes=nodes,
        run_config=config,
        run_id=run_id,
        reply_hook=reply_hook,
        round_hook=round_hook,
        node_config=dict(node_config or {}),
    )
    context = Context(
        run_id=run_id,
        node_id=1,
        node_config={},
        state=RecordDict(),
        run_config=config,
    )
    return run_server(grid, context, observe=observe)
