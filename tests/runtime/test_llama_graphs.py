"""`StaticLlamaExecutor` (pooled KV slots, padded static rounds, CUDA-graphed on CUDA) against
`LlamaExecutor`, for llama and qwen2.

On the CPU the static path runs without capture: the same code the graphs replay. Oracle: the eager
`LlamaExecutor` over the same tiny random HF checkpoints (tests/hf_tiny.py), float32. GPU tests
(`@pytest.mark.gpu`) run the same equivalence with graphs on and time the first request against the
tenth.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import hf_tiny  # tests/ is on pytest's pythonpath
import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.checkpoints import capture_model_state, restore_model_state
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.families.llama import LlamaExecutor
from ignis.runtime.families.llama_graphs import StaticLlamaExecutor
from ignis.runtime.sampling import SamplingParams

FAMILIES = ("llama", "qwen2")
ATOL = RTOL = 1e-4  # float32: attention over a padded bucket vs one lane's exact length
VOCAB = 384

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Tiny:
    """A tiny HF checkpoint of one family, imported through ignis' HF importer."""

    def __init__(self, family: str, base: Path) -> None:
        from ignis.compiler.importers import load_checkpoint

        folder = hf_tiny.save_tiny(hf_tiny.tiny_model(family, seed=0), base / "ckpt")
        ckpt = load_checkpoint(folder)
        assert ckpt.config.model_type == family
        self.config, self.weights = ckpt.config, ckpt.tensors.load_all()

    def static(self, **kw) -> StaticLlamaExecutor:
        kw = {"max_lanes": 4, "max_context": 200, "kv_bucket": 16, **kw}
        return StaticLlamaExecutor(self.config, self.weights, **kw)

    def eager(self, **kw) -> LlamaExecutor:
        return LlamaExecutor(self.config, self.weights, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ref(tiny: Tiny) -> LlamaExecutor:
    return tiny.eager()


def tokens(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def ref_kv(state, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `LlamaLaneState`'s committed (keys, values) of `layer`, each [kv_heads, n, head_dim]."""
    n = state.num_tokens
    return state.kv[layer, 0, :, :n], state.kv[layer, 1, :, :n]


def assert_same_state(config, st_lane, ref_lane) -> None:
    """Same committed length and keys / values of every layer (static lane against an eager one)."""
    assert st_lane.num_tokens == ref_lane.num_tokens
    for layer in range(config.num_hidden_layers):
        (ka, va), (kb, vb) = st_lane.kv(layer), ref_kv(ref_lane, layer)
        assert ka.shape == kb.shape == (config.num_key_value_heads, st_lane.num_tokens, config.head_dim)
        close(ka, kb)
        close(va, vb)


def run_both(ref, st, ref_states, st_states, columns, keeps, *, record=True, logits="all", **kw):
    """One forward + commit on both executors: logits (and hidden states, taps) close, greedy tokens
    equal, then the committed states equal."""
    a = ref.forward(ref_states, columns, record=record, logits=logits, **kw)
    b = st.forward(st_states, columns, record=record, logits=logits, **kw)
    assert len(a.logits) == len(b.logits)
    for la, lb in zip(a.logits, b.logits, strict=True):
        assert la.shape == lb.shape and lb.dtype == torch.float32
        close(lb, la)
        assert torch.equal(lb.argmax(-1), la.argmax(-1))
    for name in ("hidden_states", "taps"):
        xa, xb = getattr(a, name), getattr(b, name)
        assert (xa is None) == (xb is None)
        for ya, yb in zip(xa or [], xb or [], strict=True):
            assert ya.shape == yb.shape
            close(yb, ya)
    ref.commit(ref_states, keeps)
    st.commit(st_states, keeps)
    for ra, sb in zip(ref_states, st_states, strict=True):
        assert_same_state(ref.config, sb, ra)


def feed_alone(ex, kept: torch.Tensor):
    """A new lane of ex fed `kept` in one forward and committed whole."""
    lane = ex.new_lane()
    if kept.numel():
        ex.forward([lane], [kept])
        ex.commit([lane], [kept.numel()])
    return lane


def _count_calls(ex, name: str, fail_at: int | None = None) -> list[int]:
    """Wrap ex.<name> to count its calls; fail_at: the call (1-based) that raises RuntimeError instead."""
    count, inner = [0], getattr(ex, name)

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] == fail_at:
            raise RuntimeError("injected failure")
        return inner(*args, **kwargs)

    setattr(ex, name, wrapped)
    return count


def _record_shapes(ex) -> list[tuple[int, int, int]]:
    """Wrap ex._body to record each call's (lanes, columns, KV bucket)."""
    shapes, inner = [], ex._body

    def wrapped(ids, pos, slots, bucket, **kw):
        shapes.append((int(pos.shape[0]), int(pos.shape[1]), int(bucket)))
        return inner(ids, pos, slots, bucket, **kw)

    ex._body = wrapped
    return shapes


def test_grouped_attention_against_a_loop() -> None:
    """`grouped_attention` over a `round_mask` (what a round runs): query head h of lane i, column j
    attends kv head h // rep over key positions 0 .. pos[i, j], read through a strided view."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ignis.runtime.families.llama_graphs import grouped_attention, round_mask

    g = torch.Generator().manual_seed(0)
    lanes, n, nkv, rep, hd, t = 2, 3, 2, 3, 16, 20
    q = torch.randn(lanes, n, nkv, rep, hd, generator=g)
    kv = torch.randn(2, lanes, t, nkv, hd, generator=g)  # the pool's [lanes, T, kv_heads, hd] layout
    keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    pos = torch.tensor([[4, 5, 6], [17, 18, 19]])
    with sdpa_kernel([SDPBackend.MATH]):
        got = grouped_attention(q, keys, values, round_mask(pos, t, rep), 0.25).view(lanes, n, nkv * rep, hd)
    for i in range(lanes):
        for j in range(n):
            for h in range(nkv * rep):
                p = int(pos[i, j])
                w = (keys[i, h // rep, : p + 1] @ q[i, j, h // rep, h % rep] * 0.25).softmax(-1)
                close(got[i, j, h], w @ values[i, h // rep, : p + 1])


# ---- rounds -------------------------------------------------------------------------------------


def test_rounds_match_llama_executor(tiny: Tiny, ref: LlamaExecutor) -> None:
    """Prefill (a long prompt eagerly, chunked ones, short ones static), then verify rounds with mixed
    column counts and partial commits; lanes join mid-way and leave; hidden states and taps too."""
    st = tiny.static(max_lanes=5, chunked_prefill=32)
    assert not st.cuda_graphs and st.sdpa_backend == torch.nn.attention.SDPBackend.MATH
    prompts = [tokens(70, 1), tokens(5, 2), tokens(20, 3)]  # 70: eager; 20 with 5: chunked rounds
    ra, sa = [ref.new_lane() for _ in prompts], [st.new_lane() for _ in prompts]
    eager = _count_calls(st, "_eager_forward")
    run_both(ref, st, ra, sa, prompts, [p.numel() for p in prompts], record=False, logits="last")
    run_both(ref, st, ra[1:], sa[1:], [tokens(20, 4), tokens(30, 5)], [20, 30], record=False)  # chunked
    assert eager[0] == 1
    short = [tokens(3, 6), tokens(8, 7)]  # all <= max_columns: a static prefill
    rb, sb = [ref.new_lane() for _ in short], [st.new_lane() for _ in short]
    run_both(ref, st, rb, sb, short, [3, 8], record=False, logits="last", output_hidden_states=True)
    ra, sa = ra + rb[:1], sa + sb[:1]  # lane 4 joins the rounds below; lane 5 waits
    shapes = [[1, 8, 3, 5], [4, 1, 8, 2], [1, 1, 1, 1], [8, 8, 8, 8], [2, 7, 1, 6]]
    keeps = [[1, 5, 0, 5], [4, 1, 2, 1], [1, 1, 1, 0], [8, 3, 1, 7], [2, 7, 1, 6]]
    for r, (shape, keep) in enumerate(zip(shapes, keeps, strict=True)):
        cols = [tokens(n, 100 + 10 * r + i) for i, n in enumerate(shape)]
        kw = {"output_hidden_states": True, "tap_layers": (1, 0)} if r % 2 else {}
        run_both(ref, st, ra, sa, cols, keep, logits="last" if r == 2 else "all", **kw)
    # lane 2 leaves; the waiting lane joins a round with the others at a different length
    st.release_lane(sa[1])
    ra, sa = [ra[0], *ra[2:], rb[1]], [sa[0], *sa[2:], sb[1]]
    cols = [tokens(n, 900 + i) for i, n in enumerate([3, 1, 6, 2])]
    run_both(ref, st, ra, sa, cols, [c.numel() for c in cols])
    assert eager[0] == 1  # nothing else ran eagerly


@pytest.mark.parametrize("prefix", [0, 9])
def test_commit_every_k_equals_feeding_the_kept_tokens(tiny: Tiny, ref: LlamaExecutor, prefix: int) -> None:
    """A round of 8 columns beside a lane of 3, committing k = 0..8: the lane's KV equals a lane fed
    the kept tokens alone (static and eager), and the next round from there matches too."""
    st = tiny.static(max_lanes=2)
    head, cols = tokens(prefix, 7), tokens(8, 8)
    for keep in range(cols.numel() + 1):
        lane, other = st.new_lane(), st.new_lane()
        if prefix:
            st.forward([lane], [head], record=False)  # 9 > max_columns: the eager path
            st.commit([lane], [prefix])
        st.forward([lane, other], [cols, cols[:3]])
        st.commit([lane, other], [keep, 3])
        kept = torch.cat([head, cols[:keep]])
        expect = feed_alone(ref, kept)
        assert_same_state(tiny.config, lane, expect)
        alone = feed_alone(st, kept)
        for layer in range(tiny.config.num_hidden_layers):
            for x, y in zip(lane.kv(layer), alone.kv(layer), strict=True):
                close(x, y)
        nxt = tokens(4, 50 + keep)
        run_both(ref, st, [expect], [lane], [nxt], [4])
        for s in (lane, other, alone):
            st.release_lane(s)


def test_rewind_equals_feeding_the_first_tokens(tiny: Tiny, ref: LlamaExecutor) -> None:
    """rewind to m (what the draft-model drafter does with kept drafts): the lane continues as one fed
    its first m tokens alone; the checks raise without changing anything."""
    st = tiny.static(max_lanes=2)
    seq = tokens(14, 11)
    lane = feed_alone(st, seq)
    st.rewind([lane], [6])
    assert lane.num_tokens == 6
    expect = feed_alone(ref, seq[:6])
    assert_same_state(tiny.config, lane, expect)
    run_both(ref, st, [expect], [lane], [tokens(5, 12)], [5])
    with pytest.raises(StateError, match="outside"):
        st.rewind([lane], [12])
    st.forward([lane], [tokens(2, 13)])
    with pytest.raises(StateError, match="pending"):
        st.rewind([lane], [1])
    assert lane.num_tokens == 11


def test_round_shapes_are_padded_to_the_column_widths(tiny: Tiny, ref: LlamaExecutor) -> None:
    """Columns are padded to the next of `column_widths` (powers of two below max_columns, max_columns,
    and what warm_up adds), lanes are exact up to 8 and padded to a multiple of 8 past it (padding
    lanes in the scratch slot), the KV read to a bucket; the padding changes nothing the real lanes
    see."""
    st = tiny.static(max_lanes=6, max_columns=6, kv_bucket=16)
    assert st.column_widths == (1, 2, 4, 6)
    shapes = _record_shapes(st)
    lanes = [st.new_lane() for _ in range(3)]
    refs = [ref.new_lane() for _ in range(3)]
    run_both(ref, st, refs, lanes, [tokens(n, 30 + n) for n in (5, 1, 3)], [5, 1, 3])
    run_both(ref, st, refs, lanes, [tokens(n, 40 + n) for n in (1, 1, 2)], [1, 1, 1])
    run_both(ref, st, refs[:1], lanes[:1], [tokens(6, 50)], [6])  # 6 + 6 = 12 keys: bucket 16
    run_both(ref, st, refs[:1], lanes[:1], [tokens(6, 51)], [6])  # 12 + 6 = 18: bucket 32
    assert shapes == [(3, 6, 16), (3, 2, 16), (1, 6, 16), (1, 6, 32)]
    assert st.warm_up(columns=(5,)) == 0  # no graphs on the CPU; the width applies all the same
    assert st.column_widths == (1, 2, 4, 5, 6)
    with pytest.raises(ValueError, match=r"outside 1\.\.max_columns"):
        st.warm_up(columns=(7,))
    five = [st.new_lane() for _ in range(2)] + lanes
    five_refs = [ref.new_lane() for _ in range(2)] + refs
    run_both(ref, st, five_refs, five, [tokens(n, 60 + n) for n in (4, 2, 1, 5, 3)], [4, 2, 1, 5, 3])
    assert shapes[-1] == (5, 5, 32)
    ten = five + [st.new_lane() for _ in range(5)]  # the pools grow to 12 slots; 10 lanes run as 16
    ten_refs = five_refs + [ref.new_lane() for _ in range(5)]
    cols = [tokens(1 + i % 3, 70 + i) for i in range(10)]
    run_both(ref, st, ten_refs, ten, cols, [c.numel() for c in cols])
    assert st.max_lanes == 12 and shapes[-1] == (16, 4, 32)


def test_chunked_prefill_keeps_the_protocol(tiny: Tiny, ref: LlamaExecutor) -> None:
    """A chunked forward stays pending as one forward: commit(0) leaves the lane as it was (the next
    forward matches), record=True commits any prefix, record=False only whole or nothing; an error in
    a chunk leaves the lanes as before the forward."""
    st = tiny.static(max_lanes=3, chunked_prefill=24)
    eager = _count_calls(st, "_eager_forward")
    a, b = st.new_lane(), st.new_lane()
    ra, rb = ref.new_lane(), ref.new_lane()
    run_both(ref, st, [ra, rb], [a, b], [tokens(4, 1), tokens(6, 2)], [4, 6])
    prompt = tokens(20, 3)
    st.forward([a, b], [prompt, tokens(11, 4)], record=False)
    assert (a.num_tokens, b.num_tokens, a.num_pending) == (4, 6, 20)
    with pytest.raises(StateError, match="record=False"):
        st.commit([a, b], [5, 11])
    st.commit([a, b], [0, 11])
    rb_cols = tokens(11, 4)
    ref.forward([rb], [rb_cols], record=False)
    ref.commit([rb], [11])
    assert_same_state(tiny.config, a, ra)
    assert_same_state(tiny.config, b, rb)
    # record=True: a partial commit of a chunked forward is the kept prefix
    cols = tokens(19, 5)
    run_both(ref, st, [ra], [a], [cols], [13])
    assert eager[0] == 0
    # an error in the second chunk: the lanes are back where they were
    calls = _count_calls(st, "_static_forward", fail_at=2)
    with pytest.raises(RuntimeError, match="injected"):
        st.forward([a, b], [tokens(20, 6), tokens(20, 7)], record=False)
    assert calls[0] == 2
    assert (a.num_tokens, b.num_tokens) == (17, 17) and not a.is_pending and not b.is_pending
    del st._static_forward  # the class's method again
    run_both(ref, st, [ra, rb], [a, b], [tokens(3, 8), tokens(2, 9)], [3, 2])


def test_slot_reuse_growth_and_errors(tiny: Tiny, ref: LlamaExecutor) -> None:
    st = tiny.static(max_lanes=2, max_context=40)
    a, b = st.new_lane(), st.new_lane()
    st.forward([a, b], [tokens(12, 1), tokens(6, 2)], record=False)
    st.commit([a, b], [12, 6])
    ra = feed_alone(ref, tokens(12, 1))
    extra = st.new_lane()  # a third lane: the pools grow to 4 slots, a's keys come along
    assert st.max_lanes == 4 and extra.slot == 2 and st.num_free_lanes == 1
    assert_same_state(tiny.config, a, ra)
    run_both(ref, st, [ra], [a], [tokens(3, 20)], [2])
    st.release_lane(extra)
    slot = b.slot
    st.release_lane(b)
    st.release_lane(b)  # idempotent
    with pytest.raises(StateError, match="released"):
        st.forward([b], [tokens(1, 3)])
    c = st.new_lane()  # reuses b's slot with a clean state
    assert c.slot == slot and c.num_tokens == 0
    del a  # dropping a state gives its slot back too
    gc.collect()
    assert st.num_free_lanes == 3
    rc = ref.new_lane()
    run_both(ref, st, [rc], [c], [tokens(5, 4)], [5])
    with pytest.raises(StateError, match="outside"):
        st.forward([c], [tokens(3, 5)])
        st.commit([c], [4])
    st.commit([c], [3])
    st.forward([c], [tokens(4, 6)], record=False)
    with pytest.raises(StateError, match="record=False"):
        st.commit([c], [2])
    st.commit([c], [4])
    d = st.new_lane()
    st.forward([c], [tokens(2, 7)])
    st.forward([d], [tokens(2, 8)])  # another lane's forward while c's is pending: its own slot
    st.commit([c, d], [1, 2])
    with pytest.raises(StateError, match="max_context"):
        st.forward([c], [tokens(40 - c.num_tokens + 1, 9)])
    with pytest.raises(StateError, match="not created by this executor"):
        st.forward([ref.new_lane()], [tokens(1, 9)])  # type: ignore[list-item]
    with pytest.raises(StateError, match="lane 1: token id 384 outside"):
        st.forward([c, d], [tokens(1, 9), torch.tensor([3, VOCAB])])
    with pytest.raises(StateError, match="lane 0: columns must be a non-empty"):
        st.forward([c], [tokens(0, 9)])
    with pytest.raises(StateError, match="twice"):
        st.forward([c, c], [tokens(1, 9), tokens(1, 9)])
    assert not c.is_pending and not d.is_pending
    with pytest.raises(ValueError, match="CUDA"):
        tiny.static(cuda_graphs=True)
    with pytest.raises(ValueError, match="max_context"):
        tiny.static(max_context=10_000)
    with pytest.raises(ValueError, match="power of two"):
        tiny.static(kv_bucket=24)
    assert st.warm_up() == 0  # no graphs on the CPU: nothing to capture


def test_warm_up_static_passes_the_verify_width(tiny: Tiny) -> None:
    """`warm_up_static` (the server's load) calls warm_up on the executors that have one, with the
    verify width, and skips None and executors without it; on the CPU nothing is captured."""
    from ignis.runtime.families.static_rounds import warm_up_static

    st, draft = tiny.static(), tiny.static(max_lanes=2)
    assert warm_up_static(st, tiny.eager(), None, draft, columns=(6,)) == 0
    assert st.column_widths == draft.column_widths == (1, 2, 4, 6, 8)
    with pytest.raises(StateError, match="release_lane"):
        st.release_lane(draft.new_lane())


class _ReplayedGraph:
    """A CPU stand-in for a captured CUDA graph: replay() runs the captured body again and writes its
    outputs into the tensors the capture returned, as a real replay rewrites them in place."""

    def __init__(self, body, outputs) -> None:
        self.body, self.outputs = body, outputs

    def replay(self) -> None:
        for name, value in self.body().items():
            if value.data_ptr() != self.outputs[name].data_ptr():
                self.outputs[name].copy_(value)


def test_graph_bookkeeping_with_a_stand_in_graph(
    tiny: Tiny, ref: LlamaExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graphed path's bookkeeping on the CPU, with a stand-in for the capture (`_ReplayedGraph`):
    one capture per shape, replays after; the logits of every shape come out of one static buffer and
    are copied out (a round's logits survive the next rounds); warm_up captures every shape in the
    scratch slot without touching a lane; the rounds still equal LlamaExecutor's."""
    import ignis.runtime.families.llama_graphs as lg
    from ignis.runtime.families.static_rounds import CapturedRound

    def fake_capture(body, *, device, pool):
        outputs = body()
        return CapturedRound(_ReplayedGraph(body, outputs), outputs)

    monkeypatch.setattr(lg, "capture_round", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    st = tiny.static(max_lanes=3, chunked_prefill=24)  # kv_bucket 16
    st.cuda_graphs = True
    st._allocate(st.max_lanes)  # with the static logits buffer
    lanes, refs = [st.new_lane() for _ in range(3)], [ref.new_lane() for _ in range(3)]
    # chunks (3 lanes, 8 columns, bucket 16), (1, 8, 16), (1, 4, 32): three shapes
    run_both(ref, st, refs, lanes, [tokens(n, 80 + n) for n in (20, 3, 7)], [20, 3, 7], record=False)
    assert (st.num_captures, st.num_replays) == (3, 3)
    kept = st.forward(lanes, [tokens(n, 90 + n) for n in (2, 1, 2)])  # (3, 2, 32)
    first = [x.clone() for x in kept.logits]
    st.commit(lanes, [1, 1, 1])
    for r, shape in enumerate([(1, 2, 2), (2, 2, 1), (8, 1, 1)]):  # replayed twice, then (3, 8, 32)
        st.forward(lanes, [tokens(n, 91 + 3 * r + i) for i, n in enumerate(shape)])
        st.commit(lanes, [1, 1, 1])
    for a, b in zip(kept.logits, first, strict=True):
        assert torch.equal(a, b)  # copied out of the static buffer: the later rounds left it alone
    assert (st.num_captures, st.num_replays) == (5, 7)
    before = [[t.clone() for t in s.kv(layer)] for s in lanes for layer in range(2)]
    # lanes 1-3 x columns 1, 2, 3, 4, 8 at bucket 16, less the two chunk shapes captured already
    assert st.warm_up(columns=(3,), context=16) == 3 * 5 - 2
    after = [list(s.kv(layer)) for s in lanes for layer in range(2)]
    for old, new in zip(before, after, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    for s in lanes:
        st.release_lane(s)
    seqs = [tokens(n, 300 + n) for n in (5, 9, 2)]
    refs = [feed_alone(ref, q) for q in seqs]
    lanes = [feed_alone(st, q) for q in seqs]
    run_both(ref, st, refs, lanes, [tokens(n, 200 + n) for n in (3, 1, 2)], [3, 1, 2])
    assert st.num_captures == 5 + 13  # every shape since came from the warm-up
    # --graph-warmup-context as the hybrid takes it: every KV bucket up to the one holding `context`
    # (16, 32, 64: the 32 one less its 3 shapes captured above), then None: up to the capacity (208)
    assert st.warm_up(context=40) == (15 - 3) + 15
    assert st.warm_up() == 2 * 15  # buckets 128 and 208
    assert st.warm_up(context=200) == 0
    with pytest.raises(ValueError, match="context must be >= 1"):
        st.warm_up(context=0)


# ---- through the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [0, 32])
def test_spec_on_equals_spec_off_through_the_engine(tiny: Tiny, ref: LlamaExecutor, chunked: int) -> None:
    """SpeculativeEngine over the static executor: greedy outputs speculation off, with the test
    drafters (7 drafts: right with p = 0.6, always right, always wrong), ngram and a draft model
    (itself a static executor, kept drafts with rewind) equal LlamaExecutor's speculation-off output;
    lanes finish and free their slots for the waiting ones (5 requests on 3 slots)."""
    from ignis.runtime.drafters.draft_model import DraftModelDrafter
    from ignis.runtime.drafters.ngram import NgramDrafter
    from ignis.runtime.drafters.testing import always_right, always_wrong, right_with_probability

    prompts = [tokens(n, 20 + n).tolist() for n in (3, 17, 9, 70, 1)]
    prompts[2] = prompts[2] * 3  # repeats: ngram proposes
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    refs = {
        tuple(p): r.output_token_ids
        for p, r in zip(prompts, SpeculativeEngine(ref).generate(prompts, greedy), strict=True)
    }
    st = tiny.static(max_lanes=3, max_context=120, chunked_prefill=chunked)
    eager_prefills = _count_calls(st, "_eager_forward")
    off = SpeculativeEngine(st, max_lanes=3).generate(prompts, greedy)
    assert {tuple(p): r.output_token_ids for p, r in zip(prompts, off, strict=True)} == refs
    assert eager_prefills[0] == (1 if chunked else 2)  # the 70-token prompt always; 17 and 27 unless chunked
    assert st.num_free_lanes == 3
    draft = DraftModelDrafter(tiny.static(max_lanes=3, max_context=120))
    assert draft.keeps_drafts
    drafters = [
        right_with_probability(refs, 0.6, vocab_size=VOCAB, seed=3),
        always_right(refs, vocab_size=VOCAB),
        always_wrong(refs, vocab_size=VOCAB, seed=1),
        NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3),
        draft,
    ]
    for drafter in drafters:
        eng = SpeculativeEngine(st, drafter, draft_tokens=7, max_lanes=3)
        got = eng.generate(prompts, greedy)
        assert {tuple(p): r.output_token_ids for p, r in zip(prompts, got, strict=True)} == refs, drafter.name
        assert st.num_free_lanes == 3
        if drafter.name in ("always-right", "draft-model"):  # the target itself drafts: all accepted
            assert eng.metrics.accepted_tokens_total > 2 * eng.metrics.rounds_total, drafter.name
    assert draft.executor.num_free_lanes == 3  # the drafter gave its lanes back
    assert SpeculativeEngine(st).max_context == 120  # the engine caps its context to the pool
    with pytest.raises(ConfigError, match="max_context"):
        SpeculativeEngine(st, max_context=121)


def test_draft_model_stops_drafting_at_its_pool_end(tiny: Tiny, ref: LlamaExecutor) -> None:
    """A draft model whose static executor holds fewer tokens than the target's context stops drafting
    where its lanes end (plain decode rows) instead of failing the round."""
    from ignis.runtime.drafters.draft_model import DraftModelDrafter

    prompt = tokens(20, 5).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = SpeculativeEngine(ref).generate([prompt], greedy)[0].output_token_ids
    draft = DraftModelDrafter(tiny.static(max_lanes=1, max_context=32))
    assert draft.max_positions == 32
    eng = SpeculativeEngine(tiny.static(max_lanes=1, max_context=120), draft, draft_tokens=4)
    assert eng.generate([prompt], greedy)[0].output_token_ids == want
    assert eng.metrics.accepted_tokens_total > eng.metrics.rounds_total


def test_checkpoints_restore_across_executors(tiny: Tiny, ref: LlamaExecutor) -> None:
    """A lane's state captured from the static executor restores into the eager one and back
    (canonical layout), also truncated to a prefix; the restored lanes continue like a cold one."""
    st = tiny.static(max_lanes=2)
    seq = tokens(30, 21)
    lane = feed_alone(st, seq)
    cp = capture_model_state(st, lane)
    assert cp["attn.keys"].shape == (
        tiny.config.num_hidden_layers,
        tiny.config.num_key_value_heads,
        30,
        tiny.config.head_dim,
    )
    for m in (30, 17):
        into_eager = ref.new_lane()
        restore_model_state(ref, into_eager, cp, m)
        back = st.new_lane()
        restore_model_state(st, back, capture_model_state(ref, into_eager), m)
        cold = feed_alone(ref, seq[:m])
        assert_same_state(tiny.config, back, cold)
        nxt = tokens(5, 22)
        run_both(ref, st, [cold], [back], [nxt], [5])
        st.release_lane(back)
    with pytest.raises(StateError, match="fresh"):
        restore_model_state(st, lane, cp, 30)


def test_pools_built_under_inference_mode_take_restores_outside_it(tiny: Tiny, ref: LlamaExecutor) -> None:
    """An executor built inside `torch.inference_mode()` (a caller's context) keeps normal pool tensors:
    a checkpoint restore outside inference mode writes them, also after the pools grew there."""
    seq = tokens(10, 3)
    with torch.inference_mode():
        st = tiny.static(max_lanes=1)
        lane = feed_alone(st, seq)
        grown = st.new_lane()  # the pools grow inside inference mode
    cp = capture_model_state(st, lane)
    st.release_lane(grown)
    into = st.new_lane()
    restore_model_state(st, into, cp, 10)
    expect = feed_alone(ref, seq)
    assert_same_state(tiny.config, into, expect)
    run_both(ref, st, [expect], [into], [tokens(3, 4)], [3])


def test_prefix_reuse_with_the_static_executor(tiny: Tiny, ref: LlamaExecutor) -> None:
    """Prompt checkpoints through the engine on the static executor: a request sharing a prefix
    restores it (block-aligned, attention-only truncation) and its greedy output equals a cold
    prefill's; a repeated prompt takes its first token from the stored logits."""
    from ignis.runtime.prefix_cache import PrefixCache

    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    st = tiny.static(max_lanes=2, max_context=150)
    cache = PrefixCache(card_bytes=1 << 30, host_bytes=1 << 30, block_size=16)
    eng = SpeculativeEngine(st, prefix_cache=cache, max_prefill_tokens=0)
    p1 = tokens(50, 31).tolist()
    p2 = p1[:40] + tokens(7, 32).tolist()
    cold = {tuple(p): SpeculativeEngine(ref).generate([p], greedy)[0].output_token_ids for p in (p1, p2)}
    r1 = eng.generate([p1], greedy)[0]
    r2 = eng.generate([p2], greedy)[0]
    r3 = eng.generate([p1], greedy)[0]
    assert (r1.num_cached_tokens, r2.num_cached_tokens, r3.num_cached_tokens) == (0, 32, 50)
    assert r1.output_token_ids == r3.output_token_ids == cold[tuple(p1)]
    assert r2.output_token_ids == cold[tuple(p2)]
    assert st.num_free_lanes == 2


def test_make_executor_keeps_the_eager_executor_on_the_cpu(tmp_path: Path) -> None:
    """An artifact's llama executor on the CPU stays LlamaExecutor unless asked; cuda_graphs=True on a
    CPU device is refused."""
    from ignis.runtime.artifact import load_artifact

    folder = _tiny_artifact(tmp_path)
    with load_artifact(folder) as art:
        ex = art.make_executor(device="cpu", dtype=torch.float32)
        assert type(ex) is LlamaExecutor
        with pytest.raises(ValueError, match="CUDA"):
            art.make_executor(device="cpu", cuda_graphs=True)


def _tiny_artifact(base: Path, **overrides) -> Path:
    """A `.ninfer` artifact of a tiny random llama for the "cpu" card with no compiled modules (q4
    weights, torch linears: it serves on the CPU and on CUDA alike)."""
    from ignis.compiler.build import build_artifact

    ckpt = hf_tiny.save_tiny(
        hf_tiny.tiny_model("llama", seed=0, **overrides), base / "ckpt", tokenizer=hf_tiny.tiny_tokenizer()
    )
    (base / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = []\n')
    res = build_artifact(
        card="cpu", model=ckpt, recipe=base / "r.toml", out=base / "art", progress=False, echo=lambda _l: None
    )
    assert res.out is not None
    return Path(res.out)


# ---- GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_replay_like_the_eager_executor(tiny: Tiny, dtype: torch.dtype) -> None:
    """On CUDA with graphs: prefill (eager, chunked and static rounds), verify rounds with mixed
    columns and partial commits, lanes leaving and joining, match LlamaExecutor on CUDA (float32 to
    1e-4, greedy tokens equal; bf16 to bf16 rounding); shapes captured once and replayed."""
    ex_ref = LlamaExecutor(tiny.config, tiny.weights, device="cuda", dtype=dtype)
    st = StaticLlamaExecutor(
        tiny.config, tiny.weights, device="cuda", dtype=dtype, max_lanes=4, max_context=200, kv_bucket=16
    )
    assert st.cuda_graphs and st.chunked_prefill == 32
    assert st.sdpa_backend == torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION
    f32 = dtype == torch.float32
    tol = {"atol": 1e-4, "rtol": 1e-4} if f32 else {"atol": 0.1, "rtol": 0.05}
    prompts = [tokens(70, 1).cuda(), tokens(20, 2).cuda(), tokens(5, 3).cuda()]
    ra, sa = [ex_ref.new_lane() for _ in prompts], [st.new_lane() for _ in prompts]
    for p_ra, p_sa, p in zip(ra, sa, prompts, strict=True):  # eager, chunked, static
        a = ex_ref.forward([p_ra], [p], logits="last", record=False)
        b = st.forward([p_sa], [p], logits="last", record=False)
        torch.testing.assert_close(b.logits[0], a.logits[0], **tol)
        ex_ref.commit([p_ra], [p.numel()])
        st.commit([p_sa], [p.numel()])
    shapes = [[1, 8, 3], [4, 1, 8], [1, 1, 1], [8, 8, 8], [2, 7, 1]] * 2
    keeps = [[1, 5, 0], [4, 1, 2], [1, 1, 1], [8, 3, 1], [2, 7, 1]] * 2
    for r, (shape, keep) in enumerate(zip(shapes, keeps, strict=True)):
        cols = [tokens(n, 100 + 10 * r + i).cuda() for i, n in enumerate(shape)]
        a = ex_ref.forward(ra, cols, output_hidden_states=True)
        b = st.forward(sa, cols, output_hidden_states=True)
        for la, lb, ha, hb in zip(a.logits, b.logits, a.hidden_states, b.hidden_states, strict=True):
            torch.testing.assert_close(lb, la, **tol)
            torch.testing.assert_close(hb, ha, **tol)
            if f32:
                assert torch.equal(lb.argmax(-1), la.argmax(-1))
        ex_ref.commit(ra, keep)
        st.commit(sa, keep)
    assert st.num_captures > 0 and st.num_replays >= len(shapes)
    captured = st.num_captures
    cols = [tokens(n, 999 + i).cuda() for i, n in enumerate([2, 7, 1])]  # the last round's shape: replayed
    st.forward(sa, cols, output_hidden_states=True)
    st.commit(sa, [1, 1, 1])
    assert st.num_captures == captured
    for layer in range(tiny.config.num_hidden_layers):
        for x, y in zip(sa[0].kv(layer), ref_kv(ra[0], layer), strict=True):
            assert x.shape[1] == y.shape[1] + 1
    # engine: speculation off equals the eager executor's output, greedy, float32 only
    if f32:
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        ps = [tokens(n, 7 + n).tolist() for n in (5, 30, 12)]
        want = [r.output_token_ids for r in SpeculativeEngine(ex_ref).generate(ps, greedy)]
        st2 = StaticLlamaExecutor(tiny.config, tiny.weights, device="cuda", max_lanes=4, max_context=200)
        assert st2.warm_up() > 0
        assert [r.output_token_ids for r in SpeculativeEngine(st2).generate(ps, greedy)] == want


@pytest.mark.gpu
@needs_cuda
def test_first_request_is_as_fast_as_the_tenth(tmp_path: Path) -> None:
    """A small random llama built as an artifact, its executor from `make_executor` on CUDA (the
    static, graphed route) and warmed up as the server's load does (`warm_up`: the load-time
    capture of every round shape of every KV bucket, which belongs to load, not to a request):
    the first generate of a shape takes at most 1.5x the tenth of the same shape."""
    from ignis.runtime.artifact import load_artifact

    folder = _tiny_artifact(
        tmp_path, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4
    )
    with load_artifact(folder) as art:
        ex = art.make_executor(device="cuda", dtype=torch.bfloat16, max_lanes=8)
        assert isinstance(ex, StaticLlamaExecutor) and ex.cuda_graphs
        assert ex.warm_up() > 0  # load
        captured = ex.num_captures
        engine = SpeculativeEngine(ex, max_lanes=8)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        prompts = [tokens(24, 100 + i, 4096).tolist() for i in range(4)]
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            assert all(len(r.output_token_ids) == 64 for r in out)
        assert ex.num_captures == captured, "a request captured a graph the load did not"
        assert times[0] <= 1.5 * times[9], [round(t * 1e3, 1) for t in times]


@pytest.mark.gpu
@needs_cuda
def test_make_executor_takes_the_static_route_on_cuda(tmp_path: Path) -> None:
    """make_executor on CUDA: StaticLlamaExecutor by default (float32 and bf16); the eager
    LlamaExecutor with cuda_graphs=False; greedy decoding equal between them (float32)."""
    from ignis.runtime.artifact import load_artifact

    with load_artifact(_tiny_artifact(tmp_path)) as art:
        static = art.make_executor(device="cuda", dtype=torch.float32, max_lanes=2, max_context=256)
        eager = art.make_executor(device="cuda", dtype=torch.float32, cuda_graphs=False)
        assert isinstance(static, StaticLlamaExecutor) and static.max_context == 256
        assert type(eager) is LlamaExecutor
        greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        ps = [tokens(9, 1).tolist(), tokens(40, 2).tolist()]
        want = [r.output_token_ids for r in SpeculativeEngine(eager).generate(ps, greedy)]
        assert [r.output_token_ids for r in SpeculativeEngine(static).generate(ps, greedy)] == want
        bf16 = art.make_executor(device="cuda", dtype=torch.bfloat16, max_lanes=2)
        assert isinstance(bf16, StaticLlamaExecutor) and bf16.dtype == torch.bfloat16
        assert all(len(r.output_token_ids) == 20 for r in SpeculativeEngine(bf16).generate(ps, greedy))


@pytest.mark.gpu
@needs_cuda
def test_served_engine_captures_its_rounds_at_load(tmp_path: Path) -> None:
    """The server's engine factory (`ArtifactSource.load(...).make_engine`, what `ignis-run` builds at
    start) returns a static llama executor whose round shapes are captured already, for the target
    and for a draft model's executor; serving a request then captures nothing new."""
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    art = _tiny_artifact(tmp_path)
    for spec in (SpecDefaults("off"), SpecDefaults("draft-model", 3)):
        source = (
            ArtifactSource(art, draft_model=art) if spec.backend == "draft-model" else ArtifactSource(art)
        )
        model = source.load(ModelSettings(spec, device="cuda"))
        try:
            engine = model.make_engine(4, SpeculativeMetrics())
            ex = engine.executor
            # lanes 1-4 x columns 1, 2, 4, 8 (draft_tokens + 1 = 4 among them), each over the KV
            # buckets up to --graph-warmup-context (the same buckets for every shape)
            assert isinstance(ex, StaticLlamaExecutor) and ex.num_captures == len(ex._graphs)
            shapes = {(key[0], key[1]) for key in ex._graphs}
            buckets = {key[2] for key in ex._graphs}
            assert len(shapes) == 4 * 4 and ex.num_captures == len(shapes) * len(buckets)
            executors = [ex]
            if spec.backend == "draft-model":
                executors.append(engine.drafter.executor)
                assert engine.drafter.executor.num_captures > 0
            before = [e.num_captures for e in executors]
            greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            out = engine.generate([tokens(6, 1).tolist(), tokens(3, 2).tolist()], greedy)
            assert all(len(r.output_token_ids) == 16 for r in out)
            assert [e.num_captures for e in executors] == before
        finally:
            model.close()
