"""A toy `ModelSource` for server tests: the toy executor, a character tokenizer, a toy drafter.

- Model: `tests/toy_executor.py` (50 tokens, float64, logits independent of batching, so greedy output
  is exact whatever the lanes and drafts).
- Tokenizer: the real `ignis.runtime.tokenizer.Tokenizer` over a character-level `tokenizers` JSON
  built here: id 0 `<eos>` (special, the EOS), 1 `<unk>`, 2 `<|im|>` (special, the chat marker),
  3..49 single characters (text is lower-cased). The chat template writes
  `<|im|>role: content\\n` per message and `<|im|>assistant: ` as the generation prompt.
- Drafters: `dflash2` drafts `draft_tokens` per lane with a `ModelDrafter` over a toy executor of
  seed `drafter_seed` (seed 0 = the target itself: every greedy draft is accepted; another seed:
  mostly rejected); `mtp` is the same drafter, row-budgeted.
- `step_delay` (seconds) sleeps in every executor forward, to hold lanes busy in queueing tests.

Environment (for `ignis-run --model-factory toy_model:from_env` in a subprocess):
IGNIS_TOY_CONTEXT, IGNIS_TOY_DELAY, IGNIS_TOY_DRAFTER_SEED, IGNIS_TOY_KINDS ("dflash2,mtp"),
IGNIS_TOY_PROFILE, IGNIS_TOY_IGNORE_PREFILL_BUDGET ("1": engines ignore --max-prefill-tokens).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from toy_executor import ToyConfig, ToyExecutor

from ignis.runtime.drafters.testing import ModelDrafter
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.server.model import ModelSettings, ServedModel
from ignis.runtime.tokenizer import Tokenizer, TokenizerSpec

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:!?'\n-(é"
VOCAB = ["<eos>", "<unk>", "<|im|>", *CHARS]
assert len(VOCAB) == 50, len(VOCAB)
EOS_ID = 0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im|>assistant: {% endif %}"
)


def toy_tokenizer() -> Tokenizer:
    """The character tokenizer (module docstring)."""
    tok = HFTokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>", "<|im|>"])
    spec = TokenizerSpec(
        tokenizer_json=tok.to_str(),
        chat_template=CHAT_TEMPLATE,
        special_tokens={"eos_token": "<eos>"},
        eos_token_ids=(EOS_ID,),
    )
    return Tokenizer(spec)


class SlowExecutor(ToyExecutor):
    """The toy executor sleeping `delay` seconds in every forward."""

    def __init__(self, config: ToyConfig, delay: float) -> None:
        super().__init__(config)
        self.delay = delay

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.delay:
            time.sleep(self.delay)
        return super().forward(*args, **kwargs)


@dataclass
class ToySource:
    """The toy `ModelSource` (module docstring)."""

    name: str = "toy"
    aliases: tuple[str, ...] = ("toy-alias",)
    spec_kinds: tuple[str, ...] = ("dflash2", "mtp")
    profile: str | None = None
    context: int = 256
    step_delay: float = 0.0
    drafter_seed: int = 0
    fail_after_steps: int | None = None  # make the executor raise after this many forwards (tests)
    ignore_prefill_budget: bool = False  # build engines with the default budget, as a careless source

    def missing_backend_reason(self, backend: str) -> str:
        return f"the toy model has no {backend} drafter"

    def load(self, settings: ModelSettings) -> ServedModel:
        tokenizer = toy_tokenizer()
        config = ToyConfig(max_position_embeddings=self.context)
        spec = settings.spec
        source = self

        def make_engine(max_lanes: int, metrics: SpeculativeMetrics) -> SpeculativeEngine:
            executor = SlowExecutor(config, source.step_delay)
            if source.fail_after_steps is not None:
                executor = _FailingExecutor(config, source.fail_after_steps)
                source.fail_after_steps = None  # the restarted engine works
            drafter = None
            if spec.backend != "off":
                drafter_config = ToyConfig(max_position_embeddings=self.context, seed=self.drafter_seed)
                drafter = ModelDrafter(
                    ToyExecutor(drafter_config), mode="greedy", is_row_budgeted=spec.backend == "mtp"
                )
            return SpeculativeEngine(
                executor,
                drafter,
                draft_tokens=spec.draft_tokens if drafter is not None else None,
                draft_rows=spec.draft_rows,
                eos_token_ids=(EOS_ID,),
                detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                max_context=settings.max_context,
                max_lanes=max_lanes,
                **(
                    {}
                    if source.ignore_prefill_budget
                    else {"max_prefill_tokens": settings.max_prefill_tokens}
                ),
                metrics=metrics,
            )

        return ServedModel(
            name=self.name, tokenizer=tokenizer, make_engine=make_engine, spec=spec, aliases=self.aliases
        )


class _FailingExecutor(ToyExecutor):
    def __init__(self, config: ToyConfig, fail_after: int) -> None:
        super().__init__(config)
        self.left = fail_after

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("toy executor failure (test)")
        return super().forward(*args, **kwargs)


def from_env() -> ToySource:
    """A ToySource configured from IGNIS_TOY_* environment variables (module docstring)."""
    env = os.environ
    kinds = env.get("IGNIS_TOY_KINDS", "dflash2,mtp")
    return ToySource(
        context=int(env.get("IGNIS_TOY_CONTEXT", "256")),
        step_delay=float(env.get("IGNIS_TOY_DELAY", "0")),
        drafter_seed=int(env.get("IGNIS_TOY_DRAFTER_SEED", "0")),
        spec_kinds=tuple(k for k in kinds.split(",") if k),
        profile=env.get("IGNIS_TOY_PROFILE") or None,
        ignore_prefill_budget=env.get("IGNIS_TOY_IGNORE_PREFILL_BUDGET") == "1",
    )


if __name__ == "__main__":  # print the vocabulary, for debugging
    print(json.dumps(VOCAB))
