"""ignis.formats: the bytes of ignis (the .ninfer container, Q4 block layouts, constants, errors).

Depends on numpy and msgpack only; torch views import torch lazily. `formats/SPEC.md` is normative.

Reading (the runtime)::

    from ignis.formats import NinferReader
    with NinferReader(path) as r:          # validates everything before returning
        w = r.torch("model.embed_tokens.weight")      # zero-copy torch tensor (bf16 included)
        q = r.q4_g32("model.layers.0.mlp.up_proj.weight")   # Q4G32Tensor of read-only views

Writing (the compiler)::

    from ignis.formats import NinferWriter, quantize_q4_g32
    with NinferWriter(out_path, metadata={...}) as w:
        w.add_tensor(name, array_or_torch_tensor)
        w.add_q4_g32(name, *quantize_q4_g32(weight))
"""

from .constants import (
    ALIGNMENT,
    DTYPES,
    ENCODINGS,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_SIZE,
    MAX_METADATA_VALUES,
    MAX_TENSORS,
)
from .errors import (
    BadMagicError,
    ChecksumMismatchError,
    ContainerIOError,
    DuplicateTensorError,
    FormatError,
    HeaderChecksumError,
    HeaderTooLargeError,
    MalformedHeaderError,
    MisalignedTensorError,
    NonZeroPaddingError,
    OverlappingTensorsError,
    TensorGapError,
    TensorNotFoundError,
    TensorSizeError,
    TrailingBytesError,
    TruncatedFileError,
    UnknownDtypeError,
    UnsupportedVersionError,
    UsageError,
)
from .header import MetadataValue, TensorInfo
from .manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    ArtifactChecksumError,
    ArtifactFileError,
    ArtifactMismatchError,
    FileEntry,
    Manifest,
    ManifestError,
    ManifestVersionError,
    ModuleEntry,
    ModuleFunction,
    hash_file,
    parse_manifest,
    read_manifest,
    verify_artifact,
)
from .q4 import Q4G32Tensor, dequantize_q4_g32, pack_q4_codes, quantize_q4_g32, unpack_q4_codes
from .reader import NinferReader, open_ninfer
from .writer import NinferWriter, write_ninfer

__all__ = [
    "ALIGNMENT",
    "DTYPES",
    "ENCODINGS",
    "FORMAT_VERSION",
    "MAGIC",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "MAX_HEADER_SIZE",
    "MAX_METADATA_VALUES",
    "MAX_TENSORS",
    "ArtifactChecksumError",
    "ArtifactFileError",
    "ArtifactMismatchError",
    "BadMagicError",
    "ChecksumMismatchError",
    "ContainerIOError",
    "DuplicateTensorError",
    "FileEntry",
    "FormatError",
    "HeaderChecksumError",
    "HeaderTooLargeError",
    "MalformedHeaderError",
    "Manifest",
    "ManifestError",
    "ManifestVersionError",
    "MetadataValue",
    "MisalignedTensorError",
    "ModuleEntry",
    "ModuleFunction",
    "NinferReader",
    "NinferWriter",
    "NonZeroPaddingError",
    "OverlappingTensorsError",
    "Q4G32Tensor",
    "TensorGapError",
    "TensorInfo",
    "TensorNotFoundError",
    "TensorSizeError",
    "TrailingBytesError",
    "TruncatedFileError",
    "UnknownDtypeError",
    "UnsupportedVersionError",
    "UsageError",
    "dequantize_q4_g32",
    "hash_file",
    "open_ninfer",
    "pack_q4_codes",
    "parse_manifest",
    "quantize_q4_g32",
    "read_manifest",
    "unpack_q4_codes",
    "verify_artifact",
    "write_ninfer",
]
