"""Adapter for projects on Flower's legacy strategy API (``aggregate_fit``).

Projects whose server still drives a ``flwr.server.strategy.Strategy``
(``configure_fit`` / ``aggregate_fit`` with ``Parameters`` and ``FitRes``) can
use any fedlr method through :class:`LegacyStrategy`::

    from fedlr import FedExLoRA, LegacyStrategy, adapter_state, lora_layout

    layout = lora_layout(peft_model)
    strategy = LegacyStrategy(
        FedExLoRA(layout=layout),
        initial_arrays=adapter_state(peft_model, layout, FedExLoRA.send_roles),
        train_config={"lr": 3e-3, "local-steps": 5},
    )

Legacy ``Parameters`` are an ordered list of arrays without names, so the
adapter fixes the order and tells the clients:

* ``FitIns.parameters`` holds the global arrays in the order of
  :attr:`LegacyStrategy.send_keys`, and ``FitIns.config["send-keys"]`` lists
  those keys (comma-separated);
* a client's ``FitRes.parameters`` must hold its arrays in the order of
  ``FitIns.config["reply-keys"]`` (:attr:`LegacyStrategy.reply_keys`), with
  ``num_examples`` its number of training examples.

Every ``FitRes`` is turned into the reply Message the Message-API strategy
would receive and aggregated by the same code path (validation, dropping with a
logged reason, the method's aggregation), so both APIs give the same arrays.
A ``FitRes`` with the wrong number of arrays, and every entry of
``failures``, is dropped with its reason and counted in the ``dropped``
metric (the legacy server reports lost replies as failures). The clients'
own ``FitRes.metrics`` are aggregated by the strategy's
``train_metrics_aggr_fn`` beside fedlr's metrics.

Federated evaluation follows the strategy's ``fraction_evaluate`` (Flower's
default 1.0): ``EvaluateIns.parameters`` are the global arrays in
``config["send-keys"]`` order; the loss is the weighted mean of the
``EvaluateRes.loss`` values, the metrics those of the strategy's
``aggregate_evaluate`` (its ``evaluate_metrics_aggr_fn``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Metadata,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from flwr.supercore import log

from fedlr.flower.records import record_nbytes, record_to_state, state_to_record
from fedlr.round.instructions import check_arrays
from fedlr.strategies.base import FedLRStrategy
from fedlr.wire.protocol import METRICS, SERVER_ROUND

__all__ = ["LegacyStrategy"]

SEND_KEYS = "send-keys"
"""FitIns/EvaluateIns config: the order of the global arrays (comma-separated)."""
REPLY_KEYS = "reply-keys"
"""FitIns config: the order of the arrays in a client's ``FitRes``."""

EvaluateFn = Callable[[int, dict[str, torch.Tensor]], tuple[float, dict[str, Scalar]]]


def _reply(
    node_id: int,
    server_round: int,
    content: RecordDict | Error,
    message_type: str = MessageType.TRAIN,
) -> Message:
    """A reply from ``node_id`` as the Message API would deliver it."""
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id="",
        group_id=str(server_round),
        created_at=time.time(),
        ttl=3600.0,
        message_type=message_type,
    )
    # Message(..., metadata=...) is how Flower itself rebuilds received
    # messages; its typed overloads only list the instruction/reply forms.
    build: Any = Message
    if isinstance(content, Error):
        return build(error=content, metadata=metadata)
    return build(content=content, metadata=metadata)


def _node_id(proxy: ClientProxy, index: int) -> int:
    try:
        return int(proxy.cid)
    except (TypeError, ValueError):
        return index


