"""Write a random-weight HF checkpoint of a public model shape, fast and in bounded memory (issue 25).

    python -m ignis.tools.random_checkpoint --model qwen3_5-27b --out /dev/shm/q27 \\
        [--drafter /dev/shm/q27-dflash2] [--seed 0] [--dtype bfloat16] [--shard-gib 4] [--threads N]

What it writes into `--out` (an HF folder `ignis-build` accepts):

- `config.json`: the text config of the chosen model (`MODELS`): `qwen3_5-27b` is the public
  Qwen3.5-27B text config (HF `Qwen/Qwen3.5-27B` `text_config`, `model_type` "qwen3_5_text": hidden
  5120, 64 layers with every 4th one gated full attention and the others Gated DeltaNet, 24 query / 4
  KV heads of 256, GDN 16 key / 48 value heads of 128, conv 4, intermediate 17408, vocabulary
  248,320, untied head, RoPE base 1e7 on a quarter of each head). The MTP head is left out
  (`mtp_num_hidden_layers: 0`; the public checkpoint has one layer) unless `--mtp`. `tiny` is the same
  structure at toy sizes whose every linear input width is a multiple of 128 (each takes the CUDA
  cards' nvcc-built tiled route).
- `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`: every tensor of the family's
  table (`ignis.runtime.families.qwen3_5.tensor_shapes`, canonical text-model names `model.layers.*`)
  in `--dtype`, sharded at about `--shard-gib`.
- `tokenizer.json`, `tokenizer_config.json` (ChatML chat template, eos `<|im_end|>`),
  `generation_config.json`: a byte-level BPE with the model's vocabulary size
  (`random_tokenizer_json`): the 256 byte symbols, no merges, the ChatML special tokens at the
  public ids (248,044..248,046 when the vocabulary has room) and filler tokens " t<ID>" for the other
  ids, so every id decodes to readable text.

With `--drafter DIR`, a DFlash2 drafter of the public Qwen3.5-27B DFlash2 drafter's shape
(`PUBLIC_27B_DFLASH2`: 5 layers, 32 / 8 heads of 128, MLP 17408, taps [5, 19, 33, 47, 61], block 8,
sliding window 2048, conv 2 taps in groups of 16, selector rank 256, top-16, mask token 248,070) is
written there too (`tiny`: `make_test_drafter.small_dflash2_config`'s shape for the tiny target), in
the public layout: matrices N(0, 0.02), plain norm weights 1, biases 0, the conv base kernels near
identity (tap 0 ~ 1, the next ~ 0.15) and the selector's codebooks N(0, 256^-1/4).

Values (`init_tensor`): matrices and embeddings N(0, `INIT_STD` = 0.02) as HF's `initializer_range`;
(1 + w) RMSNorm weights 0 (identity), the GDN's plain gated-norm weight 1; `A_log` = log U(1, 16)
and `dt_bias` = 1 (HF's init); the conv1d N(0, 0.02) too. A block then adds O(1) to the residual
stream (a linear of fan-in K scales its normalized input by 0.02 * sqrt(K): 1.4 at 5120, 2.6 at
17408), which stays far inside bf16's range through 64 layers. Every tensor (and every
row block of a large one) draws from its own `torch.Generator` seeded by (seed, name, block), so the
output does not depend on the thread count. Every block of a shard is generated on a thread pool
(torch releases the GIL) and the shard is written by `safetensors.torch.save_file` on another
thread while the next one is drawn: peak memory is two shards (and save_file's copy of one).

Where to write the 27B (~54 GB): the device host has 64 GB of disk and 128 GB of RAM; the artifact
(~16 GB) must go to disk, so the checkpoint goes to RAM (`/dev/shm`), and is deleted once built.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import torch

from ignis.runtime.drafters.dflash2 import DFlash2Config, dflash2_tensor_shapes
from ignis.runtime.errors import ConfigError, IgnisRuntimeError
from ignis.runtime.families.base import config_from_hf
from ignis.runtime.families.qwen3_5 import HybridConfig, mtp_tensor_shapes, tensor_shapes

__all__ = [
    "INIT_STD",
    "MODELS",
    "PUBLIC_27B_DFLASH2",
    "Confident",
    "confident_permutation",
    "init_tensor",
    "random_tokenizer_json",
    "sublayer_output_rms",
    "write_random_checkpoint",
    "write_random_dflash2",
]

#: Standard deviation of matrices and embeddings (HF `initializer_range` of the Qwen3.5 configs).
INIT_STD = 0.02

#: Values per generated block (float32 scratch: 16 MiB); larger tensors are split in row blocks.
BLOCK_ELEMENTS = 1 << 22

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The public Qwen3.5-27B text config (HF `Qwen/Qwen3.5-27B` config.json `text_config`; the same numbers
# in THUDM/slime scripts/models/qwen3.5-27B.sh). The mrope fields are text-only no-ops here.
_QWEN3_5_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "full_attention_interval": 4,
    "layer_types": [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(64)],
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "attn_output_gate": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "hidden_act": "silu",
    "initializer_range": INIT_STD,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_cache": True,
    "mtp_num_hidden_layers": 0,
    "mtp_use_dedicated_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    "eos_token_id": 248046,
    "pad_token_id": 248044,
    "dtype": "bfloat16",
}

# The same structure at toy sizes, every linear's input width a multiple of 128.
_TINY: dict[str, Any] = dict(
    _QWEN3_5_27B,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    full_attention_interval=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=4096,
    eos_token_id=1023,
    pad_token_id=1021,
)

#: Model presets: name -> HF text config.json.
MODELS: dict[str, dict[str, Any]] = {"qwen3_5-27b": _QWEN3_5_27B, "tiny": _TINY}

#: The public Qwen3.5-27B DFlash2 drafter's config.json (z-lab's DFlash2 drafter for the 27B: its
#: schema and values; tests/runtime/test_dflash2.py holds the drafter's parser to it).
PUBLIC_27B_DFLASH2: dict[str, Any] = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 17408,
    "vocab_size": 248320,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "num_target_layers": 64,
    "sliding_window": 2048,
    "is_causal": False,
    "layer_types": ["sliding_attention"] * 5,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "dflash_config": {
        "block_size": 8,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "mask_token_id": 248070,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [5, 19, 33, 47, 61],
    },
}

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_PUBLIC_SPECIAL_ID = 248044  # <|endoftext|> in the public Qwen3.5 vocabulary


# --- values ---------------------------------------------------------------------------------------------


def _seed_of(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill(
    name: str, out: torch.Tensor, gen: torch.Generator, *, drafter: bool, std: float = INIT_STD
) -> None:
    """Draw `out` (a float32 block of tensor `name`) in place by the init rules (module docstring);
    `std` is the matrices' standard deviation (`Confident.out_std` for a confident output projection)."""
    if drafter:
        if name.endswith("base_kernel"):  # near identity: tap 0 ~ 1, later taps ~ 0.15
            out.normal_(0.15, 0.05, generator=gen)
            out[:, 0].normal_(1.0, 0.05, generator=gen)
        elif name.endswith("_codebook"):
            out.normal_(0.0, 1.0 / 256**0.25, generator=gen)
        elif out.dim() == 1 and name.endswith("norm.weight"):
            out.fill_(1.0)
        elif out.dim() == 1:
            out.zero_()
        else:
            out.normal_(0.0, INIT_STD, generator=gen)
        return
    if name.endswith("A_log"):
        out.uniform_(1.0, 16.0, generator=gen).log_()
    elif name.endswith("dt_bias"):
        out.fill_(1.0)
    elif name.endswith("linear_attn.norm.weight"):  # the gated RMSNorm's plain weight
        out.fill_(1.0)
    elif out.dim() == 1:  # (1 + w) RMSNorms (stored zero-centred) and biases
        out.zero_()
    else:  # linears, embeddings, the conv1d
        out.normal_(0.0, std, generator=gen)


