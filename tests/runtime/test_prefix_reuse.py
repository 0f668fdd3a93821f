"""Prompt checkpoints: a request served from a checkpoint equals the same request prefilled from zero.

For every family (llama, qwen2, qwen3_5, qwen3_5_moe, qwen3_next tiny checkpoints written by HF
transformers' own classes) and drafter (off, ngram, draft-model, and on the hybrids dflash2 and mtp),
an agent session of four turns runs on an engine with a `PrefixCache` ("warm") and on one without
("cold"), each turn alone:

1. P1 = opener (system prompt + tools, a `checkpoint_at` boundary) + a user message;
2. P2 = P1 + reply 1 + a tool result: served from turn 1's reply checkpoint;
3. P3 = P2 + reply 2 + a tool result: from turn 2's;
4. P1' = the opener + another user message: from the opener checkpoint;
5. P1 again: the whole prompt from turn 1's prompt checkpoint (no forward; the first token from the
   stored logits).

Checked: greedy outputs token for token; the drafter's proposals round by round (its context is
whole: the same drafts from the same state); the per-position acceptance counters; the tokens each
turn reused. The drafters are random, so a wrapper steers them: it overwrites the first n drafts of
each proposal (n from a seeded stream keyed by the lane's length) with the cold run's output, so
rounds commit 1..k+1 tokens; the inner drafter still proposes every round and its proposals are the
ones compared. Also: seeded sampling reproduces with and without reuse, lanes joining mid-way, the
host tier (evicted checkpoints restored from host RAM), and the static (pooled) hybrid executor.

Near-ties: the warm run prefills the rest of a prompt on top of a restored state where the cold run
prefills it whole (float32, ~1e-6 apart); a differing greedy token is tolerated only where the cold
run's top-2 logit margin is below NEAR_TIE_MARGIN (none expected with these seeds).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters.base import BaseDrafter, DraftProposal, DraftRequest
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.sampling import SamplingParams

NEAR_TIE_MARGIN = 1e-4
MAX_TOKENS = 10
OPENER, USER, TOOL = 40, 12, 30  # token counts of the session's parts
K = 3  # draft tokens
BIG = 1 << 30

HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CASES = [
    ("llama", "off"),
    ("llama", "ngram"),
    ("llama", "draft-model"),
    ("qwen2", "off"),
    ("qwen2", "ngram"),
    ("qwen3_5", "off"),
    ("qwen3_5", "dflash2"),
    ("qwen3_5", "mtp"),
    ("qwen3_5", "ngram"),
    ("qwen3_5", "draft-model"),
    ("qwen3_5_moe", "mtp"),
    ("qwen3_5_moe", "dflash2"),
    ("qwen3_next", "mtp"),
    ("qwen3_next", "dflash2"),
    ("qwen3_5", "mtp-static"),  # the pooled head CUDA serves with (its static shapes run eagerly here)
    ("qwen3_5_moe", "mtp-static"),
]


class Model:
    """A tiny target of one family, its drafter factories and the session's token parts."""

    def __init__(self, family: str, base: Path) -> None:
        from ignis.runtime.families import get_family

        self.family = family
        self.factories = {}
        if family in ("llama", "qwen2"):
            import hf_tiny

            from ignis.compiler.importers import load_checkpoint

            folder = hf_tiny.save_tiny(hf_tiny.tiny_model(family, seed=0), base / "ckpt")
            ckpt = load_checkpoint(folder)
            config, weights = ckpt.config, ckpt.tensors.load_all()
        else:
            import hf_tiny_hybrid

            from ignis.runtime.drafters.dflash2 import build_dflash2_drafter
            from ignis.runtime.drafters.mtp import build_mtp_drafter, load_mtp_checkpoint
            from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors
            from ignis.tools.make_test_drafter import make_dflash2_drafter, make_mtp_drafter

            tiny = hf_tiny_hybrid.make_tiny_hybrid(family, base / "target")
            make_mtp_drafter(tiny.folder, base / "with_mtp", seed=11)
            # a window of 8: the context is trimmed within every prompt (the restored one too)
            make_dflash2_drafter(tiny.folder, base / "dflash2", seed=12, sliding_window=8)
            config, tensors = load_mtp_checkpoint(base / "with_mtp")
            weights = canonicalize_moe_tensors(config, tensors)
            self.factories["mtp"] = lambda: build_mtp_drafter(target_config=config, target_weights=tensors)
            self.factories["mtp-static"] = lambda: build_mtp_drafter(
                target_config=config, target_weights=tensors, static=True, max_lanes=2
            )
            self.factories["dflash2"] = lambda: build_dflash2_drafter(
                target_config=config, target_weights=tensors, checkpoint=base / "dflash2"
            )
        self.config, self.weights = config, weights
        make = get_family(config.model_type).make_executor
        self.ex = make(config, weights, "cpu", torch.float32)
        self.factories["off"] = lambda: None
        self.factories["ngram"] = self._ngram
        self.factories["draft-model"] = lambda: self._draft_model(make)
        g = torch.Generator().manual_seed(5)
        self.parts = {
            name: tuple(torch.randint(3, config.vocab_size, (n,), generator=g).tolist())
            for name, n in (
                ("opener", OPENER),
                ("user", USER),
                ("user2", USER),
                ("tool1", TOOL),
                ("tool2", TOOL),
            )
        }

    @staticmethod
    def _ngram():
        from ignis.runtime.drafters.ngram import NgramDrafter

        return NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)

    def _draft_model(self, make):
        from ignis.runtime.drafters.draft_model import DraftModelDrafter

        # the target's own weights in another executor: its own lane states (hybrid: recurrent ones)
        return DraftModelDrafter(make(self.config, self.weights, "cpu", torch.float32))

    def margin(self, tokens: Sequence[int]) -> float:
        """Top-2 logit margin of the model's next token after `tokens` (one cold prefill)."""
        st = self.ex.new_lane()
        out = self.ex.forward([st], [torch.tensor(list(tokens))], logits="last", record=False)
        self.ex.commit([st], [0])
        release = getattr(self.ex, "release_lane", None)
        if release is not None:
            release(st)
        top2 = torch.topk(out.logits[0][-1].double(), 2).values
        return float(top2[0] - top2[1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, Model] = {}

    def get(family: str) -> Model:
        if family not in made:
            made[family] = Model(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


class Steered(BaseDrafter):
    """Forwards the drafter protocol (checkpoints included) to `inner`, records the inner drafter's
    proposals per lane (by prompt), and overwrites the first n drafts with `truth`'s continuation."""

    def __init__(self, inner, truth: dict[tuple[int, ...], tuple[int, ...]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.is_row_budgeted = inner.is_row_budgeted
        self.needs_hidden_states = inner.needs_hidden_states
        self.tap_layers = tuple(inner.tap_layers)
        self.supports_checkpoints = inner.supports_checkpoints
        self.truth = truth
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.proposals: dict[tuple[int, ...], list[list[int]]] = {}

    def start_lane(self, lane_id, prompt_token_ids):
        self.prompts[lane_id] = tuple(prompt_token_ids)
        self.inner.start_lane(lane_id, prompt_token_ids)

    def restore_lane(self, lane_id, prompt_token_ids, snapshot: DrafterSnapshot):
        self.prompts[lane_id] = tuple(prompt_token_ids)
        self.inner.restore_lane(lane_id, prompt_token_ids, snapshot)

    def snapshot_lane(self, lane_id, num_tokens):
        return self.inner.snapshot_lane(lane_id, num_tokens)

    def end_lane(self, lane_id):
        self.inner.end_lane(lane_id)

    def commit(self, spans):
        self.inner.commit(spans)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        got = self.inner.propose(requests)
        out = []
        for req, prop in zip(requests, got, strict=True):
            prompt = self.prompts[req.lane_id]
            self.proposals.setdefault(prompt, []).append(prop.draft_token_ids.tolist())
            truth = self.truth.get(prompt)
            ids = prop.draft_token_ids.clone()
            if truth is not None and ids.numel():
                done = len(req.token_ids) - len(prompt)
                n = random.Random(len(req.token_ids) * 7919 + len(prompt)).randint(0, ids.numel())
                right = list(truth[done : done + n])
                ids[: len(right)] = torch.tensor(right, dtype=ids.dtype)
            out.append(DraftProposal(ids, prop.draft_probs))
        return out


def _engine(model: Model, backend: str, cache: PrefixCache | None, truth, executor=None) -> SpeculativeEngine:
    inner = model.factories[backend]()
    drafter = None if inner is None else Steered(inner, truth)
    return SpeculativeEngine(
        executor if executor is not None else model.ex,
        drafter,
        draft_tokens=K if drafter is not None else None,
        prefix_cache=cache,
        max_prefill_tokens=0,
    )


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _session(model: Model, engine: SpeculativeEngine, params: SamplingParams):
    """Run the session's turns (module docstring) one request at a time; returns per turn
    (prompt, output, cached tokens)."""
    p = model.parts
    turns = []

    def run(prompt, boundary=()):
        lane = engine.add_lane(prompt, params, checkpoint_at=boundary)
        while engine.result(lane) is None:
            engine.step()
        r = engine.pop_result(lane)
        turns.append((prompt, r.output_token_ids, r.num_cached_tokens))
        return r.output_token_ids

    p1 = p["opener"] + p["user"]
    out1 = run(p1, (OPENER,))
    p2 = p1 + out1 + p["tool1"]
    out2 = run(p2)
    run(p2 + out2 + p["tool2"])
    run(p["opener"] + p["user2"], (OPENER,))
    run(p1)
    return turns


def _check_equal(model: Model, warm, cold, label: str) -> None:
    for (prompt, got, _), (_, want, _) in zip(warm, cold, strict=True):
        if got == want:
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        margin = model.margin(prompt + want[:i])
        assert margin < NEAR_TIE_MARGIN, (
            f"{label}: prompt of {len(prompt)}: reuse {got} != cold {want} at {i} (margin {margin:.2e})"
        )


@pytest.mark.parametrize(("family", "backend"), CASES)
def test_reuse_equals_cold(models, family: str, backend: str) -> None:
    model = models(family)
    cold_engine = _engine(model, backend, None, {})
    cold = _session(model, cold_engine, _greedy())
    truth = {prompt: out for prompt, out, _ in cold}
    # steered cold run: the reference for proposals and acceptance (the same steering as warm)
    cold_engine = _engine(model, backend, None, truth)
    cold = _session(model, cold_engine, _greedy())
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    warm_engine = _engine(model, backend, cache, truth)
    warm = _session(model, warm_engine, _greedy())
    label = f"{family}/{backend}"
    _check_equal(model, warm, cold, label)
    cached = [c for _, _, c in warm]
    assert [c for _, _, c in cold] == [0] * 5
    (p1, o1, _), (p2, o2, _), _, _, (p5, _, _) = warm
    # the previous turns' replies (all but their last token, never fed), the opener, the whole prompt
    assert cached == [0, len(p1) + len(o1) - 1, len(p2) + len(o2) - 1, OPENER, len(p5)], (label, cached)
    if backend != "off":
        # the drafter's context is whole: the same proposals, round by round, and the same acceptance
        assert warm_engine.drafter.proposals == cold_engine.drafter.proposals, label
        wm, cm = warm_engine.metrics, cold_engine.metrics
        assert dict(wm.position_drafted_total) == dict(cm.position_drafted_total), label
        assert dict(wm.position_accepted_total) == dict(cm.position_accepted_total), label
        assert wm.accepted_tokens_total == cm.accepted_tokens_total
        assert wm.rounds_total > 0 and sum(cm.position_accepted_total.values()) > 0
    assert cache.metrics.reused_tokens_total == sum(cached)
    assert cache.metrics.hits_total["card"] == 4


@pytest.mark.parametrize(
    ("family", "backend"), [("qwen3_5", "dflash2"), ("qwen3_next", "mtp"), ("llama", "off")]
)
def test_sampled_seeded_reproduces_with_reuse(models, family: str, backend: str) -> None:
    model = models(family)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=1234, ignore_eos=True)
    cold = _session(model, _engine(model, backend, None, {}), params)
    warm_engine = _engine(model, backend, PrefixCache(card_bytes=BIG, host_bytes=BIG), {})
    warm = _session(model, warm_engine, params)
    assert [o for _, o, _ in warm] == [o for _, o, _ in cold]
    assert [c for _, _, c in warm][4] == len(warm[4][0])  # the first token sampled from stored logits


@pytest.mark.parametrize(
    ("family", "backend"), [("qwen3_5", "dflash2"), ("qwen3_5_moe", "mtp"), ("llama", "ngram")]
)
def test_host_tier_evict_and_restore(models, family: str, backend: str) -> None:
    """A card tier that holds one checkpoint: older ones move to the host tier and are restored from
    there; never over either budget; outputs equal the cold run."""
    model = models(family)
    cold = _session(model, _engine(model, backend, None, {}), _greedy())
    probe = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    _session(model, _engine(model, backend, probe, {}), _greedy())
    biggest = max(c.nbytes for c in probe.entries("card"))
    cache = PrefixCache(card_bytes=biggest + 1, host_bytes=BIG)
    engine = _engine(model, backend, cache, {})
    budgets_ok = []
    orig_insert = cache.insert

    def insert(ckpt):
        kept = orig_insert(ckpt)
        budgets_ok.append(cache.bytes_used("card") <= cache.budget["card"])
        return kept

    cache.insert = insert  # type: ignore[method-assign]
    warm = _session(model, engine, _greedy())
    _check_equal(model, warm, cold, f"{family}/{backend} host tier")
    assert all(budgets_ok) and budgets_ok
    assert cache.metrics.evictions_total["card"] > 0
    assert cache.metrics.hits_total["host"] >= 1  # the opener's or turn 1's prompt checkpoint
    assert cache.num_entries("host") > 0
    unlimited = [c for _, _, c in cold_cached(model, backend)]
    got = [c for _, _, c in warm]
    assert got[1:4] == unlimited[1:4]
    # the retry of turn 1's prompt: its checkpoint was superseded by turn 1's reply and dropped
    # under card pressure (not copied to the host), so it starts from the opener (or, attention
    # only, a block-aligned prefix of the reply checkpoint)
    assert OPENER <= got[4] < unlimited[4] == len(warm[4][0])


def cold_cached(model: Model, backend: str):
    """The session on a warm engine with unlimited card budget (the reuse the host tier must match)."""
    return _session(
        model, _engine(model, backend, PrefixCache(card_bytes=BIG, host_bytes=BIG), {}), _greedy()
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_attention_only_reuses_block_aligned_prefix(models, family: str) -> None:
    """Attention-only state restores at any block-aligned prefix of a checkpoint (no opener needed);
    recurrent state does not (qwen3_5: no hit)."""
    for fam, want in ((family, 32), ("qwen3_5", 0)):
        model = models(fam)
        cache = PrefixCache(card_bytes=BIG, host_bytes=BIG, block_size=16)
        engine = _engine(model, "off", cache, {})
        p1 = model.parts["opener"] + model.parts["user"]
        engine.generate([p1], _greedy())
        prompt = p1[:37] + model.parts["tool1"][:5]
        r = engine.generate([prompt], _greedy())[0]
        assert r.num_cached_tokens == want, fam
        assert (
            r.output_token_ids
            == SpeculativeEngine(model.ex).generate([prompt], _greedy())[0].output_token_ids
        )


@pytest.mark.parametrize(
    ("family", "backend"),
    [("qwen3_5", "dflash2"), ("qwen3_next", "mtp"), ("qwen2", "draft-model"), ("qwen3_next", "mtp-static")],
)
def test_lanes_joining_mid_way(models, family: str, backend: str) -> None:
    """Several lanes on one warm engine, some joining while others decode, each served from a
    checkpoint: every output equals its prompt's cold single-lane output."""
    model = models(family)
    cold = _session(model, _engine(model, backend, None, {}), _greedy())
    refs = {prompt: out for prompt, out, _ in cold}
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    engine = _engine(model, backend, cache, {})
    _session(model, engine, _greedy())  # fills the pool
    prompts = [t[0] for t in cold]
    ids = [engine.add_lane(prompts[2], _greedy()), engine.add_lane(prompts[0], _greedy())]
    engine.step()
    engine.step()
    ids += [engine.add_lane(prompts[1], _greedy()), engine.add_lane(prompts[3], _greedy())]
    engine.step()
    ids.append(engine.add_lane(prompts[4] + model.parts["tool2"], _greedy()))
    while engine.has_unfinished:
        engine.step()
    results = [engine.pop_result(i) for i in ids]
    for r in results[:4]:
        want = refs[r.prompt_token_ids]
        got = r.output_token_ids
        if got != want:
            i = next(j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            assert model.margin(r.prompt_token_ids + want[:i]) < NEAR_TIE_MARGIN
        assert r.num_cached_tokens > 0
    last = results[4]
    want = SpeculativeEngine(model.ex).generate([last.prompt_token_ids], _greedy())[0].output_token_ids
    assert last.output_token_ids == want
    assert last.num_cached_tokens == len(prompts[4])


def test_static_executor_restores_into_pooled_slots(models) -> None:
    """The static (pooled-slot) hybrid executor: checkpoints captured there restore by copying into
    another lane's slot; a checkpoint from the eager executor restores there too (canonical layout)."""
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    model = models("qwen3_5")
    static = StaticHybridExecutor(model.config, model.weights, max_lanes=2, max_context=256)
    cold = _session(model, _engine(model, "dflash2", None, {}), _greedy())
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    warm = _session(model, _engine(model, "dflash2", cache, {}, executor=static), _greedy())
    _check_equal(model, warm, cold, "static")
    assert [c for _, _, c in warm][1:] != [0, 0, 0, 0]
    # eager checkpoints into the static executor
    eager_cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    _session(model, _engine(model, "dflash2", eager_cache, {}), _greedy())
    engine = _engine(model, "dflash2", eager_cache, {}, executor=static)
    prompt = cold[2][0]
    r = engine.generate([prompt], _greedy())[0]
    assert r.num_cached_tokens == len(prompt)
    assert r.output_token_ids == cold[2][1]


@pytest.mark.parametrize(
    ("family", "backend"), [("qwen3_5", "dflash2"), ("qwen3_next", "mtp"), ("llama", "ngram")]
)
def test_warm_restart_from_snapshot_directory(models, tmp_path: Path, family: str, backend: str) -> None:
    """A pool saved as snapshot files (format 5) and loaded by a new engine ("restarted server")
    serves the next turns exactly; a file bound to another artifact is refused and skipped."""
    from ignis.formats.snapshot import SnapshotBinding
    from ignis.runtime.snapshots import SnapshotDirectory

    model = models(family)
    cold = _session(model, _engine(model, backend, None, {}), _greedy())
    first = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    _session(model, _engine(model, backend, first, {}), _greedy())
    binding = SnapshotBinding(artifact_sha256="0" * 64, drafter=backend)
    written = SnapshotDirectory(tmp_path, binding).save(first)
    assert written == first.num_entries("card") > 0
    assert SnapshotDirectory(tmp_path, binding).save(first) == 0  # already on disk
    other = SnapshotBinding(artifact_sha256="1" * 64, drafter=backend)
    assert SnapshotDirectory(tmp_path, other).load(PrefixCache(card_bytes=BIG, host_bytes=BIG)) == 0
    # a server of another artifact saving into the same folder leaves this artifact's files alone
    assert SnapshotDirectory(tmp_path, other).save(PrefixCache(card_bytes=BIG, host_bytes=BIG)) == 0
    assert len(SnapshotDirectory(tmp_path, binding).files()) == written
    restarted = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    assert SnapshotDirectory(tmp_path, binding).load(restarted) == written
    engine = _engine(model, backend, restarted, {})
    for prompt, want, _ in cold[1:]:
        r = engine.generate([prompt], _greedy())[0]
        assert r.num_cached_tokens > 0
        if r.output_token_ids != want:
            i = next(j for j, (a, b) in enumerate(zip(r.output_token_ids, want, strict=False)) if a != b)
            assert model.margin(prompt + want[:i]) < NEAR_TIE_MARGIN


@pytest.mark.parametrize(("family", "backend"), [("llama", "ngram"), ("qwen3_5", "dflash2")])
def test_interleaved_agent_sessions_on_eight_lanes(models, family: str, backend: str) -> None:
    """A small agent replay: 4 sessions of 6 turns interleaved on one engine of 8 lanes (a session's
    next turn is submitted when its previous reply is done, so turns of different sessions join while
    others decode). The first turns of sessions 2-4 start from session 1's opener (system prompt and
    tools); every later turn reuses its whole conversation but the new tool output (prompt + reply -
    1 tokens of the previous turn), and its output equals a cold run of the same prompt alone."""
    model = models(family)
    g = torch.Generator().manual_seed(9)
    vocab = model.config.vocab_size
    rand = lambda n: tuple(torch.randint(3, vocab, (n,), generator=g).tolist())  # noqa: E731
    opener = rand(OPENER)
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    engine = SpeculativeEngine(
        model.ex, model.factories[backend](), draft_tokens=K, prefix_cache=cache, max_lanes=8
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sessions = [{"prompt": opener + rand(8 + 3 * s), "turn": 0, "lane": None} for s in range(4)]
    log: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = []  # prompt, output, cached, expected
    expected = {id(s): 0 for s in sessions}
    for s in sessions:  # all at once: the first prefills the opener, the others wait for it
        s["lane"] = engine.add_lane(s["prompt"], params, checkpoint_at=(OPENER,))
    while any(s["lane"] is not None for s in sessions):
        engine.step()
        for s in sessions:
            r = None if s["lane"] is None else engine.result(s["lane"])
            if r is None:
                continue
            engine.pop_result(s["lane"])
            log.append((s["prompt"], r.output_token_ids, r.num_cached_tokens, expected[id(s)]))
            s["turn"] += 1
            if s["turn"] == 6:
                s["lane"] = None
                continue
            expected[id(s)] = len(s["prompt"]) + len(r.output_token_ids) - 1
            s["prompt"] = (
                s["prompt"] + r.output_token_ids + rand(int(torch.randint(10, 40, (1,), generator=g)))
            )
            s["lane"] = engine.add_lane(s["prompt"], params)
    assert len(log) == 24
    firsts = [c for _, _, c, e in log if e == 0]
    assert sorted(firsts)[1:] == [OPENER] * 3  # the first session's opener serves the others' first turns
    assert [c for _, _, c, e in log if e] == [e for _, _, _, e in log if e]
    total = sum(len(p) for p, _, _, _ in log)
    reused = sum(c for _, _, c, _ in log)
    assert cache.metrics.reused_tokens_total == reused and reused / total > 0.75
    for prompt, got, _, _ in log:
        want = SpeculativeEngine(model.ex).generate([prompt], params)[0].output_token_ids
        if got != want:
            i = next(j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            assert model.margin(prompt + want[:i]) < NEAR_TIE_MARGIN


@pytest.mark.parametrize(("family", "backend"), [("qwen3_5", "dflash2"), ("qwen3_5", "mtp")])
def test_lane_finishing_at_its_first_token_is_checkpointed(models, family: str, backend: str) -> None:
    """A request whose first token ends it (max_tokens=1) still records its prompt (the drafter's
    context included); the same prompt again is served whole from it, and a longer one continues
    from it with the drafter's proposals of a cold run."""
    model = models(family)
    p = model.parts
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    engine = _engine(model, backend, cache, {})
    prompt = p["opener"] + p["user"]
    first = engine.generate([prompt], one)[0]
    assert first.num_cached_tokens == 0 and cache.num_entries("card") == 1
    again = engine.generate([prompt], one)[0]
    assert again.num_cached_tokens == len(prompt) and again.output_token_ids == first.output_token_ids
    longer = prompt + p["tool1"]
    got = engine.generate([longer], _greedy())[0]
    cold_engine = _engine(model, backend, None, {})
    want = cold_engine.generate([longer], _greedy())[0]
    assert got.num_cached_tokens == len(prompt)
    assert got.output_token_ids == want.output_token_ids
    assert engine.drafter.proposals[longer] == cold_engine.drafter.proposals[longer]


@pytest.mark.parametrize(("family", "backend", "budget"), [("qwen3_5", "dflash2", 16), ("llama", "off", 0)])
def test_burst_with_one_opener_prefills_it_once(models, family: str, backend: str, budget: int) -> None:
    """Four conversations with the same system prompt arrive together: the first prefills the
    opener (over several steps with a small prefill budget), the others wait for its checkpoint and
    restore it; outputs equal cold runs."""
    model = models(family)
    p = model.parts
    g = torch.Generator().manual_seed(3)
    prompts = [p["opener"] + tuple(torch.randint(3, 300, (9 + i,), generator=g).tolist()) for i in range(4)]
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    inner = model.factories[backend]()
    engine = SpeculativeEngine(
        model.ex,
        None if inner is None else Steered(inner, {}),
        draft_tokens=None if inner is None else K,
        prefix_cache=cache,
        max_prefill_tokens=budget,
    )
    ids = [engine.add_lane(q, _greedy(), checkpoint_at=(OPENER,)) for q in prompts]
    while engine.has_unfinished:
        engine.step()
    results = [engine.pop_result(i) for i in ids]
    assert [r.num_cached_tokens for r in results] == [0, OPENER, OPENER, OPENER]
    assert cache.metrics.recorded_total["opener"] == 1
    for r in results:
        want = SpeculativeEngine(model.ex).generate([r.prompt_token_ids], _greedy())[0].output_token_ids
        got = r.output_token_ids
        if got != want:
            i = next(j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            assert model.margin(r.prompt_token_ids + want[:i]) < NEAR_TIE_MARGIN


def test_a_checkpoint_that_does_not_fit_is_dropped_and_the_lane_prefills(models, caplog) -> None:
    """A pool entry that does not fit the executor (another model's shapes) costs nothing but a
    warning: the lane prefills from zero with the cold output, the entry is gone, counts undone."""
    import dataclasses

    from ignis.runtime.checkpoints import CheckpointError, restore_model_state

    model = models("qwen3_5")
    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    engine = _engine(model, "off", cache, {})
    prompt = model.parts["opener"] + model.parts["user"]
    engine.generate([prompt], _greedy())
    good = next(c for c in cache.entries("card") if c.kind == "prompt")
    bad = dataclasses.replace(
        good, model={**good.model, "gdn.recurrent": good.model["gdn.recurrent"][:, :1].clone()}
    )
    with pytest.raises(CheckpointError, match=r"gdn\.recurrent"):
        restore_model_state(model.ex, model.ex.new_lane(), bad.model, bad.num_tokens)
    cache.clear()
    cache.insert(bad)
    longer = prompt + model.parts["tool1"]
    with caplog.at_level("WARNING"):
        r = engine.generate([longer], _greedy())[0]
    assert r.num_cached_tokens == 0
    assert "prefilling from zero" in caplog.text
    assert r.output_token_ids == SpeculativeEngine(model.ex).generate([longer], _greedy())[0].output_token_ids
    assert not cache.holds(prompt) and cache.metrics.reused_tokens_total == 0
    assert cache.metrics.hits_total["card"] == 0


@pytest.mark.parametrize(
    ("family", "backend"),
    [
        ("qwen3_5", "dflash2"),
        ("qwen3_next", "mtp"),
        ("qwen3_5", "draft-model"),
        ("qwen3_5_moe", "mtp-static"),
    ],
)
def test_reply_checkpoint_holds_committed_state_only(models, family: str, backend: str) -> None:
    """The reply checkpoint, taken after verify rounds that rejected drafts, equals the state of a
    lane fed the committed tokens alone (one cold prefill): Gated DeltaNet recurrent and conv state,
    KV, and the drafter's snapshot. A rejected draft leaking into it would differ by O(1)."""
    model = models(family)
    vocab = model.config.vocab_size

    class Spoiled(Steered):  # the inner drafter's drafts past the first are made wrong: rejections
        def propose(self, requests):  # type: ignore[no-untyped-def]
            out = []
            for prop in super().propose(requests):
                ids = prop.draft_token_ids.clone()
                ids[1:] = (ids[1:] + 1) % vocab
                out.append(DraftProposal(ids, None))
            return out

    def engine_with(cache):  # type: ignore[no-untyped-def]
        drafter = Spoiled(model.factories[backend](), {})
        return SpeculativeEngine(model.ex, drafter, draft_tokens=K, prefix_cache=cache, max_prefill_tokens=0)

    cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    engine = engine_with(cache)
    prompt = model.parts["opener"] + model.parts["user"]
    r = engine.generate([prompt], _greedy())[0]
    m = engine.metrics
    assert m.drafted_tokens_total > m.accepted_tokens_total - m.rounds_total  # some drafts rejected
    tokens = (prompt + r.output_token_ids)[:-1]
    reply = next(c for c in cache.entries("card") if c.kind == "reply")
    assert reply.token_ids == tokens
    # cold: the committed tokens as one prompt (the engine's prefill path), captured the same way
    cold_cache = PrefixCache(card_bytes=BIG, host_bytes=BIG)
    cold = engine_with(cold_cache)
    cold.generate([tokens], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    ref = next(c for c in cold_cache.entries("card") if c.kind == "prompt")
    assert ref.token_ids == tokens
    assert reply.model.keys() == ref.model.keys()
    for name in ref.model:
        torch.testing.assert_close(reply.model[name], ref.model[name], atol=2e-4, rtol=2e-4, msg=name)
    a, b = reply.drafter, ref.drafter
    assert a is not None and b is not None and a.num_tokens == b.num_tokens
    if backend == "draft-model":  # fed lazily: the cold lane's draft model never ran
        assert b.meta["num_fed"] == 0 and a.meta["num_fed"] <= len(tokens)
        return
    assert a.tensors.keys() == b.tensors.keys()
    for name in b.tensors:
        torch.testing.assert_close(a.tensors[name], b.tensors[name], atol=2e-4, rtol=2e-4, msg=name)
