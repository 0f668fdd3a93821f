"""The `.ninfer` writer: streams tensors one at a time, then writes the header and renames atomically.

    with NinferWriter("out/model.ninfer", metadata={"ignis.family": "llama"}) as w:
        for name, array in converted_tensors():              # one tensor in memory at a time
            w.add_tensor(name, array)                         # dtype from the array (bf16: see below)
        w.add_q4_g32("lm_head.weight", *quantize_q4_g32(head))
    # leaving the block without an exception: header written, fsync, rename; with one: nothing left

A small state machine: OPEN --add_*/set_metadata--> OPEN --finish--> FINISHED; any failure of the
file system, or `abort`, or an exception leaving the `with` block --> ABORTED (temporary file removed).
A writer garbage-collected while OPEN also removes its temporary file. The same calls give the same
bytes (no timestamps, metadata keys sorted, padding zero).

Memory stays bounded by one tensor (or one chunk, with `add_tensor_chunks`) whatever the model size:
tensor data goes straight to the file; only the table and the metadata are held until `finish`.
"""

from __future__ import annotations

import enum
import operator
import os
import secrets
import weakref
import zlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer  # anything with the buffer protocol (collections.abc in 3.12)

import numpy as np
import numpy.typing as npt

from .constants import (
    DATA_START,
    DTYPES,
    ENCODINGS,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_SIZE,
    MAX_METADATA_VALUES,
    MAX_TENSORS,
    PREAMBLE_STRUCT,
    Q4_G32,
    align_up,
    stored_length,
)
from .errors import ContainerIOError, DuplicateTensorError, HeaderTooLargeError, UnknownDtypeError, UsageError
from .header import TensorInfo, check_dtype_and_shape, check_metadata, check_name, encode_header
from .q4 import Q4G32Tensor

#: Largest single write (and crc32 call); bounds the writer's temporary memory for big tensors.
_WRITE_CHUNK = 64 * 1024 * 1024

_ZEROS = bytes(DATA_START)

# numpy (kind, itemsize) -> table dtype, for dtype inference.
_NUMPY_KINDS: dict[tuple[str, int], str] = {
    ("f", 4): "f32",
    ("f", 2): "f16",
    ("i", 1): "i8",
    ("u", 1): "u8",
    ("i", 4): "i32",
    ("u", 4): "u32",
}


