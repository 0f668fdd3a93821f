"""Round trips of every dtype and encoding through the .ninfer writer and reader, zero-copy views,
determinism, and the writer's refusals and failure behaviour (no file left behind)."""

from __future__ import annotations

import gc
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from ignis.formats import (
    ALIGNMENT,
    ContainerIOError,
    DuplicateTensorError,
    FormatError,
    NinferReader,
    NinferWriter,
    Q4G32Tensor,
    TensorNotFoundError,
    TensorSizeError,
    UnknownDtypeError,
    UsageError,
    quantize_q4_g32,
    write_ninfer,
)

RNG = np.random.default_rng(1234)

NUMPY_CASES = {
    "f32": RNG.standard_normal((3, 5)).astype(np.float32),
    "f16": RNG.standard_normal((7,)).astype(np.float16),
    "i8": RNG.integers(-128, 128, (2, 3, 4), dtype=np.int8),
    "u8": RNG.integers(0, 256, (9,), dtype=np.uint8),
    "i32": RNG.integers(-(2**31), 2**31, (4, 4), dtype=np.int32),
    "u32": RNG.integers(0, 2**32, (5,), dtype=np.uint32),
}

TORCH_DTYPES = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "i32": torch.int32,
    "u32": torch.uint32,
}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("dtype", sorted(NUMPY_CASES))
def test_round_trip_numpy_dtypes(tmp_path: Path, dtype: str) -> None:
    data = NUMPY_CASES[dtype]
    path = write_ninfer(tmp_path / "x.ninfer", {"t": data})
    with NinferReader(path) as r:
        info = r.info("t")
        assert (info.dtype, info.shape, info.length) == (dtype, data.shape, data.nbytes)
        assert info.offset % ALIGNMENT == 0
        view = r.numpy("t")
        assert view.dtype == data.dtype.newbyteorder("<") and view.shape == data.shape
        np.testing.assert_array_equal(view, data)
        assert not view.flags.writeable
        assert np.shares_memory(view, r.raw("t"))  # a view into the mapping, not a copy
        t = r.torch("t")
        assert t.dtype == TORCH_DTYPES[dtype] and tuple(t.shape) == data.shape
        assert t.data_ptr() == view.ctypes.data  # zero-copy
        assert torch.equal(t, torch.from_numpy(data.copy()))
        r.verify()


def test_round_trip_bf16_from_torch_numpy_bits_and_ml_dtypes(tmp_path: Path) -> None:
    src = torch.randn(6, 10).to(torch.bfloat16)
    bits = src.view(torch.int16).numpy().view(np.uint16).copy()
    with NinferWriter(tmp_path / "b.ninfer") as w:
        w.add_tensor("from_torch", src)
        w.add_tensor("from_bits", bits, dtype="bf16")
        ml_dtypes = pytest.importorskip("ml_dtypes")
        w.add_tensor("from_ml_dtypes", bits.view(ml_dtypes.bfloat16))
    with NinferReader(tmp_path / "b.ninfer") as r:
        for name in ("from_torch", "from_bits", "from_ml_dtypes"):
            assert r.info(name).dtype == "bf16"
            np.testing.assert_array_equal(r.numpy(name), bits)  # numpy: raw bits as uint16
            t = r.torch(name)
            assert t.dtype == torch.bfloat16
            assert t.data_ptr() == r.numpy(name).ctypes.data  # zero-copy reinterpretation
            assert torch.equal(t, src)


