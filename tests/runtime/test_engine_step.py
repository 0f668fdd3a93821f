"""The engine step's host path (issue 25): batched round I/O (`ignis.runtime.round_batch`), the stop
checker's run path, batched metrics, and a dropped engine freed without the cycle collector.

GPU tests (`gpu` mark): no host sync between a drafter's proposal (device drafts) and the verify
forward, nor between a step's start and the forward with speculation off (`torch.cuda`'s sync debug
mode); device drafts outside the vocabulary reach the forward clamped and raise a `DrafterError`.
"""

from __future__ import annotations

import gc
import random
import tempfile
import weakref
from pathlib import Path

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.drafters.base import BaseDrafter, DrafterError, DraftProposal
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.round_batch import HostKnownColumns, LaneTokens, RoundColumns, round_host_ids
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.stops import StopChecker

_EX: dict[str, object] = {}


def _hybrid(device: str = "cpu"):  # type: ignore[no-untyped-def]
    from hf_tiny_hybrid import make_tiny_hybrid

    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    if "ex" not in _EX:
        tiny = make_tiny_hybrid("qwen3_5", Path(tempfile.mkdtemp()) / "m")
        _EX["ex"] = (tiny.config, tiny.tensors)
    config, tensors = _EX["ex"]  # type: ignore[misc]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return StaticHybridExecutor(
        config, tensors, device=device, dtype=dtype, max_lanes=4, max_columns=8, max_context=256
    )


# ---------------------------------------------------------------- the engine <-> checkpoints cycle


def test_dropped_engine_is_freed_without_the_cycle_collector() -> None:
    cache = PrefixCache(card_bytes=1 << 30, host_bytes=1 << 30)
    eng = SpeculativeEngine(_hybrid(), None, prefix_cache=cache, max_prefill_tokens=64)
    assert eng.checkpoints.is_enabled
    eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))
    ex_ref = weakref.ref(eng.executor)
    ref = weakref.ref(eng)
    gc.collect()
    gc.disable()
    try:
        del eng
        assert ref() is None, "the engine outlived its last reference (a reference cycle)"
        assert ex_ref() is None, "the executor (its device memory) outlived the engine"
    finally:
        gc.enable()


# ---------------------------------------------------------------- LaneTokens


def test_lane_tokens_reads_as_the_concatenation() -> None:
    prompt, output = (5, 6, 7), [8, 9]
    view = LaneTokens(prompt, output)
    output.append(10)  # the view follows the lane's output list
    full = [5, 6, 7, 8, 9, 10]
    assert len(view) == 6 and list(view) == full
    assert view == full and view == tuple(full) and view != full[:5] and view != [5, 6, 7, 8, 9, 11]
    for i in range(-6, 6):
        assert view[i] == full[i]
    for a in range(-7, 8):
        for b in range(-7, 8):
            assert view[a:b] == tuple(full[a:b]), (a, b)
            assert isinstance(view[a:b], tuple)
    assert view[::2] == tuple(full[::2]) and view[::-1] == tuple(full[::-1])
    with pytest.raises(IndexError):
        view[6]
    with pytest.raises(IndexError):
        view[-7]


# ---------------------------------------------------------------- round columns and host ids


def test_round_columns_one_tensor_and_host_checks() -> None:
    props = [
        DraftProposal(torch.tensor([4, 5], dtype=torch.int64)),
        DraftProposal(torch.empty(0, dtype=torch.int64)),
        DraftProposal(torch.tensor([7], dtype=torch.int32)),
    ]
    b = RoundColumns.build([1, 2, 3], props, torch.device("cpu"), 10, lane_ids=[0, 1, 2], drafter_name="x")
    assert [c.tolist() for c in b.columns] == [[1, 4, 5], [2], [3, 7]]
    assert all(c.dtype == torch.int64 for c in b.columns)
    assert b.host_drafts == [[4, 5], [], [7]] and b.device_drafts == []
    bad = [DraftProposal(torch.tensor([3, 10]))]
    with pytest.raises(DrafterError, match=r"lane 42: draft ids \[3, 10\] outside \[0, 10\)"):
        RoundColumns.build([1], bad, torch.device("cpu"), 10, lane_ids=[42], drafter_name="x")


