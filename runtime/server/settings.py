"""Resolving the speculative settings from the card profile, the config file and the command line.

Layers, lowest first: the card profile's defaults for the model's drafter kind (the built-in profile
named by `--profile`, else the one recorded in the model's manifest), then the explicit layers in order:
the config file's `spec` keys, its section for the served model, the command line.

Rules (seeds: speculative-decoding, drafter-inside-the-artifact, flash-next-speculation-mtp):

- backend: the last explicit layer that sets it, else the profile's default, else "off".
- A backend other than "off" must be one the model can run (`ModelSource.spec_kinds`):
  `mtp` without the companion container refuses to start, `dflash2` without a grafted drafter too.
- draft_tokens (1..7): the last explicit value, else the profile's value for that backend; required
  with dflash2 (no default); mtp defaults to 3 (the rtxpro6000 profile's value).
- draft_tokens set explicitly while the backend resolves to "off" is refused ("spec.draft_tokens alone
  is refused") unless a *later* layer turned the backend off (a per-model `backend: off` under a
  global `draft_tokens: 7` turns that one model off).
- draft_rows (0..32, 0 means 8) and draft_head (full | shortlist) default to the profile's, then 0 and
  "full"; they are ignored with backend off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ignis.runtime.errors import ConfigError
from ignis.runtime.profiles import CardProfile, SpecDefaults, get_profile

__all__ = [
    "BACKENDS",
    "DRAFT_HEADS",
    "HEAD_BACKENDS",
    "MTP_DEFAULT_DRAFT_TOKENS",
    "ROW_BUDGETED_BACKENDS",
    "ResolvedSpec",
    "SpecLayer",
    "resolve_spec",
]

BACKENDS = ("dflash2", "mtp", "ngram", "draft-model", "replay", "off")
DRAFT_HEADS = ("full", "shortlist")
HEAD_BACKENDS = ("dflash2", "mtp")  # the backends whose drafter reads draft_head
ROW_BUDGETED_BACKENDS = ("mtp",)  # the backends whose drafts per lane follow draft_rows
MTP_DEFAULT_DRAFT_TOKENS = 3  # rtxpro6000's MTP default; dflash2 has none (draft_tokens is required)
NGRAM_DEFAULT_DRAFT_TOKENS = 4  # prompt lookup (vLLM's num_speculative_tokens examples use 3-5)
DRAFT_MODEL_DEFAULT_DRAFT_TOKENS = 3  # a small model of the same tokenizer (docs/perf/log: 3.4 tokens/round)
REPLAY_DEFAULT_DRAFT_TOKENS = 7  # the benchmarking drafter (drafters/replay.py): DFlash2's block of 7


@dataclass(frozen=True)
class SpecLayer:
    """One explicit layer of speculative settings.

    Attributes:
        origin: where it comes from, for messages ("command line", "config.yaml spec.qwen38flashnext").
        values: a subset of backend, draft_tokens, draft_rows, draft_head (None values are unset).
    """

    origin: str
    values: Mapping[str, Any]


@dataclass(frozen=True)
class ResolvedSpec:
    """The settings the engine runs with, and where each came from.

    Attributes:
        spec: backend, draft_tokens (0 with "off"), draft_rows, draft_head.
        origins: knob -> origin ("profile rtxpro6000", "command line", "default", ...).
    """

    spec: SpecDefaults
    origins: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: the backend and draft tokens with their origins, plus the settings the backend
        reads: the row budget for mtp (the row-budgeted backend), the proposal head for dflash2 and mtp.
        Settings the backend ignores are not named (they do not apply)."""
        s = self.spec
        if s.backend == "off":
            return f"backend off ({self.origins.get('backend', 'default')})"
        o = self.origins
        out = f"backend {s.backend} ({o['backend']}), {s.draft_tokens} draft tokens ({o['draft_tokens']})"
        if s.backend in ROW_BUDGETED_BACKENDS:
            out += f", row budget {s.draft_rows or 8} ({o['draft_rows']})"
        if s.backend in HEAD_BACKENDS:
            out += f", proposal head {s.draft_head} ({o['draft_head']})"
        return out


