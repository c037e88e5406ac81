"""LoRA ClientApp payload (kind ``lora``): the text client with LoRA adapters.

The round is :class:`~fedlr.client_apps.text.TextClient`'s: the instruction
(ArrayRecord ``arrays`` keyed as the adapter layout; ConfigRecord ``config``
with ``server-round``, ``lr``, ``local-steps``, ``batch-size``,
``train-roles`` and the method's own keys: ``lora-rank`` and ``lora-alpha``
(FedSpec grows the rank), ``keep-roles`` (FedSA-LoRA keeps ``B`` on the
node and replies with ``personal-gram``), ``client-svd`` (Local SVD),
``personal-split``, ``proximal-mu`` (FedProx-LoRA), ``leading-rank`` and
HetLoRA's ``prune-gamma``, ``prune-lambda`` (rank self-pruning); an optional
ArrayRecord ``personal``, Global SVD's per-node factor) is applied by
:func:`fedlr.client.round.apply_round`, the node trains its partition with AdamW
and replies with exactly the ``train-roles`` arrays (at its pruned rank when
it prunes) and a MetricRecord with ``num-examples``, ``train-loss``,
``partition-id`` (and ``personal-loaded`` for personalised methods,
``rank-pruned`` with pruning). :mod:`fedlr.wire.protocol` names every key.
"""

from __future__ import annotations

from fedlr.adapters.lora import LoraModel
from fedlr.client_apps.text import TextClient
from fedlr.config.run import RunConfig
from fedlr.options import NoOptions
from fedlr.tasks.text import text_task

__all__ = ["CLIENT", "evaluate_message", "train_message"]


def _build(config: RunConfig, options: NoOptions) -> LoraModel:
    return text_task(config).build_lora_model()


CLIENT = TextClient(build=_build, options=NoOptions, lr=lambda config, _: config.lr)
"""The handlers of the ``lora`` payload kind."""

train_message = CLIENT.train
evaluate_message = CLIENT.evaluate
