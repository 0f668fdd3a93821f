"""Import a GGUF file (llama.cpp's format) of the `llama` or `qwen2` architecture.

- Metadata -> an HF-style config dict -> the family config (`config_from_hf`), with the key
  correspondence of transformers' GGUF integration (`{arch}.block_count` -> num_hidden_layers, ...).
  `tie_word_embeddings` is true when the file has no `output.weight`.
- Tensors: GGUF names -> HF names through gguf-py's own tensor-name tables (`get_tensor_name_map`,
  inverted over the family's expected HF names); data dequantized with `gguf.quants.dequantize`
  (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, F16, F32 and whatever else gguf-py decodes) to float32,
  lazily, one tensor per access. For `llama`, the per-head row permutation llama.cpp's
  `convert_hf_to_gguf.py` applies to q_proj/k_proj (`LlamaModel.permute`, which turns HF's
  rotate-half RoPE layout into GGML's interleaved one) is undone; `qwen2` files are not permuted
  (llama.cpp runs them with NEOX-style RoPE, i.e. HF's layout).
- Tokenizer: a `tokenizers` byte-level BPE rebuilt from `tokenizer.ggml.tokens` / `merges` /
  `token_type`, with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (the split regexes
  of llama.cpp's `llama-vocab.cpp`, written as the original models' `tokenizer.json` express them),
  control tokens as special added tokens, user-defined ones as plain added tokens (as transformers'
  `convert_gguf_tokenizer` does); the chat template from `tokenizer.chat_template`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ignis.compiler.errors import CheckpointError, UnsupportedArchitectureError
from ignis.compiler.importers import Checkpoint, LazyTensors, naming_file
from ignis.runtime.errors import ConfigError, UnknownModelTypeError
from ignis.runtime.families.base import check_tensor_set, config_from_hf, get_family
from ignis.runtime.tokenizer import TokenizerSpec

# GGUF general.architecture -> HF model_type, and whether q/k rows are permuted (llama.cpp).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "qwen2": ("qwen2", False),
}

# GGUF `{arch}.<key>` -> HF config field (transformers' GGUF_CONFIG_MAPPING for llama/qwen2).
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}

# Byte-level pre-tokenization per `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp regexes).
_GPT2_PRES = ("gpt-2", "gpt2", "default", "mpt", "olmo", "jais")
_DIGITS_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # gguf-py raises ValueError / struct errors on malformed files
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(
            f"{path}: not a readable GGUF file ({size} bytes; truncated or corrupt? re-download it): {exc}"
        ) from exc


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key -> value (strings decoded, arrays as lists) for every metadata field."""
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        try:
            out[key] = f.contents()
        except Exception:  # an unparsable value is left out rather than failing the import
            continue
    return out


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` on q_proj / k_proj rows (weight [out, in] or bias [out]).

    llama.cpp reorders each head's rows from HF's [first half | second half] into interleaved
    pairs: w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2). The inverse reshapes to
    (n_head, d // 2, 2, ...) and swaps back. `num_heads` is the tensor's own head count (query heads
    for q, KV heads for k).
    """
    shape = weight.shape
    head_rows = shape[0] // num_heads
    return weight.reshape(num_heads, head_rows // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def config_dict_from_metadata(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    """An HF-style config dict (incl. model_type) from GGUF metadata.

    Raises:
        UnsupportedArchitectureError: architecture not in SUPPORTED_ARCHITECTURES, or a MoE file
            (`{arch}.expert_count` > 0, e.g. Mixtral stored as `llama`).
        CheckpointError: metadata that ignis cannot represent (e.g. a `rope_freqs` table or an
            unsupported rope scaling type).
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source}: GGUF architecture {arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if int(meta.get(f"{arch}.expert_count", 0) or 0) > 0:
        raise UnsupportedArchitectureError(
            f"{source}: GGUF architecture {arch!r} with {meta[f'{arch}.expert_count']} experts (MoE) "
            "is not supported"
        )
    model_type, _ = SUPPORTED_ARCHITECTURES[arch]
    cfg: dict[str, Any] = {"model_type": model_type}
    for key, hf in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in meta:
            cfg[hf] = meta[f"{arch}.{key}"]
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in meta:
        cfg["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
    if "head_dim" not in cfg and "hidden_size" in cfg and cfg.get("num_attention_heads"):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and rot != cfg.get("head_dim"):
        raise CheckpointError(
            f"{source}: partial rotary embedding ({arch}.rope.dimension_count={rot}, "
            f"head_dim={cfg.get('head_dim')}) is not supported for this family"
        )
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            f"{source}: the file carries a rope_freqs table (Llama 3.1-style scaled RoPE), which this "
            "importer cannot map back to rope_parameters; import the HF checkpoint instead"
        )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling == "linear":
            rope.update(rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
        else:
            raise CheckpointError(f"{source}: rope scaling type {scaling!r} is not supported (none, linear)")
    cfg["rope_parameters"] = rope
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[hf] = int(meta[f"tokenizer.ggml.{key}"])
    return cfg


def import_gguf(path: str | Path) -> Checkpoint:
    """Import a GGUF file of a supported architecture.

    Returns:
        A `Checkpoint` whose tensors are dequantized to float32 on access (HF names and layout);
        `metadata` holds every GGUF metadata key except the tokenizer arrays.

    Raises:
        CheckpointError: unreadable file; metadata ignis cannot represent; a tensor encoding gguf-py
            cannot decode (named with the tensor); two GGUF tensors mapping to one HF name.
        UnsupportedArchitectureError: another architecture, a MoE file, or a non-BPE vocabulary.
        ConfigError (ignis.runtime.errors): the metadata gives an invalid config.
        TensorSetError / TensorShapeError (ignis.runtime.errors): missing or unexpected tensors (all
            listed, unknown GGUF names as they are in the file), or a wrong shape.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from gguf.quants import dequantize

    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file")
    reader = _open(p)
    meta = read_metadata(reader)
    by_gguf_name = {t.name: t for t in reader.tensors}
    raw = config_dict_from_metadata(meta, set(by_gguf_name), str(p))
    try:
        config = config_from_hf(raw)
        family = get_family(config.model_type)
    except (ConfigError, UnknownModelTypeError) as exc:
        raise naming_file(exc, p) from exc
    arch = str(meta["general.architecture"])
    _, permuted = SUPPORTED_ARCHITECTURES[arch]

    # GGUF name -> HF name, by asking gguf-py's table for the GGUF name of every expected HF name.
    expected = family.tensor_shapes(config)
    arch_enum = {v: k for k, v in MODEL_ARCH_NAMES.items()}[arch]
    name_map = get_tensor_name_map(arch_enum, int(raw.get("num_hidden_layers", 0)))
    to_hf: dict[str, str] = {}
    for hf_name in [*expected, "lm_head.weight"]:
        g = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if g is not None:
            to_hf.setdefault(g, hf_name)

    shapes: dict[str, tuple[int, ...]] = {}
    encodings: dict[str, str] = {}
    source_of: dict[str, str] = {}
    for gname, t in by_gguf_name.items():
        hf = to_hf.get(gname, gname)
        canonical = family.map_hf_name(hf)
        if canonical is None:
            continue
        if canonical in source_of:
            raise CheckpointError(
                f"{p}: GGUF tensors {source_of[canonical]!r} and {gname!r} both map to {canonical!r}"
            )
        shapes[canonical] = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        encodings[canonical] = t.tensor_type.name
        source_of[canonical] = gname
    check_tensor_set(config, shapes, source=str(p))

    nh = int(raw["num_attention_heads"])
    nkv = int(raw["num_key_value_heads"])

    def load(name: str) -> torch.Tensor:
        t = by_gguf_name[source_of[name]]
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{p}: tensor {t.name!r} is stored as {t.tensor_type.name}, which gguf-py cannot dequantize"
            ) from exc
        arr = np.ascontiguousarray(data, dtype=np.float32).reshape(shapes[name])
        out = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            out = unpermute_qk(out, nh).contiguous()
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            out = unpermute_qk(out, nkv).contiguous()
        return out

    tokenizer = tokenizer_from_metadata(meta, str(p)) if "tokenizer.ggml.model" in meta else None
    info = {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")}
    return Checkpoint(
        config=config,
        tensors=LazyTensors(shapes, encodings, load),
        tokenizer=tokenizer,
        source=p,
        format="gguf",
        raw_config=raw,
        metadata=info,
    )


def tokenizer_from_metadata(meta: dict[str, Any], source: str = "GGUF") -> TokenizerSpec:
    """Build the tokenizer a GGUF file describes (byte-level BPE vocabularies, `tokenizer.ggml.model` "gpt2").

    Raises:
        UnsupportedArchitectureError: another tokenizer model (e.g. SentencePiece "llama") or an
            unknown `tokenizer.ggml.pre`.
        CheckpointError: the vocabulary or merges are missing.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedArchitectureError(
            f"{source}: GGUF tokenizer model {model!r} is not supported; supported: ['gpt2'] (byte-level BPE)"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CheckpointError(
            f"{source}: GGUF tokenizer lacks tokenizer.ggml.tokens or tokenizer.ggml.merges"
        )
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = meta.get("tokenizer.ggml.pre", "default")

    # Byte-level vocabularies spell every token in GPT-2's byte alphabet; a token that is not (a
    # llama.cpp-labelled control token with e.g. a raw space) is re-spelled from its UTF-8 bytes.
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    merge_pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: malformed BPE merge {m!r}")
        merge_pairs.append((parts[0], parts[1]))

    ignore_merges = pre in _LLAMA3_PRES
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merge_pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    if pre in _GPT2_PRES:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre in _QWEN2_PRES:
            tok.normalizer = normalizers.NFC()  # Qwen2's tokenizer.json normalizes to NFC
    else:
        known = sorted({*_GPT2_PRES, *_DIGITS_PRES, *_LLAMA3_PRES, *_QWEN2_PRES})
        raise UnsupportedArchitectureError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported; supported: {known}"
        )
    tok.decoder = decoders.ByteLevel()

    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, token_types, strict=False)
        if ty == _CONTROL and set(t) <= spelled
    ]
    if control:
        tok.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, token_types, strict=False)
        if ty == _USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    single, specials = "$A:0", []
    if add_bos and bos is not None:
        single = f"{bos}:0 {single}"
        specials.append((bos, int(meta["tokenizer.ggml.bos_token_id"])))
    if add_eos and eos is not None:
        single = f"{single} {eos}:0"
        specials.append((eos, int(meta["tokenizer.ggml.eos_token_id"])))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special = {
        name: value
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if (value := token_of(key)) is not None
    }
    eos_ids = [
        int(meta[f"tokenizer.ggml.{k}"])
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in meta
    ]
    template = meta.get("tokenizer.chat_template")
    return TokenizerSpec(
        tokenizer_json=tok.to_str(),
        chat_template=template if isinstance(template, str) else None,
        special_tokens=special,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        add_bos_token=add_bos,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 `encoder.py`)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "config_dict_from_metadata",
    "import_gguf",
    "read_metadata",
    "tokenizer_from_metadata",
    "unpermute_qk",
]