def _check(origin: str, key: str, value: Any) -> Any:
    if key == "backend":
        if value is False:
            value = "off"
        if value not in BACKENDS:
            raise ConfigError(f"{origin}: spec backend {value!r} is not one of {list(BACKENDS)}")
    elif key == "draft_tokens":
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 7:
            raise ConfigError(f"{origin}: spec draft_tokens must be an integer 1..7, got {value!r}")
    elif key == "draft_rows":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 32:
            raise ConfigError(
                f"{origin}: spec draft_rows must be an integer 0..32 (0 means 8), got {value!r}"
            )
    elif key == "draft_head":
        if value not in DRAFT_HEADS:
            raise ConfigError(f"{origin}: spec draft_head {value!r} is not one of {list(DRAFT_HEADS)}")
    else:
        raise ConfigError(f"{origin}: unknown spec setting {key!r}")
    return value


def _profile_entry(profile: CardProfile | None, kind: str | None) -> SpecDefaults | None:
    if profile is None or kind is None:
        return None
    return profile.spec.get(kind)


def resolve_spec(
    layers: Sequence[SpecLayer],
    *,
    spec_kinds: Sequence[str],
    profile: str | CardProfile | None = None,
    missing_backend_reason: Mapping[str, str] | None = None,
) -> ResolvedSpec:
    """Resolve the speculative settings (module docstring for the rules).

    Args:
        layers: explicit layers, lowest precedence first.
        spec_kinds: backends the model can run besides "off"; the first is its drafter kind (whose
            profile entry gives the default backend).
        profile: a card profile (an artifact's recorded one), a built-in profile's name, or None for
            no profile defaults.
        missing_backend_reason: backend -> why the model cannot run it (for the refusal message).

    Raises:
        ConfigError: an invalid value, an unknown profile, a backend the model cannot run, dflash2
            without draft_tokens, or draft_tokens without a backend.
    """
    card = get_profile(profile) if isinstance(profile, str) else profile
    if card is not None:
        profile = card.name
    merged: dict[str, tuple[int, str, Any]] = {}  # key -> (layer index, origin, value)
    for i, layer in enumerate(layers):
        for key, value in layer.values.items():
            if value is None:
                continue
            merged[key] = (i, layer.origin, _check(layer.origin, key, value))
    kind = spec_kinds[0] if spec_kinds else None
    origins: dict[str, str] = {}
    default_entry = _profile_entry(card, kind)
    if "backend" in merged:
        backend_layer, origins["backend"], backend = merged["backend"]
    elif default_entry is not None:
        backend_layer, origins["backend"], backend = -1, f"profile {profile}", default_entry.backend
    else:
        backend_layer, origins["backend"], backend = -1, "default", "off"

    if backend == "off":
        if "draft_tokens" in merged and merged["draft_tokens"][0] >= backend_layer:
            _, origin, value = merged["draft_tokens"]
            raise ConfigError(
                f"{origin}: draft_tokens {value} without a speculative backend is refused; "
                "set --spec-backend dflash2, mtp, ngram or draft-model (or spec.backend in the config file)"
            )
        return ResolvedSpec(SpecDefaults(backend="off"), origins)

    if backend not in spec_kinds:
        reason = (missing_backend_reason or {}).get(backend, f"this model cannot run backend {backend}")
        raise ConfigError(f"{origins['backend']}: --spec-backend {backend} refused: {reason}")

    entry = _profile_entry(card, backend)
    entry = entry if entry is not None and entry.backend == backend else None
    values: dict[str, Any] = {}
    builtin = {
        "draft_tokens": {
            "mtp": MTP_DEFAULT_DRAFT_TOKENS,
            "ngram": NGRAM_DEFAULT_DRAFT_TOKENS,
            "draft-model": DRAFT_MODEL_DEFAULT_DRAFT_TOKENS,
            "replay": REPLAY_DEFAULT_DRAFT_TOKENS,
        }.get(backend),
        "draft_rows": 0,
        "draft_head": "full",
    }
    for key in ("draft_tokens", "draft_rows", "draft_head"):
        if key in merged:
            _, origins[key], values[key] = merged[key]
        elif entry is not None:
            origins[key], values[key] = f"profile {profile}", getattr(entry, key)
        else:
            origins[key], values[key] = "default", builtin[key]
    if values["draft_tokens"] is None:
        raise ConfigError(
            f"backend {backend} ({origins['backend']}) needs draft tokens: set --spec-draft-tokens 1..7 "
            "(or spec.draft_tokens in the config file)"
        )
    return ResolvedSpec(SpecDefaults(backend=backend, **values), origins)
