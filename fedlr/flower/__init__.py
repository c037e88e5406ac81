"""Flower glue: the only place in the library that imports ``flwr``."""

from fedlr.flower.grid import InProcessGrid
from fedlr.flower.records import record_nbytes, record_to_state, state_to_record

__all__ = ["InProcessGrid", "record_nbytes", "record_to_state", "state_to_record"]