def test_round_columns_carry_their_host_values_and_the_checks_read_them() -> None:
    """Columns laid out from host ids carry them (`HostKnownColumns`), so a static executor's token-id
    checks (`host_columns`) read those and never the device: here the tensors are made to disagree
    with the carried values to show which ones are read."""
    from ignis.runtime.families.static_rounds import host_columns

    props = [DraftProposal(torch.tensor([4, 5])), DraftProposal(torch.empty(0, dtype=torch.int64))]
    b = RoundColumns.build([1, 2], props, torch.device("cpu"), 10, lane_ids=[0, 1], drafter_name="x")
    assert isinstance(b.columns, HostKnownColumns) and b.columns.host == [[1, 4, 5], [2]]
    assert [c.tolist() for c in b.columns] == b.columns.host
    one = RoundColumns.build([7], [props[1]], torch.device("cpu"), 10, lane_ids=[0], drafter_name="x")
    assert isinstance(one.columns, HostKnownColumns) and one.columns.host == [[7]]
    carried = HostKnownColumns([torch.tensor([9, 9]), torch.tensor([9])], [[1, 2], [3]])
    got = host_columns(carried)
    assert [g.tolist() for g in got] == [[1, 2], [3]] and all(g.dtype == torch.int64 for g in got)
    from ignis.runtime.families.llama_graphs import _host_ids

    lanes, flat = _host_ids(carried)  # the static llama executor's checks read the same values
    assert [t.tolist() for t in lanes] == [[1, 2], [3]] and flat == [1, 2, 3]
    plain = [torch.tensor([1, 2])]
    assert host_columns(plain) is plain  # one CPU column: nothing to copy
    assert [g.tolist() for g in host_columns([torch.tensor([1, 2]), torch.tensor([3])])] == [[1, 2], [3]]


def test_round_host_ids_shared_buffer_equals_per_lane() -> None:
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(4, 5, 11, generator=g)  # [lanes, width, vocab], as a static round's output
    lens = [3, 1, 5, 2]
    views = [buf[i, :n] for i, n in enumerate(lens)]
    copies = [v.clone() for v in views]
    greedy = [0, 2, 3]
    t_views, _ = round_host_ids(views, greedy, [])
    t_copies, _ = round_host_ids(copies, greedy, [])
    expect = {i: views[i].argmax(-1).tolist() for i in greedy}
    assert t_views == expect and t_copies == expect
    t, d = round_host_ids(views, greedy, [torch.tensor([9, -1], dtype=torch.int32), torch.tensor([[3], [4]])])
    assert t == expect and d == [[9, -1], [3, 4]]
    assert round_host_ids(views, [], []) == ({}, [])


# ---------------------------------------------------------------- stops and metrics


def _checker(params: SamplingParams, prompt_len: int, max_context: int | None) -> StopChecker:
    return StopChecker(params, num_prompt_tokens=prompt_len, eos_token_ids=(0, 1), max_context=max_context)


def test_stop_checker_run_path_equals_token_by_token() -> None:
    rng = random.Random(0)
    for _ in range(400):
        params = SamplingParams(
            temperature=0,
            max_tokens=rng.choice([None, 1, 3, 8]),
            stop_token_ids=tuple(rng.sample(range(2, 12), rng.randint(0, 2))),
            ignore_eos=rng.random() < 0.3,
        )
        prompt_len, ctx = rng.randint(1, 4), rng.choice([None, 8, 12])
        fast, slow = _checker(params, prompt_len, ctx), _checker(params, prompt_len, ctx)
        while not slow.is_finished:
            run = [rng.randrange(0, 30) for _ in range(rng.randint(1, 6))]
            n_fast = fast.extend(run)
            n_slow = 0
            for t in run:
                n_slow += 1
                if slow.append(t):
                    break
            assert n_fast == n_slow
            assert fast.output_token_ids == slow.output_token_ids
            assert (fast.finish_reason, fast.stop_reason) == (slow.finish_reason, slow.stop_reason)


def test_record_rounds_equals_record_round_and_checks_first() -> None:
    rounds = [(3, 3, 4), (3, 1, 2), (2, 0, 1), (3, 2, 2)]
    one, many = SpeculativeMetrics(), SpeculativeMetrics()
    for k, a, e in rounds:
        one.record_round(num_drafted=k, num_accepted=a, num_emitted=e)
    many.record_rounds(rounds)
    assert many.samples() == one.samples()
    with pytest.raises(ValueError, match="num_accepted=4 outside"):
        many.record_rounds([(2, 1, 2), (3, 4, 5)])
    assert many.samples() == one.samples()  # nothing counted from a rejected batch


# ---------------------------------------------------------------- GPU: no sync before the forward

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _DeviceDrafter(BaseDrafter):
    """Drafts on the device (as DFlash2 / MTP on CUDA); optionally turns sync errors on after proposing."""

    name = "device-test"

    def __init__(self, drafts: list[int], guard: bool) -> None:
        self.drafts, self.guard = drafts, guard

    def propose(self, requests):  # type: ignore[no-untyped-def]
        out = [
            DraftProposal(torch.tensor(self.drafts[: r.num_drafts], dtype=torch.int64, device="cuda"))
            for r in requests
        ]
        if self.guard:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any host sync until the forward raises
        return out


