"""The runtime's closed error taxonomy: one base class, one subclass per failure kind.

Messages name the offender (file, tensor, field, lane) and, where one exists, the fix.
"""

from __future__ import annotations


class IgnisRuntimeError(Exception):
    """Base class of every error raised by `ignis.runtime`."""


class UnknownModelTypeError(IgnisRuntimeError):
    """A config's `model_type` names no registered family."""


class ConfigError(IgnisRuntimeError):
    """A family config has a missing, mistyped or out-of-range field."""


class TensorSetError(IgnisRuntimeError):
    """A checkpoint or artifact lacks expected tensors or holds unexpected ones.

    Attributes:
        missing: every expected tensor name that is absent, sorted.
        unexpected: every present tensor name that the family does not use, sorted.
    """

    def __init__(self, message: str, *, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected


class TensorShapeError(IgnisRuntimeError):
    """A tensor's shape differs from what the family config implies."""


class StateError(IgnisRuntimeError):
    """A lane's state was used out of protocol (commit without forward, commit past the columns run,
    context exhausted)."""


class TokenizerError(IgnisRuntimeError):
    """The tokenizer or chat template is missing or cannot be applied."""
