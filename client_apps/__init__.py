"""This repository's Flower app: the ClientApp component of ``flwr run``."""
