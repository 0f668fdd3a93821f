"""Constants of the `.ninfer` container, v1: the one module that the reader and the writer both import.

Every number and name here is normative; `formats/SPEC.md` explains each one and why it was chosen.
Change a value here only together with `FORMAT_VERSION` and SPEC.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

# --- the preamble (bytes 0..32 of every file) -------------------------------------------------------

#: File magic, bytes 0..8. The high-bit first byte catches 7-bit channels, the final "\n" catches
#: line-ending conversion (the same trick as PNG's signature).
MAGIC: Final[bytes] = b"\x89NINFER\n"

#: The format version this code writes and the only one it reads (u32 little-endian, bytes 8..12).
FORMAT_VERSION: Final[int] = 1

#: The preamble: magic, version u32, header crc32 u32, header offset u64, header length u64.
PREAMBLE_STRUCT: Final[struct.Struct] = struct.Struct("<8sIIQQ")

#: Bytes in the preamble (32).
PREAMBLE_SIZE: Final[int] = PREAMBLE_STRUCT.size

# --- layout -----------------------------------------------------------------------------------------

#: Alignment in bytes of every tensor's offset and of the header's offset (one 4 KiB page).
ALIGNMENT: Final[int] = 4096

#: File offset of the first tensor's data (and of the header when there are no tensors).
DATA_START: Final[int] = ALIGNMENT

#: Largest header (msgpack bytes) a reader accepts and a writer writes: 64 MiB.
MAX_HEADER_SIZE: Final[int] = 64 * 1024 * 1024

#: Longest tensor name, in UTF-8 bytes.
MAX_NAME_BYTES: Final[int] = 1024

#: Largest tensor rank.
MAX_RANK: Final[int] = 8

#: Deepest nesting of lists and maps inside a metadata value (a scalar at top level is depth 0).
MAX_METADATA_DEPTH: Final[int] = 32

#: Most entries in the tensor table, so that a maximal table decodes fast (SPEC.md §2.3 has the cost)
#: and small; DeepSeek-V3 with every expert matrix unfused holds about 45,000 tensors.
MAX_TENSORS: Final[int] = 65_536

#: Most values in the metadata map, counting every scalar, array, map and map key (the top-level
#: map included). Large data belongs in `u8` tensors (the tokenizer is one), not in metadata.
MAX_METADATA_VALUES: Final[int] = 262_144

#: Largest byte size of a tensor's numpy view, with zero dimensions counted as one: an empty tensor
#: whose other dimensions multiply past this cannot be represented by numpy or torch (2**63 - 1).
MAX_TENSOR_BYTES: Final[int] = 2**63 - 1

#: Integers that msgpack can carry (metadata values and header fields).
MIN_INT: Final[int] = -(2**63)
MAX_INT: Final[int] = 2**64 - 1

# --- the header (msgpack map) -------------------------------------------------------------------------

#: Keys of the top-level header map, exactly these.
HEADER_KEYS: Final[frozenset[str]] = frozenset({"metadata", "tensors"})

#: Keys of each tensor-table entry, exactly these (written in this order).
TENSOR_KEYS: Final[tuple[str, ...]] = ("name", "dtype", "shape", "offset", "length", "crc32")


# --- dtypes and block encodings -----------------------------------------------------------------------


@dataclass(frozen=True)
class DType:
    """A plain element type: every element stored as one little-endian scalar, C order."""

    name: str  # the name written in the tensor table ("f32")
    numpy_dtype: str  # numpy dtype string, explicit little-endian ("<f4"); bf16 is read as raw "<u2" bits
    itemsize: int  # bytes per element
    torch_dtype: str  # attribute name in the torch module ("float32")


@dataclass(frozen=True)
class BlockPart:
    """One part of a block-encoded tensor: an array of shape [*lead, last_dim // features_per_element]."""

    name: str  # part name ("packed", "scales")
    numpy_dtype: str  # numpy dtype string of the part, explicit little-endian
    itemsize: int  # bytes per element of the part
    features_per_element: int  # input features (last logical dimension) covered by one element


@dataclass(frozen=True)
class BlockEncoding:
    """A block encoding: a logical [*lead, last_dim] tensor stored as parts, one after another.

    Every part covers the whole tensor (part 0 for all rows, then part 1 for all rows, ...); parts
    are contiguous with no padding between them.
    """

    name: str  # the name written in the tensor table ("q4_g32")
    block_size: int  # the last logical dimension must be a positive multiple of this
    parts: tuple[BlockPart, ...]  # the stored parts, in storage order

    def bytes_per_row(self, last_dim: int) -> int:
        """Stored bytes per row of `last_dim` logical features (all parts)."""
        return sum(last_dim // p.features_per_element * p.itemsize for p in self.parts)


#: The plain dtypes of v1, by table name.
DTYPES: Final[dict[str, DType]] = {
    d.name: d
    for d in (
        DType("f32", "<f4", 4, "float32"),
        DType("f16", "<f2", 2, "float16"),
        DType("bf16", "<u2", 2, "bfloat16"),
        DType("i8", "<i1", 1, "int8"),
        DType("u8", "<u1", 1, "uint8"),
        DType("i32", "<i4", 4, "int32"),
        DType("u32", "<u4", 4, "uint32"),
    )
}

#: q4_g32: group-wise 4-bit, one f16 scale per 32 consecutive input features, value = (q - 8) * scale;
#: eight 4-bit codes per little-endian u32 along the input dimension, nibble j of word c holding
#: input feature 8c + j. Stored as packed u32 [*lead, in/8] then scales f16 [*lead, in/32].
Q4_G32: Final[BlockEncoding] = BlockEncoding(
    name="q4_g32",
    block_size=32,
    parts=(BlockPart("packed", "<u4", 4, 8), BlockPart("scales", "<f2", 2, 32)),
)

#: The block encodings of v1, by table name.
ENCODINGS: Final[dict[str, BlockEncoding]] = {Q4_G32.name: Q4_G32}

#: Every name a tensor-table entry's "dtype" may hold.
ALL_DTYPE_NAMES: Final[frozenset[str]] = frozenset(DTYPES) | frozenset(ENCODINGS)

#: q4_g32 parameters, for the pack/unpack references.
Q4_GROUP_SIZE: Final[int] = 32  # input features per f16 scale
Q4_VALUES_PER_WORD: Final[int] = 8  # 4-bit codes per u32
Q4_ZERO_POINT: Final[int] = 8  # value = (q - 8) * scale
Q4_MAX_ABS_CODE: Final[int] = 7  # the quantizer's scale is absmax / 7; codes 1..15 are produced
F16_MAX: Final[float] = 65504.0  # largest finite float16


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """The smallest multiple of `alignment` (a power of two) that is >= n."""
    return (n + alignment - 1) & ~(alignment - 1)


def stored_length(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this table dtype (plain or block encoding) and logical shape occupies.

    The caller has checked that `dtype` is known and, for block encodings, that the last dimension
    is a positive multiple of the block size.
    """
    count = 1
    for dim in shape:
        count *= dim
    if dtype in DTYPES:
        return count * DTYPES[dtype].itemsize
    enc = ENCODINGS[dtype]
    last = shape[-1]
    return count // last * enc.bytes_per_row(last)
