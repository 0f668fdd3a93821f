"""Step 0: resolve the build plan before any work: inputs, card profile, every tensor's dtype and size,
the files of the artifact, the estimated VRAM on the card, the modules to compile, and the disk check.

`make_plan` reads only headers (checkpoint metadata, safetensors/GGUF tensor tables, the drafter's
config) and validates everything that can be validated up front, so a build that will fail on a
missing tensor, a drafter that does not fit or an unknown card fails here, in seconds, with every
problem listed; `BuildPlan.render()` is what `ignis-build` prints before working (and all that
`--dry-run` does).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignis.compiler.build.convert import TensorJob, make_jobs, resolve_layout
from ignis.compiler.build.errors import (
    OutputExistsError,
    OutputNotWritableError,
    RecipeError,
    ShortlistError,
    UnknownCardError,
)
from ignis.compiler.build.graft import DrafterCheckpoint, check_fit, load_drafter
from ignis.compiler.build.modules import ModulePlan, linear_shapes, plan_modules
from ignis.compiler.build.mtp_companion import MTP_PREFIX, plan_mtp
from ignis.compiler.build.recipe import Recipe, load_recipe, name_problem
from ignis.compiler.build.shortlist import FrequencySource, shortlist_size
from ignis.formats.constants import ALIGNMENT, align_up
from ignis.runtime.errors import ConfigError, TensorSetError
from ignis.runtime.profiles import CardProfile, get_profile, load_profiles

#: Bytes reserved on the card beyond weights and caches (activations, workspaces, CUDA context).
VRAM_WORKSPACE = 1 << 30

#: Extra free disk demanded beyond the estimate (headers, module size uncertainty).
DISK_MARGIN = 64 << 20

#: Estimated bytes per compiled function (library size estimate for the plan only).
_BYTES_PER_FUNCTION = {"llvm": 48 << 10, "cuda": 256 << 10}

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def human(n: float) -> str:
    """Bytes as a short human string (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True)
