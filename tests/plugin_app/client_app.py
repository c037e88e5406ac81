"""The plug-in app's ClientApp: fedlr's client helpers on the app's own model."""

from __future__ import annotations

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedlr import apply_round

from .task import build_model, load_data, score

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    job = apply_round(build_model(str(context.run_config["method"])), message, context)
    x, y = load_data(int(context.node_config["partition-id"]))
    optimizer = torch.optim.SGD(job.parameters(), lr=job.lr)
    for _ in range(int(context.run_config["local-steps"])):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(job.model(x), y) + job.penalty()
        loss.backward()
        job.after_backward()  # gradient transforms (SCAFFOLD-LoRA)
        optimizer.step()
    return job.reply(num_examples=len(y), metrics={"train-loss": loss.item()})


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    job = apply_round(build_model(str(context.run_config["method"])), message, context)
    x, y = load_data(int(context.node_config["partition-id"]), split="test")
    accuracy, loss = score(job.model, x, y)
    return job.reply(num_examples=len(y), metrics={"accuracy": accuracy, "loss": loss})
