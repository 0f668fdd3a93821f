"""Acceptance on the real pair: speculation off vs draft-model vs ngram, greedy and sampled.

    python -m ignis.tools.bench.acceptance [--source artifacts|gguf] [--num-code 4] [--num-prose 4]
        [--max-new-tokens 64] [--dm-draft-tokens 3] [--ngram-draft-tokens 5] [--batch kind|single]
        [--modes greedy,sampled] [--drafters off,draft-model,ngram] [--json PATH]

Target Qwen2.5-Coder-1.5B-Instruct, draft model Qwen2.5-Coder-0.5B-Instruct. `--source artifacts`
(default) loads the `ignis-build --card cpu` artifacts that `python -m ignis.tools.bench.real_pair build`
makes, the way `ignis-run --artifact TARGET --spec-backend draft-model --spec-draft-model DRAFT`
loads them on a CPU: float32 executors, the target's linears through its compiled modules, the draft
model through `build_draft_model_drafter(artifact=...)` (its tokenizer checked against the target's).
`--source gguf` loads both GGUFs through the importer instead (`ignis.tools.bench.real_pair.load_pair`,
`--dtype`). Prompts: the first `--num-code` code and `--num-prose` prose chat prompts of
`/work/shared/bench/prompts.jsonl`, rendered with the target's chat template (generation prompt added).

For every mode (greedy; sampled at Qwen2.5-Coder's generation_config values temperature 0.7, top-p
0.8, top-k 20, a fixed seed per prompt) and every drafter (`off`, `draft-model`, `ngram`), the prompts
run through `SpeculativeEngine` (`--batch kind`: the prompts of one kind together as lanes of one
engine; `--batch single`: one prompt at a time, the latency case) and the tool records:

- tokens per round: (output tokens - 1) / verify rounds, per lane and pooled (the first token comes
  from the prefill; rounds with zero drafts count, so this is tokens per target forward);
- per-position acceptance: the engine's `position_accepted_total / position_drafted_total`;
- draft columns per round: columns the draft model ran after the prompts / verify rounds (the cost
  of its schedule: k or k + 1 with kept drafts, more with `draft-model-rerun`);
- time per token: (run time - the first step, which holds the prefill) / (tokens emitted after the
  first step), in ms, as wall time and as this process's CPU time (all threads: on a shared machine
  the CPU time leaves out the waiting for a core, so it compares runs made under different loads);
  the drafter's own share of the wall time (propose + commit) is timed separately;
- greedy exactness: each drafter's greedy output against speculation off, prompt by prompt; at the
  first differing token the target's top-2 logit margin after the speculation-off prefix is computed
  (one forward) and reported: below `--near-tie` logit units it is a near-tie (batching-order
  numerics), above it a mismatch (a bug).

Prints a table and writes everything (per lane too) as JSON. Not a test: it takes tens of minutes on
a CPU; `tests/tools/test_real_pair.py` has the slow-marked exactness test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import torch

from ignis.runtime.drafters.base import CommittedSpan, DraftProposal, DraftRequest
from ignis.runtime.drafters.draft_model import DraftModelDrafter
from ignis.runtime.drafters.ngram import NgramDrafter
from ignis.runtime.engine import LaneResult, SpeculativeEngine
from ignis.runtime.sampling import SamplingParams

DEFAULT_PROMPTS = Path("/work/shared/bench/prompts.jsonl")
SAMPLED = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)  # Qwen2.5-Coder's generation_config
NEAR_TIE = 1e-3  # logit units: float32 logits of magnitude ~10-30 differ by ~1e-5 across batch shapes


@dataclass(frozen=True)
class Prompt:
    """One chat prompt of the set: its id ("code-1"), kind ("code" / "prose") and token ids."""

    id: str
    kind: str
    token_ids: tuple[int, ...]


def load_prompts(path: Path, tokenizer: Any, *, num_code: int, num_prose: int) -> list[Prompt]:
    """The first `num_code` code and `num_prose` prose prompts, chat-rendered with the generation prompt."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for kind, n in (("code", num_code), ("prose", num_prose)):
        for row in [r for r in rows if r["kind"] == kind][:n]:
            ids = tokenizer.encode_chat(row["messages"], add_generation_prompt=True)
            out.append(Prompt(row["id"], kind, tuple(ids)))
    return out


