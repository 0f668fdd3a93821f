"""The Gated DeltaNet prefill entry (`gated_delta_prefill`: norms + chunked rule from the conv output,
key heads shared without copies, state hand-over one launch a chunk) and what a long prompt leaves
pending in `StaticHybridExecutor` (issue 24: the prefill's launches and its memory).

Oracles: the token-by-token recurrence (`gated_delta_rule_recurrent`) on HF's preprocessing
(`l2_normalize` in float32, q scaled by k_dim ** -0.5, key heads repeated to the value heads), and
`HybridExecutor` for the executor-level checks.
"""

from __future__ import annotations

import pytest
import torch
from hf_tiny_hybrid import TinyHybrid, make_tiny_hybrid  # tests/ is on pytest's pythonpath
from hybrid_graph_checks import tokens

from ignis.runtime.families.gated_deltanet import (
    gated_delta_prefill,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_rms_norm_lean,
    l2_normalize,
)
from ignis.runtime.families.hybrid_executor import HybridExecutor, gated_rms_norm
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor


def _case(n: int, hk: int, hv: int, dk: int, dv: int, seed: int, dtype: torch.dtype, device: str = "cpu"):
    """A conv output as the executors hold it ([channels, n] memory, read as [n, channels]) and the
    float32 per-token inputs of the rule, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    conv = (torch.randn(2 * hk * dk + hv * dv, n, generator=gen) * 2).to(dtype).t().to(device)
    assert conv.stride() == (1, n)  # the channel-major layout survives the move
    qk = conv[:, : 2 * hk * dk].unflatten(-1, (2, hk, dk))
    v = conv[:, 2 * hk * dk :].unflatten(-1, (hv, dv))
    g = -3 * torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen)
    return qk, v, g.to(device), beta.to(device), s0.to(device)


def _reference(qk, v, g, beta, s0):
    """HF's preprocessing and the token-by-token recurrence: (out [n, hv, dv], final state)."""
    hk, dk, hv = qk.shape[2], qk.shape[3], v.shape[1]
    q = l2_normalize(qk[:, 0].float()) * dk**-0.5
    k = l2_normalize(qk[:, 1].float())
    q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    return gated_delta_rule_recurrent(q, k, v.float(), g, beta, s0, record=False)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 129, 200])
def test_prefill_entry_equals_the_recurrence(n: int) -> None:
    """From strided bfloat16 conv outputs, with 3 value heads per key head (the 27B's 48 / 16) and
    k_dim != v_dim, at lengths around chunk edges (the padded last chunk)."""
    qk, v, g, beta, s0 = _case(n, hk=2, hv=6, dk=16, dv=8, seed=n, dtype=torch.bfloat16)
    want_o, want_s = _reference(qk, v, g, beta, s0)
    got_o, got_s = gated_delta_prefill(qk, v, g, beta, s0)
    assert got_o.dtype == got_s.dtype == torch.float32 and got_o.shape == (n, 6, 8)
    torch.testing.assert_close(got_o, want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_s, want_s, atol=2e-5, rtol=2e-5)
    # a smaller chunk: more hand-over steps, the same result
    o16, s16 = gated_delta_prefill(qk, v, g, beta, s0, chunk_size=16)
    torch.testing.assert_close(o16, want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s16, want_s, atol=2e-5, rtol=2e-5)


def test_prefill_entry_writes_into_out_in_its_dtype() -> None:
    """out= receives the output cast once (the model dtype buffer of the executor), strided too."""
    n = 100
    qk, v, g, beta, s0 = _case(n, hk=2, hv=4, dk=16, dv=8, seed=3, dtype=torch.bfloat16)
    want, _ = gated_delta_prefill(qk, v, g, beta, s0)
    buf = torch.full((2, n, 4, 8), 7.0, dtype=torch.bfloat16)
    got, _ = gated_delta_prefill(qk, v, g, beta, s0, out=buf[1])
    assert got.data_ptr() == buf[1].data_ptr()
    assert torch.equal(buf[1], want.to(torch.bfloat16))
    assert torch.equal(buf[0], torch.full((n, 4, 8), 7.0, dtype=torch.bfloat16))  # untouched


def test_chunked_rule_shares_key_heads() -> None:
    """`gated_delta_rule_chunked` takes q / k per key head (value head h reads key head h // rep):
    the same as repeating them to the value heads, and as the recurrence."""
    gen = torch.Generator().manual_seed(5)
    n, hk, hv, dk, dv = 150, 2, 6, 16, 8
    q = l2_normalize(torch.randn(n, hk, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(n, hk, dk, generator=gen))
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen)
    qr, kr = q.repeat_interleave(3, dim=1), k.repeat_interleave(3, dim=1)
    o_rec, s_rec = gated_delta_rule_recurrent(qr, kr, v, g, beta, s0, record=False)
    o_shared, s_shared = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    o_rep, s_rep = gated_delta_rule_chunked(qr, kr, v, g, beta, s0)
    torch.testing.assert_close(o_shared, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_shared, s_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o_shared, o_rep, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s_shared, s_rep, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="value heads"):
        gated_delta_rule_chunked(q[:, :1].expand(n, 4, dk), k[:, :1].expand(n, 4, dk), v, g, beta, s0)


