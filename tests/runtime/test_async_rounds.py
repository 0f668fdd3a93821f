"""Async rounds (`ignis.runtime.async_rounds`): the engine with `async_rounds=True` gives the ordinary
engine's results, token for token, over many seeds, lane counts, max_tokens, EOS-terminated lanes,
stop strings, lanes joining and aborted mid-flight, and prompt checkpoints (the reply checkpoint a
finished lane leaves equals the ordinary path's, bit for bit).

Executors: the tiny hybrid's (qwen3_5) static and eager executors, the tiny llama's static and eager
executors, and the tiny qwen3_5_moe's static and eager executors with every expert resident, behind an
expert cache of 1 slot a layer (misses every round) and, static, of 2 slots with router lookahead (and
the tiny qwen3_next's static executor behind a 1-slot cache);
float32 on the CPU (greedy margins wide: hf_tiny*.py redraw the weights). With an expert cache the
async rounds also look up the same experts in the same order as the ordinary rounds (the cache's
routing and prefetch traces and counters equal) whenever their forwards have the same shapes.

Beside them, what `ignis-run` turns on: long prompts prefilled in chunks (`max_prefill_tokens`) while
lanes decode, chat openers shared in flight and a checkpoint pool whose card tier spills to the host
tier with follow-up turns restored from it, lanes with grammars, logprobs or min_tokens (drained), a
lane aborted while another rides its keep-0 column, the warm-up request at load.

GPU tests (`gpu` mark, skipped without CUDA): async and ordinary rounds give equal tokens on CUDA with
the tiny hybrid's and llama's static executors and the MoE kinds above (dense experts, no compiled
kernels); on the served MoE route (q4 experts, the grouped kernels: resident with whole-round graphs,
an expert cache with rounds in pieces, with router lookahead, eager) equal to the resident experts'
ordinary tokens, with equal routing traces; no host sync happens between issuing round N+1 and
reading round N (torch.cuda's sync debug mode) on the dense static executors and the resident MoE
route.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import hf_tiny
import pytest
import torch
from test_moe_grouped import cuda_kernel  # noqa: F401 (the compiled grouped MoE kernels: a fixture)
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.async_rounds import lane_argmax
from ignis.runtime.engine import LaneResult, SpeculativeEngine
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.round_batch import HostKnownColumns, InRangeColumns
from ignis.runtime.sampling import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# the tiny qwen3_5_moe (4 experts, top 2) with every expert resident, behind an expert cache of 1 slot
# a layer (every round misses: 2 experts routed a row, 1 slot), and of 2 slots with router lookahead
# (and the tiny qwen3_next, static, behind a 1-slot cache)
MOE_KINDS = ("static_moe", "eager_moe", "static_moe_cache", "eager_moe_cache", "static_moe_lookahead")
MOE_KINDS += ("static_next_cache",)
KINDS = ("static_hybrid", "eager_hybrid", "static_llama", "eager_llama", *MOE_KINDS)
BIG = 1 << 30

_MODELS: dict[str, object] = {}


def _moe_executor(kind: str, device: str = "cpu", **static):  # type: ignore[no-untyped-def]
    """A tiny qwen3_5_moe executor (qwen3_next for the "_next" kinds; `MOE_KINDS`): static
    (`StaticHybridExecutor`: with a cache, rounds split at the MoE layers' host parts, `moe_piecewise`)
    or eager (`HybridExecutor`); resident experts, an expert cache of 1 slot a layer, or 2 slots with
    router lookahead. Each call makes a new cache. `static`: more options of the static executor."""
    from hf_tiny_hybrid import make_tiny_hybrid

    from ignis.runtime.expert_cache import ExpertCache
    from ignis.runtime.families.hybrid_executor import HybridExecutor
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    family = "qwen3_next" if "_next" in kind else "qwen3_5_moe"
    if family not in _MODELS:
        tiny = make_tiny_hybrid(family, Path(tempfile.mkdtemp()) / "m")
        _MODELS[family] = (tiny.config, tiny.canonical_tensors())
    config, tensors = _MODELS[family]  # type: ignore[misc]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kw: dict = {"device": device, "dtype": dtype}
    if kind.endswith("_cache"):
        kw["expert_cache"] = ExpertCache(1, device=device)
    elif kind.endswith("_lookahead"):
        copies = "memmove" if device == "cpu" else "auto"
        kw["expert_cache"] = ExpertCache(2, device=device, copies=copies, lookahead=True)
    if kind.startswith("eager"):
        return HybridExecutor(config, tensors, **kw)
    return StaticHybridExecutor(config, tensors, max_lanes=8, max_columns=8, max_context=256, **kw, **static)


def _executor(kind: str, device: str = "cpu", **static):  # type: ignore[no-untyped-def]
    """An executor of `kind` (`KINDS`) on `device`; `static`: more options of a static executor."""
    if "_moe" in kind or "_next" in kind:
        return _moe_executor(kind, device, **static)
    if kind.endswith("hybrid"):
        from hf_tiny_hybrid import make_tiny_hybrid

        from ignis.runtime.families.hybrid_executor import HybridExecutor
        from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

        if "hybrid" not in _MODELS:
            tiny = make_tiny_hybrid("qwen3_5", Path(tempfile.mkdtemp()) / "m")
            _MODELS["hybrid"] = (tiny.config, tiny.tensors)
        config, tensors = _MODELS["hybrid"]  # type: ignore[misc]
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        if kind == "eager_hybrid":
            return HybridExecutor(config, tensors, device=device, dtype=dtype)
        return StaticHybridExecutor(
            config, tensors, device=device, dtype=dtype, max_lanes=8, max_columns=8, max_context=256, **static
        )
    from ignis.compiler.importers import load_checkpoint
    from ignis.runtime.families.llama import LlamaExecutor
    from ignis.runtime.families.llama_graphs import StaticLlamaExecutor

    if "llama" not in _MODELS:
        folder = hf_tiny.save_tiny(hf_tiny.tiny_model("llama", seed=0), Path(tempfile.mkdtemp()) / "ckpt")
        ckpt = load_checkpoint(folder)
        _MODELS["llama"] = (ckpt.config, ckpt.tensors.load_all())
    config, weights = _MODELS["llama"]  # type: ignore[misc]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if kind == "eager_llama":
        return LlamaExecutor(config, weights, device=device, dtype=dtype)
    return StaticLlamaExecutor(
        config, weights, device=device, dtype=dtype, max_lanes=8, max_context=200, kv_bucket=16, **static
    )


def _mid_output_eos(ex, plan, rng: random.Random) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    """An EOS for `plan` on `ex` that makes lanes stop mid-output: one of the tokens (neither the first
    nor the last of a lane) the ordinary engine outputs, drawn with `rng`; () when there is none."""
    base, _, _ = _run(ex, plan, async_rounds=False)
    outs = [t for r in base.values() for t in r.output_token_ids[1:-1]]
    return (rng.choice(outs),) if outs else ()


def _text(ids) -> str:  # type: ignore[no-untyped-def]
    return "".join(chr(97 + t % 26) for t in ids)


def _run(ex, plan, *, async_rounds: bool, eos=(), cache=None, max_lanes=None, max_context=None, **engine):  # type: ignore[no-untyped-def]
    """Drive an engine through `plan`: {step index: [("add", key, prompt, params[, checkpoint_at]) |
    ("abort", key)]}; `engine`: more `SpeculativeEngine` options. Returns (results by key, tokens from
    the updates by key, the engine)."""
    eng = SpeculativeEngine(
        ex,
        None,
        eos_token_ids=eos,
        detokenize=_text,
        async_rounds=async_rounds,
        prefix_cache=cache,
        max_lanes=max_lanes,
        max_context=max_context,
        **engine,
    )
    ids: dict[str, int] = {}
    streamed: dict[str, list[int]] = {}
    results: dict[str, LaneResult] = {}
    step = 0
    last = max(plan) if plan else 0
    while step <= last or eng.has_unfinished:
        for op in plan.get(step, []):
            if op[0] == "add":
                ids[op[1]] = eng.add_lane(op[2], op[3], checkpoint_at=op[4] if len(op) > 4 else ())
                streamed[op[1]] = []
            else:
                eng.abort(ids[op[1]])
        by_id = {v: k for k, v in ids.items()}
        for u in eng.step():
            key = by_id[u.lane_id]
            assert key not in results, f"lane {key}: an update after its last one"
            streamed[key].extend(u.new_token_ids)
            if u.is_finished:
                results[key] = eng.result(u.lane_id)  # type: ignore[assignment]
        for key, i in ids.items():  # aborted lanes: their result is there at once
            r = eng.result(i)
            if r is not None and key not in results and r.finish_reason == "abort":
                results[key] = r
        step += 1
        assert step < 500
    assert not eng.has_unfinished
    return results, streamed, eng


def _random_plan(rng: random.Random, vocab: int, num_lanes: int, stop: str | None = None):  # type: ignore[no-untyped-def]
    plan: dict[int, list] = {}
    for j in range(num_lanes):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 14), stop=[stop] if stop else ())
        plan.setdefault(rng.choice([0, 0, 1, 3, 5]), []).append(("add", f"l{j}", prompt, params))
    return plan


def _same(a: dict[str, LaneResult], b: dict[str, LaneResult]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert (x.output_token_ids, x.finish_reason, x.stop_reason, x.text, x.num_rounds) == (
            y.output_token_ids,
            y.finish_reason,
            y.stop_reason,
            y.text,
            y.num_rounds,
        ), key


@pytest.mark.parametrize("kind", KINDS)
def test_async_rounds_equal_ordinary_rounds(kind: str) -> None:
    """Many seeds: lanes of random prompts and max_tokens joining at different steps, one of the
    ordinary run's mid-output tokens made an EOS so that lanes stop on it; results and streamed tokens
    equal."""
    ex = _executor(kind)
    vocab = ex.config.vocab_size
    num_eos = num_issued = num_drained = 0
    for seed in range(6):
        rng = random.Random(seed)
        plan = _random_plan(rng, vocab, rng.randint(1, 5))
        eos = _mid_output_eos(ex, plan, rng)
        want, want_streamed, _ = _run(ex, plan, async_rounds=False, eos=eos)
        got, got_streamed, eng = _run(ex, plan, async_rounds=True, eos=eos)
        _same(want, got)
        assert got_streamed == want_streamed == {k: list(r.output_token_ids) for k, r in got.items()}
        num_eos += sum(r.finish_reason == "stop" for r in got.values())
        num_issued += eng._async.num_issued
        num_drained += eng._async.num_drained
        free = getattr(eng.executor, "num_free_lanes", None)
        if free is not None:
            assert free == eng.executor.max_lanes  # every slot back
    assert num_eos >= 4  # lanes stopped by the EOS (riding one more forward with async rounds)
    assert num_issued > 3 * num_drained  # most rounds ran ahead of the host's read


def test_one_lane_runs_every_round_ahead() -> None:
    """One lane, speculation off: after the prefill step every round is issued before the previous
    one is read (none drained), updates come one step later, the result is the ordinary one."""
    ex = _executor("static_hybrid")
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want, _, _ = _run(ex, {0: [("add", "a", [3, 1, 4, 1, 5], p)]}, async_rounds=False)
    eng = SpeculativeEngine(ex, None, async_rounds=True)
    lane = eng.add_lane([3, 1, 4, 1, 5], p)
    per_step = [[u.new_token_ids for u in eng.step()] for _ in range(3)]
    out = want["a"].output_token_ids
    assert per_step == [[out[:1]], [out[1:2]], [out[2:3]]]  # the prefill's token, then one a step
    while eng.has_unfinished:
        eng.step()
    assert eng.result(lane).output_token_ids == want["a"].output_token_ids  # type: ignore[union-attr]
    assert eng._async.num_issued == 9 and eng._async.num_drained == 0  # 10 tokens: 1 prefill + 9 rounds


def test_async_rounds_with_a_drafter_are_off_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from ignis.runtime.drafters.ngram import NgramDrafter

    with caplog.at_level("WARNING", logger="ignis.runtime.async_rounds"):
        eng = SpeculativeEngine(_executor("eager_llama"), NgramDrafter(), draft_tokens=3, async_rounds=True)
    assert eng._async is None and "speculation off only" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_async_rounds_with_aborts_and_prompt_checkpoints(kind: str) -> None:
    """Many seeds with prompt checkpoints on and one lane aborted a few steps after it joined: every
    other lane's result equals the ordinary engine's, the same reply checkpoints are recorded (the
    same token sequences), and the aborted lane's result holds exactly the tokens streamed to it, a
    prefix of what it would have produced."""
    ex = _executor(kind)
    vocab = ex.config.vocab_size
    num_aborted = 0
    for seed in range(8):
        rng = random.Random(100 + seed)
        plan = _random_plan(rng, vocab, rng.randint(2, 5))
        eos = _mid_output_eos(ex, plan, rng)
        full, _, _ = _run(ex, plan, async_rounds=False, eos=eos)
        joins = {op[1]: step for step, ops in plan.items() for op in ops}
        victim = rng.choice(sorted(joins))
        with_abort = {k: list(v) for k, v in plan.items()}
        with_abort.setdefault(joins[victim] + rng.randint(1, 3), []).append(("abort", victim))
        caches = [PrefixCache(card_bytes=BIG, host_bytes=BIG) for _ in range(2)]
        want, _, _ = _run(ex, with_abort, async_rounds=False, eos=eos, cache=caches[0])
        got, streamed, eng = _run(ex, with_abort, async_rounds=True, eos=eos, cache=caches[1])
        others = [k for k in full if k != victim]
        _same({k: want[k] for k in others}, {k: got[k] for k in others})
        _same({k: full[k] for k in others}, {k: got[k] for k in others})
        r = got[victim]
        assert list(r.output_token_ids) == streamed[victim]
        assert r.output_token_ids == full[victim].output_token_ids[: len(r.output_token_ids)]
        if r.finish_reason == "abort":
            num_aborted += 1
        else:
            _same({victim: full[victim]}, {victim: r})
        # the victim may finish before its abort in one run and not in the other (updates a step later)
        vp = tuple(next(op[2] for ops in plan.values() for op in ops if op[1] == victim))
        kept = [
            {c.token_ids for c in cache.entries("card") if c.kind != "reply" or c.token_ids[: len(vp)] != vp}
            for cache in caches
        ]
        assert kept[0] == kept[1] and kept[0]
        if hasattr(eng.executor, "num_free_lanes"):
            assert eng.executor.num_free_lanes == eng.executor.max_lanes
    assert num_aborted >= 3


@pytest.mark.parametrize("kind", KINDS)
def test_async_rounds_stop_strings_and_context_end(kind: str) -> None:
    """Stop strings (the text cut before them) and lanes ending at max_tokens past the context."""
    ex = _executor(kind)
    rng = random.Random(7)
    plan = _random_plan(rng, ex.config.vocab_size, 4)
    base, _, _ = _run(ex, plan, async_rounds=False)
    text = _text(max(base.values(), key=lambda r: len(r.output_token_ids)).output_token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    plan = _random_plan(random.Random(7), ex.config.vocab_size, 4, stop=stop)
    want, _, _ = _run(ex, plan, async_rounds=False)
    got, streamed, _ = _run(ex, plan, async_rounds=True)
    _same(want, got)
    assert any(r.stop_reason == stop for r in got.values())
    assert streamed == {k: list(r.output_token_ids) for k, r in got.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_async_rounds_abort_mid_flight(kind: str) -> None:
    """A lane aborted while its column is in flight: its result holds the tokens streamed so far (a
    prefix of its unaborted output), its slot comes back, and the other lanes are unaffected."""
    ex = _executor(kind)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plan = {0: [("add", "a", [5, 6, 7], params), ("add", "b", [9, 10], params)], 4: [("abort", "a")]}
    full, _, _ = _run(ex, {0: plan[0]}, async_rounds=False)
    got, streamed, eng = _run(ex, plan, async_rounds=True)
    assert got["a"].finish_reason == "abort"
    assert list(got["a"].output_token_ids) == streamed["a"]
    n = len(got["a"].output_token_ids)
    assert 0 < n < 12 and got["a"].output_token_ids == full["a"].output_token_ids[:n]
    assert got["b"].output_token_ids == full["b"].output_token_ids
    # every lane of the round in flight aborted: settled at once
    solo, _, eng = _run(ex, {0: [("add", "a", [5, 6, 7], params)], 3: [("abort", "a")]}, async_rounds=True)
    assert solo["a"].finish_reason == "abort"
    if hasattr(eng.executor, "num_free_lanes"):
        assert eng.executor.num_free_lanes == eng.executor.max_lanes


def _ordinary_and_async_with_caches(ex, plan, eos):  # type: ignore[no-untyped-def]
    """`plan` run ordinary then async, each with a prompt-checkpoint cache of its own: (the two caches,
    the two result dicts), the results checked equal (`_same`)."""
    caches, results = [], []
    for flag in (False, True):
        cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
        res, _, _ = _run(ex, plan, async_rounds=flag, eos=eos, cache=cache)
        caches.append(cache)
        results.append(res)
    _same(results[0], results[1])
    return caches, results


def _replies(cache: PrefixCache) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    return {c.token_ids: c.model for c in cache.entries("card") if c.kind == "reply"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["one_lane_eos", "lanes_by_length"])
def test_async_rounds_reply_checkpoints_bit_equal(kind: str, case: str) -> None:
    """The state a finished lane leaves in the prompt checkpoint pool equals the ordinary path's bit for
    bit (forwards of the same shapes: one lane stopped by EOS; lanes ending by max_tokens, which async
    rounds leave out of the next round as the ordinary path does), and follow-up turns served from it
    give equal tokens."""
    ex = _executor(kind)
    if case == "one_lane_eos":
        p = SamplingParams(temperature=0, max_tokens=16)
        base, _, _ = _run(ex, {0: [("add", "a", [4, 8, 15, 16], p)]}, async_rounds=False)
        eos = (base["a"].output_token_ids[6],)
        plan = {0: [("add", "a", [4, 8, 15, 16], p)]}
    else:
        eos = ()
        plan = {
            0: [
                ("add", "a", [4, 8, 15, 16], SamplingParams(temperature=0, max_tokens=6)),
                ("add", "b", [23, 42], SamplingParams(temperature=0, max_tokens=9)),
            ]
        }
    caches, results = _ordinary_and_async_with_caches(ex, plan, eos)
    want, got = _replies(caches[0]), _replies(caches[1])
    assert want and want.keys() == got.keys()
    for tokens in want:
        assert want[tokens].keys() == got[tokens].keys()
        for name in want[tokens]:
            assert torch.equal(want[tokens][name], got[tokens][name]), (tokens, name)
    # a follow-up turn restores the reply checkpoint on both engines
    r = results[0]["a"]
    follow = [*r.prompt_token_ids, *r.output_token_ids, 7, 9]
    outs = []
    for flag, cache in zip((False, True), caches, strict=True):
        p = SamplingParams(temperature=0, max_tokens=5)
        res, _, _ = _run(ex, {0: [("add", "f", follow, p)]}, async_rounds=flag, eos=eos, cache=cache)
        assert res["f"].num_cached_tokens > len(r.prompt_token_ids)
        outs.append(res["f"].output_token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", KINDS)
def test_async_rounds_reply_checkpoints_after_an_eos_beside_another_lane(kind: str) -> None:
    """Two lanes, one stopped by EOS while the other goes on: the stopped lane's reply checkpoint is
    bit-equal to the ordinary path's; the other lane ran one round beside the stopped lane's keep-0
    column (2 lanes where the ordinary path ran 1: a differently shaped batch, module docstring of
    `ignis.runtime.async_rounds`), so its state equals the ordinary one up to float32 rounding, and its
    tokens exactly."""
    ex = _executor(kind)
    p = SamplingParams(temperature=0, max_tokens=14)
    plan = {0: [("add", "a", [4, 8, 15, 16], p), ("add", "b", [23, 42, 7], p)]}
    base, _, _ = _run(ex, plan, async_rounds=False)
    eos = (base["a"].output_token_ids[4],)
    caches, results = _ordinary_and_async_with_caches(ex, plan, eos)
    assert results[1]["a"].finish_reason == "stop" and results[1]["b"].finish_reason == "length"
    want, got = _replies(caches[0]), _replies(caches[1])
    assert want.keys() == got.keys() and len(want) == 2
    a_tokens = (*results[0]["a"].prompt_token_ids, *results[0]["a"].output_token_ids[:-1])
    for tokens in want:
        for name in want[tokens]:
            if tokens == a_tokens:
                assert torch.equal(want[tokens][name], got[tokens][name]), name
            else:
                torch.testing.assert_close(got[tokens][name], want[tokens][name], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_async_rounds_at_the_context_end(kind: str) -> None:
    """Lanes without max_tokens end at the context limit ("length"), staggered by prompt length: each
    is left out of the round after its last token, as the ordinary path leaves it; no forward passes
    the limit."""
    ex = _executor(kind)
    p = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    plan = {0: [("add", f"l{j}", list(range(5, 5 + 3 + 2 * j)), p) for j in range(3)]}
    want, _, _ = _run(ex, plan, async_rounds=False, max_context=20)
    got, _, _ = _run(ex, plan, async_rounds=True, max_context=20)
    _same(want, got)
    assert all(
        r.finish_reason == "length" and len(r.prompt_token_ids) + len(r.output_token_ids) == 20
        for r in got.values()
    )


CACHED_MOE_KINDS = ("static_moe_cache", "eager_moe_cache", "static_moe_lookahead", "static_next_cache")


def _cache_run(make, plan, eos=()):  # type: ignore[no-untyped-def]
    """`plan` run ordinary then async, each on a new executor from `make()` (a new expert cache, its
    routing trace recorded): [(results, (trace, prefetch trace), counters, the cache)] for the two runs."""
    runs = []
    for flag in (False, True):
        ex = make()
        st = ex.expert_cache.stats
        st.trace = []
        res, streamed, eng = _run(ex, plan, async_rounds=flag, eos=eos)
        assert streamed == {k: list(r.output_token_ids) for k, r in res.items()}
        if hasattr(ex, "num_free_lanes"):
            assert ex.num_free_lanes == ex.max_lanes
        if flag:
            assert eng._async.num_issued > eng._async.num_drained
        counts = (st.hits, st.misses, st.bytes_copied, st.forwards, st.rows, st.prefetches,
                  st.lookahead_right, st.lookahead_needed)  # fmt: skip
        runs.append((res, (list(st.trace), list(st.prefetch_trace)), counts, ex.expert_cache))
    return runs


@pytest.mark.parametrize("kind", CACHED_MOE_KINDS)
def test_async_rounds_route_the_same_experts_through_the_cache(kind: str) -> None:
    """An expert cache smaller than the experts (misses every round; with router lookahead, prefetches):
    async rounds look up the same experts in the same order as the ordinary rounds (the cache's routing
    trace, prefetch trace, hits, misses, bytes and rows equal) when their forwards have the same shapes
    (lanes ending by length, joining at different steps); the tokens equal the resident experts'
    ordinary rounds. A lane stopped by EOS rides one more forward (keep 0): the ordinary trace is then a
    prefix of the async one, one forward of one row shorter."""
    resident = _executor(kind.rsplit("_", 1)[0])  # every expert on the device
    rng = random.Random(5)
    vocab = resident.config.vocab_size
    plan: dict[int, list] = {}
    for j, step in enumerate((0, 0, 2, 5)):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 10))]
        params = SamplingParams(temperature=0, max_tokens=4 + 3 * j, ignore_eos=True)
        plan.setdefault(step, []).append(("add", f"l{j}", prompt, params))
    want, _, _ = _run(resident, plan, async_rounds=False)
    (ordinary, otrace, ocounts, _), (got, gtrace, gcounts, cache) = _cache_run(lambda: _executor(kind), plan)
    _same(want, ordinary)
    _same(want, got)
    assert gtrace == otrace and gcounts == ocounts
    num_moe = len(cache.layers)
    assert cache.stats.misses > 3 * num_moe * resident.config.num_experts  # evictions and refills
    assert (cache.stats.prefetches > 0) == kind.endswith("lookahead")
    # one lane stopped by EOS: the async run's last forward is its keep-0 ride
    p = SamplingParams(temperature=0, max_tokens=16)
    solo = {0: [("add", "a", [4, 8, 15, 16, 23], p)]}
    base, _, _ = _run(resident, solo, async_rounds=False)
    eos = (base["a"].output_token_ids[6],)
    want, _, _ = _run(resident, solo, async_rounds=False, eos=eos)
    (ordinary, otrace, ocounts, _), (got, gtrace, gcounts, _) = _cache_run(lambda: _executor(kind), solo, eos)
    _same(want, ordinary)
    _same(want, got)
    assert got["a"].finish_reason == "stop"
    (ot, op), (gt, gp) = otrace, gtrace
    assert (
        gt[: len(ot)] == ot
        and len(gt) > len(ot)
        and {layer for layer, _ in gt[len(ot) :]} == set(range(num_moe))
    )
    assert gp[: len(op)] == op
    assert gcounts[3:5] == (ocounts[3] + 1, ocounts[4] + 1)  # forwards, rows: one forward of one row more


def test_out_of_scope_lanes_run_the_ordinary_round() -> None:
    """A sampled lane or one with penalties beside greedy lanes: the round in flight is drained and the
    step runs the ordinary round (seeded sampling reproduces; the greedy lane's tokens unchanged)."""
    ex = _executor("static_hybrid")
    g = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    s = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    pen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    plan = {0: [("add", "g", [3, 4, 5], g)], 3: [("add", "s", [6, 7], s)], 5: [("add", "p", [8, 9], pen)]}
    want, _, _ = _run(ex, plan, async_rounds=False)
    got, _, _ = _run(ex, plan, async_rounds=True)
    _same(want, got)


@pytest.mark.parametrize("kind", ["static_hybrid", "static_moe_cache"])
def test_max_lanes_and_waiting_lanes(kind: str) -> None:
    """With max_lanes 2 and five lanes, lanes wait for finishing ones; async rounds drain before each
    admission (slots freed first) and the results equal the ordinary path's."""
    ex = _executor(kind)
    rng = random.Random(11)
    vocab = ex.config.vocab_size
    lanes = [
        ("add", f"l{j}", [rng.randrange(3, vocab) for _ in range(4)], SamplingParams(0, max_tokens=j + 2))
        for j in range(5)
    ]
    plan = {0: lanes}
    want, _, _ = _run(ex, plan, async_rounds=False, max_lanes=2)
    got, _, _ = _run(ex, plan, async_rounds=True, max_lanes=2)
    _same(want, got)


# ---------------------------------------------------------------- what ignis-run turns on beside them


def _drained_and_ahead(eng) -> None:  # type: ignore[no-untyped-def]
    """The async run both drained rounds (steps with prefill or out-of-scope work) and ran ahead."""
    assert eng._async.num_drained > 0 and eng._async.num_issued > eng._async.num_drained


@pytest.mark.parametrize("kind", ["static_hybrid", "static_llama", "eager_llama", "static_moe_cache"])
@pytest.mark.parametrize("budget", [5, 16, 0])
def test_async_rounds_beside_long_prompts_prefilled_in_chunks(kind: str, budget: int) -> None:
    """`max_prefill_tokens` (`ignis-run --max-prefill-tokens`) well under the prompts: long prompts
    joining while other lanes decode are prefilled chunk after chunk over several steps (each such step
    drains the round in flight and runs the ordinary round beside the chunk), then every lane runs
    ahead again; an EOS hit mid-output. The static executors prefill in static rounds of 8 columns
    (`chunked_prefill`, on by default on CUDA); budget 0: every prompt whole in one step. Results and
    streamed tokens equal the ordinary path's with the same budget."""
    ex = _executor(kind, chunked_prefill=48) if kind.startswith("static") else _executor(kind)
    rng = random.Random(21)
    vocab = ex.config.vocab_size
    plan: dict[int, list] = {}
    for j, (step, length) in enumerate(((0, 3), (0, 9), (2, 40), (3, 70), (6, 5), (7, 33))):
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(8, 16))
        plan.setdefault(step, []).append(("add", f"l{j}", prompt, params))
    base, _, _ = _run(ex, plan, async_rounds=False, max_prefill_tokens=budget)
    eos = (base["l0"].output_token_ids[5],)
    want, want_streamed, _ = _run(ex, plan, async_rounds=False, eos=eos, max_prefill_tokens=budget)
    got, streamed, eng = _run(ex, plan, async_rounds=True, eos=eos, max_prefill_tokens=budget)
    _same(want, got)
    assert streamed == want_streamed
    assert any(r.finish_reason == "stop" for r in got.values())
    _drained_and_ahead(eng)
    if hasattr(ex, "num_free_lanes"):
        assert ex.num_free_lanes == ex.max_lanes


def _pool_view(cache: PrefixCache):  # type: ignore[no-untyped-def]
    """What a pool holds and did: per tier the (kind, token ids) of its entries; the counters."""
    m = cache.metrics
    held = {tier: sorted((c.kind, c.token_ids) for c in cache.entries(tier)) for tier in ("card", "host")}
    counters = (
        m.lookups_total,
        dict(m.hits_total),
        m.reused_tokens_total,
        dict(m.recorded_total),
        dict(m.evictions_total),
        dict(m.copied_bytes_total),
    )
    return held, counters


@pytest.mark.parametrize("kind", ["static_hybrid", "static_llama", "static_moe_cache"])
def test_async_rounds_with_openers_and_the_host_tier(kind: str) -> None:
    """The prompt-checkpoint pool as `ignis-run` runs it (a card tier and a host tier): conversations
    sharing a system prompt (`checkpoint_at` its end: the opener recorded once while the lanes arriving
    meanwhile wait for it, the hybrids' conv and Gated DeltaNet state snapshots with it), a card tier
    holding about one checkpoint so the others move to the host tier, then follow-up turns restored
    from the host tier (reply checkpoints, one a lane stopped by EOS beside others) while other lanes
    decode. Results, restored prefix lengths, the entries of each tier and the pool's counters equal
    the ordinary path's."""
    ex = _executor(kind)
    rng = random.Random(31)
    vocab = ex.config.vocab_size
    opener = [rng.randrange(3, vocab) for _ in range(24)]
    at = (len(opener),)
    p = SamplingParams(temperature=0, max_tokens=9)
    first: dict[int, list] = {}
    for j, step in enumerate((0, 0, 1, 3)):
        prompt = [*opener, *(rng.randrange(3, vocab) for _ in range(rng.randint(2, 6)))]
        first.setdefault(step, []).append(("add", f"c{j}", prompt, p, at))
    pilot = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    base, _, _ = _run(ex, first, async_rounds=False, cache=pilot)
    eos = (base["c1"].output_token_ids[3],)
    card = int(1.5 * max(c.nbytes for c in pilot.entries("card")))
    views, outs = [], []
    for flag in (False, True):
        cache = PrefixCache(card_bytes=card, host_bytes=BIG)
        res, _, eng = _run(ex, first, async_rounds=flag, eos=eos, cache=cache)
        follow: dict[int, list] = {}
        for j, (key, step) in enumerate((("c0", 0), ("c1", 0), ("c2", 2), ("c3", 3))):
            r = res[key]
            prompt = [*r.prompt_token_ids, *r.output_token_ids, 7 + j, 9]
            follow.setdefault(step, []).append(("add", f"f{j}", prompt, p, at))
        more, _, eng2 = _run(ex, follow, async_rounds=flag, eos=eos, cache=cache)
        outs.append((res, more))
        views.append(_pool_view(cache))
        if flag:
            _drained_and_ahead(eng)
            _drained_and_ahead(eng2)
    _same(outs[0][0], outs[1][0])
    _same(outs[0][1], outs[1][1])
    assert [r.num_cached_tokens for r in outs[0][1].values()] == [
        r.num_cached_tokens for r in outs[1][1].values()
    ]
    assert views[0] == views[1]
    held, counters = views[1]
    assert held["host"] and counters[1].get("host", 0) > 0  # follow-ups restored from the host tier
    assert any(r.finish_reason == "stop" for r in outs[1][0].values())
    # the opener was recorded once and shared: lanes 1-3 restored it instead of prefilling it
    assert all(r.num_cached_tokens >= len(opener) for k, r in outs[1][0].items() if k != "c0")


def _tiny_grammar():  # type: ignore[no-untyped-def]
    """A regex grammar over the tiny tokenizer of the hybrids' vocabulary (EOS 2)."""
    pytest.importorskip("llguidance")
    from hf_tiny import tiny_tokenizer

    from ignis.runtime.grammar import Grammar, GrammarTokenizer

    tok = tiny_tokenizer(320)
    return Grammar.regex(GrammarTokenizer(tok.backend_tokenizer.to_str(), 320, [2]), "[a-z]{2,6}")


@pytest.mark.parametrize("kind", ["static_hybrid", "static_moe_cache"])
def test_lanes_with_logits_work_drain_the_round_in_flight(kind: str) -> None:
    """Lanes the host must see each round's logits for, joining and leaving greedy lanes that run ahead:
    structured output (a grammar), logprobs, min_tokens with stop_token_ids. The round in flight is
    drained while they decode and the greedy lanes run ahead again once they are gone; every result,
    and every logprob, equals the ordinary path's."""
    grammar = _tiny_grammar()
    ex = _executor(kind)
    g = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plan = {
        0: [("add", "g", [3, 4, 5], g), ("add", "h", [7, 8, 9, 10], g)],
        2: [("add", "grammar", [6, 7], SamplingParams(temperature=0, max_tokens=8, grammar=grammar))],
        4: [("add", "logprobs", [8, 9], SamplingParams(temperature=0, max_tokens=4, logprobs=2))],
        14: [("add", "min", [11, 12], SamplingParams(temperature=0, max_tokens=5, min_tokens=3))],
    }
    base, _, _ = _run(ex, plan, async_rounds=False, eos=(2,))
    stop = base["min"].output_token_ids[1]  # masked by min_tokens at first, a stop after
    plan[14] = [
        ("add", "min", [11, 12], SamplingParams(0, max_tokens=5, min_tokens=3, stop_token_ids=(stop,)))
    ]
    want, _, _ = _run(ex, plan, async_rounds=False, eos=(2,))
    got, streamed, eng = _run(ex, plan, async_rounds=True, eos=(2,))
    _same(want, got)
    assert streamed == {k: list(r.output_token_ids) for k, r in got.items()}
    assert got["logprobs"].logprobs == want["logprobs"].logprobs and len(got["logprobs"].logprobs) == 4
    assert grammar.matcher().consume(list(got["grammar"].output_token_ids))  # within the grammar
    _drained_and_ahead(eng)


def test_warm_up_at_load_leaves_no_round_in_flight() -> None:
    """`warm_up_engine` (the server's load on CUDA) through an engine with async rounds: it returns with
    nothing in flight, the counters and the pool as they were, and the first request equals the
    ordinary engine's."""
    from ignis.runtime.server.warmup import warm_up_engine

    ex = _executor("static_moe_cache")
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    eng = SpeculativeEngine(ex, None, async_rounds=True, prefix_cache=cache)
    warm_up_engine(eng)
    assert not eng.has_unfinished and eng.async_rounds.num_issued > 0
    assert eng.metrics.rounds_total == 0 and cache.num_entries("card") == 0
    p = SamplingParams(temperature=0, max_tokens=8)
    want = SpeculativeEngine(ex, None).generate([[5, 6, 7]], p)
    assert [r.output_token_ids for r in eng.generate([[5, 6, 7]], p)] == [r.output_token_ids for r in want]
    assert ex.num_free_lanes == ex.max_lanes


@pytest.mark.parametrize("kind", ["static_hybrid", "eager_llama", "static_moe_cache"])
def test_the_last_lane_aborted_beside_a_lane_riding_its_keep_0_column(kind: str) -> None:
    """A lane stopped by EOS rides the round in flight (keep 0) beside a lane still decoding, and that
    lane is aborted before the next step (a client gone; every request cut at a server's shutdown):
    the round is settled at once, the stopped lane's reply checkpoint is recorded (its prompt and
    output but the last token: what the ordinary path records), every slot comes back, nothing is
    left in flight."""
    ex = _executor(kind)
    p = SamplingParams(temperature=0, max_tokens=14)
    lanes = [("a", [4, 8, 15, 16]), ("b", [23, 42, 7])]
    base, _, _ = _run(ex, {0: [("add", k, q, p) for k, q in lanes]}, async_rounds=False)
    eos = (base["a"].output_token_ids[4],)
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    eng = SpeculativeEngine(ex, None, eos_token_ids=eos, async_rounds=True, prefix_cache=cache)
    ids = {k: eng.add_lane(q, p) for k, q in lanes}
    done: dict[int, object] = {}
    while ids["a"] not in done:
        for u in eng.step():
            if u.is_finished:
                done[u.lane_id] = u
    assert ids["b"] not in done and eng.async_rounds.is_busy and eng.async_rounds.holds(eng._active[0])
    eng.abort(ids["b"])
    assert not eng.has_unfinished and not eng.async_rounds.is_busy
    a, b = eng.result(ids["a"]), eng.result(ids["b"])
    assert a.output_token_ids == base["a"].output_token_ids[:5] and a.finish_reason == "stop"
    assert (
        b.finish_reason == "abort"
        and b.output_token_ids == base["b"].output_token_ids[: len(b.output_token_ids)]
    )
    replies = {c.token_ids for c in cache.entries("card") if c.kind == "reply"}
    assert replies == {(*a.prompt_token_ids, *a.output_token_ids[:-1])}
    if hasattr(ex, "num_free_lanes"):
        assert ex.num_free_lanes == ex.max_lanes


def test_lane_argmax_one_buffer_equals_per_lane() -> None:
    buf = torch.randn(4, 3, 50)
    lanes = [buf[i, :1] for i in range(4)]  # the static executors' per-lane views of one buffer
    got = lane_argmax(lanes)
    assert got.tolist() == [int(t[-1].argmax()) for t in lanes] and got.dtype == torch.int64
    loose = [torch.randn(2, 50), torch.randn(1, 50)]
    assert lane_argmax(loose).tolist() == [int(t[-1].argmax()) for t in loose]


@pytest.mark.parametrize("kind", ["static_hybrid", "static_llama"])
def test_static_executors_keep_the_columns_marker(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The static executors' `forward` hands the checks the engine's column list as it is (a copy into
    a plain list would drop `InRangeColumns` / `HostKnownColumns` and read the device): the hybrid's
    `host_columns` sees the marker; the llama's checks return in-range columns as they are (no host
    copy: `_host_ids` is not called) and read `HostKnownColumns`' carried values."""
    import ignis.runtime.families.hybrid_graphs as hg
    import ignis.runtime.families.llama_graphs as lg

    name = "host_columns" if kind == "static_hybrid" else "_host_ids"
    mod = hg if kind == "static_hybrid" else lg
    seen = []
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda cols: seen.append(type(cols)) or real(cols))
    ex = _executor(kind)
    st = ex.new_lane()
    col = torch.tensor([3])
    ex.forward([st], InRangeColumns([col]), logits="all", record=False)
    ex.commit([st], [1])
    ex.forward([st], HostKnownColumns([torch.tensor([9])], [[4]]), logits="all", record=False)
    ex.commit([st], [1])
    if kind == "static_hybrid":
        assert seen == [InRangeColumns, HostKnownColumns]
    else:
        assert seen == [HostKnownColumns]  # in-range columns: no host copy at all
        st2 = ex.new_lane()
        host, flat = ex._check_forward([st2], InRangeColumns([col]), "all", ())
        assert host[0] is col and flat is None  # a CUDA column would stay on the device
        ex.release_lane(st2)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["static_hybrid", "static_llama", *MOE_KINDS])
