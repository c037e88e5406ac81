"""A separate, minimal Flower app that uses fedlr only as a plug-in strategy.

It has its own model (a small peft-LoRA MLP), its own data and its own
ClientApp; it imports nothing from fedlr but the strategy and the layout
helpers, as a user's existing project would.
"""
