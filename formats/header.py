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
    MAX_METADATA_VALUES,
    MAX_NAME_BYTES,
    MAX_RANK,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
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
        TensorSizeError: the shape is not valid for the block encoding, or its non-zero dimensions
            multiply past MAX_TENSOR_BYTES bytes (numpy and torch cannot represent it, even empty).
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
    for d in shape:
        if type(d) is not int or d < 0 or d > MAX_INT:
            raise error(f"shape {list(shape)!r} must hold non-negative integers", path=path, tensor=name)
    dims = tuple(shape)
    if dtype in ENCODINGS:
        block = ENCODINGS[dtype].block_size
        if not dims or dims[-1] <= 0 or dims[-1] % block:
            raise TensorSizeError(
                f"{dtype} needs rank >= 1 and a last dimension that is a positive multiple of {block}; "
                f"shape is {list(dims)}",
                path=path,
                tensor=name,
            )
    if 0 in dims:  # a non-empty shape's bytes are checked against its length and the file
        span = stored_length(dtype, tuple(d or 1 for d in dims))
        if span > MAX_TENSOR_BYTES:
            raise TensorSizeError(
                f"shape {list(dims)}: its non-zero dimensions span {span} bytes of {dtype}, more than numpy "
                f"and torch can address ({MAX_TENSOR_BYTES}), even when another dimension is 0",
                path=path,
                tensor=name,
            )
    return dtype, dims


_TENSOR_KEY_SET = frozenset(TENSOR_KEYS)


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
    if entry.keys() != _TENSOR_KEY_SET:
        keys = set(entry)
        missing = sorted(_TENSOR_KEY_SET - keys)
        unexpected = sorted(map(repr, keys - _TENSOR_KEY_SET))
        raise MalformedHeaderError(
            f"tensor table entry {index}: missing keys {missing}, unexpected keys {unexpected}", path=path
        )
    name = entry["name"]
    if type(name) is not str or not 0 < len(name) <= MAX_NAME_BYTES // 4:  # else the exact check
        name = check_name(name, path=path, where=f"tensor table entry {index}")
    dtype, shape = check_dtype_and_shape(name, entry["dtype"], entry["shape"], path=path)
    offset, length, crc = entry["offset"], entry["length"], entry["crc32"]
    if not (
        type(offset) is int
        and type(length) is int
        and type(crc) is int
        and 0 <= offset <= MAX_INT
        and 0 <= length <= MAX_INT
        and 0 <= crc <= 0xFFFFFFFF
    ):
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


def check_metadata(value: object, *, path: str | os.PathLike[str] | None, error: type[FormatError]) -> int:
    """Check that `value` is a metadata map: str keys; values of MetadataValue's types, nesting <= 32.

    Iterative (no recursion), so hostile nesting cannot exhaust the stack. Tuples count as lists.

    Returns:
        The number of values, as MAX_METADATA_VALUES counts them: every scalar, list, map and map key,
        `value` itself included. (The caller compares it with the limit.)

    Raises:
        `error` (MalformedHeaderError in the reader, UsageError in the writer), naming the key path.
    """

    def fail(msg: str) -> None:
        raise error(msg, path=path)

    if type(value) is not dict:
        fail(f"metadata must be a map with string keys, got {type(value).__name__}")
    stack: list[tuple[object, str, int]] = [(value, "metadata", 0)]
    count = 0
    while stack:
        v, where, depth = stack.pop()
        count += 1
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
            count += len(v)
            for k, val in v.items():
                if type(k) is not str:
                    fail(f"{where}: map key {k!r} is not a string")
                stack.append((val, f"{where}[{k!r}]", depth + 1))
        else:
            fail(
                f"{where}: values of type {t.__name__} cannot be stored; use None, bool, int, float, str, "
                f"bytes, lists and maps with string keys (convert numpy scalars with .item())"
            )
    return count


def _kind_table() -> tuple[str, ...]:
    kinds = ["int"] * 256  # positive and negative fixints, and the int/uint codes set below
    for b in range(0x80, 0x90):
        kinds[b] = "map"
    for b in range(0x90, 0xA0):
        kinds[b] = "array"
    for b in range(0xA0, 0xC0):
        kinds[b] = "str"
    named = {
        0xC0: "nil", 0xC1: "reserved", 0xC2: "bool", 0xC3: "bool", 0xC4: "bin", 0xC5: "bin", 0xC6: "bin",
        0xC7: "ext", 0xC8: "ext", 0xC9: "ext", 0xCA: "float", 0xCB: "float", 0xD4: "ext", 0xD5: "ext",
        0xD6: "ext", 0xD7: "ext", 0xD8: "ext", 0xD9: "str", 0xDA: "str", 0xDB: "str", 0xDC: "array",
        0xDD: "array", 0xDE: "map", 0xDF: "map",
    }  # fmt: skip
    for b, k in named.items():
        kinds[b] = k
    return tuple(kinds)


