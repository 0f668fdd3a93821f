"""The grouped MoE block (`ignis.runtime.families.moe_grouped`) and its expert kernels
(`ignis.runtime.kernels.moe_experts`, ``compiler/kernels/moe_experts.cuh``).

CPU:
* `grouped_q4_reference` equals a literal per-pair dequantize-and-multiply, masked pairs untouched;
* the grouped block equals `sparse_moe_block`'s reference loop to float rounding (dense and q4
  experts; torch path and the kernel binding over a CPU stand-in of the module);
* with an expert cache of 1, 2 and all slots (`ExpertSlots` built ``stacked``) it equals the resident
  grouped block bit for bit, with the reference loop's hit / miss counts;
* tiny qwen3_5_moe and qwen3_next executors (grouped by default off CUDA) give the reference loop's
  logits to float rounding and its greedy tokens;
* the library is selected for MoE configs, builds with nvcc and checks its arguments.

GPU (marked gpu; the module from ``$IGNIS_MOE_MODULE`` -- a ``.so`` or a folder holding
``moe_experts_sm<NN>.so`` -- or built with nvcc): the kernels equal the reference at the issue's shapes
for R in {1, 3, 8, 33}; the block equals the reference loop; a cache of 2 slots equals resident;
a static executor with the kernels replays MoE rounds from CUDA graphs equal to the eager rounds.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from hf_tiny_hybrid import make_tiny_hybrid
from kernel_module_checks import HAS_NVCC, check_sass_and_exports, load_on_host_or_skip
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.formats import quantize_q4_g32
from ignis.runtime.expert_cache import ExpertCache
from ignis.runtime.families.hybrid_executor import HybridExecutor
from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights, sparse_moe_block
from ignis.runtime.families.moe_grouped import GroupedExperts, grouped_moe_block, stack_experts
from ignis.runtime.kernels.moe_experts import (
    FUNCTION_NAMES,
    MoeExpertsKernel,
    grouped_q4_reference,
    reference_module,
)
from ignis.runtime.linear import Q4Weight, dequantize_q4, torch_linear

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 3


def _w(rows: int, cols: int, g: torch.Generator, q4: bool) -> torch.Tensor | Q4Weight:
    t = torch.randn(rows, cols, generator=g) * 0.2
    if not q4:
        return t
    packed, scales = quantize_q4_g32(t.numpy())
    return Q4Weight(torch.from_numpy(packed), torch.from_numpy(scales))


def _block(q4: bool, seed: int = 0) -> SparseMoeWeights:
    g = torch.Generator().manual_seed(seed)
    experts = [
        SwiGLUWeights(_w(INTER, HIDDEN, g, q4), _w(INTER, HIDDEN, g, q4), _w(HIDDEN, INTER, g, q4))
        for _ in range(EXPERTS)
    ]
    shared = SwiGLUWeights(_w(64, HIDDEN, g, q4), _w(64, HIDDEN, g, q4), _w(HIDDEN, 64, g, q4))
    return SparseMoeWeights(
        torch.randn(EXPERTS, HIDDEN, generator=g), experts, shared, torch.randn(1, HIDDEN)
    )


def _grouped(w: SparseMoeWeights, kernel: MoeExpertsKernel | None = None) -> SparseMoeWeights:
    gate_up, down = stack_experts(
        [e.gate for e in w.experts], [e.up for e in w.experts], [e.down for e in w.experts]
    )
    return dataclasses.replace(w, grouped=GroupedExperts(gate_up, down, kernel=kernel))


def _rand_ids(rows: int, top_k: int, slots: int, g: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(rows)]).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# the reference and the binding
# ---------------------------------------------------------------------------------------------


def _stack(slots: int, n: int, k: int, g: torch.Generator) -> Q4Weight:
    w = _w(slots * n, k, g, True)
    assert isinstance(w, Q4Weight)
    return Q4Weight(w.packed.reshape(slots, n, k // 8), w.scales.reshape(slots, n, k // 32))


def test_reference_is_the_literal_maths_and_skips_masked_pairs() -> None:
    g = torch.Generator().manual_seed(1)
    stack = _stack(4, 40, 64, g)
    x = torch.randn(3, 64, generator=g)
    ids = torch.tensor([[0, 2], [2, -1], [3, 1]], dtype=torch.int32)
    y = grouped_q4_reference(x, ids, stack.packed, stack.scales, out=torch.full((3, 2, 40), 7.0))
    for r in range(3):
        for j in range(2):
            s = int(ids[r, j])
            if s < 0:
                assert torch.equal(y[r, j], torch.full((40,), 7.0))
                continue
            w = dequantize_q4(stack.packed[s], stack.scales[s])
            torch.testing.assert_close(y[r, j], w @ x[r], rtol=1e-5, atol=1e-5)
    # down: [gate | up] of K = 32 inputs each, SwiGLU fused, weighted, float32
    down = _stack(4, 40, 32, g)
    h = torch.randn(3, 2, 64, generator=g)
    route_w = torch.rand(3, 2, generator=g)
    yd = grouped_q4_reference(h, ids, down.packed, down.scales, route_w=route_w)
    gate, up = h.chunk(2, dim=-1)
    for r, j in ((0, 0), (0, 1), (1, 0), (2, 0), (2, 1)):
        s = int(ids[r, j])
        w = dequantize_q4(down.packed[s], down.scales[s])
        want = route_w[r, j] * (w @ (torch.nn.functional.silu(gate[r, j]) * up[r, j]))
        torch.testing.assert_close(yd[r, j], want, rtol=1e-5, atol=1e-5)
    assert yd.dtype == torch.float32 and torch.equal(yd[1, 1], torch.zeros(40))


# ---------------------------------------------------------------------------------------------
# the block against the reference loop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("q4", [False, True], ids=["dense", "q4_g32"])
def test_grouped_block_equals_reference_loop(q4: bool, path: str) -> None:
    if path == "kernel" and not q4:
        pytest.skip("the kernels take q4 stacks")
    w = _block(q4, seed=2)
    kernel = MoeExpertsKernel(reference_module()) if path == "kernel" else None
    grouped = _grouped(w, kernel)
    assert grouped.grouped.uses_kernel == (path == "kernel")
    g = torch.Generator().manual_seed(3)
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, HIDDEN, generator=g)
        want = sparse_moe_block(x, w, top_k=TOP_K, norm_topk_prob=True, linear=torch_linear)
        got = sparse_moe_block(x, grouped, top_k=TOP_K, norm_topk_prob=True, linear=torch_linear)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # row by row equals the batch (to float rounding: torch's GEMM blocks by rows)
        one = torch.cat([grouped_moe_block(x[i : i + 1], grouped, top_k=TOP_K, norm_topk_prob=True,
                                           linear=torch_linear) for i in range(rows)])  # fmt: skip
        torch.testing.assert_close(one, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("num_slots", [1, 2, EXPERTS])
def test_grouped_block_with_cache_equals_resident_bit_for_bit(num_slots: int, path: str) -> None:
    w = _block(True, seed=4)
    kernel = MoeExpertsKernel(reference_module()) if path == "kernel" else None
    hook = torch_linear if path == "kernel" else None  # with no q4 hook the slots are dequantized
    resident = _grouped(w, kernel)
    if hook is None:  # dense slots: compare with dense resident stacks of the same values
        dense = [
            SwiGLUWeights(*(getattr(e, f).dequantize() for f in ("gate", "up", "down"))) for e in w.experts
        ]
        resident = _grouped(dataclasses.replace(w, experts=dense), kernel)
    ref_cache = ExpertCache(num_slots, device="cpu")  # the reference loop's counters
    ref_slots = ref_cache.make_layer(w.experts, linear=torch_linear)
    reference = dataclasses.replace(w, experts=ref_slots)
    cache = ExpertCache(num_slots, device="cpu")
    slots = cache.make_layer(w.experts, linear=hook, stacked=True)
    gate_up, down = slots.stacks()
    assert isinstance(gate_up, Q4Weight) == (hook is not None)
    cached = dataclasses.replace(w, experts=slots, grouped=GroupedExperts(gate_up, down, kernel, slots=slots))
    assert cached.grouped.uses_kernel == (path == "kernel")
    g = torch.Generator().manual_seed(5)
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, HIDDEN, generator=g)
        want = sparse_moe_block(x, resident, top_k=TOP_K, norm_topk_prob=True, linear=torch_linear)
        got = sparse_moe_block(x, cached, top_k=TOP_K, norm_topk_prob=True, linear=torch_linear)
        assert torch.equal(got, want)
        sparse_moe_block(x, reference, top_k=TOP_K, norm_topk_prob=True, linear=torch_linear)
    for key in ("hits", "misses", "bytes_copied", "forwards", "rows"):
        assert getattr(cache.stats, key) == getattr(ref_cache.stats, key), key
    assert cache.stats.misses > 0 and cache.stats.forwards == 4 and cache.stats.rows == 29
    if num_slots < EXPERTS:
        assert cache.stats.misses > EXPERTS


def test_which_layers_run_the_grouped_block() -> None:
    """On CUDA: with the kernels and q4 experts only; off CUDA: unless the hook runs compiled
    functions (a CPU artifact's modules keep the reference loop)."""
    from types import SimpleNamespace

    from ignis.runtime.families.moe_grouped import use_grouped

    g = torch.Generator().manual_seed(9)
    q4 = {"p.experts.gate_up_proj": _stack(4, 64, 64, g)}
    dense = {"p.experts.0.gate_proj.weight": torch.zeros(32, 64)}
    cpu, cuda, kernel = torch.device("cpu"), torch.device("cuda"), object()
    assert use_grouped(cpu, None, q4, "p") and use_grouped(cpu, None, dense, "p", torch_linear)
    assert use_grouped(cpu, None, q4, "p", SimpleNamespace(compiled=[]))
    assert not use_grouped(cpu, kernel, q4, "p", SimpleNamespace(compiled=[("fn",)]))
    assert use_grouped(cuda, kernel, q4, "p") and not use_grouped(cuda, None, q4, "p")
    assert not use_grouped(cuda, kernel, dense, "p")


def test_stacked_slots_share_one_gate_up_buffer() -> None:
    w = _block(True, seed=6)
    slots = ExpertCache(2, device="cpu").make_layer(w.experts, linear=torch_linear, stacked=True)
    gate_up, down = slots.stacks()
    assert gate_up.shape == (2, 2 * INTER, HIDDEN) and down.shape == (2, HIDDEN, INTER)
    list(slots.slot_groups([5], rows=1))
    s = slots.resident[5]
    assert torch.equal(gate_up.packed[s, :INTER], w.experts[5].gate.packed)
    assert torch.equal(gate_up.packed[s, INTER:], w.experts[5].up.packed)
    assert torch.equal(down.scales[s], w.experts[5].down.scales)
    with pytest.raises(ValueError, match="stacked"):
        ExpertCache(2, device="cpu").make_layer(w.experts, linear=torch_linear).stacks()


# ---------------------------------------------------------------------------------------------
# tiny hybrid MoE executors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_executor_grouped_equals_reference_loop(family: str, tmp_path: Path) -> None:
    tiny = make_tiny_hybrid(family, tmp_path / family)
    tensors = tiny.canonical_tensors()
    grouped = HybridExecutor(tiny.config, tensors)
    loop = HybridExecutor(tiny.config, tensors)
    moe_layers = [layer for layer in grouped._layers if isinstance(layer.mlp, SparseMoeWeights)]
    assert moe_layers and all(layer.mlp.grouped is not None for layer in moe_layers)
    loop._layers = [
        dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, grouped=None))
        if isinstance(layer.mlp, SparseMoeWeights)
        else layer
        for layer in loop._layers
    ]
    prompts = [torch.tensor([5, 17, 3, 99, 250, 7, 8, 41]), torch.arange(30, 60)]
    lanes_g, lanes_l = [grouped.new_lane() for _ in prompts], [loop.new_lane() for _ in prompts]
    for record, cols in ((False, prompts), (True, [torch.tensor([1, 2, 3]), torch.tensor([9])])):
        a = grouped.forward(lanes_g, cols, record=record)
        b = loop.forward(lanes_l, cols, record=record)
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            assert torch.equal(x.argmax(-1), y.argmax(-1))
        keep = [c.numel() for c in cols]
        grouped.commit(lanes_g, keep)
        loop.commit(lanes_l, keep)


