"""runtime/kernels/topk.py: the tie rule in torch (any device), the compiled kernel behind it (GPU), and the
DFlash2 selector walk going through it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ignis.compiler.kernels.topk import topk_reference
from ignis.runtime.drafters.dflash2 import DFlash2Drafter
from ignis.runtime.kernels.topk import TopKModule, _topk_fixed, topk, topk_torch
from ignis.runtime.sampling import SamplingParams

NAN, INF = float("nan"), float("inf")
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _data(kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen) * 3
    if kind == "quantized":
        x = torch.clamp(torch.round(x / 2), -4, 4)
    elif kind == "equal":
        x = torch.full(shape, 0.25)
    elif kind == "zeros":  # +0.0 and -0.0, equal under the rule, fill the top
        x = -torch.abs(x)
        x[..., 1::3] = 0.0
        x[..., 2::5] = -0.0
    elif kind == "special":
        x = torch.round(x)
        x[..., ::97] = NAN
        x[..., 5::50] = INF
        x[..., 7::11] = -INF
        x[..., 1::3] = 0.0
        x[..., 2::3] = -0.0
    return x.to(dtype)


def _check(x: torch.Tensor, k: int, v: torch.Tensor, i: torch.Tensor) -> None:
    # the reference runs on the CPU: torch's CUDA sort of bfloat16 does not rank NaN first (seen
    # on an H200 with torch 2.11: +inf came before NaN), its CPU sort does
    rv, ri = topk_reference(x.cpu(), k)
    assert i.dtype == torch.int64 and v.dtype == x.dtype and v.shape == (*x.shape[:-1], k)
    assert torch.equal(i.cpu(), ri)
    assert torch.equal(_bits(v.cpu()), _bits(rv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["randn", "quantized", "equal", "special", "zeros"])
def test_torch_path_is_the_tie_rule(dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(11)
    x = _data(kind, (2, 3, 1000), dtype, gen)
    for k in (1, 16, 64, 999, 1000):
        v, i = topk(x, k)
        _check(x, k, v, i)


def test_torch_path_small_cases_and_errors() -> None:
    x = torch.tensor([[0.5, 2.0, 2.0, NAN, -0.0, 0.0, NAN]])
    _, i = topk_torch(x, 5)
    assert i.tolist() == [[3, 6, 1, 2, 0]]
    assert topk_torch(x, 7)[1].tolist() == [[3, 6, 1, 2, 0, 4, 5]]
    assert topk_torch(x, 0)[1].shape == (1, 0)
    with pytest.raises(RuntimeError):
        topk_torch(x, 8)
    with pytest.raises(TypeError):
        topk_torch(torch.arange(5), 2)


def _fixed(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPU's sync-free path (`_topk_fixed`) on every row, whatever the device."""
    x2 = x.reshape(-1, x.shape[-1])
    i = _topk_fixed(x2, k)
    return x2.gather(-1, i).view(*x.shape[:-1], k), i.view(*x.shape[:-1], k)