class TimedDrafter:
    """Wraps a drafter and adds up the wall time of its `propose` and `commit` calls (seconds), and,
    for the draft-model drafter, the columns its model ran (`num_columns_run`, read as lanes end)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.is_row_budgeted = inner.is_row_budgeted
        self.needs_hidden_states = inner.needs_hidden_states
        self.tap_layers = inner.tap_layers
        self.seconds = 0.0
        self.columns = 0

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        self.inner.start_lane(lane_id, prompt_token_ids)

    def end_lane(self, lane_id: int) -> None:
        count = getattr(self.inner, "num_columns_run", None)
        if count is not None:
            self.columns += int(count(lane_id))
        self.inner.end_lane(lane_id)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        t0 = time.perf_counter()
        try:
            return self.inner.propose(requests)
        finally:
            self.seconds += time.perf_counter() - t0

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.commit(spans)
        finally:
            self.seconds += time.perf_counter() - t0


@dataclass
class RunRecord:
    """One engine run: a drafter, a mode and a group of prompts (lanes).

    Attributes:
        drafter: "off", "draft-model" or "ngram".
        mode: "greedy" or "sampled".
        group: the prompt kind of the lanes ("code", "prose") or a prompt id (`--batch single`).
        draft_tokens: k (0 for off).
        prompt_ids: the lanes' prompt ids, in order.
        outputs: the lanes' output token ids.
        rounds: verify rounds per lane.
        wall_s: the run's wall time; first_step_s: its first step (prefill + round 1).
        cpu_s, first_step_cpu_s: the same in CPU time of this process (all threads; a shared
            machine's waiting is not in it, so it compares runs made under different loads).
        first_step_tokens: tokens emitted by the first step.
        draft_s: time inside the drafter.
        draft_columns: columns the draft model ran after the prompts (each lane's prompt, fed by its
            first proposal, is left out; 0 for other drafters).
        loadavg: the machine's 1-minute load average when the run ended (2 cores: above 2 means waiting).
        position_drafted / position_accepted: the engine's per-position counters.
    """

    drafter: str
    mode: str
    group: str
    draft_tokens: int
    prompt_ids: list[str]
    outputs: list[list[int]]
    rounds: list[int]
    wall_s: float
    first_step_s: float
    cpu_s: float
    first_step_cpu_s: float
    first_step_tokens: int
    draft_s: float
    draft_columns: int = 0
    position_drafted: dict[int, int] = field(default_factory=dict)
    position_accepted: dict[int, int] = field(default_factory=dict)
    loadavg: float = 0.0


def run_group(
    target: Any,
    make_drafter: Callable[[], Any] | None,
    prompts: Sequence[Prompt],
    params: Sequence[SamplingParams],
    *,
    drafter_name: str,
    mode: str,
    group: str,
    draft_tokens: int,
    eos_token_ids: Sequence[int],
) -> RunRecord:
    """Run `prompts` as lanes of one engine to completion, timing every step."""
    drafter = TimedDrafter(make_drafter()) if make_drafter is not None else None
    engine = SpeculativeEngine(
        target,
        drafter,  # type: ignore[arg-type]
        draft_tokens=draft_tokens if drafter is not None else None,
        eos_token_ids=eos_token_ids,
    )
    ids = [engine.add_lane(p.token_ids, sp) for p, sp in zip(prompts, params, strict=True)]
    t_start, c_start = time.perf_counter(), time.process_time()
    first_step_s, first_cpu_s, first_tokens = 0.0, 0.0, 0
    steps = 0
    while engine.has_unfinished:
        t0, c0 = time.perf_counter(), time.process_time()
        updates = engine.step()
        steps += 1
        if steps == 1:
            first_step_s, first_cpu_s = time.perf_counter() - t0, time.process_time() - c0
            first_tokens = sum(len(u.new_token_ids) for u in updates)
    wall, cpu = time.perf_counter() - t_start, time.process_time() - c_start
    results: list[LaneResult] = [engine.pop_result(i) for i in ids]
    m = engine.metrics
    return RunRecord(
        drafter=drafter_name,
        mode=mode,
        group=group,
        draft_tokens=draft_tokens if drafter is not None else 0,
        prompt_ids=[p.id for p in prompts],
        outputs=[list(r.output_token_ids) for r in results],
        rounds=[r.num_rounds for r in results],
        wall_s=wall,
        first_step_s=first_step_s,
        cpu_s=cpu,
        first_step_cpu_s=first_cpu_s,
        first_step_tokens=first_tokens,
        draft_s=drafter.seconds if drafter is not None else 0.0,
        draft_columns=(
            drafter.columns - sum(len(p.token_ids) for p in prompts) if drafter and drafter.columns else 0
        ),
        position_drafted=dict(m.position_drafted_total),
        position_accepted=dict(m.position_accepted_total),
        loadavg=os.getloadavg()[0],
    )


@dataclass
class LoadedPair:
    """The target and draft model as one run of the benchmark uses them.

    Attributes:
        source: "artifacts" or "gguf".
        target: the target's executor.
        target_config: its family config.
        target_tokenizer: its `TokenizerSpec`.
        draft: the draft model's executor (shared by every draft-model run; each run makes its own
            `DraftModelDrafter`, so lanes never mix).
        linear_routes: for artifacts with compiled modules, the target's `LinearBackend.counts`
            (calls per route), else None.
        info: what was loaded (paths, dtypes, modules), for the JSON.
    """

    source: str
    target: Any
    target_config: Any
    target_tokenizer: Any
    draft: Any
    linear_routes: dict[str, int] | None
    info: dict[str, Any]
    owners: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Unmap the artifacts (no-op for GGUF loads)."""
        for o in self.owners:
            o.close()