class ShortlistPlan:
    """The shortlist head to build.

    Attributes:
        size: rows (the recipe's size, or the vocabulary when smaller).
        vocab_size: the target's vocabulary.
        hidden_size: row width.
        head_name: the target tensor whose rows are taken (lm_head.weight or the tied embedding).
        source: the token-frequency source.
    """

    size: int
    vocab_size: int
    hidden_size: int
    head_name: str
    source: FrequencySource

    @property
    def stored_bytes(self) -> int:
        """Bytes of the q4 head plus the id map."""
        return self.size * (self.hidden_size // 2 + self.hidden_size // 16) + 4 * self.size


@dataclass
class BuildPlan:
    """Everything the build will do, resolved (see `make_plan`)."""

    card: str  # card profile name
    profile: CardProfile  # the card profile
    recipe: Recipe  # the build recipe (defaults when none)
    name: str  # artifact NAME
    out: Path  # the artifact directory to create
    model_path: Path  # the target checkpoint
    checkpoint: Any  # ignis.compiler.importers.Checkpoint (lazy tensors)
    family: str  # model_type
    config: Any  # the family config
    target_jobs: list[TensorJob]  # trunk tensors, canonical names and layout
    drafter: DrafterCheckpoint | None  # the grafted drafter, if any
    drafter_jobs: list[TensorJob]  # its tensors, prefixed
    mtp_jobs: list[TensorJob]  # the MTP companion's tensors (empty: no companion)
    shortlist: ShortlistPlan | None  # the shortlist head (None when hidden % 32 != 0)
    tokenizer: Any  # ignis.runtime.tokenizer.TokenizerSpec or None
    modules: ModulePlan  # what step 5 compiles
    disk_free: int  # bytes free where the artifact is written
    notes: list[str] = field(default_factory=list)  # things the user should know

    # ---- sizes ----
    @property
    def weights_file(self) -> str:
        """File name of the target container."""
        return f"{self.name}.ninfer"

    @property
    def mtp_file(self) -> str | None:
        """File name of the MTP companion, or None."""
        return f"{self.name}_mtp.ninfer" if self.mtp_jobs else None

    @staticmethod
    def _file_bytes(jobs: list[TensorJob], extra: int = 0) -> int:
        return ALIGNMENT + sum(align_up(j.stored_bytes) for j in jobs) + extra + 256 * len(jobs) + (64 << 10)

    @property
    def tokenizer_bytes(self) -> int:
        """Bytes of the stored tokenizer (JSON blob)."""
        return 0 if self.tokenizer is None else len(self.tokenizer.tokenizer_json.encode("utf-8"))

    @property
    def weights_bytes(self) -> int:
        """Estimated size of NAME.ninfer."""
        extra = align_up(self.tokenizer_bytes) + (
            align_up(self.shortlist.stored_bytes) if self.shortlist else 0
        )
        return self._file_bytes(self.target_jobs + self.drafter_jobs, extra)

    @property
    def mtp_bytes(self) -> int:
        """Estimated size of NAME_mtp.ninfer (0 without one)."""
        return self._file_bytes(self.mtp_jobs) if self.mtp_jobs else 0

    @property
    def modules_bytes(self) -> int:
        """Rough size of the compiled libraries."""
        per = _BYTES_PER_FUNCTION["cuda" if self.modules.is_cuda else "llvm"]
        return per * self.modules.num_functions()

    @property
    def total_bytes(self) -> int:
        """Estimated artifact size."""
        return self.weights_bytes + self.mtp_bytes + self.modules_bytes

    @property
    def disk_needed(self) -> int:
        """Free bytes the build needs (estimate plus margin)."""
        return int(self.total_bytes * 1.02) + DISK_MARGIN

    @property
    def disk_ok(self) -> bool:
        """Enough free disk."""
        return self.disk_free >= self.disk_needed

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per context token per lane (attention layers, other_dtype)."""
        c = self.config
        per = _DTYPE_BYTES.get(self.profile.other_dtype, 2)
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if hasattr(c, "is_full_attention"):
            layers = sum(1 for i in range(c.num_hidden_layers) if c.is_full_attention(i))
        else:
            layers = c.num_hidden_layers
        return 2 * kv_heads * head_dim * per * layers

    def vram(self) -> dict[str, int]:
        """Estimated card memory (bytes): weights, drafter, shortlist, MTP head, workspace, total."""
        target = sum(j.stored_bytes for j in self.target_jobs)
        drafter = sum(j.stored_bytes for j in self.drafter_jobs)
        shortlist = self.shortlist.stored_bytes if self.shortlist else 0
        mtp_spec = self.profile.spec.get("mtp")
        mtp = (
            sum(j.stored_bytes for j in self.mtp_jobs) if mtp_spec is None or mtp_spec.backend != "off" else 0
        )
        total = target + drafter + shortlist + mtp + VRAM_WORKSPACE
        return {
            "target": target,
            "drafter": drafter,
            "shortlist": shortlist,
            "mtp": mtp,
            "workspace": VRAM_WORKSPACE,
            "total": total,
        }

    # ---- the printed plan ----
    def render(self) -> str:
        """The plan as printed before the build (and by --dry-run)."""
        p = self.profile
        lines = [
            f"ignis-build plan: {self.name} for card {self.card} (arch {p.arch})",
            f"  model     {self.model_path} ({self.checkpoint.format}, family {self.family}, "
            f"{len(self.target_jobs)} tensors)",
        ]
        if self.drafter is not None:
            lines.append(
                f"  drafter   {self.drafter.source} ({self.drafter.kind}, {len(self.drafter_jobs)} tensors "
                f"under {self.recipe.drafter_prefix!r})"
            )
        else:
            lines.append("  drafter   none")
        lines.append(f"  recipe    {self.recipe.path or '(defaults)'}")
        lines.append(f"  dtypes    linear {p.linear_dtype}, other {p.other_dtype}")
        counts: dict[str, int] = {}
        for j in self.target_jobs + self.drafter_jobs + self.mtp_jobs:
            counts[j.dtype] = counts.get(j.dtype, 0) + 1
        lines.append("  tensors   " + ", ".join(f"{n} {d}" for d, n in sorted(counts.items())))
        if self.shortlist is not None:
            s = self.shortlist
            lines.append(
                f"  shortlist {s.size} of {s.vocab_size} tokens x {s.hidden_size} (q4_g32, rows of "
                f"{s.head_name}), frequencies: {s.source.kind}"
                + (f" ({len(s.source.files)} file(s))" if s.source.files else "")
            )
        else:
            lines.append("  shortlist none")
        lines.append(
            f"  tokenizer {'stored' if self.tokenizer is not None else 'none in the checkpoint'}"
            + (
                " (WARNING: no tokenizer.json: ignis-run cannot serve this artifact; the typed API and "
                "token-id executors can use it)"
                if self.tokenizer is None
                else ""
            )
            + (
                ", chat template stored"
                if self.tokenizer is not None and self.tokenizer.chat_template
                else ""
            )
        )
        m = self.modules
        routes: dict[str, int] = {}
        for s in m.shapes:
            routes[m.route(s)] = routes.get(m.route(s), 0) + 1
        lines.append(
            f"  modules   widths {list(m.widths)}; {len(m.shapes)} linear shape(s) "
            f"({', '.join(f'{r}: {n}' for r, n in sorted(routes.items())) or 'none'}), "
            f"{m.num_functions()} function(s), target {m.target}"
            + (f"; kernels {', '.join(m.kernels)}" if m.kernels else "")
        )
        lines.append(f"  out       {self.out}/")
        lines.append(f"    {self.weights_file:<28} ~{human(self.weights_bytes)}")
        if self.mtp_file:
            lines.append(f"    {self.mtp_file:<28} ~{human(self.mtp_bytes)}")
        if m.shapes and m.widths:
            lines.append(f"    {'modules/' + self.card + '/':<28} ~{human(self.modules_bytes)}")
        lines.append(f"    {'manifest.json':<28}")
        lines.append(
            f"  total     ~{human(self.total_bytes)}; disk free {human(self.disk_free)}"
            + ("" if self.disk_ok else f" -- NOT ENOUGH (needs {human(self.disk_needed)})")
        )
        if p.vram_bytes:
            v = self.vram()
            kv = self.kv_bytes_per_token()
            room = p.vram_bytes - v["total"]
            lines.append(
                f"  VRAM      ~{human(v['total'])} of {human(p.vram_bytes)}: target {human(v['target'])}, "
                f"drafter {human(v['drafter'])}, shortlist {human(v['shortlist'])}, MTP {human(v['mtp'])}, "
                f"workspace {human(v['workspace'])}"
            )
            if kv:
                lines.append(
                    f"            KV cache {human(kv * 1024)} per 1,024 tokens per lane; "
                    + (
                        f"room for ~{max(room, 0) // kv:,} tokens of context in all"
                        if room > 0
                        else "the weights do not fit: they will stream from host memory"
                    )
                )
        for n in self.notes:
            lines.append(f"  note      {n}")
        return "\n".join(lines)


def _free_bytes(path: Path) -> int:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return int(shutil.disk_usage(p).free)


#: Characters the temporary sibling `.OUT.<8 hex>.partial` adds to the output directory's name.
_TMP_EXTRA = len("..12345678.partial")


def existing_ancestor(path: Path) -> Path:
    """The nearest folder at or above `path` (absolute) that exists."""
    above = path.absolute()
    while not above.exists() and above != above.parent:
        above = above.parent
    return above


def check_out(out: Path, inputs: dict[str, Path | None], *, overwrite: bool) -> None:
    """Refuse an output the build must not use, before anything is read or written.

    Args:
        out: the artifact directory to create.
        inputs: label -> input path (None: not given): the checkpoint, drafter, recipe, corpus files.
        overwrite: `--force`: replace an existing artifact directory.

    Raises:
        OutputExistsError: `out` is or contains an input; it exists and is not a directory (or is a
            link); it is not empty (without `overwrite`); `overwrite` would replace a non-empty directory
            that is not an ignis artifact (no manifest.json).
        OutputNotWritableError: the nearest existing folder above `out` is not a directory or cannot be
            written; the temporary sibling's name would be too long.
    """
    target = out.resolve()
    for label, path in inputs.items():
        if path is None:
            continue
        src = Path(path).resolve()
        if target == src or target in src.parents:
            how = "is" if target == src else "contains"
            raise OutputExistsError(
                f"--out {out} {how} the {label} {path}; building there would replace the input. "
                "Choose another --out"
            )
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        # --force replaces an artifact directory, never a file (or what a link points to).
        raise OutputExistsError(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"{out} exists and is not empty; choose another --out or pass --force")
        if not (out / "manifest.json").is_file():
            raise OutputExistsError(
                f"{out} is not empty and is not an ignis artifact (no manifest.json); --force only replaces "
                "an artifact directory. Remove it yourself or choose another --out"
            )
    if len(os.fsencode(target.name)) + _TMP_EXTRA > 255:
        raise OutputNotWritableError(
            f"--out {out}: the directory name is too long ({len(os.fsencode(target.name))} bytes; at most "
            f"{255 - _TMP_EXTRA}); choose a shorter --out"
        )
    above = existing_ancestor(out.parent if not out.exists() else out)
    if not above.is_dir():
        raise OutputNotWritableError(
            f"--out {out}: {above} exists and is not a directory; choose another --out"
        )
    try:  # os.access is True for root everywhere: probe with an empty folder, removed at once
        probe = tempfile.mkdtemp(prefix=".ignis-build-probe.", dir=above)
        os.rmdir(probe)
    except OSError as exc:
        raise OutputNotWritableError(
            f"--out {out} is not writable: cannot create a folder in {above} ({exc.strerror or exc}); "
            "choose another --out"
        ) from None


def _check_mcpu(mcpu: str, path: Path | None) -> None:
    """Refuse an LLVM CPU name that TVM's LLVM does not know (it would silently build for generic)."""
    try:
        import tvm
        from tvm.target.codegen import llvm_get_cpu_archlist

        known = sorted(str(c) for c in llvm_get_cpu_archlist(tvm.target.Target("llvm")))
    except Exception:  # pragma: no cover - TVM without the LLVM helpers: the module build reports it
        return
    if known and mcpu not in known:
        raise RecipeError(
            f"{path}: modules.llvm_mcpu {mcpu!r} is not a CPU that TVM's LLVM knows; "
            f"known: {', '.join(known)}"
        )


def make_plan(
    *,
    card: str,
    model: str | Path,
    drafter: str | Path | None = None,
    recipe: str | Path | Recipe | None = None,
    out: str | Path,
    overwrite: bool = False,
) -> BuildPlan:
    """Resolve and validate everything before any work.

    Args:
        card: card profile name.
        model: target checkpoint (HF folder or .gguf).
        drafter: DFlash2 drafter checkpoint folder, or None.
        recipe: a recipe file, a parsed `Recipe`, or None for the defaults.
        out: the artifact directory to create.
        overwrite: allow replacing an existing non-empty `out`.

    Raises:
        UnknownCardError: the card has no profile.
        RecipeError: the recipe is invalid, asks for widths the card does not have, or for q4_pad_k on
            the cpu card.
        OutputExistsError, OutputNotWritableError: an unusable `out` (see `check_out`), checked first.
        CheckpointError, UnsupportedArchitectureError, ConfigError, UnknownModelTypeError: from import.
        TensorSetError: missing or unexpected target tensors (all listed). TensorShapeError: a shape.
        MissingTensorsError: missing/unexpected MTP or drafter tensors (all listed).
        DrafterMismatchError: the drafter does not fit the target (every misfit listed).
        ShortlistError: the vocabulary exceeds the shortlist and the recipe names no frequency source.
    """
    from ignis.compiler.importers import load_checkpoint
    from ignis.runtime.families import get_family

    try:
        profile = get_profile(card)
    except ConfigError:
        raise UnknownCardError(f"unknown card {card!r}; known cards: {sorted(load_profiles())}") from None
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    out_path = Path(out)
    inputs: dict[str, Path | None] = {
        "model checkpoint": Path(model),
        "drafter checkpoint": None if drafter is None else Path(drafter),
        "recipe": rec.path,
        "shortlist counts file": rec.counts,
    }
    inputs.update({f"shortlist corpus file {i}": c for i, c in enumerate(rec.corpus)})
    check_out(out_path, inputs, overwrite=overwrite)
    name = rec.name or out_path.resolve().name
    problem = name_problem(name)
    if problem is not None:
        raise RecipeError(
            f"cannot derive an artifact name from --out {out_path} ({name!r}: {problem}); "
            "set `name` in the recipe"
        )
    widths = profile.widths
    if rec.widths is not None and not rec.widths and profile.arch != "llvm":
        raise RecipeError(
            f"{rec.path}: modules.widths = [] builds no modules; that is allowed only on the cpu card "
            f"(torch linears), card {card} needs its compiled linears"
        )
    if rec.q4_pad_k and profile.arch == "llvm":
        raise RecipeError(
            f"{rec.path}: modules.q4_pad_k pads q4 linears for the CUDA cards' tiled route; card {card} "
            "compiles its linears with LLVM and has no such route (leave q4_pad_k out of a cpu recipe)"
        )
    if rec.llvm_mcpu is not None and profile.arch == "llvm":
        _check_mcpu(rec.llvm_mcpu, rec.path)
    if rec.widths is not None:
        extra = sorted(set(rec.widths) - set(profile.widths))
        if extra:
            raise RecipeError(
                f"{rec.path}: modules.widths {extra} are not widths of card {card} ({list(profile.widths)})"
            )
        widths = rec.widths

    ckpt = load_checkpoint(model, ignore_prefixes=(MTP_PREFIX,))
    config = ckpt.config
    family = get_family(config.model_type)
    shapes = ckpt.tensors.shapes
    notes: list[str] = []
    if not widths:
        notes.append("modules.widths = []: no compiled modules; the runtime runs every linear in torch")

    # ---- the trunk, in the family's canonical names and expert layout ----
    expected = family.tensor_shapes(config)
    trunk = {n: s for n, s in shapes.items() if not n.startswith(MTP_PREFIX)}
    loaders, sources, missing, unused = resolve_layout(expected, trunk, ckpt.tensors.__getitem__)
    if missing or unused:
        raise TensorSetError(
            f"{model}: {len(missing)} missing tensor(s) {missing}; {len(unused)} unexpected {unused}",
            missing=missing,
            unexpected=unused,
        )
    lin, oth = profile.linear_dtype, profile.other_dtype
    target_jobs = make_jobs(
        expected, loaders, linear_dtype=lin, other_dtype=oth, sources=sources, file=str(model)
    )
    kept = [
        j.name
        for j in target_jobs
        if lin == "q4_g32" and j.dtype != lin and j.shape[-1] % 32 and j.name.endswith("proj.weight")
    ]
    if kept:
        notes.append(
            f"{len(kept)} linear weight(s) with in_features not a multiple of 32 stay {oth}: {kept[:4]}"
            + (" ..." if len(kept) > 4 else "")
        )

    # ---- the MTP companion ----
    mtp_jobs = plan_mtp(
        config, shapes, ckpt.tensors.__getitem__, linear_dtype=lin, other_dtype=oth, source=str(model)
    )
    mtp_jobs = [dataclasses.replace(j, file=str(model)) for j in mtp_jobs]

    # ---- the drafter ----
    dr: DrafterCheckpoint | None = None
    drafter_jobs: list[TensorJob] = []
    if drafter is not None:
        dr = load_drafter(drafter)
        check_fit(dr, config)
        drafter_jobs = make_jobs(
            dr.shapes,
            dr.loaders(),
            linear_dtype=lin,
            other_dtype=oth,
            prefix=rec.drafter_prefix,
            file=str(dr.source),
        )
        if dr.dropped:
            notes.append(f"drafter tensors shared with the target, not grafted: {dr.dropped}")

    # ---- the shortlist head ----
    vocab, hidden = int(config.vocab_size), int(config.hidden_size)
    head_name = "lm_head.weight" if "lm_head.weight" in expected else "model.embed_tokens.weight"
    size = shortlist_size(vocab, rec.shortlist_size)
    if rec.corpus:
        source = FrequencySource("corpus", rec.corpus)
        if ckpt.tokenizer is None:
            raise ShortlistError(
                f"the recipe names a corpus, but {model} has no tokenizer to count tokens with"
            )
    elif rec.counts is not None:
        source = FrequencySource("counts", (rec.counts,))
    else:
        source = FrequencySource("none")
    shortlist: ShortlistPlan | None = None
    if hidden % 32:
        notes.append(f"no shortlist head: hidden size {hidden} is not a multiple of 32 (q4_g32)")
    else:
        if source.kind == "none" and size < vocab:
            raise ShortlistError(
                f"the shortlist keeps {size} of {vocab} tokens, so it needs token frequencies: name a "
                f"corpus or a counts file in the recipe's [shortlist] table"
            )
        shortlist = ShortlistPlan(size, vocab, hidden, head_name, source)

    # ---- modules ----
    stored = {j.name: (j.dtype, j.shape) for j in target_jobs + drafter_jobs + mtp_jobs}
    if shortlist is not None:
        stored["shortlist.head.weight"] = ("q4_g32", (shortlist.size, hidden))
    shapes_needed = linear_shapes(
        stored,
        family=config.model_type,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
    modules = plan_modules(
        card=card,
        arch=profile.arch,
        widths=widths,
        shapes=shapes_needed,
        other_dtype=oth,
        llvm_mcpu=rec.llvm_mcpu,
        config=config,
        dflash2=dr is not None and dr.kind == "dflash2",
        q4_pad_k=rec.q4_pad_k,
    )
    if rec.q4_pad_k and not any(modules.pads(s) for s in modules.shapes):
        notes.append(
            "modules.q4_pad_k: no q4 linear has an in_features that is a multiple of 32 but not of 128; "
            "nothing is padded"
        )
    return BuildPlan(
        card=card,
        profile=profile,
        recipe=rec,
        name=name,
        out=out_path,
        model_path=Path(model),
        checkpoint=ckpt,
        family=config.model_type,
        config=config,
        target_jobs=target_jobs,
        drafter=dr,
        drafter_jobs=drafter_jobs,
        mtp_jobs=mtp_jobs,
        shortlist=shortlist,
        tokenizer=ckpt.tokenizer,
        modules=modules,
        disk_free=_free_bytes(out_path.parent if not out_path.exists() else out_path),
        notes=notes,
    )


__all__ = [
    "DISK_MARGIN",
    "VRAM_WORKSPACE",
    "BuildPlan",
    "ShortlistPlan",
    "check_out",
    "existing_ancestor",
    "human",
    "make_plan",
]
