"""Build recipes: what to build for one model, as a small TOML file under `artifacts/recipes/`.

    name = "smollm2-135m"             # artifact NAME (files NAME.ninfer, NAME_mtp.ninfer)

    [shortlist]
    size = 131072                     # rows of the Q4 shortlist head (the whole vocabulary if smaller)
    corpus = ["corpus/*.txt"]         # token-frequency source: text files (globs) tokenized with the
                                      # model's tokenizer ...
    counts = "counts.tsv"             # ... or a counts file ("id<TAB>count" lines, or JSON); not both

    [modules]
    widths = [1, 2, 4, 8, 16, 32]     # verify row widths to compile (a subset of the card's; default all;
                                      # [] on the cpu card only: no modules, the runtime runs torch linears)
    llvm_mcpu = "x86-64-v3"           # cpu card only: LLVM CPU model (default: generic x86-64); checked
                                      # against the CPU names of TVM's LLVM
    q4_pad_k = true                   # CUDA cards: q4 linears whose in_features is a multiple of 32 but
                                      # not of 128 take the tiled route too, padded with zero columns to
                                      # the next multiple of 128 (default false: the TensorIR route;
                                      # refused on the cpu card)

    [drafter]
    prefix = "dflash2."               # name prefix of the grafted drafter's tensors

Relative paths are resolved against the recipe file's folder. Unknown keys are refused, so a typo
is an error rather than a silently ignored setting.
"""

from __future__ import annotations

import glob
import hashlib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignis.compiler.build.errors import RecipeError

#: Default size of the shortlist head (rows).
SHORTLIST_SIZE = 131_072

#: Default prefix of the grafted DFlash2 drafter's tensors.
DRAFTER_PREFIX = "dflash2."

_TOP = {"name", "description", "shortlist", "modules", "drafter"}
_SHORTLIST = {"size", "corpus", "counts"}
_MODULES = {"widths", "llvm_mcpu", "q4_pad_k"}
_DRAFTER = {"prefix"}


@dataclass(frozen=True)
class Recipe:
    """A parsed build recipe (defaults when no recipe is given).

    Attributes:
        path: the recipe file, or None for the defaults.
        name: artifact NAME, or None to take the output directory's name.
        description: free text, informational.
        shortlist_size: rows of the shortlist head (>= 1).
        corpus: text files (resolved, sorted, globs expanded) whose tokens are counted.
        counts: a counts file, or None.
        widths: widths to compile, or None for every width of the card profile.
        llvm_mcpu: LLVM CPU model for the cpu card's modules, or None for the generic target.
        q4_pad_k: CUDA cards: q4 linears with K % 128 != 0 (K % 32 == 0) on the tiled route, K padded
            with zero columns to a multiple of 128 (`ignis.compiler.build.modules.ModulePlan.q4_pad_k`).
        drafter_prefix: name prefix of the grafted drafter's tensors (ends with ".").
        sha256: hex sha256 of the recipe file's bytes ("" for the defaults).
    """

    path: Path | None = None
    name: str | None = None
    description: str = ""
    shortlist_size: int = SHORTLIST_SIZE
    corpus: tuple[Path, ...] = ()
    counts: Path | None = None
    widths: tuple[int, ...] | None = None
    llvm_mcpu: str | None = None
    q4_pad_k: bool = False
    drafter_prefix: str = DRAFTER_PREFIX
    sha256: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The recipe as recorded in the manifest's provenance (paths by file name only)."""
        return {
            "file": None if self.path is None else self.path.name,
            "sha256": self.sha256 or None,
            "name": self.name,
            "shortlist_size": self.shortlist_size,
            "corpus": [p.name for p in self.corpus],
            "counts": None if self.counts is None else self.counts.name,
            "widths": None if self.widths is None else list(self.widths),
            "llvm_mcpu": self.llvm_mcpu,
            "q4_pad_k": self.q4_pad_k,
            "drafter_prefix": self.drafter_prefix,
        }


#: Longest artifact NAME, in UTF-8 bytes: the container writer's temporary file
#: `.NAME_mtp.ninfer.<12 hex>.tmp` must fit a 255-byte file name.
NAME_MAX_BYTES = 255 - len("._mtp.ninfer.123456789abc.tmp")


def name_problem(name: str) -> str | None:
    """Why `name` cannot be an artifact NAME (the stem of NAME.ninfer), or None when it can: empty,
    blank or padded with spaces, a control character (NUL, newline, ...), a path separator, a leading
    dot, or longer than `NAME_MAX_BYTES` bytes."""
    if not name or not name.strip():
        return "it is empty or blank"
    if name != name.strip():
        return "it starts or ends with white space"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "it holds a control character"
    if "/" in name or "\\" in name:
        return "it holds a path separator"
    if name.startswith("."):
        return "it starts with '.'"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid UTF-8"
    if size > NAME_MAX_BYTES:
        return f"it is {size} bytes long; at most {NAME_MAX_BYTES} fit a file name"
    return None


