"""Prompt snapshots, format 5: one prompt checkpoint in a `.ninfer` container (SPEC.md section 9).

A snapshot file is a `.ninfer` container (every rule of sections 1-7 holds: magic, header crc32,
per-tensor crc32, alignment) whose metadata holds one key, ``ignis.snapshot``, a map:

    version             5
    artifact_sha256     sha256 (hex) of the target's `.ninfer` the state was computed with
    drafter             the drafter backend ("off" without one)
    drafter_sha256      sha256 (hex) of the drafter's weights ("" for "off" and weightless drafters;
                        the artifact's own hash for a drafter grafted into it)
    kind                "prompt", "opener" or "reply"
    num_tokens          N, the position the state is at
    is_truncatable      whether the state also restores at any M < N
    drafter_num_tokens  the drafter context's position (N)
    drafter_meta        map of string -> integer (the drafter's own small fields)

and the tensors ``token_ids`` (u32 [N]), ``model.<name>`` (the target's state, canonical names of
`ignis.runtime.checkpoints`), ``drafter.<name>`` (the drafter's context) and optionally
``last_logits`` (f32 [vocab]).

`read_snapshot` refuses a file with a typed error: a damaged container (the container's errors:
`ChecksumMismatchError`, `HeaderChecksumError`, `TruncatedFileError`, ...; every tensor's crc32 is
checked), a container that is not a snapshot or breaks this schema (`SnapshotSchemaError`), another
snapshot version (`SnapshotVersionError`), or a snapshot bound to another artifact or drafter
(`SnapshotBindingError`, naming the field, what the file holds and what was expected).

Versions 1-4 were the reference implementation's layouts (version 4 carried a separate "rewrite
checkpoint" of the DFlash2 window); ignis reads and writes version 5 only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from .errors import FormatError, MalformedHeaderError, UnsupportedVersionError
from .reader import NinferReader
from .writer import NinferWriter

__all__ = [
    "SNAPSHOT_KINDS",
    "SNAPSHOT_METADATA_KEY",
    "SNAPSHOT_VERSION",
    "Snapshot",
    "SnapshotBinding",
    "SnapshotBindingError",
    "SnapshotSchemaError",
    "SnapshotVersionError",
    "read_snapshot",
    "write_snapshot",
]

#: The snapshot version this code writes and the only one it reads.
SNAPSHOT_VERSION: Final[int] = 5

#: The container metadata key holding the snapshot map.
SNAPSHOT_METADATA_KEY: Final[str] = "ignis.snapshot"

#: Where a checkpoint may be taken.
SNAPSHOT_KINDS: Final[frozenset[str]] = frozenset({"prompt", "opener", "reply"})

_KEYS: Final[frozenset[str]] = frozenset(
    {
        "version",
        "artifact_sha256",
        "drafter",
        "drafter_sha256",
        "kind",
        "num_tokens",
        "is_truncatable",
        "drafter_num_tokens",
        "drafter_meta",
    }
)


class SnapshotSchemaError(MalformedHeaderError):
    """The container is not a prompt snapshot, or its snapshot map or tensors break the schema
    (a missing, unknown or mistyped key, a token_ids tensor of the wrong length or dtype)."""


class SnapshotVersionError(UnsupportedVersionError):
    """The snapshot's version is not 5 (`version` holds the one found)."""


class SnapshotBindingError(FormatError):
    """An intact snapshot bound to another artifact or drafter than the one expected.

    Attributes:
        field: "artifact_sha256", "drafter" or "drafter_sha256".
        found: what the file holds.
        expected: what the caller expected.
    """

    def __init__(
        self, detail: str, *, path: str | os.PathLike[str] | None, field: str, found: str, expected: str
    ) -> None:
        super().__init__(detail, path=path)
        self.field = field
        self.found = found
        self.expected = expected


