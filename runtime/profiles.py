"""Card profiles (`profiles.toml` beside this module): arch, VRAM, dtypes, row widths, spec defaults.

The runtime reads a profile's speculative defaults (for `ignis-run --profile` and the manifest);
the compiler reads the arch, dtypes and widths. One data file serves both.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from ignis.runtime.errors import ConfigError
from ignis.runtime.scheduler import DEFAULT_MAX_PREFILL_TOKENS, check_max_prefill_tokens

_SPEC_BACKENDS = ("dflash2", "mtp", "ngram", "draft-model", "replay", "off")
_DTYPES = ("q4_g32", "bf16", "f16", "f32")


@dataclass(frozen=True)
class SpecDefaults:
    """Speculative-decoding defaults of a profile for one drafter kind (the seeds' knobs)."""

    backend: str  # "dflash2", "mtp" or "off"
    draft_tokens: int = 0  # draft tokens per lane per round (1..7); 0 with backend "off"
    draft_rows: int = 0  # row budget of a verify round across lanes (0 means 8, at most 32)
    draft_head: str = "full"  # proposal head: "full" or "shortlist"

    def __post_init__(self) -> None:
        if self.backend not in _SPEC_BACKENDS:
            raise ConfigError(f"spec backend {self.backend!r} not in {_SPEC_BACKENDS}")
        if self.backend != "off" and not 1 <= self.draft_tokens <= 7:
            raise ConfigError(
                f"spec draft_tokens {self.draft_tokens} outside 1..7 for backend {self.backend}"
            )
        if not 0 <= self.draft_rows <= 32:
            raise ConfigError(f"spec draft_rows {self.draft_rows} outside 0..32")
        if self.draft_head not in ("full", "shortlist"):
            raise ConfigError(f"spec draft_head {self.draft_head!r} not in ('full', 'shortlist')")


@dataclass(frozen=True)
class CardProfile:
    """One card: what to compile for it and what the runtime defaults to on it."""

    name: str  # profile name, e.g. "rtxpro6000"
    arch: str  # CUDA arch ("sm_90", "sm_120") or "llvm" for the host CPU
    vram_bytes: int  # card memory in bytes (0 for cpu)
    linear_dtype: str  # weight dtype of the linear layers
    other_dtype: str  # dtype of every other tensor
    decode_widths: tuple[int, ...]  # verify row widths on the decode route (<= 8)
    wide_widths: tuple[int, ...]  # verify row widths on the tensor-core route (> 8)
    spec: dict[str, SpecDefaults] = field(default_factory=dict)  # drafter kind -> defaults
    # ignis-run's default prompt-token budget per step (--max-prefill-tokens); 0 = whole prompts
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    checkpoint_card_bytes: int = 0  # prompt checkpoint pool on the card (bytes; 0: none)
    checkpoint_host_bytes: int = 0  # prompt checkpoint pool in host RAM (bytes; 0: none)

    def __post_init__(self) -> None:
        check_max_prefill_tokens(self.max_prefill_tokens)
        for dt in (self.linear_dtype, self.other_dtype):
            if dt not in _DTYPES:
                raise ConfigError(f"profile {self.name}: dtype {dt!r} not in {_DTYPES}")
        if any(not 1 <= w <= 8 for w in self.decode_widths):
            raise ConfigError(f"profile {self.name}: decode widths must lie in 1..8")
        if any(not 9 <= w <= 64 for w in self.wide_widths):
            raise ConfigError(f"profile {self.name}: wide widths must lie in 9..64")
        if self.checkpoint_card_bytes < 0 or self.checkpoint_host_bytes < 0:
            raise ConfigError(f"profile {self.name}: checkpoint budgets must be >= 0 bytes")

    @property
    def widths(self) -> tuple[int, ...]:
        """Every compiled verify row width, ascending."""
        return tuple(sorted({*self.decode_widths, *self.wide_widths}))

    def width_for(self, rows: int) -> int | None:
        """The smallest compiled width >= rows, or None when rows exceeds every width."""
        return next((w for w in self.widths if w >= rows), None)


def _parse(name: str, raw: dict[str, Any]) -> CardProfile:
    raw = dict(raw)
    spec = {kind: SpecDefaults(**vals) for kind, vals in raw.pop("spec", {}).items()}
    try:
        return CardProfile(
            name=name,
            decode_widths=tuple(raw.pop("decode_widths")),
            wide_widths=tuple(raw.pop("wide_widths")),
            spec=spec,
            **raw,
        )
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"profile {name}: {exc}") from exc


@cache
def load_profiles() -> dict[str, CardProfile]:
    """Every built-in profile, by name (parsed once from `profiles.toml`)."""
    text = resources.files("ignis.runtime").joinpath("profiles.toml").read_text(encoding="utf-8")
    return {name: _parse(name, vals) for name, vals in tomllib.loads(text).items()}


def get_profile(name: str) -> CardProfile:
    """Look a card profile up by name.

    Raises:
        ConfigError: unknown card, listing the known ones.
    """
    profiles = load_profiles()
    if name not in profiles:
        raise ConfigError(f"unknown card {name!r}; known cards: {sorted(profiles)}")
    return profiles[name]


def profile_max_prefill_tokens(profile: str | CardProfile | None) -> int:
    """ignis-run's default `--max-prefill-tokens` for a card: the built-in profile's of that name (an
    artifact's manifest records its card's name, not this runtime default), else the given profile's,
    else `DEFAULT_MAX_PREFILL_TOKENS`."""
    if profile is None:
        return DEFAULT_MAX_PREFILL_TOKENS
    name = profile if isinstance(profile, str) else profile.name
    builtin = load_profiles().get(name)
    if builtin is not None:
        return builtin.max_prefill_tokens
    return DEFAULT_MAX_PREFILL_TOKENS if isinstance(profile, str) else profile.max_prefill_tokens
