"""`ignis-bench`: load a running ignis (or any OpenAI-compatible) server over its Unix socket or TCP and
report what its clients see.

    ignis-bench --socket /run/ignis/ignis.sock                                  # the shared prompt set, chat
    ignis-bench --socket S --input-len 32 --max-tokens 256 --concurrency 8     # random token-id prompts
    ignis-bench --socket S --request-rate 4 --num-requests 200 --json-out run.json
    ignis-bench --socket S --multi-turn --sessions 16 --turns 20 --concurrency 8

`--concurrency 1,8` runs the same benchmark at each concurrency in turn and ends with a table
comparing them (the JSON then holds {"runs": [...]}).

Exit status: 0 when every request completed; 1 when some failed (they are counted and reported), the
server cannot be reached, or a prompt file is bad; 2 on bad usage; 130 after Ctrl-C (what finished is
still reported and written).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import click

from ignis.tools.bench.serve.client import BenchClient, ServerError, Target
from ignis.tools.bench.serve.options import (
    concurrency_option,
    int_list,
    json_out_option,
    max_tokens_option,
    seed_option,
)
from ignis.tools.bench.serve.report import format_report, format_sweep
from ignis.tools.bench.serve.run import BenchConfig, MultiTurnConfig, run_load, run_multi_turn
from ignis.tools.bench.serve.stats import RequestResult
from ignis.tools.bench.serve.workload import (
    DatasetError,
    Prompt,
    default_dataset,
    load_jsonl,
    random_token_prompts,
)

__all__ = ["main"]

CHECKOUT = Path(__file__).resolve().parents[3]


def write_outputs(path: Path, results: list[RequestResult]) -> int:
    """Write the completed requests' (prompt ids, generated ids) as JSON lines, each distinct pair once,
    in first-seen order (a prompt run at several concurrencies may get several outputs when the
    server's numerics depend on the batch); returns the lines written."""
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], None] = {}
    for r in results:
        if r.ok and r.prompt_ids:
            seen[(tuple(r.prompt_ids), tuple(r.generated_ids))] = None
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for prompt, output in seen:
            f.write(json.dumps({"prompt_token_ids": list(prompt), "output_token_ids": list(output)}) + "\n")
    return len(seen)


def _range(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"expected LOW:HIGH (integers), got {value!r}") from None
    if not 0 <= low < high:
        raise click.BadParameter(f"need 0 <= LOW < HIGH, got {value!r}")
    return low, high


def _percentiles(ctx: click.Context, param: click.Parameter, value: str) -> list[float]:
    try:
        out = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None
    if not out or any(not 0 <= q <= 100 for q in out):
        raise click.BadParameter(f"percentiles must be in [0, 100], got {value!r}")
    return out


def _prompts(
    dataset: Path | None,
    input_len: list[int] | None,
    num: int,
    id_range: tuple[int, int],
    seed: int,
    prefix_len: int,
) -> list[Prompt]:
    if input_len is not None:
        return random_token_prompts(num, input_len, id_range, seed, prefix_len)
    if dataset is None:
        found, tried = default_dataset(CHECKOUT, Path.cwd())
        if found is None:
            raise click.UsageError(
                "no prompts: give --dataset FILE.jsonl or --input-len N; the shared prompt set was not at "
                + " or ".join(str(p) for p in tried)
            )
        click.echo(f"prompts: {found}", err=True)
        dataset = found
    return load_jsonl(dataset)


def _given(ctx: click.Context) -> set[str]:
    """The options the user set (command line or environment), not left at their defaults."""
    from click.core import ParameterSource

    return {
        name
        for name in ctx.params
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }


def _verb(names: list[str]) -> str:
    return "applies" if len(names) == 1 else "apply"