@dataclass(frozen=True)
class SnapshotBinding:
    """What a snapshot is bound to: the target artifact and the drafter.

    Attributes:
        artifact_sha256: sha256 (hex) of the target's `.ninfer`.
        drafter: the drafter backend ("off" without one).
        drafter_sha256: sha256 (hex) of the drafter's weights, "" when it has none.
    """

    artifact_sha256: str
    drafter: str = "off"
    drafter_sha256: str = ""


@dataclass
class Snapshot:
    """A snapshot read back (tensors are CPU torch tensors, copies: the file is closed).

    Attributes:
        binding: the artifact and drafter it is bound to.
        token_ids: the N tokens.
        kind: "prompt", "opener" or "reply".
        is_truncatable: whether the state also restores at any M < N.
        model: the target's state by canonical name.
        drafter: the drafter's context by name.
        drafter_num_tokens: the drafter context's position.
        drafter_meta: the drafter's small integer fields.
        last_logits: float32 [vocab] or None.
    """

    binding: SnapshotBinding
    token_ids: tuple[int, ...]
    kind: str
    is_truncatable: bool
    model: dict[str, Any] = field(default_factory=dict)
    drafter: dict[str, Any] = field(default_factory=dict)
    drafter_num_tokens: int = 0
    drafter_meta: dict[str, int] = field(default_factory=dict)
    last_logits: Any = None


def write_snapshot(
    path: str | os.PathLike[str],
    *,
    binding: SnapshotBinding,
    token_ids: Sequence[int],
    kind: str,
    model: Mapping[str, Any],
    drafter: Mapping[str, Any] | None = None,
    drafter_num_tokens: int | None = None,
    drafter_meta: Mapping[str, int] | None = None,
    is_truncatable: bool = False,
    last_logits: Any = None,
) -> str:
    """Write a snapshot atomically (a temporary name, then a rename). Returns the file's path.

    Args:
        model, drafter: name -> torch tensor or numpy array (f32, f16, bf16, integer dtypes of
            the container).
        last_logits: float32 [vocab] or None.

    Raises:
        SnapshotSchemaError: an unknown kind, token ids outside u32, non-integer drafter_meta.
        the container writer's errors (`UsageError`, `UnknownDtypeError`, `ContainerIOError`).
    """
    p = os.fspath(path)
    if kind not in SNAPSHOT_KINDS:
        raise SnapshotSchemaError(f"unknown snapshot kind {kind!r}; one of {sorted(SNAPSHOT_KINDS)}", path=p)
    ids = np.asarray(list(token_ids), dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFFFFFF)):
        raise SnapshotSchemaError("token ids must be a list of u32 values", path=p)
    meta = dict(drafter_meta or {})
    if not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in meta.items()
    ):
        raise SnapshotSchemaError("drafter_meta must map strings to integers", path=p)
    header = {
        "version": SNAPSHOT_VERSION,
        "artifact_sha256": binding.artifact_sha256,
        "drafter": binding.drafter,
        "drafter_sha256": binding.drafter_sha256,
        "kind": kind,
        "num_tokens": int(ids.size),
        "is_truncatable": bool(is_truncatable),
        "drafter_num_tokens": int(ids.size if drafter_num_tokens is None else drafter_num_tokens),
        "drafter_meta": meta,
    }
    with NinferWriter(p, metadata={SNAPSHOT_METADATA_KEY: header}) as w:
        w.add_tensor("token_ids", ids.astype("<u4"))
        for name in sorted(model):
            w.add_tensor(f"model.{name}", model[name])
        for name in sorted(drafter or {}):
            w.add_tensor(f"drafter.{name}", (drafter or {})[name])
        if last_logits is not None:
            w.add_tensor("last_logits", last_logits, dtype="f32")
    return p


def _schema(cond: bool, detail: str, path: str) -> None:
    if not cond:
        raise SnapshotSchemaError(detail, path=path)


