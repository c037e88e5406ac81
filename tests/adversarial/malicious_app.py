"""A malicious ClientApp: fedlr's own client, with one partition attacking.

Every node runs fedlr's real ClientApp (``fedlr.launch.client_app``); the node
whose ``partition-id`` is ``ATTACKER_PARTITION`` then replaces its honest
train reply by the payload ``ATTACK`` of :mod:`tests.adversarial.payloads`
(its first message). Evaluate replies stay honest.

In process, :func:`malicious_app` builds one for any payload. Under ``flwr
run`` the end-to-end test copies this file and ``payloads.py`` into an app of
its own and rewrites the two constants below.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedlr.flower.records import record_to_state
from fedlr.launch.client_app import app as honest_app
from fedlr.wire import protocol

try:  # in the repository
    from tests.adversarial.payloads import PAYLOADS, attack
except ImportError:  # copied into a `flwr run` app next to payloads.py
    from .payloads import PAYLOADS, attack  # type: ignore[no-redef]

ATTACK = "boosted-50x-claiming-1e15"
ATTACKER_PARTITION = 0


def malicious_app(attack_name: str, partition: int = 0) -> ClientApp:
    """fedlr's ClientApp whose node ``partition`` sends ``attack_name``'s payload."""
    payload = PAYLOADS[attack_name]
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        reply = honest_app(message, context)
        if int(context.node_config[protocol.PARTITION_ID]) != partition:
            return reply
        sent = message.content.array_records.get(protocol.ARRAYS)
        current = record_to_state(sent) if sent is not None else {}
        forged = attack(payload, reply, current, message)
        if not forged:
            raise RuntimeError("the attacker sends nothing this round")
        return forged[0]

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return honest_app(message, context)

    return app


app = malicious_app(ATTACK, ATTACKER_PARTITION)