def _guarded(ex):  # type: ignore[no-untyped-def]
    real = ex.forward

    def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode("default")
        return real(*args, **kwargs)

    ex.forward = forward
    return ex


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["off", "device"])
def test_no_host_sync_between_proposal_and_forward(backend: str) -> None:
    ex = _guarded(_hybrid("cuda"))
    drafter = None if backend == "off" else _DeviceDrafter([3, 4, 5], guard=True)
    eng = SpeculativeEngine(ex, drafter, draft_tokens=None if drafter is None else 3)
    eng.add_lane([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.add_lane([5, 6], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    try:
        eng.step()  # prefill (syncs for the first tokens) and a first round
        while eng.has_unfinished:
            if drafter is None:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
def test_device_drafts_outside_the_vocabulary_raise_after_a_clamped_forward() -> None:
    ex = _hybrid("cuda")
    vocab = int(ex.config.vocab_size)
    eng = SpeculativeEngine(ex, _DeviceDrafter([1, vocab + 5], guard=False), draft_tokens=2)
    eng.add_lane([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(DrafterError, match=rf"lane 0: draft ids \[1, {vocab + 5}\] outside"):
        while eng.has_unfinished:
            eng.step()
    torch.cuda.synchronize()  # the device is still usable: no out-of-range embedding lookup ran


# ---------------------------------------------------------------- rejection sampling without a sync


def _reference_rejection_sample(drafts, p, q, gen):  # type: ignore[no-untyped-def]
    """The host-synchronising algorithm `rejection_sample_on_device` replaces, step by step."""
    p = p.double()
    k = drafts.numel()
    n = k
    if k:
        rows = torch.arange(k)
        p_d = p[rows, drafts]
        q_d = torch.ones_like(p_d) if q is None else q.double()[rows, drafts]
        u = torch.rand(k, generator=gen, dtype=torch.float64)
        n = int(torch.cumprod((u * q_d < p_d).to(torch.int64), dim=0).sum().item())
    if n < k:
        if q is None:
            q_n = torch.zeros_like(p[n])
            q_n[drafts[n]] = 1.0
        else:
            q_n = q[n].double()
        residual = (p[n] - q_n).clamp_min(0.0)
        dist = residual if float(residual.sum().item()) > 0.0 else p[n]
    else:
        dist = p[k]
    last = torch.multinomial(dist, 1, generator=gen)
    return [*drafts[:n].tolist(), int(last.item())], n


def test_rejection_sampling_on_device_draws_as_the_host_algorithm() -> None:
    from ignis.runtime.acceptance import rejection_sample_on_device

    g = torch.Generator().manual_seed(0)
    vocab = 6
    for trial in range(300):
        k = trial % 5
        p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 2, dim=-1)
        p[:, trial % vocab] = 0.0 if trial % 3 == 0 else p[:, trial % vocab]  # zeros in the support
        p = p / p.sum(-1, keepdim=True)
        q = None if trial % 2 else torch.softmax(torch.randn(k, vocab, generator=g), dim=-1)
        drafts = torch.randint(0, vocab, (k,), generator=g)
        seed = 1000 + trial
        ref = _reference_rejection_sample(drafts, p, q, torch.Generator().manual_seed(seed))
        pending = rejection_sample_on_device(drafts, p, q, torch.Generator().manual_seed(seed))
        assert pending.resolve() == ref, trial
        assert pending.resolve(pending.host_tensor().tolist()) == ref


@pytest.mark.gpu
@needs_cuda
def test_host_columns_of_one_cuda_lane_is_one_copy() -> None:
    """One lane's CUDA column reaches the host in one copy (not a min and a max read on the device),
    and device drafts keep the columns a plain list (their values are not on the host)."""
    from ignis.runtime.families.static_rounds import host_columns

    col = torch.tensor([5, 6, 7], device="cuda")
    got = host_columns([col])
    assert len(got) == 1 and got[0].device.type == "cpu" and got[0].tolist() == [5, 6, 7]
    dev = [DraftProposal(torch.tensor([3, 4], device="cuda"))]
    b = RoundColumns.build([1], dev, torch.device("cuda"), 10, lane_ids=[0], drafter_name="x")
    assert not isinstance(b.columns, HostKnownColumns) and b.columns[0].tolist() == [1, 3, 4]