def _flags(names: list[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    epilog="Exit status: 0 every request completed; 1 some failed (counted and reported), the server cannot "
    "be reached, or the prompt file is bad; 2 bad usage; 130 interrupted (Ctrl-C: what finished is "
    "reported).",
)
@click.option(
    "--socket", metavar="PATH", envvar="IGNIS_SOCKET", help="Unix socket of the server (env IGNIS_SOCKET)."
)
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="Base URL of a TCP server (without --socket).",
)
@click.option("--model", help="Model id to send. [default: the server's first model]")
@click.option(
    "--endpoint",
    type=click.Choice(["chat", "completions"]),
    help="POST /v1/chat/completions or /v1/completions. [default: chat; completions with --input-len]",
)
@click.option(
    "--dataset",
    type=click.Path(dir_okay=False, path_type=Path),
    help='Prompts, one JSON object a line with "messages" or "prompt" (and an optional "id"). '
    "[default: ../shared/bench/prompts.jsonl beside the checkout or the working directory]",
)
@click.option(
    "--input-len",
    callback=int_list,
    metavar="N[,N...]",
    help="Random token-id prompts of these lengths (cycled) instead of a dataset (completions endpoint).",
)
@click.option(
    "--prefix-len",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="With --input-len: random ids every prompt starts with (a shared system prompt), before its own.",
)
@click.option(
    "--label",
    metavar="TEXT",
    help="A note kept in the report and its title (e.g. the server's backend and lanes).",
)
@click.option(
    "--token-id-range",
    default="16:256",
    show_default=True,
    callback=_range,
    metavar="LOW:HIGH",
    help="Random prompt ids are drawn from [LOW, HIGH); the default is inside any byte-level vocabulary.",
)
@click.option(
    "--num-requests", type=click.IntRange(min=1), help="Requests to send. [default: the prompts, or 16]"
)
@max_tokens_option(
    default=None,
    help="Output tokens per request (per reply with --multi-turn). [default: 256; 200 with --multi-turn]",
)
@click.option(
    "--ignore-eos/--no-ignore-eos",
    default=True,
    show_default=True,
    help="Generate exactly --max-tokens (as llama-bench), or let EOS end a request.",
)
@concurrency_option(
    "--concurrency",
    "--max-concurrency",
    "concurrency",
    default="8",
    help="Requests in flight at most; several values run one after the other (a sweep, compared last).",
)
@click.option(
    "--request-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=math.inf,
    help="Requests per second, Poisson arrivals. [default: inf, all at once]",
)
@click.option(
    "--burstiness",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="With --request-rate: gaps are gamma-distributed with this shape (1: Poisson; < 1 burstier).",
)
@click.option(
    "--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy."
)
@click.option(
    "--top-p", type=click.FloatRange(0, 1, min_open=True), help="Nucleus mass. [default: the server's]"
)
@click.option("--top-k", type=click.IntRange(min=1), help="Top-k. [default: the server's]")
@seed_option(help="Seeds arrivals, random prompts and sessions; a sampled request i sends seed + i.")
@click.option(
    "--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Requests before measuring."
)
@click.option(
    "--percentiles",
    default="50,90,99",
    show_default=True,
    callback=_percentiles,
    help="Percentiles of the latency distributions.",
)
@json_out_option(help="Write the full report as JSON.")
@click.option(
    "--save-outputs",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write each prompt's token ids and generated ids as JSON lines ({prompt_token_ids, "
    "output_token_ids}; --endpoint completions, greedy): the file `ignis-run --spec-backend replay "
    "--spec-replay` replays.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds to wait for the server between bytes.",
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="A progress bar on stderr.")
@click.option("--multi-turn", is_flag=True, help="Replay synthetic agent sessions (issue 24) instead.")
@click.option(
    "--sessions", type=click.IntRange(min=1), default=8, show_default=True, help="--multi-turn: sessions."
)
@click.option(
    "--turns", type=click.IntRange(min=1), default=20, show_default=True, help="--multi-turn: turns each."
)
@click.option(
    "--tool-tokens",
    default="500:2000",
    show_default=True,
    callback=_range,
    metavar="LOW:HIGH",
    help="--multi-turn: tool-output tokens added per turn (uniform; approximate on the chat endpoint).",
)
@click.option(
    "--opener-tokens",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="--multi-turn: tokens of the first turn (system prompt and task).",
)
def main(**kw: Any) -> None:
    """Benchmark a running ignis server at its socket: TTFT, inter-token and end-to-end latency, output
    tokens per second per lane and in all, and the speculative acceptance over the run (from /metrics).

    Requests are streamed (one token per server-sent event) and timed by this client. --multi-turn
    replays agent sessions (each turn resends the conversation plus a new tool output) and reports per
    turn the TTFT, the prompt tokens the server reused (usage.prompt_tokens_details.cached_tokens) and
    the decode rate.
    """
    given = _given(click.get_current_context())
    if "prefix_len" in given and kw["input_len"] is None:
        raise click.UsageError("--prefix-len applies only with --input-len")
    only_replay = sorted(given & {"sessions", "turns", "tool_tokens", "opener_tokens"})
    if only_replay and not kw["multi_turn"]:
        raise click.UsageError(f"{_flags(only_replay)} {_verb(only_replay)} only with --multi-turn")
    only_load = sorted(given & {"request_rate", "burstiness", "num_requests"})
    if only_load and kw["multi_turn"]:
        raise click.UsageError(
            f"--multi-turn takes no {_flags(only_load)} (its clients send each turn when the last one ended)"
        )
    if kw["multi_turn"] and (kw["dataset"] is not None or kw["input_len"] is not None):
        raise click.UsageError("--multi-turn makes its own sessions: leave out --dataset and --input-len")
    if kw["json_out"] is not None:  # refuse an unwritable report path before the run, not after it
        out: Path = kw["json_out"]
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise click.BadParameter(
                f"cannot write {out}: {exc.strerror or exc}", param_hint="--json-out"
            ) from None
        if not os.access(out if out.exists() else out.parent, os.W_OK):
            raise click.BadParameter(f"cannot write {out}: permission denied", param_hint="--json-out")
    endpoint = kw["endpoint"] or ("completions" if kw["input_len"] is not None else "chat")
    if kw["input_len"] is not None and endpoint == "chat":
        raise click.UsageError("--input-len sends token ids, which only --endpoint completions takes")
    if kw["save_outputs"] is not None:
        if kw["multi_turn"] or endpoint != "completions":
            raise click.UsageError(
                "--save-outputs records /v1/completions runs (the server returns the prompt ids there): "
                "use --endpoint completions, without --multi-turn"
            )
        if kw["temperature"] > 0:
            click.echo(
                "ignis-bench: warning: --save-outputs records sampled outputs; replay wants greedy", err=True
            )
    num = kw["num_requests"]
    prompts: list[Prompt] = []
    if not kw["multi_turn"]:
        try:
            prompts = _prompts(
                kw["dataset"], kw["input_len"], num or 16, kw["token_id_range"], kw["seed"], kw["prefix_len"]
            )
        except DatasetError as exc:
            click.echo(f"ignis-bench: {exc}", err=True)
            sys.exit(1)
    cfg = BenchConfig(
        endpoint=endpoint,
        model=kw["model"],
        max_tokens=kw["max_tokens"] or (200 if kw["multi_turn"] else 256),
        ignore_eos=kw["ignore_eos"],
        temperature=kw["temperature"],
        top_p=kw["top_p"],
        top_k=kw["top_k"],
        seed=kw["seed"],
        concurrency=kw["concurrency"][0],
        request_rate=kw["request_rate"],
        burstiness=kw["burstiness"],
        num_requests=num or len(prompts) or 16,
        warmup=kw["warmup"],
        percentiles=kw["percentiles"],
        timeout=kw["timeout"],
        progress=kw["progress"],
        return_token_ids=kw["save_outputs"] is not None,
    )
    target = Target(socket=kw["socket"], url=kw["url"])
    mt = MultiTurnConfig(
        sessions=kw["sessions"],
        turns=kw["turns"],
        tool_tokens=kw["tool_tokens"],
        system_tokens=kw["opener_tokens"],
        token_id_range=kw["token_id_range"],
    )

    reports: list[dict[str, Any]] = []
    outputs: list[RequestResult] = []
    interrupted = False

    async def go() -> None:
        client = BenchClient(target, timeout=cfg.timeout, max_connections=max(kw["concurrency"]))
        try:
            for concurrency in kw["concurrency"]:
                run_cfg = dataclasses.replace(cfg, concurrency=concurrency)
                if kw["multi_turn"]:
                    report = await run_multi_turn(client, run_cfg, mt)
                else:
                    report = await run_load(client, run_cfg, prompts, outputs)
                report["argv"] = ["ignis-bench", *sys.argv[1:]]
                report["label"] = kw["label"]
                reports.append(report)
                click.echo(format_report(report))
                if report["interrupted"]:
                    break
        finally:
            await client.aclose()

    try:
        asyncio.run(go())
    except (ServerError, DatasetError) as exc:
        click.echo(f"ignis-bench: {exc}", err=True)
        if not reports:
            sys.exit(1)
    except KeyboardInterrupt:  # outside a measured run (warm-up, calibration) or a second Ctrl-C
        click.echo("ignis-bench: interrupted", err=True)
        if not reports:
            sys.exit(130)
        interrupted = True
    if len(kw["concurrency"]) > 1:
        click.echo(format_sweep(reports))
    if kw["json_out"] is not None:
        out = reports[0] if len(kw["concurrency"]) == 1 else {"runs": reports}
        kw["json_out"].parent.mkdir(parents=True, exist_ok=True)
        kw["json_out"].write_text(json.dumps(out, indent=1) + "\n")
        click.echo(f"report written to {kw['json_out']}", err=True)
    if kw["save_outputs"] is not None:
        n = write_outputs(kw["save_outputs"], outputs)
        click.echo(f"{n} prompt/output pair(s) written to {kw['save_outputs']}", err=True)
    if interrupted or any(r["interrupted"] for r in reports):
        sys.exit(130)
    complete = len(reports) == len(kw["concurrency"])
    sys.exit(0 if complete and all(r["summary"]["failed"] == 0 for r in reports) else 1)


if __name__ == "__main__":
    main()
