"""The tasks a node trains and the server evaluates: text classification and
instruction tuning (text.py), VeRA models (vera.py), images (image.py),
causal-LM sequences (lm.py), continual streams (continual.py).
"""