class _State(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"
    ABORTED = "aborted"


def _discard(fd: int, tmp: str) -> None:
    # Finalizer: must not reference the writer. Closes the descriptor and removes the temporary file.
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _is_torch(data: object) -> bool:
    return type(data).__module__.split(".", 1)[0] == "torch"


class NinferWriter:
    """Write one `.ninfer` container, streaming.

    Args:
        path: the final file name. The data goes to a temporary file `.NAME.<random>.tmp` in the same
            directory, which is fsync'ed and renamed over `path` by `finish` (atomic on POSIX).
        metadata: initial metadata (string keys; values None, bool, int, float, str, bytes, lists/tuples
            and maps with string keys, nested at most 32 deep). Copied; later changes by the caller
            are not seen.

    Raises:
        UsageError: invalid metadata.
        ContainerIOError: the temporary file cannot be created (missing directory, permissions).
    """

    def __init__(self, path: str | os.PathLike[str], *, metadata: Mapping[str, object] | None = None) -> None:
        self.path = os.fspath(path)
        self._metadata: dict[str, Any] = {}
        self._tensors: list[TensorInfo] = []
        self._names: set[str] = set()
        self._state = _State.ABORTED
        self._meta_counts: dict[str, int] = {}  # values per metadata key (key and value), for the limit
        if metadata is not None:
            check_metadata(dict(metadata), path=self.path, error=UsageError)
            for k, v in metadata.items():
                self._meta_counts[k] = check_metadata({k: v}, path=self.path, error=UsageError) - 1
            self._check_metadata_count()
            self._metadata = dict(metadata)
        directory, base = os.path.split(os.path.abspath(self.path))
        self._dir = directory
        self._tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            self._fd = os.open(
                self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666
            )
        except OSError as exc:
            raise ContainerIOError(
                f"cannot create the temporary file {self._tmp}: {exc.strerror}", path=self.path
            ) from exc
        self._finalizer = weakref.finalize(self, _discard, self._fd, self._tmp)
        self._state = _State.OPEN
        self._pos = 0
        self._write(_ZEROS)  # the preamble page; the preamble itself is written by finish()

    # --- state ---------------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """ "open", "finished" or "aborted"."""
        return self._state.value

    @property
    def tensors(self) -> list[TensorInfo]:
        """The table so far, in storage order (a new list)."""
        return list(self._tensors)

    def _require_open(self) -> None:
        if self._state is not _State.OPEN:
            raise UsageError(f"the writer is {self._state.value}; nothing more can be added", path=self.path)

    def _write(self, data: Buffer) -> None:
        with memoryview(data) as mv, mv.cast("B") as b:
            done = 0
            while done < len(b):
                try:
                    done += os.write(self._fd, b[done:])
                except OSError as exc:
                    self.abort()
                    raise ContainerIOError(
                        f"writing the temporary file failed: {exc.strerror}; nothing was written",
                        path=self.path,
                        offset=self._pos + done,
                    ) from exc
        self._pos += done

    def _pad_to(self, target: int) -> None:
        while self._pos < target:
            self._write(_ZEROS[: min(len(_ZEROS), target - self._pos)])

    def _rollback(self, pos: int) -> None:
        try:
            os.ftruncate(self._fd, pos)
            os.lseek(self._fd, pos, os.SEEK_SET)
        except OSError as exc:
            self.abort()
            raise ContainerIOError(
                f"rolling back a failed tensor failed: {exc.strerror}", path=self.path
            ) from exc
        self._pos = pos

    # --- adding --------------------------------------------------------------------------------------

    def set_metadata(self, key: str, value: object) -> None:
        """Set one metadata entry (replacing an earlier value of `key`); written by `finish`.

        Raises:
            UsageError: invalid key or value, or the writer is not open.
        """
        self._require_open()
        n = check_metadata({key: value}, path=self.path, error=UsageError) - 1
        previous = self._meta_counts.get(key)
        self._meta_counts[key] = n
        try:
            self._check_metadata_count()
        except UsageError:
            if previous is None:
                del self._meta_counts[key]
            else:
                self._meta_counts[key] = previous
            raise
        self._metadata[key] = value

    def _check_metadata_count(self) -> None:
        total = 1 + sum(self._meta_counts.values())
        if total > MAX_METADATA_VALUES:
            raise UsageError(
                f"the metadata would hold {total} values (scalars, lists, maps and map keys); the maximum "
                f"is {MAX_METADATA_VALUES}: store large data as a u8 tensor",
                path=self.path,
            )

    def _begin(self, name: str, dtype: str, shape: Iterable[int]) -> tuple[str, tuple[int, ...], int]:
        self._require_open()
        check_name(name, path=self.path, where="add", error=UsageError)
        if len(self._tensors) >= MAX_TENSORS:
            raise UsageError(f"a container holds at most {MAX_TENSORS} tensors", path=self.path, tensor=name)
        if name in self._names:
            raise DuplicateTensorError(
                "a tensor of this name was already added; names must be unique",
                path=self.path,
                names=[name],
                tensor=name,
            )
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise UsageError(
                f"shape {shape!r} must be a sequence of integers", path=self.path, tensor=name
            ) from None
        dtype, dims = check_dtype_and_shape(name, dtype, dims, path=self.path, error=UsageError)
        return dtype, dims, stored_length(dtype, dims)

    def add_tensor_chunks(
        self, name: str, *, dtype: str, shape: Iterable[int], chunks: Iterable[Buffer]
    ) -> TensorInfo:
        """Stream one tensor's stored bytes from `chunks` (bytes-like, C-contiguous, little-endian,
        concatenated in order); only one chunk is held at a time.

        For plain dtypes the bytes are the elements in C order; for q4_g32 they are the packed u32
        words of every row, then the f16 scales of every row. On any error (including one raised by
        the `chunks` iterator) the partial tensor is removed and the writer stays usable.

        Args:
            name: unique tensor name (UTF-8, 1..1024 bytes).
            dtype: "f32", "f16", "bf16", "i8", "u8", "i32", "u32" or "q4_g32".
            shape: the logical shape (q4_g32: [*lead, in], in a positive multiple of 32).
            chunks: the bytes; their total length must equal the stored length.

        Returns:
            The table entry (offset, length, crc32 filled in).

        Raises:
            DuplicateTensorError, UnknownDtypeError, TensorSizeError (bad q4 shape),
            UsageError (bad name/shape, total bytes differ from the stored length, not open),
            ContainerIOError (the file system failed; the writer is then aborted).
        """
        dtype, dims, length = self._begin(name, dtype, shape)
        start = self._pos
        self._pad_to(align_up(self._pos))
        offset = self._pos
        crc = 0
        try:
            for chunk in chunks:
                with memoryview(chunk) as mv:
                    if not mv.c_contiguous:
                        raise UsageError("a chunk is not C-contiguous", path=self.path, tensor=name)
                    with mv.cast("B") as b:
                        if self._pos - offset + len(b) > length:
                            raise UsageError(
                                f"the chunks hold more than the {length} bytes {dtype} {list(dims)} needs",
                                path=self.path,
                                tensor=name,
                                offset=offset,
                            )
                        for a in range(0, len(b), _WRITE_CHUNK):
                            piece = b[a : a + _WRITE_CHUNK]
                            crc = zlib.crc32(piece, crc)
                            self._write(piece)
            if self._pos - offset != length:
                raise UsageError(
                    f"the chunks hold {self._pos - offset} bytes but {dtype} {list(dims)} needs {length}",
                    path=self.path,
                    tensor=name,
                    offset=offset,
                )
        except BaseException:
            if self._state is _State.OPEN:
                self._rollback(start)
            raise
        info = TensorInfo(name=name, dtype=dtype, shape=dims, offset=offset, length=length, crc32=crc)
        self._tensors.append(info)
        self._names.add(name)
        return info

    def add_tensor(self, name: str, data: Any, *, dtype: str | None = None) -> TensorInfo:
        """Write one plain-dtype tensor now.

        Args:
            name: unique tensor name (UTF-8, 1..1024 bytes).
            data: a numpy array or a torch tensor (any device; copied to CPU). Its dtype picks the table
                dtype: float32 f32, float16 f16, int8 i8, uint8 u8, int32 i32, uint32 u32, bfloat16
                (torch, or ml_dtypes for numpy) bf16; a numpy uint16 array is accepted as raw bf16 bits
                with `dtype="bf16"`. No implicit conversion: float64, int64, bool are refused.
            dtype: the table dtype, checked against `data` when given.

        Returns:
            The table entry.

        Raises:
            UnknownDtypeError: `dtype` is not defined by v1.
            UsageError: `data`'s dtype does not match or cannot be stored, "q4_g32" (use `add_q4_g32`), bad
                name, not open.
            DuplicateTensorError, ContainerIOError: as for `add_tensor_chunks`.
        """
        self._require_open()
        arr, inferred = self._as_numpy(name, data)
        if dtype is not None:
            if dtype in ENCODINGS:
                raise UsageError(
                    f"{dtype} is a block encoding; use add_q4_g32(name, packed, scales)",
                    path=self.path,
                    tensor=name,
                )
            if dtype not in DTYPES:
                raise UnknownDtypeError(
                    f"unknown dtype {dtype!r}; v1 defines {sorted(DTYPES)} and the block encodings "
                    f"{sorted(ENCODINGS)}",
                    path=self.path,
                    tensor=name,
                )
            if not (dtype == inferred or (dtype == "bf16" and arr.dtype == np.dtype("<u2"))):
                raise UsageError(
                    f"data has dtype {arr.dtype} ({inferred or 'no container dtype'}) "
                    f"but dtype={dtype!r} was given; convert it first",
                    path=self.path,
                    tensor=name,
                )
            inferred = dtype
        if inferred is None:
            raise UsageError(
                f"numpy dtype {arr.dtype} has no container dtype "
                f"(store f32, f16, bf16, i8, u8, i32, u32; for raw bfloat16 bits in uint16 pass "
                f"dtype='bf16'); convert it first",
                path=self.path,
                tensor=name,
            )
        want = np.dtype(DTYPES[inferred].numpy_dtype)
        # Same kind and size by construction; this only fixes the byte order (little-endian on disk)
        # and the memory order (C), copying only when one of them differs.
        flat = np.ascontiguousarray(arr, dtype=want).reshape(-1)
        chunks = [flat.view(np.uint8).data]
        return self.add_tensor_chunks(name, dtype=inferred, shape=arr.shape, chunks=chunks)

    def _as_numpy(self, name: str, data: Any) -> tuple[npt.NDArray[Any], str | None]:
        if _is_torch(data):
            t = data.detach().to("cpu").contiguous()
            tname = str(t.dtype).removeprefix("torch.")
            if tname == "bfloat16":
                import importlib

                torch = importlib.import_module("torch")
                return t.view(torch.int16).numpy().view(np.uint16), "bf16"
            matches = [d.name for d in DTYPES.values() if d.torch_dtype == tname]
            arr: npt.NDArray[Any] = t.numpy()
            return arr, (matches[0] if matches else None)
        if not isinstance(data, np.ndarray):
            raise UsageError(
                f"data must be a numpy array or torch tensor, got {type(data).__name__}",
                path=self.path,
                tensor=name,
            )
        if data.dtype.name == "bfloat16" and data.dtype.itemsize == 2:  # ml_dtypes
            return data.view(np.uint16), "bf16"
        if data.dtype.kind not in "fiu":
            return data, None
        return data, _NUMPY_KINDS.get((data.dtype.kind, data.dtype.itemsize))

    def add_q4_g32(self, name: str, packed: npt.ArrayLike, scales: npt.ArrayLike) -> TensorInfo:
        """Write one q4_g32 tensor now (see `quantize_q4_g32` to make the parts from floats).

        Args:
            name: unique tensor name.
            packed: uint32 [*lead, in/8] (either byte order; stored little-endian).
            scales: float16 [*lead, in/32].

        Returns:
            The table entry (dtype "q4_g32", logical shape [*lead, in]).

        Raises:
            UsageError (wrong part dtypes), TensorSizeError (part shapes disagree), DuplicateTensorError,
            ContainerIOError, as for `add_tensor_chunks`.
        """
        self._require_open()
        q = Q4G32Tensor(packed=np.asarray(packed), scales=np.asarray(scales))
        parts = [
            np.ascontiguousarray(q.packed, dtype=np.dtype(Q4_G32.parts[0].numpy_dtype)).reshape(-1).data,
            np.ascontiguousarray(q.scales, dtype=np.dtype(Q4_G32.parts[1].numpy_dtype)).reshape(-1).data,
        ]
        return self.add_tensor_chunks(name, dtype=Q4_G32.name, shape=q.shape, chunks=parts)

    # --- ending --------------------------------------------------------------------------------------

    def finish(self) -> str:
        """Write the header and the preamble, fsync, rename over `path`, fsync the directory.

        Returns:
            The final path.

        Raises:
            HeaderTooLargeError: the header would exceed MAX_HEADER_SIZE (64 MiB); the writer is aborted.
            ContainerIOError: the file system failed; the writer is aborted (no file left behind).
            UsageError: the writer is not open.
        """
        self._require_open()
        try:
            self._pad_to(align_up(self._pos))
            header_offset = self._pos
            header = encode_header(self._metadata, self._tensors)
            if len(header) > MAX_HEADER_SIZE:
                raise HeaderTooLargeError(
                    f"the header would be {len(header)} bytes; the maximum is {MAX_HEADER_SIZE} (store large "
                    f"metadata blobs as u8 tensors instead)",
                    path=self.path,
                )
            self._write(header)
            pre = PREAMBLE_STRUCT.pack(MAGIC, FORMAT_VERSION, zlib.crc32(header), header_offset, len(header))
            os.pwrite(self._fd, pre, 0)
            os.fsync(self._fd)
            os.close(self._fd)
            self._finalizer.detach()
            self._fd = -1
            os.replace(self._tmp, self.path)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise ContainerIOError(
                    f"finishing failed: {exc}; nothing was written", path=self.path
                ) from exc
            raise
        self._state = _State.FINISHED
        try:
            dfd = os.open(self._dir or ".", os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass  # some file systems refuse fsync on directories; the rename itself has happened
        return self.path

    def abort(self) -> None:
        """Abandon the file: close and remove the temporary file. Idempotent; no-op once finished."""
        if self._state is _State.FINISHED:
            return
        self._state = _State.ABORTED
        if self._fd >= 0:
            self._finalizer()  # closes the descriptor, removes the temporary file, runs once
            self._fd = -1
        else:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass

    def __enter__(self) -> NinferWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state is _State.OPEN:
            self.finish()

    def __repr__(self) -> str:
        return f"NinferWriter({self.path!r}, {self._state.value}, {len(self._tensors)} tensors)"


def write_ninfer(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    metadata: Mapping[str, object] | None = None,
) -> str:
    """Write a whole container in one call: each value a numpy array / torch tensor (see `add_tensor`)
    or a `Q4G32Tensor`. `tensors` may be a generator, so tensors can still be produced one at a time.

    Returns:
        The final path.

    Raises:
        Everything `NinferWriter` raises; on any error no file is left behind.
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    with NinferWriter(path, metadata=metadata) as w:
        for name, value in items:
            if isinstance(value, Q4G32Tensor):
                w.add_q4_g32(name, value.packed, value.scales)
            else:
                w.add_tensor(name, value)
    return w.path


__all__ = ["NinferWriter", "write_ninfer"]
