"""q4_g32 references against an independent float64 scalar reference, the bit layout, and SPEC.md's
worked example (the exact numbers printed there)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ignis.formats import (
    Q4G32Tensor,
    TensorSizeError,
    UsageError,
    dequantize_q4_g32,
    pack_q4_codes,
    quantize_q4_g32,
    unpack_q4_codes,
)


def reference_quantize(w: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """SPEC.md §4.1 in plain Python floats (float64), one value at a time: (codes, scale bits)."""
    rows = w.reshape(-1, w.shape[-1]).tolist()
    codes, scale_bits = [], []
    for row in rows:
        row_codes, row_scales = [], []
        for g in range(0, len(row), 32):
            group = row[g : g + 32]
            absmax = max(abs(x) for x in group)
            scale = float(np.float16(min(absmax / 7, 65504.0)))  # one rounding to f16, nearest even
            row_scales.append(int(np.array(scale, dtype=np.float16).view(np.uint16)))
            for x in group:
                q = 0 if scale == 0 else round(x / scale)  # Python's round: half to even
                row_codes.append(min(7, max(-8, q)) + 8)
        codes.append(row_codes)
        scale_bits.append(row_scales)
    return codes, scale_bits


def reference_pack(codes: list[int]) -> list[int]:
    """Nibble j of word c holds feature 8c + j."""
    return [sum(codes[8 * c + j] << (4 * j) for j in range(8)) for c in range(len(codes) // 8)]


def reference_dequantize(codes: list[int], scales: list[float]) -> list[float]:
    return [(q - 8) * scales[i // 32] for i, q in enumerate(codes)]


CASES = {
    "normal": np.random.default_rng(0).standard_normal((5, 96)),
    "3d": np.random.default_rng(1).standard_normal((2, 3, 64)) * 0.02,
    "zeros_and_tiny": np.concatenate(
        [np.zeros((2, 32)), np.full((2, 32), 1e-9), np.full((2, 32), 3e-7)], axis=1
    ),
    "huge_clamped": np.linspace(-1e6, 1e6, 64).reshape(1, 64),
    "ties": (np.arange(64).reshape(2, 32) - 16) * 0.5,  # many x / scale land near .5
    "float32": np.random.default_rng(2).standard_normal((3, 32)).astype(np.float32),
    "float16": np.random.default_rng(3).standard_normal((3, 32)).astype(np.float16),
    "one_sided": np.abs(np.random.default_rng(4).standard_normal((4, 32))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantize_matches_float64_reference_bit_exactly(case: str) -> None:
    w = CASES[case]
    packed, scales = quantize_q4_g32(w)
    n_in = w.shape[-1]
    assert packed.dtype == np.uint32 and packed.shape == (*w.shape[:-1], n_in // 8)
    assert scales.dtype == np.float16 and scales.shape == (*w.shape[:-1], n_in // 32)
    codes, scale_bits = reference_quantize(w)
    np.testing.assert_array_equal(scales.reshape(len(codes), -1).view(np.uint16), np.array(scale_bits))
    np.testing.assert_array_equal(unpack_q4_codes(packed).reshape(len(codes), -1), np.array(codes))
    np.testing.assert_array_equal(
        packed.reshape(len(codes), -1), np.array([reference_pack(c) for c in codes])
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_dequantize_is_exact_and_error_is_bounded(case: str) -> None:
    w = np.asarray(CASES[case], dtype=np.float64)
    packed, scales = quantize_q4_g32(w)
    out = dequantize_q4_g32(packed, scales)
    assert out.dtype == np.float32 and out.shape == w.shape
    codes, _ = reference_quantize(w)
    s64 = scales.astype(np.float64).reshape(len(codes), -1)
    ref = np.array([reference_dequantize(c, list(s)) for c, s in zip(codes, s64, strict=True)])
    np.testing.assert_array_equal(out.reshape(ref.shape).astype(np.float64), ref)  # exact, not close
    if case != "huge_clamped":
        # scale / 2; a group whose scale rounds to 0 in f16 has max|w| / 7 < 2**-25 and is stored as 0
        bound = np.repeat(np.where(s64 > 0, s64 / 2, 7 * 2.0**-25), 32, axis=1).reshape(w.shape)
        assert np.all(np.abs(out - w) <= bound)


def test_nibble_positions() -> None:
    for i in range(64):
        codes = np.zeros(64, dtype=np.uint8)
        codes[i] = 0xA
        words = pack_q4_codes(codes)
        expected = np.zeros(8, dtype=np.uint32)
        expected[i // 8] = 0xA << (4 * (i % 8))  # feature 8c + j in nibble j of word c
        np.testing.assert_array_equal(words, expected)
        assert words.astype("<u4").tobytes()[i // 2] == (0xA << 4 * (i % 2))  # little-endian bytes


def test_pack_unpack_round_trip_every_code() -> None:
    codes = np.random.default_rng(5).integers(0, 16, (7, 3, 64))
    np.testing.assert_array_equal(unpack_q4_codes(pack_q4_codes(codes)), codes)
    all_codes = np.arange(16).repeat(2).reshape(1, 32)
    np.testing.assert_array_equal(unpack_q4_codes(pack_q4_codes(all_codes)), all_codes)


def test_dequantize_accepts_code_0_and_negative_scales() -> None:
    # GGUF Q4_0 blocks use code 0 and negative scales (d = max / -8); readers must accept both.
    codes = np.arange(32).reshape(1, 32) % 16
    scales = np.array([[-0.25]], dtype=np.float16)
    out = dequantize_q4_g32(pack_q4_codes(codes), scales)
    np.testing.assert_array_equal(out, ((codes - 8) * -0.25).astype(np.float32))


def test_spec_worked_example() -> None:
    w = ((np.arange(32) - 16) / 16).reshape(1, 32)
    packed, scales = quantize_q4_g32(w)
    assert float(scales[0, 0]) == 0.142822265625 and int(scales.view(np.uint16)[0, 0]) == 0x3092
    codes = (
        "1 1 2 2 3 3 4 4 | 4 5 5 6 6 7 7 8 | 8 8 9 9 10 10 11 11 | 12 12 12 13 13 14 14 15"  # as in SPEC.md
    )
    assert unpack_q4_codes(packed).tolist() == [[int(c) for c in codes.split() if c != "|"]]
    assert [hex(x) for x in packed[0]] == ["0x44332211", "0x87766554", "0xbbaa9988", "0xfeeddccc"]
    stored = packed.astype("<u4").tobytes() + scales.astype("<f2").tobytes()
    assert stored.hex(" ") == "11 22 33 44 54 65 76 87 88 99 aa bb cc dc ed fe 92 30"
    out = dequantize_q4_g32(packed, scales)
    assert out[0, 0] == -0.999755859375 and out[0, 15] == 0 and out[0, 31] == 0.999755859375
    assert float(np.abs(out - w).max()) == 0.0712890625


def test_large_input_is_processed_in_chunks() -> None:
    w = np.random.default_rng(6).standard_normal((300, 8192)).astype(np.float32)  # > one chunk
    q = Q4G32Tensor.quantize(w)
    assert q.shape == w.shape
    head = Q4G32Tensor.quantize(w[:7])
    np.testing.assert_array_equal(q.packed[:7], head.packed)
    np.testing.assert_array_equal(q.dequantize()[-3:], Q4G32Tensor.quantize(w[-3:]).dequantize())


@pytest.mark.parametrize("shape", [(4, 48), (4, 0), (), (3, 16)])
def test_bad_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(TensorSizeError):
        quantize_q4_g32(np.zeros(shape))


def test_bad_inputs() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        w = np.zeros((2, 32))
        w[1, 3] = bad
        with pytest.raises(UsageError, match="non-finite"):
            quantize_q4_g32(w)
    with pytest.raises(UsageError):
        quantize_q4_g32(np.array([["a"] * 32]))
    with pytest.raises(UsageError):
        pack_q4_codes(np.full((1, 8), 16))
    with pytest.raises(TensorSizeError):
        pack_q4_codes(np.zeros((1, 7)))
    with pytest.raises(UsageError):
        dequantize_q4_g32(np.zeros((1, 4), np.int32), np.zeros((1, 1), np.float16))
    with pytest.raises(UsageError):
        dequantize_q4_g32(np.zeros((1, 4), np.uint32), np.zeros((1, 1), np.float32))
    with pytest.raises(TensorSizeError):
        dequantize_q4_g32(np.zeros((1, 4), np.uint32), np.zeros((1, 2), np.float16))
    with pytest.raises(TensorSizeError):
        Q4G32Tensor(np.zeros((2, 4), np.uint32), np.zeros((1, 1), np.float16))
