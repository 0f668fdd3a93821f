"""No Python garbage collection while a CUDA graph is captured (`ignis.runtime.kernels.tvm_runtime.capture`).

A dead engine whose executor sits in a reference cycle keeps its `torch.cuda.CUDAGraph` objects until
the cyclic collector runs. Any allocation of a Python object can start a collection; one that ran
while another graph was being captured destroyed those graphs mid-capture (``cudaGraphExecDestroy``
is forbidden then) and invalidated the capture: the server's MTP head, loaded after an engine of
the same test was dropped, logged 24 "operation not permitted when stream is capturing (function
reset)" warnings and turned its graphs off (H200, issue 22 / 25). A capture that fails must also
leave the thread's streams and the caching allocator as they were (torch's ``capture_end`` raises
before its own clean-up). On the CPU the CUDA calls are replaced by stand-ins that record whether a
graph object was finalized while a capture was open; the GPU tests (marked gpu) use real graphs.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hf_tiny_hybrid import make_tiny_hybrid  # tests/ is on pytest's pythonpath
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.kernels import tvm_runtime
from ignis.runtime.kernels.tvm_runtime import capture, gc_paused


class _Capturing:
    """Shared record of the stand-ins: whether a capture is open, what was finalized during one."""

    def __init__(self) -> None:
        self.open = False
        self.captures = 0
        self.dropped_while_capturing: list[str] = []
        self.dropped: list[str] = []


class _FakeGraph:
    """A stand-in for `torch.cuda.CUDAGraph`: destroying one during a capture is what CUDA refuses."""

    def __init__(self, rec: _Capturing, name: str = "graph") -> None:
        self.rec, self.name = rec, name

    def replay(self) -> None:
        pass

    def __del__(self) -> None:
        self.rec.dropped.append(self.name)
        if self.rec.open:
            self.rec.dropped_while_capturing.append(self.name)


class _DeadEngine:
    """An unreachable reference cycle holding graphs (as a dropped engine's executor does)."""

    def __init__(self, rec: _Capturing, n: int) -> None:
        self.me = self
        self.graphs = {i: _FakeGraph(rec, f"dead{i}") for i in range(n)}


def _fake_graph_context(rec: _Capturing, garbage_per_capture: int = 3):
    """A stand-in for `torch.cuda.graph(graph, pool=...)`: marks the capture open; on entry a dead
    engine's cycle becomes garbage (pending for the collector, as when the capture starts)."""

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None) -> Iterator[None]:
        assert isinstance(cuda_graph, _FakeGraph)
        was_enabled = gc.isenabled()
        gc.disable()  # built in one go, so the cycle is in the young generation when it dies
        _DeadEngine(rec, garbage_per_capture)  # unreachable at once: a cycle the collector must find
        rec.open = True
        if was_enabled:
            gc.enable()
        rec.captures += 1
        try:
            yield
        finally:
            rec.open = False

    return graph


@pytest.fixture
def eager_collector():
    """Python's collector enabled with a threshold of one allocation (any allocation collects the young
    generation), restored after."""
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.collect()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if not was:
            gc.disable()


@pytest.fixture
def no_tvm_ffi(monkeypatch: pytest.MonkeyPatch) -> None:
    """`capture` takes its plain torch path (tvm_ffi's stream context needs a real CUDA stream)."""
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)


def _allocate_python_objects() -> None:
    junk = [[i] for i in range(2000)]  # enough container allocations to start collections
    del junk


def test_capture_pauses_the_collector_and_restores_it(monkeypatch, no_tvm_ffi) -> None:
    """Inside `capture` the cyclic collector is off; after it (also after an exception in the block)
    it is back as it was, on or off."""
    rec = _Capturing()
    monkeypatch.setattr(torch.cuda, "graph", _fake_graph_context(rec, 0))
    seen = []
    assert gc.isenabled()
    with capture(_FakeGraph(rec), pool=None):
        seen.append(gc.isenabled())
    assert seen == [False] and gc.isenabled() and rec.captures == 1
    with pytest.raises(RuntimeError, match="boom"), capture(_FakeGraph(rec)):
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()


