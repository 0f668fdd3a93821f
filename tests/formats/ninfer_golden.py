"""The golden `.ninfer` v1 file: its tensors and metadata, from formulas (no RNG, stable across numpy
versions). `tests/formats/data/golden_v1.ninfer` holds the committed bytes; regenerate them only with a
deliberate format change (and a new version):

    python tests/formats/ninfer_golden.py tests/formats/data/golden_v1.ninfer
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from ignis.formats import NinferWriter, Q4G32Tensor, quantize_q4_g32

GOLDEN_PATH = Path(__file__).parent / "data" / "golden_v1.ninfer"

METADATA: dict[str, Any] = {
    "ignis.family": "llama",
    "ignis.config": {
        "hidden_size": 64,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
    "ints": [0, -1, 127, -(2**63), 2**64 - 1],
    "floats": [0.5, -2.25, 1e300],
    "flag": False,
    "blob": bytes(range(8)),
    "unicode": "naïve 日本 ✓",
    "nested": {"a": [[1, 2], {"b": []}], "": "empty key"},
}


def tensors() -> list[tuple[str, str, Any]]:
    """(name, dtype, data) in storage order; bf16 data is raw uint16 bits."""
    i = np.arange(4 * 64, dtype=np.int64).reshape(4, 64)
    w = (np.sin(i * 0.37) * (1 + (i % 7))).astype(np.float32)
    return [
        ("f32.weight", "f32", w),
        ("f16.weight", "f16", (w / 8).astype(np.float16)),
        ("bf16.weight", "bf16", (w.view(np.uint32) >> 16).astype(np.uint16)),
        ("i8.vec", "i8", (np.arange(33) * 13 % 256 - 128).astype(np.int8)),
        ("u8.blob", "u8", (np.arange(4097) * 7 % 256).astype(np.uint8)),
        ("i32.ids", "i32", np.array([[-(2**31), -1, 0], [1, 2**31 - 1, 12345]], dtype=np.int32)),
        ("u32.ids", "u32", np.array([0, 1, 2**32 - 1], dtype=np.uint32)),
        ("q4.weight", "q4_g32", Q4G32Tensor(*quantize_q4_g32(w))),
        ("q4.3d", "q4_g32", Q4G32Tensor(*quantize_q4_g32(w.reshape(2, 2, 64)))),
        ("f32.empty", "f32", np.zeros((0, 5), dtype=np.float32)),
        ("f32.scalar", "f32", np.array(-1.5, dtype=np.float32)),
    ]


def write(path: str | Path) -> str:
    """Write the golden container to `path`; returns the path."""
    with NinferWriter(path, metadata=METADATA) as w:
        for name, dtype, data in tensors():
            if isinstance(data, Q4G32Tensor):
                w.add_q4_g32(name, data.packed, data.scales)
            else:
                w.add_tensor(name, data, dtype=dtype)
    return str(path)


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else GOLDEN_PATH))
