"""Tiny random HF checkpoints for tests, written by HF transformers' own classes.

Generic helpers any family's tests can use:

    model = transformers.LlamaForCausalLM(cfg)
    redraw_(model, seed=0)            # weights ~ N(0, 1/fan_in): no near-tie greedy choices
    save_tiny(model, tmp_path / "ckpt", tokenizer=tiny_tokenizer())

plus ready-made llama / qwen2 configs and a tiny byte-level BPE tokenizer with a chat template.
`tests/` has no package `__init__`: import it as `import hf_tiny` when `tests/` is on `sys.path`
(pytest `pythonpath = ["tests"]`), else load it by file path (see tests/runtime/test_llama_family.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# A ChatML template in the style of SmolLM2's / Qwen2.5's (exercises loops, conditionals,
# raise_exception and the generation prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def redraw_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter in place, deterministically (in sorted-name order).

    Matrices and higher-rank tensors (linear weights, embeddings, stacked experts) get
    N(0, 1/fan_in) with fan_in = the last dimension, so activations and logits stay O(1) and the
    top-2 logit margin is rarely tiny. 1-D tensors (norm weights, biases, per-head scalars) get
    their current value plus N(0, 0.1^2), so norms are near 1 (or 0 when zero-centred) but not
    exactly, and biases are non-zero. Tied parameters are drawn once.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                sample = torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5
                p.copy_(sample.to(p.dtype))
            else:
                p.add_((0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(p.dtype))
    return model


def save_tiny(
    model: Any,
    out_dir: str | Path,
    *,
    tokenizer: Any | None = None,
    max_shard_size: str | int | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (an HF PreTrainedModel) with `save_pretrained` as safetensors, plus the tokenizer.

    Args:
        max_shard_size: e.g. "20KB" to force a sharded checkpoint with `model.safetensors.index.json`.
        generation_config: written as generation_config.json when given.
    Returns the folder.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config))
    return out


def llama_config(**overrides: Any) -> Any:
    """A tiny transformers.LlamaConfig: GQA 4:2, head_dim 16, llama3 rope scaling, untied head."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def qwen2_config(**overrides: Any) -> Any:
    """A tiny transformers.Qwen2Config: GQA 4:1, q/k/v biases, tied embeddings, rope_theta 1e6."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    kw.update(overrides)
    return transformers.Qwen2Config(**kw)


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A redrawn float32 HF model in eval mode: family "llama" or "qwen2"."""
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        model = transformers.LlamaForCausalLM(llama_config(**overrides))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(qwen2_config(**overrides))
    else:
        raise ValueError(f"no tiny config for {family!r}")
    redraw_(model, seed)
    return model.eval()


_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "def add(a, b):\n    return a + b\n",
    "Grüße aus Köln! Ça va? 日本語のテキスト。 Emoji: 🙂🚀",
    "0123456789 numbers 42 and 2024, 3.14159",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(vocab_size: int = 384, chat_template: str = CHATML_TEMPLATE) -> Any:
    """A byte-level BPE trained on a small fixed corpus, as a transformers PreTrainedTokenizerFast.

    Ids 0..2 are the special tokens <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos), as in
    ChatML models; there is no bos. The vocabulary never exceeds `vocab_size`.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
    )
    fast.chat_template = chat_template
    return fast
