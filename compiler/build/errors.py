"""Errors of the build steps, one subclass per failure kind (all `ignis.compiler.errors.CompilerError`).

Errors from the importers (`CheckpointError`, ...), the runtime's family layer (`ConfigError`,
`TensorSetError`, `TensorShapeError`, which list every missing and unexpected tensor) and the
formats layer (`FormatError`) pass through the build unchanged.
"""

from __future__ import annotations

from ignis.compiler.errors import CompilerError


class BuildError(CompilerError):
    """Base class of the errors raised by `ignis.compiler.build`."""


class UnknownCardError(BuildError):
    """`--card` names no card profile; the message lists the known cards."""


class RecipeError(BuildError):
    """The build recipe (TOML) cannot be read or holds an unknown, missing or mistyped key; the message
    names the file and the key."""


class DrafterMismatchError(BuildError):
    """The drafter does not fit the target (hidden size, a tapped layer past the target's last layer,
    the mask token outside the embedding, ...) or cannot be read.

    Attributes:
        problems: every misfit found, one line each.
    """

    def __init__(self, message: str, *, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


class MissingTensorsError(BuildError):
    """A part of the checkpoint (the MTP head, the drafter) lacks tensors its config requires.

    Attributes:
        missing: every missing tensor name, sorted.
        unexpected: every tensor that the part does not use, sorted.
    """

    def __init__(self, message: str, *, missing: list[str], unexpected: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected or []


class ShortlistError(BuildError):
    """The shortlist head cannot be built: no frequency source for a vocabulary larger than the
    shortlist, an unreadable corpus or counts file, a token id outside the vocabulary, a hidden size
    that is not a multiple of 32 (q4_g32)."""


class InsufficientDiskError(BuildError):
    """The output file system has less free space than the artifact needs.

    Attributes:
        needed: bytes the build needs (estimate, with margin).
        free: bytes free on the output file system.
    """

    def __init__(self, message: str, *, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free


class ModuleBuildError(BuildError):
    """A TVM module could not be compiled, or the exported library does not hold a binary for the
    card's arch (e.g. CUDA source embedded because no driver or stub was loaded)."""


class OutputExistsError(BuildError):
    """The output cannot be used without destroying something: it exists and is not empty (pass
    `overwrite=True` / `--force` to replace it), it is not a directory, it is or contains an input of the
    build (the checkpoint, the drafter, the recipe or its corpus), or `overwrite` would replace a
    non-empty directory that is not an ignis artifact (no manifest.json)."""


class OutputNotWritableError(BuildError):
    """The output directory cannot be created: the nearest existing folder above it is not a directory
    or cannot be written (read-only file system, permissions, a virtual file system such as /proc).
    Checked before the plan is resolved, also in a dry run."""


__all__ = [
    "BuildError",
    "DrafterMismatchError",
    "InsufficientDiskError",
    "MissingTensorsError",
    "ModuleBuildError",
    "OutputExistsError",
    "OutputNotWritableError",
    "RecipeError",
    "ShortlistError",
    "UnknownCardError",
]
