"""Step 6: the manifest (writer side): every file with its sha256, the card and widths, where the
tokenizer and chat template live, the profile's defaults and the build provenance.

The schema and its reader are `ignis.formats.manifest`; this module only gathers the facts. No
timestamps, no absolute paths, no host names: the same inputs with the same toolchain give the
same bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ignis.formats import FORMAT_VERSION, MANIFEST_NAME
from ignis.formats.manifest import (
    FileEntry,
    JSONValue,
    KernelEntry,
    Manifest,
    ModuleEntry,
    file_entry,
    hash_file,
)
from ignis.runtime.profiles import CardProfile

#: Packages whose versions the provenance records (those that shape the bytes).
TOOL_PACKAGES = (
    "ignis",
    "numpy",
    "msgpack",
    "torch",
    "safetensors",
    "tokenizers",
    "gguf",
    "apache-tvm",
    "apache-tvm-ffi",
)


def profile_json(profile: CardProfile) -> dict[str, JSONValue]:
    """The card profile as recorded in the manifest (what `ignis-run --profile` defaults to)."""
    return {
        "name": profile.name,
        "arch": profile.arch,
        "vram_bytes": profile.vram_bytes,
        "linear_dtype": profile.linear_dtype,
        "other_dtype": profile.other_dtype,
        "decode_widths": list(profile.decode_widths),
        "wide_widths": list(profile.wide_widths),
        "spec": {
            kind: {
                "backend": s.backend,
                "draft_tokens": s.draft_tokens,
                "draft_rows": s.draft_rows,
                "draft_head": s.draft_head,
            }
            for kind, s in sorted(profile.spec.items())
        },
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcc_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.splitlines() if "release" in ln]
    return lines[-1].strip() if lines else None


def tool_versions(*, cuda: bool) -> dict[str, JSONValue]:
    """Versions of Python, the packages in `TOOL_PACKAGES` and (CUDA builds) nvcc."""
    out: dict[str, JSONValue] = {"python": platform.python_version()}
    for dist in TOOL_PACKAGES:
        out[dist] = _version(dist)
    if cuda:
        out["nvcc"] = _nvcc_version()
    return out


def input_files(model: Path, fmt: str, metadata: dict[str, Any]) -> list[Path]:
    """The checkpoint files the import read (for their checksums)."""
    if fmt == "gguf" or model.is_file():
        return [model]
    names = [
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "generation_config.json",
        *metadata.get("safetensors_files", []),
    ]
    files = [model / n for n in dict.fromkeys(names) if (model / n).is_file()]
    extra = model / "additional_chat_templates"
    if extra.is_dir():
        files += sorted(extra.glob("*.jinja"))
    return sorted(set(files))


def input_checksums(
    groups: Sequence[tuple[str, Path, Sequence[Path]]],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, JSONValue]]:
    """sha256 of every input file, named relative to its group's root (no absolute paths), in the
    groups' order. The files are hashed on `build_threads()` threads (hashlib releases the GIL), so a
    sharded checkpoint hashes at the disk's speed rather than one core's.

    Args:
        groups: (role, root, files) triples, e.g. ("model", folder, [config.json, ...]).
        progress: called with bytes read (from the worker threads, one call at a time).
    """
    from ignis.compiler.build.convert import build_threads

    items = [(role, root, f) for role, root, files in groups for f in files]
    lock = threading.Lock()

    def tick(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    def one(item: tuple[str, Path, Path]) -> dict[str, JSONValue]:
        role, root, f = item
        size, sha, _ = hash_file(f, progress=tick)
        rel = f.name if f == root or not f.is_relative_to(root) else f.relative_to(root).as_posix()
        return {"role": role, "path": rel, "size": size, "sha256": sha}

    workers = max(1, min(len(items), build_threads()))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ignis-sha256") as pool:
        return list(pool.map(one, items))


def sha256_text(text: str) -> str:
    """sha256 hex of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_manifest(
    artifact_dir: Path,
    *,
    name: str,
    card: str,
    profile: CardProfile,
    family: str,
    widths: Sequence[int],
    weights_file: str,
    mtp_file: str | None,
    module_files: Sequence[str],
    modules: Sequence[ModuleEntry],
    kernels: Sequence[KernelEntry] = (),
    tokenizer: dict[str, JSONValue] | None,
    chat_template: dict[str, JSONValue] | None,
    drafter: dict[str, JSONValue] | None,
    shortlist: dict[str, JSONValue] | None,
    provenance: dict[str, JSONValue],
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Hash the artifact's files and write `manifest.json` (validated before it is written).

    `module_files` lists every compiled library, those of `modules` and of `kernels` (the compiled
    non-linear functions, e.g. the drafter's top-k) alike; each is recorded with role "module".

    Returns:
        The manifest written.

    Raises:
        ignis.formats.manifest.ManifestError: the assembled manifest does not validate.
        ignis.formats.manifest.ArtifactFileError: a file cannot be read.
    """
    entries: list[FileEntry] = [file_entry(artifact_dir, weights_file, "weights", progress=progress)]
    if mtp_file is not None:
        entries.append(file_entry(artifact_dir, mtp_file, "mtp", progress=progress))
    for rel in sorted(set(module_files)):
        entries.append(file_entry(artifact_dir, rel, "module", progress=progress))
    manifest = Manifest(
        name=name,
        card=card,
        arch=profile.arch,
        family=family,
        linear_dtype=profile.linear_dtype,
        other_dtype=profile.other_dtype,
        widths=tuple(sorted(set(widths))),
        weights=weights_file,
        files=tuple(sorted(entries, key=lambda e: e.path)),
        mtp=mtp_file,
        tokenizer=tokenizer,
        chat_template=chat_template,
        drafter=drafter,
        shortlist=shortlist,
        modules=tuple(modules),
        kernels=tuple(kernels),
        profile=profile_json(profile),
        provenance=provenance,
        ninfer_version=FORMAT_VERSION,
    )
    data = manifest.to_bytes()
    tmp = artifact_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_bytes(data)
    tmp.replace(artifact_dir / MANIFEST_NAME)
    return manifest


__all__ = [
    "TOOL_PACKAGES",
    "input_checksums",
    "input_files",
    "profile_json",
    "sha256_text",
    "tool_versions",
    "write_manifest",
]
