"""The server's own cost: the same greedy generation run by the engine in-process and by `ignis-run` at
its Unix socket, at 1 and 8 concurrent lanes (issue 25, item 3).

    python -m ignis.tools.bench.serve_overhead --synthetic --round-ms 1 --lanes 1,8
    python -m ignis.tools.bench.serve_overhead --synthetic --round-ms 0.2 --json-out overhead.json
    python -m ignis.tools.bench.serve_overhead --artifact DIR --device cuda --lanes 1,8 --max-tokens 256
    python -m ignis.tools.bench.serve_overhead --synthetic --round-ms 0.2 --engine-process both

For each concurrency c the benchmark

1. runs c lanes of the same prompt length to `--max-tokens` (greedy, `ignore_eos`) with one
   `SpeculativeEngine` of this process (`generate`, after one warm-up generation): in-process tok/s =
   output tokens / wall seconds, and this process's CPU seconds (every thread) per token;
2. serves the same prompts through `ignis-run` (a subprocess, `python -m ignis.runtime.cli`, `--lanes`
   the largest concurrency, prompt checkpoints off on both sides) on a fresh Unix socket: it first
   checks that one streamed request gives the in-process token ids (`return_token_ids`), then sends c
   concurrent streamed `/v1/completions` requests: served tok/s = output tokens (the usage the server
   reports) / the seconds from the first request sent to the last `[DONE]`, and the server's CPU
   seconds (all threads of its process and of its children, the engine process with
   `--engine-process`: the process CPU-time clocks) per token, and its main thread's (the event
   loop's). `--engine-process on` serves with `ignis-run --engine-process`, `off` (the default)
   with `--no-engine-process`, `both` starts both servers and interleaves their runs.

With `--interleave` (the default with `--synthetic`) both sides hold the model at once and their runs
alternate, so that other work on a shared machine weighs on both alike; without it (the default with
`--artifact`: one copy of a large model in memory at a time) every in-process run comes first, then
the model is closed and the server started.

Each figure is the median over `--repeat` runs. The table gives in-process tok/s, served tok/s, their
ratio and both CPU costs per token; `--json-out` writes them with the settings.

The client is a lean HTTP/1.1 reader on a raw asyncio Unix-socket stream (it counts `data:` events and
parses only the usage chunk), so that on a small machine it takes as little CPU from the server as
possible. Every request must end with `[DONE]` and report `max_tokens` completion tokens, else the run
fails.

**Synthetic mode** (`--synthetic`): a model whose forward costs `--round-ms` of sleep (the GIL released,
as a thread waiting on a GPU round) and returns logits that pick a fixed next token (a function of the
previous token and its position), with a byte-level BPE tokenizer of `--vocab` tokens trained here on
generated text. The engine around it is the real one (scheduler, stops, acceptance), so on a CPU the
served-against-in-process gap is the server's own per-token and per-round cost. `ignis-run` serves it
through `--model-factory ignis.tools.bench.serve_overhead:synthetic_source_from_env` (settings in
IGNIS_SYNTH_* environment variables).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import torch

from ignis.runtime.engine import LaneResult, SpeculativeEngine
from ignis.runtime.families.base import ForwardOutput
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.model import ModelSettings, ModelSource, ServedModel
from ignis.runtime.tokenizer import Tokenizer, TokenizerSpec
from ignis.tools.bench.serve.options import (
    concurrency_option,
    json_out_option,
    max_tokens_option,
    seed_option,
)

__all__ = [
    "SyntheticConfig",
    "SyntheticExecutor",
    "SyntheticSource",
    "main",
    "synthetic_source_from_env",
    "synthetic_tokenizer",
]

EOS_ID = 0


# --------------------------------------------------------------------------- the synthetic model


@dataclass(frozen=True)
class SyntheticConfig:
    """The synthetic model's shape.

    Attributes:
        vocab_size: tokens (the tokenizer's vocabulary size).
        max_position_embeddings: context limit in tokens.
        round_s: seconds every forward sleeps (the device time of a round; the GIL is released).
    """

    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    round_s: float = 0.001


@dataclass
class _SyntheticLane:
    committed: int = 0
    pending: int | None = None  # columns of the forward not committed yet

    @property
    def num_tokens(self) -> int:
        return self.committed


def next_token(token: int, position: int, vocab_size: int) -> int:
    """The synthetic model's greedy choice after `token` at `position`: never EOS (id 0)."""
    return (token * 1103515245 + position * 12345 + 7) % (vocab_size - 1) + 1


class SyntheticExecutor:
    """A fixed-logit executor (`ignis.runtime.families.base.Executor`): every forward sleeps
    `config.round_s` seconds, then gives each column float32 logits [n, vocab] that are 0 except 1.0 at
    `next_token(column token, column position)`. Stateless apart from each lane's committed count, so
    any commit is exact."""

    device = torch.device("cpu")

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config

    def new_lane(self) -> _SyntheticLane:
        return _SyntheticLane()

    def forward(
        self,
        states: Sequence[_SyntheticLane],
        columns: Sequence[torch.Tensor],
        *,
        logits: str = "all",
        record: bool = True,
        output_hidden_states: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        if self.config.round_s > 0:
            time.sleep(self.config.round_s)
        v = self.config.vocab_size
        out = []
        for st, col in zip(states, columns, strict=True):
            if st.pending is not None:
                raise RuntimeError("forward while a previous forward is not committed")
            ids = col.tolist()
            st.pending = len(ids)
            if logits == "last":
                ids_pos = [(ids[-1], st.committed + len(ids) - 1)]
            else:
                ids_pos = [(t, st.committed + j) for j, t in enumerate(ids)]
            rows = torch.zeros(len(ids_pos), v, dtype=torch.float32)
            for j, (t, p) in enumerate(ids_pos):
                rows[j, next_token(t, p, v)] = 1.0
            out.append(rows)
        return ForwardOutput(logits=out)

    def commit(self, states: Sequence[_SyntheticLane], num_keep: Sequence[int]) -> None:
        for st, keep in zip(states, num_keep, strict=True):
            if st.pending is None or not 0 <= keep <= st.pending:
                raise RuntimeError(f"commit of {keep} columns without a matching forward")
            st.committed += keep
            st.pending = None


def _corpus(num_words: int, seed: int = 0) -> list[str]:
    """Generated text for the tokenizer's training: words of 1-9 letters drawn with Zipf-like weights,
    with punctuation and a few accented letters (so byte-level merges span multi-byte characters)."""
    g = torch.Generator().manual_seed(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz" + "éàü"
    lengths = torch.randint(1, 10, (num_words,), generator=g).tolist()
    ranks = torch.arange(1, len(letters) + 1, dtype=torch.float64)
    picks = torch.multinomial(1.0 / ranks, sum(lengths), replacement=True, generator=g).tolist()
    words, pos = [], 0
    for n in lengths:
        words.append("".join(letters[i] for i in picks[pos : pos + n]))
        pos += n
    lines = [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    return lines


def synthetic_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style, as Qwen and Llama 3 use) of about `vocab_size` tokens
    (fewer when the generated corpus has no more merges), id 0 `<|endoftext|>` (special, the EOS),
    trained on `_corpus`. Deterministic."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(60_000), trainer=trainer)
    spec = TokenizerSpec(
        tokenizer_json=tok.to_str(),
        chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
        special_tokens={"eos_token": "<|endoftext|>"},
        eos_token_ids=(EOS_ID,),
    )
    return Tokenizer(spec)


@dataclass
class SyntheticSource:
    """A `ModelSource` over `SyntheticExecutor` and `synthetic_tokenizer` (speculation off only)."""

    vocab_size: int = 4096
    context: int = 4096
    round_s: float = 0.001
    name: str = "synthetic"
    aliases: tuple[str, ...] = ()
    spec_kinds: tuple[str, ...] = ()
    profile: str | None = None

    def missing_backend_reason(self, backend: str) -> str:
        return f"the synthetic model has no {backend} drafter (speculation off only)"

    def load(self, settings: ModelSettings) -> ServedModel:
        tokenizer = synthetic_tokenizer(self.vocab_size)
        config = SyntheticConfig(
            vocab_size=int(tokenizer.vocab_size), max_position_embeddings=self.context, round_s=self.round_s
        )

        def make_engine(max_lanes: int, metrics: SpeculativeMetrics) -> SpeculativeEngine:
            return SpeculativeEngine(
                SyntheticExecutor(config),
                None,
                eos_token_ids=(EOS_ID,),
                detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                max_context=settings.max_context,
                max_lanes=max_lanes,
                max_prefill_tokens=settings.max_prefill_tokens,
                metrics=metrics,
                async_rounds=settings.async_rounds,
            )

        return ServedModel(name=self.name, tokenizer=tokenizer, make_engine=make_engine, spec=settings.spec)


def synthetic_source_from_env() -> SyntheticSource:
    """`SyntheticSource` from IGNIS_SYNTH_VOCAB, IGNIS_SYNTH_CONTEXT, IGNIS_SYNTH_ROUND_MS (for
    `ignis-run --model-factory`)."""
    env = os.environ
    return SyntheticSource(
        vocab_size=int(env.get("IGNIS_SYNTH_VOCAB", "4096")),
        context=int(env.get("IGNIS_SYNTH_CONTEXT", "4096")),
        round_s=float(env.get("IGNIS_SYNTH_ROUND_MS", "1")) / 1000.0,
    )


# --------------------------------------------------------------------------- figures


@dataclass
class Figures:
    """One concurrency's medians.

    Attributes:
        lanes: concurrent requests.
        in_process_tok_s, served_tok_s: output tokens per wall second.
        ratio: served / in-process.
        in_process_cpu_s_per_token: this process's CPU seconds (all threads) per output token in-process.
        server_cpu_s_per_token: the server process's CPU seconds (all threads) per output token served.
        server_loop_cpu_s_per_token: of which the main thread's, the event loop's (Linux: utime + stime
            of /proc/PID/task/PID/stat, clock ticks; 0.0 where unreadable).
        engine_process_cpu_s_per_token: of which the server's child processes' (the engine process
            with --engine-process; 0.0 without).
        in_process_runs, served_runs: every run's tok/s (the best of them is the figure least
            disturbed by other work on a shared machine).
    """

    lanes: int
    in_process_tok_s: float = 0.0
    served_tok_s: float = 0.0
    ratio: float = 0.0
    in_process_cpu_s_per_token: float = 0.0
    server_cpu_s_per_token: float = 0.0
    server_loop_cpu_s_per_token: float = 0.0
    engine_process_cpu_s_per_token: float = 0.0
    in_process_runs: list[float] = field(default_factory=list)
    served_runs: list[float] = field(default_factory=list)


class BenchError(RuntimeError):
    """The server failed to start or answered wrongly (the message says what)."""


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids in [1, vocab) (no EOS), different for each lane."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(num)]


class InProcess:
    """The engine in this process: one engine of `max_lanes` lanes, warmed up with one short generation,
    reused for every run. With `in_thread` the engine is built here but every generation runs in one
    worker thread, as the server builds it and steps it in its lane thread (no event loop beside it):
    the in-thread figure against the main-thread one isolates what running in a thread costs."""

    def __init__(
        self, model: ServedModel, max_lanes: int, warm_prompt: list[int], *, in_thread: bool = False
    ) -> None:
        self.engine = model.make_engine(max_lanes, SpeculativeMetrics())
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="bench-engine") if in_thread else None
        self._generate([warm_prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[LaneResult]:
        if self._worker is None:
            return self.engine.generate(prompts, params)
        return self._worker.submit(self.engine.generate, prompts, params).result()

    def close(self) -> None:
        """Stop the worker thread (if any)."""
        if self._worker is not None:
            self._worker.shutdown()

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[int]]:
        """Generate `prompts` together (greedy, ignore_eos); returns (tok/s, this process's CPU seconds
        per token, the first prompt's output ids).

        Raises:
            BenchError: an output shorter than max_tokens.
        """
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        cpu0, t0 = time.process_time(), time.perf_counter()
        results = self._generate(prompts, params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        n = sum(len(r.output_token_ids) for r in results)
        if n != max_tokens * len(prompts):
            raise BenchError(f"in-process: {n} tokens, expected {max_tokens * len(prompts)}")
        return n / wall, cpu / n, list(results[0].output_token_ids)


def _thread_cpu_s(pid: int, tid: int) -> float:
    """utime + stime of one thread of a process (Linux /proc, clock ticks), or 0.0 where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds of a process, every thread (Linux: the process's CPU-time clock, the clock id
    `clock_getcpuclockid(pid)` returns, nanoseconds; else utime + stime of /proc/PID/stat, clock ticks)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(socket_path: str, body: dict[str, Any]) -> tuple[int, int, list[int]]:
    """POST one streamed /v1/completions over the socket; returns (token events, usage completion
    tokens, token ids when the request asked for them)."""
    reader, writer = await asyncio.open_unix_connection(socket_path, limit=1 << 20)
    try:
        payload = json.dumps(body).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: ignis\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        if status != b"200":
            rest = await reader.read()
            raise BenchError(f"HTTP {status.decode()}: {(head + rest)[:400]!r}")
        if b"transfer-encoding: chunked" not in head.lower():
            raise BenchError(f"expected a chunked event stream, got headers {head!r}")
        buf = b""
        events, completion, ids, done = 0, -1, [], False
        while not done:
            size = int((await reader.readline()).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            buf += data[:-2]
            *whole, buf = buf.split(b"\n\n")
            for ev in whole:
                if ev == b"data: [DONE]":
                    done = True
                elif b'"choices":[]' in ev:
                    completion = int(json.loads(ev[6:])["usage"]["completion_tokens"])
                elif ev.startswith(b"data: {"):
                    if b'"error"' in ev[:20]:
                        raise BenchError(f"stream error: {ev[:400]!r}")
                    events += 1
                    if body.get("return_token_ids"):
                        ids.extend(json.loads(ev[6:])["choices"][0]["token_ids"])
        if not done:
            raise BenchError("the stream ended without [DONE]")
        return events, completion, ids
    finally:
        writer.close()


def _body(prompt: list[int], max_tokens: int, with_ids: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if with_ids:
        body["return_token_ids"] = True
    return body


async def _served_once(socket_path: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    got = await asyncio.gather(*(_stream(socket_path, _body(p, max_tokens)) for p in prompts))
    wall = time.perf_counter() - t0
    for events, completion, _ in got:
        if completion != max_tokens or events != max_tokens:
            raise BenchError(f"a request got {events} token events and usage {completion}, not {max_tokens}")
    return wall, sum(c for _, c, _ in got)


class ServerProcess:
    """`ignis-run` in a subprocess on a fresh Unix socket (a context manager; SIGTERM at exit).

    `log`: where the server's output goes (kept after `close`); None: a file in the server's
    temporary folder, removed with it. `ready_s`: seconds from the start to the first healthy answer.
    """

    def __init__(self, args: list[str], env: dict[str, str], timeout: float, log: Path | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="ign-ovh-", dir="/tmp")
        self.socket = os.path.join(self.dir, "s.sock")
        self.log = Path(self.dir) / "server.log" if log is None else log
        cmd = [sys.executable, "-m", "ignis.runtime.cli", "--socket", self.socket, *args]
        self._log_file = self.log.open("wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = t0 + timeout
        while not os.path.exists(self.socket) or not self._healthy():
            if self.proc.poll() is not None:
                message = f"ignis-run exited with {self.proc.returncode}:\n{self.tail()}"
                self.close()
                raise BenchError(message)
            if time.monotonic() > deadline:
                message = f"ignis-run did not answer /health within {timeout:.0f} s:\n{self.tail()}"
                self.close()
                raise BenchError(message)
            time.sleep(0.1)
        self.ready_s = time.monotonic() - t0

    def _healthy(self) -> bool:
        import http.client
        import socket

        conn = http.client.HTTPConnection("ignis")
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2.0)
            s.connect(self.socket)
            conn.sock = s
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def tail(self, n: int = 30) -> str:
        self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s) and remove its folder (socket and log)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_served(
    server: ServerProcess,
    prompt: list[int],
    max_tokens: int,
    expect_ids: list[int],
    *,
    allow_divergence: bool = False,
) -> None:
    """One streamed request with `return_token_ids`: its ids must be the in-process ones (with
    `allow_divergence`, a difference is only printed: bf16 on a GPU, where rounds of other shapes
    round differently and a near-tie may flip).

    Raises:
        BenchError: a wrong reply, or different token ids (unless allowed).
    """
    _, _, ids = asyncio.run(_stream(server.socket, _body(prompt, max_tokens, with_ids=True)))
    if ids != expect_ids:
        first = next((i for i, (a, b) in enumerate(zip(ids, expect_ids, strict=False)) if a != b), None)
        msg = f"served token ids differ from in-process ones (first at output position {first})"
        if allow_divergence:
            print(f"warning: {msg}", file=sys.stderr, flush=True)
            return
        raise BenchError(msg)


def _descendants(pid: int) -> list[int]:
    """The process ids of a process's children and theirs (Linux /proc; [] where unreadable)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def _tree_cpu_s(pids: Sequence[int]) -> float:
    total = 0.0
    for p in pids:
        try:
            total += _proc_cpu_s(p)
        except (OSError, IndexError):
            pass
    return total


def run_served(
    server: ServerProcess, prompts: list[list[int]], max_tokens: int
) -> tuple[float, float, float, float]:
    """Serve `prompts` concurrently once; returns (tok/s, the server's CPU seconds per token (its
    process and its children: the engine process with --engine-process), its main thread's CPU
    seconds per token, its children's).

    Raises:
        BenchError: a wrong reply.
    """
    pid = server.proc.pid
    kids = _descendants(pid)
    own0, kids0, loop0 = _tree_cpu_s([pid]), _tree_cpu_s(kids), _thread_cpu_s(pid, pid)
    wall, n = asyncio.run(_served_once(server.socket, prompts, max_tokens))
    own, child = _tree_cpu_s([pid]) - own0, _tree_cpu_s(kids) - kids0
    return n / wall, (own + child) / n, (_thread_cpu_s(pid, pid) - loop0) / n, child / n


def format_table(rows: list[Figures], title: str) -> str:
    """The figures as a Markdown table."""
    out = [
        title,
        "",
        "| lanes | in-process tok/s | served tok/s | served / in-process | in-process CPU µs/token "
        "| server CPU µs/token | of which the event loop's | of which the engine process's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in rows:
        out.append(
            f"| {f.lanes} | {f.in_process_tok_s:,.0f} | {f.served_tok_s:,.0f} | {f.ratio:.3f} "
            f"| {f.in_process_cpu_s_per_token * 1e6:,.0f} | {f.server_cpu_s_per_token * 1e6:,.0f} "
            f"| {f.server_loop_cpu_s_per_token * 1e6:,.0f} | {f.engine_process_cpu_s_per_token * 1e6:,.0f} |"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--artifact", type=click.Path(exists=True, file_okay=False), help="An ignis-build artifact.")
@click.option("--synthetic", is_flag=True, help="The synthetic fixed-logit model (module docstring).")
@click.option(
    "--round-ms",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Synthetic: the device time of one forward, milliseconds.",
)
@click.option(
    "--vocab",
    type=click.IntRange(min=300),
    default=4096,
    show_default=True,
    help="Synthetic: tokenizer vocabulary size.",
)
@concurrency_option(
    "--lanes",
    "lanes",
    default="1,8",
    help="Concurrent requests, comma-separated (the server runs with --lanes the largest).",
)
@click.option(
    "--input-len",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Prompt tokens per request.",
)
@max_tokens_option(default=256, minimum=2, help="Output tokens per request (ignore_eos).")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Runs per figure (the median is reported).",
)
@click.option("--device", help="Artifact: torch device (cuda, cpu) for both sides.")
@click.option(
    "--spec-backend",
    type=click.Choice(["dflash2", "mtp", "ngram", "draft-model", "off"]),
    default="off",
    show_default=True,
    help="Artifact: the speculative backend of both sides.",
)
@click.option("--spec-draft-tokens", type=click.IntRange(1, 7), help="Artifact: draft tokens per round.")
@click.option(
    "--spec-draft-model",
    type=click.Path(exists=True, file_okay=False),
    help="Artifact, --spec-backend draft-model: the drafter's artifact.",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=True,
    show_default=True,
    help="Artifact: CUDA graphs on both sides.",
)
@click.option(
    "--max-prefill-tokens",
    type=click.IntRange(min=0),
    help="Prefill budget of both sides [default: the card profile's].",
)
@click.option(
    "--async-rounds/--no-async-rounds",
    default=False,
    show_default=True,
    help="Both sides: the engine's async rounds (ignis-run --async-rounds; runtime/async_rounds.py).",
)
@click.option(
    "--interleave/--no-interleave",
    default=None,
    help="Alternate in-process and served runs with the model loaded on both sides at once (fair on a "
    "machine shared with other work; twice the memory) [default: on with --synthetic, off with "
    "--artifact: every in-process run, the model closed, then the server].",
)
@click.option(
    "--in-process-thread",
    is_flag=True,
    help="Run the in-process engine in a worker thread, as the server's lane thread runs it (isolates the "
    "cost of stepping from a thread from the server's own).",
)
@click.option(
    "--engine-process",
    type=click.Choice(["off", "on", "both"]),
    default="off",
    show_default=True,
    help="Serve with ignis-run --engine-process (on), without (off: --no-engine-process), or both: two "
    "servers up at once, their runs alternating (and interleaved with the in-process ones with "
    "--interleave), a table each.",
)
@seed_option(help="Prompt seed.")
@click.option(
    "--start-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds the server may take to load and answer /health.",
)
@click.option(
    "--allow-divergence",
    is_flag=True,
    help="Print, instead of refusing, served token ids that leave the in-process ones (bf16 on a GPU: "
    "rounds of other shapes round differently and a near-tie may flip).",
)
@json_out_option(help="Write the figures as JSON here.")
def main(**opts: Any) -> None:
    """Served tok/s against in-process tok/s of the same model, at each concurrency (module docstring)."""
    from ignis.formats import FormatError
    from ignis.runtime.errors import IgnisRuntimeError

    try:
        _bench(**opts)
    except (BenchError, IgnisRuntimeError, FormatError) as exc:  # a server that failed, a bad artifact
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


def _bench(
    artifact: str | None,
    synthetic: bool,
    round_ms: float,
    vocab: int,
    lanes: list[int],
    input_len: int,
    max_tokens: int,
    repeat: int,
    device: str | None,
    spec_backend: str,
    spec_draft_tokens: int | None,
    spec_draft_model: str | None,
    cuda_graphs: bool,
    max_prefill_tokens: int | None,
    async_rounds: bool,
    interleave: bool | None,
    in_process_thread: bool,
    engine_process: str,
    seed: int,
    start_timeout: float,
    allow_divergence: bool,
    json_out: Path | None,
) -> None:
    """The benchmark; the arguments are `main`'s options by name."""
    from ignis.runtime.profiles import profile_max_prefill_tokens
    from ignis.runtime.server.settings import BACKENDS, SpecLayer, resolve_spec

    if (artifact is None) == (not synthetic):
        raise click.UsageError("give exactly one of --artifact DIR and --synthetic")
    env = dict(os.environ)
    source: ModelSource
    if synthetic:
        source = SyntheticSource(vocab_size=vocab, round_s=round_ms / 1000.0)
        env.update(IGNIS_SYNTH_VOCAB=str(vocab), IGNIS_SYNTH_ROUND_MS=repr(round_ms))
        model_args = ["--model-factory", "ignis.tools.bench.serve_overhead:synthetic_source_from_env"]
        spec = SpecDefaults(backend="off")
        what = f"synthetic model, {round_ms:g} ms a round, vocabulary {vocab}"
    else:
        from ignis.runtime.server.artifact_source import ArtifactSource

        source = ArtifactSource(artifact, draft_model=spec_draft_model)
        model_args = ["--artifact", str(artifact), "--spec-backend", spec_backend]
        if spec_draft_model is not None:
            model_args += ["--spec-draft-model", str(spec_draft_model)]
        if spec_draft_tokens is not None:
            model_args += ["--spec-draft-tokens", str(spec_draft_tokens)]
        if device is not None:
            model_args += ["--device", device]
        model_args.append("--cuda-graphs" if cuda_graphs else "--no-cuda-graphs")
        layer = SpecLayer("command line", {"backend": spec_backend, "draft_tokens": spec_draft_tokens})
        spec = resolve_spec(
            [layer],
            spec_kinds=source.spec_kinds,
            profile=source.profile,
            missing_backend_reason={b: source.missing_backend_reason(b) for b in BACKENDS if b != "off"},
        ).spec
        what = f"{artifact}, spec {spec_backend}" + (f" k={spec_draft_tokens}" if spec_draft_tokens else "")
    budget = (
        max_prefill_tokens if max_prefill_tokens is not None else profile_max_prefill_tokens(source.profile)
    )
    max_lanes = max(lanes)
    settings = ModelSettings(
        spec=spec,
        device=device,
        cuda_graphs=cuda_graphs,
        max_prefill_tokens=budget,
        async_rounds=async_rounds,
    )  # prompt checkpoints off (budgets 0)

    args = [
        *model_args,
        "--lanes", str(max_lanes),
        "--max-prefill-tokens", str(budget),
        "--checkpoint-card-memory", "0",
        "--checkpoint-host-memory", "0",
        "--log-level", "warning",
        "--async-rounds" if async_rounds else "--no-async-rounds",
    ]  # fmt: skip
    if interleave is None:
        interleave = synthetic
    modes = {"off": ["thread"], "on": ["process"], "both": ["thread", "process"]}[engine_process]
    runs: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {
        (side, c): [] for side in ("in", *modes) for c in lanes
    }
    first_ids: dict[int, list[int]] = {}

    click.echo(f"loading in-process: {what}", err=True)
    model = source.load(settings)
    prompts = _prompts(max_lanes, input_len, int(getattr(model.tokenizer, "vocab_size", vocab)), seed)
    engine = InProcess(model, max_lanes, prompts[0], in_thread=in_process_thread)

    def in_process(c: int) -> None:
        rate, cpu, first_ids[c] = engine.run(prompts[:c], max_tokens)
        runs[("in", c)].append((rate, cpu, 0.0, 0.0))

    if not interleave:  # every in-process run, the model closed, then every served run
        for _ in range(repeat):
            for c in lanes:
                in_process(c)
        engine.close()
        if model.close is not None:
            model.close()
        del model, engine
    click.echo(f"starting ignis-run ({', '.join(modes)})", err=True)
    flags = {"thread": "--no-engine-process", "process": "--engine-process"}
    with contextlib.ExitStack() as stack:
        servers = {
            m: stack.enter_context(ServerProcess([*args, flags[m]], env, start_timeout)) for m in modes
        }
        for rep in range(repeat):
            for c in lanes:
                if interleave:
                    in_process(c)
                for mode, server in servers.items():
                    if rep == 0:
                        check_served(
                            server, prompts[0], max_tokens, first_ids[c], allow_divergence=allow_divergence
                        )
                    runs[(mode, c)].append(run_served(server, prompts[:c], max_tokens))
    if interleave:
        engine.close()

    order = "interleaved" if interleave else "in-process first"
    if in_process_thread:
        order += "; in-process engine in a worker thread"
    by_mode: dict[str, list[Figures]] = {}
    for mode in modes:
        figures = {c: Figures(lanes=c) for c in lanes}
        for c, f in figures.items():
            f.in_process_runs = [r[0] for r in runs[("in", c)]]
            f.served_runs = [r[0] for r in runs[(mode, c)]]
            f.in_process_tok_s = statistics.median(f.in_process_runs)
            f.served_tok_s = statistics.median(f.served_runs)
            f.ratio = f.served_tok_s / f.in_process_tok_s
            f.in_process_cpu_s_per_token = statistics.median(r[1] for r in runs[("in", c)])
            f.server_cpu_s_per_token = statistics.median(r[1] for r in runs[(mode, c)])
            f.server_loop_cpu_s_per_token = statistics.median(r[2] for r in runs[(mode, c)])
            f.engine_process_cpu_s_per_token = statistics.median(r[3] for r in runs[(mode, c)])
        by_mode[mode] = [figures[c] for c in lanes]
        served = "engine in its own process" if mode == "process" else "engine in a thread of the server"
        title = (
            f"{what}; served with the {served}; prompt {input_len} tokens, {max_tokens} out, greedy; "
            f"median of {repeat} ({order})"
        )
        click.echo(format_table(by_mode[mode], title))
        click.echo("")
    rows = by_mode[modes[0]]
    if json_out:
        doc = {
            "model": what,
            "input_len": input_len,
            "max_tokens": max_tokens,
            "repeat": repeat,
            "interleaved": interleave,
            "in_process_thread": in_process_thread,
            "server_lanes": max_lanes,
            "max_prefill_tokens": budget,
            "async_rounds": async_rounds,
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "rows": [asdict(f) for f in rows],
            "engine_process": engine_process,
            "modes": {m: [asdict(f) for f in r] for m, r in by_mode.items()},
        }
        Path(json_out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
