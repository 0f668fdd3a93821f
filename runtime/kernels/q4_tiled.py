"""The tiled q4_g32 layout the CUDA "tiled" kernel streams (`compiler/kernels/q4_tiled.cuh`).

The stored q4_g32 layout (`formats/q4.py`) is row-major: codes u32 ``[N, K/8]`` (nibble j of word c
= input feature 8c + j) and f16 scales ``[N, K/32]``. A verify-round kernel that reads it must pull
16 rows at a time in 64-byte pieces and re-order nibbles and activations in registers. The tiled
layout puts, for every tile of 16 output rows and every k-step of 128 input features, exactly the
bytes each lane of a warp consumes, in lane order, so one warp-wide 16-byte load per row half reads
512 contiguous bytes, and a tile's k-steps follow each other (a tile is one contiguous stream):

* codes u32 ``[*lead, T, S, 256]`` with T = ceil(N / 16) tiles, S = K / 128 k-steps. Within one
  (tile, k-step): word ``(h * 32 + lane) * 4 + w`` (h = 0, 1; lane = 4 g + t; w = 0..3) holds the
  8 codes of output row ``16 tile + g + 8 h`` at input features ``128 s + 32 w + 8 t + f``,
  f = 0..7, with feature f in nibble ``NIBBLE_OF_FEATURE[f]`` (nibbles f0 f2 f4 f6 f1 f3 f5 f7:
  the 0x6400 / 0x4300 exponent trick's pairs (n_i, n_{i+4}) are then consecutive features, which
  is what an ``mma.m16n8k16`` fragment wants; the idea is Marlin's, Frantar et al. 2024).
* scales f16 ``[*lead, T, S, 64]``: within one (tile, k-step), scale ``(g * 2 + h) * 4 + w`` is the
  scale of output row ``16 tile + g + 8 h`` for input features ``128 s + 32 w .. + 31`` (one group
  of 32), so the lane (g, t) reads its 8 scales as one 16-byte load.
* rows past N (the last tile's padding) have code 8 and scale 0: they dequantize to exactly 0.

The transform is a pure permutation of nibbles (plus the padding), done once when an artifact's
weights are placed on a CUDA device for the tiled kernels; `untile_q4` inverts it exactly.
Requires K % 128 == 0; a weight whose K is a multiple of 32 only is first padded with zero columns
to the next multiple of 128 (`pad_q4_columns`: code 8, scale 0, each dequantizing to exactly 0), so
that its product with activations padded by zero columns equals the unpadded product.
"""

from __future__ import annotations

import torch

__all__ = [
    "NIBBLE_OF_FEATURE",
    "STEP_K",
    "TILE_ROWS",
    "Q4TiledLayoutError",
    "pad_q4_columns",
    "q4_codes",
    "tile_q4",
    "tiled_shapes",
    "untile_q4",
]

TILE_ROWS = 16
STEP_K = 128
GROUP = 32
#: nibble position of feature f (0..7) within a tiled word.
NIBBLE_OF_FEATURE = (0, 4, 1, 5, 2, 6, 3, 7)


class Q4TiledLayoutError(ValueError):
    """The q4_g32 parts cannot be tiled (shape, dtype) or a tiled pair is malformed."""


