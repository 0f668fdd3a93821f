"""Opening stays bounded in time and memory for any header the spec allows (SPEC.md §2.4): hostile
headers up to the 64 MiB maximum are refused with MalformedHeaderError naming the file and the offending
byte offset, and a table or metadata at the limits opens. Shapes whose non-zero dimensions overflow
what numpy and torch can address are refused at open (and by the writer) with TensorSizeError."""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from ignis.formats import (
    MAX_HEADER_SIZE,
    MalformedHeaderError,
    NinferReader,
    NinferWriter,
    TensorSizeError,
    UsageError,
)
from ignis.formats.constants import MAX_METADATA_DEPTH, MAX_METADATA_VALUES, MAX_TENSORS

PRE = struct.Struct("<8sIIQQ")

#: Generous bound on the CPU seconds of one open (process time: a loaded machine does not inflate it);
#: before the limits existed the 16 MiB headers below took 15-40 s and gigabytes.
OPEN_SECONDS = 5.0


def container(path: Path, raw_header: bytes) -> Path:
    """A file with no tensor data and `raw_header` as its header (valid preamble and crc32)."""
    pre = PRE.pack(b"\x89NINFER\n", 1, zlib.crc32(raw_header), 4096, len(raw_header))
    path.write_bytes(pre + bytes(4096 - PRE.size) + raw_header)
    return path


def header_with_metadata(md: bytes, tensors: bytes = b"\x90") -> bytes:
    return b"\x82" + msgpack.packb("metadata") + md + msgpack.packb("tensors") + tensors


def array32(n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n)


def refuse(path: Path) -> MalformedHeaderError:
    t0 = time.process_time()
    with pytest.raises(MalformedHeaderError) as info:
        NinferReader(path)
    took = time.process_time() - t0
    assert took < OPEN_SECONDS, f"refusing took {took:.1f} s"
    err = info.value
    assert err.path == str(path)
    assert err.offset is not None and 4096 <= err.offset < 4096 + path.stat().st_size
    return err


N = 16 * 1024 * 1024  # 16 MiB of one-byte values


@pytest.mark.parametrize(
    "value",
    [b"\x90", b"\x80", b"\xc0", b"\x01"],
    ids=["empty arrays", "empty maps", "nils", "ints"],
)
def test_metadata_with_millions_of_values_is_refused_fast(tmp_path: Path, value: bytes) -> None:
    raw = header_with_metadata(b"\x81\xa1k" + array32(N) + value * N)
    err = refuse(container(tmp_path / "m.ninfer", raw))
    assert f"more than {MAX_METADATA_VALUES} values" in err.detail


def test_deep_nesting_is_refused_at_the_depth_limit(tmp_path: Path) -> None:
    raw = header_with_metadata(b"\x81\xa1k" + b"\x91" * N + b"\x90")
    err = refuse(container(tmp_path / "d.ninfer", raw))
    assert f"nesting deeper than {MAX_METADATA_DEPTH}" in err.detail
    # the offending array is the 33rd nested one: after the metadata map, its key "k" and 32 arrays
    metadata_at = 4096 + len(b"\x82" + msgpack.packb("metadata"))
    assert err.offset == metadata_at + 3 + MAX_METADATA_DEPTH


def test_header_of_the_maximum_size_is_refused_fast(tmp_path: Path) -> None:
    prefix = header_with_metadata(b"\x81\xa1k" + array32(2**32 - 1))
    raw = prefix + b"\x90" * (MAX_HEADER_SIZE - len(prefix))
    refuse(container(tmp_path / "max.ninfer", raw))


def test_table_longer_than_the_limit_is_refused_before_decoding(tmp_path: Path) -> None:
    err = refuse(container(tmp_path / "t.ninfer", header_with_metadata(b"\x80", array32(2**32 - 1))))
    assert f"the maximum is {MAX_TENSORS}" in err.detail
    assert err.offset == 4096 + len(header_with_metadata(b"\x80", b""))


def test_table_entry_with_a_huge_value_is_refused(tmp_path: Path) -> None:
    # a tree of arrays of 60 under "name": about 13 million values in one entry
    a60 = b"\xdc\x00\x3c"
    tree = a60 + (a60 + (a60 + (a60 + b"\xc0" * 60) * 60) * 60) * 60
    entry = b"\x86" + msgpack.packb("name") + tree
    raw = header_with_metadata(b"\x80", b"\x91" + entry)
    err = refuse(container(tmp_path / "e.ninfer", raw))
    assert "tensor table entry 0 holds more values" in err.detail
    assert err.offset == 4096 + len(raw) - len(entry)
    wide = b"\x86" + msgpack.packb("name") + b"\xdd\xff\xff\xff\xff" + b"\xc0" * 1000
    raw = header_with_metadata(b"\x80", b"\x91" + wide)
    err = refuse(container(tmp_path / "w.ninfer", raw))
    assert "tensor table entry 0" in err.detail and err.offset == 4096 + len(raw) - len(wide)


