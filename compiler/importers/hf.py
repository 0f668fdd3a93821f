"""Import an HF checkpoint folder: config.json, safetensors (single or sharded), tokenizer files.

Layout read (what `save_pretrained` writes and the Hub serves):
- `config.json`: parsed by the family registry's `config_from_hf` (dispatch on `model_type`).
- `model.safetensors`, or `model.safetensors.index.json` + the shards its `weight_map` names.
- `tokenizer.json` (the `tokenizers` serialization); `tokenizer_config.json` (special tokens,
  `chat_template` as a string or HF's list of named templates); `chat_template.jinja` and
  `additional_chat_templates/*.jinja` (transformers >= 4.43 / 5.x), which take precedence like in HF;
  legacy `special_tokens_map.json`; `generation_config.json` (extra end-of-generation ids).

Families whose `config.json` nests the text model (e.g. multimodal wrappers) must accept that dict in
their own `from_hf`; this importer stays generic.

Families with a `canonicalize_tensors` hook (base.py's `Family`; the MoE families, whose routed
experts come fused or one tensor per expert) see the checkpoint's tensor set rewritten into their
canonical layout before `check_tensor_set`: the hook runs on `meta` tensors to learn the canonical
names and shapes, and each rewritten tensor is read lazily from its sources (a fused expert stack is
stacked from its per-expert tensors when read, one stack at a time).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ignis.compiler.errors import CheckpointError
from ignis.compiler.importers import Checkpoint, LazyTensors, naming_file
from ignis.runtime.errors import ConfigError, UnknownModelTypeError
from ignis.runtime.families.base import Family, check_tensor_set, config_from_hf, get_family
from ignis.runtime.tokenizer import SPECIAL_TOKEN_NAMES, TokenizerSpec

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON: {exc}") from exc


def _safetensors_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, or the single file)."""
    index = folder / _INDEX
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: folder / str(fname) for name, fname in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise CheckpointError(
                f"{index}: shard file(s) {absent} named in the index are missing from {folder}"
            )
        return files
    single = folder / _SINGLE
    if single.is_file():
        return {"": single}
    others = sorted(folder.glob("*.safetensors"))
    if len(others) == 1:
        return {"": others[0]}
    has_bin = any(folder.glob("*.bin"))
    raise CheckpointError(
        f"{folder}: no {_SINGLE} or {_INDEX}"
        + (" (pickle .bin checkpoints are not read; convert them to safetensors)" if has_bin else "")
        + (
            f"; found several .safetensors files without an index: {[p.name for p in others]}"
            if others
            else ""
        )
    )