def _blocks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) of the leading dim, each at most `BLOCK_ELEMENTS` values (>= 1 row)."""
    rows = shape[0] if shape else 1
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, BLOCK_ELEMENTS // per_row)
    return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]


# --- the confident variant ------------------------------------------------------------------------------

#: Tensor names the confident variant changes.
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _gauss_mean(f: Callable[[Any], Any], s: float) -> float:
    """E[f(x)] for x ~ N(0, s^2), by 96-point Gauss-Hermite quadrature."""
    import numpy as np

    x, w = np.polynomial.hermite_e.hermegauss(96)
    return float(np.sum(w * f(s * x)) / np.sqrt(2 * np.pi))


def sublayer_output_rms(config: HybridConfig) -> list[float]:
    """Estimated rms (per element) of what each sublayer adds to the residual stream at the default
    init, in layer order (mixer, then MLP, per layer).

    A sublayer's input is RMS-normalized (rms 1, the (1 + w) weight 1), so an input projection's
    outputs are ~N(0, s^2) with s = INIT_STD * sqrt(hidden), and an output projection of fan-in K
    scales its input's rms a by INIT_STD * sqrt(K):

    - MLP: a = rms(silu(g) * u) = s * sqrt(E[silu(g)^2]), K = intermediate;
    - Gated DeltaNet: the gated norm gives rms(norm(o) * silu(z)) = sqrt(E[silu(z)^2]), K = value dim;
    - gated attention: at most one key's value times the gate, a = s * sqrt(E[sigmoid(g)^2]) (more keys
      average it down: an upper bound), K = heads * head_dim.
    """
    import numpy as np

    s = INIT_STD * math.sqrt(config.hidden_size)
    silu2 = _gauss_mean(lambda x: (x / (1 + np.exp(-x))) ** 2, s)
    sig2 = _gauss_mean(lambda x: (1 / (1 + np.exp(-x))) ** 2, s)
    out = []
    for i in range(config.num_hidden_layers):
        if config.is_full_attention(i):
            k_attn = config.num_attention_heads * config.head_dim
            out.append(INIT_STD * math.sqrt(k_attn) * s * math.sqrt(sig2))
        else:
            out.append(INIT_STD * math.sqrt(config.linear_value_dim) * math.sqrt(silu2))
        k_mlp = config.dense_intermediate_size(i)
        out.append(INIT_STD * math.sqrt(k_mlp) * s * math.sqrt(silu2))
    return out


@dataclasses.dataclass(frozen=True)
class Confident:
    """The confident variant's values (`--confident`): the default init except for two tensors.

    - The embedding is drawn N(0, `embed_std`) with embed_std = R / rho, R the root sum of squares of
      `sublayer_output_rms`: the layers together add about rho times the embedding's rms to the
      residual stream, so the last hidden state h = e_t + r keeps the input token's embedding e_t with
      |r| ~ rho |e_t| (r is what the context contributes). The same as scaling every output
      projection (o_proj, out_proj, down_proj) down by the same factor: every sublayer sees an
      RMS-normalized input, so the two differ only by RMSNorm's eps.
    - lm_head row pi(t) = e_t * INIT_STD / embed_std (std INIT_STD like the default head), pi a fixed
      random permutation of the vocabulary (`confident_permutation`).

    The margin: the final norm maps h to u = h sqrt(H) / |h| (H the hidden size, |e_t|^2 ~ H embed_std^2).
    Token pi(t)'s logit is INIT_STD/embed_std * e_t . u = INIT_STD * H / sqrt(1 + rho^2) (to first
    order, r ~ orthogonal to e_t); every other row is an independent draw, so its logit is
    ~N(0, INIT_STD^2 H) and the largest of V - 1 of them ~ INIT_STD sqrt(2 H ln V). The greedy choice
    is pi(t) with a margin of about INIT_STD (H / sqrt(1 + rho^2) - sqrt(2 H ln V)): ~65 nats at the
    27B (H 5120, V 248,320, rho 1), ~2.4 at `tiny` (H 256, V 1024); a trained model's confident
    tokens have a few nats. `sublayer_output_rms` over-estimates the attention layers (an upper
    bound), so the actual rho is below the asked one and the margin a little wider (measured figures:
    docs/perf/README.md). Greedy output walks the permutation: t, pi(t), pi(pi(t)), ... The other
    logits depend on the context through r (a corrupted state moves them, not the argmax).

    Attributes:
        rho: the layers' share of the residual stream, relative to the embedding.
        embed_std: the embedding's standard deviation.
    """

    rho: float
    embed_std: float

    @classmethod
    def for_config(cls, config: HybridConfig, rho: float = 1.0) -> Confident:
        if not rho > 0:
            raise ConfigError(f"--confident-rho must be > 0, got {rho}")
        total = math.sqrt(sum(r * r for r in sublayer_output_rms(config)))
        return cls(rho=rho, embed_std=total / rho)


def _head_sources(shape: tuple[int, ...], seed: int) -> list[tuple[int, torch.Tensor]]:
    """Per row block k of lm_head (`_blocks`): (the embedding block it copies, the row order).

    lm_head block k's row j is row perm_k[j] of embedding block src[k]: the full blocks are permuted
    among themselves, a last partial block stays in place; each perm_k is a random order of its rows.
    Both are drawn from generators seeded by (seed, purpose, block), like the values.
    """
    blocks = _blocks(shape)
    full = [i for i, (lo, hi) in enumerate(blocks) if hi - lo == blocks[0][1] - blocks[0][0]]
    gen = torch.Generator().manual_seed(_seed_of(seed, "confident:blocks", len(blocks)))
    order = torch.randperm(len(full), generator=gen).tolist()
    src = list(range(len(blocks)))
    for k, j in zip(full, order, strict=True):
        src[k] = full[j]
    out = []
    for k, (lo, hi) in enumerate(blocks):
        g = torch.Generator().manual_seed(_seed_of(seed, "confident:rows", k))
        out.append((src[k], torch.randperm(hi - lo, generator=g)))
    return out


def confident_permutation(vocab_size: int, hidden_size: int, seed: int = 0) -> torch.Tensor:
    """pi of the confident checkpoint written with `seed`: int64 [vocab_size], pi[t] = the lm_head row
    that holds token t's embedding (the greedy successor of t)."""
    shape = (vocab_size, hidden_size)
    blocks = _blocks(shape)
    pi = torch.empty(vocab_size, dtype=torch.int64)
    for k, (src, perm) in enumerate(_head_sources(shape, seed)):
        lo, hi = blocks[k]
        pi[blocks[src][0] + perm] = torch.arange(lo, hi)
    return pi


