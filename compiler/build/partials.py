"""The build's temporary directories: each is claimed with an flock held for the whole build, and
stale ones (left by a build killed with SIGKILL, a power cut or an OOM kill: nothing ran to remove
them) are removed by the next build into the same folder.

A build writes into `.OUT.<8 hex>.partial` beside `out` and renames it to `out` at the end
(`pipeline.build_artifact`). The directory is locked with `flock(LOCK_EX)` on an fd of the directory
itself, from right after `mkdir` until the build ends; the kernel drops the lock when the process
dies, however it dies. So a `.partial` directory that can be locked is not in use: the cleaner takes
the lock itself (no live build can then start using it) and removes the directory. A directory
younger than `MIN_AGE_S` is never touched, which covers the instant between a live build's `mkdir`
and its `flock`. A file system without flock support makes every directory look in use: nothing is
removed there.

`.OUT.<8 hex>.old` is the previous artifact moved aside while `out` is replaced; it is removed only
when `out` exists (the replacement finished). When `out` is missing, a replacement was cut between
its two renames and the `.old` directory holds the only copy of the previous artifact: it is kept,
and reported so the user can rename it back.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

#: `.OUT.<8 hex>.partial` (a build's temporary directory) and `.OUT.<8 hex>.old` (a replaced artifact).
LEFTOVER_RE = re.compile(r"^\.(?P<out>.+)\.[0-9a-f]{8}\.(?P<kind>partial|old)$")

#: Seconds a leftover must be old (by mtime) before it may be removed.
MIN_AGE_S = 5.0

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC


@dataclass
class PartialDir:
    """A claimed temporary build directory; `release()` (or process death) drops its lock.

    Attributes:
        path: the directory (`parent/.OUT.<8 hex>.partial`).
        fd: an fd of the directory holding `flock(LOCK_EX)`, or -1 where flock is unsupported.
    """

    path: Path
    fd: int

    def release(self) -> None:
        """Close the locking fd (the lock follows the directory through its rename to `out`)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def claim_partial(parent: Path, out_name: str) -> PartialDir:
    """Create `parent/.OUT_NAME.<8 hex>.partial` and lock it for this process.

    Raises:
        OSError: the directory cannot be created or opened.
    """
    path = parent / f".{out_name}.{secrets.token_hex(4)}.partial"
    path.mkdir()
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        path.rmdir()
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # no flock on this file system: the cleaner will not be able to lock it either
        os.close(fd)
        fd = -1
    return PartialDir(path, fd)


@dataclass(frozen=True)
class Cleanup:
    """What `remove_stale` did in one folder.

    Attributes:
        removed: leftover directories removed.
        kept_old: `.old` directories kept because their `out` is missing (an interrupted replacement).
    """

    removed: list[Path]
    kept_old: list[Path]


def remove_stale(parent: Path, *, now: float | None = None) -> Cleanup:
    """Remove the leftovers of dead builds in `parent` (any output name); never one a live build holds.

    Args:
        parent: the folder that holds (or will hold) the output directory.
        now: the current time (seconds since the epoch) for the age check; `time.time()` by default.

    Returns:
        A Cleanup. Directories that cannot be opened, locked or removed are skipped silently (they are
        someone else's, or in use).
    """
    now = time.time() if now is None else now
    removed: list[Path] = []
    kept: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return Cleanup(removed, kept)
    for entry in entries:
        m = LEFTOVER_RE.match(entry.name)
        if m is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if now - entry.stat(follow_symlinks=False).st_mtime < MIN_AGE_S:
                continue
        except OSError:
            continue
        path = Path(entry.path)
        if m["kind"] == "old":
            if (parent / m["out"]).exists():
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    removed.append(path)
            else:
                kept.append(path)
            continue
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by a live build (or no flock here): not ours to remove
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
        finally:
            os.close(fd)
    return Cleanup(removed, kept)


__all__ = ["LEFTOVER_RE", "MIN_AGE_S", "Cleanup", "PartialDir", "claim_partial", "remove_stale"]