def test_async_rounds_equal_ordinary_rounds_on_cuda(kind: str) -> None:
    """bf16 on CUDA; the MoE kinds here run dense experts without the compiled kernels (the reference
    expert loop, syncing the host per MoE layer; the cache's per-expert slots)."""
    ex = _executor(kind, "cuda")
    for seed in range(3):
        rng = random.Random(seed)
        plan = _random_plan(rng, ex.config.vocab_size, rng.randint(1, 5))
        eos = _mid_output_eos(ex, plan, rng)
        want, _, _ = _run(ex, plan, async_rounds=False, eos=eos)
        got, _, _ = _run(ex, plan, async_rounds=True, eos=eos)
        _same(want, got)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["static_hybrid", "static_llama"])
def test_async_rounds_no_host_sync_between_issue_and_read(kind: str) -> None:
    """From the start of a pipelined step to the wait on round N's event, nothing syncs the host: the
    commit of N, the launch of N+1 from N's device argmax, its argmax and copy."""
    _assert_no_sync_between_issue_and_read(_executor(kind, "cuda"))


def _assert_no_sync_between_issue_and_read(ex) -> None:  # type: ignore[no-untyped-def]
    import ignis.runtime.async_rounds as ar

    ex.warm_up(context=64)  # every round shape captured first, as at a server's load (a capture syncs)
    eng = SpeculativeEngine(ex, None, async_rounds=True)
    real_read = ar._InFlight.read
    reads = []

    def read(self):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode("default")
        reads.append(1)
        return real_read(self)

    eng.add_lane([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.add_lane([5, 6], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ar._InFlight.read = read  # type: ignore[method-assign]
    try:
        eng.step()  # prefill (syncs for the first tokens) and the first round issued
        while eng.has_unfinished:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            eng.step()
            torch.cuda.set_sync_debug_mode("default")
    finally:
        ar._InFlight.read = real_read  # type: ignore[method-assign]
        torch.cuda.set_sync_debug_mode("default")
    assert len(reads) >= 10


FLASH_NEXT_KINDS = ("resident", "cache", "lookahead", "eager_cache")


def _flash_next_executor(kernel, kind: str):  # type: ignore[no-untyped-def]
    """The served MoE route on CUDA (what `ignis-run` builds for a `qwen3_5_moe` artifact): q4_g32
    routed experts run by the compiled grouped kernels, bf16. "resident": every expert on the device,
    rounds replayed from whole-round CUDA graphs; "cache": an expert cache of 1 slot a layer (misses
    every round, batched driver copies from page-locked memory), rounds replayed in pieces between the
    MoE layers' host parts; "lookahead": 2 slots with router lookahead (prefetches on the copy stream);
    "eager_cache": 1 slot with CUDA graphs off (the pieces run eagerly)."""
    from test_moe_grouped import _q4_experts

    from ignis.runtime.expert_cache import ExpertCache
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
    from ignis.runtime.linear import torch_linear

    if "moe_q4" not in _MODELS:
        _moe_executor("eager_moe")  # the tiny checkpoint
        config, tensors = _MODELS["qwen3_5_moe"]  # type: ignore[misc]
        _MODELS["moe_q4"] = (config, _q4_experts(tensors))
    config, tensors = _MODELS["moe_q4"]  # type: ignore[misc]
    kw: dict = dict(device=torch.device("cuda"), dtype=torch.bfloat16, linear=torch_linear, max_lanes=8,
                    max_columns=8, max_context=256, chunked_prefill=32, moe_module=kernel)  # fmt: skip
    if kind != "resident":
        slots = 2 if kind == "lookahead" else 1
        kw["expert_cache"] = ExpertCache(slots, device="cuda", lookahead=kind == "lookahead")
    if kind == "eager_cache":
        kw["cuda_graphs"] = False
    ex = StaticHybridExecutor(config, tensors, **kw)
    assert ex.cuda_graphs == (kind == "resident")
    assert ex.piecewise_graphs == (kind in ("cache", "lookahead"))
    return ex


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", FLASH_NEXT_KINDS)
def test_async_rounds_on_the_served_moe_route(cuda_kernel, kind: str) -> None:  # type: ignore[no-untyped-def] # noqa: F811
    """The served MoE route on CUDA (`_flash_next_executor`): async rounds give the ordinary rounds'
    results over seeds with an EOS hit mid-output, equal to the resident experts' ordinary tokens; with
    an expert cache the async run looks up the same experts in the same order (routing and prefetch
    traces, hits, misses, bytes) when the forwards have the same shapes (lanes ending by length), and
    misses happen every round."""
    resident = _flash_next_executor(cuda_kernel, "resident")
    ex = _flash_next_executor(cuda_kernel, kind)
    for seed in range(3):
        rng = random.Random(seed)
        plan = _random_plan(rng, ex.config.vocab_size, rng.randint(1, 5))
        eos = _mid_output_eos(resident, plan, rng)
        ordinary, _, _ = _run(ex, plan, async_rounds=False, eos=eos)
        got, _, eng = _run(ex, plan, async_rounds=True, eos=eos)
        _same(ordinary, got)  # async rounds against the ordinary rounds of the same route
        assert eng._async.num_issued > eng._async.num_drained
        # the route's ordinary rounds against the resident experts' (ADR 0012/0013: bit for bit; a
        # difference here is the cache's or the pieces', not the async rounds')
        want, _, _ = _run(resident, plan, async_rounds=False, eos=eos)
        _same(want, ordinary)
    if kind == "resident":
        return
    rng = random.Random(5)
    plan: dict[int, list] = {}
    for j, step in enumerate((0, 0, 2, 5)):
        prompt = [rng.randrange(3, ex.config.vocab_size) for _ in range(rng.randint(2, 40))]
        params = SamplingParams(temperature=0, max_tokens=4 + 3 * j, ignore_eos=True)
        plan.setdefault(step, []).append(("add", f"l{j}", prompt, params))
    (ordinary, otrace, ocounts, _), (got, gtrace, gcounts, cache) = _cache_run(
        lambda: _flash_next_executor(cuda_kernel, kind), plan
    )
    _same(ordinary, got)
    assert gtrace == otrace and gcounts == ocounts
    want, _, _ = _run(resident, plan, async_rounds=False)
    _same(want, ordinary)
    st = cache.stats
    assert st.misses + st.prefetches > 3 * len(cache.layers) * ex.config.num_experts
    assert st.direct_copies == st.misses + st.prefetches and st.staged_copies == 0
    assert (st.prefetches > 0) == (kind == "lookahead")


@pytest.mark.gpu
@needs_cuda
def test_async_rounds_no_host_sync_on_the_resident_moe_route(cuda_kernel) -> None:  # type: ignore[no-untyped-def] # noqa: F811
    """Every expert resident with the grouped kernels (whole-round graphs): async rounds issue and
    commit with no host sync before the read, as on the dense hybrid."""
    _assert_no_sync_between_issue_and_read(_flash_next_executor(cuda_kernel, "resident"))


def test_engine_step_bench_runs_async_rounds() -> None:
    """`tools/bench/engine_step.py --backends off-async`: the synthetic model's greedy outputs equal
    backend off's (the bench raises otherwise) and the figures are reported."""
    from ignis.tools.bench.engine_step import measure

    args = {
        "lanes": [1, 3],
        "backends": ["off", "off-async"],
        "round_ms": 0.0,
        "vocab": 64,
        "prompt_len": 8,
        "max_tokens": 16,
        "draft_tokens": 3,
        "accept": 0.9,
        "repeat": 1,
        "temperature": 0.0,
        "layout": "shared",
        "profile": 0,
    }
    rows = measure(args)
    assert [(r["backend"], r["lanes"]) for r in rows] == [
        ("off", 1),
        ("off", 3),
        ("off-async", 1),
        ("off-async", 3),
    ]
    assert all(r["engine_us_per_token"] > 0 for r in rows)