def test_no_graph_is_finalized_during_a_capture(monkeypatch, no_tvm_ffi, eager_collector) -> None:
    """Garbage cycles holding graphs, pending when a capture starts, are not collected while it runs
    (allocations in the captured block would collect them), and are collected after it."""
    rec = _Capturing()
    monkeypatch.setattr(torch.cuda, "graph", _fake_graph_context(rec, 3))
    graph = _FakeGraph(rec, "new")
    with capture(graph, pool=None):
        _allocate_python_objects()
    assert rec.captures == 1 and rec.dropped_while_capturing == []
    gc.collect()
    assert sorted(rec.dropped) == ["dead0", "dead1", "dead2"]  # collected once the capture closed


def test_the_stand_in_sees_a_collection_during_an_unguarded_capture(monkeypatch, eager_collector) -> None:
    """The stand-ins do detect the failure: the same capture without the pause (torch's context
    alone) finalizes the dead graphs while it is open."""
    rec = _Capturing()
    graph = _FakeGraph(rec, "new")
    with _fake_graph_context(rec, 3)(graph):
        _allocate_python_objects()
    assert sorted(rec.dropped_while_capturing) == ["dead0", "dead1", "dead2"]


def _failing_graph_context(rec: _Capturing, message: str):
    """A stand-in for `torch.cuda.graph` whose end fails as ``capture_end`` does on an invalidated
    capture (after ``cudaStreamEndCapture``, before torch's ``endAllocateToPool``)."""

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None) -> Iterator[None]:
        rec.open = True
        rec.captures += 1
        yield
        rec.open = False
        raise RuntimeError(message)

    return graph


class _FakeFfi:
    """The ``tvm_ffi`` package's `use_torch_stream` as it behaves: enter the torch context given (if
    any), then point tvm-ffi's stream at torch's current one; on exit, the torch context's exit
    first, then tvm-ffi's stream back (skipped when the torch exit raises)."""

    def __init__(self, current: list[str]) -> None:
        self.current, self.stream = current, "default"

    def use_torch_stream(self, context=None):
        ffi = self

        class _Context:
            def __enter__(self) -> None:
                if context is not None:
                    context.__enter__()
                self.prev, ffi.stream = ffi.stream, ffi.current[0]

            def __exit__(self, *exc) -> None:
                if context is not None:
                    context.__exit__(*exc)
                ffi.stream = self.prev

        return _Context()


@pytest.mark.parametrize("ffi", [False, True], ids=["torch", "tvm_ffi"])
def test_a_failed_capture_takes_its_pool_out_of_the_allocators_captures(
    monkeypatch: pytest.MonkeyPatch, ffi: bool
) -> None:
    """A capture whose end fails leaves the thread's current stream (torch's, and tvm-ffi's when the
    compiled modules' package is there) and the caching allocator as before it (`endAllocateToPool`
    and `releasePool` for its pool, on the current device) and raises the capture's error; a capture
    that ends well calls nothing, and when the allocator refuses the end (the capture's own end took
    the pool out) the pool is not released (its graph does that). Inside a capture tvm-ffi launches
    on the capture stream."""
    ended: list[tuple] = []
    pool = (0, 7)

    released: list[tuple] = []

    def end(device: int, mempool_id: tuple) -> None:
        ended.append((device, mempool_id))
        if mempool_id != pool:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    current = ["default"]

    def enter_capture_stream(graph_context):
        @contextlib.contextmanager
        def graph(cuda_graph, pool=None) -> Iterator[None]:
            current[0] = "capture"  # torch.cuda.graph's stream context, not exited when its end fails
            with graph_context(cuda_graph, pool):
                yield
            current[0] = "default"

        return graph

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, p: released.append((d, p)), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    fake_ffi = _FakeFfi(current)
    monkeypatch.setitem(sys.modules, "tvm_ffi", fake_ffi if ffi else None)
    rec = _Capturing()
    graph = _FakeGraph(rec)
    monkeypatch.setattr(torch.cuda, "graph", enter_capture_stream(_fake_graph_context(rec, 0)))
    with capture(graph, pool=pool):
        assert fake_ffi.stream == ("capture" if ffi else "default")
    assert ended == [] and current == ["default"] and fake_ffi.stream == "default"
    failing = _failing_graph_context(rec, "cudaErrorStreamCaptureInvalidated")
    monkeypatch.setattr(torch.cuda, "graph", enter_capture_stream(failing))
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"), capture(graph, pool=pool):
        pass
    assert ended == [(3, pool)] and released == [(3, pool)] and gc.isenabled()
    assert current == ["default"] and fake_ffi.stream == "default"  # the streams before the capture
    with pytest.raises(RuntimeError, match="Invalidated"), capture(graph, pool=(0, 8)):
        pass  # the allocator's refusal (nothing to end) is swallowed; the capture's error stays
    assert ended == [(3, pool), (3, (0, 8))] and released == [(3, pool)]  # its graph releases (0, 8)


