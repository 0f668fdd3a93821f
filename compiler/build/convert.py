"""Step 1: the checkpoint's tensors in the card profile's dtypes, streamed into a `.ninfer` writer.

Which dtype a tensor gets (`storage_dtype`):

- *quantizable linear weights* get the profile's `linear_dtype` (`q4_g32`, `bf16` or `f32`): tensors
  that some executor passes to a linear layer as its weight, i.e. `*proj*.weight` (`q_proj`,
  `in_proj_qkv`, `out_proj`, ...), the fused expert stacks `*.experts.gate_up_proj` /
  `*.experts.down_proj` ([E, N, K], quantized per row), `lm_head.weight`, `head.weight` and
  `fc.weight` (MTP, drafter). For `q4_g32` the input dimension must be a multiple of 32; a weight
  whose input dimension is not stays in `other_dtype` (the plan lists it).
- everything else gets `other_dtype`: embeddings, norms, biases, convolutions, and the small linears
  whose outputs steer routing, gating and decay: the MoE router (`mlp.gate.weight`), the
  shared-expert gate, the Gated DeltaNet `in_proj_a` / `in_proj_b` / `in_proj_ba`, and DFlash2's
  dynamic-conv `kernel_projection` and selector `hidden_projection` (few rows each, so keeping them
  precise costs almost nothing).

Quantization is the reference `ignis.formats.quantize_q4_g32` (symmetric, scale = absmax / 7 per 32
inputs, round to nearest even; SPEC.md §4.1). Tensors are converted one at a time and written in row
chunks of at most `CHUNK_ELEMENTS` values, so memory stays bounded by one source tensor plus a chunk.
A q4 tensor's row chunks (`PARALLEL_CHUNK_ELEMENTS` values each) are quantized by `build_threads()`
worker threads (numpy and torch release the GIL in their array loops), at most
`2 * build_threads()` chunks in flight, and written in row order: the quantizer works row by row, so
the bytes are those of the one-thread run whatever the thread count.

Routed experts are written in the family's canonical layout (`<Config>.expert_layout`) whatever the
checkpoint's layout: a fused stack is sliced per expert, per-expert tensors are stacked (one stack
at a time).
"""

from __future__ import annotations

import os
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ignis.compiler.errors import CheckpointError
from ignis.formats import NinferWriter, TensorInfo, quantize_q4_g32
from ignis.formats.constants import stored_length
from ignis.runtime.errors import TensorShapeError

#: Values per conversion chunk (float32: 64 MiB).
CHUNK_ELEMENTS = 1 << 24

#: Values per q4 chunk when the quantization runs on worker threads (float32: 8 MiB; small enough
#: that one 27B linear gives every core work).
PARALLEL_CHUNK_ELEMENTS = 1 << 21

#: Environment variable: worker threads of the q4 quantization (default: the usable cores; 1 = none).
BUILD_THREADS_ENV = "IGNIS_BUILD_THREADS"

