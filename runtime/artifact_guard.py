"""Watching a loaded artifact's files: a file changed in place while served stops the server with a
clear log line instead of letting it answer from half-rewritten weights or die of SIGBUS.

The containers are memory-mapped (`NinferReader`), and compiled modules are `dlopen`ed: the process
reads the files themselves while it serves. Two ways of "updating" an artifact differ completely:

- **replacing** it: build or copy the new artifact into a new directory and switch a symlink to it
  (`ln -sfn new current.tmp && mv -T current.tmp current`), or `mv` a new file over the old path.
  The old files stay intact (a rename never touches the inode a process has open or mapped), the
  running server keeps serving exactly what it loaded, and a restart loads the new files. Safe.
- **modifying** it in place: `cp new.ninfer artifact/model.ninfer`, an editor, `truncate`, a
  build with `--overwrite` of a plain directory copy... `cp` truncates the existing file before it
  writes: reading a cut page raises SIGBUS, which kills the process; pages written over hold other
  bytes than the ones validated at load. Unsafe: the served model is no longer the loaded one.

`ArtifactGuard` records each file's identity at load: for the containers the size and mtime of the
very file mapped (the reader holds it open: `NinferReader.changed_on_disk`), for the other files
(modules, the manifest) device, inode, size and mtime of the path. `check()` compares (a few fstat /
stat calls, microseconds) and raises `ArtifactChangedError` for a file modified in place; a file
replaced by rename is reported once as a warning (`replaced()`), and serving continues.

`watch_artifact(art)` guards the served artifact two ways:

- a read **lease** on every container (`fcntl(F_SETLEASE, F_RDLCK)`, Linux; see fcntl(2) "Leases"):
  when another process opens a served container for writing or truncates it, the kernel signals
  this process (SIGIO) and holds that open / truncate back (up to `/proc/sys/fs/lease-break-time`
  seconds, 45 by default) until the lease is released. So the server stops *before* `cp` or an
  editor changes a byte, and no lane can read a cut page. Leases need the files to be owned by the
  server's user (or CAP_LEASE), a local file system, and `watch_artifact` called on the main thread
  (Python signal handlers run there); without them the server logs that it relies on polling alone.
- **polling** every `interval` seconds in a daemon thread (`check()`), for modules, the manifest,
  and containers without a lease.

On a change it logs a CRITICAL line naming the file, what happened and the safe procedure, and exits
the process with status `EXIT_ARTIFACT_CHANGED` (75, EX_TEMPFAIL): a supervisor (systemd
`Restart=on-failure`, a container restart policy) then starts a fresh server on the new files.
Exiting at once is the only safe reaction: a lane thread may be reading the mapping, and a SIGBUS
cannot be handled in Python. It also enables `faulthandler`, so that a SIGBUS that wins a race
(polling only) still prints "Fatal Python error: Bus error" and the stacks instead of a silent death.
"""

from __future__ import annotations

import faulthandler
import fcntl
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.runtime.errors import IgnisRuntimeError

__all__ = [
    "EXIT_ARTIFACT_CHANGED",
    "ArtifactChangedError",
    "ArtifactGuard",
    "hold_leases",
    "watch_artifact",
]

log = logging.getLogger("ignis.runtime.artifact")

#: Exit status of a server stopped because its artifact changed in place (EX_TEMPFAIL: try again).
EXIT_ARTIFACT_CHANGED = 75

#: Seconds between two checks of the watchdog thread.
WATCH_INTERVAL_S = 1.0

_SAFE_WAY = (
    "replace an artifact by building or copying it into a new directory and switching a symlink "
    "(or by mv of a new file over the old one), never by writing into the served files; restart the "
    "server to serve the new files (docs/serving.md, 'Updating an artifact')"
)


class ArtifactChangedError(IgnisRuntimeError):
    """A file of the served artifact was modified in place (written to or truncated) after loading.

    Attributes:
        path: the file.
        detail: what changed.
    """

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}; stop serving it: {_SAFE_WAY}")
        self.path = path
        self.detail = detail


@dataclass(frozen=True)
class _PathIdentity:
    dev: int
    ino: int
    size: int
    mtime_ns: int


