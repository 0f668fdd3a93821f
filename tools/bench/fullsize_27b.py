"""Issue 25 item 4: the 27B-shaped qwen3_5 built and served at full size, measured at the socket.

    python -m ignis.tools.bench.fullsize_27b [options] PHASE [PHASE ...]
    bash tools/bench/fullsize_27b.sh PHASE ...        # on the GPU host: sets up the lean environment

Phases, in order (each can be its own command; state lives under --ckpt-root / --art-root, chosen
by `place` on the first command and kept in --state for the next ones):

- `write`: a random checkpoint of the public Qwen3.5-27B text config and a DFlash2 drafter of the
  public 27B drafter's shape (`ignis.tools.random_checkpoint`; ~54 + ~3.5 GB in bf16), by default
  with `--weights confident` (`random_checkpoint.Confident`: the same shapes and compute, so the
  same throughput, but greedy choices with margins of ~65 nats instead of near-flat logits: greedy
  outputs do not depend on the verify round's row count, so the replay drafter keeps its recording at
  8 clients and every backend's outputs can be compared with speculation off's; `--weights random`
  (or IGNIS_FULLSIZE_WEIGHTS=random) writes the plain init) into
  --ckpt-root: /dev/shm (RAM) when it has room, else /tmp with the artifact in /dev/shm (the GPU
  host's 64 GB disk cannot hold the checkpoint and the ~19 GB artifact together).
- `rate` (optional, after `write`, before `build` deletes the checkpoint): the weight step's
  conversion rate on the first --rate-params parameters at 1 thread and at every core
  (`ignis.tools.bench.convert_rate`), written to `rate.json`.
- `build`: `ignis-build --card CARD --drafter ...` into --art-root (disk), the whole vocabulary as
  the shortlist (random weights have no token frequencies); the checkpoint in /dev/shm is then
  deleted (RAM for serving) unless --keep-checkpoint. The artifact root records which weights it was
  built from (`weights`); the serving phases refuse an artifact of the other kind.
- `off`, `dflash2`, `replay`: one `ignis-run` each (--lanes, the backend; dflash2 and replay at
  --draft-tokens 7; replay at --accept 0.885 over the outputs `off` recorded) driven by `ignis-bench`
  at --concurrency 1,8 over its Unix socket: --num-requests token-id prompts of --input-len tokens,
  --max-tokens each, greedy, EOS ignored. Each writes `<backend>.json` (the bench report),
  `<backend>.outputs.jsonl` (prompt ids -> generated ids) and `server-<backend>.log` under --out.
  `off` must run before `replay` (its outputs are the replay file, kept in --art-root). Then, on the
  same server, `socket_equality.collect`: --equality-prompts token-id prompts (0: skipped) of
  --input-len ids, --equality-tokens each, at the same client counts, with top logprobs, into
  `socket_equality.jsonl` under --out (a backend's earlier records there are replaced); off's
  outputs of its first (cold) pass are added to the replay file.
- `table`: prints the comparison of every backend measured so far and writes `fullsize_27b.json`:
  per backend and concurrency the output tok/s (all lanes), the median per-request decode tok/s,
  TTFT p50, time per output token, tokens per round and the first draft position's acceptance, the
  round time (time per output token x tokens per round), the issue's target, and how many outputs
  equal speculation off's. The DFlash2 drafter's cost per round is estimated as its round time minus
  the replay drafter's (both verify 1 + 7 columns; replay drafts cost nothing). Then the
  `socket_equality` report of what was collected (off's repeated prompts against its cold ones, off
  at 8 vs 1 clients, each backend against off: equal, or equal up to near-ties with off's top-2
  logprob gap at each divergence), written to `socket_equality.json`.
- `all`: every phase in order (hosts without a per-command time limit).

`--model tiny --card cpu` runs the same phases on the toy model (the CPU dry run, tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "summarize_runs"]

PHASES = ("write", "build", "off", "dflash2", "replay", "table")
EXTRA_PHASES = ("rate",)
BACKENDS = ("off", "dflash2", "replay")

#: Issue 25's targets at the socket on the H200 (27B shape), output tok/s: (backend, concurrency) -> value.
TARGETS = {("off", 1): 135, ("off", 8): 830, ("replay", 1): 520, ("replay", 8): 1550}


def _say(line: str) -> None:
    print(f"[fullsize {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _free(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _tables(model: str) -> tuple[Any, dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(the target config, its tensor table, the drafter's tensor table) of a preset."""
    from ignis.runtime.drafters.dflash2 import DFlash2Config, dflash2_tensor_shapes
    from ignis.runtime.families.base import config_from_hf
    from ignis.runtime.families.qwen3_5 import HybridConfig, tensor_shapes
    from ignis.tools.make_test_drafter import small_dflash2_config
    from ignis.tools.random_checkpoint import MODELS, PUBLIC_27B_DFLASH2

    cfg = config_from_hf(MODELS[model])
    assert isinstance(cfg, HybridConfig)
    if model == "qwen3_5-27b":
        d = DFlash2Config.from_hf(PUBLIC_27B_DFLASH2)
    else:
        d = small_dflash2_config(cfg, num_layers=2, intermediate_size=2 * cfg.hidden_size)
    return cfg, dict(tensor_shapes(cfg)), dict(dflash2_tensor_shapes(d))


