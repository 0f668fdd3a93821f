"""The server's prompt checkpoints: budgets (flags, config keys, profile defaults), the chat
template's opener boundary, and the Prometheus collector of the pool.

* `resolve_checkpoint_budgets`: the card and host byte budgets of the pool
  (`ignis.runtime.prefix_cache.PrefixCache`): `--checkpoint-card-memory` / `--checkpoint-host-memory`
  (config keys `checkpoint_card_memory`, `checkpoint_host_memory`; sizes such as ``8GiB``, ``512MB``
  or a byte count), else the card profile's `checkpoint_card_bytes` / `checkpoint_host_bytes`
  (`profiles.toml`), else 0 (off).
* `opener_length`: where a chat request's opener (its leading system / developer messages and the
  tools, rendered alone with the model's chat template) ends in its prompt, when the rendering is a
  token-for-token prefix of the prompt; the engine records a checkpoint there ("opener"), which
  every later conversation with the same system prompt and tools reuses (with recurrent state a
  checkpoint restores only at its own position, so the boundary must be recorded where it is).
* `PromptCheckpointCollector`: the pool's counters and gauges at scrape time
  (`PrefixCache.samples`; names in `ignis.runtime.prefix_cache`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ignis.runtime.errors import ConfigError, IgnisRuntimeError
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.profiles import CardProfile, get_profile, load_profiles

__all__ = [
    "PromptCheckpointCollector",
    "build_checkpoint_pool",
    "chat_opener",
    "opener_length",
    "parse_size",
    "resolve_checkpoint_budgets",
]

log = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, what: str) -> int:
    """Bytes of a size: an integer byte count, or a number with a unit (B, KB, MB, GB, TB, KiB, MiB,
    GiB, TiB; case-insensitive).

    Raises:
        ConfigError: not a size, or negative.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as 8GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: a size must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{what}: expected a size such as 8GiB, 512MB or a byte count, got {value!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def resolve_checkpoint_budgets(
    profile: str | CardProfile | None, card: int | str | None, host: int | str | None
) -> tuple[int, int]:
    """(card bytes, host bytes) of the checkpoint pool: the given sizes, else the profile's (the
    built-in profile of that name when there is one), else 0.

    Raises:
        ConfigError: a size that does not parse, or an unknown profile name.
    """
    prof = get_profile(profile) if isinstance(profile, str) else profile
    if prof is not None and prof.name in load_profiles():
        # an artifact records its card's build-time profile; the budgets are the runtime's policy
        # for that card, so the built-in profile of the same name gives them
        prof = load_profiles()[prof.name]
    card_b = parse_size(card, what="checkpoint_card_memory") if card is not None else None
    host_b = parse_size(host, what="checkpoint_host_memory") if host is not None else None
    if card_b is None:
        card_b = prof.checkpoint_card_bytes if prof is not None else 0
    if host_b is None:
        host_b = prof.checkpoint_host_bytes if prof is not None else 0
    return card_b, host_b


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") if isinstance(p, Mapping) else "" for p in content)
    return "" if content is None else str(content)


def opener_length(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    prompt_ids: Sequence[int],
    **template_kwargs: Any,
) -> int | None:
    """Tokens of the prompt's opener (module docstring), or None: no system message and no tools, a
    rendering that is not a proper token prefix of the prompt, or a template that refuses a
    conversation of system messages only.

    Args:
        tokenizer: has `apply_chat_template(messages, add_generation_prompt=, tools=, **kw)` and
            `encode(text, add_special_tokens=False)`.
        messages: the request's messages (dicts with role and content).
        tools: the request's tools, or None.
        prompt_ids: the whole prompt's token ids.
    """
    head = []
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            break
        head.append({**m, "content": _text(m.get("content"))})
    if not head and not tools:
        return None
    try:
        text = tokenizer.apply_chat_template(
            head, add_generation_prompt=False, tools=tools, **template_kwargs
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
    except (IgnisRuntimeError, TypeError, ValueError, KeyError, IndexError):
        return None
    n = len(ids)
    if 0 < n < len(prompt_ids) and list(prompt_ids[:n]) == list(ids):
        return n
    return None


_HELP = {
    "ignis_prompt_checkpoint_lookups": "Requests that looked for a prompt checkpoint to start from.",
    "ignis_prompt_checkpoint_hits": "Requests started from a prompt checkpoint, by the tier it was on.",
    "ignis_prompt_checkpoint_reused_tokens": "Prompt tokens restored from checkpoints instead of prefilled.",
    "ignis_prompt_checkpoint_recorded": "Prompt checkpoints recorded, by where they were taken.",
    "ignis_prompt_checkpoint_evictions": "Prompt checkpoints evicted from a tier (card: to host or dropped).",
    "ignis_prompt_checkpoint_bytes": "Bytes of the prompt checkpoints held, by tier.",
    "ignis_prompt_checkpoint_entries": "Prompt checkpoints held, by tier.",
    "ignis_prompt_checkpoint_budget_bytes": "Byte budget of the prompt checkpoint tier.",
    "ignis_prompt_checkpoint_copied_bytes": "Bytes of prompt checkpoints copied between the tiers.",
    "ignis_prompt_checkpoint_copy_seconds": (
        "Wall time of the (synchronous) copies of prompt checkpoints between the tiers, seconds."
    ),
}


class PromptCheckpointCollector(Collector):
    """Exports a `PrefixCache`'s samples (counters end in _total, the rest are gauges)."""

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for name, labels, value in self._cache.samples():
            is_counter = name.endswith("_total")
            base = name.removesuffix("_total")
            fam = families.get(base)
            if fam is None:
                cls = CounterMetricFamily if is_counter else GaugeMetricFamily
                fam = cls(base, _HELP.get(base, base), labels=sorted(labels))
                families[base] = fam
            fam.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()


def chat_opener(tokenizer: Any, req: Any, prompt_ids: Sequence[int]) -> tuple[int, ...]:
    """The `checkpoint_at` positions of a chat request: its opener's end (`opener_length`), or ().

    Args:
        req: a `ChatCompletionRequest` whose prompt (`prompt_ids`) was rendered already.
    """
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    n = opener_length(tokenizer, messages, req.tools, prompt_ids, **dict(req.chat_template_kwargs or {}))
    return () if n is None else (n,)


def build_checkpoint_pool(
    *,
    card_bytes: int,
    host_bytes: int,
    device: Any,
    snapshot_dir: str | None = None,
    binding: Any = None,
) -> tuple[PrefixCache | None, Callable[[], None] | None]:
    """The served model's checkpoint pool and its shutdown hook.

    Args:
        card_bytes, host_bytes: the budgets (both 0: no pool, (None, None)).
        device: the engine's device (the card tier's).
        snapshot_dir: a snapshot directory to load now and save at shutdown, or None.
        binding: the `ignis.formats.snapshot.SnapshotBinding` the snapshots are bound to (required
            with snapshot_dir).

    Returns:
        (pool or None, a callable that writes the pool to snapshot_dir, or None).
    """
    cache = PrefixCache(card_bytes=card_bytes, host_bytes=host_bytes, card_device=device)
    if not cache.is_enabled:
        return None, None
    if snapshot_dir is None:
        return cache, None
    from ignis.runtime.snapshots import SnapshotDirectory

    if binding is None:
        raise ConfigError("a checkpoint snapshot directory needs the artifact binding")
    folder = SnapshotDirectory(snapshot_dir, binding)
    n = folder.load(cache, device="cpu")
    log.info("prompt checkpoints: %d loaded from %s", n, snapshot_dir)

    def save() -> None:
        written = folder.save(cache)
        log.info("prompt checkpoints: %d written to %s", written, snapshot_dir)

    return cache, save
