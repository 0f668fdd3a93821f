"""The speculative round loop: lanes, prefill, verify rounds, acceptance, stops, commits, metrics.

`SpeculativeEngine` drives one `Executor` (a family's forward pass over several lanes) and an
optional `Drafter` (None = backend `off`, plain decode rounds). Each `step()`:

0. **Prompt checkpoints** (with a `prefix_cache`): joining lanes restore the longest checkpoint of
   their prompt and prefill only the rest; states are recorded at prompt ends, `checkpoint_at`
   positions and reply ends (`ignis.runtime.engine_checkpoints`).

1. **Admit and prefill, within the prefill budget.** Waiting lanes join (up to `max_lanes`, lanes being
   prefilled counted) in arrival order. At most `max_prefill_tokens` prompt tokens are prefilled per step
   across all lanes (0: no limit): the lane whose prompt was cut last step continues first, then the
   joining lanes take what is left, and a prompt longer than the budget is prefilled chunk after chunk
   over several steps. All chunks of a step run in one forward (`record=False`, `logits="last"`) and
   are committed whole, so each chunk continues the lane's state where the previous one ended (KV
   appended, conv and recurrent state carried: what a verify round does). Only a prompt's last chunk
   gives the first output token, chosen from the last prompt position's logits (argmax, or sampled
   from p with the lane's stream), stop-checked and emitted; the lane then decodes. The drafter is
   started at the lane's first chunk and told each chunk's columns as one `CommittedSpan` (start = the
   chunk's first position, next_token_ids = the following prompt tokens, the first output token after
   the last one), so its context after the last chunk is what one unchunked prefill would have given.
2. **One verify round over every active lane** (newly prefilled lanes included):
   a. the scheduler gives each lane its drafts (`ignis.runtime.scheduler`), capped so that no draft is
      proposed whose token could not be emitted (max_tokens, context end);
   b. the drafter proposes for lanes with >= 1 draft;
   c. ONE `executor.forward` over every lane's columns [anchor, d_1..d_k] (lanes of different lengths
      and draft counts together; `record=True` whenever some lane drafts), sent to the device in one
      copy with no host sync since the proposal (`ignis.runtime.round_batch`);
   d. acceptance per lane: greedy (temperature 0) or rejection sampling (`ignis.runtime.acceptance`),
      on logits masked by the lane's grammar when it has one (`ignis.runtime.grammar`: row j's mask is
      the grammar state after drafts d_1..d_j, computed on the host while the forward runs); every
      greedy lane's argmax, every sampled lane's run and drafts the drafter left on the device come to
      the host in ONE copy (the round's only host sync);
   e. the committed run is stop-checked token by token (`ignis.runtime.stops`) and cut at a stop;
   f. `executor.commit` keeps exactly the columns whose next token was emitted;
   g. the drafter is told the committed columns (its context advances by them only);
   h. the speculative counters are updated (`ignis.runtime.metrics`).

**Anchor convention.** Prefill feeds the whole prompt; the first output token, chosen from the logits
of the last prompt position, is the first anchor. The anchor is always the lane's last token: emitted
to the client, not yet fed to the model. Invariant between steps, for every running lane:
`state.num_tokens == len(prompt) + len(output) - 1`, and the anchor is `output[-1]`. A verify round's
columns sit at positions state.num_tokens .. state.num_tokens + k; row i of its logits predicts the
token after column i. A run of n accepted drafts plus the bonus token keeps n + 1 columns (fewer when
a stop cuts the run: the columns whose next token was emitted), and the bonus token is the new anchor.

Randomness: each lane has its own stream (`ignis.runtime.sampling.LaneRandom`), seeded by the request's
seed. Lanes never share state: each lane's output is what it would produce alone (for greedy decoding
up to the executor's numerics, which the families guarantee per lane).

Chunked prefill keeps the active lanes decoding while a long prompt is prefilled: each step still runs
one verify round over every active lane, after at most one forward of `max_prefill_tokens` prompt
columns (vLLM's chunked prefill with `max_num_batched_tokens`, llama.cpp's `n_batch`). Greedy outputs do
not depend on the chunking beyond the executor's numerics (a family's batched math over a different
split of the same columns).

Errors raised by the executor or the drafter propagate out of `step()`; the engine is then in an
undefined state and must be discarded (a server restarts its lanes).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ignis.runtime.acceptance import PendingAcceptance, greedy_accept_ids, rejection_sample_on_device
from ignis.runtime.async_rounds import AsyncRounds, make_async_rounds
from ignis.runtime.drafters.base import CommittedSpan, Drafter, DrafterError, DraftProposal, DraftRequest
from ignis.runtime.engine_checkpoints import EngineCheckpoints
from ignis.runtime.errors import ConfigError, IgnisRuntimeError
from ignis.runtime.families.base import Executor, LaneState
from ignis.runtime.grammar import GrammarMatcher, mask_first_logits, mask_round_logits, start_round_masks
from ignis.runtime.logits_processors import LanePenalties, TokenLogprob, token_logprobs
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.round_batch import LaneTokens, RoundColumns, device_ids, round_host_ids
from ignis.runtime.sampling import LaneRandom, SamplingParams, logits_to_probs, sample_token
from ignis.runtime.scheduler import DEFAULT_MAX_PREFILL_TOKENS, MAX_DRAFT_TOKENS, LaneScheduler
from ignis.runtime.stops import Detokenize, StopChecker

__all__ = ["LaneRequestError", "LaneResult", "LaneUpdate", "SpeculativeEngine"]


class LaneRequestError(IgnisRuntimeError, ValueError):
    """A lane cannot be served as asked: empty prompt, a token id outside the vocabulary, a prompt
    that leaves no room in the context, or an unknown lane id."""


@dataclass(frozen=True)
class LaneUpdate:
    """What one `step()` emitted for one lane.

    Attributes:
        lane_id: the lane.
        new_token_ids: tokens emitted this step, in order (the committed run cut at a stop; may be
            empty for an aborted lane).
        finish_reason: None while running; "stop", "length" or "abort" once finished.
        stop_reason: the stop token id or stop string that finished it, else None.
    """

    lane_id: int
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token when the request asks

    @property
    def is_finished(self) -> bool:
        """True on the lane's last update."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class LaneResult:
    """A finished lane.

    Attributes:
        lane_id: the lane.
        prompt_token_ids: its prompt.
        output_token_ids: every emitted token (a stop token included as the last one).
        finish_reason: "stop", "length" or "abort".
        stop_reason: the stop token id or stop string, else None.
        text: the detokenized output cut before a stop string ("" unless the request had stop strings).
        seed: the seed of the lane's random stream (replays an unseeded sampling run).
        num_rounds: verify rounds the lane took part in (prefill not counted).
        num_cached_tokens: prompt tokens restored from a prompt checkpoint (OpenAI's
            `usage.prompt_tokens_details.cached_tokens`).
    """

    lane_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str
    stop_reason: int | str | None
    text: str
    seed: int
    num_rounds: int
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per output token when the request asked


