"""Prompt checkpoint pool: a card tier and a host-RAM tier with byte budgets, longest-prefix lookup.

`PrefixCache` keeps `LaneCheckpoint`s (`ignis.runtime.checkpoints`) keyed by their token ids and the
drafter they were taken with. A new request asks `lookup(prompt)` for the checkpoint that lets it
skip the most prompt tokens:

* a checkpoint whose tokens are a prefix of the prompt restores at its own position N, provided at
  least one prompt token is left to prefill or the checkpoint holds the logits of its last position
  (then a prompt equal to its tokens runs no forward at all);
* a truncatable checkpoint (attention-only model state and drafter context) also restores at M < N,
  the common prefix rounded down to `block_size` tokens (the granularity of vLLM's and SGLang's
  prefix caches), leaving at least one prompt token to prefill.

Tiers: `insert` puts a checkpoint on the card tier (the device its tensors are on) while the card
budget allows; the least recently used card entries move to the host tier to make room (a copy to
pinned host memory), and the least recently used host entries are dropped to stay within the host
budget. A checkpoint larger than a tier's budget skips that tier. Neither tier ever exceeds its
budget. A hit moves the entry to the most recently used end; a host hit is promoted back to the card
when it fits. Lanes hold copies of what they restored (restore copies into the lane's own buffers),
so an eviction never touches a lane in use; an entry being restored is pinned (`pin`/`unpin`) and
skipped by eviction meanwhile. A superseded entry (`supersede`: the prompt checkpoint of a lane whose
reply checkpoint now extends it, useful only to a retry of the same prompt) is evicted before any
other and dropped rather than copied to the host; a hit clears the mark.

On a CPU-only engine both tiers are host memory; the budgets, the LRU order and every counter work
the same (the tests use that).

Counters (`PrefixCacheMetrics`, exported by the server as Prometheus metrics):

- `ignis_prompt_checkpoint_lookups_total`: requests that looked for a checkpoint.
- `ignis_prompt_checkpoint_hits_total{tier}`: lookups served from a checkpoint, by the tier it was on.
- `ignis_prompt_checkpoint_reused_tokens_total`: prompt tokens restored instead of prefilled.
- `ignis_prompt_checkpoint_recorded_total{kind}`: checkpoints inserted ("prompt", "opener", "reply").
- `ignis_prompt_checkpoint_evictions_total{tier}`: entries evicted from a tier ("card": moved to the
  host or dropped; "host": dropped).
- `ignis_prompt_checkpoint_copied_bytes_total{direction}`,
  `ignis_prompt_checkpoint_copy_seconds_total{direction}`: checkpoints moved between the tiers
  ("to_host": a demotion or an insert straight to the host; "to_card": a promotion), and the wall
  time those copies held the engine's thread (they are synchronous).
- `ignis_prompt_checkpoint_bytes{tier}`, `ignis_prompt_checkpoint_entries{tier}` (gauges), and the
  budgets `ignis_prompt_checkpoint_budget_bytes{tier}`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ignis.runtime.checkpoints import LaneCheckpoint
from ignis.runtime.errors import ConfigError

__all__ = ["DEFAULT_BLOCK_SIZE", "CacheHit", "PrefixCache", "PrefixCacheMetrics"]

DEFAULT_BLOCK_SIZE = 16  # tokens: truncated (attention-only) reuse is rounded down to this
CARD, HOST = "card", "host"


class PrefixCacheMetrics:
    """The pool's counters (module docstring). Plain Python, one engine thread updates them."""

    def __init__(self) -> None:
        self.lookups_total = 0
        self.hits_total: defaultdict[str, int] = defaultdict(int)
        self.reused_tokens_total = 0
        self.recorded_total: defaultdict[str, int] = defaultdict(int)
        self.evictions_total: defaultdict[str, int] = defaultdict(int)
        self.copied_bytes_total: defaultdict[str, int] = defaultdict(int)
        self.copy_seconds_total: defaultdict[str, float] = defaultdict(float)


@dataclass
class _Entry:
    checkpoint: LaneCheckpoint
    tier: str
    nbytes: int
    pins: int = 0
    is_superseded: bool = False  # a longer checkpoint of the same lane extends it (`supersede`)


