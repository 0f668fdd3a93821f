"""`StaticHybridExecutor.warm_up` (load-time capture of every round shape) and the static output
buffers its graphs share, with the columns padded to `column_widths`.

On the CPU there are no CUDA graphs: the capture is replaced by a stand-in (`_ReplayedGraph`: a
replay runs the captured body again over the same buffers), so the graphed path's bookkeeping (keys,
shared output buffers, copies out, warm-up rounds in free slots) runs here, and its results are
compared bit for bit with the eager static path. The GPU tests time the first served request against
the tenth after the server's load.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from hf_tiny_hybrid import TinyHybrid, make_tiny_hybrid  # tests/ is on pytest's pythonpath
from hybrid_graph_checks import tokens

from ignis.runtime.errors import StateError
from ignis.runtime.families.hybrid_executor import HybridExecutor
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.families.static_rounds import CapturedRound, warm_up_static

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyHybrid:
    torch.set_num_threads(1)
    return make_tiny_hybrid("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))


def static(tiny: TinyHybrid, **kw) -> StaticHybridExecutor:
    kw = {"max_lanes": 4, "max_context": 200, "kv_bucket": 16, "chunked_prefill": 32, **kw}
    return StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), **kw)


class _ReplayedGraph:
    """A CPU stand-in for a captured CUDA graph: replay() runs the captured body again (it writes its
    outputs into the buffers the capture returned, as a real replay rewrites them in place)."""

    def __init__(self, body) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Captures go to `_ReplayedGraph`; returns the list of the bodies' capture count (one element)."""
    import ignis.runtime.families.hybrid_graphs as hg

    count = [0]

    def fake_capture(body, *, device, pool, stream=None):
        count[0] += 1
        return CapturedRound(_ReplayedGraph(body), body())

    monkeypatch.setattr(hg, "capture_round", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    return count


def graphed(tiny: TinyHybrid, **kw) -> StaticHybridExecutor:
    """A static executor on the CPU taking the graphed path (with the stand-in capture)."""
    ex = static(tiny, **kw)
    ex.cuda_graphs = True
    return ex


def lane_state(config, ex: StaticHybridExecutor, lane) -> list[torch.Tensor]:
    """Copies of everything a lane's future depends on: committed KV, conv and recurrent states."""
    out = [torch.tensor(lane.num_tokens)]
    for layer in range(config.num_hidden_layers):
        if config.is_full_attention(layer):
            out += [t.clone() for t in lane.kv(layer)]
        else:
            out += [lane.conv_state(layer).clone(), lane.recurrent_state(layer).clone()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and torch.equal(x, y)


def step(ex, lanes, columns, keeps, **kw):
    """forward + commit; returns the forward's output (copies)."""
    out = ex.forward(lanes, columns, **kw)
    ex.commit(lanes, keeps)
    return out


def same_output(a, b) -> None:
    for name in ("logits", "hidden_states", "taps"):
        xa, xb = getattr(a, name), getattr(b, name)
        assert (xa is None) == (xb is None)
        for ya, yb in zip(xa or [], xb or [], strict=True):
            assert ya.shape == yb.shape and torch.equal(ya, yb)


ASKS = {"output_hidden_states": True, "tap_layers": (1, 3)}


def test_warm_up_changes_no_lane_and_the_rounds_after_equal_the_eager_path(
    tiny: TinyHybrid, stand_in: list[int]
) -> None:
    """Lanes with real state (prefilled, a verify round committed part-way), then warm_up while they
    live (its rounds run in the one free slot): every lane's KV, conv and float32 recurrent state is
    bit for bit what it was; the next rounds (mixed columns, partial commits, a chunked prefill of a
    new lane) equal, bit for bit, the same rounds on an executor that never warmed up (the eager
    static path: no graphs), and capture nothing the warm-up did not."""
    c, vocab = tiny.config, tiny.config.vocab_size
    ex, plain = graphed(tiny), static(tiny)
    lanes, refs = [ex.new_lane() for _ in range(3)], [plain.new_lane() for _ in range(3)]
    prompts = [tokens(n, 10 + n, vocab) for n in (21, 5, 12)]  # chunked (8 + 8 + 5), static, chunked
    for e, ls in ((ex, lanes), (plain, refs)):
        step(e, ls, prompts, [p.numel() for p in prompts], record=False, logits="last", **ASKS)
        step(e, ls, [tokens(n, 40 + n, vocab) for n in (3, 1, 8)], [2, 1, 5], **ASKS)
    before = [lane_state(c, ex, s) for s in lanes]
    captured = ex.num_captures
    # lanes 1..4 x widths 1, 2, 3, 4, 8 x buckets 16, 32, 64 (context 40), less those captured above
    n = ex.warm_up(columns=(3,), context=40, hidden=True, taps=(1, 3))
    assert n == 4 * 5 * 3 - captured and ex.num_captures == stand_in[0] == 4 * 5 * 3
    assert ex.column_widths == (1, 2, 3, 4, 8)
    for s, old in zip(lanes, before, strict=True):
        same(lane_state(c, ex, s), old)
    plain.warm_up(columns=(3,))  # no graphs: the widths only, nothing run
    assert plain.num_captures == 0 and plain.column_widths == ex.column_widths
    rounds = [((3, 1, 2), (3, 1, 1)), ((8, 4, 1), (1, 4, 1)), ((1, 1, 1), (1, 1, 1)), ((2, 3, 1), (2, 0, 1))]
    for r, (shape, keep) in enumerate(rounds):
        cols = [tokens(k, 100 + 10 * r + i, vocab) for i, k in enumerate(shape)]
        same_output(step(ex, lanes, cols, list(keep), **ASKS), step(plain, refs, cols, list(keep), **ASKS))
        for s, p in zip(lanes, refs, strict=True):
            same(lane_state(c, ex, s), lane_state(c, plain, p))
    late, late_ref = ex.new_lane(), plain.new_lane()  # the last slot: a chunked prefill of 11
    prompt = tokens(11, 7, vocab)
    out = step(ex, [late], [prompt], [11], record=False, logits="last", **ASKS)
    same_output(out, step(plain, [late_ref], [prompt], [11], record=False, logits="last", **ASKS))
    same(lane_state(c, ex, late), lane_state(c, plain, late_ref))
    assert ex.num_captures == 4 * 5 * 3, "a round captured a shape the warm-up did not"
    # past the context bound (a lane at 60 + 8 tokens reads bucket 128): captured on first use
    long = [tokens(60, 3, vocab)]
    step(ex, [late], long, [60], record=False, **ASKS)
    step(plain, [late_ref], long, [60], record=False, **ASKS)
    same_output(
        step(ex, [late], [tokens(8, 4, vocab)], [8], **ASKS),
        step(plain, [late_ref], [tokens(8, 4, vocab)], [8], **ASKS),
    )
    assert ex.num_captures == 4 * 5 * 3 + 1


@pytest.mark.parametrize("spec", ["off", "drafts"])
def test_an_engine_after_warm_up_captures_nothing(tiny: TinyHybrid, stand_in: list[int], spec: str) -> None:
    """Through `SpeculativeEngine` (greedy; prompts short, chunked and long, more prompts than lanes;
    speculation off, or 3 drafts a round each right with p = 0.7): after warm_up (as the server's load
    calls it) every round replays a shape the warm-up captured, and the output equals the eager
    static path's with speculation off (no graphs, no warm-up)."""
    from ignis.runtime.drafters.testing import right_with_probability
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.sampling import SamplingParams

    vocab = tiny.config.vocab_size
    ex, plain = graphed(tiny), static(tiny)
    verify = () if spec == "off" else (4,)
    # lanes 1..4 x widths 1, 2, 4, 8 x buckets 16, 32, 64, 128 and the capacity 208
    assert warm_up_static(ex, columns=verify) == 4 * 4 * 5
    prompts = [tokens(n, 5 + n, vocab).tolist() for n in (6, 24, 3, 30, 51)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [r.output_token_ids for r in SpeculativeEngine(plain, max_lanes=4).generate(prompts, greedy)]
    shapes, inner = set(), ex._run_round

    def recorded(lanes, n, bucket, hidden, taps):
        shapes.add((lanes, n, bucket))
        return inner(lanes, n, bucket, hidden, taps)

    ex._run_round = recorded
    kw = {}
    if spec == "drafts":
        refs = {tuple(p): list(w) for p, w in zip(prompts, want, strict=True)}
        kw = {"drafter": right_with_probability(refs, 0.7, vocab_size=vocab, seed=1), "draft_tokens": 3}
    engine = SpeculativeEngine(ex, max_lanes=4, **kw)
    assert [r.output_token_ids for r in engine.generate(prompts, greedy)] == want
    assert ex.num_captures == 4 * 4 * 5, "a request captured a shape the warm-up did not"
    # prefill chunks of 8 columns and decode rounds of 1; verify rounds of 4 (and fewer drafts where
    # the reference ends: padded to 2 or 4)
    widths = {n for _, n, _ in shapes}
    if spec == "off":
        assert widths == {1, 8}
    else:
        assert {1, 4, 8} <= widths
    assert {b for _, _, b in shapes} >= {16, 32, 64, 128}


def test_graphs_share_one_set_of_output_buffers(tiny: TinyHybrid, stand_in: list[int]) -> None:
    """Every captured shape writes its logits, hidden states and taps into the first rows of one
    static buffer each (max_lanes x max_columns rows); a round's returned outputs are copies that
    later rounds leave alone."""
    vocab, h = tiny.config.vocab_size, tiny.config.hidden_size
    ex = graphed(tiny, max_lanes=3)
    assert ex.warm_up(context=16, hidden=True, taps=(0,)) == 3 * 4  # lanes 1..3 x widths 1, 2, 4, 8
    assert ex.warm_up(context=16) == 3 * 4  # another output set: other shapes
    bufs = ex._outputs
    assert set(bufs) == {"logits", "hidden", "taps1"}
    assert bufs["logits"].shape == (3 * 8, vocab) and bufs["logits"].dtype == torch.float32
    assert bufs["hidden"].shape == (24, h) and bufs["taps1"].shape == (24, h)
    for (lanes, n, _bucket, hidden, taps), entry in ex._graphs.items():
        assert taps == ((0,) if hidden else ())
        assert set(entry.outputs) == {"logits"} | ({"hidden", "taps"} if hidden else set())
        for name, t in entry.outputs.items():
            buf = bufs["taps1" if name == "taps" else name]
            assert t.data_ptr() == buf.data_ptr() and t.shape[0] == lanes * n
    lanes = [ex.new_lane() for _ in range(2)]
    first = ex.forward(lanes, [tokens(4, 1, vocab), tokens(2, 2, vocab)], **ASKS | {"tap_layers": (0,)})
    kept = [x.clone() for x in first.logits + first.hidden_states + first.taps]
    ex.commit(lanes, [4, 2])
    step(
        ex,
        lanes,
        [tokens(8, 3, vocab), tokens(8, 4, vocab)],
        [8, 8],
        output_hidden_states=True,
        tap_layers=(0,),
    )
    for a, b in zip(first.logits + first.hidden_states + first.taps, kept, strict=True):
        assert torch.equal(a, b)
    assert ex.num_captures == 24  # both rounds replayed warm-up shapes


def test_rounds_are_padded_to_the_column_widths(tiny: TinyHybrid) -> None:
    """A round of 3 columns runs as 4 (the default widths: powers of two and max_columns), as 3 once
    warm_up added the width; the padded round's logits and committed states equal HybridExecutor's
    (the dummy columns are discarded)."""
    vocab, c = tiny.config.vocab_size, tiny.config
    ref = HybridExecutor(tiny.config, tiny.canonical_tensors())
    ex = static(tiny, max_lanes=2)
    assert ex.column_widths == (1, 2, 4, 8)
    widths, inner = [], ex._body

    def body(ids, pos, slots, bucket, **kw):
        widths.append(int(pos.shape[1]))
        return inner(ids, pos, slots, bucket, **kw)

    ex._body = body
    lane, rl = ex.new_lane(), ref.new_lane()
    for cols, keep, width in ((tokens(3, 1, vocab), 3, 4), (tokens(3, 2, vocab), 2, 3)):
        a, b = ex.forward([lane], [cols]), ref.forward([rl], [cols])
        assert widths[-1] == width and a.logits[0].shape == (3, vocab)
        torch.testing.assert_close(a.logits[0], b.logits[0], atol=1e-4, rtol=1e-4)
        ex.commit([lane], [keep])
        ref.commit([rl], [keep])
        ex.warm_up(columns=(3,))
    for layer in range(c.num_hidden_layers):
        if not c.is_full_attention(layer):
            torch.testing.assert_close(
                lane.recurrent_state(layer), rl.recurrent_state(layer), atol=1e-5, rtol=1e-5
            )
    with pytest.raises(ValueError, match="column_widths"):
        static(tiny, column_widths=(0, 4))
    assert static(tiny, column_widths=range(1, 9)).column_widths == tuple(range(1, 9))


def test_warm_up_refuses_what_would_touch_a_lane(tiny: TinyHybrid, stand_in: list[int]) -> None:
    """A pending static round, or no free slot: StateError (nothing captured); bad arguments:
    ValueError."""
    vocab = tiny.config.vocab_size
    ex = graphed(tiny, max_lanes=2)
    lanes = [ex.new_lane(), ex.new_lane()]
    with pytest.raises(StateError, match="every lane slot"):
        ex.warm_up(context=16)
    ex.release_lane(lanes[1])
    ex.forward(lanes[:1], [tokens(2, 1, vocab)])
    with pytest.raises(StateError, match="pending"):
        ex.warm_up(context=16)
    assert ex.num_captures == 1  # the round's own
    ex.commit(lanes[:1], [2])
    for kw, match in (
        ({"columns": (9,)}, "column count"),
        ({"context": 0}, "context"),
        ({"taps": (4,)}, "tap layer"),
    ):
        with pytest.raises(ValueError, match=match):
            ex.warm_up(**kw)
    assert ex.warm_up(context=16) == 2 * 4 - 1


def test_warm_up_static_passes_what_each_warm_up_takes() -> None:
    """`warm_up_static` (the server's load) passes the verify width to every warm_up, and context /
    hidden / taps only to those that take them (and only when set); None and executors without
    warm_up are skipped."""
    calls: list = []

    class Full:
        def warm_up(self, *, columns=(), context=None, hidden=False, taps=()):
            calls.append(("full", columns, context, hidden, taps))
            return 2

    class Narrow:
        def warm_up(self, *, columns=()):
            calls.append(("narrow", columns))
            return 1

    assert warm_up_static(Full(), None, object(), Narrow(), columns=(4,), context=64, taps=[1, 2]) == 3
    assert calls == [("full", (4,), 64, False, (1, 2)), ("narrow", (4,))]
    calls.clear()
    assert warm_up_static(Full(), columns=()) == 2
    assert calls == [("full", (), None, False, ())]


# the recording model source of the --graph-warmup-context test (one copy, test_hybrid_graphs')
from test_hybrid_graphs import _Loaded, _RecordingSource, recording_source  # noqa: E402, F401


@pytest.mark.parametrize(("flag", "expect"), [((), None), (("--graph-warmup-context", "2048"), 2048)])
def test_ignis_run_passes_the_graph_warmup_context(flag: tuple[str, ...], expect, tmp_path: Path) -> None:
    """`--graph-warmup-context` reaches the model settings (unset: None, the whole context); 0 is a
    usage error before any load; ModelSettings refuses a bad value with ConfigError."""
    from click.testing import CliRunner

    from ignis.runtime import cli
    from ignis.runtime.errors import ConfigError
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.model import ModelSettings

    _RecordingSource.settings.clear()
    args = ["--model-factory", f"{__name__}:recording_source", "--socket", str(tmp_path / "s"), *flag]
    with pytest.raises(_Loaded):
        CliRunner().invoke(cli.main, args, catch_exceptions=False)
    (settings,) = _RecordingSource.settings
    assert settings.graph_warmup_context == expect
    bad = CliRunner().invoke(cli.main, [*args[:4], "--graph-warmup-context", "0"])
    assert bad.exit_code == 2 and "graph-warmup-context" in bad.output
    assert len(_RecordingSource.settings) == 1
    for value in (0, -5, 1.5, True):
        with pytest.raises(ConfigError, match="graph_warmup_context"):
            ModelSettings(SpecDefaults("off"), graph_warmup_context=value)


def _tiny_hybrid_artifact(root: Path) -> Path:
    """A tiny `qwen3_5` artifact for the `cpu` card with a grafted 2-layer DFlash2 drafter (as
    tests/runtime/server/server_helpers.py builds it, but with no compiled modules: torch linears, so
    it serves on the CPU and on CUDA alike), under `root`."""
    import hf_tiny

    from ignis.compiler import build
    from ignis.tools.make_test_drafter import make_dflash2_drafter

    make_tiny_hybrid("qwen3_5", root / "qwen3_5")
    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(root / "qwen3_5")
    make_dflash2_drafter(root / "qwen3_5", root / "dflash2", num_layers=2, dtype="float32")
    recipe = root / "r.toml"
    recipe.write_text('name = "tiny-hybrid"\n[modules]\nwidths = []\n')
    res = build.build_artifact(
        card="cpu",
        model=root / "qwen3_5",
        drafter=root / "dflash2",
        recipe=recipe,
        out=root / "tiny-hybrid",
        progress=False,
        echo=lambda _line: None,
    )
    assert res.out is not None
    return Path(res.out)


@pytest.mark.parametrize("backend", ["off", "dflash2"])
def test_the_server_load_warms_the_target_with_the_drafters_outputs(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's engine factory calls `warm_up_static` on the target with the verify width, the
    settings' graph_warmup_context and the output set its drafter asks every forward for (DFlash2:
    its tap layers), on a draft model's executor (none here) without them, and on the drafter itself
    (a static MTP head captures its shapes there) with the verify width and the context."""
    import ignis.runtime.server.artifact_source as src
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.model import ModelSettings

    calls: list = []
    monkeypatch.setattr(src, "warm_up_static", lambda *exs, **kw: calls.append((exs, kw)) or 0)
    spec = SpecDefaults("off") if backend == "off" else SpecDefaults("dflash2", 3)
    model = src.ArtifactSource(_tiny_hybrid_artifact(tmp_path)).load(
        ModelSettings(spec, device="cpu", graph_warmup_context=300)
    )
    try:
        engine = model.make_engine(2, SpeculativeMetrics())
        (target, target_kw), (draft, draft_kw), (head, head_kw) = calls
        assert target == (engine.executor,) and draft == (None,) and head == (engine.drafter,)
        taps = () if backend == "off" else tuple(engine.drafter.tap_layers)
        assert backend == "off" or taps
        verify = () if backend == "off" else (4,)
        assert target_kw == {"columns": verify, "context": 300, "hidden": False, "taps": taps}
        assert draft_kw == {"columns": verify}
        assert head_kw == {"columns": verify, "context": 300}
    finally:
        model.close()


# ---- GPU --------------------------------------------------------------------------------------------


def _served(tmp_path: Path, spec) -> tuple:
    """(model, engine) as `ignis-run` builds them at start for the tiny qwen3_5 artifact (a grafted
    DFlash2 drafter) on CUDA."""
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    art = _tiny_hybrid_artifact(tmp_path)
    model = ArtifactSource(art).load(ModelSettings(spec, device="cuda", max_context=512))
    return model, model.make_engine(4, SpeculativeMetrics())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["off", "dflash2"])
def test_served_hybrid_engine_captures_its_rounds_at_load(tmp_path: Path, backend: str) -> None:
    """The server's engine factory captures the hybrid target's round shapes at load (lanes 1..4 x
    widths x every KV bucket, with the taps the DFlash2 drafter asks for); serving requests (short
    and chunked prompts, speculation off and on) then captures nothing; the first request takes at
    most 1.5x the tenth."""
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.sampling import SamplingParams

    spec = SpecDefaults("off") if backend == "off" else SpecDefaults("dflash2", 3)
    model, engine = _served(tmp_path, spec)
    try:
        ex = engine.executor
        assert isinstance(ex, StaticHybridExecutor) and ex.cuda_graphs
        assert ex.column_widths == (1, 2, 4, 8)  # dflash2: draft_tokens + 1 = 4 among them
        # lanes 1..4 x 4 widths x buckets 256, 512, 520 (capacity: 512 + max_columns)
        assert ex.num_captures == 4 * 4 * 3
        captured = ex.num_captures
        vocab = ex.config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
        prompts = [tokens(n, 100 + n, vocab).tolist() for n in (5, 24, 3, 30)]
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            assert all(len(r.output_token_ids) == 96 for r in out)
        assert ex.num_captures == captured, "a request captured a graph the load did not"
        if backend == "off":  # the DFlash2 drafter runs eagerly: its own first-call costs are not ours
            assert times[0] <= 1.5 * times[9], [round(t * 1e3, 1) for t in times]
    finally:
        model.close()


@pytest.mark.gpu
@needs_cuda
def test_captured_shapes_share_the_output_memory(tiny: TinyHybrid) -> None:
    """On CUDA, with a vocabulary of 65,536 (the tiny model's head widened): capturing every other
    shape of one KV bucket (lanes 1..4 x widths 1, 2, 4, 8) after the largest keeps no memory
    allocated (per-shape outputs would hold 4 bytes x vocab x rows: 31 MB), and the reserved memory
    grows by less than that too (one side stream for the captures' warm-up runs, cache emptied after);
    every graph's logits are the first rows of one buffer."""
    import dataclasses

    vocab = 65_536
    config = dataclasses.replace(tiny.config, vocab_size=vocab)
    gen = torch.Generator().manual_seed(3)
    weights = dict(tiny.canonical_tensors())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = torch.randn(vocab, config.hidden_size, generator=gen) / config.hidden_size**0.5
    ex = StaticHybridExecutor(
        config, weights, device="cuda", dtype=torch.bfloat16, max_lanes=4, max_context=200, kv_bucket=16
    )
    assert ex.cuda_graphs
    lanes = [ex.new_lane() for _ in range(4)]
    step(ex, lanes, [tokens(8, i, 320).cuda() for i in range(4)], [8] * 4)  # the largest shape: 4 x 8
    for s in lanes:
        ex.release_lane(s)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert ex.warm_up(context=16) == 4 * 4 - 1
    torch.cuda.synchronize()
    per_shape = 4 * vocab * (10 * 15 - 4 * 8)  # the logits rows of every shape but the largest
    assert torch.cuda.memory_allocated() - allocated < per_shape / 8
    assert torch.cuda.memory_reserved() - reserved < per_shape / 2
    logits = ex._outputs["logits"]
    assert logits.shape == (32, vocab)
    assert all(e.outputs["logits"].data_ptr() == logits.data_ptr() for e in ex._graphs.values())