def load_from_artifacts(
    target_dir: Path, draft_dir: Path, *, compiled: bool = True, verify: str = "fast"
) -> LoadedPair:
    """Load both models as `ignis-run --artifact TARGET --spec-backend draft-model --spec-draft-model
    DRAFT` does on the CPU (`ignis.runtime.server.artifact_source`): float32 executors, the target's
    linears through the artifact's compiled modules (`compiled`; else torch), the draft through
    `build_draft_model_drafter(artifact=...)` (tokenizer check against the target's, torch linears).

    Raises:
        the artifact loader's errors (a missing or corrupt artifact); TokenizerMismatchError.
    """
    from ignis.runtime.artifact import load_artifact
    from ignis.runtime.drafters.draft_model import build_draft_model_drafter

    art = load_artifact(target_dir, verify=verify)  # type: ignore[arg-type]
    try:
        spec = art.tokenizer_spec()
        if spec is None:
            raise click.ClickException(f"{target_dir}: the artifact stores no tokenizer")
        linear = art.linear_backend() if compiled and art.manifest.modules else None
        target = art.make_executor(device="cpu", dtype=torch.float32, linear=linear)
        dm = build_draft_model_drafter(
            target_tokenizer=spec,
            artifact=draft_dir,
            target_config=art.config,
            device="cpu",
            dtype=torch.float32,
            verify=verify,
        )
    except BaseException:
        art.close()
        raise
    info = {
        "target_artifact": str(target_dir),
        "draft_artifact": str(draft_dir),
        "target_linear_dtype": art.manifest.linear_dtype,
        "draft_linear_dtype": dm.owner.manifest.linear_dtype,
        "target_widths": list(art.manifest.widths),
        "target_linears": "compiled modules" if linear is not None else "torch",
        "draft_linears": "torch",
        "draft_keeps_drafts": dm.keeps_drafts,
    }
    return LoadedPair(
        "artifacts",
        target,
        art.config,
        spec,
        dm.executor,
        linear.counts if linear is not None else None,  # type: ignore[union-attr]
        info,
        [art, dm],
    )


