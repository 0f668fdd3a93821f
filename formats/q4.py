"""q4_g32: the bit-exact numpy references for packing, unpacking, quantizing and dequantizing.

The layout (normative text and a worked example in `formats/SPEC.md`):

- A logical float tensor w of shape [*lead, in] (in a positive multiple of 32) is stored as two parts:
  `packed` u32 [*lead, in/8] and `scales` f16 [*lead, in/32].
- Code q (0..15) of feature i of a row is nibble `i % 8` (bits 4*(i%8) .. 4*(i%8)+3) of word `i // 8`,
  so nibble j of word c holds input feature 8c + j; words are little-endian u32.
- Feature i's value is `(q - 8) * scales[..., i // 32]`.

These functions are the references that kernels and importers are tested against; they work row
chunk by row chunk, so their temporary memory stays bounded whatever the tensor size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .constants import F16_MAX, Q4_GROUP_SIZE, Q4_MAX_ABS_CODE, Q4_VALUES_PER_WORD, Q4_ZERO_POINT
from .errors import TensorSizeError, UsageError

#: Elements processed per chunk (bounds the float64 temporaries to ~16 MiB each).
_CHUNK_ELEMENTS = 1 << 21

_SHIFTS = (np.arange(Q4_VALUES_PER_WORD, dtype=np.uint32) * 4).astype(np.uint32)


def _row_chunks(num_rows: int, row_len: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(1, row_len))
    for start in range(0, num_rows, step):
        yield slice(start, min(num_rows, start + step))


def _check_last_dim(shape: tuple[int, ...], what: str) -> int:
    if len(shape) < 1 or shape[-1] <= 0 or shape[-1] % Q4_GROUP_SIZE:
        raise TensorSizeError(
            f"{what} has shape {list(shape)}; q4_g32 needs rank >= 1 and a last (input) dimension that "
            f"is a positive multiple of {Q4_GROUP_SIZE}",
            path=None,
        )
    return shape[-1]


def pack_q4_codes(codes: npt.ArrayLike) -> npt.NDArray[np.uint32]:
    """Pack 4-bit codes along the last axis, eight per u32.

    Args:
        codes: integers 0..15, shape [*lead, in] with in a multiple of 8 (any integer dtype).

    Returns:
        uint32 [*lead, in/8], native byte order; word c of a row holds code 8c + j in bits 4j..4j+3.

    Raises:
        TensorSizeError: the last dimension is not a positive multiple of 8.
        UsageError: a code is outside 0..15.
    """
    c = np.asarray(codes)
    if c.ndim < 1 or c.shape[-1] <= 0 or c.shape[-1] % Q4_VALUES_PER_WORD:
        raise TensorSizeError(
            f"codes have shape {list(c.shape)}; the last dimension must be a positive multiple of 8",
            path=None,
        )
    if c.size and (int(c.min()) < 0 or int(c.max()) > 15):
        raise UsageError(f"4-bit codes must be 0..15, got {int(c.min())}..{int(c.max())}", path=None)
    words = c.astype(np.uint32).reshape(*c.shape[:-1], c.shape[-1] // Q4_VALUES_PER_WORD, Q4_VALUES_PER_WORD)
    packed: npt.NDArray[np.uint32] = np.bitwise_or.reduce(words << _SHIFTS, axis=-1).astype(np.uint32)
    return packed


def unpack_q4_codes(packed: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Unpack u32 words into 4-bit codes: the inverse of `pack_q4_codes`.

    Args:
        packed: uint32 [*lead, words] (either byte order).

    Returns:
        uint8 [*lead, 8 * words], codes 0..15.

    Raises:
        UsageError: `packed` is not uint32.
    """
    p = np.asarray(packed)
    if p.dtype.kind != "u" or p.dtype.itemsize != 4:
        raise UsageError(f"packed words must be uint32, got {p.dtype}", path=None)
    if p.ndim < 1:
        raise TensorSizeError("packed words must have rank >= 1", path=None)
    codes = (p.astype(np.uint32)[..., None] >> _SHIFTS) & np.uint32(0xF)
    out: npt.NDArray[np.uint8] = codes.astype(np.uint8).reshape(
        *p.shape[:-1], p.shape[-1] * Q4_VALUES_PER_WORD
    )
    return out