@dataclass(eq=False)  # identity: lanes are removed from lists by identity, not field by field
class _Lane:
    lane_id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    stops: StopChecker
    random: LaneRandom
    state: LaneState | None = None
    num_rounds: int = 0
    num_prefilled: int = 0  # prompt tokens committed so far (< len(prompt) while being prefilled)
    drafter_started: bool = False  # drafter.start_lane was called (at the lane's first chunk)
    grammar: GrammarMatcher | None = None  # params.grammar's matcher (`ignis.runtime.grammar`)
    checkpoint_at: tuple[int, ...] = ()  # prompt positions to checkpoint at (chat turn boundaries)
    num_cached: int = 0  # prompt tokens restored from a prompt checkpoint instead of prefilled
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when asked
    penalties: LanePenalties | None = None  # penalties / min_tokens state, when the request has them

    @property
    def output(self) -> list[int]:
        return self.stops.output_token_ids

    @property
    def num_committed(self) -> int:
        return len(self.prompt) + len(self.output) - 1


class SpeculativeEngine:
    """Decode several lanes with speculative verify rounds (module docstring).

    Args:
        executor: the model (`ignis.runtime.families.base.Executor`).
        drafter: the drafter, or None for backend `off` (plain decode rounds, one column per lane).
        draft_tokens: k, drafts per lane per round (1..7); required with a drafter, ignored without.
        draft_rows: row budget for row-budgeted drafters (0 means 8, at most 32).
        eos_token_ids: the model's end-of-sequence ids (a lane stops on them unless `ignore_eos`).
        detokenize: output token ids -> text, needed for requests with stop strings.
        max_context: context limit in tokens (prompt + output); defaults to the executor config's
            `max_position_embeddings` (unlimited if it has none), or the executor's own `max_context`
            attribute when smaller (fixed-capacity lane buffers), and may not exceed either. An
            executor with a `release_lane(state)` method gets each finished lane's state back.
        max_lanes: most lanes decoding or being prefilled at once (others wait, first come first
            served); None = no limit.
        max_prefill_tokens: prompt tokens prefilled per step across all lanes (module docstring); a
            longer prompt is prefilled over several steps while the active lanes keep decoding.
            0 = no limit (every joining prompt whole in one step). Default
            `ignis.runtime.scheduler.DEFAULT_MAX_PREFILL_TOKENS` (2048, its docstring says why).
        device: where column tensors and lane generators live; defaults to `executor.device` if the
            executor has one, else CPU.
        metrics: the counters to update (a fresh `SpeculativeMetrics` by default).
        prefix_cache: prompt checkpoints (`ignis.runtime.prefix_cache.PrefixCache`): a joining lane
            restores the longest usable one and prefills only the rest; the state at the end of
            each prompt, at the lane's `checkpoint_at` positions and at the end of each reply is
            recorded (`ignis.runtime.engine_checkpoints`). None: every prompt is prefilled whole.
        async_rounds: issue each round from the device's argmax of the previous one before the host
            reads it (`ignis.runtime.async_rounds`): only with no drafter and greedy lanes without
            logits processing; other steps run as usual. Same tokens; updates come a step later.

    Raises:
        ConfigError: draft_tokens missing or outside 1..7 with a drafter, draft_rows outside 0..32,
            max_context above the model's limit or < 2, max_lanes < 1, max_prefill_tokens not an
            integer >= 0.
    """

    def __init__(
        self,
        executor: Executor,
        drafter: Drafter | None = None,
        *,
        draft_tokens: int | None = None,
        draft_rows: int = 0,
        eos_token_ids: Sequence[int] = (),
        detokenize: Detokenize | None = None,
        max_context: int | None = None,
        max_lanes: int | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        device: torch.device | str | None = None,
        metrics: SpeculativeMetrics | None = None,
        prefix_cache: PrefixCache | None = None,
        async_rounds: bool = False,
    ) -> None:
        if drafter is not None and draft_tokens is None:
            raise ConfigError(f"drafter {drafter.name!r} needs draft_tokens (1..{MAX_DRAFT_TOKENS})")
        if drafter is not None and draft_tokens == 0:
            raise ConfigError(
                f"draft_tokens must be 1..{MAX_DRAFT_TOKENS} with drafter {drafter.name!r}, got 0"
            )
        self.executor = executor
        self.drafter = drafter
        self.scheduler = LaneScheduler(
            draft_tokens=0 if drafter is None else int(draft_tokens),  # type: ignore[arg-type]
            draft_rows=draft_rows,
            is_row_budgeted=bool(drafter is not None and drafter.is_row_budgeted),
            max_lanes=max_lanes,
            max_prefill_tokens=max_prefill_tokens,
        )
        model_max = getattr(executor.config, "max_position_embeddings", None)
        pool_max = getattr(executor, "max_context", None)  # executors with fixed-capacity lane buffers
        if isinstance(pool_max, int):
            model_max = pool_max if model_max is None else min(model_max, pool_max)
        if max_context is None:
            max_context = model_max
        elif model_max is not None and max_context > model_max:
            raise ConfigError(
                f"max_context {max_context} exceeds the model's max_position_embeddings or the "
                f"executor's max_context ({model_max})"
            )
        if max_context is not None and max_context < 2:
            raise ConfigError(
                f"max_context must be >= 2 (a prompt token and an output token), got {max_context}"
            )
        self.max_context: int | None = max_context
        self.vocab_size: int | None = getattr(executor.config, "vocab_size", None)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.detokenize = detokenize
        self.device = torch.device(device if device is not None else getattr(executor, "device", "cpu"))
        self.metrics = metrics if metrics is not None else SpeculativeMetrics()
        self._ids = itertools.count()
        self._waiting: list[_Lane] = []  # queued, nothing prefilled yet (arrival order)
        self._prefilling: list[_Lane] = []  # part of the prompt committed (arrival order)
        self._active: list[_Lane] = []  # decoding
        self._results: dict[int, LaneResult] = {}
        self.checkpoints = EngineCheckpoints.create(self, prefix_cache)
        # Made once: the executor's forward options for the drafter, the proposal of a lane without drafts.
        self._fwd_kwargs: dict[str, Any] = {}
        if drafter is not None:
            self._fwd_kwargs = {
                "output_hidden_states": bool(drafter.needs_hidden_states),
                "tap_layers": tuple(drafter.tap_layers),
            }
        self._no_drafts = DraftProposal(torch.empty(0, dtype=torch.int64, device=self.device))
        self._step_logprobs: dict[int, list[TokenLogprob]] = {}  # lane -> this step's logprobs
        self._async = make_async_rounds(self, async_rounds)  # None: off, or a drafter (warned)

    # ------------------------------------------------------------------ lanes

    def add_lane(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        checkpoint_at: Sequence[int] = (),
    ) -> int:
        """Queue a request; it is prefilled at the next `step()`. Returns its lane id.

        `checkpoint_at`: prompt positions (0 < p < len(prompt), e.g. the end of a chat template's
        opener: system prompt and tools) where the lane's state is recorded as a prompt checkpoint
        while it is prefilled (with a `prefix_cache`; ignored otherwise or when out of range).

        Raises:
            LaneRequestError: empty prompt, token ids outside [0, vocab), or a prompt of max_context
                tokens or more (no room for an output token).
            SamplingParamsError: the request has stop strings and the engine has no detokenize callback.
        """
        params = params if params is not None else SamplingParams()
        prompt = tuple(int(t) for t in prompt_token_ids)
        if not prompt:
            raise LaneRequestError("empty prompt: a lane needs at least one prompt token")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            raise LaneRequestError(
                f"prompt token ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})"
            )
        if self.max_context is not None and len(prompt) >= self.max_context:
            raise LaneRequestError(
                f"prompt of {len(prompt)} tokens leaves no room for output in a context of {self.max_context}"
            )
        stops = StopChecker(
            params,
            num_prompt_tokens=len(prompt),
            eos_token_ids=self.eos_token_ids,
            max_context=self.max_context,
            detokenize=self.detokenize,
        )
        lane = _Lane(
            lane_id=next(self._ids),
            prompt=prompt,
            params=params,
            stops=stops,
            random=LaneRandom(params.seed),
            checkpoint_at=tuple(sorted({int(p) for p in checkpoint_at if 0 < int(p) < len(prompt)})),
        )
        if params.grammar is not None:
            lane.grammar = params.grammar.matcher()
        self._waiting.append(lane)
        return lane.lane_id

    def abort(self, lane_id: int) -> None:
        """Cancel a waiting, prefilling or running lane between steps (finish_reason "abort"); its
        state is released (and the drafter's lane ended). No-op once finished.

        Raises:
            LaneRequestError: unknown lane id.
        """
        for pool in (self._waiting, self._prefilling, self._active):
            for lane in pool:
                if lane.lane_id == lane_id:
                    pool.remove(lane)
                    lane.stops.abort()
                    if lane.drafter_started and self.drafter is not None:
                        self.drafter.end_lane(lane_id)
                    held = self._async is not None and self._async.holds(lane)  # a column in flight
                    self._finish(lane, release=not held)  # a pooled executor's slot back (mid-prefill too)
                    if held:
                        self._async.lane_aborted(lane)  # type: ignore[union-attr]
                    return
        if lane_id not in self._results:
            raise LaneRequestError(f"unknown lane id {lane_id}")

    @property
    def num_waiting(self) -> int:
        """Lanes queued for prefill, none of their prompt prefilled yet."""
        return len(self._waiting)

    @property
    def num_prefilling(self) -> int:
        """Lanes whose prompt is partly prefilled (chunked prefill); they hold a lane (`max_lanes`)."""
        return len(self._prefilling)

    @property
    def num_active(self) -> int:
        """Lanes decoding (prefilled, not finished)."""
        return len(self._active)

    @property
    def max_prefill_tokens(self) -> int:
        """The prefill budget: prompt tokens prefilled per step across all lanes (0: no limit)."""
        return self.scheduler.max_prefill_tokens

    @property
    def async_rounds(self) -> AsyncRounds | None:
        """The round in flight and its counters (`ignis.runtime.async_rounds`); None when off."""
        return self._async

    @property
    def has_unfinished(self) -> bool:
        """True while some lane waits, is being prefilled or decodes (or, with async rounds, a round of
        finished lanes is still to be committed: step until it is False)."""
        busy = self._async is not None and self._async.is_busy
        return bool(self._waiting or self._prefilling or self._active or busy)

    def result(self, lane_id: int) -> LaneResult | None:
        """A finished lane's result (kept until `pop_result`), or None while it runs."""
        return self._results.get(lane_id)

    def pop_result(self, lane_id: int) -> LaneResult:
        """Take a finished lane's result out of the engine.

        Raises:
            LaneRequestError: the lane is unknown or not finished.
        """
        try:
            return self._results.pop(lane_id)
        except KeyError:
            raise LaneRequestError(f"lane {lane_id} is unknown or not finished") from None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[LaneResult]:
        """Run prompts to completion (together with any lanes already queued); results in prompt order.

        Raises:
            ValueError: a different number of params than prompts; otherwise as `add_lane` and `step`.
        """
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per)} sampling params")
        ids = [self.add_lane(p, sp) for p, sp in zip(prompts, per, strict=True)]
        while any(self.result(i) is None for i in ids):
            self.step()
        return [self.pop_result(i) for i in ids]

    # ------------------------------------------------------------------ the round

    def step(self) -> list[LaneUpdate]:
        """Prefill (within `max_prefill_tokens`), then run one verify round over every active lane.

        Returns:
            one update per lane that emitted tokens or finished this step (prefill and round merged);
            a lane whose prompt is only partly prefilled emits nothing yet.

        Raises:
            DrafterError: the drafter broke its protocol (the message names the lane).
            StateError: from the executor (e.g. a lane past its context); the engine is then unusable.
        """
        emitted: dict[int, list[int]] = {}
        self._step_logprobs: dict[int, list[TokenLogprob]] = {}  # lane -> this step's (when asked)
        a = self._async
        finished = a.before_step(emitted) if a is not None else []  # drains before prefill work
        finished += self.checkpoints.restore_waiting(emitted) if self.checkpoints.is_enabled else []
        chunks = self._plan_prefill()
        finished += self._prefill(chunks, emitted) if chunks else []
        if a is not None and (a.is_busy or self._active) and a.takes_round():
            finished += a.round(emitted)
        elif a is not None and a.is_busy:
            finished += a.drain(emitted)  # defensive: before_step drains a round the step cannot run
        elif self._active:
            finished += self._round(emitted)
        updates = []
        for lane in finished:
            self._finish(lane, release=a is None or not a.holds(lane))
        done = {lane.lane_id: lane for lane in finished}
        for lane_id, tokens in emitted.items():
            lane_done = done.get(lane_id)
            lps = self._step_logprobs.get(lane_id)
            lps_out = tuple(lps) if lps is not None else None
            if lane_done is None:
                updates.append(LaneUpdate(lane_id, tuple(tokens), logprobs=lps_out))
            else:
                updates.append(
                    LaneUpdate(
                        lane_id,
                        tuple(tokens),
                        lane_done.stops.finish_reason,
                        lane_done.stops.stop_reason,
                        logprobs=lps_out,
                    )
                )
        return updates

    def _plain_first_tokens(
        self, lanes: list[_Lane], bounds: list[tuple[int, int]], logits: Sequence[torch.Tensor]
    ) -> dict[int, int]:
        """The first tokens of the lanes whose prompt ends in this chunk and that have no penalties
        and no grammar (lane index -> token), in one device-to-host copy: the greedy lanes' argmax,
        the sampled lanes' draw from p with their own stream (what `_choose_first` draws)."""
        greedy, draws, sampled = [], [], []
        for i, (lane, (_, b)) in enumerate(zip(lanes, bounds, strict=True)):
            params = lane.params
            if b != len(lane.prompt) or params.processes_logits or lane.grammar is not None:
                continue
            row = logits[i][-1]  # [vocab]
            if params.is_greedy:
                greedy.append(i)
            else:
                gen = lane.random.generator(row.device)
                draws.append(torch.multinomial(logits_to_probs(row, params), 1, generator=gen))
                sampled.append(i)
        if not greedy and not sampled:
            return {}
        rows, drawn = round_host_ids([logits[i][-1:] for i in greedy], range(len(greedy)), draws)
        firsts = {i: rows[j][0] for j, i in enumerate(greedy)}
        firsts.update((i, d[0]) for i, d in zip(sampled, drawn, strict=True))
        return firsts

    def _choose_first(self, lane: _Lane, logits: torch.Tensor, token: int | None = None) -> int:
        """The lane's first output token from its last prompt position's logits float [vocab];
        `token`: already chosen on the host (`_plain_first_tokens`)."""
        raw = logits
        if token is None:
            if lane.params.processes_logits:  # penalties / min_tokens (`ignis.runtime.logits_processors`)
                logits = self._process(lane, logits[None], [])[0]
            logits = mask_first_logits(lane.grammar, logits)
            if lane.params.is_greedy:
                token = int(logits.argmax().item())
            else:
                gen = lane.random.generator(logits.device)
                token = sample_token(logits_to_probs(logits, lane.params), gen)
        if lane.grammar is not None:
            lane.grammar.consume([token])
        self._record_logprobs(lane, raw[None], [token])
        return token

    def _process(self, lane: _Lane, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        """A lane's rows penalised and masked as decoding without speculation would see them (its
        `LanePenalties`, made at first use, told the tokens emitted since the last call)."""
        if lane.penalties is None:
            lane.penalties = LanePenalties(lane.params, lane.prompt, self.eos_token_ids)
        lane.penalties.extend(lane.output[lane.penalties.num_output :])
        return lane.penalties.process(logits, drafts)

    def _record_logprobs(self, lane: _Lane, raw: torch.Tensor, tokens: Sequence[int]) -> None:
        """Keep the emitted tokens' logprobs (rows of the raw logits) when the request asks for them."""
        if lane.params.logprobs is None or not tokens:
            return
        lps = token_logprobs(raw, tokens, lane.params.logprobs)
        lane.logprobs.extend(lps)
        self._step_logprobs.setdefault(lane.lane_id, []).extend(lps)

    def _plan_prefill(self) -> list[tuple[_Lane, int]]:
        """This step's prompt chunks, (lane, columns), in arrival order within the prefill budget
        (`LaneScheduler.plan_prefill`): the lanes being prefilled first, then the waiting lanes that may
        join (`max_lanes`). A waiting lane the budget does not reach keeps waiting."""
        waiting = self._waiting
        if not waiting and not self._prefilling:
            return []
        if self.checkpoints.is_enabled:  # lanes waiting for an opener another lane is prefilling
            waiting = self.checkpoints.admissible(waiting)
        num_admit = self.scheduler.num_to_admit(len(self._active) + len(self._prefilling), len(waiting))
        queue = [*self._prefilling, *waiting[:num_admit]]
        sizes = self.scheduler.plan_prefill([len(lane.prompt) - lane.num_prefilled for lane in queue])
        return list(zip(queue, sizes, strict=False))

    def _prefill(self, chunks: list[tuple[_Lane, int]], emitted: dict[int, list[int]]) -> list[_Lane]:
        ex = self.executor
        if self.checkpoints.is_enabled:
            chunks = self.checkpoints.clip_chunks(chunks)
        lanes = [lane for lane, _ in chunks]
        for lane in lanes:
            if lane.state is None:  # its first chunk: the lane joins
                self._waiting.remove(lane)
                self._prefilling.append(lane)
                lane.state = ex.new_lane()
        states = [lane.state for lane in lanes]
        bounds = [(lane.num_prefilled, lane.num_prefilled + n) for lane, n in chunks]
        # Every chunk in one host-to-device copy; each lane's columns are a view of it.
        sizes = [n for _, n in chunks]
        ids = device_ids(
            [t for lane, (a, b) in zip(lanes, bounds, strict=True) for t in lane.prompt[a:b]], self.device
        )
        columns = [ids] if len(sizes) == 1 else list(ids.split(sizes))
        out = ex.forward(states, columns, logits="last", record=False, **self._fwd_kwargs)
        ex.commit(states, sizes)
        firsts = self._plain_first_tokens(lanes, bounds, out.logits)
        finished, spans = [], []
        for i, (lane, (a, b)) in enumerate(zip(lanes, bounds, strict=True)):
            lane.num_prefilled = b
            if b < len(lane.prompt):  # more chunks to come: the next prompt token follows this chunk
                following: tuple[int, ...] = lane.prompt[a + 1 : b + 1]
            else:
                self._prefilling.remove(lane)
                token = self._choose_first(lane, out.logits[i][-1], firsts.get(i))
                lane.stops.extend([token])
                emitted[lane.lane_id] = [token]
                following = (*lane.prompt[a + 1 :], token)
                if lane.stops.is_finished:
                    finished.append(lane)
                    if not self.checkpoints.is_enabled:  # else the drafter ends after the checkpoint
                        if lane.drafter_started and self.drafter is not None:
                            self.drafter.end_lane(lane.lane_id)
                        continue
                else:
                    self._active.append(lane)
            if self.drafter is not None:
                if not lane.drafter_started:
                    self.drafter.start_lane(lane.lane_id, lane.prompt)
                    lane.drafter_started = True
                spans.append(
                    CommittedSpan(
                        lane_id=lane.lane_id,
                        start=a,
                        input_token_ids=lane.prompt[a:b],
                        next_token_ids=following,
                        hidden_states=None if out.hidden_states is None else out.hidden_states[i],
                        taps=None if out.taps is None else out.taps[i],
                    )
                )
        if spans and self.drafter is not None:
            self.drafter.commit(spans)
        if self.checkpoints.is_enabled:
            self.checkpoints.record_prefill(lanes, bounds, out.logits)
            for lane in finished:
                if lane.drafter_started and self.drafter is not None:
                    self.drafter.end_lane(lane.lane_id)
        return finished

    def _propose(self, lanes: list[_Lane], num_drafts: list[int]) -> list[DraftProposal]:
        proposals = [self._no_drafts] * len(lanes)
        asked = [i for i, k in enumerate(num_drafts) if k > 0]
        if not asked or self.drafter is None:
            return proposals
        requests = [
            DraftRequest(
                lane_id=lanes[i].lane_id,
                num_drafts=num_drafts[i],
                token_ids=LaneTokens(lanes[i].prompt, lanes[i].output),
                num_prompt_tokens=len(lanes[i].prompt),
                params=lanes[i].params,
                generator=lanes[i].random.generator(self.device),
            )
            for i in asked
        ]
        got = self.drafter.propose(requests)
        if len(got) != len(requests):
            raise DrafterError(
                f"drafter {self.drafter.name!r} returned {len(got)} proposals for {len(requests)} lanes"
            )
        for i, req, prop in zip(asked, requests, got, strict=True):
            self._check_proposal(req, prop)
            proposals[i] = prop
        return proposals

    def _check_proposal(self, req: DraftRequest, prop: DraftProposal) -> None:
        """Shapes and dtypes (no device access). The ids' range is checked where the ids are on the
        host: at once for host drafts, after the forward for device drafts (`ignis.runtime.round_batch`)."""
        name = self.drafter.name if self.drafter is not None else "?"
        ids = prop.draft_token_ids
        if ids.dim() != 1 or ids.numel() > req.num_drafts or ids.dtype not in (torch.int64, torch.int32):
            raise DrafterError(
                f"drafter {name!r}, lane {req.lane_id}: draft_token_ids must be int64 [<= "
                f"{req.num_drafts}], got {ids.dtype} {tuple(ids.shape)}"
            )
        q = prop.draft_probs
        if q is not None and (
            q.dim() != 2
            or q.shape[0] != ids.numel()
            or (self.vocab_size is not None and q.shape[1] != self.vocab_size)
        ):
            raise DrafterError(
                f"drafter {name!r}, lane {req.lane_id}: draft_probs must be [{ids.numel()}, vocab], "
                f"got {tuple(q.shape)}"
            )

    def _check_device_drafts(self, lanes: list[_Lane], host: dict[int, list[int]]) -> None:
        """Device drafts, now on the host, in [0, vocab) (the forward saw them clamped)."""
        v = self.vocab_size
        for i, ids in host.items():
            if v is not None and ids and (min(ids) < 0 or max(ids) >= v):
                name = self.drafter.name if self.drafter is not None else "?"
                raise DrafterError(
                    f"drafter {name!r}, lane {lanes[i].lane_id}: draft ids {ids} outside [0, {v})"
                )

    def _round(self, emitted: dict[int, list[int]]) -> list[_Lane]:
        lanes = list(self._active)
        caps = []
        for lane in lanes:
            left = lane.stops.num_tokens_left
            caps.append(MAX_DRAFT_TOKENS if left is None else left - 1)
        proposals = self._propose(lanes, self.scheduler.plan(caps))
        # One host-to-device copy for every lane's column [anchor, d_1..d_k] (`round_batch`).
        anchor_ids = [lane.output[-1] for lane in lanes]
        batch = RoundColumns.build(
            anchor_ids,
            proposals,
            self.device,
            self.vocab_size,
            lane_ids=[lane.lane_id for lane in lanes],
            drafter_name=self.drafter.name if self.drafter is not None else "?",
        )
        columns = batch.columns
        states = [lane.state for lane in lanes]
        record = any(c.numel() > 1 for c in columns)
        # Grammar masks of constrained lanes, computed on the host while the forward runs.
        masks = None
        if any(lane.grammar is not None for lane in lanes):
            masks = start_round_masks([lane.grammar for lane in lanes], [c[1:] for c in columns])
        out = self.executor.forward(states, columns, logits="all", record=record, **self._fwd_kwargs)
        logits = list(out.logits)
        processing = [i for i, lane in enumerate(lanes) if lane.params.processes_logits]
        if processing or masks is not None:
            # Penalties / min_tokens: row j judged as if d_1..d_j were committed (`logits_processors`).
            for i in processing:
                logits[i] = self._process(lanes[i], logits[i], self._drafts_of(batch, i))
            logits = mask_round_logits(logits, masks)  # penalised rows, with grammar masks applied
        # Sampled lanes: rejection sampling on the device (on the clamped column drafts; the drafts'
        # check below comes before anything is committed). Then every greedy lane's argmax, every
        # device draft and every sampled run reach the host in ONE transfer (no per-lane sync); each
        # greedy run is found on the host (`greedy_accept_ids`).
        greedy, sampled = [], {}
        for i, lane in enumerate(lanes):
            if lane.params.is_greedy:
                greedy.append(i)
            else:
                sampled[i] = self._accept(lane, proposals[i], columns[i][1:], logits[i])
        dev = batch.device_drafts
        targets, host = round_host_ids(
            logits, greedy, [ids for _, ids in dev] + [r.host_tensor() for r in sampled.values()]
        )
        device_host = {i: ids for (i, _), ids in zip(dev, host, strict=False)}
        sampled_runs = dict(zip(sampled, host[len(dev) :], strict=True))
        self._check_device_drafts(lanes, device_host)
        host_drafts = batch.host_drafts
        runs: list[list[int]] = []
        keeps: list[int] = []
        round_stats: list[tuple[int, int, int]] = []  # (drafted, accepted, emitted) per speculative lane
        for i, lane in enumerate(lanes):
            if i in targets:
                d = host_drafts[i]
                run, num_accepted = greedy_accept_ids(device_host[i] if d is None else d, targets[i])
            else:
                run, num_accepted = sampled[i].resolve(sampled_runs[i])
            num_emitted = lane.stops.extend(run)
            if num_emitted < len(run):
                run = run[:num_emitted]
            if lane.grammar is not None:
                lane.grammar.consume(run)
            if lane.params.logprobs is not None:
                self._record_logprobs(lane, out.logits[i], run)
            k = columns[i].numel() - 1
            if k:
                round_stats.append((k, min(num_accepted, num_emitted), num_emitted))
            lane.num_rounds += 1
            runs.append(run)
            keeps.append(num_emitted)
            emitted.setdefault(lane.lane_id, []).extend(run)
        if round_stats:
            self.metrics.record_rounds(round_stats)
        self.executor.commit(states, keeps)
        finished, spans = [], []
        records_replies = self.checkpoints.records_replies
        for i, (lane, run, keep) in enumerate(zip(lanes, runs, keeps, strict=True)):
            if lane.stops.is_finished:
                finished.append(lane)
                self._active.remove(lane)
                if not records_replies or keep == 0:
                    if self.drafter is not None:
                        self.drafter.end_lane(lane.lane_id)
                    continue
            if self.drafter is not None:
                # The committed columns are the anchor and the accepted drafts, i.e. the anchor then
                # the run's first keep - 1 tokens (a run starts with the accepted drafts).
                spans.append(
                    CommittedSpan(
                        lane_id=lane.lane_id,
                        start=lane.num_committed - keep,
                        input_token_ids=(anchor_ids[i], *run[: keep - 1]) if keep else (),
                        next_token_ids=tuple(run),
                        hidden_states=None if out.hidden_states is None else out.hidden_states[i][:keep],
                        taps=None if out.taps is None else out.taps[i][:keep],
                    )
                )
        if spans and self.drafter is not None:
            self.drafter.commit(spans)
        if records_replies:
            self.checkpoints.record_replies(finished)
        return finished

    def _drafts_of(self, batch: RoundColumns, i: int) -> list[int]:
        """Lane i's drafts on the host (a device lane's read from its column: a sync, taken only by
        lanes with penalties)."""
        d = batch.host_drafts[i]
        return batch.columns[i][1:].tolist() if d is None else d

    def _accept(
        self, lane: _Lane, prop: DraftProposal, drafts: torch.Tensor, logits: torch.Tensor
    ) -> PendingAcceptance:
        # A sampled lane (greedy lanes are accepted on the host, batched, in `_round`).
        # drafts: int64 [k] (the column's, on the device); logits: float [k+1, vocab], row i predicts
        # the token after column i.
        drafts = drafts.to(device=logits.device)
        target_probs = logits_to_probs(logits, lane.params)  # [k+1, vocab]
        q = None if prop.draft_probs is None else prop.draft_probs.to(logits.device)  # [k, vocab]
        return rejection_sample_on_device(drafts, target_probs, q, lane.random.generator(logits.device))

    def _release_state(self, lane: _Lane) -> None:
        release = getattr(self.executor, "release_lane", None)
        if lane.state is not None and release is not None:
            release(lane.state)  # executors with pooled lane slots take the slot back now
        lane.state = None

    def _finish(self, lane: _Lane, *, release: bool = True) -> None:
        """The lane's result; its state released unless `release` is False (async rounds: a column in
        flight is committed first)."""
        if release:
            self._release_state(lane)
        s = lane.stops
        assert s.finish_reason is not None
        self._results[lane.lane_id] = LaneResult(
            lane_id=lane.lane_id,
            prompt_token_ids=lane.prompt,
            output_token_ids=tuple(s.output_token_ids),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            text=s.text,
            seed=lane.random.seed,
            num_rounds=lane.num_rounds,
            num_cached_tokens=lane.num_cached,
            logprobs=tuple(lane.logprobs),
        )
