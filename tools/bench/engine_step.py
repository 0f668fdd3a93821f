"""The engine's own host cost a step: CPU microseconds a token spent in `SpeculativeEngine.step` outside
the model (issue 25, "small models are host-bound").

    python -m ignis.tools.bench.engine_step --lanes 1,8 --backends off,ngram,replay --repeat 5
    python -m ignis.tools.bench.engine_step --lanes 8 --backends replay --profile 25
    python -m ignis.tools.bench.engine_step --lanes 1,8 --backends off,off-async --repeat 5

The model is `serve_overhead`'s synthetic executor (a fixed-logit model whose forward sleeps
`--round-ms` with the GIL released, as a thread waiting on a GPU round). For each backend and lane
count the benchmark generates `--max-tokens` greedy tokens (`ignore_eos`) for each of `lanes` prompts
of `--prompt-len` random tokens with one engine, after one warm-up generation, and reports

* **engine us/token**: the stepping thread's CPU time (`time.thread_time`) inside `step()`, less its
  CPU time inside the executor's `forward` and `commit` (the model's own host work, which a CUDA
  executor spends launching its graphs), per output token;
* model us/token: that executor CPU time per output token;
* tok/s: output tokens / wall seconds (with the sleeping forward).

The vocabulary is small by default (`--vocab 256`): on this CPU an argmax over 4,096 logits costs
~30 us of arithmetic, which a GPU does on the device while the host only launches it; a small
vocabulary leaves the engine's own cost (Python, tensor dispatch, copies) in the figure.

Backends: `off` (no drafter), `off-async` (no drafter, the engine's `async_rounds`: round N+1 issued
from round N's argmax before the host reads N, `ignis.runtime.async_rounds`; here the forward sleeps in
the stepping thread, so nothing overlaps: the figure is the engine's host cost a token with the async
bookkeeping, not a speed-up), `ngram` (prompt lookup, `--draft-tokens` drafts; the synthetic model's
outputs rarely repeat, so most of its rounds are plain decode rows), `replay` (the benchmarking drafter
replaying the model's own greedy outputs, each draft right with probability `--accept`: the verify
round at a fixed acceptance, recorded first with backend off).

With `--temperature` > 0 the lanes sample (seeded; the synthetic model's logits make a distribution
over a few tokens) and the rounds go through rejection sampling; outputs are then not compared.

Each figure is the median over `--repeat` runs. `--profile N` runs cProfile over one more generation
per configuration and prints the N functions with the most own time. `--json-out` writes the figures.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import torch

from ignis.runtime.drafters.ngram import NgramDrafter
from ignis.runtime.drafters.replay import ReplayDrafter
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.families.base import ForwardOutput
from ignis.runtime.sampling import SamplingParams
from ignis.tools.bench.serve_overhead import EOS_ID, SyntheticConfig, SyntheticExecutor, next_token

__all__ = ["TimedExecutor", "main", "measure"]


class TimedExecutor(SyntheticExecutor):
    """`SyntheticExecutor` that adds up the calling thread's CPU seconds inside `forward` and
    `commit` (`model_cpu_s`), so that the engine's own CPU time can be told apart from the model's.

    With `shared_rows` (the default) a forward's logits are views of one float32 buffer [lanes, width,
    vocab], as the static, graphed executors return their round's output buffer (`hybrid_graphs`,
    `llama_graphs`); otherwise one tensor per lane, as the eager executors."""

    def __init__(self, config: SyntheticConfig, *, shared_rows: bool = True) -> None:
        super().__init__(config)
        self.model_cpu_s = 0.0
        self.shared_rows = shared_rows

    def forward(self, states: Any, columns: Any, *, logits: str = "all", **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            if not self.shared_rows:
                return super().forward(states, columns, logits=logits, **kwargs)
            return self._shared_forward(states, columns, logits)
        finally:
            self.model_cpu_s += time.thread_time() - t0

    def _shared_forward(self, states: Any, columns: Any, logits: str) -> ForwardOutput:
        if self.config.round_s > 0:
            time.sleep(self.config.round_s)
        v = self.config.vocab_size
        lens = [int(c.numel()) for c in columns]
        buf = torch.zeros(len(lens), max(lens), v)
        lane_idx, col_idx, tok_idx = [], [], []
        for i, (st, col) in enumerate(zip(states, columns, strict=True)):
            if st.pending is not None:
                raise RuntimeError("forward while a previous forward is not committed")
            st.pending = lens[i]
            for j, t in enumerate(col.tolist()):
                lane_idx.append(i)
                col_idx.append(j)
                tok_idx.append(next_token(t, st.committed + j, v))
        buf[lane_idx, col_idx, tok_idx] = 1.0
        if logits == "last":
            return ForwardOutput(logits=[buf[i, n - 1 : n] for i, n in enumerate(lens)])
        return ForwardOutput(logits=[buf[i, :n] for i, n in enumerate(lens)])

    def commit(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.thread_time()
        try:
            super().commit(*args, **kwargs)
        finally:
            self.model_cpu_s += time.thread_time() - t0


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(num)]


def _engine(
    config: SyntheticConfig, backend: str, refs: dict[tuple[int, ...], list[int]], args: dict[str, Any]
):
    ex = TimedExecutor(config, shared_rows=args["layout"] == "shared")
    if backend in ("off", "off-async"):
        drafter = None
    elif backend == "ngram":
        drafter = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=4)
    elif backend == "replay":
        drafter = ReplayDrafter(refs, vocab_size=config.vocab_size, accept=args["accept"], seed=0)
    else:
        raise click.BadParameter(f"unknown backend {backend!r} (off, off-async, ngram, replay)")
    eng = SpeculativeEngine(
        ex,
        drafter,
        draft_tokens=None if drafter is None else args["draft_tokens"],
        eos_token_ids=(EOS_ID,),
        max_lanes=max(args["lanes"]),
        async_rounds=backend == "off-async",
    )
    return eng, ex


def _run(
    eng: SpeculativeEngine,
    ex: TimedExecutor,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    temperature: float = 0.0,
):
    """One generation: (engine CPU s, model CPU s, wall s, output tokens, rounds, outputs)."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1)
    ids = [eng.add_lane(p, params) for p in prompts]
    ex.model_cpu_s = 0.0
    steps = 0
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while eng.has_unfinished:
        eng.step()
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    results = [eng.pop_result(i) for i in ids]
    n = sum(len(r.output_token_ids) for r in results)
    return cpu - ex.model_cpu_s, ex.model_cpu_s, wall, n, steps, [list(r.output_token_ids) for r in results]


