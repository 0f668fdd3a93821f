"""The tiled q4_g32 layout and kernel: the layout's semantics, a model of the kernel's tensor-core
operand mapping checked against float64 on the CPU, the stream-K partition, cross-compiled modules,
and (on a GPU host) the CUDA kernel itself against float64 at every verify width."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ignis.compiler.kernels import q4_tiled as q4_tiled_module
from ignis.compiler.kernels.q4_linear import Q4KernelError, cuda_binary_info, dequantize_q4, pack_q4
from ignis.compiler.kernels.q4_tiled import TiledConfig, build_q4_tiled_module, tiled_config_for, tiled_source
from ignis.runtime.kernels.q4_tiled import (
    NIBBLE_OF_FEATURE,
    Q4TiledLayoutError,
    tile_q4,
    tiled_shapes,
    untile_q4,
)
from ignis.runtime.linear import dequantize_q4 as torch_dequantize_q4

HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


def _random_q4(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    qw = pack_q4(rng.integers(0, 16, (n, k)))
    scales = ((rng.random((n, k // 32)) + 0.5) / (4.6 * k**0.5)).astype(np.float16)
    return qw, scales


# ---------------------------------------------------------------------------------------------
# The layout


@pytest.mark.parametrize("n", [16, 37, 64])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_tile_round_trip_and_padding(n: int, lead: tuple[int, ...]) -> None:
    rng = np.random.default_rng(n)
    k = 256
    parts = [_random_q4(rng, n, k) for _ in range(int(np.prod(lead)) if lead else 1)]
    qw = torch.from_numpy(np.stack([p[0] for p in parts]).view(np.int32)).reshape(*lead, n, k // 8)
    sc = torch.from_numpy(np.stack([p[1] for p in parts])).reshape(*lead, n, k // 32)
    codes, scales = tile_q4(qw, sc)
    t = -(-n // 16)
    assert codes.shape == (*lead, t, k // 128, 256) and scales.shape == (*lead, t, k // 128, 64)
    back_q, back_s = untile_q4(codes, scales, n)
    assert torch.equal(back_q, qw) and torch.equal(back_s, sc)
    # the padding rows of the last tile dequantize to exactly zero: code 8, scale 0
    full_q, full_s = untile_q4(codes, scales, t * 16)
    pad = torch_dequantize_q4(full_q, full_s)[..., n:, :]
    assert pad.shape == (*lead, t * 16 - n, k) and not pad.any()


def test_tiled_word_semantics() -> None:
    """Word (h * 32 + 4 g + t) * 4 + w of (tile, k-step s) holds row 16 tile + g + 8 h at features
    128 s + 32 w + 8 t + f, feature f in nibble NIBBLE_OF_FEATURE[f]; its scales at (g * 2 + h) * 4 + w."""
    rng = np.random.default_rng(5)
    n, k = 48, 384
    qw, sc = _random_q4(rng, n, k)
    codes, scales = tile_q4(torch.from_numpy(qw.view(np.int32)), torch.from_numpy(sc))
    words = codes.numpy().view(np.uint32)
    q = np.stack([(qw >> (4 * j)) & 15 for j in range(8)], axis=-1).reshape(n, k)
    for _ in range(300):
        o, i = int(rng.integers(n)), int(rng.integers(k))
        tile, r = divmod(o, 16)
        h, g = divmod(r, 8)
        s, rem = divmod(i, 128)
        w, rem = divmod(rem, 32)
        t, f = divmod(rem, 8)
        word = int(words[tile, s, (h * 32 + 4 * g + t) * 4 + w])
        assert (word >> (4 * NIBBLE_OF_FEATURE[f])) & 15 == q[o, i]
        assert scales[tile, s, (g * 2 + h) * 4 + w] == torch.tensor(sc[o, i // 32])


def test_tiling_refuses_what_it_cannot_lay_out() -> None:
    with pytest.raises(Q4TiledLayoutError, match="multiple of 128"):
        tiled_shapes(16, 96)
    with pytest.raises(Q4TiledLayoutError, match="u32/i32"):
        tile_q4(torch.zeros(16, 16, dtype=torch.int64), torch.zeros(16, 4, dtype=torch.float16))
    with pytest.raises(Q4TiledLayoutError, match="not one q4_g32 weight"):
        tile_q4(torch.zeros(16, 16, dtype=torch.int32), torch.zeros(16, 3, dtype=torch.float16))
    codes, scales = tile_q4(torch.zeros(20, 16, dtype=torch.int32), torch.zeros(20, 4, dtype=torch.float16))
    with pytest.raises(Q4TiledLayoutError, match="cannot hold"):
        untile_q4(codes, scales, 40)


# ---------------------------------------------------------------------------------------------
# A model of the kernel's tensor-core operands (q4_tiled.cuh `compute`), against float64


def _raw_pairs(word: int) -> list[tuple[int, int]]:
    """TiledDequant::raw: the exponent trick's pairs (nibble i, nibble i + 4), i = 0..3, minus 8."""
    nib = [(word >> (4 * j)) & 15 for j in range(8)]
    return [(nib[i] - 8, nib[i + 4] - 8) for i in range(4)]