def tiled_shapes(out_features: int, in_features: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(codes shape, scales shape) of the tiled layout of an [N, K] weight, without lead dims.

    Raises:
        Q4TiledLayoutError: K is not a positive multiple of 128, or N < 1.
    """
    if in_features <= 0 or in_features % STEP_K or out_features < 1:
        raise Q4TiledLayoutError(
            f"the tiled q4 layout needs in_features a positive multiple of {STEP_K} and out_features >= 1, "
            f"got [{out_features}, {in_features}]"
        )
    t = -(-out_features // TILE_ROWS)
    s = in_features // STEP_K
    return (t, s, 256), (t, s, 64)


#: A packed word of eight code-8 nibbles (each dequantizes to (8 - 8) * scale = 0), as int32 bits.
_ZERO_WORD = int(torch.tensor(0x88888888, dtype=torch.int64).to(torch.int32))


def pad_q4_columns(
    packed: torch.Tensor, scales: torch.Tensor, in_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major q4_g32 parts [*lead, N, K/8] / [*lead, N, K/32] widened to `in_features` input
    columns: the new columns hold code 8 with scale 0 (they dequantize to exactly +0), on the parts'
    device, the parts' dtypes. `in_features` == K returns the parts as they are.

    Raises:
        Q4TiledLayoutError: in_features is below K or not a multiple of 32.
    """
    k = int(packed.shape[-1]) * 8
    if in_features < k or in_features % GROUP:
        raise Q4TiledLayoutError(f"cannot pad a q4_g32 weight of in_features {k} to {in_features}")
    if in_features == k:
        return packed, scales
    extra = (in_features - k) // 8
    words = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed
    pad = words.new_full((*words.shape[:-1], extra), _ZERO_WORD)
    out = torch.cat([words, pad], dim=-1)
    out = out.view(torch.uint32) if packed.dtype == torch.uint32 else out
    sc = torch.cat([scales, scales.new_zeros((*scales.shape[:-1], (in_features - k) // GROUP))], dim=-1)
    return out, sc


def q4_codes(packed: torch.Tensor) -> torch.Tensor:
    """The q4 codes of packed words: u32/i32 [..., W] -> uint8 [..., 8 W] (code 8c + j = nibble j of
    word c), on packed's device."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    words = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed
    return ((words.unsqueeze(-1) >> shifts) & 15).to(torch.uint8).flatten(-2)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 8 W] (nibble j of word c = codes[8c + j]) -> int32 words [..., W]."""
    c = codes.to(torch.int32).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    # Bitwise OR of disjoint nibbles == sum (int32 wraps exactly like u32 bits for nibble 7).
    return (c << shifts).sum(dim=-1, dtype=torch.int32)


def tile_q4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-lay q4_g32 parts in the tiled layout (module docstring), on their device.

    Args:
        packed: uint32 or int32 [*lead, N, K/8] (row-major codes, `formats/q4.py`).
        scales: float16 [*lead, N, K/32].

    Returns:
        (codes, scales): ``packed``'s dtype [*lead, T, S, 256] and float16 [*lead, T, S, 64].

    Raises:
        Q4TiledLayoutError: the parts do not match, the dtypes are wrong, or K % 128 != 0.
    """
    if packed.dtype not in (torch.uint32, torch.int32) or scales.dtype != torch.float16:
        raise Q4TiledLayoutError(
            f"tile_q4 needs u32/i32 codes and f16 scales, got {packed.dtype}, {scales.dtype}"
        )
    if (
        packed.dim() < 2
        or packed.shape[:-1] != scales.shape[:-1]
        or packed.shape[-1] * 8 != scales.shape[-1] * 32
    ):
        raise Q4TiledLayoutError(
            f"tile_q4: codes {tuple(packed.shape)} and scales {tuple(scales.shape)} are not one q4_g32 weight"
        )
    lead = tuple(packed.shape[:-2])
    n, k = int(packed.shape[-2]), int(packed.shape[-1]) * 8
    (t, s, _), _ = tiled_shapes(n, k)
    pad = t * TILE_ROWS - n
    codes = q4_codes(packed)  # [*lead, N, K]
    sc = scales
    if pad:
        codes = torch.cat([codes, codes.new_full((*lead, pad, k), 8)], dim=-2)
        sc = torch.cat([sc, sc.new_zeros((*lead, pad, k // GROUP))], dim=-2)
    nl = len(lead)
    # rows 16 tile + 8 h + g, features 128 s + 32 w + 8 tt + f
    c = codes.reshape(*lead, t, 2, 8, s, 4, 4, 8)  # [.., tile, h, g, s, w, tt, f]
    # -> [.., tile, s, h, g, tt, w, f]  (lane = 4 g + tt)
    c = c.permute(*range(nl), nl + 0, nl + 3, nl + 1, nl + 2, nl + 5, nl + 4, nl + 6)
    order = torch.tensor(sorted(range(8), key=lambda f: NIBBLE_OF_FEATURE[f]), device=c.device)
    c = c.index_select(-1, order)  # nibble position p holds feature order[p]
    words = _words(c.reshape(*lead, t, s, 2 * 32 * 4 * 8))
    words = words.view(torch.uint32) if packed.dtype == torch.uint32 else words
    # scales: rows 16 tile + 8 h + g, groups 4 s + w  -> [.., tile, s, g, h, w]
    sv = sc.reshape(*lead, t, 2, 8, s, 4).permute(*range(nl), nl + 0, nl + 3, nl + 2, nl + 1, nl + 4)
    return words.reshape(*lead, t, s, 256).contiguous(), sv.reshape(*lead, t, s, 64).contiguous()


def untile_q4(
    codes: torch.Tensor, scales: torch.Tensor, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert `tile_q4`: the row-major parts [*lead, N, K/8] (codes' dtype) and [*lead, N, K/32] f16.

    Raises:
        Q4TiledLayoutError: the tiled parts are malformed (shapes, dtypes) or do not hold
            `out_features` rows.
    """
    if codes.dtype not in (torch.uint32, torch.int32) or scales.dtype != torch.float16:
        raise Q4TiledLayoutError(
            f"untile_q4 needs u32/i32 codes and f16 scales, got {codes.dtype}, {scales.dtype}"
        )
    if (
        codes.dim() < 3
        or codes.shape[-1] != 256
        or scales.shape[:-1] != codes.shape[:-1]
        or scales.shape[-1] != 64
    ):
        raise Q4TiledLayoutError(
            f"untile_q4: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} are not a tiled q4 pair"
        )
    lead = tuple(codes.shape[:-3])
    t, s = int(codes.shape[-3]), int(codes.shape[-2])
    if not (t - 1) * TILE_ROWS < out_features <= t * TILE_ROWS:
        raise Q4TiledLayoutError(f"untile_q4: {t} tiles cannot hold {out_features} rows")
    k = s * STEP_K
    nl = len(lead)
    nib = q4_codes(codes.reshape(*lead, t, s, 256))  # [.., t, s, 2048] in nibble order
    nib = nib.reshape(*lead, t, s, 2, 8, 4, 4, 8)  # [.., tile, s, h, g, tt, w, p]
    inv = torch.tensor(NIBBLE_OF_FEATURE, device=nib.device)
    nib = nib.index_select(-1, inv)  # feature f from nibble NIBBLE_OF_FEATURE[f]
    # -> [.., tile, h, g, s, w, tt, f]
    rows = nib.permute(*range(nl), nl + 0, nl + 2, nl + 3, nl + 1, nl + 5, nl + 4, nl + 6)
    rows = rows.reshape(*lead, t * TILE_ROWS, k)[..., :out_features, :]
    words = _words(rows)
    words = words.view(torch.uint32) if codes.dtype == torch.uint32 else words
    sv = scales.reshape(*lead, t, s, 8, 2, 4).permute(*range(nl), nl + 0, nl + 3, nl + 2, nl + 1, nl + 4)
    sv = sv.reshape(*lead, t * TILE_ROWS, k // GROUP)[..., :out_features, :]
    return words.contiguous(), sv.contiguous()
