"""`ignis-build`: convert a checkpoint into a memory-mappable artifact for one card.

The CLI is thin: it parses options and calls the typed API `ignis.compiler.build.build_artifact`.
It prints the resolved plan before working; every refusal is one clear message and a non-zero exit:

    0  built (or, with --dry-run, planned)
    1  the build failed or was refused: missing tensors (all listed), a drafter that does not fit,
       too little disk, an unreadable checkpoint, a module that did not compile
    2  bad usage: unknown card, invalid recipe, an existing --out without --force
    130 interrupted (Ctrl-C); nothing was left behind
"""

from __future__ import annotations

import signal
import sys

import click

from ignis.runtime.profiles import load_profiles

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int) -> None:
    click.echo(f"ignis-build: error: {message}", err=True)
    sys.exit(code)


def _names_block(title: str, names: list[str]) -> str:
    if not names:
        return ""
    return f"\n  {title} ({len(names)}):\n" + "\n".join(f"    {n}" for n in names)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
    help="Replace --out if it exists and is not empty (the old directory is removed only after the new "
    "artifact is complete).",
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
        RecipeError,
        UnknownCardError,
        build_artifact,
    )
    from ignis.compiler.errors import CompilerError
    from ignis.formats import FormatError
    from ignis.runtime.errors import IgnisRuntimeError, TensorSetError

    def _terminated(signum: int, _frame: object) -> None:  # SIGTERM (systemd, CI, `timeout`) as Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")

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
    except (UnknownCardError, RecipeError, OutputExistsError) as exc:
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
        _fail("the drafter does not fit the target:" + _names_block("problems", exc.problems), EXIT_FAILED)
    except (BuildError, CompilerError, IgnisRuntimeError, FormatError, OSError) as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)


if __name__ == "__main__":
    main()