def _block_jobs(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    seed: int,
    drafter: bool,
    confident: Confident | None = None,
) -> tuple[torch.Tensor, list[Callable[[], None]]]:
    """The empty tensor and one job per row block that draws it (`init_tensor`; `Confident`)."""
    out = torch.empty(shape, dtype=dtype)
    blocks = [(0, shape[0])] if (not shape or name.endswith("base_kernel")) else _blocks(shape)
    embed_std = confident.embed_std if confident is not None and not drafter else None
    sources = _head_sources(shape, seed) if embed_std is not None and name == HEAD else None

    def draw(i: int) -> None:
        lo, hi = blocks[i]
        if sources is not None:  # a block of embedding rows, permuted and rescaled (`Confident`)
            src, perm = sources[i]
            slo, shi = blocks[src]
            gen = torch.Generator().manual_seed(_seed_of(seed, EMBED, src))
            scratch = torch.empty((shi - slo, *shape[1:]), dtype=torch.float32)
            assert embed_std is not None
            scratch.normal_(0.0, embed_std, generator=gen)
            out[lo:hi].copy_(scratch[perm].mul_(INIT_STD / embed_std))
            return
        gen = torch.Generator().manual_seed(_seed_of(seed, name, i))
        scratch = torch.empty((hi - lo, *shape[1:]) if shape else (), dtype=torch.float32)
        std = embed_std if (embed_std is not None and name == EMBED) else INIT_STD
        _fill(name, scratch, gen, drafter=drafter, std=std)
        if shape:
            out[lo:hi].copy_(scratch)
        else:
            out.copy_(scratch)

    return out, [functools.partial(draw, i) for i in range(len(blocks))]


