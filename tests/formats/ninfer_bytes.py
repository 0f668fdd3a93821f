"""Helpers for tests that edit .ninfer bytes: split a file into preamble fields and header, and
"reseal" an edited header (recompute its length and crc32) so that deeper checks are reached."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack

PRE = struct.Struct("<8sIIQQ")


def fields(data: bytes) -> dict[str, Any]:
    magic, version, crc, offset, length = PRE.unpack_from(data)
    return {"magic": magic, "version": version, "crc": crc, "offset": offset, "length": length}


def header(data: bytes) -> dict[str, Any]:
    f = fields(data)
    out: dict[str, Any] = msgpack.unpackb(data[f["offset"] : f["offset"] + f["length"]], raw=False)
    return out


def with_preamble(data: bytes, **changes: Any) -> bytes:
    f = fields(data) | changes
    return PRE.pack(f["magic"], f["version"], f["crc"], f["offset"], f["length"]) + data[PRE.size :]


def reseal(data: bytes, new_header: dict[str, Any] | bytes, *, header_offset: int | None = None) -> bytes:
    """Replace the header (a dict is packed with msgpack), keeping the data; fix length and crc32."""
    f = fields(data)
    raw = new_header if isinstance(new_header, bytes) else msgpack.packb(new_header, use_bin_type=True)
    body = data[: f["offset"]]
    if header_offset is not None:
        body = body[:header_offset] + bytes(max(0, header_offset - len(body)))
    off = len(body)
    out = body + raw
    return with_preamble(out, crc=zlib.crc32(raw), offset=off, length=len(raw))
