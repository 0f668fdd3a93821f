"""The host's share of a llama artifact's decode round, measured on a CPU with the model's math taken out
(issue 25, item 5: what SmolLM2's 3.6 ms a token on the H200 is made of).

    python -m ignis.tools.bench.host_stub ARTIFACT [--lanes 1,8] [--tokens 128]
    python -m ignis.tools.bench.host_stub ARTIFACT --serve [--stream] [--tokens 128]

The executor is `StaticLlamaExecutor` (the one the server builds on CUDA; on the CPU the same code runs
without capture) over the artifact's config and weights, with its `_body` (what a CUDA graph replays)
replaced by fixed float32 logits [rows, vocab] (next token = a function of the column's token, never
an end-of-sequence id): the engine, the executor's host work, the tokenizer and the server are the real
ones, the model costs nothing.

In-process (default): `SpeculativeEngine.generate` of ``--tokens`` tokens a lane from 20-token prompts,
greedy, after one untimed run, median of ``--repeat`` runs: CPU µs a round (`time.thread_time`), of
which this CPU's argmax over [lanes, vocab] (a kernel on CUDA, timed apart), and the torch calls of a
round outside the body (each a dispatch here, a launch or a copy on CUDA).

``--serve``: `ignis-run --model-factory ignis.tools.bench.host_stub:source_from_env` (engine in a
thread, or in its own process with ``--engine-process``; ``--lanes`` the largest lane count) on a
fresh Unix socket; 8 chat prompts (`served_backends`' prompts, greedy, ``ignore_eos``) from 1
client, then from 8 at once, whole or ``--stream``ed; reports tok/s and the server's CPU µs a token
(Linux `/proc/PID/task/*/stat`): the event loop (the main thread), its other threads (the lane
thread, the AnyIO workers) and its child processes (the engine process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.families.llama_graphs import StaticLlamaExecutor
from ignis.runtime.sampling import SamplingParams

__all__ = ["StubSource", "in_process", "source_from_env", "stub_executor"]


def stub_executor(
    config: Any, weights: Any, *, max_lanes: int = 8, max_context: int = 2048
) -> StaticLlamaExecutor:
    """`StaticLlamaExecutor` on the CPU whose round body returns fixed logits (module docstring)."""
    ex = StaticLlamaExecutor(
        config, weights, device="cpu", dtype=torch.float32, max_lanes=max_lanes, max_context=max_context
    )
    vocab = int(config.vocab_size)
    cache: dict[int, torch.Tensor] = {}

    def body(
        ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, bucket: int, **kw: Any
    ) -> dict[str, torch.Tensor]:
        rows = kw.get("logit_rows")
        src = ids if rows is None else ids.index_select(0, rows)
        n = int(src.numel())
        if n not in cache:
            cache[n] = torch.zeros(n, vocab)
        out = cache[n]
        out.zero_()
        out[torch.arange(n), (src * 7 + 3) % (vocab - 1) + 1] = 1.0  # never id 0
        return {"logits": out}

    ex._body = body  # type: ignore[method-assign]
    return ex


class _CallCount(TorchDispatchMode):
    """Counts torch calls by name while not `paused`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self.paused:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def in_process(engine: SpeculativeEngine, *, lanes: int, tokens: int, repeat: int = 5) -> dict[str, Any]:
    """One lane count's figures (module docstring)."""
    vocab = int(engine.executor.config.vocab_size)
    prompts = [[5 + i] * 20 for i in range(lanes)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, params)
    runs = []
    for _ in range(repeat):
        t0 = time.thread_time()
        out = engine.generate(prompts, params)
        runs.append(1e6 * (time.thread_time() - t0) / len(out[0].output_token_ids))
    x = torch.zeros(lanes, vocab)
    t0 = time.thread_time()
    for _ in range(100):
        x.argmax(-1).tolist()
    argmax_us = 1e6 * (time.thread_time() - t0) / 100
    # torch calls of one round outside the body (the stub's own calls excluded)
    ex = engine.executor
    ids = [engine.add_lane(p, params) for p in prompts]
    engine.step()
    count = _CallCount()
    inner = ex._body

    def quiet(*a: Any, **k: Any) -> Any:
        count.paused = True
        try:
            return inner(*a, **k)
        finally:
            count.paused = False

    ex._body = quiet  # type: ignore[method-assign]
    try:
        with count:
            engine.step()
    finally:
        ex._body = inner  # type: ignore[method-assign]
    for i in ids:
        engine.abort(i)
        engine.pop_result(i)
    us = statistics.median(runs)
    return {
        "lanes": lanes,
        "cpu_us_round": round(us, 1),
        "cpu_argmax_us": round(argmax_us, 1),
        "cpu_us_round_without_argmax": round(us - argmax_us, 1),
        "torch_calls_round": sum(count.ops.values()),
    }


# --------------------------------------------------------------------------- served


