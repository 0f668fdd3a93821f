"""The documents' references resolve: every relative Markdown link in README.md and docs/ names an
existing file, every `docs/...` path they quote exists, and every command on the performance page
names a script or module that exists in the repository (or says it cannot be rerun)."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LOG = ROOT / "docs" / "perf" / "log"
PERF = ROOT / "docs" / "perf" / "README.md"

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(\s*(?:<([^>]+)>|([^)\s]+))(?:\s+\"[^\"]*\")?\s*\)")
_DOC_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]+\.md)\b")
_NOT_A_FILE = ("http://", "https://", "mailto:", "#")


def _prose(text: str) -> str:
    """`text` without fenced code blocks and code spans (a link inside code is not a link)."""
    return _SPAN.sub("", _FENCE.sub("", text))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def relative_links(text: str) -> list[str]:
    """The relative link targets of the Markdown `text`, without their `#fragment`."""
    out = []
    for angled, bare in _LINK.findall(_prose(text)):
        target = angled or bare
        if target.startswith(_NOT_A_FILE):
            continue
        out.append(target.split("#", 1)[0])
    return out


def test_the_link_parser_finds_links_and_skips_code() -> None:
    text = "see [a](x/a.md#h) and [b](<b c.md>), [web](https://e.x), [top](#h)\n`[no](n.md)`\n"
    text += "```\n[no](m.md)\n```\n"
    assert relative_links(text) == ["x/a.md", "b c.md"]


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    links = relative_links(doc.read_text(encoding="utf-8"))
    dead = [t for t in links if t and not (doc.parent / t).exists()]
    assert not dead, f"{_rel(doc)}: links to missing files: {dead}"


@pytest.mark.parametrize("doc", [d for d in DOCS if LOG not in d.parents], ids=_rel)
def test_every_quoted_docs_path_exists(doc: Path) -> None:
    """A `docs/...md` path named in a document (linked or quoted) exists. The lab log is exempt: it
    keeps the paths of its time (docs/perf/log/README.md maps them)."""
    text = doc.read_text(encoding="utf-8")
    dead = sorted({p for p in _DOC_PATH.findall(text) if not (ROOT / p).exists()})
    assert not dead, f"{_rel(doc)}: names missing documents: {dead}"


# --- the commands on the performance page --------------------------------------------------------

_PYTHONS = {"python", "python3", ".venv/bin/python"}


def _console_scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def _commands(text: str) -> list[tuple[str, str]]:
    """(command, the paragraph it is in) for every fenced line and code span that starts with a
    python interpreter, `bash`, or an ignis console script; `$VAR=...` prefixes are skipped."""
    out: list[tuple[str, str]] = []
    for para in re.split(r"\n\s*\n", text):
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", para, re.S | re.M):
            out += [(ln.strip(), para) for ln in block.splitlines() if ln.strip()]
        for span in _SPAN.findall(_FENCE.sub("", para)):
            out.append((" ".join(span.split()), para))
    first_words = _PYTHONS | {"bash"} | _console_scripts()
    keep = []
    for cmd, para in out:
        words = cmd.split()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if len(words) > 1 and words[0] in first_words:  # a bare interpreter's name is no command
            keep.append((" ".join(words), para))
    return keep


def _problem(cmd: str, para: str, scripts: set[str]) -> str | None:
    """Why `cmd` does not run from the repository, or None."""
    words = cmd.split()
    head = words[0]
    if head in scripts:
        return None
    target = words[1] if len(words) > 1 else ""
    if head in _PYTHONS and target == "-m":
        module = words[2]
        if not module.startswith("ignis."):
            return f"module {module} is not ignis's"
        return None if importlib.util.find_spec(module) is not None else f"no module {module}"
    if target.startswith(".device/"):
        ok = "cannot be rerun" in " ".join(para.split())
        return None if ok else f"{target} is not in the repository and the text does not say so"
    return None if (ROOT / target).is_file() else f"no file {target}"


def test_the_command_parser_reads_spans_and_fences() -> None:
    text = (
        "Run `python -m ignis.tools.bench.topk --modules d` then\n```bash\nbash tools/x.sh 1\n```\n\n"
        "`OUT=o python3 -m ignis.tools.bench.q4_tiled\n  run --widths 8` and `a plain span`\n"
    )
    cmds = sorted(c for c, _ in _commands(text))
    assert cmds == [
        "bash tools/x.sh 1",
        "python -m ignis.tools.bench.topk --modules d",
        "python3 -m ignis.tools.bench.q4_tiled run --widths 8",
    ]
    scripts = _console_scripts()
    assert _problem("bash tools/x.sh 1", "", scripts) == "no file tools/x.sh"
    assert _problem("python -m ignis.tools.bench_topk", "", scripts) == "no module ignis.tools.bench_topk"
    assert _problem(".venv/bin/python .device/s/b.py", "a script", scripts) is not None
    assert _problem("python .device/s/b.py", "it cannot\nbe rerun", scripts) is None


_DEVICE_SCRIPT = re.compile(r"\.device/[\w./-]+\.(?:py|sh)\b")


def test_perf_page_has_a_command_for_its_figures() -> None:
    assert len(_commands(PERF.read_text(encoding="utf-8"))) >= 10


@pytest.mark.parametrize("doc", [d for d in DOCS if LOG not in d.parents], ids=_rel)
def test_doc_commands_name_existing_scripts_and_modules(doc: Path) -> None:
    """Every command in README.md and docs/ (the lab log excepted: docs/perf/log/README.md maps its old
    paths) runs from the repository, or its paragraph says it cannot be rerun."""
    text = doc.read_text(encoding="utf-8")
    scripts = _console_scripts()
    cmds = _commands(text)
    problems = [f"{cmd!r}: {why}" for cmd, para in cmds if (why := _problem(cmd, para, scripts))]
    # a session script named anywhere (not only as a command) comes with the note that it is gone
    for para in re.split(r"\n\s*\n", text):
        if _DEVICE_SCRIPT.search(para) and "cannot be rerun" not in " ".join(para.split()):
            problems.append(f"names {_DEVICE_SCRIPT.findall(para)} without saying it cannot be rerun")
    assert not problems, "\n".join(problems)
