"""Prompt checkpoints on disk: `LaneCheckpoint` <-> snapshot format 5, and a snapshot directory.

`save_checkpoint` / `load_checkpoint` convert one checkpoint to and from a snapshot file
(`ignis.formats.snapshot`, SPEC.md section 9), bound to the target artifact's sha256 and the drafter
(`SnapshotBinding`); a file bound to anything else, damaged or of another version is refused with the
format's typed errors.

`SnapshotDirectory` keeps a pool's checkpoints in a folder so that a restarted server starts warm:
`save(cache)` writes every checkpoint of both tiers that is not on disk yet (one file per checkpoint,
``<artifact sha256[:16]>-<drafter>-<sha256 of drafter and token ids>.snapshot.ninfer``, so the same
checkpoint is never written twice) and removes the files of its own artifact and drafter whose
checkpoints the pool no longer holds (files of other artifacts or drafters in the same folder are
left alone); `load(cache)` inserts every file of its artifact and drafter that reads back (most
recently written last, so the LRU order survives), skipping and naming the refused ones. Loading
reads and checks every byte (crc32, about 1.8 GB/s on one core).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from pathlib import Path

import torch

from ignis.formats.errors import FormatError
from ignis.formats.snapshot import SnapshotBinding, read_snapshot, write_snapshot
from ignis.runtime.checkpoints import DrafterSnapshot, LaneCheckpoint
from ignis.runtime.prefix_cache import PrefixCache

__all__ = ["SnapshotDirectory", "checkpoint_file_name", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

SUFFIX = ".snapshot.ninfer"


def save_checkpoint(
    path: str | os.PathLike[str], checkpoint: LaneCheckpoint, binding: SnapshotBinding
) -> str:
    """Write `checkpoint` as a snapshot file (format 5) bound to `binding`. Returns the path.

    Raises:
        ValueError: the binding's drafter differs from the checkpoint's.
        the format's writer errors (`ignis.formats.errors`).
    """
    if binding.drafter != checkpoint.drafter_name:
        raise ValueError(
            f"checkpoint taken with drafter {checkpoint.drafter_name!r}, binding names {binding.drafter!r}"
        )
    d = checkpoint.drafter
    return write_snapshot(
        path,
        binding=binding,
        token_ids=checkpoint.token_ids,
        kind=checkpoint.kind,
        model={k: v.detach().cpu() for k, v in checkpoint.model.items()},
        drafter=None if d is None else {k: v.detach().cpu() for k, v in d.tensors.items()},
        drafter_num_tokens=checkpoint.num_tokens if d is None else d.num_tokens,
        drafter_meta=None if d is None else dict(d.meta),
        is_truncatable=checkpoint.is_truncatable,
        last_logits=None if checkpoint.last_logits is None else checkpoint.last_logits.detach().float().cpu(),
    )


def load_checkpoint(
    path: str | os.PathLike[str], binding: SnapshotBinding, *, device: torch.device | str = "cpu"
) -> LaneCheckpoint:
    """Read a snapshot file back as a checkpoint on `device`.

    Raises:
        the format's errors: damaged bytes, `SnapshotSchemaError`, `SnapshotVersionError`,
        `SnapshotBindingError` (another artifact or drafter).
    """
    snap = read_snapshot(path, expect=binding)
    dev = torch.device(device)
    drafter = None
    if snap.binding.drafter != "off":
        drafter = DrafterSnapshot(
            num_tokens=snap.drafter_num_tokens,
            tensors={k: v.to(dev) for k, v in snap.drafter.items()},
            meta=dict(snap.drafter_meta),
        )
    return LaneCheckpoint(
        token_ids=snap.token_ids,
        model={k: v.to(dev) for k, v in snap.model.items()},
        drafter=drafter,
        drafter_name=snap.binding.drafter,
        last_logits=None if snap.last_logits is None else snap.last_logits.to(dev),
        is_truncatable=snap.is_truncatable,
        kind=snap.kind,
    )


def checkpoint_file_name(checkpoint: LaneCheckpoint) -> str:
    """The file name of a checkpoint in a snapshot directory: sha256 of its drafter and token ids."""
    h = hashlib.sha256(checkpoint.drafter_name.encode())
    h.update(b"\0")
    h.update(b"".join(int(t).to_bytes(4, "little") for t in checkpoint.token_ids))
    return h.hexdigest()[:32] + SUFFIX


class SnapshotDirectory:
    """A folder of snapshot files for a warm restart (module docstring).

    Args:
        folder: the directory (created when missing).
        binding: the artifact and drafter the server runs; files bound to others are refused on load.
    """

    def __init__(self, folder: str | os.PathLike[str], binding: SnapshotBinding) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.binding = binding

    @property
    def prefix(self) -> str:
        """The file name prefix of this artifact's and drafter's snapshots."""
        return f"{self.binding.artifact_sha256[:16]}-{self.binding.drafter}-"

    def files(self) -> list[Path]:
        """This artifact's and drafter's snapshot files in the folder, oldest first (by mtime)."""
        return sorted(
            self.folder.glob(glob.escape(self.prefix) + "*" + SUFFIX),
            key=lambda p: (p.stat().st_mtime_ns, p.name),
        )

    def save(self, cache: PrefixCache) -> int:
        """Write the pool's checkpoints not on disk yet (least recently used first) and remove the
        files of checkpoints it no longer holds. Returns the number of files written."""
        keep: set[str] = set()
        written = 0
        ckpts = [*cache.entries("host"), *cache.entries("card")]
        for ckpt in ckpts:
            if ckpt.drafter_name != self.binding.drafter:
                continue
            name = self.prefix + checkpoint_file_name(ckpt)
            keep.add(name)
            path = self.folder / name
            if path.exists():
                os.utime(path)  # the LRU order: touched in pool order
                continue
            save_checkpoint(path, ckpt, self.binding)
            written += 1
        for path in self.files():
            if path.name not in keep:
                path.unlink(missing_ok=True)
        return written

    def load(self, cache: PrefixCache, *, device: torch.device | str = "cpu") -> int:
        """Insert every snapshot that reads back into `cache` (oldest first); refused files are
        logged and left alone. Returns the number inserted."""
        n = 0
        for path in self.files():
            try:
                ckpt = load_checkpoint(path, self.binding, device=device)
            except FormatError as exc:
                log.warning("snapshot %s refused: %s", path, exc)
                continue
            n += bool(cache.insert(ckpt))
        return n