_POOL_LOCK = threading.Lock()
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def build_threads() -> int:
    """Threads that quantize q4 chunks: `$IGNIS_BUILD_THREADS` when set (>= 1), else the cores this
    process may run on.

    Raises:
        CheckpointError: `$IGNIS_BUILD_THREADS` is not a positive integer.
    """
    raw = os.environ.get(BUILD_THREADS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise CheckpointError(f"${BUILD_THREADS_ENV} must be a positive integer, got {raw!r}")
        return n
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _pool(threads: int) -> ThreadPoolExecutor:
    """The shared quantization pool of `threads` workers (re-made when the count changes)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != threads:
            if _POOL is not None:
                _POOL[1].shutdown(wait=False)
            _POOL = (threads, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ignis-q4"))
        return _POOL[1]


_TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

# Linear weights by name (anything an executor hands to F.linear as a weight, bar the gates below).
_LINEAR_NAME = re.compile(
    r"(^|\.)([A-Za-z0-9_]*proj[A-Za-z0-9_]*\.weight|(lm_)?head\.weight|fc\.weight|experts\.(gate_up|down)_proj)$"
)
# Linear weights that always stay in other_dtype (routing and gating: tiny outputs, precision-critical).
_KEEP_PRECISE = re.compile(
    r"(^|\.)(mlp\.gate\.weight|shared_expert_gate\.weight|in_proj_(a|b|ba)\.weight"
    r"|kernel_projection\.weight|hidden_projection\.weight)$"
)
# Linear weights for module coverage (the router and the shared-expert gate are linears too).
_ANY_LINEAR = re.compile(r"(^|\.)(mlp\.gate\.weight|shared_expert_gate\.weight)$")


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an executor uses the tensor as a linear layer's weight ([N, K], or [E, N, K] stacks).

    Includes the MoE router and the shared-expert gate (plain linears, kept in `other_dtype`).
    """
    if len(shape) == 2:
        return bool(_LINEAR_NAME.search(name) or _ANY_LINEAR.search(name))
    return len(shape) == 3 and bool(re.search(r"experts\.(gate_up|down)_proj$", name))


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the tensor takes the profile's `linear_dtype` (see the module docstring)."""
    return is_linear_weight(name, shape) and not _KEEP_PRECISE.search(name)


def storage_dtype(name: str, shape: tuple[int, ...], *, linear_dtype: str, other_dtype: str) -> str:
    """The dtype the tensor is stored in (the profile's rule; q4 needs in_features % 32 == 0)."""
    if is_quantizable(name, shape):
        if linear_dtype != "q4_g32" or (shape[-1] > 0 and shape[-1] % 32 == 0):
            return linear_dtype
    return other_dtype


@dataclass(frozen=True)
class TensorJob:
    """One tensor to write.

    Attributes:
        name: the name in the output container.
        shape: the logical shape.
        dtype: the stored dtype ("f32", "bf16", "f16" or "q4_g32").
        load: reads the source tensor (any float dtype, the logical shape), on demand.
        source: where it comes from (checkpoint tensor names), for messages.
        file: the checkpoint (folder or file) it is read from, for messages ("" when unknown).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    load: Callable[[], torch.Tensor]
    source: str
    file: str = ""

    @property
    def stored_bytes(self) -> int:
        """Bytes the tensor occupies in the container (without alignment padding)."""
        return stored_length(self.dtype, self.shape)


def make_jobs(
    names_shapes: Mapping[str, tuple[int, ...]],
    loaders: Mapping[str, Callable[[], torch.Tensor]],
    *,
    linear_dtype: str,
    other_dtype: str,
    prefix: str = "",
    sources: Mapping[str, str] | None = None,
    file: str = "",
) -> list[TensorJob]:
    """Jobs for tensors (in the given order), named `prefix + name`, dtypes by `storage_dtype`; `file`
    is the checkpoint they are read from (named in errors)."""
    return [
        TensorJob(
            name=prefix + name,
            shape=tuple(shape),
            dtype=storage_dtype(name, tuple(shape), linear_dtype=linear_dtype, other_dtype=other_dtype),
            load=loaders[name],
            source=(sources or {}).get(name, name),
            file=file,
        )
        for name, shape in names_shapes.items()
    ]


# --- the expert layout --------------------------------------------------------------------------------


_FUSED = re.compile(r"^(?P<p>.+)\.mlp\.experts\.(?P<w>gate_up|down)_proj$")
_PER_EXPERT = re.compile(r"^(?P<p>.+)\.mlp\.experts\.(?P<e>\d+)\.(?P<w>gate|up|down)_proj\.weight$")


def resolve_layout(
    expected: Mapping[str, tuple[int, ...]],
    shapes: Mapping[str, tuple[int, ...]],
    get: Callable[[str], torch.Tensor],
) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str], list[str], list[str]]:
    """Map the expected (canonical) tensor names to loaders over the checkpoint's tensors.

    A name present in `shapes` is loaded as is; a fused expert stack absent from the checkpoint is
    stacked from per-expert tensors, and a per-expert tensor absent from it is sliced from a fused
    stack (the executor's convention: gate_up = [gate; up] along the rows).

    Args:
        expected: canonical name -> shape (the family table).
        shapes: checkpoint name -> shape of every available tensor.
        get: checkpoint name -> tensor (reads it).

    Returns:
        (loaders for every resolvable expected name, canonical name -> source description,
        every expected name that cannot be resolved (sorted), every checkpoint name no expected name
        uses (sorted)).

    Raises:
        TensorShapeError: tensors present under their expected name with another shape (all listed).
    """
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    sources: dict[str, str] = {}
    used: set[str] = set()
    missing: list[str] = []
    wrong = [
        f"{n}: {tuple(shapes[n])} (expected {tuple(s)})"
        for n, s in expected.items()
        if n in shapes and tuple(shapes[n]) != tuple(s)
    ]
    if wrong:
        raise TensorShapeError(f"{len(wrong)} tensor(s) have the wrong shape: {wrong}")
    for name, shape in expected.items():
        if name in shapes:
            loaders[name] = lambda n=name: get(n)
            sources[name] = name
            used.add(name)
            continue
        m = _FUSED.match(name)
        if m is not None:
            p, which = m.group("p"), m.group("w")
            num_experts = shape[0]
            parts = ("gate", "up") if which == "gate_up" else ("down",)
            names = [f"{p}.mlp.experts.{e}.{w}_proj.weight" for e in range(num_experts) for w in parts]
            if all(n in shapes for n in names):

                def stack(p: str = p, parts: tuple[str, ...] = parts, num: int = num_experts) -> torch.Tensor:
                    return torch.stack(
                        [
                            torch.cat([get(f"{p}.mlp.experts.{e}.{w}_proj.weight") for w in parts], dim=0)
                            for e in range(num)
                        ]
                    )

                loaders[name] = stack
                sources[name] = f"{p}.mlp.experts.*.{'/'.join(parts)}_proj.weight (stacked)"
                used.update(names)
                continue
        m = _PER_EXPERT.match(name)
        if m is not None:
            p, e, which = m.group("p"), int(m.group("e")), m.group("w")
            fused = f"{p}.mlp.experts.{'down' if which == 'down' else 'gate_up'}_proj"
            if fused in shapes:
                rows = shape[0]
                if which == "down":

                    def piece(f: str = fused, e: int = e) -> torch.Tensor:
                        return get(f)[e].contiguous()
                else:
                    lo = 0 if which == "gate" else rows

                    def piece(f: str = fused, e: int = e, lo: int = lo, rows: int = rows) -> torch.Tensor:
                        return get(f)[e, lo : lo + rows].contiguous()

                loaders[name] = piece
                sources[name] = f"{fused}[{e}] (sliced)"
                used.add(fused)
                continue
        missing.append(name)
    unused = sorted(set(shapes) - used)
    return loaders, sources, sorted(missing), unused


# --- writing --------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 1 else t.reshape(1, 1)


def _plain_chunks(t: torch.Tensor, dtype: str) -> Iterator[memoryview]:
    target = _TORCH_DTYPES[dtype]
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        piece = flat[start : start + CHUNK_ELEMENTS].to(target).contiguous()
        if target == torch.bfloat16:
            arr = piece.view(torch.int16).numpy().view(np.uint16)
        else:
            arr = piece.numpy()
        yield memoryview(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))).cast("B")


def _quantize_rows(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(little-endian packed codes, scales) of a row block (float32 through the reference quantizer)."""
    packed, s = quantize_q4_g32(rows.to(torch.float32).numpy())
    return np.ascontiguousarray(packed, dtype="<u4"), s


def q4_chunks(t: torch.Tensor, threads: int | None = None) -> Iterator[memoryview]:
    """The stored q4_g32 bytes of `t`: packed codes row block by row block, then every scale.

    With more than one thread (`build_threads()` unless given) the blocks are quantized ahead on the
    shared pool, at most 2 * threads in flight, and yielded in row order (module docstring).
    """
    rows = _rows(t)
    k = rows.shape[1]
    threads = build_threads() if threads is None else threads
    step = max(1, (PARALLEL_CHUNK_ELEMENTS if threads > 1 else CHUNK_ELEMENTS) // k)
    starts = range(0, rows.shape[0], step)
    scales: list[np.ndarray] = []
    if threads <= 1 or len(starts) == 1:
        for start in starts:
            packed, s = _quantize_rows(rows[start : start + step])
            scales.append(s)
            yield memoryview(packed).cast("B")
    else:
        pool = _pool(threads)
        pending: deque[Future[tuple[np.ndarray, np.ndarray]]] = deque()
        todo = iter(starts)
        try:
            for start in todo:
                pending.append(pool.submit(_quantize_rows, rows[start : start + step]))
                if len(pending) >= 2 * threads:
                    break
            while pending:
                packed, s = pending.popleft().result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append(pool.submit(_quantize_rows, rows[nxt : nxt + step]))
                scales.append(s)
                yield memoryview(packed).cast("B")
        finally:
            for f in pending:  # a failure or an abandoned generator: drop the work not yet started
                f.cancel()
    yield memoryview(np.ascontiguousarray(np.concatenate(scales), dtype="<f2")).cast("B")


def write_tensor(
    writer: NinferWriter,
    name: str,
    tensor: torch.Tensor,
    dtype: str,
    *,
    source: str | None = None,
    file: str = "",
) -> TensorInfo:
    """Convert one float tensor to `dtype` and stream it into `writer`.

    Args:
        tensor: float (any float dtype) of the logical shape; q4_g32 needs a last dim % 32 == 0.
        dtype: "f32", "bf16", "f16" or "q4_g32".
        source: the checkpoint tensor(s) it comes from (default `name`), for messages.
        file: the checkpoint it is read from, for messages.

    Raises:
        CheckpointError: a non-float tensor (an integer or bool tensor, a GGUF type the importer
            does not dequantize), or one holding NaN or inf values; the message names the tensor
            and the file.
        ValueError: an unsupported storage dtype (a bug of the caller).
        ignis.formats.FormatError: from the writer or the quantizer (non-finite values, bad shape).
    """
    if not tensor.is_floating_point():
        dt = str(tensor.dtype).removeprefix("torch.")
        raise CheckpointError(
            f"{file or 'the checkpoint'}: tensor {source or name} is {dt}, not a float tensor; "
            f"ignis-build converts only float weights (f32, f16, bf16, or quantized types it dequantizes)"
        )
    t = tensor.detach().to("cpu").contiguous()
    shape = tuple(t.shape)
    finite = torch.isfinite(t)
    if not bool(finite.all()):  # a corrupt checkpoint (GGUF has no checksums): refused, not stored
        bad = (~finite).reshape(-1)
        first = int(bad.nonzero()[0, 0])
        raise CheckpointError(
            f"{file or 'the checkpoint'}: tensor {source or name} holds {int(bad.sum())} non-finite "
            f"value(s) (NaN or inf; the first at flat index {first}); the checkpoint is corrupt"
        )
    if dtype == "q4_g32":
        return writer.add_tensor_chunks(name, dtype=dtype, shape=shape, chunks=q4_chunks(t))
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"{name}: unsupported storage dtype {dtype!r}")
    return writer.add_tensor_chunks(name, dtype=dtype, shape=shape, chunks=_plain_chunks(t, dtype))


def write_jobs(
    writer: NinferWriter,
    jobs: Iterable[TensorJob],
    *,
    on_done: Callable[[TensorJob], None] | None = None,
) -> list[TensorInfo]:
    """Load, convert and write every job in order (one source tensor in memory at a time).

    Raises:
        CheckpointError: a loaded tensor's shape differs from the job's (the checkpoint lied about it),
            or it is not a float tensor; the message names the file and the tensor.
    """
    out = []
    for job in jobs:
        t = job.load()
        if tuple(t.shape) != job.shape:
            raise CheckpointError(
                f"{job.file or 'the checkpoint'}: tensor {job.source}: loaded shape {tuple(t.shape)} "
                f"differs from the planned {job.shape}"
            )
        out.append(write_tensor(writer, job.name, t, job.dtype, source=job.source, file=job.file))
        del t
        if on_done is not None:
            on_done(job)
    return out


__all__ = [
    "BUILD_THREADS_ENV",
    "CHUNK_ELEMENTS",
    "PARALLEL_CHUNK_ELEMENTS",
    "TensorJob",
    "build_threads",
    "is_linear_weight",
    "is_quantizable",
    "make_jobs",
    "q4_chunks",
    "resolve_layout",
    "storage_dtype",
    "write_jobs",
    "write_tensor",
]
