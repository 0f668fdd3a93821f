"""The README's test command runs on parallel workers and leaves out the `long` tests; CI runs that
command and then the `long` tests, so every test but the `slow` ones runs in CI."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from long_tests import LONG

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines() if "-m pytest" in ln]
    return line.split("&&", 1)[1].split("#", 1)[0].strip()


def test_the_readme_command_is_parallel_and_ci_runs_it_and_the_long_tests() -> None:
    cmd = _readme_test_command()
    assert re.search(r"-n \d+", cmd) and '-m "not slow and not long"' in cmd
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert cmd in ci, "CI must run the README's command as written"
    assert cmd.replace('-m "not slow and not long"', '-m "long"') in ci
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(d.startswith("pytest-xdist") for d in data["project"]["optional-dependencies"]["test"])
    markers = data["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("long:") for m in markers)


def test_every_long_entry_names_an_existing_test_file() -> None:
    for prefix in LONG:
        assert (ROOT / prefix.split("::")[0]).is_file(), prefix