PATHS = {"topk_torch": topk_torch, "fixed": _fixed}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["randn", "quantized", "equal", "special", "zeros"])
def test_sync_free_path_is_the_tie_rule(dtype: torch.dtype, kind: str) -> None:
    """`_topk_fixed` (what a GPU runs without the module) on every row, not only tied ones."""
    gen = torch.Generator().manual_seed(13)
    x = _data(kind, (2, 3, 1000), dtype, gen)
    for k in (1, 16, 64, 999, 1000):
        _check(x, k, *_fixed(x, k))


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_torch_path_resolves_boundary_ties_to_the_smallest_ids(path: str, dtype: torch.dtype) -> None:
    """Rows drawn from a handful of values (NaN, +-inf, +-0, two finite ones) put ties at, above
    and below the k-th value in every row: the torch paths equal the stable sort for every k."""
    if path == "fixed" and dtype == torch.float64:
        pytest.skip("float64 has its own path")
    run = PATHS[path]
    gen = torch.Generator().manual_seed(29)
    pool = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 1.5, -2.0])
    for trial in range(40):
        vocab = int(torch.randint(1, 300, (1,), generator=gen))
        rows = int(torch.randint(1, 5, (1,), generator=gen))
        # a row's own mix: some rows all one value, some with few distinct values
        probs = torch.rand(rows, len(pool), generator=gen) ** 4
        choice = torch.multinomial(probs, vocab, replacement=True, generator=gen)
        x = pool[choice].to(dtype)
        for k in sorted({1, 2, min(7, vocab), min(64, vocab), max(1, vocab - 1), vocab}):
            v, i = run(x, k)
            _check(x, k, v, i)
            for r in range(rows):
                assert i[r].unique().numel() == k, (trial, k, r)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_torch_path_ties_straddling_the_boundary(path: str) -> None:
    """Hand-checked: the k-th value is tied with elements before and after topk's choice."""
    run = PATHS[path]
    x = torch.tensor([[1.0, 3.0, 1.0, 1.0, 5.0, 1.0, 3.0, 1.0]])
    assert run(x, 4)[1].tolist() == [[4, 1, 6, 0]]
    assert run(x, 5)[1].tolist() == [[4, 1, 6, 0, 2]]
    z = torch.tensor([[-0.0, 0.0, -1.0, 0.0, -0.0]])
    v, i = run(z, 3)
    assert i.tolist() == [[0, 1, 3]] and torch.signbit(v[0, 0]) and not torch.signbit(v[0, 1])
    n = torch.tensor([[INF, NAN, 2.0, NAN, INF]])
    assert run(n, 3)[1].tolist() == [[1, 3, 0]]
    assert run(n, 5)[1].tolist() == [[1, 3, 0, 4, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_path_has_no_host_sync(dtype: torch.dtype) -> None:
    """A fixed sequence of ops with no data-dependent branch: it runs on "meta" tensors (which hold
    no data: any .item(), nonzero() or bool() on them raises), so it never waits for the GPU and can
    be captured in a CUDA graph."""
    x = torch.empty(3, 5, 248_320, device="meta", dtype=dtype)
    v, i = topk_torch(x, 64)  # not the CPU: the sync-free path
    assert v.shape == i.shape == (3, 5, 64) and v.dtype == dtype and i.dtype == torch.int64
    with pytest.raises(RuntimeError):
        bool(x.sum() > 0)  # the meta device refuses a data-dependent branch


class _FakeModule(TopKModule):
    """Supports everything, records the call, answers with the torch path."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls: list[tuple[tuple[int, ...], int]] = []

    def supports(self, x: torch.Tensor, k: int) -> bool:
        return True

    def __call__(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append((tuple(x.shape), k))
        return topk_torch(x, k)


def test_module_used_only_when_it_supports_the_input() -> None:
    x = torch.randn(4, 100)
    fake = _FakeModule()
    topk(x, 8, module=fake)
    assert fake.calls == [((4, 100), 8)]
    real = TopKModule(lambda *a: pytest.fail("a CPU tensor must not reach the kernel"))
    assert not real.supports(x, 8)
    _check(x, 8, *topk(x, 8, module=real))
    with pytest.raises(ValueError, match="compiled top-k takes"):
        real(x, 8)


def test_dflash2_walk_uses_the_module_and_breaks_ties_to_the_smaller_id() -> None:
    """The selector walk's candidates: ties in the head logits go to the smaller id, through the
    drafter's `topk_module` when one is attached."""
    vocab, top_k = 50, 4
    logits = torch.zeros(1, 2, vocab)
    logits[0, 0, [30, 7, 19, 41, 3]] = 5.0  # five tied maxima: the top 4 are ids 3, 7, 19, 30
    logits[0, 1, [12, 44]] = 2.0

    def selector_scores(hidden, cand, unary, prev):  # type: ignore[no-untyped-def]
        return unary  # the walk then takes the first candidate (argmax: first of equal scores)

    fake = _FakeModule()
    me = SimpleNamespace(
        network=SimpleNamespace(selector_scores=selector_scores),
        config=SimpleNamespace(selector_top_k=top_k),
        topk_module=fake,
        _to_vocab=lambda idx: idx,
        _proposals=lambda drafts, probs: drafts,
    )
    req = SimpleNamespace(params=SamplingParams(temperature=0))
    drafts = DFlash2Drafter._walk(me, [req], [2], torch.zeros(1, 2, 8), logits, torch.tensor([0]))  # type: ignore[arg-type]
    assert fake.calls == [((1, 2, vocab), top_k)]
    assert drafts == [[3, 12]]


# ---------------------------------------------------------------------------------------------
# On a GPU host: the compiled kernel ($IGNIS_TOPK_MODULE: a .so or a folder of topk_<arch>.so;
# else built here with nvcc)


def _has_cuda() -> bool:
    return bool(torch.cuda.is_available())


@pytest.fixture(scope="module")
def cuda_module(tmp_path_factory: pytest.TempPathFactory) -> TopKModule:
    from ignis.runtime.kernels.topk import load_topk_module

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    env = os.environ.get("IGNIS_TOPK_MODULE")
    if env:
        path = Path(env)
        if path.is_dir():
            path = path / f"topk_sm{major}{minor}.so"
        if not path.exists():
            pytest.skip(f"IGNIS_TOPK_MODULE={env} holds no module for {arch}")
    elif HAS_NVCC:
        from ignis.compiler.kernels.topk import build_topk

        path = build_topk(arch, out_path=tmp_path_factory.mktemp("topk") / "topk.so")
    else:
        pytest.skip("no compiled top-k: set IGNIS_TOPK_MODULE or install nvcc")
    return load_topk_module(path)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["randn", "quantized", "equal", "special", "zeros"])
def test_cuda_kernel_is_the_tie_rule(cuda_module: TopKModule, dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(5)
    for shape, k in (
        ((8, 248_320), 64),
        ((1, 248_320), 8),
        ((2, 7, 248_320), 16),
        ((3, 4097), 64),
        ((5, 100), 1),
        ((2, 64), 64),
        ((1, 1_048_576), 32),
    ):
        x = _data(kind, shape, dtype, gen).cuda()
        assert cuda_module.supports(x, k)
        v, i = topk(x, k, module=cuda_module)
        _check(x, k, v, i)
        v2, i2 = cuda_module(x, k)  # deterministic
        assert torch.equal(i, i2) and torch.equal(_bits(v), _bits(v2))
        tv, ti = topk_torch(x, k)  # the torch path on the GPU agrees
        assert torch.equal(ti, i) and torch.equal(_bits(tv), _bits(v))


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_cuda_kernel_in_a_graph_and_on_a_side_stream(cuda_module: TopKModule) -> None:
    x = torch.randn(8, 248_320, device="cuda")
    cuda_module(x, 64)  # the first call reserves shared memory: before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gv, gi = cuda_module(x, 64)
    x.copy_(torch.round(torch.randn(8, 248_320, device="cuda")))  # new ties, same buffer
    graph.replay()
    torch.cuda.synchronize()
    _check(x, 64, gv, gi)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sv, si = cuda_module(x, 32)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    _check(x, 32, sv, si)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_torch_path_in_a_cuda_graph() -> None:
    """The sync-free torch path (no module) replays from a CUDA graph with new ties in the input."""
    x = torch.randn(8, 248_320, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (allocator pools, cached ordinals) off the capture
        topk_torch(x, 64)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gv, gi = topk_torch(x, 64)
    x.copy_(torch.round(torch.randn(8, 248_320, device="cuda")))  # most of the top 64 tied
    graph.replay()
    torch.cuda.synchronize()
    _check(x, 64, gv, gi)


# ---------------------------------------------------------------------------------------------
# On a GPU host, from an artifact built for its card ($IGNIS_TOPK_ARTIFACT: the artifact directory,
# e.g. a tiny qwen3_5 + DFlash2 drafter built for h200 on the build host)


def _gpu_artifact() -> Path:
    env = os.environ.get("IGNIS_TOPK_ARTIFACT")
    if not env:
        pytest.skip("set IGNIS_TOPK_ARTIFACT to an artifact built for this GPU's card")
    from ignis.formats import read_manifest

    path = Path(env)
    entry = read_manifest(path).kernel("topk")
    major, minor = torch.cuda.get_device_capability()
    if entry is None or entry.target.get("arch") != f"sm_{major}{minor}":
        pytest.skip(f"{path} lists no top-k kernel for sm_{major}{minor}")
    return path


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_artifact_topk_module_is_the_tie_rule() -> None:
    from ignis.runtime.artifact import load_artifact

    with load_artifact(_gpu_artifact()) as art:
        module = art.topk_module()
        assert module is not None and art.topk_module() is module
        gen = torch.Generator().manual_seed(17)
        for dtype in module.dtypes:
            for kind in ("randn", "quantized", "special"):
                for shape, k in (((8, 248_320), 64), ((1, 151_936), 16), ((2, 3, 320), 16)):
                    x = _data(kind, shape, dtype, gen).cuda()
                    assert module.supports(x, k)
                    _check(x, k, *topk(x, k, module=module))


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_served_dflash2_drafter_selects_with_the_artifacts_kernel() -> None:
    """ArtifactSource on CUDA attaches the kernel to the DFlash2 drafter; its selector walk calls it,
    and greedy output equals the run without it (torch's exact path)."""
    pytest.importorskip("fastapi", reason="ignis.runtime.server needs fastapi")
    pytest.importorskip("tokenizers", reason="the artifact's tokenizer needs tokenizers")
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    path = _gpu_artifact()
    source = ArtifactSource(path)
    if "dflash2" not in source.spec_kinds:
        pytest.skip(f"{path} has no DFlash2 drafter")
    model = source.load(ModelSettings(SpecDefaults("dflash2", 3), device="cuda"))
    try:
        prompts = [[5, 17, 33, 2, 90, 41], [7, 7, 200, 11]]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = []
        for attach in (True, False):
            engine = model.make_engine(2, SpeculativeMetrics())
            module = engine.drafter.topk_module
            assert isinstance(module, TopKModule)
            calls = []
            real = module.func
            module.func = lambda *a, _c=calls, _f=real: (_c.append(1), _f(*a))[1]
            if not attach:
                engine.drafter.topk_module = None
            outs.append([r.output_token_ids for r in engine.generate(prompts, params)])
            module.func = real
            assert (len(calls) > 0) == attach
        assert outs[0] == outs[1]
    finally:
        if model.close is not None:
            model.close()
