"""The closed error taxonomy of `ignis.formats`: one base class, one subclass per failure kind.

Every message names the file, the tensor (where one is involved) and the byte offset (where one is
known), then what is wrong and, where one exists, the fix. The same facts are attributes: `path`,
`tensor`, `offset`, `detail`. Callers that only want "is this file usable" catch `FormatError`.
"""

from __future__ import annotations

import os
from typing import Any


class FormatError(Exception):
    """Base class of every error raised by `ignis.formats`.

    Attributes:
        path: the file concerned (as given by the caller), or None for in-memory checks (q4 references).
        tensor: the tensor concerned, or None.
        offset: the absolute byte offset in the file where the problem is, or None.
        detail: the message without the file/tensor/offset prefix.
    """

    def __init__(
        self,
        detail: str,
        *,
        path: str | os.PathLike[str] | None,
        tensor: str | None = None,
        offset: int | None = None,
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor
        self.offset = offset
        self.detail = detail
        where = [] if self.path is None else [self.path]
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if offset is not None:
            where.append(f"byte offset {offset}")
        super().__init__(", ".join(where) + ": " + detail if where else detail)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only constructor: teach pickle (multiprocessing) how to rebuild the exception.
        return (_rebuild, (type(self), self.detail, self.path, self.tensor, self.offset, self.__dict__))


def _rebuild(
    cls: type[FormatError],
    detail: str,
    path: str | None,
    tensor: str | None,
    offset: int | None,
    state: dict[str, Any],
) -> FormatError:
    err = cls.__new__(cls)
    FormatError.__init__(err, detail, path=path, tensor=tensor, offset=offset)
    err.__dict__.update(state)
    return err


def with_offset(exc: FormatError, offset: int) -> FormatError:
    """A copy of `exc` (same type and attributes) that names `offset` in its message."""
    state = {k: v for k, v in exc.__dict__.items() if k not in ("path", "tensor", "offset", "detail")}
    return _rebuild(type(exc), exc.detail, exc.path, exc.tensor, offset, state)


class ContainerIOError(FormatError):
    """The operating system refused an operation (open, read, map, write, rename); see `__cause__`."""


class TruncatedFileError(FormatError):
    """The file ends before the preamble, the header or the data it declares (`offset` = file size)."""


class BadMagicError(FormatError):
    """The first 8 bytes are not the `.ninfer` magic: this is not a `.ninfer` file."""


class UnsupportedVersionError(FormatError):
    """The format version is not one this reader supports (written by a newer ignis, or invalid).

    Attributes:
        version: the version found in the file.
    """

    def __init__(
        self, detail: str, *, path: str | os.PathLike[str] | None, version: int, offset: int | None = None
    ) -> None:
        super().__init__(detail, path=path, offset=offset)
        self.version = version


class HeaderTooLargeError(FormatError):
    """The declared header length exceeds `MAX_HEADER_SIZE` (the reader refuses to allocate it)."""


class HeaderChecksumError(FormatError):
    """The header's bytes do not match the crc32 stored in the preamble (the header is corrupt)."""


class MalformedHeaderError(FormatError):
    """The header is not valid msgpack, or violates the schema (keys, types, ranges, preamble fields)."""


class UnknownDtypeError(FormatError):
    """A dtype or block encoding name that v1 does not define (in a file, or given to the writer)."""


class TensorSizeError(FormatError):
    """A tensor's byte length disagrees with its shape and dtype, or its shape is invalid for its
    encoding (q4_g32 needs a last dimension that is a positive multiple of 32)."""


class DuplicateTensorError(FormatError):
    """Two tensor-table entries share a name (in a file, or added twice to a writer).

    Attributes:
        names: every duplicated name, sorted.
    """

    def __init__(
        self,
        detail: str,
        *,
        path: str | os.PathLike[str] | None,
        names: list[str],
        tensor: str | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(detail, path=path, tensor=tensor, offset=offset)
        self.names = names


class MisalignedTensorError(FormatError):
    """A tensor's offset is not a multiple of `ALIGNMENT` (4096)."""


class OverlappingTensorsError(FormatError):
    """A tensor's bytes overlap the previous tensor's, the preamble page, or the header."""


class TensorGapError(FormatError):
    """There are bytes between two tensors (or before the header) beyond the alignment padding."""


class TrailingBytesError(FormatError):
    """The file continues past the end of the header (appended or concatenated data)."""


class ChecksumMismatchError(FormatError):
    """A tensor's bytes do not match its crc32 (found by `verify`).

    Attributes:
        mismatches: every tensor name whose checksum failed, in storage order.
    """

    def __init__(
        self,
        detail: str,
        *,
        path: str | os.PathLike[str] | None,
        mismatches: list[str],
        tensor: str | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(detail, path=path, tensor=tensor, offset=offset)
        self.mismatches = mismatches


class NonZeroPaddingError(FormatError):
    """A padding byte (after the preamble or after a tensor) is not zero."""


class TensorNotFoundError(FormatError):
    """The container has no tensor of the requested name."""


class UsageError(FormatError):
    """The API was called wrongly: data that does not match the declared dtype or shape, metadata
    that cannot be stored, the wrong accessor for an encoding, a closed reader or writer."""


__all__ = [
    "BadMagicError",
    "ChecksumMismatchError",
    "ContainerIOError",
    "DuplicateTensorError",
    "FormatError",
    "HeaderChecksumError",
    "HeaderTooLargeError",
    "MalformedHeaderError",
    "MisalignedTensorError",
    "NonZeroPaddingError",
    "OverlappingTensorsError",
    "TensorGapError",
    "TensorNotFoundError",
    "TensorSizeError",
    "TrailingBytesError",
    "TruncatedFileError",
    "UnknownDtypeError",
    "UnsupportedVersionError",
    "UsageError",
]