def _checkpoint_bytes(model: str) -> int:
    """Bytes of the checkpoint and its drafter in bf16 (from the tables, nothing written)."""
    _, target, drafter = _tables(model)
    return 2 * sum(math.prod(s) for s in (*target.values(), *drafter.values()))


def _artifact_bytes(model: str, card: str) -> int:
    """Bytes of the artifact's weights: the card's storage dtypes (`convert.storage_dtype`) of the
    target and the drafter, plus the whole-vocabulary shortlist head (q4_g32)."""
    from ignis.compiler.build.convert import storage_dtype
    from ignis.formats.constants import stored_length
    from ignis.runtime.profiles import get_profile

    cfg, target, drafter = _tables(model)
    prof = get_profile(card)
    total = stored_length("q4_g32", (int(cfg.vocab_size), int(cfg.hidden_size)))
    for name, shape in (*target.items(), *drafter.items()):
        dt = storage_dtype(name, shape, linear_dtype=prof.linear_dtype, other_dtype=prof.other_dtype)
        total += stored_length(dt, shape)
    return int(total)


def place(model: str, card: str) -> tuple[Path, Path]:
    """(checkpoint root, artifact root) for a host: the checkpoint in /dev/shm (RAM) when it fits
    there, else on /tmp's disk with the artifact beside it when both fit, else the artifact in
    /dev/shm. The GPU host (64 GB disk, 128 GB RAM) takes the first.

    Raises:
        SystemExit: no placement fits (the sizes are named).
    """
    need_ck, need_art = int(_checkpoint_bytes(model) * 1.05), int(_artifact_bytes(model, card) * 1.1)
    shm, disk = Path("/dev/shm"), Path("/tmp")
    shm_free = _free(shm) if shm.is_dir() else 0
    disk_free = _free(disk)
    if shm_free >= need_ck and disk_free >= need_art:
        return shm / "ignis-fullsize", disk / "ignis-fullsize-art"
    if disk_free >= need_ck + need_art:
        return disk / "ignis-fullsize-ckpt", disk / "ignis-fullsize-art"
    if disk_free >= need_ck and shm_free >= need_art:
        return disk / "ignis-fullsize-ckpt", shm / "ignis-fullsize-art"
    raise SystemExit(
        f"no room: the checkpoint needs {need_ck / 2**30:.1f} GiB and the artifact "
        f"{need_art / 2**30:.1f} GiB; /dev/shm has {shm_free / 2**30:.1f} GiB free, /tmp "
        f"{disk_free / 2**30:.1f} GiB: pass --ckpt-root and --art-root"
    )