def init_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    seed: int,
    drafter: bool = False,
    pool: ThreadPoolExecutor | None = None,
    confident: Confident | None = None,
) -> torch.Tensor:
    """One random tensor by the init rules (module docstring), drawn in row blocks.

    Each block uses its own generator seeded by (seed, name, block index): the result is the same
    whether the blocks run in `pool` (threads) or here. Tensors whose rules act across rows (a
    `base_kernel`'s tap 0) are drawn as one block.

    Returns:
        A CPU tensor of `shape` and `dtype`.
    """
    out, jobs = _block_jobs(name, shape, dtype, seed=seed, drafter=drafter, confident=confident)
    if pool is None or len(jobs) == 1:
        for job in jobs:
            job()
    else:
        for f in [pool.submit(job) for job in jobs]:
            f.result()
    return out


# --- writing --------------------------------------------------------------------------------------------


def _shards(shapes: Mapping[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> list[list[str]]:
    """Names grouped in order into shards of at most `shard_bytes` (a larger tensor gets its own)."""
    out: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * itemsize
        if out[-1] and size + n > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def _write_tensors(
    folder: Path,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    dtype: torch.dtype,
    seed: int,
    drafter: bool,
    shard_bytes: int,
    threads: int,
    stem: str,
    echo: Callable[[str], None],
    confident: Confident | None = None,
) -> int:
    """Sharded safetensors (+ index when more than one shard); returns the bytes of tensor data."""
    from safetensors.torch import save_file

    itemsize = torch.empty((), dtype=dtype).element_size()
    groups = _shards(shapes, itemsize, shard_bytes)
    total = 0
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()

    def save(file: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        size = sum(t.numel() * itemsize for t in tensors.values())
        total += size
        rate = total / max(time.perf_counter() - t0, 1e-9) / 2**30
        echo(f"  {file}: {len(tensors)} tensors, {size / 2**30:.2f} GiB ({rate:.2f} GiB/s so far)")

    # every block of a shard on the pool at once; the shard is saved on another thread while the
    # next one is drawn (two shards in memory at most)
    with (
        ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ignis-random") as pool,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="ignis-save") as saver,
    ):
        saving: Future[None] | None = None
        for i, names in enumerate(groups):
            file = (
                f"{stem}.safetensors"
                if len(groups) == 1
                else f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            )
            tensors: dict[str, torch.Tensor] = {}
            futures = []
            for n in names:
                tensors[n], jobs = _block_jobs(
                    n, tuple(shapes[n]), dtype, seed=seed, drafter=drafter, confident=confident
                )
                futures += [pool.submit(job) for job in jobs]
            for f in futures:
                f.result()
            if saving is not None:
                saving.result()
            saving = saver.submit(save, file, tensors)
            weight_map |= dict.fromkeys(names, file)
            del tensors
        if saving is not None:
            saving.result()
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def random_tokenizer_json(vocab_size: int) -> tuple[str, dict[int, str]]:
    """A `tokenizers` byte-level BPE of exactly `vocab_size` ids (module docstring).

    Returns:
        (the tokenizer.json text, special token id -> content).

    Raises:
        ConfigError: `vocab_size` < 259 (the 256 byte symbols and the three specials).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 256 + len(_SPECIALS):
        raise ConfigError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (>= 259)")
    first = min(_PUBLIC_SPECIAL_ID, vocab_size - len(_SPECIALS))
    specials = {first + i: s for i, s in enumerate(_SPECIALS)}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {c: i for i, c in enumerate(alphabet)}
    for i in range(len(alphabet), vocab_size):
        vocab[specials.get(i, f"\u0120t{i}")] = i  # "Ġt<id>" decodes to " t<id>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIALS))
    if tok.get_vocab_size() != vocab_size or any(tok.token_to_id(s) != i for i, s in specials.items()):
        raise ConfigError(f"the random tokenizer came out with {tok.get_vocab_size()} ids, not {vocab_size}")
    return tok.to_str(), specials


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    text, specials = random_tokenizer_json(vocab_size)
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    ids = {s: i for i, s in specials.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 262144,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": _CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for i, s in sorted(specials.items())
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


def _prepare(folder: Path, force: bool) -> None:
    if folder.exists():
        if not folder.is_dir():
            raise ConfigError(f"{folder}: exists and is not a folder")
        if any(folder.iterdir()):
            if not force:
                raise ConfigError(f"{folder}: folder is not empty (pass --force to overwrite)")
            shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)


def _threads(threads: int | None) -> int:
    if threads:
        return threads
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def write_random_checkpoint(
    out: str | Path,
    *,
    model: str = "qwen3_5-27b",
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_gib: float = 4.0,
    threads: int | None = None,
    mtp: bool = False,
    num_layers: int | None = None,
    force: bool = False,
    echo: Callable[[str], None] = lambda _line: None,
    confident: bool = False,
    confident_rho: float = 1.0,
) -> HybridConfig:
    """Write the random checkpoint folder of preset `model` into `out` (module docstring).

    `num_layers` overrides the depth (the preset's full-attention interval kept): a few layers of the
    full width make a quick full-size smoke test. `confident` writes the `Confident` variant (the
    same shapes and compute; greedy choices with wide margins) with the layers' share `confident_rho`;
    config.json then records it under "ignis_random": {"confident": true, "rho", "embed_std", "seed"}.

    Returns:
        The parsed family config.

    Raises:
        ConfigError: an unknown model or dtype, a non-empty `out` without force, a confident checkpoint
            of a tied-head config or a rho <= 0.
    """
    if model not in MODELS:
        raise ConfigError(f"unknown --model {model!r}; choose one of {sorted(MODELS)}")
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown --dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    raw = dict(MODELS[model], dtype=dtype)
    if num_layers is not None:
        if num_layers < 1:
            raise ConfigError(f"--num-layers must be >= 1, got {num_layers}")
        every = int(raw["full_attention_interval"])
        raw["num_hidden_layers"] = num_layers
        raw["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)
        ]
    if mtp:
        raw["mtp_num_hidden_layers"] = 1
    config = config_from_hf(raw)
    assert isinstance(config, HybridConfig)
    conf = None
    if confident:
        if config.tie_word_embeddings:
            raise ConfigError("--confident needs an untied lm_head (the head is a permuted embedding)")
        conf = Confident.for_config(config, confident_rho)
        raw["ignis_random"] = {"confident": True, "rho": conf.rho, "embed_std": conf.embed_std, "seed": seed}
    shapes = dict(tensor_shapes(config))
    shapes |= mtp_tensor_shapes(config)
    folder = Path(out)
    _prepare(folder, force)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    _write_tokenizer(folder, config.vocab_size)
    params = sum(math.prod(s) for s in shapes.values())
    echo(f"{model}: {params / 1e9:.2f} B parameters, {len(shapes)} tensors -> {folder}")
    if conf is not None:
        echo(f"confident: rho {conf.rho:g}, embedding std {conf.embed_std:.4g}, lm_head a permuted embedding")
    _write_tensors(
        folder,
        shapes,
        dtype=_DTYPES[dtype],
        seed=seed,
        drafter=False,
        shard_bytes=int(shard_gib * 2**30),
        threads=_threads(threads),
        stem="model",
        echo=echo,
        confident=conf,
    )
    return config


def write_random_dflash2(
    target: str | Path,
    out: str | Path,
    *,
    model: str = "qwen3_5-27b",
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_gib: float = 4.0,
    threads: int | None = None,
    force: bool = False,
    echo: Callable[[str], None] = lambda _line: None,
) -> DFlash2Config:
    """Write a random DFlash2 drafter for the checkpoint `target` (written by this tool) into `out`:
    the public 27B drafter's shape for `qwen3_5-27b`, `small_dflash2_config`'s for `tiny`.

    Raises:
        ConfigError: an unknown model or dtype, an unreadable target, a non-empty `out` without force.
    """
    from ignis.tools.make_test_drafter import small_dflash2_config

    if dtype not in _DTYPES:
        raise ConfigError(f"unknown --dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    try:
        raw_target = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{target}: cannot read the target's config.json: {exc}") from exc
    target_config = config_from_hf(raw_target)
    if model == "qwen3_5-27b":
        config = DFlash2Config.from_hf(PUBLIC_27B_DFLASH2)
        depth = int(target_config.num_hidden_layers)
        if depth != config.num_target_layers:  # a shallower smoke-test target: taps spread over it
            taps = min(depth, len(config.target_layer_ids))
            ids = sorted({round(i * (depth - 1) / max(1, taps - 1)) for i in range(taps)})
            config = dataclasses.replace(config, target_layer_ids=tuple(ids), num_target_layers=depth)
    else:
        config = small_dflash2_config(
            target_config, num_layers=2, intermediate_size=2 * target_config.hidden_size
        )
    if config.hidden_size != target_config.hidden_size or config.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"the {model} drafter (hidden {config.hidden_size}, vocab {config.vocab_size}) does not fit the "
            f"target {target} (hidden {target_config.hidden_size}, vocab {target_config.vocab_size})"
        )
    folder = Path(out)
    _prepare(folder, force)
    raw = config.to_hf()
    raw["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    shapes = dflash2_tensor_shapes(config)
    params = sum(math.prod(s) for s in shapes.values())
    echo(f"dflash2 drafter: {params / 1e9:.2f} B parameters, {len(shapes)} tensors -> {folder}")
    _write_tensors(
        folder,
        shapes,
        dtype=_DTYPES[dtype],
        seed=seed + 1,
        drafter=True,
        shard_bytes=int(shard_gib * 2**30),
        threads=_threads(threads),
        stem="model",
        echo=echo,
    )
    return config


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default="qwen3_5-27b", show_default=True, type=click.Choice(sorted(MODELS)))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    help="Output folder (new or empty). The 27B (~54 GB) belongs in /dev/shm on the GPU host.",
)
@click.option(
    "--drafter",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write a random DFlash2 drafter of the model's public drafter shape here.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(sorted(_DTYPES)))
@click.option("--shard-gib", default=4.0, show_default=True, type=click.FloatRange(min=0.01))
@click.option(
    "--threads", default=None, type=click.IntRange(1), help="Generator threads (default: all cores)."
)
@click.option("--mtp", is_flag=True, help="Include the MTP head (mtp_num_hidden_layers 1, as published).")
@click.option("--num-layers", type=click.IntRange(1), default=None, help="Override the depth (smoke tests).")
@click.option("--force", is_flag=True, help="Replace non-empty output folders.")
@click.option(
    "--confident",
    is_flag=True,
    help="Weights whose greedy choice has wide margins (the same shapes and compute): the embedding "
    "dominates the residual stream and lm_head is a permuted embedding (see `Confident`).",
)
@click.option(
    "--confident-rho",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="With --confident: the layers' share of the residual stream relative to the embedding.",
)
def main(
    model: str,
    out: Path,
    drafter: Path | None,
    seed: int,
    dtype: str,
    shard_gib: float,
    threads: int | None,
    mtp: bool,
    num_layers: int | None,
    force: bool,
    confident: bool,
    confident_rho: float,
) -> None:
    """Write a random-weight checkpoint (and optionally a DFlash2 drafter) of a public model shape."""

    def echo(line: str) -> None:
        click.echo(line, err=True)

    t0 = time.perf_counter()
    try:
        write_random_checkpoint(
            out,
            model=model,
            seed=seed,
            dtype=dtype,
            shard_gib=shard_gib,
            threads=threads,
            mtp=mtp,
            num_layers=num_layers,
            force=force,
            echo=echo,
            confident=confident,
            confident_rho=confident_rho,
        )
        echo(f"checkpoint written in {time.perf_counter() - t0:.1f} s")
        if drafter is not None:
            t1 = time.perf_counter()
            write_random_dflash2(
                out,
                drafter,
                model=model,
                seed=seed,
                dtype=dtype,
                shard_gib=shard_gib,
                threads=threads,
                force=force,
                echo=echo,
            )
            echo(f"drafter written in {time.perf_counter() - t1:.1f} s")
    except (IgnisRuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
