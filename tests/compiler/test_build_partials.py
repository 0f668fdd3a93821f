"""A build killed with SIGKILL leaves its `.partial` directory; later builds remove such leftovers,
never the directory of a live build (flock) nor the only copy of a replaced artifact."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from ignis.compiler.build import build_artifact, partials
from ignis.compiler.build.errors import ModuleBuildError
from ignis.compiler.build.partials import MIN_AGE_S, claim_partial, remove_stale

# The child loads partials.py alone (not the ignis.compiler package, which imports torch): fast.
_CHILD = """
import importlib.util, os, signal, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("partials", sys.argv[3])
mod = sys.modules["partials"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
part = mod.claim_partial(Path(sys.argv[1]), "art")
(part.path / "weights.ninfer").write_bytes(b"x" * 100)
print(part.path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _child(parent: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(parent), mode, partials.__file__],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the child did not claim a directory"
    return proc, Path(line)


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_killed_builders_partial_is_removed_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    dead, dead_dir = _child(tmp_path, "kill")
    assert dead.wait(timeout=60) == -9 and dead_dir.is_dir()
    live, live_dir = _child(tmp_path, "live")
    try:
        for d in (dead_dir, live_dir):
            _age(d, MIN_AGE_S + 60)
        young = claim_partial(tmp_path, "young")
        young.release()  # unlocked, but too young: may be a live build between mkdir and flock
        cleanup = remove_stale(tmp_path)
        assert cleanup.removed == [dead_dir]
        assert not dead_dir.exists() and live_dir.is_dir() and young.path.is_dir()
        assert (live_dir / "weights.ninfer").read_bytes() == b"x" * 100
    finally:
        live.kill()
        live.wait(timeout=60)
    # once its builder is gone, the formerly live directory is stale too
    assert set(remove_stale(tmp_path, now=time.time() + MIN_AGE_S + 60).removed) == {live_dir, young.path}
    assert list(tmp_path.iterdir()) == []


def test_old_directories_are_kept_when_they_hold_the_only_copy(tmp_path: Path) -> None:
    (tmp_path / "art").mkdir()
    done = tmp_path / ".art.0123abcd.old"
    cut = tmp_path / ".gone.89abcdef.old"
    unrelated = tmp_path / ".art.notahex.partial"
    for d in (done, cut, unrelated):
        d.mkdir()
        _age(d, MIN_AGE_S + 60)
    cleanup = remove_stale(tmp_path)
    assert cleanup.removed == [done] and cleanup.kept_old == [cut]
    assert cut.is_dir() and unrelated.is_dir() and (tmp_path / "art").is_dir()


def _helper(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_next_build_removes_a_killed_builds_partial(tmp_path: Path) -> None:
    hf_tiny = _helper("hf_tiny")
    model = hf_tiny.save_tiny(
        hf_tiny.tiny_model("llama"), tmp_path / "ckpt", tokenizer=hf_tiny.tiny_tokenizer()
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dead, dead_dir = _child(out_dir, "kill")
    assert dead.wait(timeout=60) == -9
    _age(dead_dir, MIN_AGE_S + 60)
    lines: list[str] = []

    def fail(*_a: Any, **_k: Any) -> Any:  # stop the build right after it claimed its own directory
        assert len([p for p in out_dir.iterdir() if p.name.endswith(".partial")]) == 1
        raise ModuleBuildError("stop here")

    with mock.patch("ignis.compiler.build.pipeline.write_jobs", fail), pytest.raises(ModuleBuildError):
        build_artifact(card="cpu", model=model, out=out_dir / "art", progress=False, echo=lines.append)
    assert list(out_dir.iterdir()) == []
    assert any(f"removed {dead_dir.name}: left behind by a build that was killed" in ln for ln in lines)