class _Ctx:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        ckpt_root, art_root = a.ckpt_root, a.art_root
        if ckpt_root is None or art_root is None:  # where an earlier command put them, else `place`
            state = Path(a.state)
            saved = json.loads(state.read_text()) if state.exists() else {}
            if saved.get("model") != a.model:
                ck, ar = place(a.model, a.card)
                saved = {"model": a.model, "ckpt_root": str(ck), "art_root": str(ar)}
                state.write_text(json.dumps(saved) + "\n")
            ckpt_root = ckpt_root or saved["ckpt_root"]
            art_root = art_root or saved["art_root"]
        self.ckpt_root = Path(ckpt_root)
        self.ckpt = self.ckpt_root / "ckpt"
        self.drafter = self.ckpt_root / "dflash2"
        self.art_root = Path(art_root)
        self.art = self.art_root / "art"
        self.ref = self.art_root / "replay.jsonl"
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def record(self, name: str, data: dict[str, Any]) -> None:
        (self.out / name).write_text(json.dumps(data, indent=1) + "\n")


def phase_write(c: _Ctx) -> None:
    from ignis.tools.random_checkpoint import write_random_checkpoint, write_random_dflash2

    done, kind = c.ckpt_root / ".complete", f"{c.a.model} {c.a.weights}"
    if done.exists() and done.read_text().strip() == kind:
        _say(f"write: {c.ckpt_root} already holds the {kind} checkpoint and drafter")
        return
    need, free = _checkpoint_bytes(c.a.model), _free(c.ckpt_root)
    _say(f"write: {need / 2**30:.1f} GiB into {c.ckpt_root} ({free / 2**30:.1f} GiB free)")
    if free < need:
        raise SystemExit(
            f"write: {c.ckpt_root} has {free / 2**30:.1f} GiB free, the checkpoint needs "
            f"{need / 2**30:.1f} GiB: pass --ckpt-root"
        )
    t0 = time.perf_counter()
    write_random_checkpoint(
        c.ckpt, model=c.a.model, seed=0, force=True, echo=_say, confident=c.a.weights == "confident"
    )
    t1 = time.perf_counter()
    write_random_dflash2(c.ckpt, c.drafter, model=c.a.model, seed=0, force=True, echo=_say)
    t2 = time.perf_counter()
    done.write_text(kind)
    c.record(
        "write.json",
        {
            "model": c.a.model,
            "weights": c.a.weights,
            "root": str(c.ckpt_root),
            "bytes": need,
            "checkpoint_s": t1 - t0,
            "drafter_s": t2 - t1,
        },
    )
    _say(f"write: checkpoint {t1 - t0:.0f} s, drafter {t2 - t1:.0f} s ({need / (t2 - t0) / 2**30:.2f} GiB/s)")


def phase_rate(c: _Ctx) -> None:
    from ignis.tools.bench.convert_rate import measure

    if not (c.ckpt_root / ".complete").exists():
        raise SystemExit(f"rate: no checkpoint in {c.ckpt_root}: run the write phase first")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = sorted({1, cores})
    _say(f"rate: converting {c.a.rate_params:.2g} parameters at {threads} thread(s)")
    res = measure(
        c.ckpt,
        drafter=c.drafter,
        card=c.a.card,
        threads=threads,
        max_params=c.a.rate_params,
        out_dir=c.art_root,
    )
    c.record("rate.json", res)