def _open_safetensors(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises SafetensorError / OSError
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc


def import_hf(path: str | Path, *, ignore_prefixes: tuple[str, ...] = ()) -> Checkpoint:
    """Import an HF checkpoint folder.

    Args:
        path: the folder.
        ignore_prefixes: canonical-name prefixes kept in `tensors` but not validated (e.g. "mtp.").

    Returns:
        A `Checkpoint` whose tensors are read lazily from the memory-mapped safetensors files, in
        their stored dtype, under canonical (HF) names after the family's `map_hf_name`.

    Raises:
        CheckpointError: missing/unreadable config.json, index, shard or safetensors file; a tensor
            the index lists but its shard lacks; two checkpoint names mapping to one name.
        ConfigError / UnknownModelTypeError (ignis.runtime.errors): the config is invalid or its
            model_type unsupported.
        TensorSetError / TensorShapeError (ignis.runtime.errors): missing or unexpected tensors
            (all listed), or a shape that does not match the config.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    raw = _read_json(config_path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    try:
        config = config_from_hf(raw)
        family = get_family(config.model_type)
    except (ConfigError, UnknownModelTypeError) as exc:
        raise naming_file(exc, config_path) from exc

    files = _safetensors_files(folder)
    handles: dict[Path, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    encodings: dict[str, str] = {}
    where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, checkpoint name)
    if "" in files:
        single = files[""]
        handles[single] = _open_safetensors(single)
        names = {name: single for name in handles[single].keys()}
    else:
        names = files
        held: dict[Path, set[str]] = {}
        for p in sorted(set(files.values())):
            handles[p] = _open_safetensors(p)
            held[p] = set(handles[p].keys())
        for name, p in files.items():
            if name not in held[p]:
                raise CheckpointError(f"{p}: tensor {name!r} listed in {_INDEX} is not in this shard")

    for name, p in names.items():
        canonical = family.map_hf_name(name)
        if canonical is None:
            continue
        if canonical in where:
            raise CheckpointError(
                f"{folder}: checkpoint tensors {where[canonical][1]!r} and {name!r} both map to {canonical!r}"
            )
        sl = handles[p].get_slice(name)
        shapes[canonical] = tuple(int(d) for d in sl.get_shape())
        encodings[canonical] = str(sl.get_dtype())
        where[canonical] = (p, name)

    # A tied checkpoint may still store the head; HF ignores it in favour of the embedding.
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in shapes:
        expected = family.tensor_shapes(config)
        if "lm_head.weight" not in expected:
            del shapes["lm_head.weight"], encodings["lm_head.weight"], where["lm_head.weight"]

    def load(name: str) -> torch.Tensor:
        p, ckpt_name = where[name]
        return handles[p].get_tensor(ckpt_name)

    stored = {name: encodings[name] for name in where}  # before any canonical rewrite
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    if family.canonicalize_tensors is not None:
        shapes, encodings, loaders = _canonicalize(family, config, shapes, encodings, load)

    check_tensor_set(config, shapes, source=str(folder), ignore_prefixes=ignore_prefixes)
    not_float = sorted(n for n, enc in stored.items() if not enc.startswith(("F", "BF")))
    if not_float:
        listed = "; ".join(f"{where[n][1]} ({stored[n]}) in {where[n][0].name}" for n in not_float)
        raise CheckpointError(
            f"{folder}: {len(not_float)} tensor(s) are not stored as floats: {listed}. Pre-quantized "
            "checkpoints (GPTQ, AWQ, ...) cannot be imported: use the bf16/f16/f32 release or a GGUF file"
        )

    def read(name: str) -> torch.Tensor:
        return loaders[name]() if name in loaders else load(name)

    tokenizer = read_hf_tokenizer(folder, raw)
    return Checkpoint(
        config=config,
        tensors=LazyTensors(shapes, encodings, read),
        tokenizer=tokenizer,
        source=folder,
        format="hf",
        raw_config=raw,
        metadata={"safetensors_files": sorted(str(p.name) for p in handles)},
    )


def _canonicalize(
    family: Family,
    config: Any,
    shapes: dict[str, tuple[int, ...]],
    encodings: dict[str, str],
    load: Callable[[str], torch.Tensor],
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, Callable[[], torch.Tensor]]]:
    """The family's canonical tensor set over a checkpoint's (names, shapes, lazy loaders).

    Returns:
        (canonical name -> shape, canonical name -> encoding, loaders of the names the hook created
        or rewrote; every other name is read as stored).
    """
    from ignis.compiler.build.convert import resolve_layout

    assert family.canonicalize_tensors is not None
    meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    canonical = family.canonicalize_tensors(config, meta)
    new_shapes = {n: tuple(int(d) for d in t.shape) for n, t in canonical.items()}
    derived = {n: s for n, s in new_shapes.items() if n not in meta or canonical[n] is not meta[n]}
    if not derived:
        return shapes, encodings, {}
    consumed = sorted(set(shapes) - set(canonical))
    loaders, _sources, unresolved, _unused = resolve_layout(derived, shapes, load)
    if unresolved:  # a rewrite resolve_layout does not know: run the hook on every consumed tensor

        def rewrite(name: str) -> torch.Tensor:
            assert family.canonicalize_tensors is not None
            return family.canonicalize_tensors(config, {n: load(n) for n in consumed})[name]

        for name in unresolved:
            loaders[name] = lambda n=name: rewrite(n)
    fallback = encodings[consumed[0]] if consumed else "?"  # a rewritten tensor: its sources' encoding
    new_encodings = {n: encodings[n] if n in encodings and n not in derived else fallback for n in new_shapes}
    return new_shapes, new_encodings, loaders


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_hf_tokenizer(folder: str | Path, config: dict[str, Any] | None = None) -> TokenizerSpec | None:
    """The tokenizer of an HF folder, or None when it has no `tokenizer.json`.

    Chat templates: `chat_template.jinja` (default) and `additional_chat_templates/NAME.jinja`
    override `tokenizer_config.json`'s `chat_template` (a string, or a list of {name, template}),
    as in transformers. End-of-generation ids: generation_config.json's `eos_token_id`, then
    config.json's, then the id of the tokenizer's `eos_token` (duplicates dropped, order kept).
    `tokenizer.json` is kept as is: `encode(add_special_tokens=True)` follows its post-processor
    (transformers' per-class `add_bos_token` overrides are not replicated; chat prompts are encoded
    without special tokens, the template writes them).

    Raises:
        CheckpointError: an unreadable JSON or template file.
    """
    folder = Path(folder)
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        return None
    try:
        tokenizer_json = tok_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{tok_path}: cannot read: {exc}") from exc
    tc_path = folder / "tokenizer_config.json"
    tc: dict[str, Any] = _read_json(tc_path) if tc_path.is_file() else {}
    if not isinstance(tc, dict):
        raise CheckpointError(f"{tc_path}: expected a JSON object")

    special: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = _token_str(tc.get(name))
        if value is not None:
            special[name] = value
    stm_path = folder / "special_tokens_map.json"
    if stm_path.is_file():
        stm = _read_json(stm_path)
        if isinstance(stm, dict):
            for name in SPECIAL_TOKEN_NAMES:
                value = _token_str(stm.get(name))
                if value is not None and name not in special:
                    special[name] = value

    default: str | None = None
    named: dict[str, str] = {}
    ct = tc.get("chat_template")
    if isinstance(ct, str):
        default = ct
    elif isinstance(ct, list):
        for entry in ct:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                named[entry["name"]] = str(entry.get("template", ""))
        default = named.pop("default", None)
    jinja = folder / "chat_template.jinja"
    try:
        if jinja.is_file():
            default = jinja.read_text(encoding="utf-8")
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                named[f.stem] = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{folder}: cannot read a chat template file: {exc}") from exc

    eos: list[int] = []
    gc_path = folder / "generation_config.json"
    if gc_path.is_file():
        gc = _read_json(gc_path)
        if isinstance(gc, dict):
            eos += _ids(gc.get("eos_token_id"))
    if config is not None:
        eos += _ids(config.get("eos_token_id"))
    if "eos_token" in special:
        from tokenizers import Tokenizer

        try:
            eos_id = Tokenizer.from_str(tokenizer_json).token_to_id(special["eos_token"])
        except Exception as exc:
            raise CheckpointError(f"{tok_path}: not a valid tokenizers JSON: {exc}") from exc
        if eos_id is not None:
            eos.append(int(eos_id))
    return TokenizerSpec(
        tokenizer_json=tokenizer_json,
        chat_template=default,
        named_chat_templates=named,
        special_tokens=special,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        add_bos_token=bool(tc.get("add_bos_token", False)),
    )


__all__ = ["import_hf", "read_hf_tokenizer"]