def _mma_m16n8k16(
    a_regs: list[list[tuple[float, float]]], b_regs: list[list[tuple[float, float]]]
) -> np.ndarray:
    """D[16, 8] = A[16, 16] @ B[16, 8] from per-lane fragments laid out as the PTX ISA's
    mma.m16n8k16 .f16/.bf16 tables say: lane (g, t), A regs (a0a1, a2a3, a4a5, a6a7) = A[g][2t..],
    A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]; B regs (b0b1, b2b3) = B[2t..][g], B[2t+8..][g]."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col : col + 2] = a_regs[lane][reg]
        for reg, krow in enumerate([2 * t, 2 * t + 8]):
            B[krow : krow + 2, g] = b_regs[lane][reg]
    return A @ B


@pytest.mark.parametrize("post_scale", [True, False])
def test_operand_model_matches_float64(post_scale: bool) -> None:
    """Per unit, word w, lane (g, t): a0 = (P0 g, P0 g+8, P1 g, P1 g+8), a1 = (P2 .., P3 ..), B from
    one 16-byte load of x (features 32 w + 8 t ..), scales post or pre mma: the sum over units equals
    x @ dequant(W)^T. A change to the nibble order or the operand mapping on either side fails here."""
    rng = np.random.default_rng(11)
    n, k, rows = 32, 256, 8
    qw, sc = _random_q4(rng, n, k)
    x = rng.standard_normal((rows, k))
    codes, scales = tile_q4(torch.from_numpy(qw.view(np.int32)), torch.from_numpy(sc))
    words = codes.numpy().view(np.uint32)
    svals = scales.numpy().astype(np.float64)
    y = np.zeros((rows, n))
    for tile in range(words.shape[0]):
        for s in range(words.shape[1]):
            for w in range(4):
                a0, a1, b0, b1 = [], [], [], []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    s_g, s_g8 = svals[tile, s, (g * 2 + 0) * 4 + w], svals[tile, s, (g * 2 + 1) * 4 + w]
                    p0 = _raw_pairs(int(words[tile, s, (0 * 32 + lane) * 4 + w]))
                    p1 = _raw_pairs(int(words[tile, s, (1 * 32 + lane) * 4 + w]))
                    if not post_scale:
                        p0 = [(u * s_g, v * s_g) for u, v in p0]
                        p1 = [(u * s_g8, v * s_g8) for u, v in p1]
                    a0.append([p0[0], p1[0], p0[1], p1[1]])
                    a1.append([p0[2], p1[2], p0[3], p1[3]])
                    feats = x[g % rows, 128 * s + 32 * w + 8 * t : 128 * s + 32 * w + 8 * t + 8]
                    pairs = [(feats[2 * i], feats[2 * i + 1]) for i in range(4)]
                    b0.append([pairs[0], pairs[1]])  # v.x, v.y
                    b1.append([pairs[2], pairs[3]])  # v.z, v.w
                d = _mma_m16n8k16(a0, b0) + _mma_m16n8k16(a1, b1)  # [16 out rows, 8 act rows]
                if post_scale:
                    row_scale = np.array([svals[tile, s, (r % 8 * 2 + r // 8) * 4 + w] for r in range(16)])
                    d = d * row_scale[:, None]
                o = 16 * tile + np.arange(16)
                keep = o < n
                y[:, o[keep]] += d[keep].T
    ref = x @ dequantize_q4(qw, sc).astype(np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# The stream-K partition (q4_tiled.cuh tiled_owner, q4_tiled_ffi.cuh slots)


_KMAX = re.search(
    r"constexpr int kMaxParts = (\d+);", (Path(q4_tiled_module.__file__).parent / "q4_tiled.cuh").read_text()
)
assert _KMAX, "kMaxParts not found in q4_tiled.cuh"
_MAX_PARTS = int(_KMAX.group(1))


def _slots(steps: int, units: int, workers: int) -> int:
    per = units // workers
    return (steps - 2 + per - 1) // per + 2 if steps >= 2 else 1


@pytest.mark.parametrize(
    ("groups", "steps", "workers"),
    [
        (1088, 40, 2112),
        (320, 136, 2112),
        (68, 40, 132),
        (20, 136, 132),
        (7, 1, 7),
        (3, 3, 5),
        (15520, 40, 132),
        (4, 40, 132),  # a narrow weight (1024 rows): capped at 8 workers a group
        (1, 136, 132),
        (2, 12, 132),
    ],
)
def test_stream_k_partition(groups: int, steps: int, workers: int) -> None:
    units = groups * steps
    # the host launches at most one worker a unit and kMaxParts workers a group (q4_tiled_ffi.cuh)
    workers = min(workers, units, _MAX_PARTS * groups)

    def start(p: int) -> int:
        return p * units // workers

    def owner(u: int) -> int:  # tiled_owner
        return ((u + 1) * workers + units - 1) // units - 1

    for p in range(workers):
        assert start(p) < start(p + 1)  # no empty range
    rng = np.random.default_rng(groups)
    for u in [*rng.integers(0, units, 500).tolist(), 0, units - 1]:
        p = owner(u)
        assert start(p) <= u < start(p + 1)
    slots = _slots(steps, units, workers)
    for grp in range(groups):
        cover = owner(grp * steps + steps - 1) - owner(grp * steps) + 1
        assert 1 <= cover <= slots
        # the host's cap bounds the other partials the group's first worker gathers (a round trip each)
        assert cover - 1 <= _MAX_PARTS


_KXS = re.search(
    r"constexpr int kXsFirst = (\d+);", (Path(q4_tiled_module.__file__).parent / "q4_tiled.cuh").read_text()
)
assert _KXS, "kXsFirst not found in q4_tiled.cuh"
_XS_FIRST = int(_KXS.group(1))


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 7, 40, 136])
def test_bulk_staging_plan(steps: int) -> None:
    """The bulk-copy staging (q4_tiled.cuh, XS 2) as the kernel computes it: each copy group's bytes
    equal what its mbarrier is armed with, every (row, slot) is written once with the k-step the
    units read from it, the second group only after its wait, every copy 16-byte aligned and inside
    its row of the layout."""
    rng = np.random.default_rng(steps)
    lengths = {1, 2, 3, 4, 5, steps - 1, steps, steps + 1, 2 * steps + 3, *rng.integers(1, 3 * steps, 6)}
    for rows in (1, 7, 8, 16, 17, 32):
        for ks0 in sorted({0, 1, steps // 2, steps - 1} & set(range(steps))):
            for length in sorted(n for n in lengths if n >= 1):
                n_xs = min(length, steps)
                first = min(n_xs, _XS_FIRST)
                armed = [first * rows * 256, (n_xs - first) * rows * 256]
                row_stride = 256 * n_xs + 64
                moved, where = [0, 0], {}
                wrap = steps - ks0  # the slot of k-step 0
                for warp in range(16):
                    for grp, (lo, hi) in enumerate([(0, first), (first, n_xs)]):
                        for r in range(warp, rows, 16):
                            spans = [(lo, min(hi, wrap), ks0 + lo)] if lo < wrap else []
                            s0 = max(lo, wrap)
                            if s0 < hi:
                                spans.append((s0, hi, s0 - wrap))
                            for a, b, ks in spans:
                                if a >= b:
                                    continue
                                dst = r * row_stride + a * 256
                                assert dst % 16 == 0 and 0 <= ks and ks + b - a <= steps  # 256-byte k-steps
                                assert dst + (b - a) * 256 <= r * row_stride + 256 * n_xs
                                moved[grp] += (b - a) * 256
                                for slot in range(a, b):
                                    assert (r, slot) not in where
                                    where[(r, slot)] = (grp, ks + slot - a)
                assert moved == armed and len(where) == rows * n_xs
                for i in range(length):  # unit u0 + i reads k-step (ks0 + i) mod S from its slot
                    ks = (ks0 + i) % steps
                    slot = ks - ks0 if ks >= ks0 else ks - ks0 + steps
                    for r in range(rows):
                        grp, staged = where[(r, slot)]
                        assert staged == ks and (grp == 0 or i >= first)


_KXR_LAG = re.search(
    r"constexpr int tiled_xr_lag\(int xr\) \{ return xr > 2 \? (\d+) : (\d+); \}",
    (Path(q4_tiled_module.__file__).parent / "q4_tiled.cuh").read_text(),
)
assert _KXR_LAG, "tiled_xr_lag not found in q4_tiled.cuh"


def _xr_lag(xr: int) -> int:
    assert _KXR_LAG
    return int(_KXR_LAG.group(1)) if xr > 2 else int(_KXR_LAG.group(2))


@pytest.mark.parametrize(("xr", "xk"), [(2, 4), (3, 3), (4, 2), (6, 1), (2, 1), (8, 8)])
def test_activation_ring_plan(xr: int, xk: int) -> None:
    """The activation ring's copy plan (q4_tiled.cuh, XS 3), sequentially: each use of a slot is
    copied once, by every warp for its rows, with the bytes that warp arms the slot's full barrier
    with, in bulk copies that stay inside their rows (runs of consecutive k-steps, K < 128 XK
    included); every unit reads its own k-step (ks0 + i) mod S at its slot and position; a refill is
    issued after the slot's previous use and before its new one. The barriers' phases and parities
    under concurrency: `test_activation_ring_interleavings`."""
    rng = np.random.default_rng(xr * 10 + xk)
    lag = _xr_lag(xr)
    assert 1 <= lag < xr
    for steps in (1, 3, 40, 136):
        for rows in (1, 8, 17, 48, 64):
            for _ in range(6):
                ks0 = int(rng.integers(0, steps))
                n_units = int(rng.integers(1, 3 * steps + 2 * xr * xk))
                uses = -(-n_units // xk)
                row_stride = 256 * xk + 64
                slot_bytes = rows * row_stride
                contents: dict[tuple[int, int, int], int] = {}  # (slot, row, position) -> k-step
                issued_at: dict[int, int] = {}  # use -> the use at whose start it is copied (-1: prologue)
                for n in range(min(xr, uses)):
                    issued_at[n] = -1
                for m in range(uses):  # the start of use m: the refill, as every warp issues it
                    if m >= lag and (m - lag + xr) * xk < n_units:
                        assert (m - lag + xr) not in issued_at
                        issued_at[m - lag + xr] = m
                assert sorted(issued_at) == list(range(uses))  # every use copied exactly once
                for n in range(uses):
                    cnt = min(xk, n_units - n * xk)
                    ks_first = (ks0 + n * xk) % steps
                    runs, q, ks = [], 0, ks_first  # (position, end, first k-step) a bulk copy
                    while q < cnt:
                        length = min(cnt - q, steps - ks)
                        runs.append((q, q + length, ks))
                        q, ks = q + length, 0
                    slot = n % xr
                    moved = 0
                    for warp in range(16):
                        my_rows = (rows - 1 - warp) // 16 + 1 if rows > warp else 0
                        armed = my_rows * cnt * 256
                        mine = 0
                        for r in range(warp, rows, 16):
                            for a, b, k0 in runs:
                                row_end = slot * slot_bytes + (r + 1) * row_stride
                                dst = slot * slot_bytes + r * row_stride + a * 256
                                assert dst % 16 == 0 and dst + (b - a) * 256 <= row_end
                                assert k0 + (b - a) <= steps
                                mine += (b - a) * 256
                                for q in range(a, b):
                                    contents[(slot, r, q)] = k0 + q - a
                        assert mine == armed
                        moved += mine
                    assert moved == rows * cnt * 256
                    # the refill of this slot for use n waited for every warp to finish use n - xr
                    # (its empty phase (n - xr) // xr) and was issued before use n is read
                    if n >= xr:
                        assert n - xr < issued_at[n] < n
                    else:
                        assert issued_at[n] == -1
                    for i in range(n * xk, n * xk + cnt):
                        q = i - n * xk
                        for r in range(rows):
                            assert contents[(slot, r, q)] == (ks0 + i) % steps


class _Mbarrier:
    """A shared-memory mbarrier as PTX defines it: a phase completes when its pending arrivals reach
    zero and its transaction count (bytes expected minus bytes completed) is zero."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, expect_tx: int = 0) -> None:
        self.tx += expect_tx
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._complete_phase()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._complete_phase()

    def _complete_phase(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def try_wait(self, parity: int) -> bool:  # mbarrier.try_wait.parity: the phase of that parity is over
        return (self.phase & 1) != parity


def _ring_interleaving(warps: int, xr: int, xk: int, rows: int, steps: int, n_units: int, seed: int) -> None:
    """One random interleaving of the ring's warps and its in-flight bulk copies, transcribed from the
    kernel (q4_tiled.cuh: the prologue's `xr_copy`s, `step`'s refill, full wait and empty arrival):
    asserts that every unit reads its own use's data, no copy lands in a slot another warp is still
    reading, no warp deadlocks and no copy is in flight when the warps are done."""
    rnd = random.Random(seed)
    lag = _xr_lag(xr)
    full = [_Mbarrier(warps) for _ in range(xr)]
    empty = [_Mbarrier(warps) for _ in range(xr)]
    held: list[list[int | None]] = [[None] * rows for _ in range(xr)]  # slot, row -> the use it holds
    inflight: list[tuple[int, int, int]] = []  # (slot, use, bytes) of issued, not yet landed copies
    reading: list[tuple[int, int] | None] = [None] * warps  # warp -> (slot, use) being read

    def xr_copy(w: int, n: int) -> None:
        cnt = min(xk, n_units - n * xk)
        mine = list(range(w, rows, warps))
        full[n % xr].arrive(len(mine) * cnt * 256)  # arrive.expect_tx before the copies
        inflight.extend((n % xr, n, cnt * 256) for _ in mine)

    def warp(w: int) -> Iterator[None]:
        for n in range(xr):
            if n * xk < n_units:
                xr_copy(w, n)
        for i in range(n_units):
            m, q = divmod(i, xk)
            if q == 0:
                if m >= lag and (m - lag + xr) * xk < n_units:
                    done = m - lag
                    while not empty[done % xr].try_wait((done // xr) & 1):
                        yield
                    xr_copy(w, done + xr)
                while not full[m % xr].try_wait((m // xr) & 1):
                    yield
            assert all(held[m % xr][r] == m for r in range(rows)), "a unit read before its copy landed"
            reading[w] = (m % xr, m)
            yield
            reading[w] = None
            if q == xk - 1:
                empty[m % xr].arrive()
            yield

    live = {w: warp(w) for w in range(warps)}
    for _ in range(10**6):
        if not live and not inflight:
            return
        pick = rnd.randrange(len(live) + (1 if inflight else 0))
        if pick == len(live):  # a copy lands (one row)
            slot, use, nbytes = inflight.pop(rnd.randrange(len(inflight)))
            assert all(r is None or r[0] != slot or r[1] == use for r in reading), "overwrote a slot in use"
            row = next(r for r in range(rows) if held[slot][r] != use)
            held[slot][row] = use
            full[slot].complete_tx(nbytes)
        else:
            w = list(live)[pick]
            try:
                next(live[w])
            except StopIteration:
                del live[w]
    raise AssertionError("the ring deadlocked")


@pytest.mark.parametrize(("xr", "xk"), [(2, 4), (3, 3), (2, 1), (8, 2)])
def test_activation_ring_interleavings(xr: int, xk: int) -> None:
    """The ring's synchronization under random interleavings of warps and copy completions (real
    mbarrier phase, transaction-count and parity semantics): no read before its data, no overwrite
    of a slot in use, no deadlock, nothing in flight at the end."""
    for warps in (1, 4, 16):
        for rows in (1, 17, 64):
            for n_units in (1, xr * xk, xr * xk + 1, 3 * xr * xk + 2):
                for seed in range(2):
                    _ring_interleaving(warps, xr, xk, rows, 40, n_units, seed * 31 + n_units)


# ---------------------------------------------------------------------------------------------
# Configurations and cross-compiled modules


def test_configs_are_validated_and_tagged() -> None:
    with pytest.raises(Q4KernelError, match="n_tiles"):
        TiledConfig(n_tiles=9)
    with pytest.raises(Q4KernelError, match="more than 4 n-tiles need x_smem"):
        TiledConfig(n_tiles=5)  # 33-64 rows read their activations from the shared-memory staging
    assert TiledConfig(n_tiles=8, warps=16, min_blocks=1, x_smem=True).max_rows == 64
    with pytest.raises(Q4KernelError, match="ring"):
        TiledConfig(ring=1)
    with pytest.raises(Q4KernelError, match="x_smem takes no x_double"):
        TiledConfig(x_smem=True, x_double=True)
    cfg = TiledConfig(n_tiles=2, warps=16, depth=3, min_blocks=1, blocks_per_sm=1, x_smem=True)
    assert cfg.tag == "t2_mt1_w16_d3_post_mb1_b1_xs" and cfg.max_rows == 16
    assert cfg.export_line("f") == "IGNIS_Q4T_EXPORT(f, 2, 1, 16, 3, true, 1, 1, true, 0, false, 0, 1, 0, 1)"
    bulk = TiledConfig(n_tiles=2, warps=16, depth=3, min_blocks=1, blocks_per_sm=1, x_smem=True, x_bulk=True)
    assert bulk.tag == "t2_mt1_w16_d3_post_mb1_b1_xb" and bulk.export_line("f").endswith(", 0, 2, 0, 1)")
    with pytest.raises(Q4KernelError, match="x_bulk needs x_smem"):
        TiledConfig(x_bulk=True)
    ring = TiledConfig(
        n_tiles=8, warps=16, min_blocks=1, blocks_per_sm=1, x_smem=True, x_bulk=True, x_ring=2, x_ring_k=4
    )
    assert ring.tag.endswith("_xr2k4") and ring.export_line("f").endswith(", 3, 2, 4)")
    for bad in (
        {"x_ring": 1, "x_bulk": True, "x_smem": True},
        {"x_ring": 9, "x_bulk": True, "x_smem": True},
        {"x_ring": 2, "x_smem": True},
        {"x_ring_k": 2, "x_bulk": True, "x_smem": True},
        {"x_ring": 2, "x_ring_k": 9, "x_bulk": True, "x_smem": True},
    ):
        with pytest.raises(Q4KernelError, match="x_ring"):
            TiledConfig(**bad)
    # 41-64 rows stream their activations through a ring on sm_90+; 1-40 rows and older archs stage
    # the whole span
    assert [tiled_config_for(8 * nt, 5120, 5120, "sm_90").x_ring for nt in range(1, 9)] == [0] * 5 + [2] * 3
    assert tiled_config_for(64, 5120, 5120, "sm_80").x_ring == 0
    # bulk-copy staging on sm_90 and newer, cp.async staging before (no bulk copies there)
    staging = {arch: tiled_config_for(8, 17408, 5120, arch) for arch in ("sm_80", "sm_89", "sm_90", "sm_120")}
    assert [(c.x_smem, c.x_bulk) for c in staging.values()] == [(True, False)] * 2 + [(True, True)] * 2
    with pytest.raises(Q4KernelError, match="sm_NN"):
        tiled_config_for(8, 17408, 5120, "hopper")
    with pytest.raises(Q4KernelError, match="x_bulk needs sm_90"):
        build_q4_tiled_module("sm_86", {"f": bulk}, "/nonexistent/x.so")
    assert tiled_source({"f": cfg}).startswith('#include "q4_tiled_ffi.cuh"')
    for rows in (1, 8, 9, 16, 17, 24, 25, 32, 33, 40, 57, 64):
        cfg_r = tiled_config_for(rows, 17408, 5120, "sm_90")
        assert cfg_r.max_rows - 8 < rows <= cfg_r.max_rows
    with pytest.raises(Q4KernelError, match=r"1\.\.64 rows"):
        tiled_config_for(65, 128, 128, "sm_90")
    with pytest.raises(Q4KernelError, match="% 128"):
        tiled_config_for(1, 128, 96, "sm_90")
    with pytest.raises(Q4KernelError, match="sm_80"):
        build_q4_tiled_module("sm_75", {"f": TiledConfig()}, "/nonexistent/x.so")


def test_diagnostic_modes_match_the_kernel() -> None:
    """The diagnostics (wrong output by design, timed by tools/bench/q4_tiled.py) are exclusive, tagged
    apart, and their export's MODE is the kernel's constant of that name (q4_tiled.cuh, q4_linear.cuh)."""
    src = (Path(q4_tiled_module.__file__).parent / "q4_tiled.cuh").read_text()
    src += (Path(q4_tiled_module.__file__).parent / "q4_linear.cuh").read_text()
    base = {"warps": 16, "depth": 3, "min_blocks": 1, "blocks_per_sm": 1, "x_smem": True, "x_bulk": True}
    modes = {}
    for flag, const in (
        ("stream_only", "kModeStreamOnly"),
        ("no_fixup", "kModeNoFixup"),
        ("no_wait", "kModeNoWait"),
        ("math_only", "kModeMathOnly"),
    ):
        cfg = TiledConfig(**base, **{flag: True})
        assert cfg.diagnostic and "_" + flag.replace("_", "") in cfg.tag
        mode = int(cfg.export_line("f").split(", ")[11])
        match = re.search(rf"\b{const} = (\d+)", src)
        assert match and int(match.group(1)) == mode, flag
        modes[flag] = mode
    assert len(set(modes.values())) == 4 and 0 not in modes.values()
    assert not TiledConfig(**base).diagnostic and TiledConfig(**base).export_line("f").split(", ")[11] == "0"
    with pytest.raises(Q4KernelError, match="exclusive"):
        TiledConfig(**base, no_fixup=True, math_only=True)
    with pytest.raises(Q4KernelError, match="math_only takes ring 0"):
        TiledConfig(warps=16, depth=3, min_blocks=1, ring=2, math_only=True)
    # no configuration the build can pick is a diagnostic (every arch's staging, every width)
    for arch in ("sm_80", "sm_90", "sm_120"):
        assert not any(tiled_config_for(rows, 17408, 5120, arch).diagnostic for rows in range(1, 65))


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_120"])
def test_rule_modules_cross_compile(tmp_path: Path, arch: str) -> None:
    exports = {f"q4t_nt{nt}": tiled_config_for(8 * nt, 17408, 5120, arch) for nt in (1, 4)}
    path = build_q4_tiled_module(arch, exports, tmp_path / f"q4t_{arch}.so")
    info = cuda_binary_info(path)
    assert info.sass_archs == (arch,) and info.is_binary_only


# ---------------------------------------------------------------------------------------------
# On a GPU host: the CUDA kernel against float64 (a `build_gpu_modules` bundle: IGNIS_Q4T_BUNDLE,
# or built here when nvcc exists; the cp.async staging of cards before sm_90 from a
# `python -m ignis.tools.bench.q4_tiled build` folder: IGNIS_Q4T_CANDIDATES)


def _bundle(tmp_path: Path, x_bulk: bool = True, fresh: bool = False) -> tuple[dict[int, object], str]:
    """The rules' functions by n-tile count; ``x_bulk=False``: the same rules with cp.async staging
    (what cards before sm_90 run), on any card. ``fresh``: from a copy of the library under
    `tmp_path`, so its stream-K workspace (a static of the library) starts empty whatever earlier
    tests grew it to."""
    import shutil
    from dataclasses import replace

    from ignis.runtime.kernels.tvm_runtime import load_module

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    rules = {nt: tiled_config_for(8 * nt, 5120, 5120, arch) for nt in range(1, 9)}
    if not x_bulk:
        rules = {nt: replace(cfg, x_bulk=False, x_ring=0, x_ring_k=1) for nt, cfg in rules.items()}
        folder = os.environ.get("IGNIS_Q4T_CANDIDATES")
        if folder:
            man = json.loads((Path(folder) / "manifest.json").read_text())
            by_tag = {info["tag"]: name for name, info in man["exports"].items()}
            missing = [cfg.tag for cfg in rules.values() if cfg.tag not in by_tag]
            if missing:
                pytest.skip(f"{folder} lacks {missing}")
            mod = load_module(Path(folder) / man["file"], cuda=True)
            return {nt: mod[by_tag[cfg.tag]] for nt, cfg in rules.items()}, arch
    folder = os.environ.get("IGNIS_Q4T_BUNDLE")
    if folder and x_bulk:
        man = json.loads((Path(folder) / "manifest.json").read_text())
        if man.get("kind") != "q4_g32_tiled":
            pytest.skip(f"{folder} is not a tiled bundle")
        lib = Path(folder) / man["file"]
        if fresh:
            lib = Path(shutil.copy(lib, tmp_path / f"fresh_{lib.name}"))
        mod = load_module(lib, cuda=True)
        by_nt = {}
        for key, name in man["table"].items():
            w = int(key.split("|")[0])
            by_nt.setdefault((w + 7) // 8, mod[name])
        return by_nt, arch
    if not HAS_NVCC:
        pytest.skip("needs IGNIS_Q4T_BUNDLE (tools/bench/build_gpu_modules.py), IGNIS_Q4T_CANDIDATES or nvcc")
    exports = {f"q4t_nt{nt}": cfg for nt, cfg in rules.items()}
    mod = load_module(build_q4_tiled_module(arch, exports, tmp_path / "q4t.so"), cuda=True)
    return {nt: mod[f"q4t_nt{nt}"] for nt in rules}, arch


def _cuda_q4(n: int, k: int, gen: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """Random q4_g32 parts on the GPU, row-major and tiled: (codes, scales, tiled codes, tiled scales)."""
    qw = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int64, generator=gen)
    qw = qw.to(torch.int32)
    sc = ((torch.rand(n, k // 32, device="cuda", generator=gen) + 0.5) / (4.6 * k**0.5)).half()
    return (qw, sc, *tile_q4(qw, sc))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("dtype", "x_bulk"), [(torch.float16, True), (torch.bfloat16, True), (torch.float16, False)]
)
def test_tiled_kernel_matches_float64(tmp_path: Path, dtype: torch.dtype, x_bulk: bool) -> None:
    """Every width bucket on the 27B's MLP shapes (and their stacked gate|up, split into launches over
    tile ranges at 25-32 rows), shapes whose N is not a multiple of 16, a single k-step, fewer units
    than SMs, and the vocabulary head (whose 17-32-row calls run as 16-row slices through the 2-n-tile
    block kernel: its activations at those rows fit in shared memory in no split); outputs fully
    written, deterministic, within the output dtype's rounding. With the
    activations staged by bulk copies (sm_90+) and by cp.async (the staging before sm_90)."""
    from ignis.runtime.kernels.tvm_runtime import torch_stream

    fns, arch = _bundle(tmp_path, x_bulk)
    if x_bulk and int(arch[3:]) < 90:
        pytest.skip(f"bulk-copy staging needs sm_90 or newer, this card is {arch}")
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    gen = torch.Generator(device="cuda").manual_seed(3)
    # (1024, 5120): a narrow weight, its workers capped at kMaxParts a group; (1024, 27648): narrow and
    # deep, whose capped workers' activations do not fit at 25-32 rows (the host lifts the cap);
    # (34816, 5120): a stacked gate|up whose activations fit at 25-32 rows only in two launches over
    # halves of its tiles (kMaxTileChunks)
    shapes = [
        (34816, 5120),
        (17408, 5120),
        (5120, 17408),
        (100, 128),
        (37, 384),
        (1000, 1280),
        (1024, 5120),
        (1024, 27648),
        (248320, 5120),
    ]
    for n, k in shapes:
        qw, sc, tq, ts = _cuda_q4(n, k, gen)
        wd = torch_dequantize_q4(qw, sc, torch.float64)
        widths = [1, 5, 8, 9, 16, 17, 24, 25, 32, 33, 48, 57, 64] if n * k < 10**9 else [1, 8, 16, 24, 32, 64]
        for rows in widths:
            # the next function up where a bundle has no function of this n-tile count
            fn = next((fns[nt] for nt in range((rows + 7) // 8, 9) if nt in fns), None)
            if fn is None:
                continue
            x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
            y1 = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
            y2 = torch.full_like(y1, float("nan"))
            with torch_stream():
                fn(x, tq, ts, y1)
                fn(x, tq, ts, y2)
            torch.cuda.synchronize()
            assert torch.isfinite(y1).all(), f"[{n}, {k}] rows={rows}: output not fully written"
            assert torch.equal(y1, y2), f"[{n}, {k}] rows={rows}: reruns differ"
            ref = x.double() @ wd.T
            err = ((y1.double() - ref).norm() / ref.norm()).item()
            assert err < tol, f"[{n}, {k}] rows={rows}: rel err {err:.2e}"
        del qw, sc, tq, ts, wd


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiled_kernel_with_nan_inputs(tmp_path: Path) -> None:
    """A NaN activation and a NaN scale reach only the outputs they feed: the shared groups' partials
    that are NaN are still gathered (the workspace's empty value is a NaN pattern arithmetic does not
    produce), the call returns, and every other output matches float64."""
    from ignis.runtime.kernels.tvm_runtime import torch_stream

    fns, _arch = _bundle(tmp_path)
    gen = torch.Generator(device="cuda").manual_seed(5)
    n, k = 5120, 17408  # groups shared by ~7 blocks
    qw, sc, _tq, _ts = _cuda_q4(n, k, gen)
    sc[:16, 0] = float("nan")  # tile 0's first scale group: outputs 0..15 are NaN for every row
    tq, ts = tile_q4(qw, sc)
    wd = torch_dequantize_q4(qw, sc, torch.float64)
    for rows in (2, 9, 16, 32):
        x = torch.randn(rows, k, device="cuda", generator=gen).half()
        x[rows // 2, 7] = float("nan")  # one activation row is NaN everywhere
        y = torch.zeros(rows, n, device="cuda", dtype=torch.float16)
        with torch_stream():
            fns[(rows + 7) // 8](x, tq, ts, y)
        torch.cuda.synchronize()
        assert torch.isnan(y[rows // 2]).all(), f"rows={rows}: the NaN row leaked"
        assert torch.isnan(y[:, :16]).all(), f"rows={rows}: the NaN scale group leaked"
        keep = torch.ones(rows, dtype=torch.bool, device="cuda")
        keep[rows // 2] = False
        ref = x[keep].double() @ wd[16:].T
        got = y[keep][:, 16:].double()
        assert torch.isfinite(got).all(), f"rows={rows}: NaN outside the NaN inputs' outputs"
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 2e-3, f"rows={rows}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiled_kernel_in_a_cuda_graph(tmp_path: Path) -> None:
    """Captured after one eager call (the workspace is sized then), replays equal the eager result;
    a shape whose workspace would have to grow during capture is refused with a clear error (a fresh
    copy of the library: earlier tests' 64-row calls on the vocabulary head grow the shared workspace
    past what the large shape below needs)."""
    import tvm_ffi

    from ignis.runtime.kernels.tvm_runtime import torch_stream

    fns, _arch = _bundle(tmp_path, fresh=True)
    fn = fns[1]
    n, k = 4096, 2048
    _qw, _sc, tq, ts = _cuda_q4(n, k)
    x = torch.randn(4, k, device="cuda").half()
    want = torch.empty(4, n, device="cuda", dtype=torch.float16)
    with torch_stream():
        fn(x, tq, ts, want)
    got = torch.empty_like(want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
        fn(x, tq, ts, got)
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    # A much larger shape first seen during capture: refused, not silently corrupting the graph.
    big_n = 1 << 20
    bq = torch.zeros(big_n, k // 8, device="cuda", dtype=torch.int32)
    btq, bts = tile_q4(bq, torch.zeros(big_n, k // 32, device="cuda", dtype=torch.float16))
    by = torch.empty(4, big_n, device="cuda", dtype=torch.float16)
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.stream(stream), tvm_ffi.use_torch_stream(torch.cuda.graph(g2)):
            fn(x, btq, bts, by)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiled_kernel_refuses_bad_arguments(tmp_path: Path) -> None:
    """Wrong shapes, an empty output and misaligned parts are refused with a named error (the process
    survives and the next good call is right)."""
    from ignis.runtime.kernels.tvm_runtime import torch_stream

    fns, _arch = _bundle(tmp_path)
    fn = fns[1]
    n, k = 64, 256
    qw, sc, tq, ts = _cuda_q4(n, k)
    x = torch.randn(2, k, device="cuda").half()
    with torch_stream():
        with pytest.raises(ValueError, match="tiled qweight must be"):
            fn(x, tq[:1], ts[:1], torch.empty(2, n, device="cuda", dtype=torch.float16))
        with pytest.raises(ValueError, match=r"contiguous|at least one output"):
            fn(x, tq[:0], ts[:0], torch.empty(2, 0, device="cuda", dtype=torch.float16))
        buf = torch.empty(2 * k + 1, device="cuda", dtype=torch.float16)
        with pytest.raises(ValueError, match="16-byte"):
            fn(buf[1:].view(2, k), tq, ts, torch.empty(2, n, device="cuda", dtype=torch.float16))
        with pytest.raises(ValueError, match=r"compiled for 1\.\.8 rows"):
            fn(
                torch.randn(9, k, device="cuda").half(),
                tq,
                ts,
                torch.empty(9, n, device="cuda", dtype=torch.float16),
            )
        y = torch.empty(2, n, device="cuda", dtype=torch.float16)
        fn(x, tq, ts, y)
    torch.cuda.synchronize()
    ref = x.double() @ torch_dequantize_q4(qw, sc, torch.float64).T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_tiled_source_exports_the_dequantization() -> None:
    """Every tiled module carries q4_g32_tiled_dequant, the name the runtime's prefill route looks up."""
    from ignis.runtime.linear import DEQUANT_FUNCTION_NAME

    src = tiled_source({"f": tiled_config_for(8, 1024, 1024, "sm_90")})
    assert '#include "q4_dequant.cuh"' in src and "IGNIS_Q4_DEQUANT_EXPORT()" in src
    header = (Path(q4_tiled_module.__file__).parent / "q4_dequant.cuh").read_text()
    assert f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({DEQUANT_FUNCTION_NAME}," in header


def _dequant_fn(tmp_path: Path) -> object:
    """q4_g32_tiled_dequant from the bundle (IGNIS_Q4T_BUNDLE) or a module built here with nvcc."""
    from ignis.runtime.kernels.tvm_runtime import load_module
    from ignis.runtime.linear import find_dequant

    folder = os.environ.get("IGNIS_Q4T_BUNDLE")
    if folder:
        man = json.loads((Path(folder) / "manifest.json").read_text())
        fn = find_dequant(load_module(Path(folder) / man["file"], cuda=True))
        if fn is None:
            pytest.skip(f"{folder}'s bundle predates q4_g32_tiled_dequant")
        return fn
    if not HAS_NVCC:
        pytest.skip("needs IGNIS_Q4T_BUNDLE (tools/build_gpu_modules.py) or nvcc")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    lib = build_q4_tiled_module(arch, {"f": tiled_config_for(8, 1024, 1024, arch)}, tmp_path / "q4t.so")
    fn = find_dequant(load_module(lib, cuda=True))
    assert fn is not None
    return fn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiled_dequant_kernel_equals_the_reference_bit_for_bit(tmp_path: Path) -> None:
    """The kernel's bf16 / f16 weights equal `dequantize_q4` of the row-major parts exactly (one
    rounding of an exact product), for N not a multiple of 16, one k-step, stacked weights and the
    vocabulary head; rows past N are not written (poisoned output checked)."""
    from ignis.runtime.kernels.tvm_runtime import torch_stream

    fn = _dequant_fn(tmp_path)
    gen = torch.Generator(device="cuda").manual_seed(5)
    cases = [((), 37, 128), ((), 1000, 1280), ((), 17408, 5120), ((3,), 100, 384), ((), 248320, 5120)]
    for lead, n, k in cases:
        qw = torch.randint(-(2**31), 2**31 - 1, (*lead, n, k // 8), device="cuda", generator=gen)
        qw = qw.to(torch.int32)
        sc = ((torch.rand(*lead, n, k // 32, device="cuda", generator=gen) + 0.5) / (4.6 * k**0.5)).half()
        tq, ts = tile_q4(qw, sc)
        t, s = tq.shape[-3], tq.shape[-2]
        for dtype in (torch.bfloat16, torch.float16):
            out = torch.full((*lead, n, k), float("nan"), dtype=dtype, device="cuda")
            with torch_stream():
                fn(tq.reshape(-1, t, s, 256), ts.reshape(-1, t, s, 64), out.view(-1, n, k))
            torch.cuda.synchronize()
            ref = torch_dequantize_q4(qw, sc, dtype)
            assert torch.equal(out, ref), (lead, n, k, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_backend_prefill_route_dequantizes_once(tmp_path: Path) -> None:
    """Above every compiled width, from DEQUANT_MIN_ROWS rows on, a tiled q4 linear runs as
    dequantize + one GEMM ("dequant" count) and equals the float64 product within bf16 GEMM rounding;
    below DEQUANT_MIN_ROWS it keeps the chunked compiled route."""
    from ignis.runtime.linear import DEQUANT_MIN_ROWS, CompiledLinears, LinearBackend, Q4Weight

    fn = _dequant_fn(tmp_path)
    fns, _arch = _bundle(tmp_path)
    n, k = 1024, 5120
    gen = torch.Generator(device="cuda").manual_seed(9)
    qw, sc, tq, ts = _cuda_q4(n, k, gen)
    table = {(8 * nt, "q4_g32_tiled", n, k, "bfloat16"): (f, True, True) for nt, f in fns.items()}
    backend = LinearBackend(CompiledLinears(table, sorted(w for w, *_ in table), dequant=fn))
    weight = Q4Weight(tq, ts, layout="tiled", rows=n)
    ref_w = torch_dequantize_q4(qw, sc, torch.float64)
    for rows in (DEQUANT_MIN_ROWS - 1, DEQUANT_MIN_ROWS, 2048):
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        before = dict(backend.counts)
        y = backend(x, weight)
        ref = x.double() @ ref_w.T
        err = (y.double() - ref).norm() / ref.norm()
        assert err < 1e-2, (rows, float(err))
        routed = backend.counts["dequant"] - before["dequant"]
        assert routed == (1 if rows >= DEQUANT_MIN_ROWS else 0), rows
