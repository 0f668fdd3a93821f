"""The tiled q4 layout in the runtime (runtime/linear.py): `Q4Weight` in the tiled layout, its
dispatch to "q4_g32_tiled" functions, and the placement rule (`tile_decision`, `LinearBackend.place`,
`Artifact.make_executor`), on the CPU with Python stand-ins for the CUDA functions; one GPU test
runs a tiny artifact built for the GPU's card through the real tiled modules."""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_tiny  # tests/ is on pytest's pythonpath
import numpy as np
import pytest
import torch
from hybrid_graph_checks import assert_greedy_equal_up_to_a_near_tie, greedy_with_margins

from ignis.formats import quantize_q4_g32
from ignis.runtime.kernels.q4_tiled import tile_q4, untile_q4
from ignis.runtime.linear import (
    CompiledLinears,
    LinearBackend,
    Q4TiledLayoutError,
    Q4Weight,
    WeightLoader,
    cat_rows,
    place_weight,
    row_splits_of,
    tile_decision,
    torch_linear,
)


def _q4(*shape: int, seed: int = 0, dtype: torch.dtype = torch.int32) -> Q4Weight:
    """A random row-major q4 weight [*lead, N, K] (every nibble value, scales of both signs)."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    packed = torch.randint(-(2**31), 2**31 - 1, (*lead, n, k // 8), generator=g, dtype=torch.int64)
    packed = packed.to(torch.int32)
    if dtype == torch.uint32:
        packed = packed.view(torch.uint32)
    scales = (torch.rand((*lead, n, k // 32), generator=g) - 0.5).half()
    return Q4Weight(packed, scales)


# ---------------------------------------------------------------------------------------------
# Q4Weight in the tiled layout


@pytest.mark.parametrize("shape", [(16, 128), (40, 256), (1, 128), (3, 24, 384)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint32])
def test_to_tiled_is_tile_q4_and_round_trips_exactly(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    w = _q4(*shape, dtype=dtype)
    t = w.to_tiled()
    codes, scales = tile_q4(w.packed, w.scales)
    assert t.is_tiled and not w.is_tiled and t.layout == "tiled" and t.rows == shape[-2]
    assert torch.equal(t.packed, codes) and torch.equal(t.scales, scales) and t.packed.dtype == dtype
    assert t.shape == w.shape == shape and t.lead == w.lead == shape[:-2]
    assert (t.out_features, t.in_features) == (w.out_features, w.in_features) == shape[-2:]
    assert torch.equal(t.dequantize(), w.dequantize())  # exact (float32)
    assert torch.equal(t.dequantize(torch.bfloat16), w.dequantize(torch.bfloat16))
    back = t.to_row_major()
    assert torch.equal(back.packed, w.packed) and torch.equal(back.scales, w.scales) and not back.is_tiled
    assert t.to_tiled() is t and w.to_row_major() is w
    # chunked re-lay (tiny chunks: one tile at a time) gives the same bytes
    small = w.to_tiled(chunk_bytes=1)
    assert torch.equal(small.packed, t.packed) and torch.equal(small.scales, t.scales)


def test_tiled_to_and_contiguous_keep_the_layout() -> None:
    t = _q4(40, 128).to_tiled()
    moved = t.to("cpu")
    assert moved.is_tiled and moved.rows == 40 and torch.equal(moved.packed, t.packed)
    assert t.contiguous() is t
    strided = t[:32]
    assert strided.contiguous().is_tiled and strided.contiguous().rows == 32
    assert t.device == torch.device("cpu")


def test_tiled_parts_are_validated() -> None:
    t = _q4(40, 128).to_tiled()
    with pytest.raises(Q4TiledLayoutError, match=r"holds 33\.\.48 rows"):
        Q4Weight(t.packed, t.scales, "tiled", 32)
    with pytest.raises(Q4TiledLayoutError, match="rows=None"):
        Q4Weight(t.packed, t.scales, "tiled")
    with pytest.raises(Q4TiledLayoutError, match=r"\[\*lead, T, S, 256\]"):
        Q4Weight(t.packed[..., :128], t.scales, "tiled", 40)
    with pytest.raises(ValueError, match="takes no rows"):
        Q4Weight(_q4(16, 128).packed, _q4(16, 128).scales, "row_major", 16)
    with pytest.raises(ValueError, match="layout must be"):
        Q4Weight(t.packed, t.scales, "columns", 40)
    with pytest.raises(Q4TiledLayoutError, match="multiple of 128"):
        _q4(16, 96).to_tiled()
    # the functions themselves name wrong dtypes (not a torch "rshift not implemented" error)
    with pytest.raises(Q4TiledLayoutError, match="untile_q4 needs u32/i32 codes and f16 scales"):
        untile_q4(t.packed.float(), t.scales, 40)
    with pytest.raises(Q4TiledLayoutError, match="untile_q4 needs u32/i32 codes and f16 scales"):
        untile_q4(t.packed, t.scales.float(), 40)
    with pytest.raises(Q4TiledLayoutError, match="tile_q4 needs u32/i32 codes"):
        tile_q4(_q4(16, 128).packed.long(), _q4(16, 128).scales)


def test_tiled_getitem_indexes_lead_dims_and_whole_tiles() -> None:
    w = _q4(3, 48, 128, seed=1)  # an expert stack [E, 2 I, K] with I = 24? no: 48 rows, tiles of 16
    t = w.to_tiled()
    for index in (1, (2,), (1, slice(0, 32)), (1, slice(16, None)), (0, slice(32, 48)), slice(0, 2)):
        got, want = t[index], w[index]
        assert got.is_tiled and got.shape == want.shape, index
        assert torch.equal(got.dequantize(), want.dequantize()), index
    assert t[1, 16:].rows == 32 and t[1, :16].packed.shape == (1, 1, 256)
    # the last tile's padding: a slice to N (48 is a multiple of 16 here; 40 below is not)
    u = _q4(40, 128, seed=2)
    assert torch.equal(u.to_tiled()[16:].dequantize(), u[16:].dequantize())
    assert torch.equal(u.to_tiled()[32:40].dequantize(), u[32:40].dequantize())


@pytest.mark.parametrize(
    ("index", "match"),
    [
        ((1, slice(0, 20)), "not on 16-row tile boundaries"),
        ((1, slice(8, None)), "not on 16-row tile boundaries"),
        ((1, slice(0, 32, 2)), "not on 16-row tile boundaries"),
        ((1, slice(16, 16)), "not on 16-row tile boundaries"),
        ((1, 3), "cannot select one row"),
        ((1, slice(None), 0), "reaches the K axis"),
        ((Ellipsis, slice(0, 16)), "int and slice indices only"),
        (torch.tensor([0, 1]), "int and slice indices only"),
    ],
)
def test_tiled_getitem_refuses_what_the_layout_cannot_slice(index: Any, match: str) -> None:
    t = _q4(3, 48, 128).to_tiled()
    with pytest.raises(Q4TiledLayoutError, match=match):
        t[index]
    assert issubclass(Q4TiledLayoutError, ValueError)


def test_cat_rows_of_tiled_weights() -> None:
    a, b, c = _q4(32, 128, seed=3), _q4(16, 128, seed=4), _q4(48, 128, seed=5)
    fused = Q4Weight.cat_rows([a.to_tiled(), b.to_tiled(), c.to_tiled()])
    want = Q4Weight.cat_rows([a, b, c])
    assert fused.is_tiled and fused.rows == 96
    assert torch.equal(fused.packed, want.to_tiled().packed) and torch.equal(
        fused.dequantize(), want.dequantize()
    )
    fused2 = cat_rows([a.to_tiled(), b.to_tiled()])
    assert isinstance(fused2, Q4Weight) and fused2.rows == 48
    # a stack: along the tile axis of every member
    s1, s2 = _q4(2, 16, 128, seed=6), _q4(2, 32, 128, seed=7)
    fs = Q4Weight.cat_rows([s1.to_tiled(), s2.to_tiled()])
    assert fs.shape == (2, 48, 128) and torch.equal(fs.dequantize(), Q4Weight.cat_rows([s1, s2]).dequantize())
    with pytest.raises(Q4TiledLayoutError, match=r"multiple of 16, got \[32, 40\]"):
        Q4Weight.cat_rows([a.to_tiled(), _q4(40, 128).to_tiled()])
    with pytest.raises(Q4TiledLayoutError, match="row-major and tiled"):
        Q4Weight.cat_rows([a.to_tiled(), b])
    # row-major weights fuse as before
    assert not Q4Weight.cat_rows([a, _q4(40, 128)]).is_tiled


# ---------------------------------------------------------------------------------------------
# the placement rule


def test_tile_decision() -> None:
    served = {(64, 128), (32, 256), (40, 128)}
    assert tile_decision((64, 128), served)
    assert tile_decision((8, 64, 128), served)  # a stack indexed whole-row
    assert tile_decision((40, 128), served)  # any N (the last tile padded)
    assert not tile_decision((64, 256), served)  # not served
    # K % 128 != 0 is served only by a function built with padded_in_features (the weight is then
    # padded with zero columns when tiled); K must be whole q4 groups of 32
    assert tile_decision((64, 96), {(64, 96)}) and not tile_decision((64, 96), served)
    assert not tile_decision((64, 100), {(64, 100)})
    assert tile_decision((4, 64, 256), served, row_splits=2)  # gate_up [E, 2 I, K], I = 32
    assert not tile_decision((4, 80, 128), served, row_splits=2)  # I = 40: slices off tile boundaries
    assert not tile_decision((4, 64, 128), served, row_splits=2)  # (32, 128) not served
    assert row_splits_of("model.layers.0.mlp.experts.gate_up_proj") == 2
    assert row_splits_of("model.layers.0.mlp.experts.down_proj") == 1
    assert row_splits_of("model.layers.0.mlp.gate_proj.weight") == 1
    with pytest.raises(ValueError):
        tile_decision((64,), served)


def _tiled_call(
    calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]], outs: list[int] | None = None
) -> Callable[..., None]:
    """A stand-in for a "q4_g32_tiled" function: the math in torch, from the tiled parts (outs: the
    data_ptr of every y it writes)."""

    def call(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, y: torch.Tensor) -> None:
        assert codes.dim() == 3 and codes.shape[-1] == 256 and scales.shape == (*codes.shape[:2], 64)
        assert codes.shape[0] == math.ceil(y.shape[1] / 16) and codes.shape[1] * 128 == x.shape[1]
        assert x.is_contiguous() and codes.is_contiguous() and scales.is_contiguous() and y.is_contiguous()
        calls.append(("tiled", tuple(x.shape), tuple(codes.shape)))
        if outs is not None:
            outs.append(y.data_ptr())
        p, s = untile_q4(codes, scales, y.shape[1])
        y.copy_(torch_linear(x, Q4Weight(p, s)))

    return call


def _row_major_call(calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> Callable[..., None]:
    def call(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, y: torch.Tensor) -> None:
        calls.append(("row_major", tuple(x.shape), tuple(packed.shape)))
        y.copy_(torch_linear(x, Q4Weight(packed, scales)))

    return call


def _fake_compiled(
    tiled: set[tuple[int, int]],
    row_major: set[tuple[int, int]] = frozenset(),  # type: ignore[assignment]
    *,
    widths: tuple[int, ...] = (8, 16),
    dtype: str = "float32",
    calls: list[Any] | None = None,
    outs: list[int] | None = None,
) -> CompiledLinears:
    calls = [] if calls is None else calls
    fns: dict[tuple[int, str, int, int, str], tuple[Any, ...]] = {}
    for w in widths:
        for n, k in tiled:
            fns[(w, "q4_g32_tiled", n, k, dtype)] = (
                _tiled_call(calls, outs),
                True,
                False,
                f"nt{(w + 7) // 8}",
            )
        for n, k in row_major:
            fns[(w, "q4_g32", n, k, dtype)] = (_row_major_call(calls), True, False, "tir")
    return CompiledLinears(fns, widths)


def test_dispatch_of_a_tiled_weight(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Any] = []
    compiled = _fake_compiled({(40, 128)}, {(24, 64)}, calls=calls)
    assert compiled.tiled_shapes(cuda=False) == {(40, 128)} and compiled.tiled_shapes(cuda=True) == set()
    backend = LinearBackend(compiled)
    w = _q4(40, 128, seed=8)
    t = w.to_tiled()
    x = torch.randn(2, 5, 128)
    bias = torch.randn(40)
    want = torch_linear(x, w, bias)
    torch.testing.assert_close(backend(x, t, bias), want, rtol=1e-5, atol=1e-5)
    assert calls[-1] == ("tiled", (10, 128), (3, 1, 256)) and backend.counts["compiled"] == 1
    # rows above every width: chunks of the widest, each on the tiled function, each writing its
    # rows of the one result (no concatenation)
    big = torch.randn(37, 128)
    outs: list[int] = []
    backend = LinearBackend(_fake_compiled({(40, 128)}, {(24, 64)}, calls=calls, outs=outs))
    got = backend(big, t)
    torch.testing.assert_close(got, torch_linear(big, w), rtol=1e-5, atol=1e-5)
    assert [c[1][0] for c in calls[-3:]] == [16, 16, 5]
    row_bytes = 40 * got.element_size()
    assert outs == [got.data_ptr() + i * row_bytes for i in (0, 16, 32)]
    # a row-major weight still goes to the row-major function
    r = _q4(24, 64, seed=9)
    x2 = torch.randn(3, 64)
    torch.testing.assert_close(backend(x2, r), torch_linear(x2, r), rtol=1e-5, atol=1e-5)
    assert calls[-1][0] == "row_major"
    # a row-major weight of a shape only the tiled functions serve: a logged fallback, still right
    with caplog.at_level(logging.WARNING, logger="ignis.runtime.linear"):
        torch.testing.assert_close(backend(x, w), want - bias, rtol=1e-5, atol=1e-5)
    assert backend.counts["fallback"] == 1 and "no compiled q4_g32 linear [40, 128]" in caplog.text
    # a tiled weight without a function for its shape: torch over the untiled weight, logged
    other = _q4(48, 256, seed=10).to_tiled()
    x3 = torch.randn(4, 256)
    with caplog.at_level(logging.WARNING, logger="ignis.runtime.linear"):
        torch.testing.assert_close(
            backend(x3, other), torch_linear(x3, other.to_row_major()), rtol=1e-5, atol=1e-5
        )
    assert backend.counts["fallback"] == 2 and "no compiled q4_g32_tiled linear [48, 256]" in caplog.text
    # no compiled modules at all: the torch reference untiles
    torch.testing.assert_close(LinearBackend()(x, t, bias), want, rtol=1e-5, atol=1e-5)


def test_place_tiles_served_shapes_only() -> None:
    backend = LinearBackend(_fake_compiled({(40, 128), (32, 128), (64, 256)}))
    w = _q4(40, 128)
    placed = backend.place(w)
    assert (
        isinstance(placed, Q4Weight) and placed.is_tiled and torch.equal(placed.dequantize(), w.dequantize())
    )
    assert backend.place(placed) is placed
    unserved = _q4(48, 128)
    assert backend.place(unserved) is unserved
    dense = torch.randn(40, 128)
    assert backend.place(dense) is dense
    # a gate_up stack [E, 2 I, K] whose halves are served: tiled, and its halves slice on tiles
    gate_up = _q4(4, 64, 128, seed=11)
    placed_gu = backend.place(gate_up, row_splits=2)
    assert isinstance(placed_gu, Q4Weight) and placed_gu.is_tiled
    assert torch.equal(placed_gu[2, 32:].dequantize(), gate_up[2, 32:].dequantize())
    assert backend.place(gate_up, row_splits=1) is gate_up  # (64, 128) is not served
    # no compiled modules, or the F.linear hook: nothing changes
    assert LinearBackend().place(w) is w
    assert place_weight(torch.nn.functional.linear, w) is w
    assert place_weight(backend, w).is_tiled  # type: ignore[union-attr]
    # CUDA functions serve weights on a CUDA device only: a CPU weight stays row-major
    fns = {(8, "q4_g32_tiled", 40, 128, "bfloat16"): (lambda *a: None, True, True, "m.so")}
    assert LinearBackend(CompiledLinears(fns, [8])).place(w) is w


def test_place_warms_each_cuda_tiled_function_over_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled kernel's workspace need depends on the rows (a call whose activations do not fit
    in shared memory runs the warp variant, which needs more workspace): `place` runs each CUDA tiled
    function at the fewest and the most rows the dispatch gives it (width W serves the rows above
    the next smaller width up to W), once per function, so that no later call grows (and frees) a
    workspace a CUDA graph captured. (CPU stand-ins flagged as CUDA functions; the weight's device
    reads as CUDA.)"""
    import contextlib

    import ignis.runtime.kernels.tvm_runtime as tvm_runtime

    calls: list[tuple[str, int, int, torch.dtype]] = []

    def fn_of(module: str, width: int) -> Callable[..., None]:
        def call(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, y: torch.Tensor) -> None:
            assert 1 <= x.shape[0] <= width and y.shape == (x.shape[0], 40) and codes.shape == (3, 1, 256)
            calls.append((module, int(x.shape[0]), width, x.dtype))

        return call

    widths = (1, 3, 8, 16, 32)
    fns: dict[tuple[int, str, int, int, str], tuple[Any, ...]] = {}
    for w in widths:
        module = f"q4_tiled_nt{(w + 7) // 8}.so"  # the artifact's layout: one library per n-tile count
        fns[(w, "q4_g32_tiled", 40, 128, "bfloat16")] = (fn_of(module, w), True, True, module)
    backend = LinearBackend(CompiledLinears(fns, widths))
    monkeypatch.setattr(Q4Weight, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(tvm_runtime, "torch_stream", contextlib.nullcontext)
    placed = backend.place(_q4(40, 128))
    assert isinstance(placed, Q4Weight) and placed.is_tiled
    bf16 = torch.bfloat16
    assert sorted(calls) == [
        ("q4_tiled_nt1.so", 1, 1, bf16),
        ("q4_tiled_nt1.so", 2, 3, bf16),
        ("q4_tiled_nt1.so", 3, 3, bf16),
        ("q4_tiled_nt1.so", 4, 8, bf16),
        ("q4_tiled_nt1.so", 8, 8, bf16),
        ("q4_tiled_nt2.so", 9, 16, bf16),
        ("q4_tiled_nt2.so", 16, 16, bf16),
        ("q4_tiled_nt4.so", 17, 32, bf16),
        ("q4_tiled_nt4.so", 32, 32, bf16),
    ]
    calls.clear()
    backend.place(_q4(2, 40, 128, seed=1))  # the same shape again (a stack member): nothing to grow
    assert calls == []
    # one library exporting every width's function (tools/bench/e2e_gpu.py's bundle, no module
    # name): each function still runs within its own rows only
    fns = {(w, "q4_g32_tiled", 40, 128, "bfloat16"): (fn_of("", w), True, True) for w in (1, 8, 32)}
    backend = LinearBackend(CompiledLinears(fns, (1, 8, 32)))
    backend.place(_q4(40, 128))
    assert sorted(c[:3] for c in calls) == [("", 1, 1), ("", 2, 8), ("", 8, 8), ("", 9, 32), ("", 32, 32)]


def test_weight_loader_places_linear_weights_for_the_hook() -> None:
    backend = LinearBackend(_fake_compiled({(32, 128), (16, 128)}))
    weights = {
        "a.q_proj.weight": _q4(32, 128),
        "m.experts.gate_up_proj": _q4(2, 32, 128),
        "m.experts.down_proj": _q4(2, 16, 128),
        "norm.weight": torch.ones(128),
    }
    load = WeightLoader(weights, torch.device("cpu"), torch.float32, source="test", linear=backend)
    q = load.linear("a.q_proj.weight")
    gu = load.linear("m.experts.gate_up_proj")  # halves (16, 128) served, 16 % 16 == 0
    down = load.linear("m.experts.down_proj")
    assert all(isinstance(w, Q4Weight) and w.is_tiled for w in (q, gu, down))
    plain = WeightLoader(weights, torch.device("cpu"), torch.float32, source="test")
    assert not plain.linear("a.q_proj.weight").is_tiled  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# executors over tiled weights (CPU, Python stand-ins for the tiled functions)


def _quantized(
    tensors: dict[str, torch.Tensor], is_linear: Callable[[str, torch.Tensor], bool]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if is_linear(name, t):
            packed, scales = quantize_q4_g32(t.detach().float().numpy())
            out[name] = Q4Weight(torch.from_numpy(packed.view(np.int32)), torch.from_numpy(scales))
        else:
            out[name] = t.detach().float()
    return out


def _served(weights: dict[str, Any], extra: set[tuple[int, int]] = frozenset()) -> set[tuple[int, int]]:  # type: ignore[assignment]
    shapes = set(extra)
    for name, w in weights.items():
        if isinstance(w, Q4Weight):
            n, k = w.shape[-2:]
            shapes.add((n // row_splits_of(name), k))
    return shapes


def test_llama_fuses_before_tiling_and_matches_torch() -> None:
    """The llama executor fuses q|k|v and gate|up in the row-major layout and places the fused
    weights (tiled where served); logits equal the dequantized model's, every q4 linear runs tiled."""
    from ignis.runtime.families import get_family

    model = hf_tiny.tiny_model("llama", hidden_size=128, intermediate_size=256)
    family = get_family("llama")
    config = family.config_cls.from_hf(model.config.to_dict())
    names = family.tensor_shapes(config)
    tensors = {k: v for k, v in model.state_dict().items() if k in names}
    q4 = _quantized(tensors, lambda n, t: n.endswith("proj.weight") or n == "lm_head.weight")
    dense = {k: v.dequantize() if isinstance(v, Q4Weight) else v for k, v in q4.items()}
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    fused = {(config.num_attention_heads * config.head_dim + 2 * kv, h), (2 * config.intermediate_size, h)}
    calls: list[Any] = []
    # the members' own shapes are served too (q_proj [128, 128] == o_proj's): the executor must not
    # fuse tiled members, it fuses the row-major ones and tiles the result
    backend = LinearBackend(_fake_compiled(_served(q4, fused), calls=calls))
    tiled_q = backend.place(q4["model.layers.0.self_attn.q_proj.weight"])
    q4["model.layers.0.self_attn.q_proj.weight"] = tiled_q  # a caller that tiled a member anyway
    ex = family.make_executor(config, q4, "cpu", torch.float32, linear=backend)
    layer = ex.layers[0]
    assert all(
        isinstance(w, Q4Weight) and w.is_tiled
        for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)
    )
    assert isinstance(ex.lm_head, Q4Weight) and ex.lm_head.is_tiled
    ref = family.make_executor(config, dense, "cpu", torch.float32)
    cols = torch.tensor([3, 1, 4, 1, 5])
    out = ex.forward([ex.new_lane()], [cols]).logits[0]
    want = ref.forward([ref.new_lane()], [cols]).logits[0]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert backend.counts["fallback"] == 0 and calls and all(c[0] == "tiled" for c in calls)


def test_hybrid_moe_executor_slices_tiled_expert_stacks() -> None:
    """qwen3_5_moe with fused expert stacks: gate_up [E, 2 I, H] is tiled whole (I % 16 == 0) and
    sliced per expert on tile boundaries; logits equal the dequantized model's."""
    import hf_tiny_hybrid

    from ignis.runtime.families import get_family
    from ignis.runtime.families.hybrid_executor import HybridExecutor
    from ignis.runtime.families.qwen3_5 import tensor_shapes

    # the tiny hybrid MoE config, at hidden 128 (K % 128 == 0: the tiled layout applies), 2 layers
    raw = dict(
        hf_tiny_hybrid._TEXT,
        **hf_tiny_hybrid._MOE,
        model_type="qwen3_5_moe_text",
        hidden_size=128,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    family = get_family("qwen3_5_moe")
    try:
        config = family.config_cls.from_hf(raw)
    except Exception as exc:  # the family's config parser wants the text config's own keys
        pytest.skip(f"tiny qwen3_5_moe config not accepted here: {exc}")
    shapes = tensor_shapes(config, expert_layout="fused")  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "A_log", "dt_bias")):
            tensors[name] = torch.rand(shape, generator=g) * 0.1
        else:
            tensors[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])

    def linear_name(name: str, t: torch.Tensor) -> bool:
        quantizable = name.endswith(("_proj.weight", "gate_up_proj", "down_proj", "lm_head.weight"))
        return quantizable and "conv1d" not in name and t.shape[-1] % 32 == 0

    q4 = _quantized(tensors, linear_name)
    gu_name = "model.layers.0.mlp.experts.gate_up_proj"
    assert isinstance(q4[gu_name], Q4Weight)
    dense = {k: v.dequantize() if isinstance(v, Q4Weight) else v for k, v in q4.items()}
    calls: list[Any] = []
    backend = LinearBackend(_fake_compiled(_served(q4), calls=calls))
    ex = HybridExecutor(config, q4, device="cpu", dtype=torch.float32, linear=backend)
    experts = ex._layers[0].mlp.experts  # type: ignore[union-attr]
    assert experts[1].gate.is_tiled and experts[1].up.is_tiled and experts[1].gate.shape == (32, 128)
    ref = HybridExecutor(config, dense, device="cpu", dtype=torch.float32)
    cols = torch.tensor([3, 1, 4, 1, 5, 9])
    out = ex.forward([ex.new_lane()], [cols]).logits[0]
    want = ref.forward([ref.new_lane()], [cols]).logits[0]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert any(c[0] == "tiled" for c in calls)


def test_artifact_places_served_q4_weights_tiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Artifact.make_executor` with a backend whose tiled functions serve the artifact's shapes:
    the loaded q4 weights come out tiled (the fused members are left to the executor) and the
    logits equal the torch executor's. (A q4 artifact for the h200 card, built without compiling
    modules; Python stand-ins serve as its tiled functions.)"""
    import dataclasses

    from ignis.compiler.build import build_artifact
    from ignis.compiler.build import plan as build_plan
    from ignis.runtime.artifact import load_artifact

    real = build_plan.plan_modules

    def no_modules(**kw: Any) -> Any:
        return dataclasses.replace(real(**kw), shapes=(), kernels=())

    monkeypatch.setattr(build_plan, "plan_modules", no_modules)
    ckpt = hf_tiny.save_tiny(
        hf_tiny.tiny_model("llama", hidden_size=128, intermediate_size=256),
        tmp_path / "ckpt",
        tokenizer=hf_tiny.tiny_tokenizer(),
    )
    (tmp_path / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = [1]\n')
    res = build_artifact(
        card="h200",
        model=ckpt,
        recipe=tmp_path / "r.toml",
        out=tmp_path / "tiny",
        progress=False,
        echo=lambda _l: None,
    )
    assert res.out is not None
    with load_artifact(res.out) as art:
        assert art.manifest.linear_dtype == "q4_g32" and not art.manifest.modules
        plain = art.target_weights(keep_q4=True)
        served = _served(dict(plain), {(h, k) for h, k in [(384, 128), (512, 128)]})
        calls: list[Any] = []
        backend = LinearBackend(_fake_compiled(served, calls=calls))
        placed = art.target_weights(keep_q4=True, linear=backend)
        assert placed["model.layers.0.self_attn.o_proj.weight"].is_tiled  # type: ignore[union-attr]
        assert not placed["model.layers.0.self_attn.q_proj.weight"].is_tiled  # type: ignore[union-attr]
        ex = art.make_executor(device="cpu", dtype=torch.float32, linear=backend)
        ref = art.make_executor(device="cpu", dtype=torch.float32)
        cols = torch.tensor([5, 7, 11])
        out = ex.forward([ex.new_lane()], [cols]).logits[0]
        want = ref.forward([ref.new_lane()], [cols]).logits[0]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        assert backend.counts["fallback"] == 0 and calls and all(c[0] == "tiled" for c in calls)


def _build_tiny_tiled_llama(
    card: str,
    tmp_path: Path,
    out: Path,
    widths: tuple[int, ...] | None = (1, 4, 8, 16),
    *,
    shape: tuple[int, int, int, int] = (256, 512, 4, 2),
    q4_pad_k: bool = False,
) -> None:
    """A tiny llama built for `card` into `out`, in a subprocess (the build imports TVM). `shape`:
    (hidden, intermediate, query heads, KV heads); the default has K % 128 == 0, so its q4 linears take
    the tiled route. `widths` None: the card profile's widths. `q4_pad_k`: the recipe's option (q4
    linears with K % 128 != 0 tiled over a padded K)."""
    import subprocess
    import textwrap

    hidden, intermediate, heads, kv_heads = shape
    ckpt = hf_tiny.save_tiny(
        hf_tiny.tiny_model(
            "llama",
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
        ),
        tmp_path / "ckpt",
        tokenizer=hf_tiny.tiny_tokenizer(),
    )
    modules = (f"widths = {list(widths)}\n" if widths is not None else "") + (
        "q4_pad_k = true\n" if q4_pad_k else ""
    )
    (tmp_path / "r.toml").write_text('name = "tiny"\n' + (f"[modules]\n{modules}" if modules else ""))
    code = textwrap.dedent(
        f"""
        from ignis.compiler.build import build_artifact
        build_artifact(card={card!r}, model={str(ckpt)!r}, recipe={str(tmp_path / "r.toml")!r},
                       out={str(out)!r}, progress=False, echo=lambda _l: None)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# GPU: the real tiled modules


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiled_modules_give_the_torch_greedy_tokens(tmp_path: Path) -> None:
    """A tiny llama built for this GPU's card (tiled route) and run through `make_executor` on CUDA:
    every served q4 weight is placed tiled, the compiled tiled functions run, and greedy decoding
    gives the tokens of the same artifact run on torch (bf16; the logit margins are checked so
    that a near-tie is reported, not hidden)."""
    import shutil

    prebuilt = os.environ.get("IGNIS_TILED_ARTIFACT")  # built on a host with nvcc (see gpu_suite.sh)
    if prebuilt:
        out = Path(prebuilt)
    else:
        if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
            pytest.skip("building the GPU artifact needs nvcc (or IGNIS_TILED_ARTIFACT)")
        major, minor = torch.cuda.get_device_capability()
        card = {(9, 0): "h200", (12, 0): "rtx5090"}.get((major, minor))
        if card is None:
            pytest.skip(f"no card profile for sm_{major}{minor}")
        out = tmp_path / "tiny"
        _build_tiny_tiled_llama(card, tmp_path, out)
    from ignis.runtime.artifact import load_artifact

    with load_artifact(out) as art:
        assert any(e.route == "cuda-tiled" for e in art.manifest.modules)
        backend = art.linear_backend()
        ex = art.make_executor(device="cuda", dtype=torch.bfloat16, linear=backend)
        layer = ex.layers[0]  # type: ignore[attr-defined]
        assert (
            layer.w_qkv.is_tiled and layer.w_o.is_tiled and layer.w_gate_up.is_tiled and layer.w_down.is_tiled
        )
        ref = art.make_executor(device="cuda", dtype=torch.bfloat16)
        prompt = torch.tensor([5, 17, 33, 2, 90, 41, 7], device="cuda")
        got, _ = greedy_with_margins(ex, prompt)
        want, margins = greedy_with_margins(ref, prompt)
        assert_greedy_equal_up_to_a_near_tie(got, want, margins)
        assert backend.counts["compiled"] > 0 and backend.counts["fallback"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiled_artifact_at_the_profile_widths(tmp_path: Path) -> None:
    """An artifact built at its card profile's widths (the h200's reach 64 rows: 33-64-row calls
    through the ring kernel) runs forwards of 1 x 64, 8 x 8, 5 x 8 and 1 x 57 rows on CUDA with the
    compiled functions (every call within the widest width: no 32-row chunks), and its logits match
    the same artifact on torch."""
    import shutil

    prebuilt = os.environ.get("IGNIS_TILED_WIDE_ARTIFACT")  # built on a host with nvcc
    if prebuilt:
        out = Path(prebuilt)
    else:
        if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
            pytest.skip("building the GPU artifact needs nvcc (or IGNIS_TILED_WIDE_ARTIFACT)")
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the wide profile widths are the h200's (sm_90)")
        out = tmp_path / "tiny"
        _build_tiny_tiled_llama("h200", tmp_path, out, widths=None)
    from ignis.runtime.artifact import load_artifact

    with load_artifact(out) as art:
        assert art.manifest.widths[-1] == 64
        backend = art.linear_backend()
        # the eager executors: the backend counts its calls, which a replayed CUDA graph does not make
        ex = art.make_executor(device="cuda", dtype=torch.bfloat16, linear=backend, cuda_graphs=False)
        ref = art.make_executor(device="cuda", dtype=torch.bfloat16, cuda_graphs=False)
        gen = torch.Generator().manual_seed(0)
        for lanes, cols in ((1, 64), (8, 8), (5, 8), (1, 57)):
            prompts = [torch.randint(3, 200, (cols,), generator=gen).cuda() for _ in range(lanes)]
            before = backend.counts["compiled"]
            outs = []
            for executor in (ex, ref):
                states = [executor.new_lane() for _ in range(lanes)]
                o = executor.forward(states, prompts, record=False)
                outs.append(torch.stack([lg.float() for lg in o.logits]))
            assert backend.counts["compiled"] > before and backend.counts["fallback"] == 0
            got, want = outs
            err = ((got - want).norm() / want.norm()).item()
            assert err < 2e-2, f"{lanes} x {cols}: rel err {err:.2e}"


def test_families_declare_the_fusions_a_loader_must_not_re_lay() -> None:
    from ignis.compiler.build.modules import FUSED_LINEARS
    from ignis.runtime.families import get_family

    llama = get_family("llama")
    assert llama.fused_linears == FUSED_LINEARS["llama"] == FUSED_LINEARS["qwen2"]
    assert llama.is_fused_member("model.layers.3.self_attn.k_proj.weight")
    assert llama.is_fused_member("model.layers.0.mlp.up_proj.weight")
    assert not llama.is_fused_member("model.layers.0.mlp.down_proj.weight")
    assert not llama.is_fused_member("model.layers.0.self_attn.o_proj.weight")
    assert not llama.is_fused_member("dflash2.layers.0.self_attn.q_proj.weight")
    hybrid = get_family("qwen3_5")
    assert hybrid.fused_linears == FUSED_LINEARS["qwen3_5"] == FUSED_LINEARS["qwen3_next"]
    for member in ("self_attn.q_proj", "self_attn.v_proj", "linear_attn.in_proj_z", "mlp.gate_proj"):
        assert hybrid.is_fused_member(f"model.layers.3.{member}.weight"), member
    for other in ("linear_attn.in_proj_b", "linear_attn.out_proj", "mlp.down_proj", "self_attn.o_proj"):
        assert not hybrid.is_fused_member(f"model.layers.3.{other}.weight"), other
    assert not hybrid.is_fused_member("model.layers.3.mlp.shared_expert.gate_proj.weight")
    assert not hybrid.is_fused_member("mtp.layers.0.self_attn.q_proj.weight")


def test_tiled_weight_refuses_bool_rows_and_indices() -> None:
    """A bool is not a row count nor an index of a tiled weight (torch would read it as a new axis)."""
    w = _q4(2, 32, 128).to_tiled()
    with pytest.raises(Q4TiledLayoutError, match="rows"):
        Q4Weight(w.packed, w.scales, "tiled", True)
    with pytest.raises(Q4TiledLayoutError, match="int and slice"):
        w[True]


# ---------------------------------------------------------------------------------------------
# K % 128 != 0: the tiled layout padded with zero columns (a build's q4_pad_k)


def _exact_q4(n: int, k: int, seed: int) -> Q4Weight:
    """A row-major q4 weight whose products with small-integer activations are exact in float32
    (scales powers of two), so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
    choices = torch.tensor([0.25, 0.5, 1.0, 2.0, -0.5, -1.0], dtype=torch.float16)
    scales = choices[torch.randint(0, len(choices), (n, k // 32), generator=g)]
    return Q4Weight(packed, scales)


def test_a_padded_tiled_weight_keeps_its_values() -> None:
    w = _q4(40, 576, seed=21)
    with pytest.raises(Q4TiledLayoutError):
        w.to_tiled()  # K % 128 != 0 without padding
    t = w.to_tiled(pad_k=True)
    assert t.is_tiled and t.cols == 576 and t.in_features == 576 and t.padded_in_features == 640
    assert t.shape == (40, 576) and t.packed.shape == (3, 5, 256) and t.scales.shape == (3, 5, 64)
    back = t.to_row_major()
    assert torch.equal(back.packed, w.packed) and torch.equal(back.scales, w.scales)
    assert torch.equal(t.dequantize(), w.dequantize())
    # the padding columns: code 8 and scale 0, dequantizing to exactly +0
    p, s = untile_q4(t.packed, t.scales, 40)
    full = Q4Weight(p, s).dequantize()
    assert full.shape == (40, 640) and torch.equal(full[:, :576], w.dequantize())
    assert torch.equal(full[:, 576:], torch.zeros(40, 64)) and not torch.signbit(full[:, 576:]).any()
    # row slices on tile boundaries, moves and fusions keep the padding
    assert t[16:].cols == 576 and torch.equal(t[16:].dequantize(), w[16:].dequantize())
    assert t.to("cpu").cols == 576 and t.contiguous().cols == 576
    two = Q4Weight.cat_rows(
        [_q4(16, 576, seed=1).to_tiled(pad_k=True), _q4(32, 576, seed=2).to_tiled(pad_k=True)]
    )
    assert two.cols == 576 and two.out_features == 48
    with pytest.raises(Q4TiledLayoutError, match="one in_features"):
        Q4Weight.cat_rows([t[:16], _q4(16, 640, seed=3).to_tiled()])
    # a stack pads every member
    stack = _q4(2, 16, 96, seed=4)
    ts = stack.to_tiled(pad_k=True)
    assert ts.cols == 96 and torch.equal(ts[1].dequantize(), stack[1].dequantize())
    for bad in (600, 512, 640, 577):  # not in (512, 640) or not whole groups
        with pytest.raises(Q4TiledLayoutError):
            Q4Weight(t.packed, t.scales, "tiled", 40, bad)
    with pytest.raises(ValueError, match="row-major"):
        Q4Weight(w.packed, w.scales, cols=576)


@pytest.mark.parametrize("rows", [1, 5, 8, 13])
def test_padded_product_equals_the_unpadded_reference(rows: int) -> None:
    """y = x @ W^T over the weight padded to K = 640 with zero columns and x padded with zeros (by the
    backend, or pre-padded by the caller) equals the reference dequantized q4 matmul at K = 576,
    bit for bit (exact arithmetic: any order gives the same floats)."""
    from ignis.runtime.linear import dequantize_q4

    w = _exact_q4(40, 576, seed=rows)
    x = torch.randint(-3, 4, (rows, 576), generator=torch.Generator().manual_seed(7)).float()
    want = x @ dequantize_q4(w.packed, w.scales).T  # the reference q4 product, K = 576
    calls: list[Any] = []
    backend = LinearBackend(_fake_compiled({(40, 576)}, calls=calls))  # a padded function (K 640)
    t = backend.place(w)
    assert isinstance(t, Q4Weight) and t.is_tiled and t.cols == 576
    got = backend(x, t)
    assert calls[-1][1] == (rows, 640) and calls[-1][2] == (3, 5, 256)  # the function saw K = 640
    assert torch.equal(got, want)
    pre = torch.zeros(rows, 640)
    pre[:, :576] = x
    assert torch.equal(backend(pre, t), want)  # pre-padded activations: no copy of x
    assert calls[-1][1] == (rows, 640) and backend.counts["compiled"] == 2
    # the torch route over a padded weight (no modules; or the pre-padded x) computes the same
    assert torch.equal(LinearBackend()(x, t), want) and torch.equal(torch_linear(pre, t), want)
    # a fixed-rows function pads rows and columns
    fixed = _fake_compiled({(40, 576)}, calls=calls)
    fixed._fns = {key: type(fn)(fn.call, False, fn.cuda, fn.module) for key, fn in fixed._fns.items()}
    assert torch.equal(LinearBackend(fixed)(x, t), want)
    assert calls[-1][1] == (8 if rows <= 8 else 16, 640)
