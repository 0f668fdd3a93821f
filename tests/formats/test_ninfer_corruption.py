"""Every corruption the issue and SPEC.md §5 list gives its own typed error naming the file, the
tensor and the byte offset."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from ninfer_bytes import fields, header, reseal, with_preamble

import ignis.formats.writer as writer_module
from ignis.formats import (
    MAX_HEADER_SIZE,
    BadMagicError,
    ChecksumMismatchError,
    DuplicateTensorError,
    FormatError,
    HeaderChecksumError,
    HeaderTooLargeError,
    MalformedHeaderError,
    MisalignedTensorError,
    NinferReader,
    NinferWriter,
    NonZeroPaddingError,
    OverlappingTensorsError,
    TensorGapError,
    TensorSizeError,
    TrailingBytesError,
    TruncatedFileError,
    UnknownDtypeError,
    UnsupportedVersionError,
    quantize_q4_g32,
)


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("valid") / "v.ninfer"
    with NinferWriter(path, metadata={"k": "v"}) as w:
        w.add_tensor("a", np.arange(1250, dtype=np.float32))  # 5000 bytes: two pages
        w.add_tensor("b", np.arange(10, dtype=np.int8))
        w.add_q4_g32("c", *quantize_q4_g32(np.ones((2, 64))))
    return path.read_bytes()


def open_bytes(tmp_path: Path, data: bytes) -> NinferReader:
    p = tmp_path / "bad.ninfer"
    p.write_bytes(data)
    return NinferReader(p)


def expect(tmp_path: Path, data: bytes, cls: type[FormatError], *, verify: bool = False) -> FormatError:
    with pytest.raises(FormatError) as info:
        r = open_bytes(tmp_path, data)
        if verify:
            r.verify()
    err = info.value
    assert type(err) is cls, f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    assert str(tmp_path / "bad.ninfer") in str(err)  # names the file
    return err


def edit(data: bytes, fn: Callable[[dict[str, Any]], None]) -> bytes:
    h = copy.deepcopy(header(data))
    fn(h)
    return reseal(data, h)


def entry(h: dict[str, Any], name: str) -> dict[str, Any]:
    e: dict[str, Any] = next(e for e in h["tensors"] if e["name"] == name)
    return e


# --- the cases the issue names ------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 5, 8, 31, 4096, 9000, -30, -1])
def test_truncated(tmp_path: Path, valid: bytes, cut: int) -> None:
    err = expect(tmp_path, valid[:cut], TruncatedFileError)
    assert err.offset == len(valid[:cut])


def test_bad_magic(tmp_path: Path, valid: bytes) -> None:
    expect(tmp_path, b"\x88" + valid[1:], BadMagicError)
    expect(tmp_path, b"PK\x03\x04 not a ninfer file at all" * 10, BadMagicError)
    expect(tmp_path, b"NINF", BadMagicError)  # short, and not a prefix of the magic


@pytest.mark.parametrize("version", [2, 0, 2**32 - 1])
def test_unsupported_version(tmp_path: Path, valid: bytes, version: int) -> None:
    err = expect(tmp_path, with_preamble(valid, version=version), UnsupportedVersionError)
    assert isinstance(err, UnsupportedVersionError) and err.version == version and err.offset == 8
    if version == 2:
        assert "newer" in str(err)


@pytest.mark.parametrize("length", [MAX_HEADER_SIZE + 1, 2**64 - 1])
def test_oversized_header(tmp_path: Path, valid: bytes, length: int) -> None:
    expect(tmp_path, with_preamble(valid, length=length), HeaderTooLargeError)


def test_writer_refuses_oversized_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "MAX_HEADER_SIZE", 100)
    with pytest.raises(HeaderTooLargeError), NinferWriter(tmp_path / "big.ninfer", metadata={"x": "y" * 200}):
        pass
    assert list(tmp_path.iterdir()) == []


def test_overlapping(tmp_path: Path, valid: bytes) -> None:
    def overlap(h: dict[str, Any]) -> None:
        entry(h, "b")["offset"] = entry(h, "a")["offset"] + 4096  # inside a's second page

    err = expect(tmp_path, edit(valid, overlap), OverlappingTensorsError)
    assert err.tensor == "b" and err.offset == 8192 and "'a'" in str(err)

    def into_preamble(h: dict[str, Any]) -> None:
        entry(h, "a")["offset"] = 0

    expect(tmp_path, edit(valid, into_preamble), OverlappingTensorsError)

    def past_header(h: dict[str, Any]) -> None:
        c = entry(h, "c")
        c["shape"], c["length"] = [2, 4096], 2 * (4096 // 2 + 4096 // 16)  # 4608 bytes: past the header

    err = expect(tmp_path, edit(valid, past_header), OverlappingTensorsError)
    assert err.tensor == "c" and "header" in str(err)


def test_misaligned(tmp_path: Path, valid: bytes) -> None:
    def shift(h: dict[str, Any]) -> None:
        entry(h, "b")["offset"] += 64

    err = expect(tmp_path, edit(valid, shift), MisalignedTensorError)
    assert err.tensor == "b" and err.offset == 12288 + 64


def test_duplicate_names(tmp_path: Path, valid: bytes) -> None:
    def dup(h: dict[str, Any]) -> None:
        entry(h, "b")["name"] = "a"
        entry(h, "c")["name"] = "a"

    err = expect(tmp_path, edit(valid, dup), DuplicateTensorError)
    assert isinstance(err, DuplicateTensorError) and err.names == ["a"] and err.tensor == "a"


def test_flipped_data_byte_under_verify(tmp_path: Path, valid: bytes) -> None:
    data = bytearray(valid)
    data[4096 + 4999] ^= 0x10  # last byte of "a"
    data[4 * 4096 + 7] ^= 0x01  # inside "c"
    r = open_bytes(tmp_path, bytes(data))  # opening does not read the data
    r.verify(["b"])
    err = expect(tmp_path, bytes(data), ChecksumMismatchError, verify=True)
    assert isinstance(err, ChecksumMismatchError) and err.mismatches == ["a", "c"]
    assert err.tensor == "a" and err.offset == 4096


def test_each_issue_case_has_its_own_error_type() -> None:
    kinds = [
        TruncatedFileError,
        BadMagicError,
        UnsupportedVersionError,
        HeaderTooLargeError,
        OverlappingTensorsError,
        MisalignedTensorError,
        DuplicateTensorError,
        ChecksumMismatchError,
    ]
    assert len(set(kinds)) == len(kinds)
    assert all(issubclass(k, FormatError) for k in kinds)
    assert not any(issubclass(a, b) for a in kinds for b in kinds if a is not b)


# --- the rest of SPEC.md §5 -----------------------------------------------------------------------------


def test_header_offset_rules(tmp_path: Path, valid: bytes) -> None:
    f = fields(valid)
    expect(tmp_path, with_preamble(valid, offset=f["offset"] + 1), MalformedHeaderError)
    expect(tmp_path, with_preamble(valid, offset=0), MalformedHeaderError)


def test_trailing_bytes(tmp_path: Path, valid: bytes) -> None:
    err = expect(tmp_path, valid + b"\0", TrailingBytesError)
    assert err.offset == len(valid)


def test_preamble_padding(tmp_path: Path, valid: bytes) -> None:
    data = bytearray(valid)
    data[100] = 1
    err = expect(tmp_path, bytes(data), NonZeroPaddingError)
    assert err.offset == 100


def test_padding_between_tensors_under_verify(tmp_path: Path, valid: bytes) -> None:
    data = bytearray(valid)
    data[4096 + 5000 + 10] = 0xFF  # after "a", before "b"
    open_bytes(tmp_path, bytes(data)).verify(check_padding=False)
    err = expect(tmp_path, bytes(data), NonZeroPaddingError, verify=True)
    assert err.offset == 4096 + 5010


def test_header_checksum(tmp_path: Path, valid: bytes) -> None:
    data = bytearray(valid)
    data[fields(valid)["offset"] + 5] ^= 0x40
    err = expect(tmp_path, bytes(data), HeaderChecksumError)
    assert err.offset == fields(valid)["offset"]


def _dup_key_map() -> bytes:
    # {"metadata": {}, "tensors": [], "tensors": []} -- msgpack decoders would silently keep one
    return b"\x83" + msgpack.packb("metadata") + b"\x80" + (msgpack.packb("tensors") + b"\x90") * 2


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never-used byte
        b"\x92\x80\x90",  # an array, not a map
        msgpack.packb({"metadata": {}, "tensors": []}) + b"\x00",  # extra data after the map
        msgpack.packb({"metadata": {}}),
        msgpack.packb({"metadata": {}, "tensors": [], "extra": 1}),
        msgpack.packb({"metadata": [], "tensors": []}),
        msgpack.packb({"metadata": {}, "tensors": {}}),
        msgpack.packb({"metadata": {1: 2}, "tensors": []}),
        msgpack.packb({"metadata": {"t": msgpack.ExtType(5, b"x")}, "tensors": []}),
        msgpack.packb({"metadata": {"t": msgpack.Timestamp(1)}, "tensors": []}),
        b"\x82\xa8metadata\x80\xa7tensors\x91\xa1\xff",  # invalid UTF-8
        _dup_key_map(),
        b"\x82\xa8metadata\x81\xa1k" + b"\x91" * 100_000 + b"\xc0\xa7tensors\x90",  # decoder stack
        b"\x82\xa8metadata\x81\xa1k" + b"\x91" * 33 + b"\xc0\xa7tensors\x90",  # deeper than 32
        b"\x82\xa8metadata\x80\xa7tensors\xdd\xff\xff\xff\xff",  # 2**32 - 1 entries claimed
    ],
)
def test_malformed_header(tmp_path: Path, valid: bytes, raw: bytes) -> None:
    expect(tmp_path, reseal(valid, raw, header_offset=4096), MalformedHeaderError)


@pytest.mark.parametrize(
    "key, value",
    [
        ("name", 7),
        ("name", ""),
        ("shape", "[10]"),
        ("shape", [-10]),
        ("shape", [True] * 10),
        ("offset", -1),
        ("offset", True),
        ("length", 1.5),
        ("crc32", 2**32),
        ("shape", [1] * 9),
    ],
)
def test_malformed_entry(tmp_path: Path, valid: bytes, key: str, value: Any) -> None:
    def change(h: dict[str, Any]) -> None:
        entry(h, "b")[key] = value

    expect(tmp_path, edit(valid, change), MalformedHeaderError)

    def extra(h: dict[str, Any]) -> None:
        entry(h, "b")["extra"] = 1

    expect(tmp_path, edit(valid, extra), MalformedHeaderError)


@pytest.mark.parametrize("dtype", ["f64", "Q4_G32", "", "q4_0"])
def test_unknown_dtype(tmp_path: Path, valid: bytes, dtype: str) -> None:
    def change(h: dict[str, Any]) -> None:
        entry(h, "b")["dtype"] = dtype

    err = expect(tmp_path, edit(valid, change), UnknownDtypeError)
    assert err.tensor == "b"
    assert err.offset is not None and f"byte offset {err.offset}" in str(err)  # the header's start


def test_negative_dimension_names_the_header_offset(tmp_path: Path, valid: bytes) -> None:
    def change(h: dict[str, Any]) -> None:
        entry(h, "b")["shape"] = [-1]

    err = expect(tmp_path, edit(valid, change), MalformedHeaderError)
    assert err.tensor == "b" and err.offset is not None and f"byte offset {err.offset}" in str(err)


def test_size_mismatches(tmp_path: Path, valid: bytes) -> None:
    def length(h: dict[str, Any]) -> None:
        entry(h, "b")["length"] = 11

    err = expect(tmp_path, edit(valid, length), TensorSizeError)
    assert err.tensor == "b"

    def q4_shape(h: dict[str, Any]) -> None:
        entry(h, "c")["shape"] = [4, 16]

    expect(tmp_path, edit(valid, q4_shape), TensorSizeError)

    def b_as_f32(h: dict[str, Any]) -> None:
        entry(h, "b")["dtype"] = "f32"

    expect(tmp_path, edit(valid, b_as_f32), TensorSizeError)


def test_gaps(tmp_path: Path, valid: bytes) -> None:
    def later(h: dict[str, Any]) -> None:
        entry(h, "b")["offset"] += 4096

    err = expect(tmp_path, edit(valid, later), TensorGapError)
    assert err.tensor == "b"
    f = fields(valid)
    raw = valid[f["offset"] :]
    moved = reseal(valid, raw, header_offset=f["offset"] + 4096)
    err = expect(tmp_path, moved, TensorGapError)
    assert "header" in str(err)

    def first_late(h: dict[str, Any]) -> None:
        for e in h["tensors"]:
            e["offset"] += 4096

    expect(tmp_path, edit(valid, first_late), TensorGapError)
