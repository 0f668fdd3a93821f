"""runtime/topk.py: the tie rule in torch (any device), the compiled kernel behind it (GPU), and the
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
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.topk import TopKModule, topk, topk_torch

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
    from ignis.runtime.topk import load_topk_module

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