def entries(n: int) -> list[dict[str, Any]]:
    return [
        {"name": f"t{i}", "dtype": "u8", "shape": [0], "offset": 4096, "length": 0, "crc32": 0}
        for i in range(n)
    ]


def test_a_table_at_the_limit_opens_and_one_more_is_refused(tmp_path: Path) -> None:
    table = entries(MAX_TENSORS + 1)
    ok = container(tmp_path / "ok.ninfer", msgpack.packb({"metadata": {}, "tensors": table[:-1]}))
    t0 = time.process_time()
    with NinferReader(ok) as r:
        assert len(r) == MAX_TENSORS
        assert r.numpy(f"t{MAX_TENSORS - 1}").shape == (0,)
    assert time.process_time() - t0 < OPEN_SECONDS
    err = refuse(container(tmp_path / "over.ninfer", msgpack.packb({"metadata": {}, "tensors": table})))
    assert f"declares {MAX_TENSORS + 1} entries" in err.detail


def test_the_writer_and_the_reader_count_metadata_values_alike(tmp_path: Path) -> None:
    # root map (1) + key "k" (1) + the list (1) + its items
    items = MAX_METADATA_VALUES - 3
    with NinferWriter(tmp_path / "m.ninfer", metadata={"k": [0] * items}) as w:
        w.finish()
    with NinferReader(tmp_path / "m.ninfer") as r:
        assert len(r.metadata["k"]) == items  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="metadata would hold"):
        NinferWriter(tmp_path / "n.ninfer", metadata={"k": [0] * (items + 1)})
    w = NinferWriter(tmp_path / "n.ninfer", metadata={"k": [0] * items})
    with pytest.raises(UsageError, match="metadata would hold"):
        w.set_metadata("j", None)
    w.set_metadata("k", None)  # replacing the big value frees its count
    w.set_metadata("j", None)
    w.abort()
    raw = msgpack.packb({"metadata": {"k": [0] * (items + 1)}, "tensors": []})
    refuse(container(tmp_path / "over.ninfer", raw))


def test_the_writer_refuses_more_tensors_than_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ignis.formats.writer as writer_module

    monkeypatch.setattr(writer_module, "MAX_TENSORS", 2)
    with NinferWriter(tmp_path / "w.ninfer") as w:
        w.add_tensor("a", np.zeros(0, np.uint8))
        w.add_tensor("b", np.zeros(0, np.uint8))
        with pytest.raises(UsageError, match="at most 2 tensors"):
            w.add_tensor("c", np.zeros(0, np.uint8))


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("u8", [0, 2**63]), ("f32", [0, 2**62]), ("u8", [2**32, 0, 2**32]), ("q4_g32", [0, 2**61, 2**10])],
)
def test_empty_tensor_with_an_unaddressable_shape_is_refused_at_open(
    tmp_path: Path, dtype: str, shape: list[int]
) -> None:
    entry = {"name": "e", "dtype": dtype, "shape": shape, "offset": 4096, "length": 0, "crc32": 0}
    raw = msgpack.packb({"metadata": {}, "tensors": [entry]})
    path = container(tmp_path / "z.ninfer", raw)
    with pytest.raises(TensorSizeError, match="more than numpy and torch can address") as info:
        NinferReader(path)
    assert info.value.tensor == "e" and info.value.offset == 4096 + len(raw) - len(msgpack.packb(entry))
    with NinferWriter(tmp_path / "w.ninfer") as w, pytest.raises(TensorSizeError):
        w.add_tensor_chunks("e", dtype=dtype, shape=shape, chunks=[])


def test_empty_tensor_with_a_large_but_addressable_shape_opens(tmp_path: Path) -> None:
    entry = {"name": "e", "dtype": "f32", "shape": [0, 2**40], "offset": 4096, "length": 0, "crc32": 0}
    path = container(tmp_path / "z.ninfer", msgpack.packb({"metadata": {}, "tensors": [entry]}))
    with NinferReader(path) as r:
        assert r.numpy("e").shape == (0, 2**40)
        r.verify()
