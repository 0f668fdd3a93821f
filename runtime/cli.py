"""`ignis-run`: load an artifact and serve it over a Unix socket (OpenAI-compatible HTTP/1.1).

A thin click layer over `ignis.runtime.server`: it merges the command line with the config file
(`ignis.runtime.config_file`), resolves the speculative settings (`ignis.runtime.server.settings`),
loads the model, logs the proposal head (logger `ignis.runtime.draft_head`) and runs the server
until SIGTERM or SIGINT. Every refusal (a bad knob, a socket held by a live server, `mtp` without its
companion container) exits with status 1 and one line that names the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

import click
import prometheus_client

from ignis.runtime.errors import IgnisRuntimeError
from ignis.runtime.profiles import profile_max_prefill_tokens
from ignis.runtime.scheduler import DEFAULT_MAX_PREFILL_TOKENS

__all__ = ["main", "run_command"]

_DEFAULTS: dict[str, Any] = {
    "lanes": 8,
    "queue_size": 64,
    "retry_after": 1,
    "shutdown_timeout": 30.0,
    "log_level": "info",
    "cuda_graphs": True,
    "max_prefill_tokens": DEFAULT_MAX_PREFILL_TOKENS,
    "expert_cache_pin": "auto",
    "expert_cache_lookahead": False,
}
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

logger = logging.getLogger("ignis.runtime.cli")


def _load_factory(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"expected MODULE:CALLABLE, got {spec!r}", param_hint="--model-factory")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot import {spec!r}: {exc}", param_hint="--model-factory") from exc
    return obj() if callable(obj) else obj


def _checked_device(value: Any) -> str | None:
    """`--device` (or the config file's `device`) checked before any loading: a name torch parses,
    and for CUDA a torch built with it and a device of that index.

    Raises:
        click.BadParameter: otherwise.
    """
    if value is None:
        return None
    import torch

    try:
        dev = torch.device(str(value))
    except (RuntimeError, TypeError, ValueError) as exc:
        raise click.BadParameter(
            f"{value!r} is not a torch device (cpu, cuda, cuda:1, ...)", param_hint="--device"
        ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise click.BadParameter(
                f"{value!r}: this torch has no usable CUDA (built without it, or no GPU visible)",
                param_hint="--device",
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise click.BadParameter(
                f"{value!r}: only {torch.cuda.device_count()} CUDA device(s) visible", param_hint="--device"
            )
    return str(value)


ENGINE_PROCESS_ON_CUDA = True
"""Whether `--engine-process` is on by default for a model served on CUDA. On since the H200 run of
session 15 (a tiny graphed hybrid, 256 tokens, served against in-process: 1.04x / 0.99x at 1 / 8 lanes
in its own process against 0.94x / 0.72x in a thread; docs/perf/README.md). Off on the CPU: there the
engine's own work is the host's and the 2-vCPU build box lost at 1 ms rounds (session 14); it needs a
core for each process."""


ASYNC_ROUNDS_ON_CUDA = True
"""Whether `--async-rounds` is on by default for a model served on CUDA with speculation off. On since
the H200 run of session 16 (the 27B-shaped qwen3_5 at the socket, speculation off: 148.9 / 914.3 tok/s
at 1 / 8 clients against 127.4 / 842.3 without, and again 149.0 / 926.4 against 130.3 / 834.9; greedy
outputs equal; docs/perf/README.md). Off on the CPU (the host is the device: nothing to overlap) and
with a drafter (async rounds run with speculation off only; ADR 0015)."""


def _serves_on_cuda(source: Any, settings: Any) -> bool:
    """Whether the model will be served on CUDA: an explicit CUDA `--device`, or a source that says it
    would load there (`serves_on_cuda`); a source that cannot say counts as not."""
    if settings.device is not None:
        return str(settings.device).startswith("cuda")
    on_cuda = getattr(source, "serves_on_cuda", None)
    return bool(on_cuda(settings)) if on_cuda is not None else False


def _engine_process(value: bool | None, source: Any, settings: Any) -> bool:
    """`--engine-process` resolved: as given, else `ENGINE_PROCESS_ON_CUDA` when the model is served on
    CUDA (`_serves_on_cuda`), else off."""
    if value is not None:
        return bool(value)
    return ENGINE_PROCESS_ON_CUDA and _serves_on_cuda(source, settings)


def _async_rounds(value: bool | None, source: Any, settings: Any) -> bool:
    """`--async-rounds` resolved: as given (asked for beside a drafter, the engine turns it off with a
    warning), else `ASYNC_ROUNDS_ON_CUDA` when speculation is off (`settings.spec.backend == "off"`)
    and the model is served on CUDA (`_serves_on_cuda`), else off."""
    if value is not None:
        return bool(value)
    return ASYNC_ROUNDS_ON_CUDA and settings.spec.backend == "off" and _serves_on_cuda(source, settings)


def run_command(opts: dict[str, Any]) -> None:
    """Resolve, load and serve (the body of `ignis-run`; `opts` are its options by parameter name).

    Raises:
        IgnisRuntimeError, ValueError: a refused setting or a failed load (the CLI prints the message).
    """
    from ignis.runtime.config_file import load_config_file
    from ignis.runtime.server.checkpoints import resolve_checkpoint_budgets
    from ignis.runtime.server.model import ModelSettings, ModelSource
    from ignis.runtime.server.runner import IgnisServer, ServerOptions
    from ignis.runtime.server.settings import BACKENDS, HEAD_BACKENDS, SpecLayer, resolve_spec
    from ignis.runtime.server.sockets import check_socket_group, check_tcp_address, check_unix_socket_path

    cfg = load_config_file(opts["config"]) if opts.get("config") else None
    file_server = cfg.server if cfg is not None else {}

    def pick(key: str) -> Any:
        value = opts.get(key)
        if value is None:
            value = file_server.get(key)
        return _DEFAULTS.get(key) if value is None else value

    logging.getLogger().setLevel(str(pick("log_level")).upper())

    artifact, factory = pick("artifact"), opts.get("model_factory")
    if (artifact is None) == (factory is None):
        raise click.UsageError("give exactly one of --artifact DIR and --model-factory MODULE:CALLABLE")
    if factory is not None:
        source = _load_factory(factory)
        if not isinstance(source, ModelSource):
            raise click.BadParameter(
                f"{factory} returned {type(source).__name__}, not a ModelSource", param_hint="--model-factory"
            )
    else:
        from ignis.runtime.server.artifact_source import ArtifactSource

        replay = None
        if opts.get("spec_replay") is not None:
            from ignis.runtime.drafters.replay import ReplayOptions

            replay = ReplayOptions(
                Path(opts["spec_replay"]),
                accept=float(opts.get("spec_replay_accept", 0.885)),
                seed=int(opts.get("spec_replay_seed") or 0),
            )
        source = ArtifactSource(artifact, draft_model=opts.get("spec_draft_model"), replay=replay)

    if opts.get("max_prefill_tokens") is None and file_server.get("max_prefill_tokens") is None:
        # unset: the card profile's budget (cpu: 256), not the GPU-sized default
        opts = {**opts, "max_prefill_tokens": profile_max_prefill_tokens(pick("profile") or source.profile)}
    served_name = pick("served_model_name") or source.name
    names = [served_name, source.name, *source.aliases]
    layers = []
    if cfg is not None:
        layers.append(SpecLayer(f"{cfg.path} spec", cfg.spec))
        own = cfg.spec_for(names)
        if own:
            section = next(n for n in names if n in cfg.spec_models)
            layers.append(SpecLayer(f"{cfg.path} spec.{section}", own))
    layers.append(
        SpecLayer(
            "command line",
            {
                "backend": opts.get("spec_backend"),
                "draft_tokens": opts.get("spec_draft_tokens"),
                "draft_rows": opts.get("spec_draft_rows"),
                "draft_head": opts.get("spec_draft_head"),
            },
        )
    )
    resolved = resolve_spec(
        layers,
        spec_kinds=source.spec_kinds,
        profile=pick("profile") or source.profile,
        missing_backend_reason={b: source.missing_backend_reason(b) for b in BACKENDS if b != "off"},
    )
    max_context = opts.get("model_max_context")
    if max_context is None and cfg is not None:
        max_context = cfg.max_context_for(names)
    try:
        server_options = ServerOptions(
            socket=pick("socket"),
            socket_group=pick("socket_group"),
            host=pick("host"),
            port=pick("port"),
            lanes=int(pick("lanes")),
            queue_size=int(pick("queue_size")),
            retry_after=int(pick("retry_after")),
            shutdown_timeout=float(pick("shutdown_timeout")),
            log_level=str(pick("log_level")),
            api_key=pick("api_key"),
            max_request_bytes=pick("max_request_bytes"),
        )
    except ValueError as exc:  # a usage error: from the command line or the config file's [server]
        where = f" (the command line or {cfg.path})" if cfg is not None else ""
        raise click.UsageError(f"{exc}{where}") from exc
    # Every listener setting is checked before the (long) model load.
    if server_options.socket is not None:
        check_unix_socket_path(server_options.socket)  # refuse a live server's path before a long load
        if server_options.socket_group is not None:
            check_socket_group(server_options.socket_group)
    if server_options.port is not None:
        host = server_options.host or "127.0.0.1"
        if not check_tcp_address(host, server_options.port) and server_options.api_key is None:
            logger.warning(
                "serving TCP on %s without an API key: anyone who can reach this port can use the model; "
                "set --api-key (or IGNIS_API_KEY, or api_key in the config file), or keep it on loopback",
                host,
            )
    device = _checked_device(pick("device"))

    backend = resolved.spec.backend
    if opts.get("spec_draft_head") is not None and backend not in HEAD_BACKENDS:
        logger.warning("--spec-draft-head applies to dflash2 and mtp; ignored with backend %s", backend)
    if opts.get("spec_draft_model") is not None and backend != "draft-model":
        logger.warning("--spec-draft-model applies to backend draft-model; ignored with backend %s", backend)
    if opts.get("spec_replay") is not None and backend != "replay":
        logger.warning("--spec-replay applies to backend replay; ignored with backend %s", backend)
    head = resolved.spec.draft_head if backend in HEAD_BACKENDS else "none"
    logging.getLogger("ignis.runtime.draft_head").info("proposal head: %s; %s", head, resolved.describe())
    card_bytes, host_bytes = resolve_checkpoint_budgets(
        pick("profile") or source.profile, pick("checkpoint_card_memory"), pick("checkpoint_host_memory")
    )
    logger.info("prompt checkpoints: card %d bytes, host %d bytes", card_bytes, host_bytes)
    logger.info("loading %s (context %s)", served_name, max_context or "the model's own")
    settings = ModelSettings(
        spec=resolved.spec,
        max_context=max_context,
        device=device,
        cuda_graphs=bool(pick("cuda_graphs")),
        graph_warmup_context=pick("graph_warmup_context"),
        max_prefill_tokens=int(pick("max_prefill_tokens")),
        checkpoint_card_bytes=card_bytes,
        checkpoint_host_bytes=host_bytes,
        checkpoint_dir=pick("checkpoint_dir"),
        expert_cache=pick("expert_cache_bytes"),
        expert_cache_pin=pick("expert_cache_pin"),
        expert_cache_lookahead=bool(pick("expert_cache_lookahead")),
    )
    async_rounds = _async_rounds(pick("async_rounds"), source, settings)
    settings = dataclasses.replace(settings, async_rounds=async_rounds)
    engine = None
    if _engine_process(pick("engine_process"), source, settings):
        from ignis.runtime.server.engine_process import EngineSpec, FactorySource, load_text_model

        engine = EngineSpec(FactorySource(factory) if factory is not None else source, settings)
        model = load_text_model(source, settings)
        logger.info("the engine runs in its own process (--engine-process)")
    else:
        model = source.load(settings)
    if served_name != model.name:
        model.aliases = (*model.aliases, model.name)
        model.name = served_name
    server = IgnisServer(model, server_options, engine=engine)
    budget, built = int(pick("max_prefill_tokens")), server.lanes.max_prefill_tokens
    if built is not None and built != budget:  # a --model-factory source that does not pass it on
        logger.warning(
            "the model source built its engine with max_prefill_tokens %s, not the %s asked for "
            "(its make_engine does not pass ModelSettings.max_prefill_tokens on)",
            built,
            budget,
        )
    server.bind()
    status = server.run()
    if status:  # requests were cut at shutdown
        sys.exit(status)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--artifact",
    type=click.Path(exists=True, file_okay=False),
    help="Artifact directory built by ignis-build (the model to serve).",
)
@click.option(
    "--model-factory",
    metavar="MODULE:CALLABLE",
    help="Serve the ModelSource a Python callable returns instead of an artifact (development "
    "and tests; see docs/serving.md).",
)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML or TOML config file: any option below by its long name, plus `spec` and `model` "
    "sections with per-model overrides (e.g. spec: {NAME: {backend: off}}). The command "
    "line wins over the file.",
)
@click.option(
    "--socket",
    metavar="PATH",
    help="Unix socket to serve on, created with mode 0600. A path held by a live server is "
    "refused, a stale socket replaced, a symlink never followed; removed at shutdown.",
)
@click.option(
    "--socket-group",
    metavar="GROUP",
    help="Give the socket to this group with mode 0660 (name or numeric gid).",
)
@click.option(
    "--host", metavar="HOST", help="Also serve TCP on this address (default 127.0.0.1 with --port)."
)
@click.option(
    "--port", type=click.IntRange(0, 65535), help="Also serve TCP on this port (0 picks a free one)."
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1024),
    metavar="BYTES",
    help="Request bodies over this get 413 before they are read. [default: room for a prompt that fills "
    "the context, 16 bytes a token plus 1 MiB, at most 32 MiB]",
)
@click.option(
    "--api-key",
    metavar="KEY",
    envvar="IGNIS_API_KEY",
    show_envvar=True,
    help="Require 'Authorization: Bearer KEY' (the openai client's api_key) on every endpoint but "
    "/health, over TCP and the socket alike; 401 otherwise. Prefer the environment variable or the "
    "config file's api_key: a command line is visible to other users.",
)
@click.option(
    "--served-model-name",
    metavar="NAME",
    help="The model id clients send and /v1/models lists (default: the artifact's name).",
)
@click.option(
    "--lanes",
    type=click.IntRange(min=1),
    help=f"Requests decoded at once; a new request joins at the next round. [default: {_DEFAULTS['lanes']}]",
)
@click.option(
    "--max-prefill-tokens",
    type=click.IntRange(min=0),
    metavar="TOKENS",
    help="Prompt tokens prefilled per step across all lanes: a longer prompt is prefilled in chunks "
    "over several steps while the other lanes keep decoding (one verify round per step); 0 prefills "
    "every prompt whole at once. [default: the card profile's: "
    f"{_DEFAULTS['max_prefill_tokens']}, 256 for cpu]",
)
@click.option(
    "--checkpoint-card-memory",
    metavar="SIZE",
    help="Prompt checkpoints kept on the card (e.g. 16GiB, 0 for none): a request whose prompt "
    "starts with a checkpointed prefix (a previous turn, the system prompt and tools) restores it "
    "and prefills only the rest. Least recently used ones move to host RAM. [default: the profile's]",
)
@click.option(
    "--checkpoint-host-memory",
    metavar="SIZE",
    help="Prompt checkpoints kept in host RAM (e.g. 32GiB, 0 for none). [default: the profile's]",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    help="Snapshot directory: prompt checkpoints are loaded from it at start and written to it at "
    "shutdown (snapshot format 5, bound to the artifact and the drafter), so a restart starts warm.",
)
@click.option(
    "--queue-size",
    type=click.IntRange(min=0),
    help="Requests that may wait for a lane; past them a request gets 503 with Retry-After. "
    f"[default: {_DEFAULTS['queue_size']}]",
)
@click.option(
    "--retry-after",
    type=click.IntRange(min=0),
    metavar="SECONDS",
    help=f"Retry-After of a 503 when the queue is full. [default: {_DEFAULTS['retry_after']}]",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="On SIGTERM, how long requests in flight may run before they are cancelled. "
    f"[default: {_DEFAULTS['shutdown_timeout']:g}]",
)
@click.option(
    "--spec-backend",
    type=click.Choice(["dflash2", "mtp", "ngram", "draft-model", "replay", "off"]),
    help="Speculative backend: dflash2 (the grafted drafter), mtp (needs the NAME_mtp.ninfer "
    "companion beside the artifact), ngram (prompt lookup in the lane's own context: no weights, "
    "4 draft tokens by default), draft-model (needs --spec-draft-model; 3 draft tokens by default), "
    "replay (benchmarking only: needs --spec-replay; 7 draft tokens by default) "
    "or off. [default: the card profile's]",
)
@click.option(
    "--spec-replay",
    type=click.Path(exists=True, dir_okay=False),
    help="With --spec-backend replay (a benchmarking drafter, not for production): a JSONL file of "
    "recorded greedy outputs ({prompt_token_ids, output_token_ids} per line, ignis-bench "
    "--save-outputs writes it) replayed as drafts, each right with probability --spec-replay-accept; "
    "prompts not in it draft nothing. The output stays exact.",
)
@click.option(
    "--spec-replay-accept",
    type=click.FloatRange(0.0, 1.0),
    default=0.885,
    show_default=True,
    help="With --spec-backend replay: the probability that each draft is right.",
)
@click.option(
    "--spec-replay-seed",
    type=int,
    default=0,
    show_default=True,
    help="With --spec-backend replay: seeds the right-or-wrong draws (per prompt).",
)
@click.option(
    "--spec-draft-model",
    type=click.Path(exists=True, file_okay=False),
    help="With --spec-backend draft-model: the ignis artifact of a smaller model with the same "
    "tokenizer (checked at start: the first differing token id is named).",
)
@click.option(
    "--spec-draft-tokens",
    type=click.IntRange(1, 7),
    help="Draft tokens per lane per round, 1..7; required with dflash2, refused without a backend.",
)
@click.option(
    "--spec-draft-rows",
    type=click.IntRange(0, 32),
    help="Row budget of a verify round across lanes for mtp: each lane drafts "
    "min(draft tokens, rows / lanes - 1); 0 means 8, at most 32. [default: the profile's]",
)
@click.option(
    "--spec-draft-head",
    type=click.Choice(["full", "shortlist"]),
    help="The drafter's proposal head: the target's full head, or the Q4 shortlist head over "
    "the 131,072 most frequent tokens. Logged at load as ignis.runtime.draft_head. [default: full]",
)
@click.option(
    "--model-max-context",
    type=click.IntRange(min=2),
    metavar="TOKENS",
    help="Context limit per request in tokens (prompt + output); a longer prompt, or a max_tokens "
    "past it, gets 400. [default: the model's]",
)
@click.option(
    "--profile",
    metavar="CARD",
    help="Card profile whose speculative defaults apply (rtx5090, rtxpro6000, rtx50-16gb, h200, "
    "...). [default: the artifact's card]",
)
@click.option(
    "--device", metavar="DEVICE", help="Torch device to load on (cuda, cuda:1, cpu). [default: the loader's]"
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=None,
    help="On CUDA, run verify rounds of every family (llama, qwen2, qwen3_5, qwen3_next) from CUDA "
    "graphs over fixed-capacity lane buffers sized by --lanes and --model-max-context (8192 tokens "
    "when neither is set and the model allows more), captured at load. [default: on]",
)
@click.option(
    "--engine-process/--no-engine-process",
    default=None,
    help="Run the model and its engine in a child process of their own, the HTTP side (tokenizer, chat "
    "template, tools, grammars) in this one, so that the two do not share one Python interpreter lock "
    "(it pays where the engine is host-bound and a core is free for each process). A child that dies "
    "fails the requests it held (500) and is started again; shutdown stops both. [default: on for a "
    "model served on CUDA, off on the CPU]",
)
@click.option(
    "--graph-warmup-context",
    type=click.IntRange(min=1),
    metavar="TOKENS",
    help="With CUDA graphs (llama, qwen2 and the hybrid families): capture at load the round shapes of "
    "every KV bucket up to this many tokens (a lane's past + the round's columns); rounds past it "
    "capture their shape on first use. Lower it to shorten the load. [default: the whole context]",
)
@click.option(
    "--expert-cache-bytes",
    metavar="SIZE|auto|off",
    help="MoE models: device memory for the routed-expert cache (e.g. 24GiB, 512MiB, bytes); the experts "
    "stay in host memory and each layer caches what fits. --spec-backend mtp takes the MTP head's "
    "reserve from it. auto: the card profile's memory after the weights, KV, the MTP reserve and the "
    "round workspace (on CUDA, when the experts do not all fit); off: every expert on the device. "
    "[default: auto]",
)
@click.option(
    "--expert-cache-pin",
    type=click.Choice(("auto", "on", "off"), case_sensitive=False),
    help="MoE models with an expert cache on CUDA: page-lock the routed experts in host memory (the "
    "artifact's expert ranges mapped read-only and registered with CUDA) so that a cache miss is one "
    "DMA into its slot. auto: fall back to the pinned staging ring (a CPU memcpy first, at the "
    "pageable rate) when registration is refused, logging why; on: refuse to start instead; off: "
    "always the staging ring. [default: auto]",
)
@click.option(
    "--expert-cache-lookahead/--no-expert-cache-lookahead",
    default=None,
    help="MoE models with an expert cache: router lookahead prefetch (each MoE layer also runs the "
    "next MoE layer's router on its input and copies the predicted experts into that layer's slots "
    "while it computes; verify rounds on CUDA graphs in pieces). Off until measured on a trained "
    "router (tools/bench/expert_cache.py --lookahead reports its recall and hit rate). [default: off]",
)
@click.option(
    "--async-rounds/--no-async-rounds",
    default=None,
    help="With speculation off (--spec-backend off; beside a drafter it stays off, with a warning): "
    "issue each decode round from the device's argmax of the previous one before the host reads it, "
    "so the host's work between rounds (stop checks, commit, the next launch) runs while the GPU "
    "computes (runtime/async_rounds.py, ADR 0015). Only while every decoding lane is greedy without "
    "penalties, min_tokens, logprobs or a grammar and no prompt is being prefilled; any other step "
    "first drains the round in flight and runs the ordinary round. Same tokens (up to float rounding "
    "in a round where a lane stops beside others); nothing to gain on the CPU. Counted in /metrics "
    "(ignis_async_rounds_issued_total, ignis_async_rounds_drained_total). [default: on for a model "
    "served on CUDA with speculation off (--spec-backend off, or no drafter), off otherwise]",
)
@click.option(
    "--log-level",
    type=click.Choice(_LOG_LEVELS, case_sensitive=False),
    help=f"Logging level. [default: {_DEFAULTS['log_level']}]",
)
def main(**opts: Any) -> None:
    """Serve a model over a Unix socket with OpenAI-compatible HTTP: /v1/chat/completions,
    /v1/completions (SSE streaming), /v1/models, /health, /metrics.

    \b
    Example:
      ignis-run --artifact artifacts/smollm2-135m --socket /run/ignis/ignis.sock
      curl --unix-socket /run/ignis/ignis.sock http://localhost/v1/models
    """
    logging.basicConfig(
        level=str(opts.get("log_level") or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    prometheus_client.disable_created_metrics()  # no *_created series beside every counter (as vLLM)
    from ignis.formats import FormatError

    try:
        run_command(opts)
    except (IgnisRuntimeError, FormatError, ValueError) as exc:  # a bad artifact: one line, no traceback
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


if __name__ == "__main__":
    main()
