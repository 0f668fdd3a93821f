"""Drafters for the verify round: the protocol (`base`), the registry, and test drafters (`testing`).

`DRAFTERS` maps a `--spec-backend` name to a factory building the drafter; `off` is no drafter at all
(plain decode rounds). DFlash2 and MTP register here once their model families exist (issue 4).
"""

from __future__ import annotations

from collections.abc import Callable

from ignis.runtime.drafters.base import (
    BaseDrafter,
    CommittedSpan,
    Drafter,
    DrafterError,
    DraftProposal,
    DraftRequest,
)
from ignis.runtime.errors import ConfigError

__all__ = [
    "DRAFTERS",
    "BaseDrafter",
    "CommittedSpan",
    "DraftProposal",
    "DraftRequest",
    "Drafter",
    "DrafterError",
    "get_drafter_factory",
    "register_drafter",
]

DrafterFactory = Callable[..., Drafter]

DRAFTERS: dict[str, DrafterFactory] = {}  # backend name -> factory (keyword arguments are backend-specific)


def register_drafter(name: str, factory: DrafterFactory) -> DrafterFactory:
    """Register a drafter backend (module import time). Raises ValueError on a duplicate or on "off"."""
    if name == "off" or name in DRAFTERS:
        raise ValueError(f"drafter backend {name!r} is reserved or registered twice")
    DRAFTERS[name] = factory
    return factory


def get_drafter_factory(name: str) -> DrafterFactory | None:
    """The factory for a backend name; None for "off".

    Raises:
        ConfigError: unknown backend, listing the registered ones.
    """
    if name == "off":
        return None
    _register_builtin_backends()
    try:
        return DRAFTERS[name]
    except KeyError:
        raise ConfigError(f"unknown spec backend {name!r}; available: {['off', *sorted(DRAFTERS)]}") from None


def _register_builtin_backends() -> None:
    """Import the built-in backends (each registers itself); lazy, so the protocol module stays light."""
    from ignis.runtime.drafters import dflash2 as dflash2
    from ignis.runtime.drafters import draft_model as draft_model
    from ignis.runtime.drafters import mtp as mtp
    from ignis.runtime.drafters import ngram as ngram
    from ignis.runtime.drafters import replay as replay
