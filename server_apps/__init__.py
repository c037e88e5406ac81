"""This repository's Flower app: the ServerApp component of ``flwr run``."""