#: The msgpack kind of a value, by its first byte (the msgpack spec's format table).
_KIND: tuple[str, ...] = _kind_table()

#: Values one tensor-table entry may decode to (a valid one holds at most 1 + 12 + 8 = 21).
_ENTRY_BUDGET = 64


def _map_length(raw: bytes, pos: int, first: int) -> int:
    """The number of pairs the msgpack map at raw[pos] (first byte `first`) declares."""
    if first == 0xDE:
        return int.from_bytes(raw[pos + 1 : pos + 3], "big")
    if first == 0xDF:
        return int.from_bytes(raw[pos + 1 : pos + 5], "big")
    return first & 0x0F


class _HeaderLimit(Exception):
    """Raised by the decoder's hooks when a tensor-table entry holds too many values."""


class _Budget:
    """Counts the values of the tensor-table entry being decoded; the msgpack hooks spend it."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = _ENTRY_BUDGET

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise _HeaderLimit("holds more values than a tensor-table entry can")


def _map_hook(budget: _Budget) -> Any:
    def hook(d: dict[Any, Any]) -> dict[Any, Any]:
        budget.spend(2 * len(d) + 1)
        return d

    return hook


def _list_hook(budget: _Budget) -> Any:
    def hook(items: list[Any]) -> list[Any]:
        budget.spend(len(items) + 1)
        return items

    return hook


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not allowed")


class _HeaderDecoder:
    """Decodes the header's msgpack with every allocation bounded before it is made.

    The structure is walked with msgpack's streaming `Unpacker`: container headers are read without
    materialising their elements (`read_map_header` / `read_array_header`), the first byte of the
    next value is peeked to tell containers from scalars, and scalars are decoded one at a time. So
    the metadata costs one step per value, capped at MAX_METADATA_VALUES with nesting capped at
    MAX_METADATA_DEPTH as it is read; the table's length is checked against MAX_TENSORS before any
    entry is decoded, and each entry is decoded whole by msgpack with hooks that refuse it after
    `_ENTRY_BUDGET` values. Scalars cost at most their own bytes.
    """

    def __init__(self, raw: bytes, *, path: str | os.PathLike[str], offset: int) -> None:
        self.raw = raw
        self.path = path
        self.base = offset
        self.budget = _Budget()
        self.u = msgpack.Unpacker(
            raw=False,
            use_list=True,
            strict_map_key=True,  # only str/bytes keys; the metadata's keys are checked by peeking
            object_hook=_map_hook(self.budget),
            list_hook=_list_hook(self.budget),
            ext_hook=_reject_ext,
            timestamp=0,
            max_buffer_size=max(len(raw), 1),
            max_array_len=_ENTRY_BUDGET,
            max_map_len=_ENTRY_BUDGET,
        )
        self.u.feed(raw)

    def fail(self, msg: str, pos: int | None = None) -> MalformedHeaderError:
        where = self.base if pos is None else self.base + pos
        return MalformedHeaderError(msg, path=self.path, offset=where)

    def peek(self) -> tuple[int, str]:
        """(position in the header, msgpack kind) of the next value."""
        pos = self.u.tell()
        if pos >= len(self.raw):
            raise self.fail("the header ends inside a value (truncated msgpack)", pos)
        return pos, _KIND[self.raw[pos]]

    def key(self, where: str) -> str:
        pos, kind = self.peek()
        if kind != "str":
            raise self.fail(f"{where}: map key is a msgpack {kind}, not a string", pos)
        k: str = self.u.unpack()
        return k

    def decode(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        pos, kind = self.peek()
        if kind != "map":
            raise self.fail(f"header must be a msgpack map, got a msgpack {kind}", pos)
        n = self.u.read_map_header()
        if n != len(HEADER_KEYS):
            raise self.fail(f"header is a map of {n} keys, expected exactly {sorted(HEADER_KEYS)}", pos)
        metadata: dict[str, Any] | None = None
        infos: list[TensorInfo] | None = None
        for _ in range(n):
            kpos = self.u.tell()
            k = self.key("header")
            if k == "metadata" and metadata is None:
                metadata = self.metadata()
            elif k == "tensors" and infos is None:
                infos = self.tensors()
            else:
                raise self.fail(
                    f"header key {k[:80]!r} is unexpected or repeated; "
                    f"expected exactly {sorted(HEADER_KEYS)}",
                    kpos,
                )
        assert metadata is not None and infos is not None
        end = self.u.tell()
        if end != len(self.raw):
            raise self.fail(f"{len(self.raw) - end} byte(s) follow the header's msgpack map", end)
        return metadata, infos

    def metadata(self) -> dict[str, Any]:
        """Decode the metadata map iteratively, checking the value count and nesting as it goes."""
        pos, kind = self.peek()
        if kind != "map":
            raise self.fail(f"metadata must be a map with string keys, got a msgpack {kind}", pos)
        u, raw, kinds = self.u, self.raw, _KIND
        root: dict[str, Any] = {}
        count = 1
        # Frames: [container, entries left, depth, path for messages]; the root map is depth 0.
        stack: list[list[Any]] = [[root, u.read_map_header(), 0, "metadata"]]
        while stack:
            frame = stack[-1]
            if frame[1] == 0:
                stack.pop()
                continue
            frame[1] -= 1
            container, depth, where = frame[0], frame[2], frame[3]
            key: str | int
            if type(container) is dict:
                key = self.key(where)
                count += 1
                if key in container:
                    raise self.fail(f"{where}: map key {key[:80]!r} repeats", u.tell())
            else:
                key = len(container)
            count += 1
            if count > MAX_METADATA_VALUES:
                raise self.fail(
                    f"metadata holds more than {MAX_METADATA_VALUES} values (scalars, lists, maps and map "
                    f"keys); store large data as a u8 tensor",
                    u.tell(),
                )
            pos = u.tell()
            if pos >= len(raw):
                raise self.fail("the header ends inside the metadata (truncated msgpack)", pos)
            kind = kinds[raw[pos]]
            if kind == "map" or kind == "array":
                child = f"{where}[{key!r}]"
                if depth + 1 > MAX_METADATA_DEPTH:
                    raise self.fail(f"{child}: nesting deeper than {MAX_METADATA_DEPTH} levels", pos)
                value: Any
                if kind == "map":
                    value = {}
                    stack.append([value, u.read_map_header(), depth + 1, child])
                else:
                    value = []
                    stack.append([value, u.read_array_header(), depth + 1, child])
            elif kind == "ext":
                raise self.fail(f"{where}[{key!r}]: msgpack extension types are refused", pos)
            else:
                value = u.unpack()
            if type(container) is dict:
                container[key] = value
            else:
                container.append(value)
        return root

    def tensors(self) -> list[TensorInfo]:
        pos, kind = self.peek()
        if kind != "array":
            raise self.fail(f"'tensors' must be a list, got a msgpack {kind}", pos)
        n = self.u.read_array_header()
        if n > MAX_TENSORS:
            raise self.fail(f"the tensor table declares {n} entries; the maximum is {MAX_TENSORS}", pos)
        infos: list[TensorInfo] = []
        for i in range(n):
            pos = self.u.tell()
            self.budget.left = _ENTRY_BUDGET
            first = self.raw[pos] if pos < len(self.raw) else 0
            try:
                entry = self.u.unpack()
            except _HeaderLimit as exc:
                raise self.fail(f"tensor table entry {i} {exc} ({_ENTRY_BUDGET})", pos) from None
            except Exception as exc:  # msgpack's own errors (limits, bad bytes), several types
                detail = f"{type(exc).__name__}: {str(exc)[:200]}"
                raise self.fail(f"tensor table entry {i} is not a valid entry ({detail})", pos) from None
            if type(entry) is dict and len(entry) != _map_length(self.raw, pos, first):
                raise self.fail(f"tensor table entry {i} repeats a map key", pos)
            try:
                infos.append(parse_tensor_entry(entry, i, path=self.path))
            except FormatError as exc:  # name the entry's offset
                if exc.offset is not None:
                    raise
                raise with_offset(exc, self.base + pos) from exc
        return infos


def decode_header(
    raw: bytes, *, path: str | os.PathLike[str], offset: int
) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Decode and validate header bytes (the checksum is already checked); return (metadata, tensors).

    Only the schema is checked here (not the layout against the file). Time and memory are bounded
    for any input: the metadata holds at most MAX_METADATA_VALUES values nested at most
    MAX_METADATA_DEPTH deep, the table at most MAX_TENSORS entries, and each is refused as soon as
    it is exceeded, before the rest is decoded (see `_HeaderDecoder`).

    Raises:
        MalformedHeaderError: not one msgpack map, repeated map keys, unknown or missing keys, wrong
            types or ranges, a limit exceeded; `offset` is the file offset of the offending value.
        UnknownDtypeError, TensorSizeError: from the tensor entries.
        DuplicateTensorError: names repeat (all duplicates are listed).
    """
    dec = _HeaderDecoder(raw, path=path, offset=offset)
    try:
        metadata, infos = dec.decode()
    except FormatError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input; all mean "malformed"
        raise MalformedHeaderError(
            f"header is not a valid msgpack document ({type(exc).__name__}: {str(exc)[:200]})",
            path=path,
            offset=offset + min(dec.u.tell(), len(raw)),
        ) from None
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
