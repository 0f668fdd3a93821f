"""`ignis-run`: memory-map an artifact and serve it over a Unix socket.

Not implemented yet (issue 6); the command says so and exits non-zero.
"""

from __future__ import annotations

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--artifact", type=click.Path(exists=True), required=True, help="Artifact directory built by ignis-build.")
@click.option("--socket", "socket_path", type=click.Path(), default=None,
              help="Unix socket path to serve on (created with mode 0600).")
@click.option("--spec-backend", type=click.Choice(["dflash2", "mtp", "off"]), default=None,
              help="Speculative backend; default from the card profile in the manifest.")
@click.option("--spec-draft-tokens", type=click.IntRange(1, 7), default=None,
              help="Draft tokens per lane per round (1..7); required with dflash2.")
@click.option("--spec-draft-rows", type=click.IntRange(0, 32), default=None,
              help="Row budget of a verify round across lanes (0 means 8, at most 32).")
@click.option("--spec-draft-head", type=click.Choice(["full", "shortlist"]), default=None,
              help="Proposal head of the drafter: the target's full head or the Q4 shortlist head.")
def main(artifact: str, socket_path: str | None, spec_backend: str | None, spec_draft_tokens: int | None,
         spec_draft_rows: int | None, spec_draft_head: str | None) -> None:
    """Serve ARTIFACT over a Unix socket (OpenAI-compatible HTTP)."""
    raise click.ClickException("ignis-run is not implemented yet (issue 6: the server); nothing is served.")