@pytest.mark.parametrize("shape", [(4, 64), (1, 32), (2, 3, 96), (32,), (0, 32)])
def test_round_trip_q4_g32(tmp_path: Path, shape: tuple[int, ...]) -> None:
    w = RNG.standard_normal(shape)
    packed, scales = quantize_q4_g32(w)
    with NinferWriter(tmp_path / "q.ninfer") as wr:
        info = wr.add_q4_g32("q", packed, scales)
    assert info.dtype == "q4_g32" and info.shape == shape
    assert info.length == packed.nbytes + scales.nbytes
    with NinferReader(tmp_path / "q.ninfer") as r:
        q = r.q4_g32("q")
        assert q.shape == shape
        assert q.packed.dtype == np.dtype("<u4") and q.scales.dtype == np.dtype("<f2")
        np.testing.assert_array_equal(q.packed, packed)
        np.testing.assert_array_equal(q.scales, scales)
        np.testing.assert_array_equal(q.dequantize(), Q4G32Tensor(packed, scales).dequantize())
        if q.packed.size:
            assert np.shares_memory(q.packed, r.raw("q")) and np.shares_memory(q.scales, r.raw("q"))
            assert q.scales.ctypes.data % 16 == 0
        parts = r.torch_parts("q")
        assert parts["packed"].dtype == torch.uint32 and parts["scales"].dtype == torch.float16
        assert torch.equal(parts["scales"], torch.from_numpy(scales))
        with pytest.raises(UsageError):
            r.numpy("q")
        with pytest.raises(UsageError):
            r.torch("q")
        r.verify()


def test_shapes_metadata_and_order(tmp_path: Path) -> None:
    meta = {
        "z": None,
        "a": {"nested": [1, -2, 2**64 - 1, -(2**63), 1.5, True, "s", b"\x00\xff", [], {}]},
        "tuple": (1, 2),
        "unicode": "ключ ✓",
    }
    arrays = {
        "scalar": np.array(7, dtype=np.int32),
        "empty": np.zeros((3, 0, 2), dtype=np.float32),
        "after_empty": np.ones(3, dtype=np.float16),
        "rank8": np.arange(256, dtype=np.uint8).reshape((2,) * 8),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "big_endian": np.arange(5, dtype=">i4"),
        "strided": np.arange(20, dtype=np.int8)[::2],
    }
    path = write_ninfer(tmp_path / "m.ninfer", arrays, metadata=meta)
    with NinferReader(path) as r:
        assert list(r) == list(arrays)
        assert len(r) == len(arrays) and "scalar" in r and "nope" not in r
        for name, a in arrays.items():
            np.testing.assert_array_equal(r.numpy(name), a)
            assert r.numpy(name).shape == a.shape
        expected = dict(meta, tuple=[1, 2])
        assert r.metadata == expected
        assert r.info("after_empty").offset == r.info("empty").offset  # zero-length: no bytes
        r.verify()


def test_empty_container(tmp_path: Path) -> None:
    path = write_ninfer(tmp_path / "e.ninfer", {})
    assert os.path.getsize(path) > ALIGNMENT
    with NinferReader(path) as r:
        assert len(r) == 0 and r.metadata == {} and r.header_offset == ALIGNMENT
        r.verify()


def test_same_input_same_bytes(tmp_path: Path) -> None:
    arrays = {"b": np.arange(10, dtype=np.float32), "a": np.arange(3, dtype=np.uint8)}
    write_ninfer(tmp_path / "1.ninfer", arrays, metadata={"x": 1, "y": {"q": 2, "p": 3}})
    write_ninfer(tmp_path / "2.ninfer", arrays, metadata={"y": {"p": 3, "q": 2}, "x": 1})  # other key order
    assert (tmp_path / "1.ninfer").read_bytes() == (tmp_path / "2.ninfer").read_bytes()


def test_chunked_stream_equals_whole_array(tmp_path: Path) -> None:
    a = RNG.standard_normal((64, 33)).astype(np.float32)
    raw = a.tobytes()
    with NinferWriter(tmp_path / "c.ninfer") as w:
        w.add_tensor_chunks(
            "t",
            dtype="f32",
            shape=[np.int64(64), 33],
            chunks=(raw[i : i + 1000] for i in range(0, len(raw), 1000)),
        )
    write_ninfer(tmp_path / "d.ninfer", {"t": a})
    assert (tmp_path / "c.ninfer").read_bytes() == (tmp_path / "d.ninfer").read_bytes()


def test_views_outlive_close_and_closed_reader_refuses(tmp_path: Path) -> None:
    path = write_ninfer(tmp_path / "v.ninfer", {"t": np.arange(4, dtype=np.float32)})
    r = NinferReader(path)
    v = r.numpy("t")
    r.close()
    r.close()  # idempotent
    np.testing.assert_array_equal(v, np.arange(4, dtype=np.float32))
    with pytest.raises(UsageError, match="closed"):
        r.numpy("t")
    with pytest.raises(TensorNotFoundError, match="'missing'"):
        NinferReader(path).info("missing")


