"""The typed build API: `build_artifact(card=..., model=..., out=...)` runs every step in order.

    from ignis.compiler.build import build_artifact
    result = build_artifact(card="cpu", model="ckpt/", out="artifacts/tiny")
    result.out, result.manifest.widths, result.seconds

Steps (one module each): plan (`plan.py`, printed first; `dry_run` stops there) -> convert the
target (`convert.py`) -> graft the drafter (`graft.py`) -> the shortlist head (`shortlist.py`) ->
the MTP companion (`mtp_companion.py`) -> TVM modules per width, and on CUDA cards the kernel
libraries the model uses (the drafter's top-k, the fused GDN recurrence and row norms: `modules.py`)
-> the manifest (`manifest.py`).

Atomicity: everything is written into a temporary sibling directory `.NAME.<random>.partial` next
to `out`, which is renamed to `out` only when the manifest is written. Any failure, and
KeyboardInterrupt, removes the temporary directory and the missing parent folders of `out` that the
build created: a failed or interrupted build leaves nothing. A build killed outright (SIGKILL) cannot
clean up; the directory stays locked (flock) only while its builder lives, and the next build into
the same folder removes it (`partials.py`).

Safety (checked by `make_plan`, before anything is read, also in a dry run): `out` must not be or
contain an input (checkpoint, drafter, recipe, corpus); `overwrite` replaces only an ignis artifact
directory (one holding manifest.json); the nearest existing folder above `out` must be writable.
Determinism: no timestamps or absolute paths are recorded, tensors are written in a fixed order and
quantized by the reference quantizer, so the same inputs give byte-identical artifacts.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ignis.compiler.build.convert import write_jobs
from ignis.compiler.build.errors import InsufficientDiskError, OutputNotWritableError
from ignis.compiler.build.manifest import (
    input_checksums,
    input_files,
    sha256_text,
    tool_versions,
    write_manifest,
)
from ignis.compiler.build.modules import build_modules, prepare_cuda_build, require_tvm
from ignis.compiler.build.partials import LEFTOVER_RE, Cleanup, claim_partial, remove_stale
from ignis.compiler.build.plan import BuildPlan, human, make_plan
from ignis.compiler.build.recipe import Recipe
from ignis.compiler.build.shortlist import PREFIX as SHORTLIST_PREFIX
from ignis.compiler.build.shortlist import count_corpus, read_counts, select_tokens, write_shortlist
from ignis.formats import NinferWriter
from ignis.formats.manifest import (
    META_ARTIFACT,
    META_CHAT_TEMPLATE,
    META_CONFIG,
    META_DRAFTER_CONFIG,
    META_FAMILY,
    META_LINEAR_DTYPE,
    META_OTHER_DTYPE,
    META_SHORTLIST,
    META_TOKENIZER,
    TOKENIZER_TENSOR,
    JSONValue,
    Manifest,
)


@dataclass(frozen=True)
class BuildResult:
    """What `build_artifact` did.

    Attributes:
        plan: the resolved plan.
        out: the artifact directory (None for a dry run).
        manifest: the manifest written (None for a dry run).
        seconds: wall time of the whole call.
        step_seconds: wall time per step ("plan", "weights", "mtp", "modules", "manifest").
        total_bytes: bytes of every file written (0 for a dry run).
    """

    plan: BuildPlan
    out: Path | None
    manifest: Manifest | None
    seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)
    total_bytes: int = 0


class _Bar:
    """A tqdm bar, or nothing when progress is off or tqdm is not installed."""

    def __init__(self, enabled: bool, total: int, desc: str, unit: str = "B") -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm comes with the build host's packages
                return
            scale = unit == "B"
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=scale,
                unit_divisor=1024 if scale else 1,
                leave=False,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextmanager
def _bar(enabled: bool, total: int, desc: str, unit: str = "B") -> Iterator[_Bar]:
    bar = _Bar(enabled, total, desc, unit)
    try:
        yield bar
    finally:
        bar.close()


def _plain(value: Any) -> Any:
    """Config values as msgpack-storable plain data (tuples -> lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _token_ids(plan: BuildPlan, echo: Callable[[str], None]) -> tuple[np.ndarray, dict[str, JSONValue]]:
    s = plan.shortlist
    assert s is not None
    if s.source.kind == "corpus":
        from ignis.runtime.tokenizer import Tokenizer

        tok = Tokenizer(plan.tokenizer).backend

        def encode(batch: list[str]) -> list[list[int]]:
            return [e.ids for e in tok.encode_batch(batch, add_special_tokens=False)]

        counts = count_corpus(s.source.files, encode, s.vocab_size)
    elif s.source.kind == "counts":
        counts = read_counts(s.source.files[0], s.vocab_size)
    else:
        counts = np.zeros(s.vocab_size, dtype=np.int64)
    ids = select_tokens(counts, s.size)
    total = int(counts.sum())
    if s.source.kind != "none":
        covered = int(counts[ids.astype(np.int64)].sum())
        echo(
            f"shortlist: {total:,} tokens counted; the {s.size:,} kept cover "
            f"{100.0 * covered / max(total, 1):.2f}% of them"
        )
    info: dict[str, JSONValue] = {**s.source.to_json(), "tokens_counted": total}
    return ids, info


def _write_weights(
    plan: BuildPlan, tmp: Path, *, show: bool, echo: Callable[[str], None]
) -> dict[str, dict[str, JSONValue] | None]:
    """NAME.ninfer: target, drafter, shortlist, tokenizer. Returns the manifest's location objects."""
    cfg = plan.config
    meta: dict[str, Any] = {
        META_ARTIFACT: {"name": plan.name, "part": "target", "card": plan.card},
        META_FAMILY: plan.family,
        META_CONFIG: _plain(cfg.to_dict()),
        META_LINEAR_DTYPE: plan.profile.linear_dtype,
        META_OTHER_DTYPE: plan.profile.other_dtype,
    }
    locations: dict[str, dict[str, JSONValue] | None] = {
        "tokenizer": None,
        "chat_template": None,
        "drafter": None,
        "shortlist": None,
    }
    ids: np.ndarray | None = None
    if plan.shortlist is not None:
        ids, source_info = _token_ids(plan, echo)
        meta[META_SHORTLIST] = {
            "size": plan.shortlist.size,
            "vocab_size": plan.shortlist.vocab_size,
            "head": plan.shortlist.head_name,
            "source": source_info,
        }
        locations["shortlist"] = {
            "file": plan.weights_file,
            "prefix": SHORTLIST_PREFIX,
            "size": plan.shortlist.size,
            "vocab_size": plan.shortlist.vocab_size,
            "source": source_info,
        }
    if plan.drafter is not None:
        meta[META_DRAFTER_CONFIG] = _plain(plan.drafter.raw_config)
        locations["drafter"] = {
            "kind": plan.drafter.kind,
            "file": plan.weights_file,
            "prefix": plan.recipe.drafter_prefix,
            "config_key": META_DRAFTER_CONFIG,
        }
    spec = plan.tokenizer
    if spec is not None:
        d = spec.to_dict()
        d.pop("tokenizer_json")
        template = d.pop("chat_template")
        meta[META_TOKENIZER] = _plain(d)
        locations["tokenizer"] = {
            "file": plan.weights_file,
            "tensor": TOKENIZER_TENSOR,
            "metadata_key": META_TOKENIZER,
            "sha256": sha256_text(spec.tokenizer_json),
        }
        if template is not None:
            meta[META_CHAT_TEMPLATE] = template
            locations["chat_template"] = {
                "file": plan.weights_file,
                "metadata_key": META_CHAT_TEMPLATE,
                "sha256": sha256_text(template),
            }
    jobs = plan.target_jobs + plan.drafter_jobs
    total = sum(j.stored_bytes for j in jobs)
    with (
        NinferWriter(tmp / plan.weights_file, metadata=meta) as w,
        _bar(show, total, plan.weights_file) as bar,
    ):
        write_jobs(w, jobs, on_done=lambda j: bar.update(j.stored_bytes))
        if plan.shortlist is not None and ids is not None:
            head_job = next(j for j in plan.target_jobs if j.name == plan.shortlist.head_name)
            head = head_job.load()
            write_shortlist(w, head, ids)
            del head
        if spec is not None:
            w.add_tensor(TOKENIZER_TENSOR, np.frombuffer(spec.tokenizer_json.encode("utf-8"), dtype=np.uint8))
    return locations


def _write_mtp(plan: BuildPlan, tmp: Path, *, show: bool) -> None:
    assert plan.mtp_file is not None
    meta = {
        META_ARTIFACT: {"name": plan.name, "part": "mtp", "card": plan.card},
        META_FAMILY: plan.family,
        META_CONFIG: _plain(plan.config.to_dict()),
        META_LINEAR_DTYPE: plan.profile.linear_dtype,
        META_OTHER_DTYPE: plan.profile.other_dtype,
    }
    total = sum(j.stored_bytes for j in plan.mtp_jobs)
    with NinferWriter(tmp / plan.mtp_file, metadata=meta) as w, _bar(show, total, plan.mtp_file) as bar:
        write_jobs(w, plan.mtp_jobs, on_done=lambda j: bar.update(j.stored_bytes))


def _provenance(plan: BuildPlan, *, show: bool) -> dict[str, JSONValue]:
    groups: list[tuple[str, Path, list[Path]]] = []
    model = plan.model_path
    files = input_files(model, plan.checkpoint.format, plan.checkpoint.metadata)
    groups.append(("model", model if model.is_dir() else model.parent, files))
    if plan.drafter is not None:
        groups.append(("drafter", plan.drafter.source, sorted(set(plan.drafter.files))))
    rec = plan.recipe
    if rec.path is not None:
        base = rec.path.resolve().parent
        groups.append(("recipe", base, [rec.path.resolve()]))
        if rec.corpus:
            groups.append(("corpus", base, [p.resolve() for p in rec.corpus]))
        if rec.counts is not None:
            groups.append(("counts", base, [rec.counts.resolve()]))
    total = sum(f.stat().st_size for _, _, fs in groups for f in fs)
    with _bar(show, total, "input checksums") as bar:
        inputs = input_checksums(groups, progress=bar.update)
    return {
        "ignis_version": tool_versions(cuda=False).get("ignis"),
        "tools": tool_versions(cuda=plan.modules.is_cuda),
        "inputs": inputs,
        "checkpoint_format": plan.checkpoint.format,
        "recipe": rec.to_json(),
        "quantizer": "ignis.formats.quantize_q4_g32 (SPEC.md 4.1: symmetric, absmax/7, round half even)",
    }


def _default_echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_artifact(
    *,
    card: str,
    model: str | os.PathLike[str],
    drafter: str | os.PathLike[str] | None = None,
    recipe: str | os.PathLike[str] | Recipe | None = None,
    out: str | os.PathLike[str],
    dry_run: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    echo: Callable[[str], None] | None = None,
) -> BuildResult:
    """Build an ignis artifact for one card (see the module docstring for the steps).

    Args:
        card: card profile name ("rtx5090", "rtxpro6000", "rtx50-16gb", "h200", "cpu").
        model: target checkpoint: an HF folder (config.json + safetensors + tokenizer) or a .gguf file.
        drafter: a DFlash2 drafter checkpoint folder to graft, or None.
        recipe: a recipe TOML (artifacts/recipes/NAME.toml), a parsed `Recipe`, or None (defaults).
        out: the artifact directory to create (its parent is created if needed).
        dry_run: resolve and print the plan, then stop (nothing is written).
        overwrite: replace an existing non-empty `out` that is an ignis artifact (holds manifest.json;
            it is replaced only once the new artifact is complete). Any other non-empty directory, and an
            `out` that is or contains an input, is refused even with `overwrite`.
        progress: show progress bars on long steps (stderr); None shows them when stderr is a terminal.
        echo: receives the plan and step messages, one line or block per call (default: stderr).

    Returns:
        A `BuildResult`.

    Raises:
        Everything `make_plan` raises (unknown card, recipe errors, missing tensors, a drafter that
        does not fit, shortlist without a frequency source, an existing or unsafe output:
        OutputExistsError; an unwritable one: OutputNotWritableError), before any work;
        InsufficientDiskError: less free disk than the estimate (after the plan is printed, also in a
        dry run); ShortlistError: an unreadable corpus or counts file; ModuleBuildError: a module
        failed to compile or is not a binary for the card's arch, or the plan has linears on a TVM
        route and the TVM compiler is not installed (after the plan is printed, also in a dry run);
        FormatError / OSError: writing failed. In every failure case nothing is left at `out` or beside it.
    """
    start = time.perf_counter()
    say = echo or _default_echo
    show = sys.stderr.isatty() if progress is None else bool(progress)
    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    plan = make_plan(card=card, model=model, drafter=drafter, recipe=recipe, out=out, overwrite=overwrite)
    steps["plan"] = time.perf_counter() - t0
    say(plan.render())
    if not plan.disk_ok:
        raise InsufficientDiskError(
            f"not enough disk for {plan.out}: the artifact needs about {human(plan.disk_needed)} "
            f"(with margin), {human(plan.disk_free)} is free; free some space or choose another --out",
            needed=plan.disk_needed,
            free=plan.disk_free,
        )
    require_tvm(plan.modules)  # a plan that needs the TVM compiler where it is missing: refused now
    if dry_run:
        say("dry run: nothing written")
        return BuildResult(
            plan=plan, out=None, manifest=None, seconds=time.perf_counter() - start, step_seconds=steps
        )
    if plan.modules.is_cuda and plan.modules.shapes and plan.modules.widths:
        say(f"cuda build: libcuda.so.1 from the {prepare_cuda_build()}")

    out_path = plan.out
    created: list[Path] = []  # missing parents of out, made here and removed again on failure
    try:
        created = _make_parents(out_path.parent)
        _report_cleanup(remove_stale(out_path.parent), say)
        part = claim_partial(out_path.parent, out_path.name)
        tmp = part.path
    except BaseException as exc:
        _remove_dirs(created)
        if isinstance(exc, OSError):
            raise OutputNotWritableError(
                f"--out {out_path} is not writable: {exc.strerror or exc} ({exc.filename or out_path.parent})"
            ) from exc
        raise
    try:
        t0 = time.perf_counter()
        locations = _write_weights(plan, tmp, show=show, echo=say)
        steps["weights"] = time.perf_counter() - t0
        say(
            f"wrote {plan.weights_file} ({human((tmp / plan.weights_file).stat().st_size)}) "
            f"in {steps['weights']:.1f} s"
        )
        if plan.mtp_file is not None:
            t0 = time.perf_counter()
            _write_mtp(plan, tmp, show=show)
            steps["mtp"] = time.perf_counter() - t0
            say(f"wrote {plan.mtp_file} ({human((tmp / plan.mtp_file).stat().st_size)})")
        t0 = time.perf_counter()
        libs = max(1, len(plan.modules.widths) + len(plan.modules.kernels))
        with _bar(show, libs, "modules", unit="lib") as bar:
            modules, kernels, module_files = build_modules(
                plan.modules, tmp, on_file=lambda _rel: bar.update(1)
            )
        steps["modules"] = time.perf_counter() - t0
        if module_files:
            say(
                f"compiled {len(module_files)} module file(s), {plan.modules.num_functions()} function(s) "
                f"for {plan.modules.arch} in {steps['modules']:.1f} s"
            )
        t0 = time.perf_counter()
        provenance = _provenance(plan, show=show)
        manifest = write_manifest(
            tmp,
            name=plan.name,
            card=plan.card,
            profile=plan.profile,
            family=plan.family,
            widths=plan.modules.widths,
            weights_file=plan.weights_file,
            mtp_file=plan.mtp_file,
            module_files=module_files,
            modules=modules,
            kernels=kernels,
            tokenizer=locations["tokenizer"],
            chat_template=locations["chat_template"],
            drafter=locations["drafter"],
            shortlist=locations["shortlist"],
            provenance=provenance,
        )
        steps["manifest"] = time.perf_counter() - t0
        _install(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise
    finally:
        part.release()
    total = sum(f.size for f in manifest.files)
    seconds = time.perf_counter() - start
    say(f"built {out_path} ({human(total)}) in {seconds:.1f} s")
    return BuildResult(
        plan=plan, out=out_path, manifest=manifest, seconds=seconds, step_seconds=steps, total_bytes=total
    )


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; return the folders created, outermost first."""
    missing: list[Path] = []
    p = folder.absolute()
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    created: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except BaseException:
        _remove_dirs(created)
        raise
    return created


def _remove_dirs(created: list[Path]) -> None:
    """Remove the folders `_make_parents` created, innermost first, while they are empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


def _report_cleanup(cleanup: Cleanup, say: Callable[[str], None]) -> None:
    for p in cleanup.removed:
        say(f"removed {p.name}: left behind by a build that was killed")
    for p in cleanup.kept_old:
        m = LEFTOVER_RE.match(p.name)
        out = p.parent / (m["out"] if m else "?")
        say(f"warning: {out} is missing; {p} holds the artifact a killed build was replacing: rename it back")


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory to `out` (replacing an existing one last)."""
    old: Path | None = None
    if out.exists():
        old = out.parent / f".{out.name}.{secrets.token_hex(4)}.old"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    try:
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


__all__ = [
    "BuildResult",
    "build_artifact",
]
