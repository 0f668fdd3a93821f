"""A served artifact's files modified in place (written to, truncated: what `cp` over a served file
does) are detected and stop the server with a clear log line and exit status 75; a file replaced by
rename (the supported way) keeps the loaded copy intact and is only reported."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ignis.formats import NinferReader, NinferWriter
from ignis.runtime.artifact_guard import (
    EXIT_ARTIFACT_CHANGED,
    ArtifactChangedError,
    ArtifactGuard,
    watch_artifact,
)

W = np.arange(4096, dtype=np.float32)


def _artifact(root: Path) -> Any:
    root.mkdir(exist_ok=True)
    with NinferWriter(root / "m.ninfer") as w:
        w.add_tensor("w", W)
    (root / "linear.so").write_bytes(b"\x7fELF" + bytes(100))
    files = [SimpleNamespace(path="m.ninfer"), SimpleNamespace(path="linear.so")]
    return SimpleNamespace(
        path=root, weights=NinferReader(root / "m.ninfer"), mtp=None, manifest=SimpleNamespace(files=files)
    )


def _bump_mtime(p: Path) -> None:
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_in_place_write_of_the_same_size_is_detected(tmp_path: Path) -> None:
    art = _artifact(tmp_path / "a")
    guard = ArtifactGuard(art)
    guard.check()
    p = tmp_path / "a" / "m.ninfer"
    with open(p, "r+b") as f:  # as an editor or `dd conv=notrunc` would
        f.seek(4096)
        f.write(b"\xff" * 16)
    _bump_mtime(p)
    with pytest.raises(ArtifactChangedError, match="modified in place") as info:
        guard.check()
    assert info.value.path == str(p) and "symlink" in str(info.value)
    art.weights.close()


def test_truncation_is_detected_before_anything_reads_the_cut_pages(tmp_path: Path) -> None:
    art = _artifact(tmp_path / "a")
    guard = ArtifactGuard(art)
    os.truncate(tmp_path / "a" / "m.ninfer", 0)  # `cp new m.ninfer` starts with this
    with pytest.raises(ArtifactChangedError, match=r"truncated from \d+ to 0 bytes"):
        guard.check()
    art.weights.close()


def test_replacing_by_rename_keeps_the_loaded_copy_and_is_reported_once(tmp_path: Path) -> None:
    art = _artifact(tmp_path / "a")
    guard = ArtifactGuard(art)
    new = _artifact(tmp_path / "b")
    new.weights.close()
    os.replace(tmp_path / "b" / "m.ninfer", tmp_path / "a" / "m.ninfer")
    os.replace(tmp_path / "b" / "linear.so", tmp_path / "a" / "linear.so")
    guard.check()  # not a change of what is served
    assert sorted(guard.replaced()) == [str(tmp_path / "a" / "linear.so"), str(tmp_path / "a" / "m.ninfer")]
    assert guard.replaced() == []
    np.testing.assert_array_equal(art.weights.numpy("w"), W)
    art.weights.close()
    assert guard.closed


def test_a_module_modified_in_place_is_detected(tmp_path: Path) -> None:
    art = _artifact(tmp_path / "a")
    guard = ArtifactGuard(art)
    with open(tmp_path / "a" / "linear.so", "ab") as f:
        f.write(b"more")
    with pytest.raises(ArtifactChangedError, match=r"linear\.so: was modified in place"):
        guard.check()
    art.weights.close()


def test_the_watchdog_reports_a_change_and_stops_when_closed(tmp_path: Path) -> None:
    art = _artifact(tmp_path / "a")
    seen: list[ArtifactChangedError] = []
    stop = watch_artifact(art, interval=0.05, on_change=seen.append, lease=False)  # polling alone
    os.truncate(tmp_path / "a" / "m.ninfer", 4096)
    deadline = time.monotonic() + 20
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(seen) == 1 and "truncated" in seen[0].detail
    stop.set()
    art.weights.close()


_SERVER = """
import logging, sys, time
from pathlib import Path
from types import SimpleNamespace
from ignis.formats import NinferReader
from ignis.runtime.artifact_guard import watch_artifact
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
root = Path(sys.argv[1])
r = NinferReader(root / "m.ninfer")
art = SimpleNamespace(path=root, weights=r, mtp=None,
                      manifest=SimpleNamespace(files=[SimpleNamespace(path="m.ninfer")]))
watch_artifact(art, interval=0.05)
print("serving", flush=True)
total = 0.0
while True:  # a lane reading the mapping; it must never read a cut page
    if (root / "stop").exists():
        total += float(r.numpy("w")[-1])
    time.sleep(0.01)
"""


def _serve(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SERVER), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
    return proc


def _leases_work(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def test_cp_over_a_served_file_stops_the_process_before_the_file_changes(tmp_path: Path) -> None:
    _artifact(tmp_path / "a").weights.close()
    _artifact(tmp_path / "b").weights.close()
    proc = _serve(tmp_path / "a")
    # cp truncates the served file, then writes: the lease holds it back until the server is gone
    subprocess.run(["cp", str(tmp_path / "b" / "m.ninfer"), str(tmp_path / "a" / "m.ninfer")], timeout=60)
    (tmp_path / "a" / "stop").touch()  # a lane would now read the mapping
    _, err = proc.communicate(timeout=60)
    if not _leases_work(tmp_path):  # polling alone: a read may win the race, but never silently
        assert proc.returncode == EXIT_ARTIFACT_CHANGED or "Fatal Python error: Bus error" in err, err
        return
    assert proc.returncode == EXIT_ARTIFACT_CHANGED, err
    assert "CRITICAL" in err and "m.ninfer: is being opened for writing" in err and "symlink" in err
    assert "Bus error" not in err
