"""Packaging gate: every source folder with an __init__.py is listed in pyproject's packages, so a
non-editable wheel holds every subpackage (the card's folders install as ignis.*)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {
    "formats": "ignis.formats",
    "runtime": "ignis.runtime",
    "compiler": "ignis.compiler",
    "tools": "ignis.tools",
}


def test_every_subpackage_is_listed() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {v: k for k, v in TOP.items()}
    found = set()
    for folder, name in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == set(cfg["packages"])


def test_license_is_an_spdx_expression() -> None:
    """PEP 639: a table (`{ text = ... }`) makes setuptools >= 77 print a deprecation box per build."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["license"] == "Apache-2.0"
    assert "license-files" not in data["project"] or isinstance(data["project"]["license-files"], list)
    # the string form needs setuptools 77; an older build backend would reject it
    (req,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert req == "setuptools>=77"
