"""The engine's side of prompt checkpoints: restore joining lanes, record lanes at chosen positions.

`EngineCheckpoints` is a part of `ignis.runtime.engine.SpeculativeEngine` (it reads and moves the
engine's lanes); the pool itself is `ignis.runtime.prefix_cache.PrefixCache` and a checkpoint's
contents `ignis.runtime.checkpoints`. Per step, before the prefill is planned:

1. **Restore.** Each waiting lane that may join this step (`max_lanes`, arrival order) looks up the
   longest usable checkpoint of its prompt. On a hit the lane takes a fresh state, the checkpoint's
   model state is copied into it and the drafter restores its context (`Drafter.restore_lane`,
   instead of `start_lane`); the lane then counts as being prefilled from the checkpoint's position
   on, so only the rest of its prompt is prefilled (chunked like any prompt). A checkpoint covering
   the whole prompt (with the logits of its last position) gives the first output token at once,
   chosen from those logits exactly as a prefill would (argmax, or sampled with the lane's stream),
   and the lane decodes from the next round. A checkpoint that turns out not to fit (a
   `CheckpointError`: it should not happen) is dropped from the pool with a warning and the lane
   is prefilled from zero.
2. **Record.** Only committed state is recorded, between a commit and the next forward, so a
   rejected draft never reaches a checkpoint:

   * "opener": a prompt chunk is cut at each of the lane's `checkpoint_at` positions (the chat
     template's turn boundaries, from the server), and the state there is recorded;
   * "prompt": the state after a prompt's last chunk (with the logits of its last position);
   * "reply": the state of a finished lane (prompt + output without its last token, which was
     never fed), when it holds more than the prompt. The drafter first commits the lane's last run
     (the engine otherwise skips it for a finishing lane), then its context is snapshot. The lane's
     prompt checkpoint is then marked superseded in the pool (evicted first, never moved to the
     host: only a retry of the same prompt still needs it).

3. **Share an opener in flight.** A waiting lane whose `checkpoint_at` position p another lane of
   the same prompt prefix (the same opener) is still prefilling towards is not admitted yet: it waits
   until that lane has recorded the opener at p, then restores it instead of prefilling the same
   tokens again (a burst of conversations with one system prompt prefills it once). It waits only
   while such a lane is being prefilled (or admitted this step) below p and the pool does not hold
   the opener; otherwise it is admitted as usual.

The model state is cloned on the executor's device (a card-to-card copy); the pool moves it to the
host when the card tier is full. Recording costs one copy of the lane's state per checkpoint.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ignis.runtime.checkpoints import CheckpointError, capture_lane, model_state_io, restore_lane
from ignis.runtime.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from ignis.runtime.engine import SpeculativeEngine, _Lane

__all__ = ["EngineCheckpoints"]

log = logging.getLogger(__name__)


class EngineCheckpoints:
    """Prompt checkpoints for one engine (module docstring). `is_enabled` False: every hook is off.

    Args:
        engine: the engine.
        cache: the pool, or None.
        is_enabled: whether restoring and recording run.
    """

    def __init__(self, engine: SpeculativeEngine, cache: PrefixCache | None, *, is_enabled: bool) -> None:
        # A weak reference: the engine owns this object, and a strong one back would make a cycle that
        # keeps a dropped engine (its executor's device memory, its CUDA graphs) until the cycle
        # collector runs.
        self._engine = weakref.ref(engine)
        self.cache = cache
        self.is_enabled = is_enabled

    @property
    def engine(self) -> SpeculativeEngine:
        """The engine this belongs to.

        Raises:
            ReferenceError: the engine was dropped.
        """
        eng = self._engine()
        if eng is None:
            raise ReferenceError("the engine of these prompt checkpoints was dropped")
        return eng

    @classmethod
    def create(cls, engine: SpeculativeEngine, cache: PrefixCache | None) -> EngineCheckpoints:
        """Enabled when the pool has a budget, the executor's state can be captured and the drafter
        (if any) supports checkpoints; otherwise off, with a warning saying why."""
        if cache is None or not cache.is_enabled:
            return cls(engine, cache, is_enabled=False)
        if model_state_io(engine.executor) is None:
            log.warning(
                "prompt checkpoints are off: %s has no lane state capture", type(engine.executor).__name__
            )
            return cls(engine, cache, is_enabled=False)
        d = engine.drafter
        if d is not None and not getattr(d, "supports_checkpoints", False):
            log.warning("prompt checkpoints are off: drafter %r cannot be checkpointed", d.name)
            return cls(engine, cache, is_enabled=False)
        return cls(engine, cache, is_enabled=True)

    @property
    def records_replies(self) -> bool:
        """Whether finished lanes are recorded ("reply" checkpoints)."""
        return self.is_enabled

    @property
    def _drafter_name(self) -> str:
        d = self.engine.drafter
        return "off" if d is None else str(d.name)

    # ---- restore ----

    def restore_waiting(self, emitted: dict[int, list[int]]) -> list[_Lane]:
        """Restore the joining lanes that have a usable checkpoint (module docstring, 1).

        Returns:
            the lanes that finished on their first token (a full-prompt hit whose token is a stop).
        """
        eng, cache = self.engine, self.cache
        assert cache is not None
        num_admit = eng.scheduler.num_to_admit(len(eng._active) + len(eng._prefilling), len(eng._waiting))
        finished: list[_Lane] = []
        for lane in list(eng._waiting[:num_admit]):
            hit = cache.lookup(lane.prompt, drafter_name=self._drafter_name)
            if hit is None:
                continue
            try:
                state = eng.executor.new_lane()
                try:
                    restore_lane(
                        eng.executor,
                        state,
                        hit.checkpoint,
                        hit.num_tokens,
                        lane.prompt,
                        drafter=eng.drafter,
                        lane_id=lane.lane_id,
                    )
                except CheckpointError as exc:
                    log.warning(
                        "lane %d: prompt checkpoint dropped, prefilling from zero: %s", lane.lane_id, exc
                    )
                    release = getattr(eng.executor, "release_lane", None)
                    if release is not None:
                        release(state)
                    cache.unpin(hit)
                    cache.discard(hit)
                    continue
            finally:
                cache.unpin(hit)
            eng._waiting.remove(lane)
            lane.state = state
            lane.num_prefilled = lane.num_cached = hit.num_tokens
            lane.drafter_started = eng.drafter is not None
            if hit.num_tokens < len(lane.prompt):
                eng._prefilling.append(lane)
                continue
            logits = hit.checkpoint.last_logits
            assert logits is not None  # `PrefixCache.lookup` serves a whole prompt only with them
            token = eng._choose_first(lane, logits.to(eng.device))
            lane.stops.extend([token])
            emitted[lane.lane_id] = [token]
            if lane.stops.is_finished:
                finished.append(lane)
                if eng.drafter is not None:
                    eng.drafter.end_lane(lane.lane_id)
            else:
                eng._active.append(lane)
        return finished

    def admissible(self, waiting: Sequence[_Lane]) -> list[_Lane]:
        """The waiting lanes that may be admitted now, in order: all but those whose opener another
        lane is prefilling (module docstring, 3)."""
        cache = self.cache
        assert cache is not None
        sources = [lane for lane in self.engine._prefilling if lane.checkpoint_at]
        out = []
        for lane in waiting:
            if lane.checkpoint_at and self._shares_opener(lane, sources, cache):
                continue
            out.append(lane)
            if lane.checkpoint_at:
                sources.append(lane)
        return out

    def _shares_opener(self, lane: _Lane, sources: Sequence[_Lane], cache: PrefixCache) -> bool:
        for p in lane.checkpoint_at:
            for src in sources:
                if (
                    p in src.checkpoint_at
                    and src.num_prefilled < p
                    and src.prompt[:p] == lane.prompt[:p]
                    and not cache.holds(lane.prompt[:p], drafter_name=self._drafter_name)
                ):
                    return True
        return False

    # ---- record ----

    def clip_chunks(self, chunks: list[tuple[_Lane, int]]) -> list[tuple[_Lane, int]]:
        """Cut each lane's prompt chunk at its next `checkpoint_at` position, so the state there exists."""
        out = []
        for lane, n in chunks:
            a = lane.num_prefilled
            for p in lane.checkpoint_at:
                if a < p < a + n:
                    n = p - a
                    break
            out.append((lane, n))
        return out

    def record_prefill(
        self,
        lanes: Sequence[_Lane],
        bounds: Sequence[tuple[int, int]],
        logits: Sequence[torch.Tensor],  # per lane float32 [1, vocab], its chunk's last position
    ) -> None:
        """Record the lanes whose chunk ended at a `checkpoint_at` position ("opener") or at the end
        of the prompt ("prompt"), after the chunk's commit (model and drafter)."""
        for i, (lane, (_, b)) in enumerate(zip(lanes, bounds, strict=True)):
            if b == len(lane.prompt):
                kind = "prompt"
            elif b in lane.checkpoint_at:
                kind = "opener"
            else:
                continue
            self._record(lane, lane.prompt[:b], logits[i][-1], kind)

    def record_replies(self, finished: Sequence[_Lane]) -> None:
        """Record each finished lane that holds more than its prompt ("reply"), then end its drafter
        lane (the engine left it open for this)."""
        d = self.engine.drafter
        for lane in finished:
            n = lane.num_committed
            if lane.state is not None and n > len(lane.prompt) and lane.state.num_tokens == n:
                if self._record(lane, (*lane.prompt, *lane.output)[:n], None, "reply"):
                    assert self.cache is not None  # the prompt's checkpoint now serves only a retry
                    self.cache.supersede(lane.prompt, drafter_name=self._drafter_name)
            if d is not None:
                d.end_lane(lane.lane_id)

    def _record(
        self, lane: _Lane, tokens: Sequence[int], last_logits: torch.Tensor | None, kind: str
    ) -> bool:
        """Capture and insert one checkpoint; whether the pool kept it."""
        cache = self.cache
        assert cache is not None and lane.state is not None
        if len(tokens) < cache.min_tokens or cache.holds(tokens, drafter_name=self._drafter_name):
            return False  # too short to keep, or held already (the same prompt prefilled twice)
        eng = self.engine
        try:
            ckpt = capture_lane(
                eng.executor,
                lane.state,
                tokens,
                drafter=eng.drafter,
                lane_id=lane.lane_id,
                last_logits=last_logits,
                kind=kind,
            )
        except CheckpointError as exc:
            log.warning("lane %d: no %s checkpoint: %s", lane.lane_id, kind, exc)
            return False
        return cache.insert(ckpt)