def measure(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (backend, lanes) figure (module docstring)."""
    config = SyntheticConfig(
        vocab_size=args["vocab"], max_position_embeddings=4096, round_s=args["round_ms"] / 1e3
    )
    lanes_list = args["lanes"]
    prompts = _prompts(max(lanes_list), args["prompt_len"], args["vocab"], 0)
    # The model's greedy outputs for the replay drafter (backend off records them).
    eng, ex = _engine(config, "off", {}, args)
    refs = {tuple(p): o for p, o in zip(prompts, _run(eng, ex, prompts, args["max_tokens"])[5], strict=True)}
    rows = []
    for backend in args["backends"]:
        for lanes in lanes_list:
            eng, ex = _engine(config, backend, refs, args)
            _run(eng, ex, prompts[:1], 8)  # warm-up
            eng_us, mod_us, tps, tpr = [], [], [], []
            for _ in range(args["repeat"]):
                e, m, w, n, steps, outs = _run(
                    eng, ex, prompts[:lanes], args["max_tokens"], args["temperature"]
                )
                for p, o in zip(prompts[:lanes], outs, strict=True):
                    if args["temperature"] == 0 and o != refs[tuple(p)]:
                        raise click.ClickException(f"{backend} at {lanes} lanes: output differs from off")
                eng_us.append(e / n * 1e6)
                mod_us.append(m / n * 1e6)
                tps.append(n / w)
                tpr.append(n / lanes / steps)
            row = {
                "backend": backend,
                "lanes": lanes,
                "engine_us_per_token": statistics.median(eng_us),
                "model_us_per_token": statistics.median(mod_us),
                "tok_s": statistics.median(tps),
                "tokens_per_step_per_lane": statistics.median(tpr),
                "runs_engine_us": [round(x, 1) for x in eng_us],
            }
            rows.append(row)
            click.echo(
                f"{backend:>7} {lanes:>2} lanes: engine {row['engine_us_per_token']:7.1f} us/token "
                f"(runs {row['runs_engine_us']}), model {row['model_us_per_token']:6.1f} us/token, "
                f"{row['tok_s']:8.0f} tok/s, {row['tokens_per_step_per_lane']:.2f} tokens/step/lane"
            )
            if args["profile"]:
                prof = cProfile.Profile()
                prof.enable()
                _run(eng, ex, prompts[:lanes], args["max_tokens"], args["temperature"])
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args["profile"])
                click.echo(buf.getvalue())
    return rows


def _ints(value: str) -> list[int]:
    return [int(x) for x in value.split(",") if x]


@click.command()
@click.option("--lanes", default="1,8", show_default=True, help="Lane counts, comma-separated.")
@click.option(
    "--backends", default="off,ngram,replay", show_default=True, help="off, off-async, ngram, replay."
)
@click.option("--round-ms", type=float, default=0.05, show_default=True, help="Forward sleep (ms).")
@click.option(
    "--vocab",
    type=int,
    default=256,
    show_default=True,
    help="Vocabulary (small: an argmax over a real vocabulary is device work on a GPU, not host cost).",
)
@click.option("--prompt-len", type=int, default=32, show_default=True)
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--draft-tokens", type=int, default=7, show_default=True)
@click.option("--accept", type=float, default=0.885, show_default=True, help="Replay drafts' p.")
@click.option("--repeat", type=int, default=5, show_default=True)
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="0: greedy (outputs checked against off); > 0: seeded sampling (rejection sampling).",
)
@click.option(
    "--layout",
    type=click.Choice(["shared", "per-lane"]),
    default="shared",
    show_default=True,
    help="Logits as views of one buffer (graphed executors) or one tensor per lane (eager).",
)
@click.option("--profile", type=int, default=0, help="Print the N functions with most own time.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(**opts: Any) -> None:
    """Engine CPU us a token at each lane count and backend (module docstring)."""
    torch.set_num_threads(1)
    opts["lanes"] = _ints(opts["lanes"])
    opts["backends"] = [b for b in opts["backends"].split(",") if b]
    rows = measure(opts)
    if opts["json_out"] is not None:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in opts.items()}
        opts["json_out"].write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
