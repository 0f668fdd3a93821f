"""Golden bytes: the committed tests/formats/data/golden_v1.ninfer is reproduced byte for byte by the
writer, and reads back to the exact tensors and metadata it was made from."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from ninfer_bytes import fields, header
from ninfer_golden import GOLDEN_PATH, METADATA, tensors, write

from ignis.formats import ALIGNMENT, MAGIC, NinferReader, Q4G32Tensor

# Pinned so that regenerating the golden file is a deliberate, visible change in two places.
GOLDEN_SHA256 = "dff872d26f0ba7deefd90be13ee0d28f587709ceef76079e43746c0a2c3cbe8d"


def test_golden_file_is_pinned() -> None:
    assert hashlib.sha256(GOLDEN_PATH.read_bytes()).hexdigest() == GOLDEN_SHA256


def test_writer_reproduces_golden_bytes(tmp_path: Path) -> None:
    out = write(tmp_path / "golden.ninfer")
    assert Path(out).read_bytes() == GOLDEN_PATH.read_bytes()


def test_golden_layout() -> None:
    data = GOLDEN_PATH.read_bytes()
    f = fields(data)
    assert f["magic"] == MAGIC and f["version"] == 1
    assert f["offset"] % ALIGNMENT == 0 and f["offset"] + f["length"] == len(data)
    h = header(data)
    assert set(h) == {"metadata", "tensors"}
    assert [e["name"] for e in h["tensors"]] == [name for name, _, _ in tensors()]
    assert list(h["tensors"][0]) == ["name", "dtype", "shape", "offset", "length", "crc32"]
    assert list(h["metadata"]) == sorted(METADATA)  # keys sorted by the writer


def test_golden_reads_back_exactly() -> None:
    with NinferReader(GOLDEN_PATH) as r:
        r.verify()
        assert r.metadata == METADATA
        for name, dtype, data in tensors():
            info = r.info(name)
            assert info.dtype == dtype
            if isinstance(data, Q4G32Tensor):
                q = r.q4_g32(name)
                assert q.shape == data.shape
                np.testing.assert_array_equal(q.packed, data.packed)
                np.testing.assert_array_equal(q.scales, data.scales)
            else:
                np.testing.assert_array_equal(r.numpy(name), data)
                if dtype == "bf16":
                    expected = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
                    assert torch.equal(r.torch(name), expected)
