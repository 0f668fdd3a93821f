"""`ignis-build`: convert a checkpoint into a memory-mappable artifact for one card.

The CLI is thin: it parses options and calls the typed build API. Steps that are not built yet say
so and exit non-zero (exit code 2); they never pretend to have built anything.
"""

from __future__ import annotations

import click

CARDS = ("rtx5090", "rtxpro6000", "rtx50-16gb", "h200", "cpu")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--card", type=click.Choice(CARDS), required=True,
              help="Card profile to build for: sets the weight dtypes, the TVM target arch and the "
                   "verify row widths compiled, and the runtime defaults written into the manifest.")
@click.option("--model", "model", type=click.Path(exists=True), required=True,
              help="Target checkpoint: an HF folder (config.json + safetensors + tokenizer) or a GGUF file.")
@click.option("--drafter", type=click.Path(exists=True), default=None,
              help="DFlash2 drafter checkpoint folder to graft into the target's .ninfer (optional).")
@click.option("--recipe", type=click.Path(exists=True), default=None,
              help="Build recipe (TOML under artifacts/recipes/) naming the token-frequency source for "
                   "the Q4 shortlist head and per-model overrides.")
@click.option("--out", type=click.Path(), required=True,
              help="Output artifact directory (written to a temporary name and renamed when complete).")
@click.option("--dry-run", is_flag=True, help="Print the resolved plan (files, sizes, estimated VRAM) and stop.")
def main(card: str, model: str, drafter: str | None, recipe: str | None, out: str, dry_run: bool) -> None:
    """Build an ignis artifact (.ninfer files, TVM modules per row width, manifest) for CARD."""
    raise click.ClickException(
        "ignis-build is not implemented yet (issue 5: the artifact toolchain); nothing was written."
    )