def test_torch_writes_never_reach_the_file(tmp_path: Path) -> None:
    path = write_ninfer(tmp_path / "w.ninfer", {"t": np.zeros(4, dtype=np.float32)})
    before = Path(path).read_bytes()
    with NinferReader(path) as r:
        r.torch("t").fill_(1.0)  # private copy-on-write mapping
    assert Path(path).read_bytes() == before
    with NinferReader(path) as r:
        r.verify()


# --- writer refusals and failures -------------------------------------------------------------------


def test_writer_refuses_duplicates_and_stays_usable(tmp_path: Path) -> None:
    with NinferWriter(tmp_path / "d.ninfer") as w:
        w.add_tensor("t", np.zeros(2, np.float32))
        with pytest.raises(DuplicateTensorError, match="'t'"):
            w.add_tensor("t", np.zeros(2, np.float32))
        with pytest.raises(DuplicateTensorError):
            w.add_q4_g32("t", *quantize_q4_g32(np.zeros((1, 32))))
        w.add_tensor("u", np.ones(2, np.float32))
    with NinferReader(tmp_path / "d.ninfer") as r:
        assert list(r) == ["t", "u"]
        r.verify()


@pytest.mark.parametrize("dtype", ["f64", "q8_0", "int4", "F32", ""])
def test_writer_refuses_unknown_dtypes(tmp_path: Path, dtype: str) -> None:
    with NinferWriter(tmp_path / "u.ninfer") as w:
        with pytest.raises(UnknownDtypeError):
            w.add_tensor("t", np.zeros(2, np.float32), dtype=dtype)
        with pytest.raises(UnknownDtypeError):
            w.add_tensor_chunks("t", dtype=dtype, shape=[1], chunks=[b"\0"])
    with NinferReader(tmp_path / "u.ninfer") as r:
        assert len(r) == 0


@pytest.mark.parametrize(
    "data, dtype",
    [
        (np.zeros(2, np.float64), None),
        (np.zeros(2, np.int64), None),
        (np.zeros(2, bool), None),
        (np.zeros(2, np.uint16), None),
        (np.zeros(2, np.float32), "f16"),
        (np.zeros((1, 32), np.float32), "q4_g32"),
        ([1.0, 2.0], None),
        (torch.zeros(2, dtype=torch.float64), None),
    ],
)
def test_writer_refuses_data_that_does_not_match(tmp_path: Path, data: object, dtype: str | None) -> None:
    with NinferWriter(tmp_path / "x.ninfer") as w, pytest.raises(UsageError):
        w.add_tensor("t", data, dtype=dtype)


