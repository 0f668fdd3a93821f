"""docs/serving.md's examples run as pasted: no bare GGUF file names, no socket folder that only a
service manager creates, and every example that shows generated text is greedy (temperature 0)
unless it demonstrates a seed."""

from __future__ import annotations

import json
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_shell_examples_name_real_paths() -> None:
    shell = "\n".join(_blocks("bash"))
    assert shell
    for line in shell.splitlines():
        code = line.split("#", 1)[0]
        assert "/run/ignis" not in code, line  # exists only under a service manager
        for word in re.findall(r"\S+\.gguf\b", code):
            assert word.startswith(("$", '"$', "/")), f"bare GGUF name outside its folder: {line}"
    assert "find_smollm2" in shell  # the GGUF's path is computed, not assumed


def test_text_examples_are_greedy() -> None:
    bodies = [json.loads(b) for b in re.findall(r"-d '(\{.*?\})'", "\n".join(_blocks("bash")))]
    assert len(bodies) >= 4
    for body in bodies:
        if "seed" in body:
            continue  # the sampling example: reproducible through its seed
        assert body.get("temperature") == 0, body
    python = "\n".join(_blocks("python"))
    creates = python.count(".create(")
    assert creates >= 3 and python.count("temperature=0") == creates


def test_the_docs_explain_the_two_rates_and_updating_an_artifact() -> None:
    text = DOC.read_text()
    assert "tokens per verify round" in text and "draft acceptance rate" in text
    assert "## Updating an artifact" in text and "status 75" in text
