"""The compiler's closed error taxonomy: one base class, one subclass per failure kind.

Messages name the offender (file, tensor, metadata key) and, where one exists, the fix. Errors the
runtime's family layer raises while the compiler validates a checkpoint (`ConfigError`,
`UnknownModelTypeError`, `TensorSetError`, `TensorShapeError` from `ignis.runtime.errors`) pass
through unchanged, so one `except` per kind works for both packages.
"""

from __future__ import annotations


class CompilerError(Exception):
    """Base class of every error raised by `ignis.compiler`."""


class CheckpointError(CompilerError):
    """A checkpoint cannot be read: a missing or unreadable file, a malformed `config.json` or
    safetensors index, a tensor listed in the index but absent from its shard, or a tensor encoding
    that cannot be decoded. The message names the file and, where known, the tensor."""


class UnsupportedArchitectureError(CompilerError):
    """A checkpoint's architecture (GGUF `general.architecture`) or tokenizer model has no importer.
    The message lists the supported ones."""


__all__ = ["CheckpointError", "CompilerError", "UnsupportedArchitectureError"]
