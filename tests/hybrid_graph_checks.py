"""Shared checks of tests/runtime/test_hybrid_graphs.py: the token helper, feeding tokens alone, the
module paths the GPU tests read ($IGNIS_GDN_MODULE, $IGNIS_NORMS_MODULE, $IGNIS_MIXERS_MODULE), and
the rounds / state comparisons the GPU tests for the GDN, norms and mixers modules share; the greedy
decode with margins the GPU tests of compiled llama artifacts share (test_linear_tiled.py,
test_llama_round_cost.py)."""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Callable, Sequence

import pytest
import torch

assert_close = torch.testing.assert_close


def tokens(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def feed_alone(ex, kept: torch.Tensor):
    """A new lane of ex fed `kept` token by token (record=True) and committed whole."""
    expect = ex.new_lane()
    ex.forward([expect], [kept], record=True)
    ex.commit([expect], [kept.numel()])
    return expect


def setter_wants_cuda(
    st, make_static: Callable[..., object], attr: str, module: Callable[[], object]
) -> None:
    """st.<attr> = module() and a new executor with <attr>=module() raise (they want CUDA);
    st.<attr> = None clears it."""
    with pytest.raises(ValueError, match="CUDA"):
        setattr(st, attr, module())
    with pytest.raises(ValueError, match="CUDA"):
        make_static(**{attr: module()})
    setattr(st, attr, None)
    assert getattr(st, attr) is None


def module_path(env: str, kernels_module: str, build: str) -> str | None:
    """$<env>, else a build for this GPU's arch with nvcc
    (ignis.compiler.kernels.<kernels_module>.<build>), else None."""
    path = os.environ.get(env)
    if path:
        return path
    if shutil.which("nvcc") is None:
        return None
    builder = getattr(importlib.import_module(f"ignis.compiler.kernels.{kernels_module}"), build)
    major, minor = torch.cuda.get_device_capability()
    return str(builder(f"sm_{major}{minor}"))


def compiled_kernel_or_skip(env: str, kernels_module: str, build: str, cls, export: str):  # type: ignore[no-untyped-def]
    """`cls` (a runtime kernel wrapper) over the module `module_path(env, kernels_module, build)`
    finds; skips when there is none, or when it lacks `export` (its `has_<export>` is false: a module
    built before that export)."""
    path = module_path(env, kernels_module, build)
    if path is None:
        pytest.skip(f"no compiled {kernels_module} module (${env}) and no nvcc")
    kernel = cls(path)
    if not getattr(kernel, f"has_{export}"):
        pytest.skip(f"the {kernels_module} module predates {export}")
    return kernel


def greedy_with_margins(executor, prompt: torch.Tensor, steps: int = 16) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    """Prefill `prompt` (int64 [n] on the executor's device) on a new lane of `executor`, then decode
    `steps` tokens greedily one round at a time. Returns (tokens, top-1 minus top-2 logit at each)."""
    lane = executor.new_lane()
    o = executor.forward([lane], [prompt], record=False)
    executor.commit([lane], [prompt.numel()])
    toks: list[int] = []
    margins: list[float] = []
    row = o.logits[0][-1].float()
    for _ in range(steps):
        top = row.topk(2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        o = executor.forward([lane], [torch.tensor([toks[-1]], device=prompt.device)])
        executor.commit([lane], [1])
        row = o.logits[0][-1].float()
    return toks, margins


def assert_greedy_equal_up_to_a_near_tie(
    got: Sequence[int], want: Sequence[int], margins: Sequence[float]
) -> None:
    """`got` equals `want` (`greedy_with_margins` of a reference, with its `margins`), or first differs
    where the reference's top-2 logit margin is below 0.1 (a near-tie)."""
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert first is None or margins[first] < 0.1, (got, want, margins)


def cuda_kw(dtype: torch.dtype) -> dict:
    return {"device": "cuda", "dtype": dtype, "max_lanes": 4, "max_context": 200, "kv_bucket": 16}


def gpu_tolerances(dtype: torch.dtype) -> tuple[dict, dict]:
    """(same, tol): fused vs plain static rounds; against HybridExecutor."""
    f32 = dtype == torch.float32
    same = {"atol": 1e-4, "rtol": 1e-4} if f32 else {"atol": 0.05, "rtol": 0.02}
    tol = {"atol": 2e-4, "rtol": 2e-4} if f32 else {"atol": 0.15, "rtol": 0.05}
    return same, tol


def prefill_on_gpu(exs: Sequence, vocab: int, seed: int) -> list[list]:
    """Three lanes on every executor, prefilled with prompts of 20, 6 and 11 tokens (record=False)."""
    lanes = [[ex.new_lane() for _ in range(3)] for ex in exs]
    prompts = [tokens(n, seed + n, vocab).cuda() for n in (20, 6, 11)]
    for ex, ls in zip(exs, lanes, strict=True):
        ex.forward(ls, prompts, record=False)
        ex.commit(ls, [p.numel() for p in prompts])
    return lanes


def gpu_rounds(
    exs: Sequence,
    lanes: list[list],
    shapes: list[list[int]],
    keeps: list[list[int]],
    seed: int,
    vocab: int,
    *,
    same: dict,
    tol: dict,
    hidden: bool,
    after_commit: Callable[[], None] | None = None,
) -> None:
    """Verify rounds on (fused, plain, eager): logits fused ~ plain (same) and ~ eager (tol), hidden
    states fused ~ plain when `hidden`; then every executor commits `keep`; then after_commit()."""
    for r, (shape, keep) in enumerate(zip(shapes, keeps, strict=True)):
        cols = [tokens(n, seed + 10 * r + i, vocab).cuda() for i, n in enumerate(shape)]
        outs = [ex.forward(ls, cols, output_hidden_states=True) for ex, ls in zip(exs, lanes, strict=True)]
        for i in range(3):
            assert_close(outs[0].logits[i], outs[1].logits[i], **same)
            assert_close(outs[0].logits[i], outs[2].logits[i], **tol)
            if hidden:
                assert_close(outs[0].hidden_states[i], outs[1].hidden_states[i], **same)
        for ex, ls in zip(exs, lanes, strict=True):
            ex.commit(ls, keep)
        if after_commit is not None:
            after_commit()


def states_agree(config, a, b, e=None, *, same: dict, tol: dict | None = None, attn: str, conv: bool) -> None:
    """Lane a against b (same) and e (tol, when given): the committed length; on the full-attention
    layers nothing (attn=""), the keys against b (attn="k") or keys and values against b and e
    (attn="kv"); on the GDN layers the conv state (when `conv`), then the recurrent state."""
    if e is None:
        assert a.num_tokens == b.num_tokens
    else:
        assert a.num_tokens == b.num_tokens == e.num_tokens
    for layer in range(config.num_hidden_layers):
        if config.is_full_attention(layer):
            if attn == "k":
                assert_close(a.kv(layer)[0], b.kv(layer)[0], **same)
            elif attn == "kv":
                for x, y, z in zip(a.kv(layer), b.kv(layer), (b if e is None else e).kv(layer), strict=True):
                    assert_close(x, y, **same)
                    if e is not None:
                        assert_close(x, z, **tol)
        else:
            if conv:
                assert_close(a.conv_state(layer), b.conv_state(layer), **same)
                if e is not None:
                    assert_close(a.conv_state(layer), e.conv_state(layer), **tol)
            assert_close(a.recurrent_state(layer), b.recurrent_state(layer), **same)
            if e is not None:
                assert_close(a.recurrent_state(layer), e.recurrent_state(layer), **tol)


def commit_every_k_on_gpu(
    fused, eager, config, vocab: int, keeps: Sequence[int], seed: int, *, tol: dict, kv: bool
) -> None:
    """For every keep: a lane prefilled with 9 tokens (eagerly), one round of 8 columns committing
    `keep`: its recurrent and conv states (and KV when `kv`) equal feeding the kept tokens alone."""
    base, cols = tokens(9, seed, vocab).cuda(), tokens(8, seed + 1, vocab).cuda()
    for keep in keeps:
        lane = fused.new_lane()
        fused.forward([lane], [base], record=False)  # 9 > max_columns: eager prefill
        fused.commit([lane], [9])
        fused.forward([lane], [cols])
        fused.commit([lane], [keep])
        expect = feed_alone(eager, torch.cat([base, cols[:keep]]))
        assert lane.num_tokens == expect.num_tokens
        for layer in range(config.num_hidden_layers):
            if config.is_full_attention(layer):
                if kv:
                    for x, z in zip(lane.kv(layer), expect.kv(layer), strict=True):
                        assert_close(x, z, **tol)
            else:
                assert_close(lane.recurrent_state(layer), expect.recurrent_state(layer), **tol)
                assert_close(lane.conv_state(layer), expect.conv_state(layer), **tol)
        fused.release_lane(lane)


def recaptured_matches(exs: Sequence, lanes: list[list], vocab: int, seed: int, same: dict) -> None:
    """One round of 8, 2 and 5 columns: the plain executor's logits (its module set after captures:
    recaptured) equal the fused one's."""
    cols = [tokens(n, seed + i, vocab).cuda() for i, n in enumerate([8, 2, 5])]
    outs = [ex.forward(ls, cols) for ex, ls in zip(exs, lanes, strict=True)]
    for i in range(3):
        assert_close(outs[1].logits[i], outs[0].logits[i], **same)
