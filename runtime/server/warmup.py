"""A warm-up request at load: the first request must be as fast as the tenth.

`warm_up_static` captures the static executors' round shapes at load, but a first request still
pays one-time costs outside the graphs: kernels of the eager prefill and checkpoint paths loaded
lazily by the CUDA driver on first use (torch enables lazy module loading), the caching allocator
growing its pools for the engine's tensors, the prompt-checkpoint pools' first copies. Measured on
the H200 (docs/perf/log, session 13): a served tiny hybrid's first request took 2.8x its tenth with
every graph captured at load. `warm_up_engine` runs one short generation through the engine as the
server built it (two lanes, one prompt longer than the round width so chunked prefill runs, greedy,
end of sequence ignored, a few rounds with speculation) and then leaves no trace: the engine's
metrics object and the prompt-checkpoint cache's counters are swapped out for the run, and the
checkpoints it took are dropped. vLLM (a dummy run at start) and llama.cpp (a warm-up decode) do
the same.

The text side has one-time costs of its own, paid by the first chat request unless the server pays
them at start (`warm_up_text`, from the app's lifespan): the chat template's compilation (jinja2 and
its import), the truncating copy of the tokenizer the prompt is encoded with (`Tokenizer.encode`
with max_length: a copy of the backend rebuilt from its JSON) and the longest token's byte count
(`Tokenizer.min_tokens`). For SmolLM2's 49,152-token tokenizer on the 2-vCPU build box: 98, 104 and
27 ms, about 0.23 s added to the first chat request's time to first token.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["warm_up_engine", "warm_up_text"]


def warm_up_engine(engine: Any, *, tokens: int = 4) -> float:
    """Run one throwaway generation through `engine` (a `SpeculativeEngine` with no lanes) and return
    its seconds. Prompts: token ids 1.. of lengths 3 and ``2 x max_columns + 1`` (the executor's
    round width when it has one, else 17); `tokens` output tokens each (plus the drafts' rounds).
    The engine's metrics and the prefix cache's metrics and entries are as before on return.

    Raises:
        StateError: the engine already has lanes (warm-up belongs to load).
    """
    from ignis.runtime.errors import StateError

    if engine.has_unfinished:
        raise StateError("warm_up_engine: the engine has lanes; warm up at load, before serving")
    width = int(getattr(engine.executor, "max_columns", 8) or 8)
    vocab = int(getattr(engine.executor.config, "vocab_size", 2))
    prompts = [[1 + i % (vocab - 1) for i in range(n)] for n in (3, 2 * width + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    cache = getattr(engine.checkpoints, "cache", None)
    saved_metrics = engine.metrics
    saved_cache_metrics = getattr(cache, "metrics", None)
    engine.metrics = SpeculativeMetrics()
    if cache is not None:
        cache.metrics = type(saved_cache_metrics)()
    t0 = time.perf_counter()
    try:
        engine.generate(prompts, params)
    finally:
        engine.metrics = saved_metrics
        if cache is not None:
            cache.clear()
            cache.metrics = saved_cache_metrics
    seconds = time.perf_counter() - t0
    log.info("warm-up request at load: %.2f s", seconds)
    return seconds


def warm_up_text(tokenizer: Any, max_context: int | None) -> float:
    """Pay the text side's one-time costs now (module docstring): render a one-message conversation
    with `tokenizer`'s chat template, bound its tokens (`min_tokens`) and encode it truncated to
    `max_context` tokens, as a chat request's prompt is (`_Service.chat_prompt`). Returns its seconds.

    Never raises for the model's sake: a tokenizer without these methods, or a template that refuses
    the conversation, leaves the rest for the first request (logged at debug level).
    """
    t0 = time.perf_counter()
    try:
        prompt = tokenizer.render_chat([{"role": "user", "content": "warm-up"}], add_generation_prompt=True)
        tokenizer.min_tokens(prompt.text)
        tokenizer.encode_chat_prompt(prompt, max_length=max_context)
    except Exception as exc:  # a template's raise_exception, a tokenizer of another kind
        log.debug("text warm-up stopped early: %s", exc)
    seconds = time.perf_counter() - t0
    log.info("text warm-up at start: %.2f s", seconds)
    return seconds
