"""Model families (one module per architecture group); importing this package registers them all."""

from ignis.runtime.families import llama as llama
from ignis.runtime.families import qwen3_5 as qwen3_5
from ignis.runtime.families.base import (
    FAMILIES,
    Executor,
    Family,
    FamilyConfig,
    ForwardOutput,
    LaneState,
    config_from_hf,
    get_family,
    register_family,
)

__all__ = [
    "FAMILIES",
    "Executor",
    "Family",
    "FamilyConfig",
    "ForwardOutput",
    "LaneState",
    "config_from_hf",
    "get_family",
    "register_family",
]
