"""The prompt checkpoint pool (`PrefixCache`): longest usable prefix, LRU by bytes over a card and a
host tier, budgets never exceeded, pinned entries never evicted, counters."""

from __future__ import annotations

import random

import pytest
import torch

from ignis.runtime.checkpoints import LaneCheckpoint
from ignis.runtime.errors import ConfigError
from ignis.runtime.prefix_cache import PrefixCache


def _ckpt(tokens, *, nbytes=400, logits=False, truncatable=False, drafter="off", kind="prompt"):
    return LaneCheckpoint(
        token_ids=tuple(tokens),
        model={"attn.keys": torch.zeros(nbytes // 4, dtype=torch.float32)},
        drafter_name=drafter,
        last_logits=torch.zeros(1) if logits else None,
        is_truncatable=truncatable,
        kind=kind,
    )


def test_longest_usable_prefix() -> None:
    c = PrefixCache(card_bytes=10_000, host_bytes=0)
    c.insert(_ckpt(range(10)))
    c.insert(_ckpt(range(20)))
    c.insert(_ckpt([*range(15), 99]))
    hit = c.lookup([*range(20), 5])
    assert hit is not None and hit.num_tokens == 20 and hit.tier == "card"
    c.unpin(hit)
    # a prompt equal to a checkpoint without logits: not usable (no token left to prefill)
    hit = c.lookup(list(range(20)))
    assert hit is not None and hit.num_tokens == 10
    c.unpin(hit)
    assert c.lookup([1, 2, 3]) is None
    # another drafter's checkpoints are never used
    assert c.lookup([*range(20), 5], drafter_name="mtp") is None
    assert c.metrics.lookups_total == 4 and c.metrics.hits_total["card"] == 2
    assert c.metrics.reused_tokens_total == 30


def test_whole_prompt_needs_logits() -> None:
    c = PrefixCache(card_bytes=10_000, host_bytes=0)
    c.insert(_ckpt(range(8), logits=True))
    hit = c.lookup(list(range(8)))
    assert hit is not None and hit.num_tokens == 8


def test_truncatable_block_aligned() -> None:
    c = PrefixCache(card_bytes=10_000, host_bytes=0, block_size=4)
    c.insert(_ckpt(range(20), truncatable=True))
    hit = c.lookup([*range(11), 50, 51])
    assert hit is not None and hit.num_tokens == 8  # common 11 -> 8
    c.unpin(hit)
    hit = c.lookup(list(range(9)))  # a prefix of the checkpoint: at most len - 1, aligned
    assert hit is not None and hit.num_tokens == 8
    c.unpin(hit)
    c2 = PrefixCache(card_bytes=10_000, host_bytes=0, block_size=4)
    c2.insert(_ckpt(range(20)))  # recurrent state: exact position only
    assert c2.lookup([*range(11), 50]) is None


def test_lru_demotes_to_host_and_drops() -> None:
    c = PrefixCache(card_bytes=1000, host_bytes=1000)
    for i in range(5):
        assert c.insert(_ckpt([i] * 5, nbytes=400))
    # card holds the 2 newest, host the 2 before, the oldest was dropped
    assert [e.token_ids[0] for e in c.entries("card")] == [3, 4]
    assert [e.token_ids[0] for e in c.entries("host")] == [1, 2]
    assert c.bytes_used("card") == 800 and c.bytes_used("host") == 800
    assert c.metrics.evictions_total["card"] == 3 and c.metrics.evictions_total["host"] == 1
    hit = c.lookup([1] * 5 + [7])
    assert hit is not None and hit.tier == "host" and hit.num_tokens == 5
    c.unpin(hit)
    assert c.metrics.hits_total["host"] == 1
    # the host hit became most recently used there: the next demotion drops entry 2, not 1
    c.insert(_ckpt([9] * 5, nbytes=400))
    assert [e.token_ids[0] for e in c.entries("host")] == [1, 3]


def test_too_large_skips_tiers() -> None:
    c = PrefixCache(card_bytes=100, host_bytes=1000)
    assert c.insert(_ckpt([1] * 3, nbytes=400))
    assert c.num_entries("card") == 0 and c.num_entries("host") == 1
    assert not c.insert(_ckpt([2] * 3, nbytes=4000))
    assert c.metrics.recorded_total["prompt"] == 1


def test_pinned_entries_are_not_evicted() -> None:
    c = PrefixCache(card_bytes=800, host_bytes=0)
    c.insert(_ckpt([1] * 4, nbytes=400))
    c.insert(_ckpt([2] * 4, nbytes=400))
    hit = c.lookup([1] * 4 + [0])
    assert hit is not None
    c.insert(_ckpt([3] * 4, nbytes=400))  # evicts 2 (1 is pinned, though older)
    assert sorted(e.token_ids[0] for e in c.entries("card")) == [1, 3]
    assert not c.insert(_ckpt([4] * 4, nbytes=800))  # would need the pinned one
    c.unpin(hit)
    assert c.insert(_ckpt([4] * 4, nbytes=800))
    assert [e.token_ids[0] for e in c.entries("card")] == [4]


def test_same_tokens_replace() -> None:
    c = PrefixCache(card_bytes=1000, host_bytes=0)
    c.insert(_ckpt([1, 2, 3], nbytes=400, kind="prompt"))
    c.insert(_ckpt([1, 2, 3], nbytes=400, kind="reply"))
    assert c.num_entries("card") == 1 and c.bytes_used("card") == 400
    assert c.entries("card")[0].kind == "reply"


def test_budgets_never_exceeded_random() -> None:
    rng = random.Random(0)
    c = PrefixCache(card_bytes=3000, host_bytes=5000)
    pins = []
    for _ in range(400):
        op = rng.random()
        if op < 0.6:
            c.insert(
                _ckpt(
                    [rng.randrange(4) for _ in range(rng.randrange(1, 6))], nbytes=4 * rng.randrange(1, 400)
                )
            )
        elif op < 0.85:
            hit = c.lookup([rng.randrange(4) for _ in range(6)])
            if hit is not None:
                pins.append(hit)
        elif pins:
            c.unpin(pins.pop(rng.randrange(len(pins))))
        for tier in ("card", "host"):
            assert c.bytes_used(tier) <= c.budget[tier]
            assert c.bytes_used(tier) == sum(e.nbytes for e in c.entries(tier))


def test_config_errors() -> None:
    with pytest.raises(ConfigError):
        PrefixCache(card_bytes=-1, host_bytes=0)
    with pytest.raises(ConfigError):
        PrefixCache(card_bytes=0, host_bytes=0, block_size=0)
    assert not PrefixCache(card_bytes=0, host_bytes=0).is_enabled


def test_samples_names() -> None:
    c = PrefixCache(card_bytes=1000, host_bytes=1000)
    c.insert(_ckpt([1, 2]))
    names = {n for n, _, _ in c.samples()}
    assert names == {
        "ignis_prompt_checkpoint_lookups_total",
        "ignis_prompt_checkpoint_reused_tokens_total",
        "ignis_prompt_checkpoint_hits_total",
        "ignis_prompt_checkpoint_evictions_total",
        "ignis_prompt_checkpoint_bytes",
        "ignis_prompt_checkpoint_entries",
        "ignis_prompt_checkpoint_budget_bytes",
        "ignis_prompt_checkpoint_recorded_total",
        "ignis_prompt_checkpoint_copied_bytes_total",
        "ignis_prompt_checkpoint_copy_seconds_total",
    }
    assert ("ignis_prompt_checkpoint_bytes", {"tier": "card"}, 400) in c.samples()


def test_superseded_entries_go_first_and_are_dropped() -> None:
    c = PrefixCache(card_bytes=1200, host_bytes=10_000)
    c.insert(_ckpt([1] * 4, nbytes=400))  # oldest
    c.insert(_ckpt([2] * 4, nbytes=400))  # a prompt checkpoint ...
    c.insert(_ckpt([2] * 8, nbytes=400, kind="reply"))  # ... extended by its reply
    c.supersede([2] * 4)
    c.insert(_ckpt([3] * 4, nbytes=400))
    # the superseded entry left first (though not the least recently used) and was dropped
    assert [e.token_ids for e in c.entries("card")] == [(1,) * 4, (2,) * 8, (3,) * 4]
    assert c.num_entries("host") == 0 and c.metrics.evictions_total["card"] == 1
    # a hit on a superseded entry (a retry) makes it ordinary again: demoted, not dropped
    c.supersede([1] * 4)
    hit = c.lookup([1] * 4 + [5])
    assert hit is not None
    c.unpin(hit)
    c.insert(_ckpt([4] * 4, nbytes=400))
    assert [e.token_ids for e in c.entries("host")] == [(2,) * 8]