def phase_build(c: _Ctx) -> None:
    from ignis.runtime.families.base import config_from_hf
    from ignis.tools.random_checkpoint import MODELS

    done, kind = c.ckpt_root / ".complete", f"{c.a.model} {c.a.weights}"
    if not done.exists():
        raise SystemExit(
            f"build: no checkpoint in {c.ckpt_root}: run the write phase first (same --ckpt-root)"
        )
    if done.read_text().strip() != kind:
        raise SystemExit(
            f"build: {c.ckpt_root} holds a {done.read_text().strip()!r} checkpoint, not {kind!r}: "
            "run the write phase with the same --weights"
        )
    vocab = int(config_from_hf(MODELS[c.a.model]).vocab_size)
    c.art_root.mkdir(parents=True, exist_ok=True)
    recipe = c.art_root / "recipe.toml"
    lines = ['name = "fullsize"', "[shortlist]", f"size = {vocab}"]
    if c.a.widths is not None:
        widths = [int(w) for w in c.a.widths.split(",") if w.strip()]
        lines += ["[modules]", f"widths = {widths}"]
    recipe.write_text("\n".join(lines) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "ignis.compiler.cli",
        "--card",
        c.a.card,
        "--model",
        str(c.ckpt),
        "--drafter",
        str(c.drafter),
        "--recipe",
        str(recipe),
        "--out",
        str(c.art),
        "--force",
        "--no-progress",
    ]
    _say("build: " + " ".join(cmd[2:]))
    t0 = time.perf_counter()
    with (c.out / "build.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    tail = (c.out / "build.log").read_text().splitlines()[-8:]
    for line in tail:
        _say("build| " + line)
    c.record(
        "build.json",
        {"rc": rc, "seconds": seconds, "card": c.a.card, "weights": c.a.weights, "log_tail": tail},
    )
    if rc != 0:
        raise SystemExit(f"build: ignis-build failed (rc {rc}); see {c.out / 'build.log'}")
    (c.art_root / "weights").write_text(c.a.weights + "\n")
    c.ref.unlink(missing_ok=True)  # outputs recorded from another artifact are no reference
    _say(f"build: {seconds:.0f} s; artifact {c.art}")
    if str(c.ckpt_root).startswith("/dev/shm") and not c.a.keep_checkpoint:
        shutil.rmtree(c.ckpt_root, ignore_errors=True)  # RAM back for serving
        _say(f"build: removed {c.ckpt_root} (RAM); --keep-checkpoint keeps it")


def phase_serve(c: _Ctx, backend: str) -> None:
    if not (c.art / "manifest.json").exists():
        raise SystemExit(f"{backend}: no artifact at {c.art}: run the build phase first (same --art-root)")
    marker = c.art_root / "weights"
    built = marker.read_text().strip() if marker.exists() else "random"  # built before the marker existed
    if built != c.a.weights:
        raise SystemExit(
            f"{backend}: the artifact at {c.art} was built from {built} weights, not {c.a.weights}: "
            f"pass --weights {built} or run write and build again"
        )
    spec = ["--spec-backend", backend]
    if backend in ("dflash2", "replay"):
        spec += ["--spec-draft-tokens", str(c.a.draft_tokens)]
    if backend == "replay":
        if not c.ref.exists():
            raise SystemExit(f"replay: no recorded outputs at {c.ref}: run the off phase first")
        spec += ["--spec-replay", str(c.ref), "--spec-replay-accept", str(c.a.accept)]
    log = c.out / f"server-{backend}.log"
    args = ["--artifact", str(c.art), "--lanes", str(c.a.lanes), *spec, *c.a.server_arg]
    _say(f"{backend}: ignis-run " + " ".join(args))
    from ignis.tools.bench.serve_overhead import BenchError, ServerProcess

    try:
        server = ServerProcess(args, dict(os.environ), c.a.ready_timeout, log=log)
    except BenchError as exc:
        raise SystemExit(f"{backend}: {exc} (log: {log})") from None
    sock = server.socket
    with server:
        ready = server.ready_s
        _say(f"{backend}: serving after {ready:.0f} s")
        report, outputs = c.out / f"{backend}.json", c.out / f"{backend}.outputs.jsonl"
        bench = [
            sys.executable,
            "-m",
            "ignis.tools.bench.serve.cli",
            "--socket",
            str(sock),
            "--endpoint",
            "completions",
            "--input-len",
            str(c.a.input_len),
            "--max-tokens",
            str(c.a.max_tokens),
            "--num-requests",
            str(c.a.num_requests),
            "--concurrency",
            c.a.concurrency,
            "--warmup",
            "1",
            "--no-progress",
            "--label",
            f"{backend} ({c.a.model}, {c.a.card})",
            "--json-out",
            str(report),
            "--save-outputs",
            str(outputs),
        ]
        t0 = time.perf_counter()
        run = subprocess.run(bench, capture_output=True, text=True)
        (c.out / f"bench-{backend}.log").write_text(run.stdout + run.stderr)
        _say(f"{backend}: ignis-bench rc {run.returncode} in {time.perf_counter() - t0:.0f} s")
        if run.returncode != 0:
            raise SystemExit(f"{backend}: ignis-bench failed; see {c.out / f'bench-{backend}.log'}")
        data = json.loads(report.read_text())
        data["server_ready_s"] = ready
        report.write_text(json.dumps(data, indent=1) + "\n")
        if backend == "off":
            shutil.copyfile(outputs, c.ref)
        if c.a.equality_prompts > 0:
            records = _collect_equality(c, str(sock), backend)
            if backend == "off":  # the replay drafter gets these prompts' recordings too
                with c.ref.open("a") as f:
                    for r in records:
                        if not r["repeat"]:  # the cold pass (the others repeat its outputs or differ at ties)
                            row = {"prompt_token_ids": r["prompt"], "output_token_ids": r["output_token_ids"]}
                            f.write(json.dumps(row) + "\n")
        if c.a.after_bench:  # e.g. issue 24's agent measurements on the same loaded server
            env = {**os.environ, "IGNIS_SOCK": str(sock), "IGNIS_BACKEND": backend}
            _say(f"{backend}: after-bench: {c.a.after_bench}")
            after = subprocess.run(c.a.after_bench, shell=True, env=env, capture_output=True, text=True)
            (c.out / f"after-{backend}.log").write_text(after.stdout + after.stderr)
            print(after.stdout[-6000:], flush=True)
            _say(f"{backend}: after-bench rc {after.returncode}")


def _collect_equality(c: _Ctx, sock: str, backend: str) -> list[dict[str, Any]]:
    """Greedy outputs with top logprobs from the running server (`socket_equality.collect`), kept
    under --out (replacing the backend's earlier ones) and returned."""
    from ignis.tools.bench import socket_equality as se

    prompts = se.make_prompts("ids", c.a.equality_prompts, c.a.input_len, 1000, 1)
    clients = [int(x) for x in c.a.concurrency.split(",") if x.strip()]
    t0 = time.perf_counter()
    records = se.collect(sock, backend, prompts, clients=clients, max_tokens=c.a.equality_tokens)
    path = c.out / se.RECORDS
    kept = [r for r in (se.read_records(c.out) if path.exists() else []) if r["label"] != backend]
    path.unlink(missing_ok=True)
    se.append_records(c.out, [*kept, *records])
    _say(f"{backend}: equality records at {clients} client(s) in {time.perf_counter() - t0:.0f} s")
    return records


def _outputs(path: Path) -> dict[tuple[int, ...], set[tuple[int, ...]]]:
    """prompt ids -> the distinct outputs recorded for it (one per concurrency at most)."""
    out: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out.setdefault(tuple(r["prompt_token_ids"]), set()).add(tuple(r["output_token_ids"]))
    return out


def summarize_runs(out: Path) -> list[dict[str, Any]]:
    """One row per (backend, concurrency) measured under `out` (the `table` phase's figures)."""
    reference = _outputs(out / "off.outputs.jsonl")
    rows: list[dict[str, Any]] = []
    for backend in BACKENDS:
        path = out / f"{backend}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        outputs = _outputs(out / f"{backend}.outputs.jsonl")
        same = sum(1 for p, o in outputs.items() if o <= reference.get(p, set()))  # each one of off's
        for run in data.get("runs", [data]):
            s, spec = run["summary"], run.get("speculative") or {}
            conc = int(run["config"]["concurrency"])
            tpr = spec.get("tokens_per_round") or 1.0
            tpot = (s.get("tpot") or {}).get("mean")
            per_pos = spec.get("per_position") or []
            rows.append(
                {
                    "backend": backend,
                    "concurrency": conc,
                    "output_tok_s": s["output_throughput"],
                    "decode_tok_s_p50": (s.get("decode_tok_s") or {}).get("p50"),
                    "ttft_p50_ms": 1e3 * ((s.get("ttft") or {}).get("p50") or 0.0),
                    "tpot_ms": None if tpot is None else 1e3 * tpot,
                    "tokens_per_round": tpr,
                    "first_acceptance": per_pos[0]["rate"] if per_pos else None,
                    "round_ms": None if tpot is None else 1e3 * tpot * tpr,
                    "target_tok_s": TARGETS.get((backend, conc)),
                    "same_as_off": f"{same}/{len(outputs)}" if reference else "n/a",
                    "failed": s["failed"],
                    "requests": s["completed"],
                    "max_tokens": run["config"]["max_tokens"],
                    "prompt_tokens_mean": s["prompt_tokens"] / s["completed"] if s["completed"] else None,
                    "server_ready_s": data.get("server_ready_s"),
                }
            )
    by = {(r["backend"], r["concurrency"]): r for r in rows}
    for r in rows:
        if r["backend"] == "dflash2":
            rep = by.get(("replay", r["concurrency"]))
            if rep and r["round_ms"] is not None and rep["round_ms"] is not None:
                r["drafter_ms_per_round"] = r["round_ms"] - rep["round_ms"]
    return rows


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        width = re.match(r"[<>^]?\d*", spec)
        return format("-", width.group(0) if width else "")
    return format(v, spec)


def phase_table(c: _Ctx) -> None:
    rows = summarize_runs(c.out)
    meta = {}
    for name in ("write.json", "rate.json", "build.json"):
        if (c.out / name).exists():
            meta[name.removesuffix(".json")] = json.loads((c.out / name).read_text())
    c.record(
        "fullsize_27b.json",
        {"model": c.a.model, "card": c.a.card, "weights": c.a.weights, "rows": rows, **meta},
    )
    head = (
        f"{'backend':<8} {'lanes':>5} {'tok/s':>8} {'target':>6} {'lane p50':>8} {'TTFT ms':>8} "
        f"{'ms/tok':>7} {'tok/rnd':>7} {'acc@1':>6} {'ms/rnd':>7} {'drafter':>8} {'=off':>6}"
    )
    shape = ""
    if rows:
        r0 = rows[0]
        prompt = r0["prompt_tokens_mean"] or 0.0
        shape = f"; {r0['requests']} requests of {prompt:.0f} + {r0['max_tokens']} tokens, greedy"
    print(f"\n27B-shaped qwen3_5 at the socket ({c.a.model}, {c.a.weights} weights, card {c.a.card}{shape})")
    if "write" in meta:
        w = meta["write"]
        print(
            f"write: checkpoint {w['checkpoint_s']:.0f} s + drafter {w['drafter_s']:.0f} s into {w['root']}"
        )
    for run in meta.get("rate", {}).get("runs", []):
        q4 = run["params_per_s"]["q4"] or 0.0
        print(
            f"rate: {run['threads']} thread(s): q4 {q4 / 1e6:.0f} M params/s, "
            f"weights of the whole plan ~{run['estimated_plan_weights_s']:.0f} s"
        )
    if "build" in meta:
        print(f"build: {meta['build']['seconds']:.0f} s (rc {meta['build']['rc']})")
    print(head)
    for r in rows:
        cells = [
            f"{r['backend']:<8}",
            f"{r['concurrency']:>5}",
            f"{r['output_tok_s']:>8.1f}",
            _fmt(r["target_tok_s"], ">6"),
            _fmt(r["decode_tok_s_p50"], ">8.1f"),
            f"{r['ttft_p50_ms']:>8.1f}",
            _fmt(r["tpot_ms"], ">7.2f"),
            f"{r['tokens_per_round']:>7.2f}",
            _fmt(r["first_acceptance"], ">6.3f"),
            _fmt(r["round_ms"], ">7.2f"),
            _fmt(r.get("drafter_ms_per_round"), ">8.2f"),
            f"{r['same_as_off']:>6}",
        ]
        print(" ".join(cells))
    print(f"(written to {c.out / 'fullsize_27b.json'})")
    from ignis.tools.bench import socket_equality as se

    if (c.out / se.RECORDS).exists():
        try:
            se.write_report(c.out, "off", c.a.equality_threshold)
        except SystemExit as exc:  # no off records yet
            _say(f"table: no equality report: {exc}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ignis.tools.bench.fullsize_27b",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "phases",
        nargs="+",
        choices=[*PHASES, *EXTRA_PHASES, "all"],
        metavar="PHASE",
        help=" ".join(PHASES) + " | all | rate",
    )
    p.add_argument("--model", default="qwen3_5-27b", choices=["qwen3_5-27b", "tiny"])
    p.add_argument("--card", default="h200")
    p.add_argument(
        "--weights",
        default=os.environ.get("IGNIS_FULLSIZE_WEIGHTS") or "confident",
        choices=["confident", "random"],
        help="the checkpoint's values: confident (wide greedy margins, `random_checkpoint.Confident`) "
        "or random (the plain init); default $IGNIS_FULLSIZE_WEIGHTS or confident",
    )
    p.add_argument("--ckpt-root", default=None, help="default: /dev/shm when it has room (`place`)")
    p.add_argument("--art-root", default=None, help="default: /tmp (`place`)")
    p.add_argument(
        "--state",
        default="/tmp/ignis-fullsize-state.json",
        help="where the chosen roots are kept between commands",
    )
    p.add_argument("--out", default=os.environ.get("OUT") or "fullsize-out")
    p.add_argument(
        "--widths", default=None, help="recipe widths, comma-separated ('' = none); default: the card's"
    )
    p.add_argument("--keep-checkpoint", action="store_true")
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--draft-tokens", type=int, default=7)
    p.add_argument("--accept", type=float, default=0.885)
    p.add_argument("--ready-timeout", type=float, default=420.0)
    p.add_argument(
        "--equality-prompts",
        type=int,
        default=8,
        help="token-id prompts sent with top logprobs after each bench (socket_equality; 0: none)",
    )
    p.add_argument("--equality-tokens", type=int, default=128, help="tokens per equality prompt")
    p.add_argument(
        "--equality-threshold",
        type=float,
        default=0.25,
        help="near-tie gap in nats (socket_equality.DEFAULT_THRESHOLD)",
    )
    p.add_argument("--rate-params", type=float, default=3e9, help="rate: parameters converted per run")
    p.add_argument(
        "--server-arg", action="append", default=[], help="an extra ignis-run argument (repeatable)"
    )
    p.add_argument(
        "--after-bench",
        default="",
        help="a shell command run after each serving phase's bench while its server is up (the socket "
        "in $IGNIS_SOCK, the backend in $IGNIS_BACKEND); its output goes to after-<backend>.log",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    c = _Ctx(a)
    phases = list(PHASES) if "all" in a.phases else a.phases
    _say(f"phases {phases}; checkpoint {c.ckpt_root}, artifact {c.art}, out {c.out}")
    for phase in phases:
        if phase == "write":
            phase_write(c)
        elif phase == "build":
            phase_build(c)
        elif phase == "rate":
            phase_rate(c)
        elif phase == "table":
            phase_table(c)
        else:
            phase_serve(c, phase)
    if "table" not in phases and any(p in BACKENDS for p in phases):
        phase_table(c)


if __name__ == "__main__":
    main()
