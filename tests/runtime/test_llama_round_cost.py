"""What a static llama round costs besides its math: the kernels its body launches a decoder layer
(each one a node of the CUDA graph replayed every round) and the host work of `StaticLlamaExecutor`
around the body (torch calls a round, outside the body).

On the CPU the body runs eagerly: the aten ops it dispatches are the kernels the CUDA graph holds
(views excluded; SDPA and RMSNorm counted as the one kernel each launches on CUDA).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import hf_tiny  # tests/ is on pytest's pythonpath
import pytest
import torch
import torch.nn.functional as F
from hybrid_graph_checks import (
    assert_greedy_equal_up_to_a_near_tie,
    compiled_kernel_or_skip,
    greedy_with_margins,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.families import llama_graphs
from ignis.runtime.families.llama import LlamaExecutor
from ignis.runtime.families.llama_graphs import StaticLlamaExecutor, rope_qk, signed_sin
from ignis.runtime.kernels.fused_mixers import FusedMixersKernel
from ignis.runtime.kernels.fused_norms import FusedNormsKernel
from ignis.runtime.linear import LinearBackend

#: aten ops that launch nothing on a device (views, metadata, allocations).
_NO_KERNEL = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.slice",
        "aten.select",
        "aten.expand",
        "aten.transpose",
        "aten.permute",
        "aten.unsqueeze",
        "aten.squeeze",
        "aten.split",
        "aten.split_with_sizes",
        "aten.t",
        "aten.alias",
        "aten.detach",
        "aten.as_strided",
        "aten.empty",
        "aten.new_empty",
        "aten.empty_strided",
        "aten.empty_like",
        "aten.unbind",
        "aten.chunk",
        "aten.lift_fresh",
    }
)


#: torch functions that launch one kernel on CUDA (the memory-efficient SDPA, torch's fused RMSNorm):
#: counted as one, their CPU decomposition not counted.
FUSED_ON_CUDA = ("scaled_dot_product_attention", "rms_norm")


class KernelCount(TorchDispatchMode):
    """Counts the aten ops that launch a kernel, by name; `paused` stops counting (an op counted as
    one kernel runs its decomposition inside)."""

    def __init__(self, skip: frozenset[str] = _NO_KERNEL) -> None:
        super().__init__()
        self.skip = skip  # op names not counted
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if not self.paused and name not in self.skip:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from ignis.compiler.importers import load_checkpoint

    folder = hf_tiny.save_tiny(hf_tiny.tiny_model("llama", seed=0), tmp_path_factory.mktemp("llama") / "c")
    ckpt = load_checkpoint(folder)
    return ckpt.config, ckpt.tensors.load_all()


def _one_kernel(count: KernelCount, fn, name: str | None = None):  # type: ignore[no-untyped-def]
    """`fn` counted as one kernel named `name` (default its __name__), its own ops not counted."""

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        count.ops[name or fn.__name__] += 1
        count.paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            count.paused = False

    return run


def emulated_norms(count: KernelCount | None = None) -> FusedNormsKernel:
    """A `FusedNormsKernel` over the CPU models of ``add_rms_norm_llama`` and ``silu_mul`` (each
    counted by `count` as the one kernel it launches on CUDA); the hybrid's norms raise."""
    from ignis.compiler.kernels.fused_norms import add_rms_norm_llama_emulated, silu_mul_emulated

    def add_rms_norm_llama(h, d, w, h_out, x_out, eps):  # type: ignore[no-untyped-def]
        a, b = add_rms_norm_llama_emulated(h, d, w, eps)
        h_out.copy_(a)
        x_out.copy_(b)

    def silu_mul(gu, out):  # type: ignore[no-untyped-def]
        out.copy_(silu_mul_emulated(gu))

    def unused(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("the llama rounds do not run the hybrid's norms")

    funcs = {"add_rms_norm_llama": add_rms_norm_llama, "silu_mul": silu_mul}
    if count is not None:
        funcs = {k: _one_kernel(count, f, k) for k, f in funcs.items()}
    return FusedNormsKernel({"add_rms_norm": unused, "gated_rms_norm": unused, **funcs})


def emulated_mixers(count: KernelCount | None = None, *, attention: bool = False) -> FusedMixersKernel:
    """A `FusedMixersKernel` over the CPU model of ``rope_kv`` and (attention) the oracle of
    ``grouped_attention`` (each counted by `count` as the one kernel it launches on CUDA); the
    hybrid's mixers raise."""
    from ignis.compiler.kernels.fused_mixers import grouped_attention_reference, rope_kv_emulated

    def unused(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("the llama rounds do not run the hybrid's mixers")

    def grouped_attention(q, kc, vc, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale):  # type: ignore[no-untyped-def]
        assert scale == q.shape[-1] ** -0.5 and max_keys >= int(pos.max()) + 1
        out.copy_(grouped_attention_reference(q, kc, vc, pos, slots))

    funcs = {"gdn_conv_silu": unused, "qk_norm_rope_kv": unused, "rope_kv": rope_kv_emulated}
    if attention:
        funcs["grouped_attention"] = grouped_attention
    if count is not None:
        funcs |= {k: _one_kernel(count, f, k) for k, f in funcs.items() if f is not unused}
    return FusedMixersKernel(funcs)


def _body_kernels(
    ex: StaticLlamaExecutor,
    monkeypatch: pytest.MonkeyPatch,
    layers: int,
    *,
    fused: bool = False,
    mixers: bool = False,
    attention: bool = False,
    count: KernelCount | None = None,
) -> KernelCount:
    """Kernels of one static decode round of 2 lanes through the first `layers` decoder layers
    (fused: with the emulated fused norms, `emulated_norms`; mixers: the emulated ``rope_kv``),
    counted into `count` (default: a new one)."""
    count = KernelCount() if count is None else count
    if mixers:
        monkeypatch.setattr(ex, "_mixers_kernel", emulated_mixers(count, attention=attention))

    def one_kernel(fn):  # type: ignore[no-untyped-def]
        return _one_kernel(count, fn)

    if fused:
        monkeypatch.setattr(ex, "_norms_kernel", emulated_norms(count))
    for name in FUSED_ON_CUDA:
        monkeypatch.setattr(llama_graphs.F, name, one_kernel(getattr(F, name)))
    all_layers = ex.layers
    ex.layers = all_layers[:layers]
    try:
        ids = torch.tensor([3, 5])
        pos = torch.tensor([[4], [9]])
        slots = torch.tensor([0, 1])
        with torch.no_grad(), count:
            ex._body(ids, pos, slots, 16, want_hidden=False, taps=())
    finally:
        ex.layers = all_layers
        monkeypatch.undo()
    return count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_qk_is_bit_identical_to_rotating_q_and_k_apart(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rows, nh, nkv, hd = 7, 6, 2, 16
    x = (torch.randn(rows, nh + nkv, hd, generator=gen) * 3).to(dtype)
    x[0, 0, :4] = 0.0  # zeros: signs of zero must agree too
    x[1, 1, hd // 2 : hd // 2 + 4] = -0.0
    angles = torch.randn(rows, 1, hd, generator=gen) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = rope_qk(x, cos, signed_sin(sin))
    q = LlamaExecutor._apply_rope(x[:, :nh], cos, sin)
    k = LlamaExecutor._apply_rope(x[:, nh:], cos, sin)
    want = torch.cat((q, k), dim=1)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32),
        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoder_layer_launches_at_most_its_budget(
    tiny, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:  # type: ignore[no-untyped-def]
    """Kernels a decoder layer adds to a round (the CUDA graph's nodes) with the torch norms: RoPE of
    q and k together (4 kernels, was 10 rotating them apart), written back into the q|k|v output so
    that keys and values go into the pool in one write (1, was 2), and gathered from it at once (1,
    was 2). The budget: norm 2 + qkv linear 1 + RoPE 4 + KV write 1 + KV gather 1 + SDPA 1 + o linear
    and residual 2 + norm 2 + gate|up linear, silu, product, down linear and residual 5 = 19, with 2
    casts a norm in 16-bit dtypes (27 before session 15, 24 before session 16)."""
    config, weights = tiny
    ex = StaticLlamaExecutor(config, weights, dtype=dtype, max_lanes=2, max_context=64, kv_bucket=16)
    assert config.num_hidden_layers >= 2
    one = _body_kernels(ex, monkeypatch, 1)
    two = _body_kernels(ex, monkeypatch, 2)
    per_layer = two.ops - one.ops
    casts = 4 if dtype != torch.float32 else 0  # x.float() and .to(dtype) in both norms
    assert sum(per_layer.values()) == 19 + casts, dict(per_layer)
    assert per_layer["aten.neg"] == 0  # rotate_half's negation lives in the sine table
    assert per_layer["aten.cat"] == 1
    assert per_layer["aten.index_select"] == 1  # keys and values in one gather
    assert per_layer["aten.index_put_"] == 1  # and in one write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoder_layer_with_the_fused_norms(  # type: ignore[no-untyped-def]
    tiny, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """With the fused norms (`norms_module`, CUDA; here their CPU models, each counted as the one
    kernel it launches) a layer is: add + norm 1 (x2), qkv linear 1, RoPE 4, KV write 1, KV gather 1,
    SDPA 1, o linear 1, gate|up linear 1, silu_mul 1, down linear 1 = 14 in every dtype (19-23 with
    the torch norms)."""
    config, weights = tiny
    ex = StaticLlamaExecutor(config, weights, dtype=dtype, max_lanes=2, max_context=64, kv_bucket=16)
    one = _body_kernels(ex, monkeypatch, 1, fused=True)
    two = _body_kernels(ex, monkeypatch, 2, fused=True)
    per_layer = two.ops - one.ops
    assert sum(per_layer.values()) == 14, dict(per_layer)
    assert per_layer["add_rms_norm_llama"] == 2 and per_layer["silu_mul"] == 1
    assert per_layer["rms_norm"] == 0 and per_layer["aten.silu"] == 0
    # the round outside its layers: the embedding, the RoPE tables (positions cast, product, cat, cos,
    # sin, and their casts in 16-bit dtypes), the signed sine (neg, cat), the mask (arange, le), the
    # first norm (2 kernels, 4 in 16-bit dtypes), the head and its cast to float32
    assert one.total - sum(per_layer.values()) == (13 if dtype == torch.float32 else 18), dict(one.ops)


def _host_ops(ex: StaticLlamaExecutor, lanes: int, columns: int) -> int:
    """torch calls (views included) of one `forward` + `commit` of `lanes` lanes, outside the body."""
    states = [ex.new_lane() for _ in range(lanes)]
    prompt = [torch.arange(1, 6) + i for i in range(lanes)]
    ex.forward(states, prompt, logits="last", record=False)
    ex.commit(states, [5] * lanes)
    count = KernelCount(skip=frozenset())  # every torch call, views included
    inner = ex._body

    def body(*args, **kwargs):  # type: ignore[no-untyped-def]
        count.paused = True
        try:
            return inner(*args, **kwargs)
        finally:
            count.paused = False

    ex._body = body  # type: ignore[method-assign]
    cols = [torch.arange(2, 2 + columns) + i for i in range(lanes)]
    try:
        with torch.no_grad(), count:
            ex.forward(states, cols)
            ex.commit(states, [columns] * lanes)
    finally:
        del ex._body
        for s in states:
            ex.release_lane(s)
    return count.total


@pytest.mark.parametrize("columns", [1, 4])
def test_host_work_of_a_round_does_not_grow_with_the_lanes(tiny, columns: int) -> None:  # type: ignore[no-untyped-def]
    """Around the body, a static round's inputs are laid out in one host list and copied once, and
    its outputs split into lanes by one call: the torch calls (each a dispatch on the host, and on
    CUDA a launch or a copy) are the same for 2 and 8 lanes (they grew by 8 a lane: a copy,
    a min, a max and a cast per lane to check the ids, an index copy to lay them out, a select and a
    slice to split the logits)."""
    config, weights = tiny
    ex = StaticLlamaExecutor(config, weights, max_lanes=8, max_context=64, kv_bucket=16)
    one, two, eight = (_host_ops(ex, n, columns) for n in (1, 2, 8))
    assert eight == two, (two, eight)
    assert one <= two <= 13, (one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoder_layer_with_the_fused_norms_and_rope_kv(  # type: ignore[no-untyped-def]
    tiny, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """With ``rope_kv`` too (`mixers_module`, here its CPU model counted as one kernel): RoPE 4 and
    the KV write 1 become 1, so a layer is 10 kernels: add + norm (x2), qkv, rope_kv, KV gather,
    SDPA, o, gate|up, silu_mul, down."""
    config, weights = tiny
    ex = StaticLlamaExecutor(config, weights, dtype=dtype, max_lanes=2, max_context=64, kv_bucket=16)
    one = _body_kernels(ex, monkeypatch, 1, fused=True, mixers=True)
    two = _body_kernels(ex, monkeypatch, 2, fused=True, mixers=True)
    per_layer = two.ops - one.ops
    assert sum(per_layer.values()) == 10, dict(per_layer)
    assert per_layer["rope_kv"] == 1 and per_layer["aten.index_put_"] == 0 and per_layer["aten.cat"] == 0
    # outside the layers the signed sine table is not made (rope_kv negates as it rotates)
    assert one.total - sum(per_layer.values()) == (11 if dtype == torch.float32 else 16), dict(one.ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_kv_rounds_are_bit_identical_to_the_torch_rope(tiny, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The fused RoPE + KV write (its CPU model, the kernel's roundings) gives the torch path's
    logits and pool bit for bit (HF's three roundings either way); long forwards keep torch."""
    config, weights = tiny
    kw = {"dtype": dtype, "max_lanes": 2, "max_context": 64, "kv_bucket": 16, "chunked_prefill": 0}
    plain = StaticLlamaExecutor(config, weights, **kw)
    fused = StaticLlamaExecutor(config, weights, **kw)
    fused._mixers_kernel = emulated_mixers()  # the setter wants CUDA
    want, got = _rounds(plain), _rounds(fused)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(plain._kv, fused._kv)
    lanes = [ex.new_lane() for ex in (plain, fused)]
    pairs = zip((plain, fused), lanes, strict=True)
    longs = [ex.forward([lane], [torch.arange(3, 23)]).logits[0] for ex, lane in pairs]
    assert torch.equal(longs[0], longs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_decoder_layer_with_every_fused_kernel(  # type: ignore[no-untyped-def]
    tiny, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """With ``grouped_attention`` too (16-bit dtypes; head_dim 16 is not one it takes, so the test
    patches the check): the gather and SDPA become one kernel reading the pool, and the mask is not
    made: 9 kernels a layer (add + norm x2, qkv, rope_kv, attention, o, gate|up, silu_mul, down) and 14
    outside the layers."""
    config, weights = tiny
    ex = StaticLlamaExecutor(config, weights, dtype=dtype, max_lanes=2, max_context=64, kv_bucket=16)
    monkeypatch.setattr(FusedMixersKernel, "_attention_takes", lambda self, dt, hd, dev: dt == dtype)
    kw = {"fused": True, "mixers": True, "attention": True}
    one = _body_kernels(ex, monkeypatch, 1, **kw)
    monkeypatch.setattr(FusedMixersKernel, "_attention_takes", lambda self, dt, hd, dev: dt == dtype)
    two = _body_kernels(ex, monkeypatch, 2, **kw)
    per_layer = two.ops - one.ops
    assert sum(per_layer.values()) == 9, dict(per_layer)
    assert per_layer["grouped_attention"] == 1 and per_layer["aten.index_select"] == 0
    assert per_layer["scaled_dot_product_attention"] == 0
    assert one.total - sum(per_layer.values()) == 14, dict(one.ops)


def test_fused_attention_rounds_agree_with_sdpa(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Static rounds with rope_kv and grouped_attention (their CPU models; bf16) give the torch
    path's logits to bf16 rounding, and the same pool (rope_kv is exact)."""
    config, weights = tiny
    kw = {"dtype": torch.bfloat16, "max_lanes": 2, "max_context": 64, "kv_bucket": 16}
    plain = StaticLlamaExecutor(config, weights, **kw)
    fused = StaticLlamaExecutor(config, weights, **kw)
    fused._mixers_kernel = emulated_mixers(attention=True)
    monkeypatch.setattr(FusedMixersKernel, "_attention_takes", lambda self, dt, hd, dev: True)
    want, got = _rounds(plain), _rounds(fused)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0.05, rtol=0.02)
    assert torch.equal(plain._kv, fused._kv)


def _rounds(ex: StaticLlamaExecutor) -> list[torch.Tensor]:
    """Logits of a prompt chunk of two lanes, then a verify round of 4 / 1 columns."""
    a, b = ex.new_lane(), ex.new_lane()
    first = ex.forward([a, b], [torch.arange(1, 9), torch.arange(20, 25)])
    ex.commit([a, b], [8, 5])
    second = ex.forward([a, b], [torch.tensor([7, 8, 9, 10]), torch.tensor([3])])
    return list(first.logits) + list(second.logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_rounds_agree_with_the_torch_norms(tiny, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The rounds with the fused norms (their CPU models) give the torch norms' logits up to the sum
    of squares' order (float32: 1e-4; bf16: a rounding step of the activations)."""
    config, weights = tiny
    kw = {"dtype": dtype, "max_lanes": 2, "max_context": 64, "kv_bucket": 16}
    plain = StaticLlamaExecutor(config, weights, **kw)
    fused = StaticLlamaExecutor(config, weights, **kw)
    fused._norms_kernel = emulated_norms()  # the setter wants CUDA
    want, got = _rounds(plain), _rounds(fused)
    for g, w in zip(got, want, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))
        else:
            torch.testing.assert_close(g, w, atol=0.1, rtol=0.05)


def test_norms_module_needs_cuda_and_the_llama_norm(tiny) -> None:  # type: ignore[no-untyped-def]
    config, weights = tiny
    with pytest.raises(ValueError, match="CUDA"):
        StaticLlamaExecutor(config, weights, max_lanes=1, max_context=32, norms_module=emulated_norms())
    ex = StaticLlamaExecutor(config, weights, max_lanes=1, max_context=32)
    ex.device = torch.device("cuda")  # only the setter's checks run
    old = {k: v for k, v in emulated_norms().funcs.items() if k != "add_rms_norm_llama"}
    with pytest.raises(ValueError, match="add_rms_norm_llama"):
        ex.norms_module = old
    with pytest.raises(ValueError, match="rope_kv"):
        ex.mixers_module = {k: v for k, v in emulated_mixers().funcs.items() if k != "rope_kv"}


# ---------------------------------------------------------------------------------------------
# q4 weights padded to K % 128 == 0 (a build's q4_pad_k): the rounds' activations pre-padded


def _q4_weights(weights: dict) -> dict:  # type: ignore[type-arg]
    """The tiny model's linear weights as q4_g32 `Q4Weight`s (row-major), the rest as they are."""
    from ignis.formats import quantize_q4_g32
    from ignis.runtime.linear import Q4Weight

    out = {}
    for name, t in weights.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            packed, scales = quantize_q4_g32(t.float().numpy())
            out[name] = Q4Weight(torch.from_numpy(packed.view("int32")), torch.from_numpy(scales))
        else:
            out[name] = t
    return out


def _padded_backend(calls: list, count: KernelCount | None = None):  # type: ignore[no-untyped-def,type-arg]
    """A `LinearBackend` whose stand-in "q4_g32_tiled" functions (the math in torch from the tiled
    parts; each counted as one kernel by `count`) serve the tiny llama's fused shapes, every K padded
    to 128 (as `padded_in_features` functions); `calls` gets (x's data_ptr, x's shape) per call."""
    from ignis.runtime.kernels.q4_tiled import untile_q4
    from ignis.runtime.linear import CompiledLinears, LinearBackend, Q4Weight, torch_linear

    def call(x, codes, scales, y):  # type: ignore[no-untyped-def]
        assert codes.shape[1] * 128 == x.shape[1] and x.is_contiguous()
        calls.append((x.data_ptr(), tuple(x.shape)))
        p, s = untile_q4(codes, scales, y.shape[1])
        y.copy_(torch_linear(x, Q4Weight(p, s)))

    fn = call if count is None else _one_kernel(count, call, "q4_tiled")
    shapes = {(128, 64), (64, 64), (320, 64), (64, 160), (384, 64)}  # qkv, o, gate|up, down, head
    fns = {(w, "q4_g32_tiled", n, k, "float32"): (fn, True, False, "m") for w in (8, 16) for n, k in shapes}
    return LinearBackend(CompiledLinears(fns, (8, 16)))


def test_padded_linears_read_the_rounds_padded_buffers(tiny) -> None:  # type: ignore[no-untyped-def]
    """Every q4 linear of the tiny llama has K % 128 != 0; with (stand-ins of) padded tiled functions
    its weights are tiled with zero columns, and in static rounds each linear's activations are
    written by the op before it (the norms, the attention output's copy, silu_mul) into a zero-padded
    buffer of the executor, which the tiled function reads as it is (no padding copy). The logits
    equal those of the same q4 weights on torch (the reference q4 matmul, unpadded) to float32
    rounding, and greedy choices agree; long (eager) forwards let the backend pad."""
    config, weights = tiny
    q4 = _q4_weights(weights)
    calls: list = []  # type: ignore[type-arg]
    kw = {"max_lanes": 2, "max_context": 64, "kv_bucket": 16}
    ex = StaticLlamaExecutor(config, q4, linear=_padded_backend(calls), chunked_prefill=0, **kw)
    layer = ex.layers[0]
    for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down, ex.lm_head):
        assert w.is_tiled and w.cols is not None and w.padded_in_features % 128 == 0  # type: ignore[union-attr]
    assert sorted(ex._pad_bufs) == [(64, 128), (160, 256)]
    ref = StaticLlamaExecutor(config, q4, linear=LinearBackend(), chunked_prefill=0, **kw)
    want = _rounds(ref)
    calls.clear()
    got = _rounds(ex)
    bufs = {b.data_ptr(): b for b in ex._pad_bufs.values()}
    assert calls and all(ptr in bufs for ptr, _shape in calls)  # every call read a padded buffer
    assert {shape[1] for _ptr, shape in calls} == {128, 256}
    for b in ex._pad_bufs.values():  # the padding columns stay zero
        k = 64 if b.shape[1] == 128 else 160
        assert not b[:, k:].any()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    # a long forward (past max_columns, eager): the backend pads each call itself
    calls.clear()
    lane = ex.new_lane()
    long = ex.forward([lane], [torch.arange(3, 23)], logits="last")
    assert calls and not any(ptr in bufs for ptr, _shape in calls)
    ref_lane = ref.new_lane()
    torch.testing.assert_close(
        long.logits[0],
        ref.forward([ref_lane], [torch.arange(3, 23)], logits="last").logits[0],
        atol=1e-4,
        rtol=1e-4,
    )


def test_padded_linears_add_no_kernels(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """With padded weights and the fused norms a layer adds no padding kernels: the norms and
    silu_mul write into the padded buffers; the attention output is copied into its buffer (1
    kernel: on CUDA it replaces the copy that reshape makes of the memory-efficient SDPA's output,
    which is not in row order; the CPU's math SDPA at one column is, so here it shows as one more)."""
    config, weights = tiny
    count = KernelCount()
    ex = StaticLlamaExecutor(
        config,
        _q4_weights(weights),
        linear=_padded_backend([], count),
        max_lanes=2,
        max_context=64,
        kv_bucket=16,
    )

    def per_layer() -> Counter[str]:
        count.ops.clear()
        one = _body_kernels(ex, monkeypatch, 1, fused=True, count=count)
        one_ops = Counter(one.ops)
        count.ops.clear()
        two = _body_kernels(ex, monkeypatch, 2, fused=True, count=count)
        return two.ops - one_ops

    ops = per_layer()
    assert sum(ops.values()) == 14 + 1, dict(ops)
    assert ops["q4_tiled"] == 4 and ops["aten.copy_"] == 1 and ops["aten.new_zeros"] == 0


# ---------------------------------------------------------------------------------------------
# GPU (marker gpu): the compiled kernels and the padded tiled route


def _norms_on_gpu() -> FusedNormsKernel:
    """The compiled fused norms ($IGNIS_NORMS_MODULE, else built for this GPU with nvcc), or skip."""
    return compiled_kernel_or_skip(
        "IGNIS_NORMS_MODULE", "fused_norms", "build_fused_norms", FusedNormsKernel, "add_rms_norm_llama"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_rms_norm_llama_on_the_gpu_is_its_cpu_model(dtype: torch.dtype) -> None:
    """The compiled add_rms_norm_llama against its CPU model (the sum's order modelled: at most a
    rounding step of the normed row apart), writing x_out into the front columns of a wider zero
    buffer (the padded activations) without touching the rest; silu_mul into a strided out too."""
    from ignis.compiler.kernels.fused_norms import add_rms_norm_llama_emulated, silu_mul_emulated

    kernel = _norms_on_gpu()
    gen = torch.Generator().manual_seed(1)
    for rows, hidden in ((1, 576), (8, 576), (40, 1536), (3, 9000)):
        h = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
        d = torch.randn(rows, hidden, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        want_h, want_x = add_rms_norm_llama_emulated(h, d, w, 1e-5)
        buf = torch.zeros(rows, hidden + 64, dtype=dtype, device="cuda")
        got_h, got_x = kernel.add_rms_norm_llama(h.cuda(), d.cuda(), w.cuda(), 1e-5, x_out=buf[:, :hidden])
        assert torch.equal(got_h.cpu(), want_h)
        diff = (got_x.cpu().float() - want_x.float()).abs()
        scale = want_x.float().abs().clamp_min(1e-30) * torch.finfo(dtype).eps
        # bf16 / f16: the row's 1/rms from another summation order moves x by under a rounding step of
        # T, so the two stay within 2 eps. float32: that relative difference of 1/rms (the order of the
        # mean of squares over `hidden` terms) is itself ~1 eps and adds to the two roundings (H200,
        # session 16: up to 2.03 eps at [8, 576])
        k = 4 if dtype == torch.float32 else 2
        assert (diff <= k * scale + 1e-30).all(), (rows, hidden, float((diff / scale).max()))
        assert not buf[:, hidden:].any()
    gu = torch.randn(5, 2 * 1536, generator=gen).to(dtype)
    out = torch.zeros(5, 1536 + 128, dtype=dtype, device="cuda")
    kernel.silu_mul(gu.cuda(), out=out[:, :1536])
    torch.testing.assert_close(out[:, :1536].cpu(), silu_mul_emulated(gu), atol=1e-6, rtol=1e-2)
    assert not out[:, 1536:].any()


def _mixers_on_gpu() -> FusedMixersKernel:
    """The compiled fused mixers ($IGNIS_MIXERS_MODULE, else built for this GPU with nvcc), or skip."""
    return compiled_kernel_or_skip(
        "IGNIS_MIXERS_MODULE", "fused_mixers", "build_fused_mixers", FusedMixersKernel, "rope_kv"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_kv_on_the_gpu_is_the_torch_rope_bit_for_bit(tiny, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """StaticLlamaExecutor's static rounds on CUDA with the compiled rope_kv (graphs) give the logits
    and the pool of the same executor with torch's RoPE and KV write, bit for bit."""
    config, weights = tiny
    kernel = _mixers_on_gpu()
    kw = {"device": "cuda", "dtype": dtype, "max_lanes": 2, "max_context": 64, "kv_bucket": 16}
    plain = StaticLlamaExecutor(config, weights, cuda_graphs=False, **kw)
    fused = StaticLlamaExecutor(config, weights, cuda_graphs=False, mixers_module=kernel, **kw)
    outs = []
    for ex in (plain, fused):
        a, b = ex.new_lane(), ex.new_lane()
        first = ex.forward([a, b], [torch.arange(1, 9, device="cuda"), torch.arange(20, 25, device="cuda")])
        ex.commit([a, b], [8, 5])
        second = ex.forward(
            [a, b], [torch.tensor([7, 8, 9, 10], device="cuda"), torch.tensor([3], device="cuda")]
        )
        outs.append([t.cpu() for t in list(first.logits) + list(second.logits)])
    assert all(torch.equal(f, p) for f, p in zip(outs[1], outs[0], strict=True))
    assert torch.equal(plain._kv, fused._kv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "max_keys"), [(1, 64), (5, 256), (8, 1024)])
def test_grouped_attention_on_the_gpu_is_its_oracle(dtype: torch.dtype, n: int, max_keys: int) -> None:
    """The compiled grouped_attention (gated_attention without the gate) against its oracle over a
    pool laid out as the llama executor's (keys and values as halves of one [S, cap, 2 kv, hd]
    pool), one and several key splits, into the front columns of a wider zero buffer."""
    from ignis.compiler.kernels.fused_mixers import grouped_attention_reference

    mixers = _mixers_on_gpu()
    if not mixers.grouped_attention_takes(dtype, 64, torch.device("cuda")):
        pytest.skip("grouped_attention not in this module")
    gen = torch.Generator().manual_seed(n)
    lanes, heads, kv, hd, cap = 3, 9, 3, 64, max_keys + 16
    pool = torch.randn(lanes + 1, cap, 2 * kv, hd, generator=gen).to(dtype).cuda()
    kc, vc = pool[:, :, :kv], pool[:, :, kv:]
    q = torch.randn(lanes * n, heads, hd, generator=gen).to(dtype).cuda()
    past = torch.tensor([0, max_keys // 2, max_keys - n])
    pos = (past[:, None] + torch.arange(n)[None, :]).reshape(-1).cuda()
    slots = torch.tensor([2, 0, 3]).cuda()
    buf = torch.zeros(lanes * n, heads * hd + 64, dtype=dtype, device="cuda")
    mixers.grouped_attention(q, kc, vc, pos, slots, max_keys, hd**-0.5, out=buf[:, : heads * hd])
    want = grouped_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), pos.cpu(), slots.cpu())
    torch.testing.assert_close(buf[:, : heads * hd].cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
    assert not buf[:, heads * hd :].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_rounds_on_the_gpu_match_the_torch_norms(tiny, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """StaticLlamaExecutor on CUDA (graphs) with the compiled fused norms and rope_kv against the same
    executor with torch's ops: logits to the tolerance of another summation order, greedy equal where the
    margin is clear; a replayed graph gives the eager round's logits (to the same tolerance: cuBLAS
    may pick another algorithm under capture)."""
    config, weights = tiny
    kernel, mixers = _norms_on_gpu(), _mixers_on_gpu()
    kw = {"device": "cuda", "dtype": dtype, "max_lanes": 2, "max_context": 64, "kv_bucket": 16}
    plain = StaticLlamaExecutor(config, weights, **kw)
    fused = StaticLlamaExecutor(config, weights, norms_module=kernel, mixers_module=mixers, **kw)
    eager = StaticLlamaExecutor(
        config, weights, norms_module=kernel, mixers_module=mixers, cuda_graphs=False, **kw
    )
    outs = []
    for ex in (plain, fused, eager):
        a, b = ex.new_lane(), ex.new_lane()
        first = ex.forward([a, b], [torch.arange(1, 9, device="cuda"), torch.arange(20, 25, device="cuda")])
        ex.commit([a, b], [8, 5])
        second = ex.forward(
            [a, b], [torch.tensor([7, 8, 9, 10], device="cuda"), torch.tensor([3], device="cuda")]
        )
        outs.append([t.float().cpu() for t in list(first.logits) + list(second.logits)])
    assert fused.num_replays > 0
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    for p, f, e in zip(*outs, strict=True):
        torch.testing.assert_close(f, p, **tol)
        torch.testing.assert_close(f, e, **tol)


def _build_padded_llama(card: str, tmp_path: Path) -> Path:
    """A tiny llama whose q4 linears all have K % 128 != 0 (hidden 192, intermediate 320, head_dim
    64: grouped_attention takes it), built for `card` with the recipe's q4_pad_k, in a subprocess.
    Returns the artifact."""
    from test_linear_tiled import _build_tiny_tiled_llama

    out = tmp_path / "tiny"
    _build_tiny_tiled_llama(card, tmp_path, out, shape=(192, 320, 3, 1), q4_pad_k=True)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_tiled_modules_serve_like_torch(tmp_path: Path) -> None:
    """A tiny llama whose every q4 linear has K % 128 != 0, built with q4_pad_k for this GPU's card:
    `make_executor` on CUDA (the graphed static executor) places every q4 weight tiled and padded,
    takes the fused norms, runs the padded tiled functions (no fallback to torch), and greedy
    decoding gives the tokens of the same artifact on torch (near-ties reported, not hidden)."""
    import os
    import shutil

    prebuilt = os.environ.get("IGNIS_PADDED_TILED_ARTIFACT")
    if prebuilt:
        out = Path(prebuilt)
    else:
        if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
            pytest.skip("building the GPU artifact needs nvcc (or IGNIS_PADDED_TILED_ARTIFACT)")
        major, minor = torch.cuda.get_device_capability()
        card = {(9, 0): "h200", (12, 0): "rtx5090"}.get((major, minor))
        if card is None:
            pytest.skip(f"no card profile for sm_{major}{minor}")
        out = _build_padded_llama(card, tmp_path)
    from ignis.runtime.artifact import load_artifact

    with load_artifact(out) as art:
        assert any(f.padded_in_features for e in art.manifest.modules for f in e.functions)
        backend = art.linear_backend()
        ex = art.make_executor(device="cuda", dtype=torch.bfloat16, linear=backend)
        assert isinstance(ex, StaticLlamaExecutor) and ex.norms_module is not None
        assert ex.mixers_module is not None
        layer = ex.layers[0]
        for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down):
            assert w.is_tiled and w.cols is not None  # type: ignore[union-attr]
        ref = art.make_executor(device="cuda", dtype=torch.bfloat16, cuda_graphs=False)
        prompt = torch.tensor([5, 17, 33, 2, 90, 41, 7], device="cuda")
        got, _ = greedy_with_margins(ex, prompt)
        want, margins = greedy_with_margins(ref, prompt)
        assert_greedy_equal_up_to_a_near_tie(got, want, margins)
        assert backend.counts["compiled"] > 0 and backend.counts["fallback"] == 0