@pytest.mark.parametrize(
    "meta",
    [{"k": np.float32(1)}, {"k": {1: 2}}, {"k": 2**64}, {"k": {1.5}}, {"k": object()}, {1: "x"}],
)
def test_writer_refuses_bad_metadata(tmp_path: Path, meta: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(UsageError):
        NinferWriter(tmp_path / "m.ninfer", metadata=meta)
    assert leftovers(tmp_path) == []
    with NinferWriter(tmp_path / "m.ninfer") as w:
        for k, v in meta.items():
            with pytest.raises(UsageError):
                w.set_metadata(k, v)


def test_writer_refuses_deep_metadata(tmp_path: Path) -> None:
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(UsageError, match="nesting"):
        NinferWriter(tmp_path / "m.ninfer", metadata={"deep": deep})


@pytest.mark.parametrize("name", ["", "x" * 1025, "\ud800"])
def test_writer_refuses_bad_names(tmp_path: Path, name: str) -> None:
    with NinferWriter(tmp_path / "n.ninfer") as w, pytest.raises(UsageError):
        w.add_tensor(name, np.zeros(1, np.float32))


def test_writer_q4_shape_errors(tmp_path: Path) -> None:
    with NinferWriter(tmp_path / "q.ninfer") as w:
        with pytest.raises(TensorSizeError):
            w.add_tensor_chunks("q", dtype="q4_g32", shape=[2, 48], chunks=[])
        with pytest.raises(TensorSizeError):
            w.add_q4_g32("q", np.zeros((2, 4), np.uint32), np.zeros((2, 2), np.float16))
        with pytest.raises(UsageError):
            w.add_q4_g32("q", np.zeros((2, 4), np.int32), np.zeros((2, 1), np.float16))


def test_chunk_errors_roll_back_the_partial_tensor(tmp_path: Path) -> None:
    def failing():  # type: ignore[no-untyped-def]
        yield b"\1" * 5000
        raise RuntimeError("converter failed")

    with NinferWriter(tmp_path / "r.ninfer") as w:
        w.add_tensor("a", np.arange(3, dtype=np.uint8))
        with pytest.raises(RuntimeError, match="converter failed"):
            w.add_tensor_chunks("b", dtype="u8", shape=[8000], chunks=failing())
        with pytest.raises(UsageError, match="more than"):
            w.add_tensor_chunks("b", dtype="u8", shape=[4], chunks=[b"12345"])
        with pytest.raises(UsageError, match="hold 3 bytes"):
            w.add_tensor_chunks("b", dtype="u8", shape=[4], chunks=[b"123"])
        w.add_tensor("b", np.arange(4, dtype=np.uint8))
    expected = write_ninfer(
        tmp_path / "e.ninfer", {"a": np.arange(3, dtype=np.uint8), "b": np.arange(4, dtype=np.uint8)}
    )
    assert (tmp_path / "r.ninfer").read_bytes() == Path(expected).read_bytes()


def test_exception_in_with_block_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(KeyError), NinferWriter(tmp_path / "x.ninfer") as w:
        w.add_tensor("t", np.zeros(1000, np.float32))
        assert len(leftovers(tmp_path)) == 1  # the temporary file, hidden name
        assert leftovers(tmp_path)[0].startswith(".x.ninfer.")
        raise KeyError("boom")
    assert leftovers(tmp_path) == []
    assert w.state == "aborted"
    with pytest.raises(UsageError, match="aborted"):
        w.add_tensor("u", np.zeros(1, np.float32))


def test_abandoned_writer_removes_its_temporary_file(tmp_path: Path) -> None:
    w = NinferWriter(tmp_path / "x.ninfer")
    w.add_tensor("t", np.zeros(10, np.float32))
    del w
    gc.collect()
    assert leftovers(tmp_path) == []


def test_failed_writer_keeps_the_old_file(tmp_path: Path) -> None:
    old = write_ninfer(tmp_path / "x.ninfer", {"old": np.zeros(1, np.float32)})
    before = Path(old).read_bytes()
    with pytest.raises(ValueError), NinferWriter(old) as w:
        w.add_tensor("new", np.ones(1, np.float32))
        raise ValueError
    assert Path(old).read_bytes() == before and leftovers(tmp_path) == ["x.ninfer"]
    write_ninfer(old, {"new": np.ones(1, np.float32)})  # a successful writer replaces it
    with NinferReader(old) as r:
        assert list(r) == ["new"]
    assert leftovers(tmp_path) == ["x.ninfer"]


def test_finish_twice_and_missing_directory(tmp_path: Path) -> None:
    w = NinferWriter(tmp_path / "f.ninfer")
    assert w.finish() == str(tmp_path / "f.ninfer")
    assert w.state == "finished"
    with pytest.raises(UsageError, match="finished"):
        w.finish()
    w.abort()  # no-op once finished
    assert (tmp_path / "f.ninfer").exists()
    with pytest.raises(ContainerIOError):
        NinferWriter(tmp_path / "no" / "such" / "dir.ninfer")


def test_reader_refuses_directories_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ContainerIOError, match="directory"):
        NinferReader(tmp_path)
    with pytest.raises(ContainerIOError, match="cannot open"):
        NinferReader(tmp_path / "missing.ninfer")


def test_errors_name_file_tensor_offset_and_pickle() -> None:
    e = DuplicateTensorError("twice", path="/a/b.ninfer", names=["x"], tensor="x", offset=4096)
    assert str(e) == "/a/b.ninfer, tensor 'x', byte offset 4096: twice"
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is DuplicateTensorError and str(e2) == str(e) and e2.names == ["x"]
    assert isinstance(e2, FormatError)