def read_snapshot(path: str | os.PathLike[str], *, expect: SnapshotBinding | None = None) -> Snapshot:
    """Read and check a snapshot (module docstring); every tensor's crc32 is verified.

    Args:
        expect: the binding the caller runs with; None skips the binding check (inspection only).

    Raises:
        the container's errors for damaged bytes; SnapshotSchemaError, SnapshotVersionError,
        SnapshotBindingError (module docstring).
    """
    p = os.fspath(path)
    with NinferReader(p) as r:
        raw = r.metadata.get(SNAPSHOT_METADATA_KEY)
        _schema(isinstance(raw, dict), f"no {SNAPSHOT_METADATA_KEY!r} map in the metadata: not a snapshot", p)
        assert isinstance(raw, dict)
        meta: dict[str, Any] = dict(raw)
        version = meta.get("version")
        if not isinstance(version, int) or version != SNAPSHOT_VERSION:
            raise SnapshotVersionError(
                f"snapshot version {version!r}; this ignis reads version {SNAPSHOT_VERSION} only "
                "(record the checkpoint again)",
                path=p,
                version=version if isinstance(version, int) else -1,
            )
        keys = set(meta)
        _schema(keys == _KEYS, f"snapshot keys {sorted(keys)}, expected {sorted(_KEYS)}", p)
        for k in ("artifact_sha256", "drafter", "drafter_sha256", "kind"):
            _schema(isinstance(meta[k], str), f"snapshot {k!r} must be a string", p)
        for k in ("num_tokens", "drafter_num_tokens"):
            _schema(
                isinstance(meta[k], int) and not isinstance(meta[k], bool) and meta[k] >= 0,
                f"snapshot {k!r} must be an integer >= 0",
                p,
            )
        _schema(isinstance(meta["is_truncatable"], bool), "snapshot 'is_truncatable' must be a boolean", p)
        dmeta: Any = meta["drafter_meta"]
        _schema(
            isinstance(dmeta, dict)
            and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in dmeta.items()
            ),
            "snapshot 'drafter_meta' must map strings to integers",
            p,
        )
        _schema(meta["kind"] in SNAPSHOT_KINDS, f"snapshot kind {meta['kind']!r} unknown", p)
        binding = SnapshotBinding(
            str(meta["artifact_sha256"]), str(meta["drafter"]), str(meta["drafter_sha256"])
        )
        if expect is not None:
            for name in ("artifact_sha256", "drafter", "drafter_sha256"):
                found, want = getattr(binding, name), getattr(expect, name)
                if found != want:
                    raise SnapshotBindingError(
                        f"snapshot bound to {name} {found!r}, this server runs {want!r}: it was recorded "
                        "with another artifact or drafter and cannot be restored",
                        path=p,
                        field=name,
                        found=found,
                        expected=want,
                    )
        r.verify()
        names = set(r.tensors)
        _schema("token_ids" in names, "no 'token_ids' tensor", p)
        info = r.info("token_ids")
        n = int(meta["num_tokens"])
        _schema(info.dtype == "u32" and tuple(info.shape) == (n,), f"'token_ids' must be u32 [{n}]", p)
        unknown = sorted(
            x
            for x in names
            if x not in ("token_ids", "last_logits") and not x.startswith(("model.", "drafter."))
        )
        _schema(not unknown, f"unknown tensors {unknown}", p)
        tokens = tuple(int(t) for t in r.numpy("token_ids"))
        model = {x[len("model.") :]: r.torch(x).clone() for x in sorted(names) if x.startswith("model.")}
        drafter = {
            x[len("drafter.") :]: r.torch(x).clone() for x in sorted(names) if x.startswith("drafter.")
        }
        logits = None
        if "last_logits" in names:
            li = r.info("last_logits")
            _schema(li.dtype == "f32" and len(li.shape) == 1, "'last_logits' must be f32 [vocab]", p)
            logits = r.torch("last_logits").clone()
    return Snapshot(
        binding=binding,
        token_ids=tokens,
        kind=str(meta["kind"]),
        is_truncatable=bool(meta["is_truncatable"]),
        model=model,
        drafter=drafter,
        drafter_num_tokens=int(meta["drafter_num_tokens"]),
        drafter_meta={str(k): int(v) for k, v in dmeta.items()},
        last_logits=logits,
    )
