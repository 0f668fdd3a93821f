"""tools/setup.sh asks for the CPU build of torch (a `+cpu` wheel: from a local copy when pip's
sources hold one, else from PyTorch's CPU index), never PyPI's default CUDA build; run hermetically
with a recording stand-in for pip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "tools" / "setup.sh"

_PIP = """#!/bin/sh
echo "$*" >> "$PIP_LOG"
case "$*" in *--dry-run*) [ "$LOCAL_TORCH" = 1 ] && exit 0 || exit 1 ;; esac
exit 0
"""


def _run(tmp_path: Path, *, local: bool) -> list[str]:
    root = tmp_path / ("local" if local else "fresh")
    (root / "tools").mkdir(parents=True)
    shutil.copy(SETUP, root / "tools" / "setup.sh")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "activate").write_text("")
    py = root / ".venv" / "bin" / "python"
    py.write_text("#!/bin/sh\nexit 0\n")
    py.chmod(0o755)
    pip = root / "pip"
    pip.write_text(_PIP)
    pip.chmod(0o755)
    log = root / "pip.log"
    env = {
        **os.environ,
        "PATH": f"{root / '.venv' / 'bin'}:{os.environ['PATH']}",  # `python` is the no-op stand-in
        "IGNIS_SETUP_PIP": str(pip),
        "PIP_LOG": str(log),
        "LOCAL_TORCH": "1" if local else "0",
    }
    subprocess.run(["bash", str(root / "tools" / "setup.sh")], env=env, check=True, timeout=60)
    return log.read_text().splitlines()


@pytest.mark.skipif(sys.platform != "linux", reason="the +cpu wheels are Linux's")
def test_a_fresh_machine_gets_torch_from_the_cpu_index(tmp_path: Path) -> None:
    calls = _run(tmp_path, local=False)
    torch = [c for c in calls if "torch" in c and "--dry-run" not in c]
    assert len(torch) == 1
    assert "torch==2.13.0+cpu" in torch[0] and "--index-url https://download.pytorch.org/whl/cpu" in torch[0]
    assert calls.index(torch[0]) < next(i for i, c in enumerate(calls) if "-e .[test,compiler]" in c)


@pytest.mark.skipif(sys.platform != "linux", reason="the +cpu wheels are Linux's")
def test_a_local_cpu_wheel_is_used_without_the_network(tmp_path: Path) -> None:
    calls = _run(tmp_path, local=True)
    torch = [c for c in calls if "torch" in c and "--dry-run" not in c]
    assert torch == ["install -q torch==2.13.0+cpu"]