class LegacyStrategy(Strategy):
    """A fedlr strategy behind Flower's legacy ``Strategy`` interface.

    Parameters
    ----------
    strategy : FedLRStrategy
        Any fedlr method (``FedExLoRA(layout=...)``, ...).
    initial_arrays : mapping of str to torch.Tensor
        The global arrays of round 1 (for LoRA methods:
        ``adapter_state(model, layout, strategy.send_roles)``), checked
        against the strategy (:func:`fedlr.round.instructions.check_arrays`).
    train_config : mapping, optional
        Values sent in every ``FitIns.config`` (``lr`` is decayed per round by
        the strategy's ``lr_decay``).
    evaluate_fn : callable, optional
        ``evaluate_fn(server_round, global_arrays) -> (loss, metrics)`` for
        server-side evaluation.

    Raises
    ------
    InitialArraysError
        If ``initial_arrays`` are not the arrays the strategy sends.
    """

    def __init__(
        self,
        strategy: FedLRStrategy,
        initial_arrays: Mapping[str, torch.Tensor],
        train_config: Mapping[str, Scalar] | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> None:
        super().__init__()
        if not initial_arrays:
            raise ValueError("initial_arrays is empty")
        check_arrays(strategy, ArrayRecord(dict(initial_arrays)))
        self.strategy = strategy
        self.send_keys: list[str] = list(initial_arrays)
        self._initial = {k: v.detach().clone() for k, v in initial_arrays.items()}
        self.train_config: dict[str, Scalar] = dict(train_config or {})
        self.evaluate_fn = evaluate_fn

    def __repr__(self) -> str:
        return f"LegacyStrategy({type(self.strategy).__name__})"

    @property
    def reply_keys(self) -> list[str]:
        """The order of the arrays in a client's ``FitRes.parameters``."""
        return list(self.strategy.reply_shapes())

    # ---------------------------------------------------------------- helpers
    def _to_parameters(self, state: Mapping[str, torch.Tensor]) -> Parameters:
        return ndarrays_to_parameters(
            [state[k].detach().cpu().numpy() for k in self.send_keys]
        )

    def _to_state(self, parameters: Parameters) -> dict[str, torch.Tensor]:
        arrays = parameters_to_ndarrays(parameters)
        if len(arrays) != len(self.send_keys):
            raise ValueError(
                f"global parameters hold {len(arrays)} arrays, expected "
                f"{len(self.send_keys)} ({self.send_keys[:3]}...)"
            )
        return {
            k: torch.from_numpy(np.array(a))
            for k, a in zip(self.send_keys, arrays, strict=True)
        }

    def _fit_reply(self, node: int, server_round: int, res: FitRes) -> Message:
        keys = self.reply_keys
        arrays = parameters_to_ndarrays(res.parameters)
        if len(arrays) != len(keys):
            return _reply(
                node,
                server_round,
                Error(
                    code=0,
                    reason=f"FitRes holds {len(arrays)} arrays, expected "
                    f"{len(keys)} in the order of config['{REPLY_KEYS}']",
                ),
            )
        state = {
            k: torch.from_numpy(np.array(a)) for k, a in zip(keys, arrays, strict=True)
        }
        metrics: dict[str, Any] = {
            k: v for k, v in res.metrics.items() if isinstance(v, (int, float))
        }
        metrics[self.strategy.weighted_by_key] = int(res.num_examples)
        content = RecordDict(
            {
                self.strategy.arrayrecord_key: state_to_record(state),
                METRICS: MetricRecord(metrics),
            }
        )
        return _reply(node, server_round, content)

    # ------------------------------------------------------ legacy interface
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters:
        """The initial global arrays, in :attr:`send_keys` order."""
        return self._to_parameters(self._initial)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Sample clients like the Message-API strategy; the same round config."""
        state = self._to_state(parameters)
        record = ArrayRecord(state)
        available = client_manager.num_available()
        size = max(
            int(available * self.strategy.fraction_train), self.strategy.min_train_nodes
        )
        clients = client_manager.sample(
            num_clients=min(size, available) if available else size,
            min_num_clients=self.strategy.min_available_nodes,
        )
        config = self.strategy.begin_round(  # no node list: Flower reports failures
            server_round,
            record,
            ConfigRecord(dict(self.train_config)),
            instructed=len(clients),
            bytes_down=record_nbytes(record) * len(clients),
        )
        fit_config: dict[str, Scalar] = {
            k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))
        }
        fit_config[SERVER_ROUND] = server_round
        fit_config[SEND_KEYS] = ",".join(self.send_keys)
        fit_config[REPLY_KEYS] = ",".join(self.reply_keys)
        ins = FitIns(parameters, fit_config)
        return [(client, ins) for client in clients]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Aggregate through the Message-API strategy's validation and kernel."""
        replies = [
            self._fit_reply(_node_id(proxy, i), server_round, res)
            for i, (proxy, res) in enumerate(results)
        ]
        for j, failure in enumerate(failures):
            if isinstance(failure, BaseException):
                node, reason = -(j + 1), repr(failure)
            else:
                node = _node_id(failure[0], -(j + 1))
                reason = f"status {failure[1].status.code.name}: "
                reason += failure[1].status.message
            log(WARNING, "round %d: client %d failed: %s", server_round, node, reason)
            replies.append(_reply(node, server_round, Error(code=0, reason=reason)))
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is None:
            return None, {}
        state = record_to_state(arrays)
        self.send_keys = list(state)
        out: dict[str, Scalar] = {}
        if metrics is not None:
            out = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        return self._to_parameters(state), out

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Sample clients by the strategy's ``fraction_evaluate`` (none if 0)."""
        strategy = self.strategy
        if strategy.fraction_evaluate == 0.0:
            return []
        available = client_manager.num_available()
        size = max(
            int(available * strategy.fraction_evaluate), strategy.min_evaluate_nodes
        )
        clients = client_manager.sample(
            num_clients=min(size, available) if available else size,
            min_num_clients=strategy.min_available_nodes,
        )
        config: dict[str, Scalar] = {
            k: v
            for k, v in strategy.round_config(server_round).items()
            if isinstance(v, (int, float, str, bool))
        }
        config[SERVER_ROUND] = server_round
        config[SEND_KEYS] = ",".join(self.send_keys)
        ins = EvaluateIns(parameters, config)
        return [(client, ins) for client in clients]

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """Weighted mean loss; metrics by the strategy's ``aggregate_evaluate``."""
        if failures:
            log(
                WARNING,
                "round %d: %d evaluate failures ignored",
                server_round,
                len(failures),
            )
        if not results:
            return None, {}
        total = sum(res.num_examples for _, res in results)
        loss = sum(res.loss * res.num_examples for _, res in results) / max(total, 1)
        replies = []
        for i, (proxy, res) in enumerate(results):
            metrics: dict[str, Any] = {
                k: v for k, v in res.metrics.items() if isinstance(v, (int, float))
            }
            metrics[self.strategy.weighted_by_key] = int(res.num_examples)
            content = RecordDict({METRICS: MetricRecord(metrics)})
            replies.append(
                _reply(_node_id(proxy, i), server_round, content, MessageType.EVALUATE)
            )
        aggregated = self.strategy.aggregate_evaluate(server_round, replies)
        out: dict[str, Scalar] = {}
        if aggregated is not None:
            out = {k: v for k, v in aggregated.items() if isinstance(v, (int, float))}
        return float(loss), out

    def evaluate(
        self, server_round: int, parameters: Parameters
    ) -> tuple[float, dict[str, Scalar]] | None:
        """Server-side evaluation through ``evaluate_fn`` (if given)."""
        if self.evaluate_fn is None:
            return None
        return self.evaluate_fn(server_round, self._to_state(parameters))
