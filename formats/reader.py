"""The `.ninfer` reader: memory-maps a container, validates it whole, then hands out zero-copy views.

    with NinferReader("model.ninfer") as r:
        r.metadata["ignis.family"]            # typed metadata values
        w = r.numpy("model.norm.weight")      # read-only numpy view into the mapping, no copy
        t = r.torch("model.norm.weight")      # torch tensor over the same bytes (bf16 included)
        q = r.q4_g32("model.layers.0.mlp.down_proj.weight")   # packed u32 + f16 scales views
        r.verify()                            # crc32 of every tensor and the padding, on request

Opening reads only the preamble page and the header (the data pages are not touched until a view is
used); everything in the header is validated before the constructor returns, so a reader that
exists describes a well-formed file. Data corruption inside a tensor is only found by `verify`.
"""

from __future__ import annotations

import importlib
import mmap
import os
import stat
import weakref
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from .constants import (
    ALIGNMENT,
    DATA_START,
    DTYPES,
    ENCODINGS,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_SIZE,
    PREAMBLE_SIZE,
    PREAMBLE_STRUCT,
    Q4_G32,
    align_up,
)
from .errors import (
    BadMagicError,
    ChecksumMismatchError,
    ContainerIOError,
    HeaderChecksumError,
    HeaderTooLargeError,
    MalformedHeaderError,
    MisalignedTensorError,
    NonZeroPaddingError,
    OverlappingTensorsError,
    TensorGapError,
    TensorNotFoundError,
    TrailingBytesError,
    TruncatedFileError,
    UnsupportedVersionError,
    UsageError,
)
from .header import MetadataValue, TensorInfo, decode_header
from .q4 import Q4G32Tensor

#: Bytes hashed per zlib.crc32 call in verify (zlib releases the GIL for each call).
_VERIFY_CHUNK = 64 * 1024 * 1024


def _torch() -> Any:
    # Imported lazily: ignis.formats depends on numpy and msgpack only. importlib keeps the strict
    # type check of formats/ from analysing torch.
    try:
        return importlib.import_module("torch")
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise UsageError(
            "torch views need torch installed (pip install 'ignis[runtime]')", path=None
        ) from exc