def test_final_state_owns_its_memory() -> None:
    """The final state is not a view of the call's per-chunk buffers (a view kept every chunk's
    state alive until commit: 0.4 GB a GDN layer at 8,192 tokens of the 27B shape)."""
    qk, v, g, beta, s0 = _case(300, hk=2, hv=4, dk=16, dv=8, seed=1, dtype=torch.float32)
    _, s = gated_delta_prefill(qk, v, g, beta, s0)
    assert s.untyped_storage().nbytes() == s.numel() * s.element_size()
    q = l2_normalize(qk[:, 0].float()) * 0.25
    _, s = gated_delta_rule_chunked(q, l2_normalize(qk[:, 1]), v, g, beta, s0)
    assert s.untyped_storage().nbytes() == s.numel() * s.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_lean_equals_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, 8, generator=gen).to(dtype)
    z = torch.randn(37, 4 * 8 * 2, generator=gen).to(dtype)[:, :32].view(37, 4, 8)  # a strided gate
    w = (1 + 0.1 * torch.randn(8, generator=gen)).to(dtype)
    want = gated_rms_norm(x, z, w, 1e-6)
    got = gated_rms_norm_lean(x, z, w, 1e-6)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # one bfloat16 rounding apart at most
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    got32w = gated_rms_norm_lean(x, z, w.float(), 1e-6)  # a float32 weight: no extra rounding
    assert got32w.dtype == dtype
    torch.testing.assert_close(got32w, gated_rms_norm(x, z, w.float(), 1e-6), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyHybrid:
    torch.set_num_threads(1)
    return make_tiny_hybrid("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))


def test_long_prompt_leaves_only_the_states_pending(tiny: TinyHybrid) -> None:
    """An eager record=False forward (a prompt past max_columns) keeps per GDN layer only the conv
    state after its last column and the final recurrent state (each its own memory) until commit,
    and commits to the state the reference executor reaches; two lanes of different lengths too."""
    c = tiny.config
    st = StaticHybridExecutor(c, tiny.canonical_tensors(), max_lanes=2, max_context=300, kv_bucket=16)
    ref = HybridExecutor(c, tiny.canonical_tensors())
    prompts = [tokens(150, 1, c.vocab_size), tokens(97, 2, c.vocab_size)]
    lanes = [st.new_lane(), st.new_lane()]
    out = st.forward(lanes, prompts, record=False, logits="last")
    kd = c.linear_conv_kernel_dim - 1
    for lane in lanes:
        pending = lane._pending
        assert pending is not None and pending.conv_windows and pending.rec_states
        for window in pending.conv_windows:
            assert window.shape == (c.linear_conv_dim, kd)
            assert window.untyped_storage().nbytes() == window.numel() * window.element_size()
        for rec in pending.rec_states:
            assert rec.shape == (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
            assert rec.untyped_storage().nbytes() == rec.numel() * rec.element_size()
    st.commit(lanes, [150, 97])
    for lane, prompt, logits in zip(lanes, prompts, out.logits, strict=True):
        r = ref.new_lane()
        want = ref.forward([r], [prompt], record=False, logits="last").logits[0]
        ref.commit([r], [len(prompt)])
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        for layer in range(c.num_hidden_layers):
            if not c.is_full_attention(layer):
                torch.testing.assert_close(lane.conv_state(layer), r.conv_state(layer), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(
                    lane.recurrent_state(layer), r.recurrent_state(layer), atol=1e-4, rtol=1e-4
                )
        # and the lane goes on exactly as a fed reference: one verify round after the prompt
        nxt = tokens(3, 9, c.vocab_size)
        a = st.forward([lane], [nxt]).logits[0]
        b = ref.forward([r], [nxt]).logits[0]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        st.commit([lane], [3])
        ref.commit([r], [3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [2048, 200])
def test_prefill_entry_on_cuda_at_the_27b_mixer_shape(n: int) -> None:
    """On CUDA (cuBLAS's in-place solve and strided products), the 27B's GDN shape (16 key / 48 value
    heads of 128 x 128) from a strided bf16 conv output: equal to the same call on the CPU (float32
    rounding apart) and to the token-by-token recurrence, the final state its own memory, and the
    call's transient memory bounded by ~213 KB a token (its chunk-major temporaries: decays 25 KB,
    right-hand sides 49, per-chunk B and P 51 + 49, K_end 25, q|k 16)."""
    dev = torch.device("cuda")
    want_o, want_s = gated_delta_prefill(*_case(n, 16, 48, 128, 128, seed=n, dtype=torch.bfloat16))
    qk, v, g, beta, s0 = _case(n, 16, 48, 128, 128, seed=n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(n, 48, 128, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got_o, got_s = gated_delta_prefill(qk, v, g, beta, s0, out=out)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - base
    assert got_o.data_ptr() == out.data_ptr()
    assert got_s.untyped_storage().nbytes() == got_s.numel() * 4
    padded = 64 * -(-n // 64)
    assert transient < 260e3 * padded + (64 << 20), transient
    torch.testing.assert_close(got_o.cpu(), want_o.to(torch.bfloat16), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_s.cpu(), want_s, atol=2e-4, rtol=2e-4)
    o32, s32 = gated_delta_prefill(qk, v, g, beta, s0)
    ref_o, ref_s = _reference(qk, v, g, beta, s0)
    torch.testing.assert_close(o32, ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s32, ref_s, atol=1e-4, rtol=1e-4)


def test_the_hand_over_is_one_operator_a_chunk() -> None:
    """Everything but the state hand-over runs for all chunks at once, and the hand-over is one
    in-place ``baddbmm_`` a chunk (it was two ``baddbmm`` copying into their outputs and a ``mul``):
    two more chunks cost exactly two more operator calls."""
    from ignis.tools.bench.prefill_ops import leaf_counts

    def calls(n: int) -> int:
        qk, v, g, beta, s0 = _case(n, hk=2, hv=4, dk=16, dv=8, seed=0, dtype=torch.bfloat16)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            gated_delta_prefill(qk, v, g, beta, s0)
        return sum(leaf_counts(prof).values())

    calls(64)  # the first call builds the cached causal mask
    assert calls(256) - calls(128) == 2
