"""The plug-in app's ClientApp: plain peft state in, plain peft state out.

Record contract with fedlr's LoRA strategies: the instruction's ArrayRecord
``arrays`` holds A, B and head keyed as in ``get_peft_model_state_dict`` and,
for FedEx-LoRA, updated base weights keyed as in ``model.state_dict()``; the
reply carries the trained arrays under the same peft keys plus a MetricRecord
with ``num-examples``.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from tests.plugin_app.task import build_model, load_data

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    model = build_model()
    arrays = message.content["arrays"].to_torch_state_dict()
    state = model.state_dict()
    set_peft_model_state_dict(
        model, {k: v for k, v in arrays.items() if k not in state}
    )
    model.load_state_dict({k: v for k, v in arrays.items() if k in state}, strict=False)
    x, y = load_data(int(context.node_config["partition-id"]))
    lr = float(message.content["config"]["lr"])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(10):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    reply = RecordDict(
        {
            "arrays": ArrayRecord(get_peft_model_state_dict(model)),
            "metrics": MetricRecord({"num-examples": len(y)}),
        }
    )
    return Message(reply, reply_to=message)