def _identity(path: Path) -> _PathIdentity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _PathIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ArtifactGuard:
    """The identity of a loaded artifact's files, and checks against it.

    Args:
        art: a loaded `ignis.runtime.artifact.Artifact` (its readers must be open).
    """

    def __init__(self, art: Any) -> None:
        self.art = art
        self.readers = [r for r in (art.weights, art.mtp) if r is not None]
        mapped = {os.path.realpath(r.path) for r in self.readers}
        self.paths: dict[Path, _PathIdentity | None] = {}
        for f in art.manifest.files:
            p = Path(art.path) / f.path
            if os.path.realpath(p) not in mapped:
                self.paths[p] = _identity(p)
        self._replaced: set[str] = set()

    @property
    def closed(self) -> bool:
        """True once the artifact was closed (nothing left to guard)."""
        return any(r.closed for r in self.readers)

    def check(self) -> None:
        """Raise if a file the process serves from was modified in place since loading.

        Raises:
            ArtifactChangedError: a container's mapped file changed size or mtime, or a module or the
                manifest changed size or mtime under the same inode.
        """
        for r in self.readers:
            detail = r.changed_on_disk()
            if detail is not None:
                raise ArtifactChangedError(r.path, detail)
        for p, was in self.paths.items():
            now = _identity(p)
            if was is None or now is None or (now.dev, now.ino) != (was.dev, was.ino):
                continue  # missing, or replaced by rename: the loaded copy (if any) is intact
            if (now.size, now.mtime_ns) != (was.size, was.mtime_ns):
                raise ArtifactChangedError(
                    str(p), f"was modified in place while loaded (size {was.size} -> {now.size} bytes)"
                )

    def replaced(self) -> list[str]:
        """Files whose path now names another file (replaced by rename, or removed) and that were not
        reported before; the loaded copies are intact. Each file is reported once."""
        out = []
        for r in self.readers:
            try:
                st = os.stat(r.path)
                moved = (st.st_dev, st.st_ino) != r.file_identity
            except OSError:
                moved = True
            if moved and r.path not in self._replaced:
                out.append(r.path)
        for p, was in self.paths.items():
            now = _identity(p)
            if was is not None and (now is None or (now.dev, now.ino) != (was.dev, was.ino)):
                if str(p) not in self._replaced:
                    out.append(str(p))
        self._replaced.update(out)
        return out


def _stop_process(err: ArtifactChangedError) -> None:
    log.critical("the artifact changed under the running server: %s (exit %d)", err, EXIT_ARTIFACT_CHANGED)
    for h in logging.getLogger().handlers + log.handlers:
        try:
            h.flush()
        except Exception:  # best effort before exiting
            pass
    sys.stderr.flush()
    os._exit(EXIT_ARTIFACT_CHANGED)


def hold_leases(guard: ArtifactGuard, on_change: Callable[[ArtifactChangedError], None]) -> list[str]:
    """Take a read lease on each container of `guard` and handle SIGIO: when a process opens one for
    writing (or truncates it), `on_change` runs before that process can change a byte; if it returns,
    the leases are released (the writer then proceeds, and polling sees the change).

    Returns:
        The paths leased (empty off the main thread, or where the kernel refuses leases: files of
        another user without CAP_LEASE, NFS).
    """
    if threading.current_thread() is not threading.main_thread():
        log.info("artifact files: no lease (not on the main thread); changes are found by polling")
        return []
    readers = []
    previous = signal.getsignal(signal.SIGIO)
    state = {"fired": False}

    def on_sigio(signum: int, frame: Any) -> None:
        broken = []
        for r in readers:
            try:
                if fcntl.fcntl(r.fileno(), fcntl.F_GETLEASE) == fcntl.F_UNLCK:
                    broken.append(r.path)
            except Exception:  # a reader closed meanwhile
                continue
        if not broken or state["fired"]:
            if callable(previous):
                previous(signum, frame)
            return
        state["fired"] = True
        try:
            on_change(
                ArtifactChangedError(
                    broken[0],
                    "is being opened for writing or truncated by another process (cp, an editor, a build "
                    "writing in place); the server stops before the file changes",
                )
            )
        finally:
            for r in readers:
                try:
                    fcntl.fcntl(r.fileno(), fcntl.F_SETLEASE, fcntl.F_UNLCK)
                except Exception:  # closed, or the lease is already gone
                    continue

    signal.signal(signal.SIGIO, on_sigio)
    for r in guard.readers:
        try:
            fcntl.fcntl(r.fileno(), fcntl.F_SETLEASE, fcntl.F_RDLCK)
            readers.append(r)
        except OSError as exc:
            log.info("artifact file %s: no lease (%s); changes are found by polling", r.path, exc.strerror)
    if not readers:
        signal.signal(signal.SIGIO, previous)
    return [r.path for r in readers]


def watch_artifact(
    art: Any,
    *,
    interval: float = WATCH_INTERVAL_S,
    on_change: Callable[[ArtifactChangedError], None] = _stop_process,
    lease: bool = True,
) -> threading.Event:
    """Guard `art` from a daemon thread: `check()` every `interval` s until the artifact is closed.

    Called on the main thread with `lease`, it also takes read leases on the containers (`hold_leases`). On a
    change, `on_change` runs (default: log CRITICAL and exit the process with status
    EXIT_ARTIFACT_CHANGED); files replaced by rename are logged once as a warning. Also enables
    `faulthandler` (SIGBUS, SIGSEGV print the stack) if it is not enabled.

    Returns:
        An event; set it to stop the thread.
    """
    if not faulthandler.is_enabled():
        faulthandler.enable()
    guard = ArtifactGuard(art)
    if lease:
        hold_leases(guard, on_change)
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval):
            if guard.closed:
                return
            try:
                guard.check()
            except ArtifactChangedError as err:
                on_change(err)
                return
            except Exception:  # a reader closed between the two checks
                if guard.closed:
                    return
                raise
            for path in guard.replaced():
                log.warning(
                    "%s was replaced on disk; this server keeps serving the files it loaded (intact); "
                    "restart it to serve the new ones",
                    path,
                )

    threading.Thread(target=run, name="ignis-artifact-guard", daemon=True).start()
    return stop
