"""Flower glue: the only place in the library that imports ``flwr``."""

from fedlr.flower.grid import InProcessGrid
from fedlr.flower.records import (
    array_record,
    config_float,
    config_int,
    config_record,
    config_str,
    record_nbytes,
    record_to_state,
    state_to_record,
)

__all__ = [
    "InProcessGrid",
    "array_record",
    "config_float",
    "config_int",
    "config_record",
    "config_str",
    "record_nbytes",
    "record_to_state",
    "state_to_record",
]