def load_from_gguf(cache_dir: Path | None, dtype: torch.dtype, echo: Callable[[str], None]) -> LoadedPair:
    """Both GGUFs through the importer (`ignis.tools.bench.real_pair.load_pair`), torch linears."""
    from ignis.tools.bench.real_pair import load_pair

    target, draft = load_pair(cache_dir, dtype=dtype, echo=echo)
    info = {"dtype": str(dtype).removeprefix("torch."), "target_linears": "torch", "draft_linears": "torch"}
    return LoadedPair("gguf", target.executor, target.config, target.tokenizer, draft.executor, None, info)


def top2_margin(target: Any, token_ids: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit after `token_ids` (one forward on a fresh lane)."""
    lane = target.new_lane()
    out = target.forward(
        [lane], [torch.tensor(list(token_ids), dtype=torch.int64)], logits="last", record=False
    )
    target.commit([lane], [0])
    top2 = torch.topk(out.logits[0][-1].double(), 2).values
    return float(top2[0] - top2[1])


def compare_greedy(
    target: Any, prompt: Prompt, got: Sequence[int], ref: Sequence[int], near_tie: float
) -> dict[str, Any]:
    """Exactness of one greedy output against speculation off (module docstring)."""
    if list(got) == list(ref):
        return {"prompt": prompt.id, "status": "equal"}
    i = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    if i >= min(len(got), len(ref)):
        return {"prompt": prompt.id, "status": "mismatch", "index": i, "reason": "lengths differ"}
    margin = top2_margin(target, [*prompt.token_ids, *ref[:i]])
    return {
        "prompt": prompt.id,
        "status": "near-tie" if margin < near_tie else "mismatch",
        "index": i,
        "margin": margin,
        "spec_off_token": int(ref[i]),
        "spec_on_token": int(got[i]),
    }


def forward_costs(
    executor: Any, context: Sequence[int], widths: Sequence[int], *, repeats: int = 3
) -> dict[int, float]:
    """Median seconds of one verify-shaped forward (`logits="all"`, `record=True`, then `commit(0)`)
    of `n` columns after `context` (committed once), for each n in `widths`: what a round costs."""
    lane = executor.new_lane()
    executor.forward([lane], [torch.tensor(list(context), dtype=torch.int64)], logits="last", record=False)
    executor.commit([lane], [len(context)])
    out: dict[int, float] = {}
    for n in widths:
        cols = torch.tensor(list(context[:n]), dtype=torch.int64)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            executor.forward([lane], [cols], logits="all", record=True)
            executor.commit([lane], [0])
            times.append(time.perf_counter() - t0)
        out[n] = sorted(times)[len(times) // 2]
    return out


def summarize(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Pooled figures of several runs of one (drafter, mode[, kind])."""
    tokens = sum(len(o) for r in records for o in r.outputs)
    rounds = sum(sum(r.rounds) for r in records)
    decode_tokens = sum(len(o) for r in records for o in r.outputs) - sum(
        r.first_step_tokens for r in records
    )
    decode_s = sum(r.wall_s - r.first_step_s for r in records)
    decode_cpu_s = sum(r.cpu_s - r.first_step_cpu_s for r in records)
    drafted: dict[int, int] = {}
    accepted: dict[int, int] = {}
    for r in records:
        for p, n in r.position_drafted.items():
            drafted[p] = drafted.get(p, 0) + n
        for p, n in r.position_accepted.items():
            accepted[p] = accepted.get(p, 0) + n
    num_lanes = sum(len(r.outputs) for r in records)
    return {
        "lanes": num_lanes,
        "tokens": tokens,
        "rounds": rounds,
        "tokens_per_round": (tokens - num_lanes) / rounds if rounds else 0.0,
        "position_acceptance": [accepted.get(p, 0) / drafted[p] for p in sorted(drafted)],
        "ms_per_token": 1000 * decode_s / decode_tokens if decode_tokens else 0.0,
        "cpu_ms_per_token": 1000 * decode_cpu_s / decode_tokens if decode_tokens else 0.0,
        "wall_s": sum(r.wall_s for r in records),
        "draft_share": sum(r.draft_s for r in records) / max(sum(r.wall_s for r in records), 1e-9),
        "draft_columns_per_round": sum(r.draft_columns for r in records) / rounds if rounds else 0.0,
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--prompts",
    "prompts_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=DEFAULT_PROMPTS,
    show_default=True,
)
@click.option("--num-code", type=click.IntRange(0, 64), default=4, show_default=True)
@click.option("--num-prose", type=click.IntRange(0, 64), default=4, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option(
    "--dm-draft-tokens",
    type=click.IntRange(1, 7),
    default=3,
    show_default=True,
    help="k for the draft-model drafter.",
)
@click.option(
    "--ngram-draft-tokens",
    type=click.IntRange(1, 7),
    default=5,
    show_default=True,
    help="k for the ngram drafter.",
)
@click.option(
    "--ngram-min", type=click.IntRange(1, 64), default=2, show_default=True, help="prompt_lookup_min"
)
@click.option(
    "--ngram-max", type=click.IntRange(1, 64), default=4, show_default=True, help="prompt_lookup_max"
)
@click.option(
    "--batch",
    type=click.Choice(["kind", "single"]),
    default="kind",
    show_default=True,
    help="kind: the prompts of one kind run together as lanes; single: one prompt at a time.",
)
@click.option("--modes", default="greedy,sampled", show_default=True)
@click.option(
    "--drafters",
    default="off,draft-model,ngram",
    show_default=True,
    help="Any of off, draft-model, draft-model-rerun (the re-run schedule, for comparison), ngram.",
)
@click.option(
    "--source",
    type=click.Choice(["artifacts", "gguf"]),
    default="artifacts",
    show_default=True,
    help="artifacts: the built .ninfer artifacts, loaded as ignis-run loads them (float32, compiled "
    "modules for the target); gguf: both GGUFs through the importer (--dtype).",
)
@click.option(
    "--target-artifact",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Default: the real pair's cache (python -m ignis.tools.bench.real_pair build).",
)
@click.option("--draft-artifact", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option(
    "--target-linears",
    type=click.Choice(["compiled", "torch"]),
    default="compiled",
    show_default=True,
    help="artifacts: the target's linears through its compiled modules (as served) or torch.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampled lanes use seed + prompt index.")
@click.option("--near-tie", type=float, default=NEAR_TIE, show_default=True, help="Logit margin (units).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="torch CPU threads.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option(
    "--costs-only",
    is_flag=True,
    help="Only time one forward of 1..8 columns of each model (after the first prompt) and exit.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    prompts_path: Path,
    num_code: int,
    num_prose: int,
    max_new_tokens: int,
    dtype: str,
    dm_draft_tokens: int,
    ngram_draft_tokens: int,
    ngram_min: int,
    ngram_max: int,
    batch: str,
    modes: str,
    drafters: str,
    source: str,
    target_artifact: Path | None,
    draft_artifact: Path | None,
    target_linears: str,
    seed: int,
    near_tie: float,
    threads: int | None,
    cache_dir: Path | None,
    costs_only: bool,
    json_path: Path | None,
) -> None:
    """Acceptance of draft-model and ngram speculation on Qwen2.5-Coder 1.5B (0.5B drafting)."""
    from ignis.runtime.tokenizer import Tokenizer
    from ignis.tools.bench.real_pair import DRAFT, TARGET, artifact_dir

    if threads:
        torch.set_num_threads(threads)
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    drafter_list = [d.strip() for d in drafters.split(",") if d.strip()]
    if "off" not in drafter_list:
        drafter_list.insert(0, "off")  # the reference every other run is compared with
    for m in mode_list:
        if m not in ("greedy", "sampled"):
            raise click.BadParameter(f"unknown mode {m!r}", param_hint="--modes")
    for d in drafter_list:
        if d not in ("off", "draft-model", "draft-model-rerun", "ngram"):
            raise click.BadParameter(f"unknown drafter {d!r}", param_hint="--drafters")

    def echo(s: str) -> None:
        click.echo(s, err=True)

    t0 = time.perf_counter()
    if source == "artifacts":
        tdir = target_artifact or artifact_dir(TARGET, cache_dir)
        ddir = draft_artifact or artifact_dir(DRAFT, cache_dir)
        for d in (tdir, ddir):
            if not (d / "manifest.json").is_file():
                raise click.ClickException(
                    f"{d}: no artifact; build both with `python -m ignis.tools.bench.real_pair build`"
                )
        pair = load_from_artifacts(tdir, ddir, compiled=target_linears == "compiled")
    else:
        pair = load_from_gguf(cache_dir, getattr(torch, dtype), echo)
    load_s = time.perf_counter() - t0
    echo(f"loaded from {pair.source} in {load_s:.0f} s: {pair.info}")
    target_ex, draft_ex, vocab = pair.target, pair.draft, pair.target_config.vocab_size
    tokenizer = Tokenizer(pair.target_tokenizer)
    prompts = load_prompts(prompts_path, tokenizer, num_code=num_code, num_prose=num_prose)
    eos = tokenizer.eos_token_ids
    echo(f"{len(prompts)} prompts ({[p.id for p in prompts]}), eos {eos}, load {load_s:.0f} s")

    makers: dict[str, tuple[Callable[[], Any] | None, int]] = {
        "off": (None, 0),
        "draft-model": (lambda: DraftModelDrafter(draft_ex, vocab_size=vocab), dm_draft_tokens),
        "draft-model-rerun": (
            lambda: DraftModelDrafter(draft_ex, vocab_size=vocab, keep_drafts=False),
            dm_draft_tokens,
        ),
        "ngram": (
            lambda: NgramDrafter(prompt_lookup_min=ngram_min, prompt_lookup_max=ngram_max),
            ngram_draft_tokens,
        ),
    }
    if batch == "kind":
        groups = [(kind, [p for p in prompts if p.kind == kind]) for kind in ("code", "prose")]
        groups = [(g, ps) for g, ps in groups if ps]
    else:
        groups = [(p.id, [p]) for p in prompts]
    index = {p.id: i for i, p in enumerate(prompts)}

    # warm-up (untimed): one forward of each model, so first-touch costs land nowhere
    for ex in (target_ex, draft_ex):
        lane = ex.new_lane()
        ex.forward([lane], [torch.tensor(prompts[0].token_ids)], logits="last", record=False)
        ex.commit([lane], [0])

    if costs_only:
        widths = (1, 2, 3, 4, 6, 8)
        costs = {
            "target": forward_costs(target_ex, prompts[0].token_ids, widths),
            "draft": forward_costs(draft_ex, prompts[0].token_ids, widths),
        }
        click.echo("| model | " + " | ".join(f"{n} col" for n in widths) + " |")
        click.echo("|---|" + "---|" * len(widths))
        for name, c in costs.items():
            click.echo(f"| {name} | " + " | ".join(f"{1000 * c[n]:.0f} ms" for n in widths) + " |")
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(
                json.dumps(
                    {
                        "date": datetime.now(UTC).isoformat(timespec="seconds"),
                        "threads": torch.get_num_threads(),
                        "dtype": dtype,
                        "context_tokens": len(prompts[0].token_ids),
                        "loadavg": os.getloadavg(),
                        "seconds": costs,
                    },
                    indent=1,
                ),
                encoding="utf-8",
            )
        return

    # drafters interleaved inside each (mode, group), so the load of a shared machine spreads over all
    records: list[RunRecord] = []
    for mode in mode_list:
        for group, ps in groups:
            params = [
                SamplingParams(temperature=0, max_tokens=max_new_tokens)
                if mode == "greedy"
                else dataclasses.replace(SAMPLED, max_tokens=max_new_tokens, seed=seed + index[p.id])
                for p in ps
            ]
            for name in drafter_list:
                make, k = makers[name]
                rec = run_group(
                    target_ex,
                    make,
                    ps,
                    params,
                    drafter_name=name,
                    mode=mode,
                    group=group,
                    draft_tokens=k,
                    eos_token_ids=eos,
                )
                records.append(rec)
                s = summarize([rec])
                echo(
                    f"{mode:7s} {group:8s} {name:17s} k={k} tokens/round {s['tokens_per_round']:.2f} "
                    f"{s['ms_per_token']:.0f} ms/token ({s['cpu_ms_per_token']:.0f} CPU) "
                    f"draft cols/round {s['draft_columns_per_round']:.2f} "
                    f"wall {rec.wall_s:.0f} s load {rec.loadavg:.1f}"
                )

    # exactness: greedy outputs of each drafter against off, prompt by prompt
    exactness: dict[str, list[dict[str, Any]]] = {}
    if "greedy" in mode_list:
        ref = {
            pid: out
            for r in records
            if r.mode == "greedy" and r.drafter == "off"
            for pid, out in zip(r.prompt_ids, r.outputs, strict=True)
        }
        for name in drafter_list:
            if name == "off":
                continue
            got = {
                pid: out
                for r in records
                if r.mode == "greedy" and r.drafter == name
                for pid, out in zip(r.prompt_ids, r.outputs, strict=True)
            }
            exactness[name] = [compare_greedy(target_ex, p, got[p.id], ref[p.id], near_tie) for p in prompts]

    def kind_of(rec: RunRecord) -> str:  # every group holds prompts of one kind
        return prompts[index[rec.prompt_ids[0]]].kind

    summary: dict[str, Any] = {}
    for mode in mode_list:
        for name in drafter_list:
            sel = [r for r in records if r.mode == mode and r.drafter == name]
            summary[f"{mode}/{name}"] = {
                "all": summarize(sel),
                **{kind: summarize([r for r in sel if kind_of(r) == kind]) for kind in ("code", "prose")},
            }

    # the table
    lines = [
        "| mode | drafter | k | kind | tokens/round | per-position acceptance | wall ms/token | vs off "
        "| CPU ms/token | vs off | drafter share | draft columns/round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in mode_list:
        for name in drafter_list:
            k = makers[name][1]
            for kind in ("code", "prose", "all"):
                s = summary[f"{mode}/{name}"][kind]
                off = summary[f"{mode}/off"][kind]
                if not s["lanes"]:
                    continue
                speed = off["ms_per_token"] / s["ms_per_token"] if s["ms_per_token"] else 0.0
                cpu_speed = off["cpu_ms_per_token"] / s["cpu_ms_per_token"] if s["cpu_ms_per_token"] else 0.0
                acc = " ".join(f"{a:.2f}" for a in s["position_acceptance"]) or "-"
                lines.append(
                    f"| {mode} | {name} | {k} | {kind} | {s['tokens_per_round']:.2f} | {acc} | "
                    f"{s['ms_per_token']:.0f} | {speed:.2f}x | {s['cpu_ms_per_token']:.0f} | "
                    f"{cpu_speed:.2f}x | {100 * s['draft_share']:.0f}% | "
                    f"{s['draft_columns_per_round']:.2f} |"
                )
    click.echo("\n".join(lines))
    for name, rows in exactness.items():
        counts = {st: sum(r["status"] == st for r in rows) for st in ("equal", "near-tie", "mismatch")}
        click.echo(f"greedy {name} vs off: {counts}")
        for r in rows:
            if r["status"] != "equal":
                click.echo(f"  {r}")

    if json_path is not None:
        out = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor(),
                "cpu_count": os.cpu_count(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "loadavg": os.getloadavg(),
            },
            "source": pair.source,
            "loaded": pair.info,
            "target_linear_routes": dict(pair.linear_routes) if pair.linear_routes is not None else None,
            "settings": {
                "prompts": str(prompts_path),
                "num_code": num_code,
                "num_prose": num_prose,
                "max_new_tokens": max_new_tokens,
                "dtype": dtype,
                "batch": batch,
                "dm_draft_tokens": dm_draft_tokens,
                "ngram_draft_tokens": ngram_draft_tokens,
                "ngram_min": ngram_min,
                "ngram_max": ngram_max,
                "sampled": dataclasses.asdict(SAMPLED),
                "seed": seed,
                "near_tie": near_tie,
            },
            "load_s": load_s,
            "summary": summary,
            "exactness": exactness,
            "runs": [dataclasses.asdict(r) for r in records],
            "prompts": [{"id": p.id, "kind": p.kind, "num_tokens": len(p.token_ids)} for p in prompts],
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=1), encoding="utf-8")
        echo(f"wrote {json_path}")
    pair.close()


if __name__ == "__main__":
    main()