@dataclass(frozen=True)
class CacheHit:
    """A lookup's answer.

    Attributes:
        checkpoint: the checkpoint to restore (on its tier's device: restore copies it into the lane).
        num_tokens: the position to restore at (N, or M < N for a truncated attention-only one).
        tier: "card" or "host", where it was found.
        key: the entry's key (for `unpin`).
    """

    checkpoint: LaneCheckpoint
    num_tokens: int
    tier: str
    key: tuple[str, tuple[int, ...]]


class PrefixCache:
    """The checkpoint pool (module docstring).

    Args:
        card_bytes: byte budget of the card tier (0: no card tier).
        host_bytes: byte budget of the host tier (0: no host tier).
        card_device: the device of the card tier (a checkpoint on another device is moved there on
            insert); None: whatever device a checkpoint arrives on.
        block_size: granularity of truncated reuse (attention-only checkpoints), >= 1.
        min_tokens: checkpoints shorter than this are not kept (>= 1).
        pin_host_memory: host copies in pinned memory when CUDA is present.

    Raises:
        ConfigError: a negative budget, block_size or min_tokens < 1.
    """

    def __init__(
        self,
        *,
        card_bytes: int,
        host_bytes: int,
        card_device: torch.device | str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        min_tokens: int = 1,
        pin_host_memory: bool = True,
    ) -> None:
        if card_bytes < 0 or host_bytes < 0:
            raise ConfigError(
                f"checkpoint budgets must be >= 0 bytes, got card {card_bytes}, host {host_bytes}"
            )
        if block_size < 1 or min_tokens < 1:
            raise ConfigError(f"block_size and min_tokens must be >= 1, got {block_size} and {min_tokens}")
        self.budget = {CARD: int(card_bytes), HOST: int(host_bytes)}
        self.card_device = None if card_device is None else torch.device(card_device)
        self.block_size = int(block_size)
        self.min_tokens = int(min_tokens)
        self.pin_host_memory = bool(pin_host_memory)
        self.metrics = PrefixCacheMetrics()
        self._tiers: dict[str, OrderedDict[tuple[str, tuple[int, ...]], _Entry]] = {
            CARD: OrderedDict(),
            HOST: OrderedDict(),
        }
        self._used = {CARD: 0, HOST: 0}

    # ---- inspection ----

    @property
    def is_enabled(self) -> bool:
        """Whether any tier has a budget."""
        return self.budget[CARD] > 0 or self.budget[HOST] > 0

    def bytes_used(self, tier: str) -> int:
        """Bytes of the checkpoints held on `tier` ("card" or "host")."""
        return self._used[tier]

    def num_entries(self, tier: str) -> int:
        """Checkpoints held on `tier`."""
        return len(self._tiers[tier])

    def holds(self, token_ids: Sequence[int], *, drafter_name: str = "off") -> bool:
        """Whether a checkpoint of exactly these tokens (and drafter) is held, on either tier."""
        key = (drafter_name, tuple(int(t) for t in token_ids))
        return any(key in self._tiers[tier] for tier in (CARD, HOST))

    def entries(self, tier: str) -> list[LaneCheckpoint]:
        """The checkpoints on `tier`, least recently used first."""
        return [e.checkpoint for e in self._tiers[tier].values()]

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """Every counter and gauge as (metric name, labels, value), for an exporter (safe to call from
        another thread while the engine's thread updates the pool)."""
        m = self.metrics
        out: list[tuple[str, dict[str, str], float]] = [
            ("ignis_prompt_checkpoint_lookups_total", {}, m.lookups_total),
            ("ignis_prompt_checkpoint_reused_tokens_total", {}, m.reused_tokens_total),
        ]
        # .get: a scrape (another thread) never inserts into the counters' dicts
        for tier in (CARD, HOST):
            out.append(("ignis_prompt_checkpoint_hits_total", {"tier": tier}, m.hits_total.get(tier, 0)))
            out.append(
                ("ignis_prompt_checkpoint_evictions_total", {"tier": tier}, m.evictions_total.get(tier, 0))
            )
            out.append(("ignis_prompt_checkpoint_bytes", {"tier": tier}, self._used[tier]))
            out.append(("ignis_prompt_checkpoint_entries", {"tier": tier}, len(self._tiers[tier])))
            out.append(("ignis_prompt_checkpoint_budget_bytes", {"tier": tier}, self.budget[tier]))
        for d in ("to_host", "to_card"):
            out.append(
                (
                    "ignis_prompt_checkpoint_copied_bytes_total",
                    {"direction": d},
                    m.copied_bytes_total.get(d, 0),
                )
            )
            out.append(
                (
                    "ignis_prompt_checkpoint_copy_seconds_total",
                    {"direction": d},
                    m.copy_seconds_total.get(d, 0.0),
                )
            )
        for kind in ("prompt", "opener", "reply"):
            out.append(
                ("ignis_prompt_checkpoint_recorded_total", {"kind": kind}, m.recorded_total.get(kind, 0))
            )
        return out

    # ---- lookup ----

    def lookup(self, prompt_token_ids: Sequence[int], *, drafter_name: str = "off") -> CacheHit | None:
        """The checkpoint restoring the most of the prompt (module docstring), pinned; None on a miss.

        Counts the lookup, and on a hit the tier and the tokens reused. The caller restores from
        `hit.checkpoint` and then calls `unpin(hit)`.
        """
        prompt = tuple(int(t) for t in prompt_token_ids)
        self.metrics.lookups_total += 1
        best: tuple[int, str, tuple[str, tuple[int, ...]]] | None = None
        for tier in (CARD, HOST):
            for key, entry in self._tiers[tier].items():
                if key[0] != drafter_name:
                    continue
                n = self._usable(entry.checkpoint, prompt)
                if n > 0 and (best is None or n > best[0]):
                    best = (n, tier, key)
        if best is None:
            return None
        n, tier, key = best
        entry = self._tiers[tier][key]
        entry.is_superseded = False  # asked for again (a retry of its prompt): an ordinary entry
        self._tiers[tier].move_to_end(key)
        self.metrics.hits_total[tier] += 1
        self.metrics.reused_tokens_total += n
        if tier == HOST:
            entry = self._promote(key, entry)
        entry.pins += 1
        return CacheHit(checkpoint=entry.checkpoint, num_tokens=n, tier=tier, key=key)

    def supersede(self, token_ids: Sequence[int], *, drafter_name: str = "off") -> None:
        """Mark the checkpoint of exactly these tokens (if held) superseded (module docstring)."""
        key = (drafter_name, tuple(int(t) for t in token_ids))
        for tier in (CARD, HOST):
            entry = self._tiers[tier].get(key)
            if entry is not None:
                entry.is_superseded = True

    def unpin(self, hit: CacheHit) -> None:
        """Release a hit's entry (restore done); it may be evicted again. Idempotent per entry."""
        for tier in (CARD, HOST):
            entry = self._tiers[tier].get(hit.key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def _usable(self, ckpt: LaneCheckpoint, prompt: tuple[int, ...]) -> int:
        toks = ckpt.token_ids
        n = len(toks)
        if n <= len(prompt) and prompt[:n] == toks and (n < len(prompt) or ckpt.last_logits is not None):
            return n
        if not ckpt.is_truncatable:
            return 0
        common = 0
        for a, b in zip(toks, prompt, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        return common // self.block_size * self.block_size

    # ---- insert / evict ----

    def insert(self, checkpoint: LaneCheckpoint) -> bool:
        """Keep a checkpoint (module docstring for the tiers); one with the same tokens and drafter
        is replaced. Returns False when it is not kept (shorter than min_tokens, larger than every
        budget, or evicting enough would touch pinned entries)."""
        if checkpoint.num_tokens < self.min_tokens or not self.is_enabled:
            return False
        key = (checkpoint.drafter_name, checkpoint.token_ids)
        for tier in (CARD, HOST):
            old = self._tiers[tier].get(key)
            if old is not None:
                if old.pins:
                    return False  # being restored: keep the one in use
                self._remove(tier, key)
        nbytes = checkpoint.nbytes
        if self._make_room(CARD, nbytes):
            ckpt = checkpoint if self.card_device is None else checkpoint.to(self.card_device)
            self._add(CARD, key, _Entry(ckpt, CARD, nbytes))
        elif self._make_room(HOST, nbytes):
            self._add(HOST, key, _Entry(self._copy(checkpoint, torch.device("cpu")), HOST, nbytes))
        else:
            return False
        self.metrics.recorded_total[checkpoint.kind] += 1
        return True

    def discard(self, hit: CacheHit) -> None:
        """Drop a hit's entry that failed to restore, and take its counts back (lookup stays counted)."""
        for tier in (CARD, HOST):
            if hit.key in self._tiers[tier]:
                self._remove(tier, hit.key)
        self.metrics.hits_total[hit.tier] -= 1
        self.metrics.reused_tokens_total -= hit.num_tokens

    def clear(self) -> None:
        """Drop every checkpoint (pinned ones too: their restores hold their own references)."""
        for tier in (CARD, HOST):
            self._tiers[tier].clear()
            self._used[tier] = 0

    def _add(self, tier: str, key: tuple[str, tuple[int, ...]], entry: _Entry) -> None:
        entry.tier = tier
        self._tiers[tier][key] = entry
        self._used[tier] += entry.nbytes

    def _remove(self, tier: str, key: tuple[str, tuple[int, ...]]) -> _Entry:
        entry = self._tiers[tier].pop(key)
        self._used[tier] -= entry.nbytes
        return entry

    def _make_room(self, tier: str, nbytes: int) -> bool:
        """Evict `tier`'s least recently used unpinned entries until nbytes fit; False (nothing
        evicted) when they cannot fit even then."""
        budget = self.budget[tier]
        if nbytes > budget:
            return False
        free = budget - self._used[tier] + sum(e.nbytes for e in self._tiers[tier].values() if not e.pins)
        if free < nbytes:
            return False
        entries = self._tiers[tier]
        order = [k for k, e in entries.items() if e.is_superseded] + [
            k for k, e in entries.items() if not e.is_superseded
        ]  # superseded first, then least recently used first
        for key in order:
            if budget - self._used[tier] >= nbytes:
                break
            if entries[key].pins:
                continue
            entry = self._remove(tier, key)
            self.metrics.evictions_total[tier] += 1
            if tier == CARD and not entry.is_superseded:
                self._demote(key, entry)
        return True

    def _demote(self, key: tuple[str, tuple[int, ...]], entry: _Entry) -> None:
        """A card entry evicted: to the host tier when it fits there (dropped otherwise)."""
        if self._make_room(HOST, entry.nbytes):
            host = dataclasses.replace(
                entry, checkpoint=self._copy(entry.checkpoint, torch.device("cpu")), pins=0
            )
            self._add(HOST, key, host)

    def _copy(self, ckpt: LaneCheckpoint, device: torch.device) -> LaneCheckpoint:
        """`ckpt` on `device` (host copies pinned per `pin_host_memory`), timed and counted when it
        moves between devices."""
        if ckpt.device.type == device.type:
            return ckpt.to(device, pin=self.pin_host_memory)
        direction = "to_host" if device.type == "cpu" else "to_card"
        t0 = time.perf_counter()
        out = ckpt.to(device, pin=self.pin_host_memory)
        self.metrics.copy_seconds_total[direction] += time.perf_counter() - t0
        self.metrics.copied_bytes_total[direction] += ckpt.nbytes
        return out

    def _promote(self, key: tuple[str, tuple[int, ...]], entry: _Entry) -> _Entry:
        """A host hit: back to the card tier when it fits there without evicting pinned entries."""
        if self.card_device is None or self.card_device.type == "cpu" or entry.pins:
            return entry
        if entry.nbytes > self.budget[CARD]:
            return entry
        self._remove(HOST, key)
        if not self._make_room(CARD, entry.nbytes):
            self._add(HOST, key, entry)
            return entry
        card = _Entry(self._copy(entry.checkpoint, self.card_device), CARD, entry.nbytes)
        self._add(CARD, key, card)
        return card
