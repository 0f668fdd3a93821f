"""Model families (one module per architecture group); importing this package registers them all."""

from ignis.runtime.families import llama as llama  # noqa: F401  (llama, qwen2)
from ignis.runtime.families import qwen3_5 as qwen3_5  # noqa: F401  (qwen3_5, qwen3_5_moe, qwen3_next)
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