def quantize_q4_g32(w: npt.ArrayLike) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.float16]]:
    """Quantize a float matrix to q4_g32 (round to nearest, symmetric, scale = absmax / 7).

    For each group g of 32 consecutive input features of a row, in float64:
    `scale = float16(min(max|w_g| / 7, 65504))` (numpy's round-to-nearest-even conversion), then for
    each feature `q = clip(rint(w / scale), -8, 7) + 8` (`rint` rounds half to even) using the
    *stored* f16 scale; a group whose f16 scale is 0 (all zeros, or absmax < ~2e-7) gets q = 8.
    Codes 1..15 are produced (code 0 is valid in files, e.g. from GGUF Q4_0, but this quantizer never
    needs it); the clip only acts when the scale was clamped to the f16 maximum.

    Args:
        w: float [*lead, in] (usually [out, in]); any real float dtype; in a positive multiple of 32;
           every value finite.

    Returns:
        (packed uint32 [*lead, in/8], scales float16 [*lead, in/32]), native byte order.

    Raises:
        TensorSizeError: the last dimension is not a positive multiple of 32.
        UsageError: `w` holds NaN or infinity, or is not a real float/integer array.
    """
    a = np.asarray(w)
    if a.dtype.kind not in "fiu":
        raise UsageError(f"quantize_q4_g32 needs a real float array, got dtype {a.dtype}", path=None)
    n_in = _check_last_dim(a.shape, "w")
    lead = a.shape[:-1]
    rows = a.reshape(-1, n_in)
    num_rows = rows.shape[0]
    groups = n_in // Q4_GROUP_SIZE
    packed = np.empty((num_rows, n_in // Q4_VALUES_PER_WORD), dtype=np.uint32)
    scales = np.empty((num_rows, groups), dtype=np.float16)
    for sl in _row_chunks(num_rows, n_in):
        x = rows[sl].astype(np.float64).reshape(-1, groups, Q4_GROUP_SIZE)
        if not np.isfinite(x).all():
            bad = int(np.argwhere(~np.isfinite(x.reshape(-1, n_in)))[0][0]) + (sl.start or 0)
            raise UsageError(f"w holds a non-finite value (first in flattened row {bad})", path=None)
        absmax = np.abs(x).max(axis=-1)
        s16 = np.minimum(absmax / Q4_MAX_ABS_CODE, F16_MAX).astype(np.float16)
        s = s16.astype(np.float64)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s > 0, np.rint(x / np.where(s > 0, s, 1.0)), 0.0)
        codes = (np.clip(q, -Q4_ZERO_POINT, Q4_ZERO_POINT - 1) + Q4_ZERO_POINT).astype(np.uint8)
        packed[sl] = pack_q4_codes(codes.reshape(-1, n_in))
        scales[sl] = s16
    return packed.reshape(*lead, n_in // Q4_VALUES_PER_WORD), scales.reshape(*lead, groups)


def _check_parts(packed: np.ndarray, scales: np.ndarray) -> int:
    if packed.dtype.kind != "u" or packed.dtype.itemsize != 4:
        raise UsageError(f"packed must be uint32, got {packed.dtype}", path=None)
    if scales.dtype.kind != "f" or scales.dtype.itemsize != 2:
        raise UsageError(f"scales must be float16, got {scales.dtype}", path=None)
    ok = (
        packed.ndim >= 1
        and packed.ndim == scales.ndim
        and packed.shape[:-1] == scales.shape[:-1]
        and scales.shape[-1] > 0
        and packed.shape[-1] * Q4_VALUES_PER_WORD == scales.shape[-1] * Q4_GROUP_SIZE
    )
    if not ok:
        raise TensorSizeError(
            f"packed {list(packed.shape)} and scales {list(scales.shape)} do not describe one q4_g32 tensor: "
            f"need packed [*lead, in/8] and scales [*lead, in/32] with in > 0",
            path=None,
        )
    return int(scales.shape[-1]) * Q4_GROUP_SIZE


def dequantize_q4_g32(packed: npt.ArrayLike, scales: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Dequantize q4_g32: value of feature i = (q_i - 8) * scale[i // 32], exactly.

    The result is exact in float32 (a 4-bit integer times an f16 needs at most 15 significant bits),
    so it equals the float64 evaluation of the same formula.

    Args:
        packed: uint32 [*lead, in/8] (either byte order; a zero-copy reader view works).
        scales: float16 [*lead, in/32].

    Returns:
        float32 [*lead, in].

    Raises:
        UsageError: wrong dtypes.
        TensorSizeError: the shapes do not match each other.
    """
    p = np.asarray(packed)
    s = np.asarray(scales)
    n_in = _check_parts(p, s)
    lead = p.shape[:-1]
    p2 = p.reshape(-1, p.shape[-1])
    s2 = s.reshape(-1, s.shape[-1])
    out = np.empty((p2.shape[0], n_in), dtype=np.float32)
    for sl in _row_chunks(p2.shape[0], n_in):
        codes = unpack_q4_codes(p2[sl]).astype(np.int8) - np.int8(Q4_ZERO_POINT)
        vals = codes.astype(np.float32).reshape(-1, n_in // Q4_GROUP_SIZE, Q4_GROUP_SIZE)
        out[sl] = (vals * s2[sl].astype(np.float32)[..., None]).reshape(-1, n_in)
    return out.reshape(*lead, n_in)


@dataclass(frozen=True)
class Q4G32Tensor:
    """One q4_g32 tensor as its two stored parts (the reader returns zero-copy read-only views).

    Attributes:
        packed: uint32 [*lead, in/8]; nibble j of word c holds the code of input feature 8c + j.
        scales: float16 [*lead, in/32]; one scale per 32 consecutive input features.

    Raises (on construction):
        UsageError: wrong dtypes. TensorSizeError: shapes that do not describe one q4_g32 tensor.
    """

    packed: npt.NDArray[np.uint32]
    scales: npt.NDArray[np.float16]

    def __post_init__(self) -> None:
        _check_parts(self.packed, self.scales)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape [*lead, in]."""
        return (*self.scales.shape[:-1], self.scales.shape[-1] * Q4_GROUP_SIZE)

    @classmethod
    def quantize(cls, w: npt.ArrayLike) -> Q4G32Tensor:
        """`quantize_q4_g32(w)` wrapped: w float [*lead, in] -> Q4G32Tensor (see there)."""
        packed, scales = quantize_q4_g32(w)
        return cls(packed=packed, scales=scales)

    def dequantize(self) -> npt.NDArray[np.float32]:
        """A new float32 [*lead, in] array: (q - 8) * scale, exactly (see `dequantize_q4_g32`)."""
        return dequantize_q4_g32(self.packed, self.scales)


__all__ = ["Q4G32Tensor", "dequantize_q4_g32", "pack_q4_codes", "quantize_q4_g32", "unpack_q4_codes"]