def _tiny_static_head(root: Path):
    from ignis.runtime.drafters.mtp import build_mtp_drafter, load_mtp_checkpoint
    from ignis.runtime.drafters.mtp_static import StaticMTPDrafter
    from ignis.tools.make_test_drafter import make_mtp_drafter

    tiny = make_tiny_hybrid("qwen3_5", root / "target")
    make_mtp_drafter(tiny.folder, root / "with_mtp", seed=5)
    config, tensors = load_mtp_checkpoint(root / "with_mtp")
    d = build_mtp_drafter(
        target_config=config, target_weights=tensors, static=True, max_lanes=2, max_context=16
    )
    assert isinstance(d, StaticMTPDrafter)
    return d


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def cuda_stand_ins(monkeypatch: pytest.MonkeyPatch, no_tvm_ffi, eager_collector):
    """A callable that replaces every CUDA call of a capture (`capture_round`, `capture`) by a
    stand-in and returns the record; each capture then finds two dead graphs pending for the
    collector (`_fake_graph_context`). Install it after building the model (its imports read
    ``torch.cuda`` types)."""

    def install() -> _Capturing:
        rec = _Capturing()

        class NewGraph(_FakeGraph):
            def __init__(self) -> None:
                super().__init__(rec, "new")

        monkeypatch.setattr(torch.cuda, "graph", _fake_graph_context(rec, 2))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", NewGraph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        return rec

    return install


def test_mtp_head_warm_up_finalizes_no_graph_while_capturing(tmp_path: Path, cuda_stand_ins) -> None:
    """The static MTP head's load-time warm-up (`StaticMTPDrafter.warm_up`, through `capture_round`
    and `capture`) with dead engines' graphs pending for the collector at every capture: each of its
    captures completes with no graph finalized during it, and the dead graphs are collected
    afterwards."""
    d = _tiny_static_head(tmp_path)
    rec = cuda_stand_ins()
    d.cuda_graphs = True  # the graphed path, its CUDA calls replaced
    n = d.warm_up(columns=(4,))
    assert n > 0 and d.cuda_graphs and rec.captures == n == d.num_captures
    assert rec.dropped_while_capturing == []
    gc.collect()
    assert sum(name.startswith("dead") for name in rec.dropped) == 2 * n


def test_hybrid_target_warm_up_finalizes_no_graph_while_capturing(tmp_path: Path, cuda_stand_ins) -> None:
    """The same for the hybrid target's load-time warm-up (`StaticHybridExecutor.warm_up`): every
    round shape captured, no graph finalized during a capture."""
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    tiny = make_tiny_hybrid("qwen3_5", tmp_path / "target")
    kw = {"max_lanes": 2, "max_context": 16, "kv_bucket": 16}
    ex = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), **kw)
    rec = cuda_stand_ins()
    ex.cuda_graphs = True  # the graphed path, its CUDA calls replaced
    n = ex.warm_up(columns=(4,))
    assert n == 2 * 4 * 2 == ex.num_captures == rec.captures  # lanes 1, 2 x widths 1, 2, 4, 8 x KV 16, 24
    assert rec.dropped_while_capturing == []
    gc.collect()
    assert sum(name.startswith("dead") for name in rec.dropped) == 2 * n