class StubSource:
    """A `ModelSource`: the artifact's tokenizer and chat template, the real engine over `stub_executor`
    (speculation off)."""

    def __init__(self, path: str | Path) -> None:
        from ignis.runtime.server.artifact_source import ArtifactSource

        self._src = ArtifactSource(path)
        self.name = self._src.name
        self.aliases = self._src.aliases
        self.spec_kinds: tuple[str, ...] = ()
        self.profile = None

    def missing_backend_reason(self, backend: str) -> str:
        return f"the stub model has no {backend} drafter (speculation off only)"

    def serves_on_cuda(self, settings: Any) -> bool:
        return False

    def load(self, settings: Any) -> Any:
        from ignis.runtime.server.model import ServedModel

        art = self._src.artifact
        tokenizer = self._src._tokenizer()
        weights = art.target_weights(dtype=torch.float32, device="cpu", keep_q4=False)
        eos = tuple(tokenizer.eos_token_ids)

        def make_engine(max_lanes: int, metrics: Any) -> SpeculativeEngine:
            return SpeculativeEngine(
                stub_executor(art.config, weights, max_lanes=max_lanes),
                None,
                eos_token_ids=eos,
                detokenize=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
                max_lanes=max_lanes,
                metrics=metrics,
            )

        return ServedModel(name=self.name, tokenizer=tokenizer, make_engine=make_engine, spec=settings.spec)


def source_from_env() -> StubSource:
    """`StubSource` of the artifact in IGNIS_STUB_ARTIFACT (for `ignis-run --model-factory`)."""
    return StubSource(os.environ["IGNIS_STUB_ARTIFACT"])


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the server process's main thread (the event loop), its other threads, and its
    child processes (the engine process) with their threads."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}

    def add(p: int, key: str | None) -> None:
        for tid in os.listdir(f"/proc/{p}/task"):
            try:
                fields = Path(f"/proc/{p}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            k = key or ("event_loop" if tid == str(p) else "other_threads")
            out[k] = out.get(k, 0.0) + (int(fields[11]) + int(fields[12])) / tick

    add(pid, None)
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        try:
            add(int(child), "engine_process")
        except OSError:
            continue
    return out


def serve(
    artifact: str, *, tokens: int, stream: bool, lanes: int, engine_process: bool = False
) -> list[dict[str, Any]]:
    """The `--serve` figures (module docstring)."""
    import httpx

    from ignis.tools.bench.served_backends import PROMPTS

    folder = Path(tempfile.mkdtemp(prefix="ign-stub-", dir="/tmp"))
    sock = folder / "s.sock"
    env = dict(os.environ, IGNIS_STUB_ARTIFACT=str(artifact))
    cmd = [
        sys.executable,
        "-m",
        "ignis.runtime.cli",
        "--model-factory",
        "ignis.tools.bench.host_stub:source_from_env",
    ]
    cmd += ["--socket", str(sock), "--lanes", str(lanes)]
    cmd += ["--engine-process" if engine_process else "--no-engine-process"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        for _ in range(600):
            if sock.exists():
                break
            if proc.poll() is not None:
                raise RuntimeError(f"ignis-run exited with {proc.returncode}")
            time.sleep(0.2)

        def client() -> httpx.Client:
            return httpx.Client(
                transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://ignis", timeout=600
            )

        c = client()
        for _ in range(300):
            try:
                model = c.get("/v1/models").json()["data"][0]["id"]
                break
            except httpx.TransportError:
                time.sleep(0.2)

        def ask(cl: httpx.Client, prompt: str) -> int:
            body: dict[str, Any] = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            if not stream:
                r = cl.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            n = 0
            with cl.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage")
                        n = int(usage["completion_tokens"]) if usage else n
            return n

        ask(c, "Hello")  # untimed
        for clients in (1, 8):
            before, t0 = _thread_cpu(proc.pid), time.perf_counter()
            if clients == 1:
                n = sum(ask(c, p) for p in PROMPTS)
            else:
                got = [0] * len(PROMPTS)

                def work(i: int, got: list[int] = got) -> None:
                    got[i] = ask(client(), PROMPTS[i])

                threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                n = sum(got)
            wall, after = time.perf_counter() - t0, _thread_cpu(proc.pid)
            cpu = {k: 1e6 * (after[k] - before.get(k, 0.0)) / n for k in after}
            rows.append(
                {
                    "clients": clients,
                    "stream": stream,
                    "tokens": n,
                    "tok_s": round(n / wall, 1),
                    "server_cpu_us_token": round(sum(cpu.values()), 1),
                    **{f"{k}_us_token": round(v, 1) for k, v in cpu.items()},
                }
            )
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--engine-process", action="store_true", help="--serve: the engine in its own process")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    counts = [int(x) for x in a.lanes.split(",") if x]
    if a.serve:
        rows = serve(
            a.artifact, tokens=a.tokens, stream=a.stream, lanes=max(counts), engine_process=a.engine_process
        )
        for row in rows:
            print(json.dumps(row), flush=True)
        return 0
    from ignis.runtime.artifact import load_artifact

    art = load_artifact(a.artifact)
    weights = art.target_weights(dtype=torch.float32, device="cpu", keep_q4=False)
    engine = SpeculativeEngine(
        stub_executor(art.config, weights, max_lanes=max(counts)), None, max_lanes=max(counts)
    )
    for lanes in counts:
        print(json.dumps(in_process(engine, lanes=lanes, tokens=a.tokens, repeat=a.repeat)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