def _q4_experts(tensors: dict) -> dict:
    """The routed experts (trunk and MTP head) quantized to q4_g32; the rest as is."""
    out = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and t.shape[-1] % 32 == 0:
            packed, scales = quantize_q4_g32(t.reshape(-1, t.shape[-1]).float().numpy())
            t = Q4Weight(
                torch.from_numpy(packed).reshape(*t.shape[:-1], -1),
                torch.from_numpy(scales).reshape(*t.shape[:-1], -1),
            )
        out[name] = t
    return out


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_static_executor_runs_the_kernel_binding(family: str, tmp_path: Path) -> None:
    """`moe_module` reaches every MoE layer (a CPU stand-in of the module here): the rounds equal the
    torch path's to float rounding, and the binding ran."""
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    tiny = make_tiny_hybrid(family, tmp_path / family)
    tensors = _q4_experts(tiny.canonical_tensors())
    calls = {"moe_q4_gate_up": 0, "moe_q4_down": 0}
    stand_in = reference_module()

    def counted(name: str):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            calls[name] += 1
            stand_in[name](*args)

        return call

    module = {name: counted(name) for name in stand_in}
    kw = dict(linear=torch_linear, max_lanes=4, max_context=256)
    with_kernel = StaticHybridExecutor(tiny.config, tensors, moe_module=module, **kw)
    torch_path = StaticHybridExecutor(tiny.config, tensors, **kw)
    layers = [layer.mlp.grouped for layer in with_kernel._layers if isinstance(layer.mlp, SparseMoeWeights)]
    assert layers and all(g.uses_kernel and not g.capturable for g in layers)  # CPU: no graphs
    prompts = [torch.tensor([5, 17, 3, 99, 250, 7, 8, 41]), torch.arange(30, 45)]
    a_lanes, b_lanes = [with_kernel.new_lane() for _ in prompts], [torch_path.new_lane() for _ in prompts]
    for record, cols in ((False, prompts), (True, [torch.tensor([1, 2, 3]), torch.tensor([9, 4])])):
        a = with_kernel.forward(a_lanes, cols, record=record)
        b = torch_path.forward(b_lanes, cols, record=record)
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        with_kernel.commit(a_lanes, [c.numel() for c in cols])
        torch_path.commit(b_lanes, [c.numel() for c in cols])
    assert calls["moe_q4_gate_up"] == calls["moe_q4_down"] == 2 * len(layers)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_mtp_head_runs_the_grouped_block(family: str, tmp_path: Path) -> None:
    """A MoE MTP head holds its routed experts as stacks (the kernel binding with `moe_module`); its
    MoE block equals the reference loop to float rounding."""
    from ignis.runtime.drafters.mtp import build_mtp_drafter, load_mtp_checkpoint
    from ignis.tools.make_test_drafter import make_mtp_drafter

    tiny = make_tiny_hybrid(family, tmp_path / "target")
    make_mtp_drafter(tiny.folder, tmp_path / "with_mtp", seed=7)
    config, tensors = load_mtp_checkpoint(tmp_path / "with_mtp")
    tensors = _q4_experts(tensors)
    drafter = build_mtp_drafter(
        target_config=config, target_weights=tensors, linear=torch_linear, moe_module=reference_module()
    )
    mlp = drafter.head.mlp
    assert isinstance(mlp, SparseMoeWeights) and mlp.grouped is not None and mlp.grouped.uses_kernel
    loop = dataclasses.replace(mlp, grouped=None)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(8))
    kw = dict(top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob, linear=torch_linear)
    torch.testing.assert_close(
        sparse_moe_block(x, mlp, **kw), sparse_moe_block(x, loop, **kw), rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------------------------------------
# the library: selection, build, argument checks
# ---------------------------------------------------------------------------------------------


def test_library_is_selected_for_moe_configs() -> None:
    from ignis.compiler.build.modules import moe_kernel_fits, select_kernels
    from ignis.runtime.families.qwen3_5 import Qwen3_5Config
    from ignis.tools.bench.expert_cache import issue_config

    moe = issue_config(4, tiny=True)
    assert moe_kernel_fits(moe) and "moe_experts" in select_kernels(config=moe)
    assert moe_kernel_fits(issue_config(48))
    odd = dataclasses.replace(moe, moe_intermediate_size=48)
    assert not moe_kernel_fits(odd) and "moe_experts" not in select_kernels(config=odd)
    dense = Qwen3_5Config.from_hf(
        dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, full_attention_interval=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=16,
             linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
             intermediate_size=96, max_position_embeddings=512)
    )  # fmt: skip
    assert not moe_kernel_fits(dense) and "moe_experts" not in select_kernels(config=dense)


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_build_emits_sass_exports_and_checks_arguments(tmp_path: Path) -> None:
    from ignis.compiler.kernels.moe_experts import build_moe_experts

    path = build_moe_experts("sm_90", out_path=tmp_path / "moe_experts.so")
    check_sass_and_exports(path, "sm_90", FUNCTION_NAMES, ("moe_q4_kernel", "moe_q4_kernel"))
    pytest.importorskip("tvm_ffi")
    mod = load_on_host_or_skip(path)
    x, ids = torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32)
    packed, scales = torch.zeros(3, 40, 8, dtype=torch.int32), torch.zeros(3, 40, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["moe_q4_gate_up"](x, ids, packed, scales, torch.empty(2, 2, 40))
    with pytest.raises(ValueError, match="y must be"):
        mod["moe_q4_gate_up"](x, ids, packed, scales, torch.empty(2, 2, 41))
    with pytest.raises(TypeError, match="int32"):
        mod["moe_q4_gate_up"](x, ids.long(), packed, scales, torch.empty(2, 2, 40))
    with pytest.raises(ValueError, match="rows \\* top_k"):
        big = torch.zeros(600, 2, dtype=torch.int32)
        mod["moe_q4_gate_up"](torch.zeros(600, 64), big, packed, scales, torch.empty(600, 2, 40))
    h, rw = torch.zeros(2, 2, 64), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["moe_q4_down"](h, ids, packed, scales, rw, torch.empty(2, 2, 40))
    with pytest.raises(TypeError, match="float32"):
        mod["moe_q4_down"](h, ids, packed, scales, rw.half(), torch.empty(2, 2, 40))
    with pytest.raises(ValueError, match="x must be"):
        mod["moe_q4_down"](torch.zeros(2, 2, 48), ids, packed, scales, rw, torch.empty(2, 2, 40))


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_kernel(tmp_path_factory: pytest.TempPathFactory) -> MoeExpertsKernel:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    env = os.environ.get("IGNIS_MOE_MODULE")
    if env:
        path = Path(env)
        if path.is_dir():
            path = path / f"moe_experts_sm{major}{minor}.so"
        if not path.exists():
            pytest.skip(f"IGNIS_MOE_MODULE={env} holds no module for sm_{major}{minor}")
    elif HAS_NVCC:
        from ignis.compiler.kernels.moe_experts import build_moe_experts

        path = build_moe_experts(f"sm_{major}{minor}", out_path=tmp_path_factory.mktemp("moe") / "moe.so")
    else:
        pytest.skip("no compiled grouped MoE kernels: set IGNIS_MOE_MODULE or install nvcc")
    return MoeExpertsKernel(path)


def _rand_stack(slots: int, n: int, k: int, g: torch.Generator) -> Q4Weight:
    packed = torch.randint(-(2**31), 2**31 - 1, (slots, n, k // 8), generator=g, dtype=torch.int32)
    scales = (torch.rand(slots, n, k // 32, generator=g) * (2 / (7 * k**0.5))).half()
    return Q4Weight(packed.view(torch.uint32), scales)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_cuda_kernels_equal_reference_at_the_issue_shapes(cuda_kernel: MoeExpertsKernel, rows: int) -> None:
    dev, top_k, slots = torch.device("cuda"), 8, 64
    g = torch.Generator().manual_seed(rows)
    gate_up = _rand_stack(slots, 2048, 3072, g).to(dev)
    down = _rand_stack(slots, 3072, 1024, g).to(dev)
    x = torch.randn(rows, 3072, generator=g).to(dev, torch.bfloat16)
    ids = _rand_ids(rows, top_k, slots, g).to(dev)  # 3+ rows x 8 of 64: slots shared by rows
    h = cuda_kernel.gate_up(x, ids, gate_up)
    want_h = grouped_q4_reference(x, ids, gate_up.packed, gate_up.scales)
    torch.testing.assert_close(h.float(), want_h.float(), rtol=2e-2, atol=2e-2)
    route_w = torch.rand(rows, top_k, generator=g).to(dev)
    y = torch.full((rows, top_k, 3072), float("nan"), device=dev)
    cuda_kernel.down(h, ids, down, route_w, y)  # SwiGLU fused: h is [gate | up]
    want = grouped_q4_reference(h, ids, down.packed, down.scales, route_w=route_w)
    torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3)
    act = (torch.nn.functional.silu(h[..., :1024]) * h[..., 1024:]).contiguous()
    y2 = torch.empty_like(y)
    cuda_kernel.down(act, ids, down, route_w, y2)  # the plain input (torch's SwiGLU: exp may differ)
    torch.testing.assert_close(y2, y, rtol=2e-3, atol=2e-3)
    masked = ids.clone()
    masked[:, ::2] = -1
    y3 = torch.full_like(y, 5.0)
    cuda_kernel.down(h, masked, down, route_w, y3)
    assert torch.equal(y3[:, ::2], torch.full_like(y3[:, ::2], 5.0))
    assert torch.equal(y3[:, 1::2], y[:, 1::2])  # bit for bit: a pair does not depend on the others


def _cuda_block(kernel: MoeExpertsKernel, g: torch.Generator) -> tuple[SparseMoeWeights, SparseMoeWeights]:
    dev = torch.device("cuda")
    hidden, inter, n = 512, 256, 16
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    experts = [SwiGLUWeights(*(_rand_stack(1, r, c, g)[0] for r, c in shapes)) for _ in range(n)]
    shared = SwiGLUWeights(
        *((torch.randn(r, c, generator=g) * 0.05).to(dev, torch.bfloat16) for r, c in shapes)
    )
    router = (torch.randn(n, hidden, generator=g) * 0.1).to(dev, torch.bfloat16)
    on_device = [SwiGLUWeights(*(p.to(dev) for p in (e.gate, e.up, e.down))) for e in experts]
    gate = torch.randn(1, hidden, generator=g).to(dev, torch.bfloat16)
    base = SparseMoeWeights(router, on_device, shared, gate)
    host = dataclasses.replace(base, experts=experts)
    return _grouped(base, kernel), host


@pytest.mark.gpu
def test_cuda_block_equals_reference_loop_and_cache_of_two_equals_resident(
    cuda_kernel: MoeExpertsKernel,
) -> None:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    grouped, host = _cuda_block(cuda_kernel, g)
    assert grouped.grouped.capturable
    loop = dataclasses.replace(grouped, grouped=None)
    cache = ExpertCache(2, device=dev)
    slots = cache.make_layer(host.experts, linear=torch_linear, dtype=torch.bfloat16, stacked=True)
    cached = dataclasses.replace(
        host, experts=slots, grouped=GroupedExperts(*slots.stacks(), kernel=cuda_kernel, slots=slots)
    )
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, 512, generator=g).to(dev, torch.bfloat16)
        got = sparse_moe_block(x, grouped, top_k=4, norm_topk_prob=True, linear=torch_linear)
        want = sparse_moe_block(x, loop, top_k=4, norm_topk_prob=True, linear=torch_linear)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
        assert torch.equal(
            sparse_moe_block(x, cached, top_k=4, norm_topk_prob=True, linear=torch_linear), got
        )
    assert cache.stats.misses > 16


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_cuda_static_executor_graphs_moe_rounds(
    cuda_kernel: MoeExpertsKernel, family: str, tmp_path: Path
) -> None:
    """Resident experts + the kernels: rounds are graphed (no host sync in the MoE layers) and equal
    the eager static rounds."""
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
    from ignis.runtime.sampling import SamplingParams

    tiny = make_tiny_hybrid(family, tmp_path / family)
    tensors = _q4_experts(tiny.canonical_tensors())
    dev = torch.device("cuda")
    kw = dict(device=dev, dtype=torch.bfloat16, linear=torch_linear, max_lanes=4, max_context=256)
    kw["chunked_prefill"] = 32  # prompts as static rounds in both (graphed and eager)
    graphed = StaticHybridExecutor(tiny.config, tensors, moe_module=cuda_kernel, **kw)
    eager = StaticHybridExecutor(tiny.config, tensors, moe_module=cuda_kernel, cuda_graphs=False, **kw)
    assert graphed.cuda_graphs
    greedy = SamplingParams(temperature=0, max_tokens=12)
    prompts = [[5, 17, 3, 99, 250, 7, 8, 41], list(range(30, 60))]
    outs = [
        [o.output_token_ids for o in SpeculativeEngine(ex, None).generate(prompts, greedy)]
        for ex in (graphed, eager)
    ]
    assert outs[0] == outs[1] and graphed.num_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize(("num_slots", "lookahead"), [(1, False), (2, False), (2, True)])
def test_cuda_piecewise_cached_rounds_equal_eager_and_resident(
    cuda_kernel: MoeExpertsKernel, family: str, num_slots: int, lookahead: bool, tmp_path: Path
) -> None:
    """An expert cache of 1-2 slots a layer + the kernels: static rounds replayed in pieces between the
    MoE syncs (moe_piecewise.py) give every logit of the eager cached rounds bit for bit, and the
    greedy output of the resident (whole-round graphed) executor; misses are batched driver copies;
    with router lookahead too (experts prefetched on the copy stream)."""
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
    from ignis.runtime.sampling import SamplingParams

    tiny = make_tiny_hybrid(family, tmp_path / family)
    tensors = _q4_experts(tiny.canonical_tensors())
    dev = torch.device("cuda")
    kw = dict(device=dev, dtype=torch.bfloat16, linear=torch_linear, max_lanes=4, max_context=256)
    kw["chunked_prefill"] = 32
    resident = StaticHybridExecutor(tiny.config, tensors, moe_module=cuda_kernel, **kw)
    caches = [ExpertCache(num_slots, device=dev, lookahead=lookahead) for _ in range(2)]
    pieces = StaticHybridExecutor(tiny.config, tensors, moe_module=cuda_kernel, expert_cache=caches[0], **kw)
    eager = StaticHybridExecutor(
        tiny.config, tensors, moe_module=cuda_kernel, expert_cache=caches[1], cuda_graphs=False, **kw
    )
    assert resident.cuda_graphs and pieces.piecewise_graphs and not pieces.cuda_graphs
    assert not eager.piecewise_graphs and eager._moe_pieces is not None
    assert all(layer.batched for layer in caches[0].layers), caches[0].describe_host()
    # verify rounds of 3 lanes, logits bit for bit
    g = torch.Generator().manual_seed(12)
    lanes = {id(ex): [ex.new_lane() for _ in range(3)] for ex in (pieces, eager)}
    prompts = [torch.tensor([5, 17, 3, 99, 250, 7, 8, 41]), torch.arange(30, 50), torch.tensor([1, 2, 3])]
    for record, cols in ((False, prompts), (True, None), (True, None), (True, None)):
        if cols is None:
            cols = [torch.randint(0, tiny.config.vocab_size, (4,), generator=g) for _ in range(3)]
        outs = [ex.forward(lanes[id(ex)], cols, record=record).logits for ex in (pieces, eager)]
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
        keep = [c.numel() for c in cols] if not record else [1, 4, 2]
        for ex in (pieces, eager):
            ex.commit(lanes[id(ex)], keep)
    for ex in (pieces, eager):
        for lane in lanes[id(ex)]:
            ex.release_lane(lane)
    assert pieces.num_replays > 0 and pieces.num_captures > 0
    greedy = SamplingParams(temperature=0, max_tokens=12)
    text = [[5, 17, 3, 99, 250, 7, 8, 41], list(range(30, 60))]
    outs = [
        [o.output_token_ids for o in SpeculativeEngine(ex, None).generate(text, greedy)]
        for ex in (resident, pieces, eager)
    ]
    assert outs[0] == outs[1] == outs[2]
    stats = caches[0].stats
    assert stats.misses > len(caches[0].layers) * tiny.config.num_experts
    assert stats.direct_copies == stats.misses + stats.prefetches and stats.staged_copies == 0
    assert (stats.prefetches > 0) == lookahead
    # warm-up at load captures without counting lookups
    before = stats.snapshot()
    assert pieces.warm_up(context=64) > 0 and stats.snapshot() == before
