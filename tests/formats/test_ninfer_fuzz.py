"""Property test: random mutations and truncations of a valid .ninfer file make the reader raise only
`FormatError` subclasses (or succeed), never another exception, a crash or a hang.

Three generators: raw byte edits anywhere (mostly caught by the preamble checks and the header crc32),
byte edits inside the header with the crc32 recomputed ("resealed", so the msgpack decoder and the schema
checks see them), and structural edits of decoded header fields with random msgpack values. Whenever a
file opens, every view, every torch tensor and `verify` are exercised too. Seeded (derandomized) so CI
is reproducible; about 10 s on a 2-core box.
"""

from __future__ import annotations

import copy
import faulthandler
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ninfer_bytes import fields, header, reseal, with_preamble

from ignis.formats import DTYPES, ENCODINGS, FormatError, NinferReader, NinferWriter, quantize_q4_g32

SETTINGS = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", autouse=True)
def hang_guard() -> Iterator[None]:
    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails loudly instead of stalling CI
    yield
    faulthandler.cancel_dump_traceback_later()


_DIR = tempfile.TemporaryDirectory(prefix="ninfer-fuzz-")
_WORK = Path(_DIR.name)


def _valid() -> bytes:
    path = _WORK / "valid.ninfer"
    with NinferWriter(path, metadata={"family": "llama", "cfg": {"n": [1, 2.5, None, True, b"x"]}}) as w:
        w.add_tensor("f32", np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
        w.add_tensor("bf16", np.arange(6, dtype=np.uint16) + 0x3F80, dtype="bf16")
        w.add_q4_g32("q4", *quantize_q4_g32(np.linspace(-2, 2, 128).reshape(2, 64)))
        w.add_tensor("empty", np.zeros((0, 4), dtype=np.int8))
        w.add_tensor("scalar", np.array(7, dtype=np.int32))
    return path.read_bytes()


VALID = _valid()
HEADER_OFFSET = fields(VALID)["offset"]
HEADER = header(VALID)


def exercise(data: bytes) -> None:
    """Open `data` as a file; if it opens, touch everything. Only FormatError may escape."""
    path = _WORK / "mutant.ninfer"
    path.write_bytes(data)
    try:
        r = NinferReader(path)
    except FormatError:
        return
    try:
        with np.errstate(all="ignore"):
            for name in r:
                info = r.info(name)
                r.raw(name).sum()
                if info.is_block_encoded:
                    for part in r.parts(name).values():
                        part.sum()
                    r.q4_g32(name).dequantize()
                    r.torch_parts(name)
                else:
                    r.numpy(name).sum()
                    r.torch(name).sum()
        r.verify()
    except FormatError:
        pass
    finally:
        r.close()


def test_valid_file_passes() -> None:
    with NinferReader(_WORK / "valid.ninfer") as r:
        r.verify()
        assert len(r) == 5


# --- 1. raw byte edits ----------------------------------------------------------------------------------

_anywhere = st.integers(0, len(VALID) - 1)  # data, padding, anything
_data = st.sampled_from(
    [i for e in HEADER["tensors"] for i in range(e["offset"], e["offset"] + e["length"])]
)  # the tensors' bytes
_positions = st.one_of(
    st.integers(8, 31),  # the preamble after the magic
    st.integers(HEADER_OFFSET, len(VALID) - 1),  # the header
    _data,
    _anywhere,
    _anywhere,
)
_ops = st.one_of(
    st.tuples(st.just("flip"), _positions, st.integers(0, 7)),
    st.tuples(st.just("set"), _positions, st.integers(0, 255)),
    st.tuples(st.just("truncate"), _positions, st.just(0)),
    st.tuples(st.just("insert"), _positions, st.integers(1, 64)),
    st.tuples(st.just("delete"), _positions, st.integers(1, 64)),
)


def apply(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    b = bytearray(data)
    for op, pos, arg in ops:
        if not b:
            break
        pos %= len(b)
        if op == "flip":
            b[pos] ^= 1 << arg
        elif op == "set":
            b[pos] = arg
        elif op == "truncate":
            del b[pos:]
        elif op == "insert":
            b[pos:pos] = bytes([arg]) * arg
        else:
            del b[pos : pos + arg]
    return bytes(b)


@settings(SETTINGS, max_examples=400)
@given(st.lists(_ops, min_size=1, max_size=6))
def test_raw_mutations_raise_only_format_errors(ops: list[tuple[str, int, int]]) -> None:
    exercise(apply(VALID, ops))


# --- 2. header byte edits, resealed ---------------------------------------------------------------------


@settings(SETTINGS, max_examples=200)
@given(st.lists(_ops, min_size=1, max_size=4))
def test_resealed_header_mutations_raise_only_format_errors(ops: list[tuple[str, int, int]]) -> None:
    raw = VALID[HEADER_OFFSET:]
    shifted = [(op, pos - HEADER_OFFSET if pos >= HEADER_OFFSET else pos, arg) for op, pos, arg in ops]
    exercise(reseal(VALID, apply(raw, shifted)))


# --- 3. structural edits of decoded fields ----------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 4096, 4095, 8192, 2**32, 2**63, 2**64 - 1]),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["f32", "f16", "bf16", "i8", "u8", "i32", "u32", "q4_g32", "q4", "name", "a"]),
    st.binary(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_ENTRY_KEYS = ["name", "dtype", "shape", "offset", "length", "crc32"]


@st.composite
def header_edits(draw: st.DrawFn) -> bytes:
    h = copy.deepcopy(HEADER)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                [
                    *("entry", "entry_dim", "drop_key", "swap", "meta", "top"),
                    *("move", "rename", "retype", "resize"),
                ]
            )
        )
        entries = h.get("tensors") if isinstance(h.get("tensors"), list) else None
        if kind == "entry" and entries:
            e = draw(st.sampled_from(entries))
            if isinstance(e, dict):
                e[draw(st.sampled_from([*_ENTRY_KEYS, "extra"]))] = draw(_values)
        elif kind == "entry_dim" and entries:
            e = draw(st.sampled_from(entries))
            if isinstance(e, dict) and isinstance(e.get("shape"), list):
                e["shape"] = draw(st.lists(st.integers(0, 2**20), max_size=9))
                if draw(st.booleans()):
                    e["length"] = draw(st.integers(0, 2**20))
        elif kind == "drop_key" and entries:
            e = draw(st.sampled_from(entries))
            if isinstance(e, dict) and e:
                del e[draw(st.sampled_from(sorted(e)))]
        elif kind == "swap" and entries and len(entries) > 1:
            i, j = draw(st.integers(0, len(entries) - 1)), draw(st.integers(0, len(entries) - 1))
            entries[i], entries[j] = entries[j], entries[i]
        elif kind == "move" and entries:
            e = draw(st.sampled_from(entries))
            if isinstance(e, dict):
                step = draw(st.sampled_from([4096, -4096, 8192, 1, -1, 64, 2**40]))
                e["offset"] = max(0, e.get("offset", 0) + step) if isinstance(e.get("offset"), int) else step
        elif kind == "rename" and entries and len(entries) > 1:
            a, b = draw(st.sampled_from(entries)), draw(st.sampled_from(entries))
            if isinstance(a, dict) and isinstance(b, dict):
                a["name"] = b.get("name")
        elif kind == "retype" and entries:
            e = draw(st.sampled_from(entries))
            if isinstance(e, dict):
                e["dtype"] = draw(st.sampled_from([*DTYPES, *ENCODINGS, "f64"]))
        elif kind == "resize" and entries:
            # A shape with a consistent length, so the layout checks (not the size check) decide.
            e = draw(st.sampled_from(entries))
            if isinstance(e, dict) and e.get("dtype") in ("f32", "i32", "u8", "q4_g32"):
                n = draw(st.sampled_from([0, 1, 32, 1024, 1056, 4096, 40960]))
                if e["dtype"] == "q4_g32":
                    n = max(32, n - n % 32)
                    e["shape"], e["length"] = [1, n], n // 2 + n // 16
                else:
                    e["shape"], e["length"] = [n], n * (1 if e["dtype"] == "u8" else 4)
        elif kind == "meta":
            h["metadata"] = draw(_values)
        elif kind == "top":
            h[draw(st.sampled_from(["metadata", "tensors", "other"]))] = draw(_values)
    data = reseal(VALID, msgpack.packb(h, use_bin_type=True))
    if draw(st.integers(0, 5)) == 0:
        key = draw(st.sampled_from(["version", "offset", "length", "crc"]))
        value = draw(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([1, 4096, 8192, len(data)])))
        data = with_preamble(data, **{key: value})
    return data


@settings(SETTINGS, max_examples=500)
@given(header_edits())
def test_structural_header_edits_raise_only_format_errors(data: bytes) -> None:
    exercise(data)


def test_every_truncation_raises_only_format_errors() -> None:
    for cut in [*range(0, 64), *range(HEADER_OFFSET - 8, len(VALID))]:
        exercise(VALID[:cut])
