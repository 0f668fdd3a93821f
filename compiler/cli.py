"""`ignis-build`: convert a checkpoint into a memory-mappable artifact for one card.

The CLI is thin: it parses options and calls the typed API `ignis.compiler.build.build_artifact`.
It prints the resolved plan before working; every refusal is one clear message and a non-zero exit:

    0  built (or, with --dry-run, planned)
    1  the build failed or was refused: missing tensors (all listed), a drafter that does not fit,
       too little disk, an unreadable checkpoint, a module that did not compile
    2  bad usage: unknown card, invalid recipe, an existing --out without --force, an --out that is
       (or holds) an input or cannot be written, --force on a non-empty directory that is not an
       artifact
    130 interrupted (Ctrl-C); nothing was left behind

An unexpected exception is reported as one "internal error" line (exit 1); set IGNIS_DEBUG=1 to get
the Python traceback instead.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from ignis.runtime.profiles import load_profiles

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int) -> None:
    click.echo(f"ignis-build: error: {message}", err=True)
    sys.exit(code)


def _out_problem(out: str, inputs: dict[str, str | None], force: bool) -> str | None:
    """Why --out cannot be used, or None: it is (or contains) an input the build would replace with
    --force, --force would replace a non-empty directory that is not an ignis artifact, or a path
    component above it exists and is not a directory."""
    target = Path(out).resolve()
    for label, path in inputs.items():
        if path is None:
            continue
        src = Path(path).resolve()
        if target == src or target in src.parents:
            how = "is" if target == src else "contains"
            return (
                f"--out {out} {how} the {label} {path}; building there would replace the input. "
                "Choose another --out"
            )
    given = Path(out)
    if (
        force
        and given.is_dir()
        and not given.is_symlink()
        and any(given.iterdir())
        and not (given / "manifest.json").is_file()
    ):
        return (
            f"--out {out} is not empty and is not an ignis artifact (no manifest.json); --force only "
            "replaces an artifact directory. Remove it yourself or choose another --out"
        )
    above = Path(out).absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return f"--out {out}: {above} exists and is not a directory; choose another --out"
    return None


def _names_block(title: str, names: list[str]) -> str:
    if not names:
        return ""
    return f"\n  {title} ({len(names)}):\n" + "\n".join(f"    {n}" for n in names)


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    epilog="Exit status: 0 built (or planned, with --dry-run); 1 the build failed or was refused "
    "(missing tensors, a misfit drafter, too little disk, an unreadable checkpoint, a module that did not "
    "compile); 2 bad usage (unknown card, invalid recipe, an existing or unusable --out); 130 interrupted "
    "(nothing is left behind). Set IGNIS_DEBUG=1 to see the traceback of an internal error.",
)
@click.option(
    "--card",
    required=True,
    metavar="CARD",
    help="Card profile to build for (" + ", ".join(sorted(load_profiles())) + "). It sets the weight dtypes "
    "(q4_g32 linears + bf16 on the GPU cards, f32 on cpu), the TVM target (sm_90, sm_120, llvm), the verify "
    "row widths compiled, and the runtime defaults written into the manifest.",
)
@click.option(
    "--model",
    required=True,
    type=click.Path(exists=True),
    help="Target checkpoint: an HF folder (config.json + safetensors + tokenizer files) or a .gguf file. "
    "mtp.* tensors in it become the NAME_mtp.ninfer companion.",
)
@click.option(
    "--drafter",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="DFlash2 drafter checkpoint folder (config.json + safetensors) to graft into NAME.ninfer under "
    "its prefix (dflash2. by default). Refused when it does not fit the target: hidden size, a tapped "
    "layer past the last layer, a mask token outside the embedding.",
)
@click.option(
    "--recipe",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Build recipe (TOML, see artifacts/recipes/ and artifacts/README.md): the artifact name, the "
    "token-frequency source of the Q4 shortlist head (a text corpus or a counts file), the widths to "
    "compile, the drafter prefix. Without one: defaults, and the name comes from --out.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="Artifact directory to create, e.g. artifacts/NAME. The build writes into a temporary sibling "
    "directory and renames it at the end: a failed or interrupted build leaves nothing.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the resolved plan (files, sizes, dtypes, modules, estimated VRAM, free disk) and stop; "
    "nothing is written. Still refuses (non-zero exit) what the build would refuse.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace --out if it is an existing artifact directory (one with manifest.json; the old one is "
    "removed only after the new artifact is complete). Any other non-empty directory is refused.",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Show progress bars on long steps (default: when stderr is a terminal).",
)
def main(
    card: str,
    model: str,
    drafter: str | None,
    recipe: str | None,
    out: str,
    dry_run: bool,
    force: bool,
    progress: bool | None,
) -> None:
    """Build an ignis artifact for CARD: NAME.ninfer (weights, grafted drafter, Q4 shortlist head,
    tokenizer), NAME_mtp.ninfer (when the checkpoint has an MTP head), modules/CARD/ (TVM linears for
    every verify row width) and manifest.json (sha256 of every file, provenance, profile defaults).

    Example: ignis-build --card cpu --model SmolLM2-135M-Instruct.Q4_1.gguf
    --recipe artifacts/recipes/smollm2-135m.toml --out artifacts/smollm2-135m
    """
    from ignis.compiler.build import (
        BuildError,
        DrafterMismatchError,
        MissingTensorsError,
        OutputExistsError,
        OutputNotWritableError,
        RecipeError,
        UnknownCardError,
        build_artifact,
    )
    from ignis.compiler.errors import CompilerError
    from ignis.formats import FormatError
    from ignis.runtime.errors import IgnisRuntimeError, TensorSetError

    def _terminated(signum: int, _frame: object) -> None:  # SIGTERM (systemd, CI, `timeout`) as Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")

    problem = _out_problem(
        out, {"--model checkpoint": model, "--drafter checkpoint": drafter, "--recipe": recipe}, force
    )
    if problem is not None:
        _fail(problem, EXIT_USAGE)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        build_artifact(
            card=card,
            model=model,
            drafter=drafter,
            recipe=recipe,
            out=out,
            dry_run=dry_run,
            overwrite=force,
            progress=progress,
            echo=lambda line: click.echo(line, err=True),
        )
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written", EXIT_INTERRUPTED)
    except (UnknownCardError, RecipeError, OutputExistsError, OutputNotWritableError) as exc:
        _fail(str(exc), EXIT_USAGE)
    except (TensorSetError, MissingTensorsError) as exc:
        missing, unexpected = list(exc.missing), list(exc.unexpected)
        head = str(exc).split(":", 1)[0]
        _fail(
            f"{head}: {len(missing)} missing and {len(unexpected)} unexpected tensor(s)"
            + _names_block("missing", missing)
            + _names_block("unexpected", unexpected),
            EXIT_FAILED,
        )
    except DrafterMismatchError as exc:
        _fail(
            f"the drafter {drafter} does not fit the target or cannot be read:"
            + _names_block("problems", exc.problems),
            EXIT_FAILED,
        )
    except (BuildError, CompilerError, IgnisRuntimeError, FormatError, OSError) as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    except Exception as exc:  # a bug, not a user error: one line, no traceback (IGNIS_DEBUG=1 shows it)
        if os.environ.get("IGNIS_DEBUG"):
            raise
        _fail(
            f"internal error ({type(exc).__name__}: {exc}). This is a bug in ignis-build: "
            "please report it with the command line (IGNIS_DEBUG=1 shows the traceback)",
            EXIT_FAILED,
        )


if __name__ == "__main__":
    main()
