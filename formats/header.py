"""The header's schema: the tensor-table entry type, metadata validation, and header (de)serialisation.

Shared by the reader (which validates untrusted bytes) and the writer (which validates caller input
and serialises it canonically). Everything here is pure: no file access.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack  # type: ignore[import-untyped]

from .constants import (
    ALL_DTYPE_NAMES,
    DTYPES,
    ENCODINGS,
    HEADER_KEYS,
    MAX_INT,
    MAX_METADATA_DEPTH,
    MAX_NAME_BYTES,
    MAX_RANK,
    MIN_INT,
    TENSOR_KEYS,
    stored_length,
)
from .errors import (
    DuplicateTensorError,
    FormatError,
    MalformedHeaderError,
    TensorSizeError,
    UnknownDtypeError,
    with_offset,
)

#: A metadata value: msgpack's types less extension types; map keys are strings.
MetadataValue: TypeAlias = (
    bool | int | float | str | bytes | list["MetadataValue"] | dict[str, "MetadataValue"] | None
)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-table entry.

    Attributes:
        name: the tensor's name (unique in the file; UTF-8, 1..1024 bytes).
        dtype: a plain dtype ("f32", "f16", "bf16", "i8", "u8", "i32", "u32") or block encoding ("q4_g32").
        shape: the logical shape (for q4_g32 the dequantized shape [*lead, in]).
        offset: absolute byte offset of the tensor's first byte in the file (a multiple of 4096).
        length: bytes stored (for q4_g32 both parts: packed then scales).
        crc32: zlib crc32 of the `length` stored bytes (unsigned).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    crc32: int

    @property
    def is_block_encoded(self) -> bool:
        """True for block encodings (q4_g32), False for plain dtypes."""
        return self.dtype in ENCODINGS

    @property
    def end(self) -> int:
        """Absolute offset one past the tensor's last byte."""
        return self.offset + self.length

    def to_entry(self) -> dict[str, Any]:
        """The msgpack map written in the header (keys in canonical order)."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "length": self.length,
            "crc32": self.crc32,
        }


def check_name(
    name: object,
    *,
    path: str | os.PathLike[str] | None,
    where: str,
    error: type[FormatError] = MalformedHeaderError,
) -> str:
    """Validate a tensor name (a str of 1..1024 UTF-8 bytes); return it.

    Raises:
        `error` (MalformedHeaderError by default): it is not a string, is empty, too long, or not UTF-8.
    """
    if type(name) is not str:
        raise error(f"{where}: tensor name must be a string, got {type(name).__name__}", path=path)
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise error(f"{where}: tensor name {name!r} is not valid UTF-8 ({exc})", path=path) from None
    if not 1 <= n <= MAX_NAME_BYTES:
        raise error(
            f"{where}: tensor name must be 1..{MAX_NAME_BYTES} UTF-8 bytes, got {n}",
            path=path,
            tensor=name[:80],
        )
    return name


def check_dtype_and_shape(
    name: str,
    dtype: object,
    shape: object,
    *,
    path: str | os.PathLike[str] | None,
    error: type[FormatError] = MalformedHeaderError,
) -> tuple[str, tuple[int, ...]]:
    """Validate a dtype name and a logical shape for it; return them normalised.

    Raises:
        `error` (MalformedHeaderError by default): wrong types, negative dimensions, rank above MAX_RANK.
        UnknownDtypeError: the dtype/encoding name is not defined by v1.
        TensorSizeError: the shape is not valid for the block encoding.
    """
    if type(dtype) is not str:
        raise error(f"dtype must be a string, got {type(dtype).__name__}", path=path, tensor=name)
    if dtype not in ALL_DTYPE_NAMES:
        raise UnknownDtypeError(
            f"unknown dtype or encoding {dtype[:40]!r}; v1 defines {sorted(ALL_DTYPE_NAMES)}",
            path=path,
            tensor=name,
        )
    if type(shape) is not list and type(shape) is not tuple:
        raise error(f"shape must be a list, got {type(shape).__name__}", path=path, tensor=name)
    if len(shape) > MAX_RANK:
        raise error(f"rank {len(shape)} exceeds the maximum {MAX_RANK}", path=path, tensor=name)
    dims: list[int] = []
    for d in shape:
        if type(d) is not int or d < 0 or d > MAX_INT:
            raise error(f"shape {list(shape)!r} must hold non-negative integers", path=path, tensor=name)
        dims.append(d)
    if dtype in ENCODINGS:
        block = ENCODINGS[dtype].block_size
        if not dims or dims[-1] <= 0 or dims[-1] % block:
            raise TensorSizeError(
                f"{dtype} needs rank >= 1 and a last dimension that is a positive multiple of {block}; "
                f"shape is {dims}",
                path=path,
                tensor=name,
            )
    return dtype, tuple(dims)


def _uint(
    entry: Mapping[str, Any], key: str, name: str, path: str | os.PathLike[str] | None, top: int
) -> int:
    v = entry[key]
    if type(v) is not int or not 0 <= v <= top:
        raise MalformedHeaderError(f"{key} must be an integer in 0..{top}, got {v!r}", path=path, tensor=name)
    return v


def parse_tensor_entry(entry: object, index: int, *, path: str | os.PathLike[str]) -> TensorInfo:
    """Validate one decoded tensor-table entry; return its TensorInfo.

    Raises:
        MalformedHeaderError, UnknownDtypeError, TensorSizeError.
    """
    if type(entry) is not dict:
        raise MalformedHeaderError(
            f"tensor table entry {index} must be a map, got {type(entry).__name__}", path=path
        )
    keys = set(entry)
    if keys != set(TENSOR_KEYS):
        missing = sorted(set(TENSOR_KEYS) - keys)
        unexpected = sorted(map(repr, keys - set(TENSOR_KEYS)))
        raise MalformedHeaderError(
            f"tensor table entry {index}: missing keys {missing}, unexpected keys {unexpected}", path=path
        )
    name = check_name(entry["name"], path=path, where=f"tensor table entry {index}")
    dtype, shape = check_dtype_and_shape(name, entry["dtype"], entry["shape"], path=path)
    offset = _uint(entry, "offset", name, path, MAX_INT)
    length = _uint(entry, "length", name, path, MAX_INT)
    crc = _uint(entry, "crc32", name, path, 0xFFFFFFFF)
    expected = stored_length(dtype, shape)
    if length != expected:
        raise TensorSizeError(
            f"length is {length} bytes but {dtype} {list(shape)} needs {expected}",
            path=path,
            tensor=name,
            offset=offset,
        )
    return TensorInfo(name=name, dtype=dtype, shape=shape, offset=offset, length=length, crc32=crc)


def check_metadata(value: object, *, path: str | os.PathLike[str] | None, error: type[FormatError]) -> None:
    """Check that `value` is a metadata map: str keys; values of MetadataValue's types, nesting <= 32.

    Iterative (no recursion), so hostile nesting cannot exhaust the stack. Tuples count as lists.

    Raises:
        `error` (MalformedHeaderError in the reader, UsageError in the writer), naming the key path.
    """

    def fail(msg: str) -> None:
        raise error(msg, path=path)

    if type(value) is not dict:
        fail(f"metadata must be a map with string keys, got {type(value).__name__}")
    stack: list[tuple[object, str, int]] = [(value, "metadata", 0)]
    while stack:
        v, where, depth = stack.pop()
        t = type(v)
        if v is None or t is bool or t is float or t is str or t is bytes:
            continue
        if isinstance(v, int) and t is int:
            if not MIN_INT <= v <= MAX_INT:
                fail(f"{where}: integer {v} is outside msgpack's range [-2**63, 2**64 - 1]")
            continue
        if depth >= MAX_METADATA_DEPTH + 1:
            fail(f"{where}: nesting deeper than {MAX_METADATA_DEPTH} levels")
        if isinstance(v, (list, tuple)) and (t is list or t is tuple):
            for i, item in enumerate(v):
                stack.append((item, f"{where}[{i}]", depth + 1))
        elif isinstance(v, dict) and t is dict:
            for k, val in v.items():
                if type(k) is not str:
                    fail(f"{where}: map key {k!r} is not a string")
                stack.append((val, f"{where}[{k!r}]", depth + 1))
        else:
            fail(
                f"{where}: values of type {t.__name__} cannot be stored; use None, bool, int, float, str, "
                f"bytes, lists and maps with string keys (convert numpy scalars with .item())"
            )


def _pairs_to_dict(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for k, v in pairs:
        if type(k) is not str:
            raise ValueError(f"map key {k!r} is not a string")
        if k in out:
            raise ValueError(f"map key {k!r} repeats")
        out[k] = v
    return out


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def decode_header(
    raw: bytes, *, path: str | os.PathLike[str], offset: int
) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Decode and validate header bytes (the checksum is already checked); return (metadata, tensors).

    Only the schema is checked here (not the layout against the file).

    Raises:
        MalformedHeaderError: not one msgpack map, repeated map keys, unknown or missing keys, wrong
            types or ranges.
        UnknownDtypeError, TensorSizeError: from the tensor entries.
        DuplicateTensorError: names repeat (all duplicates are listed).
    """
    try:
        obj = msgpack.unpackb(
            raw,
            raw=False,
            use_list=True,
            strict_map_key=False,
            object_pairs_hook=_pairs_to_dict,
            ext_hook=_reject_ext,
            timestamp=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on bad input; all mean "malformed"
        raise MalformedHeaderError(
            f"header is not a valid msgpack document ({type(exc).__name__}: {str(exc)[:200]})",
            path=path,
            offset=offset,
        ) from None
    if type(obj) is not dict:
        raise MalformedHeaderError(
            f"header must be a msgpack map, got {type(obj).__name__}", path=path, offset=offset
        )
    if set(obj) != HEADER_KEYS:
        raise MalformedHeaderError(
            f"header keys are {sorted(map(repr, obj))}, expected exactly {sorted(HEADER_KEYS)}",
            path=path,
            offset=offset,
        )
    metadata = obj["metadata"]
    check_metadata(metadata, path=path, error=MalformedHeaderError)
    table = obj["tensors"]
    if type(table) is not list:
        raise MalformedHeaderError(
            f"'tensors' must be a list, got {type(table).__name__}", path=path, offset=offset
        )
    try:
        infos = [parse_tensor_entry(e, i, path=path) for i, e in enumerate(table)]
    except FormatError as exc:  # name the header's offset: the entry is somewhere in it
        if exc.offset is not None:
            raise
        raise with_offset(exc, offset) from exc
    seen: set[str] = set()
    dups: set[str] = set()
    for info in infos:
        if info.name in seen:
            dups.add(info.name)
        seen.add(info.name)
    if dups:
        names = sorted(dups)
        first = next(i for i in infos if i.name in dups)
        raise DuplicateTensorError(
            f"{len(names)} tensor name(s) appear more than once: {names[:20]}",
            path=path,
            names=names,
            tensor=first.name,
            offset=offset,
        )
    return metadata, infos


def encode_header(metadata: Mapping[str, Any], tensors: list[TensorInfo]) -> bytes:
    """Serialise the header canonically: metadata maps with keys sorted (recursively), tensor entries in
    storage order with keys in TENSOR_KEYS order, floats as float64, strings as str, bytes as bin.

    The caller has validated `metadata` with `check_metadata`.
    """
    header = {"metadata": _canonical(metadata), "tensors": [t.to_entry() for t in tensors]}
    out: bytes = msgpack.packb(header, use_bin_type=True, use_single_float=False, strict_types=False)
    return out


def _canonical(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _canonical(v[k]) for k in sorted(v)}
    if isinstance(v, (list, tuple)):
        return [_canonical(x) for x in v]
    return v


def dtype_table() -> dict[str, str]:
    """Every dtype/encoding name mapped to a one-line description (for help texts)."""
    out = {name: f"plain, {d.itemsize} byte(s) per element" for name, d in DTYPES.items()}
    for name, e in ENCODINGS.items():
        out[name] = "block encoding: " + " then ".join(p.name for p in e.parts)
    return out