def test_capture_is_the_one_capture_path() -> None:
    """Every runtime capture goes through `capture` (so the pause covers them all): no module of the
    runtime enters ``torch.cuda.graph`` itself."""
    root = Path(tvm_runtime.__file__).resolve().parents[1]
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "torch.cuda.graph(" in p.read_text() and p.name != "tvm_runtime.py"
    ]
    assert offenders == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_capture_with_a_dead_engines_graphs_pending() -> None:
    """On CUDA: real graphs in an unreachable cycle (a dropped engine's) become garbage while another
    graph is captured, and the captured block allocates enough Python objects to start collections:
    none of the dead graphs is destroyed during the capture (CUDA forbids it; the capture would be
    invalidated), the capture succeeds and replays, and the dead graphs go at the next collection."""
    x = torch.zeros(4096, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    capturing = [False]
    destroyed: list[bool] = []  # per dead graph: destroyed while a capture was open

    class Engine:
        def __init__(self) -> None:
            self.me, self.graphs = self, []

    holder = [Engine()]
    for _ in range(4):
        g = torch.cuda.CUDAGraph()
        with capture(g, pool=pool):
            x.add_(1)
        weakref.finalize(g, lambda: destroyed.append(capturing[0]))
        holder[0].graphs.append(g)
    del g
    torch.cuda.synchronize()
    thresholds = gc.get_threshold()
    gc.collect()  # the next collections find the engine young (allocated since)
    holder.append(Engine())  # fresh cycle in the young generation, holding the old one's graphs
    holder[1].graphs, holder[0].graphs = holder[0].graphs, []
    new = torch.cuda.CUDAGraph()
    try:
        with capture(new, pool=pool):
            capturing[0] = True
            holder.clear()  # the engines are unreachable now
            gc.set_threshold(1, 1, 1)
            _allocate_python_objects()
            x.mul_(2)
            capturing[0] = False
    finally:
        capturing[0] = False
        gc.set_threshold(*thresholds)
    gc.collect()
    assert destroyed == [False] * 4
    x.fill_(3.0)
    new.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 6.0)  # the captured block's one kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_failed_capture_leaves_the_stream_usable_and_a_fresh_pool_captures() -> None:
    """On CUDA: a capture invalidated by a forbidden call (a device synchronize) raises; after it the
    thread launches on the stream it used before, and the next capture, into a fresh pool (as the
    executors take after a failure: torch 2.11 still refused the failed one's pool with "already
    recording to mempool_id"), succeeds and replays."""
    x = torch.zeros(1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.current_stream()
    bad = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captur"), capture(bad, pool=pool):
        x.add_(1)
        torch.cuda.synchronize()  # not permitted while capturing: the capture is invalidated
    assert torch.cuda.current_stream() == stream
    good = torch.cuda.CUDAGraph()
    with capture(good, pool=torch.cuda.graph_pool_handle()):
        x.add_(2)
    x.zero_()
    good.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 2)


@pytest.mark.parametrize("family", ["hybrid", "llama"])
def test_a_static_executor_drops_the_pool_of_a_failed_capture(family: str, monkeypatch) -> None:
    """A static executor whose capture raised takes a fresh graph pool for its next capture (the
    failed one's may stay refused by torch's allocator: `tvm_runtime.capture`); one that succeeded
    keeps sharing its pool."""
    import ignis.runtime.families.hybrid_graphs as hg
    import ignis.runtime.families.llama_graphs as lg

    module, cls = (hg, hg.StaticHybridExecutor) if family == "hybrid" else (lg, lg.StaticLlamaExecutor)
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    seen: list[object] = []

    def capture_round(body, *, device, pool, stream=None):
        seen.append(pool)
        if body == "fail":
            raise RuntimeError("operation not permitted when stream is capturing")
        return "entry"

    monkeypatch.setattr(module, "capture_round", capture_round)
    ex = cls.__new__(cls)
    ex._pool, ex._side_stream, ex.device, ex.num_captures = None, "stream", torch.device("cpu"), 0
    assert ex._capture("ok") == "entry" and ex._capture("ok") == "entry"
    with pytest.raises(RuntimeError, match="capturing"):
        ex._capture("fail")
    assert ex._pool is None
    assert ex._capture("ok") == "entry"
    assert seen == [(0, 0), (0, 0), (0, 0), (0, 1)] and ex.num_captures == 3