class NinferReader:
    """A validated, memory-mapped `.ninfer` container.

    Args:
        path: the file to open.

    Attributes:
        path: the path as given (str).
        version: the format version (1).
        file_size: bytes in the file.
        header_offset: absolute offset of the msgpack header.
        header_length: bytes of the msgpack header.

    Raises (from the constructor; all subclasses of FormatError):
        ContainerIOError: the file cannot be opened, stat'ed, read or mapped, or is not a regular file.
        TruncatedFileError, BadMagicError, UnsupportedVersionError, HeaderTooLargeError,
        TrailingBytesError, NonZeroPaddingError (preamble page), HeaderChecksumError,
        MalformedHeaderError, UnknownDtypeError, TensorSizeError, DuplicateTensorError,
        MisalignedTensorError, OverlappingTensorsError, TensorGapError.

    The mapping is private copy-on-write: views never write to the file. Views keep the mapping
    alive after `close()`. Truncating the file while it is mapped makes later accesses fault
    (SIGBUS), and pages not yet read show later writes to the file; artifacts are written once and
    replaced by rename, never modified in place. The reader keeps the file open until `close()`, so
    `changed_on_disk()` can tell whether the file it mapped (not whatever the path names now) was
    written to since.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._mm: mmap.mmap | None = None
        self._fd = -1
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ContainerIOError(f"cannot open: {exc.strerror}", path=self.path) from exc
        ok = False
        try:
            st = os.fstat(fd)
            self._stat = st
            if not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise ContainerIOError(f"is {kind}; a .ninfer container is a regular file", path=self.path)
            self.file_size = st.st_size
            pre = os.pread(fd, PREAMBLE_SIZE, 0)
            self._check_preamble(pre)
            try:
                self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:
                raise ContainerIOError(f"cannot memory-map: {exc}", path=self.path) from exc
            ok = True
        except OSError as exc:
            raise ContainerIOError(f"cannot read: {exc}", path=self.path) from exc
        finally:
            if not ok:
                os.close(fd)
        self._fd = fd
        self._fd_closer = weakref.finalize(self, os.close, fd)  # a reader never closed still frees it
        try:
            if len(self._mm) != self.file_size:
                raise ContainerIOError(
                    f"file changed size while opening ({self.file_size} -> {len(self._mm)} bytes)",
                    path=self.path,
                )
            self._validate()
        except BaseException:
            self._mm.close()
            self._mm = None
            self._fd = -1
            self._fd_closer()
            raise

    # --- validation ----------------------------------------------------------------------------------

    def _check_preamble(self, pre: bytes) -> None:
        size = self.file_size
        n = min(len(pre), len(MAGIC))
        if pre[:n] != MAGIC[:n]:
            raise BadMagicError(
                f"starts with {pre[:8]!r}, not the .ninfer magic {MAGIC!r}; this is not a .ninfer file",
                path=self.path,
                offset=0,
            )
        if size < PREAMBLE_SIZE or len(pre) < PREAMBLE_SIZE:
            raise TruncatedFileError(
                f"the file is {size} bytes, shorter than the {PREAMBLE_SIZE}-byte preamble",
                path=self.path,
                offset=size,
            )
        _, version, header_crc, header_offset, header_length = PREAMBLE_STRUCT.unpack(pre)
        if version != FORMAT_VERSION:
            hint = (
                "written by a newer ignis; upgrade ignis to read it"
                if version > FORMAT_VERSION
                else "invalid"
            )
            raise UnsupportedVersionError(
                f"format version {version} is not supported "
                f"(this reader reads version {FORMAT_VERSION}: {hint})",
                path=self.path,
                version=version,
                offset=8,
            )
        if header_length > MAX_HEADER_SIZE:
            raise HeaderTooLargeError(
                f"the preamble declares a {header_length}-byte header; the maximum is {MAX_HEADER_SIZE}",
                path=self.path,
                offset=24,
            )
        if header_offset % ALIGNMENT or header_offset < DATA_START:
            raise MalformedHeaderError(
                f"the preamble's header offset {header_offset} must be a multiple of {ALIGNMENT} "
                f"and >= {DATA_START}",
                path=self.path,
                offset=16,
            )
        end = header_offset + header_length
        if end > size:
            raise TruncatedFileError(
                f"the file is {size} bytes but its header ends at byte {end} (the preamble's header "
                f"offset {header_offset} and length {header_length}, bytes 16-31): the file is truncated "
                f"or its preamble is corrupt (re-copy or rebuild it)",
                path=self.path,
                offset=size,
            )
        if end < size:
            raise TrailingBytesError(
                f"{size - end} byte(s) follow the end of the header at byte {end} (the preamble's header "
                f"offset {header_offset} and length {header_length}, bytes 16-31): data appended to the "
                f"file, or a corrupt preamble",
                path=self.path,
                offset=end,
            )
        self.version: int = version
        self.header_offset: int = header_offset
        self.header_length: int = header_length
        self._header_crc: int = header_crc

    def _validate(self) -> None:
        mm = self._mm
        assert mm is not None
        pad = mm[PREAMBLE_SIZE:DATA_START]
        if pad.count(0) != len(pad):
            first = PREAMBLE_SIZE + next(i for i, b in enumerate(pad) if b)
            raise NonZeroPaddingError("the preamble page's padding is not zero", path=self.path, offset=first)
        raw = mm[self.header_offset : self.header_offset + self.header_length]
        crc = zlib.crc32(raw)
        if crc != self._header_crc:
            raise HeaderChecksumError(
                f"header crc32 is {crc:#010x} but the preamble records {self._header_crc:#010x}; "
                f"the header is corrupt",
                path=self.path,
                offset=self.header_offset,
            )
        metadata, infos = decode_header(raw, path=self.path, offset=self.header_offset)
        self._check_layout(infos)
        self._metadata: dict[str, MetadataValue] = metadata
        self._tensors: dict[str, TensorInfo] = {t.name: t for t in infos}

    def _check_layout(self, infos: list[TensorInfo]) -> None:
        cursor = DATA_START
        prev: TensorInfo | None = None
        for t in infos:
            if t.offset % ALIGNMENT:
                raise MisalignedTensorError(
                    f"offset {t.offset} is not a multiple of {ALIGNMENT}",
                    path=self.path,
                    tensor=t.name,
                    offset=t.offset,
                )
            expected = align_up(cursor)
            if t.offset < expected:
                what = (
                    "the preamble page"
                    if prev is None
                    else f"tensor {prev.name!r} [{prev.offset}, {prev.end})"
                )
                raise OverlappingTensorsError(
                    f"bytes [{t.offset}, {t.end}) overlap {what}",
                    path=self.path,
                    tensor=t.name,
                    offset=t.offset,
                )
            if t.offset > expected:
                what = "the preamble page" if prev is None else f"tensor {prev.name!r}"
                raise TensorGapError(
                    f"starts at {t.offset} but the previous data ({what}) ends at {cursor}; "
                    f"tensors are packed in table order, each at the next multiple of {ALIGNMENT} "
                    f"({expected})",
                    path=self.path,
                    tensor=t.name,
                    offset=t.offset,
                )
            if t.end > self.header_offset:
                raise OverlappingTensorsError(
                    f"bytes [{t.offset}, {t.end}) overlap the header at {self.header_offset}",
                    path=self.path,
                    tensor=t.name,
                    offset=t.offset,
                )
            cursor = t.end
            prev = t
        if align_up(cursor) != self.header_offset:
            raise TensorGapError(
                f"the header starts at {self.header_offset} but the data ends at {cursor}; "
                f"the header must follow at the next multiple of {ALIGNMENT} ({align_up(cursor)})",
                path=self.path,
                offset=cursor,
            )

    # --- the table -----------------------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, MetadataValue]:
        """The metadata map (string keys; values None, bool, int, float, str, bytes, lists, maps).

        The returned dict is the reader's own; do not mutate it.
        """
        return self._metadata

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Name -> TensorInfo, in storage order (a new dict each call)."""
        return dict(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        """The table entry of `name`.

        Raises:
            TensorNotFoundError: no tensor of that name.
        """
        try:
            return self._tensors[name]
        except KeyError:
            raise TensorNotFoundError(
                f"no such tensor (the file holds {len(self._tensors)})", path=self.path, tensor=name
            ) from None

    # --- views ---------------------------------------------------------------------------------------

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise UsageError("the reader is closed", path=self.path)
        return self._mm

    def _view(self, offset: int, dtype: str, shape: tuple[int, ...], *, writable: bool) -> npt.NDArray[Any]:
        count = 1
        for d in shape:
            count *= d
        dt = np.dtype(dtype)
        if count == 0:
            arr: npt.NDArray[Any] = np.zeros(shape, dtype=dt)
        else:
            arr = np.frombuffer(self._map(), dtype=dt, count=count, offset=offset).reshape(shape)
        arr.flags.writeable = writable
        return arr

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        """The stored bytes of `name`: a read-only uint8 [length] view (no copy).

        Raises:
            TensorNotFoundError, UsageError (closed).
        """
        t = self.info(name)
        return self._view(t.offset, "<u1", (t.length,), writable=False)

    def numpy(self, name: str) -> npt.NDArray[Any]:
        """A read-only zero-copy numpy view of a plain-dtype tensor, of the tensor's shape.

        dtypes: f32 -> float32, f16 -> float16, i8, u8, i32, u32 as named; bf16 -> uint16 holding the raw
        bfloat16 bits (numpy has no bfloat16; `.view(ml_dtypes.bfloat16)` or `torch()` reinterpret them).
        All little-endian (correct on any host).

        Raises:
            TensorNotFoundError; UsageError: the tensor is block-encoded (use `q4_g32`), or the reader
                is closed.
        """
        t = self.info(name)
        if t.dtype not in DTYPES:
            raise UsageError(
                f"is {t.dtype}, a block encoding; use q4_g32() or parts()",
                path=self.path,
                tensor=name,
                offset=t.offset,
            )
        return self._view(t.offset, DTYPES[t.dtype].numpy_dtype, t.shape, writable=False)

    def parts(self, name: str) -> dict[str, npt.NDArray[Any]]:
        """Read-only zero-copy views of a block-encoded tensor's parts, by part name, in storage order.

        For q4_g32: {"packed": uint32 [*lead, in/8], "scales": float16 [*lead, in/32]}.

        Raises:
            TensorNotFoundError; UsageError: the tensor has a plain dtype (use `numpy`), or the reader
                is closed.
        """
        return self._parts(name, writable=False)

    def _parts(self, name: str, *, writable: bool) -> dict[str, npt.NDArray[Any]]:
        t = self.info(name)
        enc = ENCODINGS.get(t.dtype)
        if enc is None:
            raise UsageError(
                f"is {t.dtype}, a plain dtype; use numpy() or torch()",
                path=self.path,
                tensor=name,
                offset=t.offset,
            )
        lead, last = t.shape[:-1], t.shape[-1]
        out: dict[str, npt.NDArray[Any]] = {}
        off = t.offset
        for part in enc.parts:
            shape = (*lead, last // part.features_per_element)
            arr = self._view(off, part.numpy_dtype, shape, writable=writable)
            out[part.name] = arr
            off += arr.size * part.itemsize
        return out

    def q4_g32(self, name: str) -> Q4G32Tensor:
        """Zero-copy views of a q4_g32 tensor (packed u32 [*lead, in/8], scales f16 [*lead, in/32]).

        Raises:
            TensorNotFoundError; UsageError: the tensor is not q4_g32, or the reader is closed.
        """
        t = self.info(name)
        if t.dtype != Q4_G32.name:
            raise UsageError(f"is {t.dtype}, not q4_g32", path=self.path, tensor=name, offset=t.offset)
        p = self.parts(name)
        return Q4G32Tensor(packed=p["packed"], scales=p["scales"])

    def torch(self, name: str) -> Any:
        """A zero-copy CPU torch.Tensor over a plain-dtype tensor's bytes (bf16 as torch.bfloat16).

        The tensor shares the private copy-on-write mapping: writing to it never reaches the file, but
        changes what later views (and `verify`) of this reader see; treat it as read-only. Needs torch
        (imported on first use) and a little-endian host.

        Raises:
            TensorNotFoundError; UsageError: block-encoded (use `torch_parts`), closed, or torch missing.
        """
        t = self.info(name)
        if t.dtype not in DTYPES:
            raise UsageError(
                f"is {t.dtype}, a block encoding; use torch_parts()",
                path=self.path,
                tensor=name,
                offset=t.offset,
            )
        torch = _torch()
        d = DTYPES[t.dtype]
        arr = self._view(t.offset, d.numpy_dtype, t.shape, writable=True)
        tensor = torch.from_numpy(arr)
        if t.dtype == "bf16":
            tensor = tensor.view(torch.bfloat16)
        return tensor

    def torch_parts(self, name: str) -> dict[str, Any]:
        """Zero-copy torch tensors of a block-encoded tensor's parts (q4_g32: packed torch.uint32
        [*lead, in/8], scales torch.float16 [*lead, in/32]); same sharing rules as `torch`.

        Raises:
            TensorNotFoundError; UsageError: plain dtype (use `torch`), closed, or torch missing.
        """
        torch = _torch()
        return {k: torch.from_numpy(v) for k, v in self._parts(name, writable=True).items()}

    # --- integrity -----------------------------------------------------------------------------------

    def _crc(self, start: int, length: int) -> int:
        crc = 0
        with memoryview(self._map()) as mv:
            for a in range(start, start + length, _VERIFY_CHUNK):
                b = min(start + length, a + _VERIFY_CHUNK)
                with mv[a:b] as piece:
                    crc = zlib.crc32(piece, crc)
        return crc

    def verify_tensor(self, name: str) -> None:
        """Check one tensor's crc32 against the table.

        Raises:
            TensorNotFoundError; ChecksumMismatchError: the bytes differ from what was written.
        """
        t = self.info(name)
        crc = self._crc(t.offset, t.length)
        if crc != t.crc32:
            raise ChecksumMismatchError(
                f"crc32 of the data is {crc:#010x} but the table records {t.crc32:#010x}; "
                f"the file is corrupt (re-copy or rebuild it)",
                path=self.path,
                tensor=name,
                offset=t.offset,
                mismatches=[name],
            )

    def verify(self, names: Iterable[str] | None = None, *, check_padding: bool = True) -> None:
        """Check the crc32 of every tensor (or of `names`) and, with `check_padding`, that every padding
        byte between tensors is zero. Reads every byte checked, so it runs at zlib's crc32 rate (or the
        disk's, for pages not in the page cache).

        Raises:
            ChecksumMismatchError: one or more tensors differ; `mismatches` lists all of them, the message
                names the first and its offset.
            NonZeroPaddingError: (checksums fine) a padding byte is not zero.
            TensorNotFoundError: a name in `names` is absent.
        """
        selected = list(self._tensors) if names is None else list(names)
        bad: list[str] = []
        for name in selected:
            try:
                self.verify_tensor(name)
            except ChecksumMismatchError:
                bad.append(name)
        if bad:
            first = self._tensors[bad[0]]
            raise ChecksumMismatchError(
                f"{len(bad)} tensor(s) fail their crc32: {bad[:20]}{' ...' if len(bad) > 20 else ''}; "
                f"the file is corrupt (re-copy or rebuild it)",
                path=self.path,
                tensor=first.name,
                offset=first.offset,
                mismatches=bad,
            )
        if check_padding:
            self._check_padding()

    def _check_padding(self) -> None:
        mm = self._map()
        cursor = DATA_START
        for t in [*self._tensors.values(), None]:
            start = cursor
            stop = t.offset if t is not None else self.header_offset
            if stop > start:
                pad = mm[start:stop]
                if pad.count(0) != len(pad):
                    first = start + next(i for i, b in enumerate(pad) if b)
                    raise NonZeroPaddingError(
                        "padding before "
                        + (f"tensor {t.name!r}" if t is not None else "the header")
                        + " is not zero",
                        path=self.path,
                        offset=first,
                    )
            if t is not None:
                cursor = t.end

    # --- lifetime ------------------------------------------------------------------------------------

    def fileno(self) -> int:
        """The descriptor of the open file (for fstat, or a lease: `fcntl(F_SETLEASE)`); the reader owns it.

        Raises:
            UsageError: the reader is closed.
        """
        if self._fd < 0:
            raise UsageError("the reader is closed", path=self.path)
        return self._fd

    @property
    def closed(self) -> bool:
        """True after `close()`."""
        return self._mm is None

    @property
    def file_identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the file opened: a path that now names another file was replaced."""
        return self._stat.st_dev, self._stat.st_ino

    def changed_on_disk(self) -> str | None:
        """What happened to the mapped file since it was opened: None while its size and modification
        time are those seen at open, else a sentence saying what changed. One fstat of the file the
        reader holds, so a file renamed over `path` (the safe way to replace one) is not a change:
        this reader still maps the intact old file.

        Raises:
            UsageError: the reader is closed.
        """
        if self._fd < 0:
            raise UsageError("the reader is closed", path=self.path)
        try:
            now = os.fstat(self._fd)
        except OSError as exc:  # pragma: no cover - fstat of an open fd does not fail in practice
            return f"cannot stat the mapped file: {exc.strerror}"
        was = self._stat
        if now.st_size < was.st_size:
            return (
                f"was truncated from {was.st_size} to {now.st_size} bytes while mapped (reading the cut "
                f"pages would crash the process with SIGBUS)"
            )
        if now.st_size != was.st_size or now.st_mtime_ns != was.st_mtime_ns:
            return (
                f"was modified in place while mapped (size {was.st_size} -> {now.st_size} bytes, "
                f"mtime changed: {now.st_mtime_ns != was.st_mtime_ns}); its pages no longer hold what "
                f"was validated"
            )
        return None

    def close(self) -> None:
        """Release the reader's mapping and file. Views already handed out stay valid (they keep the
        mapping alive)."""
        if self._fd >= 0:
            self._fd = -1
            self._fd_closer()
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still reference the mapping; it is unmapped when the last one goes

    def __enter__(self) -> NinferReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"{len(self._tensors)} tensors"
        return f"NinferReader({self.path!r}, v{getattr(self, 'version', '?')}, {state})"


def open_ninfer(path: str | os.PathLike[str]) -> NinferReader:
    """Open and validate a `.ninfer` container (same as `NinferReader(path)`)."""
    return NinferReader(path)


__all__ = ["NinferReader", "open_ninfer"]
