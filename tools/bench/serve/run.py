"""The load of `ignis-bench`: requests sent at a request rate (Poisson arrivals) with at most
`concurrency` in flight, and the `--multi-turn` agent-session replay; both return the run's report
(a JSON-able dict).

Arrivals: with a finite rate r, the gaps between sends are drawn from a gamma distribution of shape b
(`burstiness`) and mean 1/r, seeded: b = 1 is exponential, a Poisson process (as `vllm bench serve`),
b < 1 burstier, b > 1 more regular; with r = inf every
request is sent at once and only the concurrency limit holds them back. A request that arrives while
`concurrency` requests are in flight waits for one to finish (its TTFT is measured from its send).

Speculative figures and counter deltas come from GET /metrics read just before the first request and
just after the last (warm-up requests are run before that first read and left out of everything).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ignis.tools.bench.serve.client import BenchClient, ServerError
from ignis.tools.bench.serve.stats import (
    DEFAULT_PERCENTILES,
    MetricsSnapshot,
    RequestResult,
    checkpoint_summary,
    counters_json,
    distribution,
    linear_fit,
    server_side_summary,
    speculative_summary,
    summarize,
)
from ignis.tools.bench.serve.workload import AgentSession, Prompt, tool_output_text

__all__ = ["BenchConfig", "MultiTurnConfig", "arrival_gaps", "run_load", "run_multi_turn"]

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class BenchConfig:
    """The knobs of a run (the CLI's options).

    Attributes:
        endpoint: "chat" or "completions".
        model: the model id to send (None: the server's first model).
        max_tokens: output tokens per request (per reply in --multi-turn).
        ignore_eos: keep generating past EOS, so each request yields exactly max_tokens.
        temperature: 0 is greedy.
        top_p, top_k: sampling filters (None: the server's defaults).
        seed: seeds the arrivals, random prompts and sessions; request i sends seed + i when sampling.
        concurrency: requests in flight at most.
        request_rate: requests per second (math.inf: all at once).
        burstiness: the shape of the gamma-distributed gaps between sends (1: exponential, Poisson).
        num_requests: requests in the run (prompts cycled).
        warmup: requests run before the measurement.
        percentiles: percentiles the distributions report.
        timeout: seconds the client waits for the server between bytes.
        progress: show a progress bar on stderr.
        return_token_ids: ask for the prompt and generated token ids (`--save-outputs`).
    """

    endpoint: str = "chat"
    model: str | None = None
    max_tokens: int = 256
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    concurrency: int = 8
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_requests: int = 16
    warmup: int = 1
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    timeout: float = 600.0
    progress: bool = True
    return_token_ids: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        out["percentiles"] = list(self.percentiles)
        return out


@dataclass
class MultiTurnConfig:
    """The `--multi-turn` replay: `sessions` synthetic agent conversations of `turns` turns each,
    interleaved on `BenchConfig.concurrency` clients.

    Attributes:
        sessions: conversations.
        turns: turns per conversation.
        tool_tokens: (low, high) tokens of tool output added per turn (drawn uniformly).
        system_tokens: about how many tokens the opener (system prompt + task) has.
        token_id_range: completions sessions draw tool-output ids from [low, high).
    """

    sessions: int = 8
    turns: int = 20
    tool_tokens: tuple[int, int] = (500, 2000)
    system_tokens: int = 1000
    token_id_range: tuple[int, int] = (16, 256)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tool_tokens"] = list(self.tool_tokens)
        out["token_id_range"] = list(self.token_id_range)
        return out


@dataclass
class _Run:
    """What a run gathers; `interrupted` is set by Ctrl-C."""

    results: list[RequestResult] = field(default_factory=list)
    interrupted: bool = False


def _sampling(cfg: BenchConfig, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    if cfg.top_k is not None:
        body["top_k"] = cfg.top_k
    if cfg.temperature > 0:
        body["seed"] = cfg.seed + index
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    return body


def _body(cfg: BenchConfig, model: str, prompt: Prompt, index: int) -> dict[str, Any]:
    body = {"model": model, **_sampling(cfg, index)}
    if cfg.endpoint == "chat":
        body["messages"] = prompt.chat_messages()
    else:
        body["prompt"] = prompt.completion_prompt()
    return body


class _Progress:
    """A tqdm bar on stderr (or nothing)."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=True)

    def update(self, failed: bool) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if failed:
                self.bar.set_postfix_str("some failed", refresh=False)

    def skip(self, n: int) -> None:
        if self.bar is not None and n > 0:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive sends of `num` requests (num - 1 gaps): gamma-distributed with shape
    `burstiness` and mean 1 / `rate` (module docstring), seeded; all 0 when `rate` is infinite."""
    if math.isinf(rate):
        return [0.0] * max(0, num - 1)
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(max(0, num - 1))]


async def _interruptible(main: Callable[[], Any], run: _Run) -> None:
    """Run `main()` as a task; SIGINT (Ctrl-C) cancels it and marks the run interrupted, so the caller
    can still report what finished. Where signal handlers cannot be set (not the main thread), Ctrl-C
    is not caught here."""
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main())

    def on_sigint() -> None:
        run.interrupted = True
        task.cancel()

    installed = False
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    try:
        await task
    except asyncio.CancelledError:
        if not run.interrupted:
            raise
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def _prepare(client: BenchClient, cfg: BenchConfig) -> tuple[str, dict[str, Any]]:
    info = await client.model_info()
    return cfg.model or str(info["id"]), info


def _report(
    mode: str,
    cfg: BenchConfig,
    info: dict[str, Any],
    run: _Run,
    duration: float,
    before: MetricsSnapshot | None,
    after: MetricsSnapshot | None,
    where: str,
) -> dict[str, Any]:
    results = sorted(run.results, key=lambda r: r.index)
    delta = after.delta(before) if before is not None and after is not None else None
    return {
        "mode": mode,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "server": where,
        "model": cfg.model or info.get("id"),
        "max_model_len": info.get("max_model_len"),
        "server_lanes": None if after is None else after.value("ignis_lanes_max"),
        "server_side": None if delta is None else server_side_summary(delta),
        "config": cfg.to_json(),
        "interrupted": run.interrupted,
        "summary": summarize(results, duration, cfg.percentiles),
        "speculative": speculative_summary(delta) if delta is not None else None,
        "prompt_checkpoints": checkpoint_summary(delta, after) if delta is not None else None,
        "metrics_delta": counters_json(delta) if delta is not None else None,
        "requests": [r.to_json() for r in results],
    }


async def run_load(
    client: BenchClient,
    cfg: BenchConfig,
    prompts: Sequence[Prompt],
    outputs: list[RequestResult] | None = None,
) -> dict[str, Any]:
    """Send `cfg.num_requests` requests (prompts cycled) at `cfg.request_rate` with at most
    `cfg.concurrency` in flight; return the report (`_report`; mode "load"). The measured requests'
    records (with their token ids when `cfg.return_token_ids`) are appended to `outputs` when given.

    Raises:
        ServerError: the server cannot be reached at the start.
    """
    model, info = await _prepare(client, cfg)
    path = ENDPOINTS[cfg.endpoint]
    if cfg.endpoint == "chat":
        for p in prompts:
            p.chat_messages()  # a token-id prompt raises DatasetError before anything is sent
    for i in range(cfg.warmup):
        w = await client.stream(
            path,
            _body(cfg, model, prompts[i % len(prompts)].warmup_variant(), i),
            RequestResult(-1, "w"),
            0.0,
        )
        if not w.ok:
            raise ServerError(f"the warm-up request failed: {w.error}")
    run = _Run()
    before = await client.metrics()
    gaps = arrival_gaps(cfg.num_requests, cfg.request_rate, cfg.burstiness, cfg.seed)
    gate = asyncio.Semaphore(cfg.concurrency)
    bar = _Progress(cfg.num_requests, cfg.progress, "requests")
    t0 = time.perf_counter()
    end = t0

    async def one(i: int) -> None:
        nonlocal end
        prompt = prompts[i % len(prompts)]
        result = RequestResult(index=i, prompt_id=prompt.id)
        run.results.append(result)
        async with gate:
            await client.stream(path, _body(cfg, model, prompt, i), result, t0)
        end = max(end, time.perf_counter())
        bar.update(not result.ok)

    async def main() -> None:
        tasks = []
        try:
            for i in range(cfg.num_requests):
                tasks.append(asyncio.create_task(one(i)))
                if i < len(gaps) and gaps[i] > 0:
                    await asyncio.sleep(gaps[i])
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        await _interruptible(main, run)
    finally:
        bar.close()
    end = end if run.results else time.perf_counter()
    after = await client.metrics()
    run.results = [r for r in run.results if r.ok or r.error is not None]  # never-sent ones are dropped
    if outputs is not None:
        outputs.extend(run.results)
    return _report("load", cfg, info, run, end - t0, before, after, client.target.where)


async def _calibrate(client: BenchClient, model: str, path: str) -> float:
    """Words of synthetic tool output per prompt token on this server's tokenizer and chat template:
    two one-token requests whose user messages differ by 4x words; their `usage.prompt_tokens` differ
    by the tokens of those words (x = 100, smaller when that overflows the context).

    Raises:
        ServerError: a calibration request failed.
    """
    error = None
    for base in (100, 25, 5):
        counts = []
        for words in (base, 5 * base):
            text = tool_output_text(random.Random(words), words)
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
            r = await client.stream(path, body, RequestResult(-1, "calibration"), 0.0)
            if not r.ok:
                error = r.error
                break
            counts.append(r.prompt_tokens)
        if len(counts) == 2:
            return 4 * base / max(1, counts[1] - counts[0])
        if error is None or "context_length_exceeded" not in error:
            break
    raise ServerError(f"the calibration request failed: {error}")


def _turn_body(
    cfg: BenchConfig, mt: MultiTurnConfig, model: str, s: AgentSession, index: int
) -> tuple[dict[str, Any], int]:
    """The next turn's request of session `s` and the tokens it adds (an estimate for chat); a sampled
    turn sends the seed `cfg.seed + index` (index = session * turns + turn, whatever the interleaving)."""
    rng = s.rng
    low, high = mt.tool_tokens
    new = rng.randint(low, high) if s.turn > 0 else mt.system_tokens
    body = {"model": model, **_sampling(cfg, index)}
    if cfg.endpoint == "chat":
        words = max(1, round(new / s.tokens_per_word))
        if s.turn == 0:
            s.messages = [
                {
                    "role": "system",
                    "content": "You are a coding agent. Tools you may call:\n"
                    + tool_output_text(rng, max(1, words // 2)),
                },
                {
                    "role": "user",
                    "content": "Task: fix the failing test.\n" + tool_output_text(rng, words - words // 2),
                },
            ]
        else:
            s.messages.append({"role": "user", "content": "Tool output:\n" + tool_output_text(rng, words)})
        body["messages"] = list(s.messages)
    else:
        s.token_ids.extend(rng.randrange(*mt.token_id_range) for _ in range(new))
        body["prompt"] = list(s.token_ids)
        body["return_token_ids"] = True
    return body, new


async def run_multi_turn(client: BenchClient, cfg: BenchConfig, mt: MultiTurnConfig) -> dict[str, Any]:
    """Replay `mt.sessions` synthetic agent sessions of `mt.turns` turns on `cfg.concurrency` clients.

    A turn sends the whole conversation so far plus a new tool output (the opener at turn 0) and
    streams a reply of `cfg.max_tokens` tokens, which joins the conversation. Sessions are taken round
    robin by the clients, so with more sessions than clients they interleave (a session has one turn in
    flight at most). A session stops early when its next turn would not fit the server's context
    (`max_model_len`) or after a failed turn.

    Chat turns carry text: tool output is synthetic log lines sized by the tokens per word measured
    before the run (`_calibrate`), so its token counts are close to the asked ones. Completions turns
    carry token ids: the reply's own ids (`return_token_ids`) and random tool-output ids, so each
    prompt extends the previous prompt and reply exactly.

    Returns:
        The report (`_report`, mode "multi-turn") plus "multi_turn": per turn index the TTFT,
        prompt, cached and new tokens and decode rate (`distribution`s), the share of prompt tokens reused
        ("prompt_tokens_reused_pct", from `usage.prompt_tokens_details.cached_tokens`, 0 when the
        server does not report it), TTFT fits in ms per 1k tokens against the prompt length and against
        the uncached tokens, and how each session ended.
    """
    model, info = await _prepare(client, cfg)
    max_len = info.get("max_model_len")
    path = ENDPOINTS[cfg.endpoint]
    words_per_token = 1.0
    if cfg.endpoint == "chat":  # the calibration requests warm the server up too
        words_per_token = await _calibrate(client, model, path)
    for i in range(cfg.warmup if cfg.endpoint == "completions" else 0):
        ids = [
            mt.token_id_range[0] + (7 * j) % (mt.token_id_range[1] - mt.token_id_range[0]) for j in range(16)
        ]
        body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0}
        w = await client.stream(path, body, RequestResult(-1, f"warm-up-{i}"), 0.0)
        if not w.ok:
            raise ServerError(f"the warm-up request failed: {w.error}")
    run = _Run()
    before = await client.metrics()
    sessions = [
        AgentSession(index=s, rng=random.Random(cfg.seed * 1_000_003 + s)) for s in range(mt.sessions)
    ]
    queue: asyncio.Queue[AgentSession] = asyncio.Queue()
    for s in sessions:
        s.tokens_per_word = 1.0 / words_per_token
        queue.put_nowait(s)
    bar = _Progress(mt.sessions * mt.turns, cfg.progress, "turns")
    t0 = time.perf_counter()
    counter = 0
    prompt_len: dict[int, int] = {}  # session -> the last turn's prompt + reply tokens
    end = t0

    async def turn(s: AgentSession) -> None:
        nonlocal counter, end
        index = counter
        counter += 1
        body, new = _turn_body(cfg, mt, model, s, s.index * mt.turns + s.turn)
        expected = prompt_len.get(s.index, 0) + new
        if max_len is not None and expected + cfg.max_tokens > int(max_len):
            s.done_reason = "context"
            return
        result = RequestResult(
            index=index, prompt_id=f"session-{s.index}/turn-{s.turn}", session=s.index, turn=s.turn
        )
        run.results.append(result)
        await client.stream(path, body, result, t0)
        end = max(end, time.perf_counter())
        bar.update(not result.ok)
        if not result.ok:
            if result.error is not None and "context_length_exceeded" in result.error:
                run.results.remove(result)  # the conversation outgrew the context: the session ends
                s.done_reason = "context"
            else:
                s.done_reason = "error"
            return
        if cfg.endpoint == "chat":
            s.messages.append({"role": "assistant", "content": result.text})
        else:
            s.token_ids.extend(result.generated_ids)
        prompt_len[s.index] = result.prompt_tokens + result.output_tokens
        s.turn += 1
        if s.turn >= mt.turns:
            s.done_reason = "turns"

    async def worker() -> None:
        while True:
            try:
                s = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await turn(s)
            if s.done_reason is None:
                queue.put_nowait(s)
            elif s.done_reason != "turns":  # the turns it will not run still move the bar
                bar.skip(mt.turns - s.turn - (1 if s.done_reason == "error" else 0))

    async def main() -> None:
        workers = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    try:
        await _interruptible(main, run)
    finally:
        bar.close()
    after = await client.metrics()
    run.results = [r for r in run.results if r.ok or r.error is not None]
    report = _report("multi-turn", cfg, info, run, end - t0, before, after, client.target.where)
    report["multi_turn"] = _multi_turn_summary(mt, run.results, sessions, cfg.percentiles)
    return report


def _multi_turn_summary(
    mt: MultiTurnConfig,
    results: Sequence[RequestResult],
    sessions: Sequence[AgentSession],
    percentiles: Sequence[float],
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    per_turn = []
    for t in range(mt.turns):
        rs = [r for r in done if r.turn == t]
        if not rs:
            continue
        per_turn.append(
            {
                "turn": t,
                "requests": len(rs),
                "prompt_tokens": distribution([r.prompt_tokens for r in rs], percentiles),
                "cached_tokens": distribution([r.cached_tokens for r in rs], percentiles),
                "new_tokens": distribution([r.prompt_tokens - r.cached_tokens for r in rs], percentiles),
                "ttft": distribution([r.ttft for r in rs if r.ttft is not None], percentiles),
                "decode_tok_s": distribution(
                    [v for r in rs if (v := r.decode_tok_s) is not None], percentiles
                ),
            }
        )
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    timed = [(r.prompt_tokens, r.cached_tokens, r.ttft) for r in done if r.ttft is not None]
    fit_len = linear_fit([p / 1000 for p, _c, _t in timed], [t * 1000 for _p, _c, t in timed])
    fit_new = linear_fit([(p - c) / 1000 for p, c, _t in timed], [t * 1000 for _p, _c, t in timed])
    first = [t for t in per_turn if t["turn"] == 0]
    last = per_turn[-1] if per_turn else None
    ends: dict[str, int] = {}
    for s in sessions:
        key = s.done_reason or "interrupted"
        ends[key] = ends.get(key, 0) + 1
    return {
        "config": mt.to_json(),
        "turns_completed": len(done),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prompt_tokens_reused_pct": 100.0 * cached / prompt if prompt else 0.0,
        "ttft_ms_per_1k_prompt_tokens": None if fit_len is None else fit_len[0],
        "ttft_ms_per_1k_new_tokens": None if fit_new is None else fit_new[0],
        "ttft_first_turn_mean_s": first[0]["ttft"]["mean"] if first else None,
        "ttft_last_turn_mean_s": last["ttft"]["mean"] if last else None,
        "last_turn": last["turn"] if last else None,
        "sessions_ended": ends,
        "per_turn": per_turn,
    }