def _table(raw: dict[str, Any], key: str, allowed: set[str], path: Path) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise RecipeError(f"{path}: [{key}] must be a table")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise RecipeError(f"{path}: unknown key(s) {unknown} in [{key}]; allowed: {sorted(allowed)}")
    return value


def load_recipe(path: str | os.PathLike[str] | None) -> Recipe:
    """Read and validate a recipe; `None` gives the defaults.

    Raises:
        RecipeError: unreadable file, invalid TOML, an unknown key, a value of the wrong type, a corpus
            glob matching nothing, a missing counts file, both corpus and counts, a bad prefix.
    """
    if path is None:
        return Recipe()
    p = Path(path)
    try:
        data = p.read_bytes()
        raw = tomllib.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RecipeError(f"{p}: cannot read the recipe: {exc}") from exc
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise RecipeError(f"{p}: unknown key(s) {unknown}; allowed: {sorted(_TOP)}")
    base = p.resolve().parent
    name = raw.get("name")
    if name is not None:
        problem = name_problem(name) if isinstance(name, str) else "it is not a string"
        if problem is not None:
            shown = repr(name) if len(repr(name)) <= 64 else repr(name)[:48] + "..."
            raise RecipeError(f"{p}: name must be a plain file name, got {shown}: {problem}")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise RecipeError(f"{p}: description must be a string")

    sl = _table(raw, "shortlist", _SHORTLIST, p)
    size = sl.get("size", SHORTLIST_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise RecipeError(f"{p}: shortlist.size must be a positive integer, got {size!r}")
    corpus_spec = sl.get("corpus", [])
    if isinstance(corpus_spec, str):
        corpus_spec = [corpus_spec]
    if not isinstance(corpus_spec, list) or not all(isinstance(c, str) for c in corpus_spec):
        raise RecipeError(f"{p}: shortlist.corpus must be a string or a list of strings (paths or globs)")
    corpus: list[Path] = []
    for spec in corpus_spec:
        pattern = spec if os.path.isabs(spec) else str(base / spec)
        matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True) if Path(m).is_file())
        if not matches:
            raise RecipeError(f"{p}: shortlist.corpus entry {spec!r} matches no file (looked for {pattern})")
        corpus += matches
    counts = sl.get("counts")
    counts_path: Path | None = None
    if counts is not None:
        if not isinstance(counts, str):
            raise RecipeError(f"{p}: shortlist.counts must be a path string")
        counts_path = Path(counts) if os.path.isabs(counts) else base / counts
        if not counts_path.is_file():
            raise RecipeError(f"{p}: shortlist.counts file {counts_path} does not exist")
    if corpus and counts_path is not None:
        raise RecipeError(f"{p}: give shortlist.corpus or shortlist.counts, not both")

    mods = _table(raw, "modules", _MODULES, p)
    widths = mods.get("widths")
    if widths is not None and (
        not isinstance(widths, list)
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths)
    ):
        raise RecipeError(f"{p}: modules.widths must be a list of positive integers, got {widths!r}")
    # widths = [] is allowed on the cpu card only (checked in the plan): no compiled linears, the runtime
    # runs every linear in torch (LinearBackend without modules).
    mcpu = mods.get("llvm_mcpu")
    if mcpu is not None and (not isinstance(mcpu, str) or not mcpu.strip() or mcpu != mcpu.strip()):
        raise RecipeError(
            f"{p}: modules.llvm_mcpu must be an LLVM CPU name such as 'x86-64-v3', got {mcpu!r}"
        )

    pad_k = mods.get("q4_pad_k", False)
    if not isinstance(pad_k, bool):
        raise RecipeError(f"{p}: modules.q4_pad_k must be true or false, got {pad_k!r}")

    dr = _table(raw, "drafter", _DRAFTER, p)
    prefix = dr.get("prefix", DRAFTER_PREFIX)
    if not isinstance(prefix, str) or not prefix.endswith(".") or len(prefix) < 2:
        raise RecipeError(f"{p}: drafter.prefix must be a string ending in '.', got {prefix!r}")

    return Recipe(
        path=p,
        name=name,
        description=description,
        shortlist_size=size,
        corpus=tuple(dict.fromkeys(corpus)),
        counts=counts_path,
        widths=None if widths is None else tuple(sorted(set(widths))),
        llvm_mcpu=mcpu,
        q4_pad_k=pad_k,
        drafter_prefix=prefix,
        sha256=hashlib.sha256(data).hexdigest(),
        raw=raw,
    )


__all__ = ["DRAFTER_PREFIX", "NAME_MAX_BYTES", "SHORTLIST_SIZE", "Recipe", "load_recipe", "name_problem"]
