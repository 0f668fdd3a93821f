"""Write a small random drafter for a target HF checkpoint, in the public layout (issue 4).

    python -m ignis.tools.make_test_drafter --target CKPT --kind {dflash2,mtp} --out DIR [--seed N]

- `dflash2`: a drafter checkpoint folder as published (`config.json` in the DFlash2 layout with its
  `dflash_config` sub-dict, plus `model.safetensors` with the public tensor names), fitted to the
  target: hidden size, vocabulary, tapped layers spread over the target's depth, its RoPE base and
  context length. Small: few heads, a narrow MLP, a low selector rank (all overridable).
- `mtp`: a copy of the target checkpoint folder with random `mtp.*` tensors added (the head of the
  target's family, `mtp_tensor_shapes`; routed experts in the layout the target's trunk uses) and
  `mtp_num_hidden_layers: 1`, `mtp_use_dedicated_embeddings: false` set in the (text) config as the
  released Qwen3-Next / Qwen3.5 configs do (`num_nextn_predict_layers` too where the config has it).

Weights are drawn seeded: matrices N(0, 1/fan_in), (1 + w) norms near 0, plain norms near 1, the
DFlash2 conv's base kernel near identity (tap 0 ~ 1, later taps ~ 0.15), so outputs are O(1) and
greedy choices are not ties. They carry no knowledge: acceptance is near chance. The point is that
every drafter path (load, fit checks, context advance, proposals) runs without real drafter weights.

The API (`make_dflash2_drafter`, `make_mtp_drafter`, `random_dflash2_weights`, `small_dflash2_config`)
is usable from tests; the CLI is a thin click layer over it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import click
import torch

from ignis.runtime.drafters.common import read_hf_folder, safetensors_files
from ignis.runtime.drafters.dflash2 import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlash2Config,
    dflash2_tensor_shapes,
)
from ignis.runtime.errors import ConfigError, IgnisRuntimeError
from ignis.runtime.families.base import config_from_hf
from ignis.runtime.families.qwen3_5 import HybridConfig, mtp_tensor_shapes

__all__ = [
    "make_dflash2_drafter",
    "make_mtp_drafter",
    "random_dflash2_weights",
    "random_mtp_weights",
    "small_dflash2_config",
]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_STORED = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}  # safetensors dtype names


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the target's config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return raw


def _spread(num_layers: int, count: int) -> tuple[int, ...]:
    """`count` distinct layer indices spread evenly over 0..num_layers-1, the last layer included."""
    count = min(count, num_layers)
    if count == 1:
        return (num_layers - 1,)
    return tuple(sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)}))


def _group_size(hidden: int, preferred: int = 16) -> int:
    for g in range(min(preferred, hidden), 0, -1):
        if hidden % g == 0:
            return g
    return 1


def small_dflash2_config(
    target: Any,
    *,
    num_layers: int = 5,
    block_size: int = 8,
    sliding_window: int = 2048,
    num_taps: int = 5,
    intermediate_size: int | None = None,
    selector_rank: int | None = None,
    selector_top_k: int = 16,
    mask_token_id: int | None = None,
) -> DFlash2Config:
    """A small DFlash2 config fitted to a target family config (hidden size, vocabulary, depth).

    Heads: 4 query / 2 KV heads of hidden/4 for narrow targets (< 1024), else 32 / 8 of 128 (the
    public checkpoint's). Taps: `num_taps` layers spread over the target's depth.
    """
    h, depth, vocab = int(target.hidden_size), int(target.num_hidden_layers), int(target.vocab_size)
    if h < 1024:
        head_dim = max(2, (h // 4) // 2 * 2)
        heads, kv_heads = 4, 2
    else:
        head_dim, heads, kv_heads = 128, 32, 8
    theta = getattr(target, "rope_theta", None)
    if theta is None:
        theta = float((getattr(target, "rope_parameters", None) or {}).get("rope_theta", 1e7))
    return DFlash2Config(
        hidden_size=h,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or 2 * h,
        vocab_size=vocab,
        block_size=block_size,
        target_layer_ids=_spread(depth, num_taps),
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        layer_types=(SLIDING_ATTENTION if sliding_window else FULL_ATTENTION,) * num_layers,
        sliding_window=sliding_window or None,
        is_causal=False,
        conv_kernel_size=2,
        conv_group_size=_group_size(h),
        selector_rank=selector_rank or (256 if h >= 1024 else max(4, h // 4)),
        selector_top_k=min(selector_top_k, vocab),
        rms_norm_eps=float(getattr(target, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(target, "max_position_embeddings", 262144)),
        num_target_layers=depth,
    )


def _draw(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[-1]))


def random_dflash2_weights(config: DFlash2Config, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random float32 tensors for every name of `dflash2_tensor_shapes(config)` (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in dflash2_tensor_shapes(config).items():
        if name.endswith("base_kernel"):
            t = 0.15 + 0.05 * torch.randn(shape, generator=gen)
            t[:, 0] = 1.0 + 0.05 * torch.randn(shape[0], shape[2], generator=gen)
        elif name.endswith("kernel_projection.weight"):
            t = _draw(shape, gen, 0.05)
        elif name.endswith("_codebook"):
            t = torch.randn(shape, generator=gen) / config.selector_rank**0.25
        elif len(shape) == 1 and name.endswith("norm.weight"):  # plain-weight RMSNorms
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # biases
            t = 0.02 * torch.randn(shape, generator=gen)
        else:
            t = _draw(shape, gen)
        out[name] = t.float()
    return out


def random_mtp_weights(
    config: HybridConfig, *, expert_layout: str | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Seeded random float32 `mtp.*` tensors of the family's head (`mtp_tensor_shapes`)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    shapes = mtp_tensor_shapes(config, expert_layout=expert_layout)
    for name, shape in shapes.items():
        if len(shape) == 1:  # (1 + w) RMSNorms (stored zero-centred) and biases
            out[name] = 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = _draw(shape, gen)
    return out


def _prepare_out(out: Path, *, force: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"{out}: exists and is not a folder")
        if any(out.iterdir()):
            if not force:
                raise ConfigError(f"{out}: folder is not empty (pass --force to overwrite)")
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def make_dflash2_drafter(
    target: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    force: bool = False,
    **config_overrides: Any,
) -> DFlash2Config:
    """Write a random DFlash2 drafter folder for the target checkpoint folder `target`.

    Args:
        config_overrides: keyword arguments of `small_dflash2_config` (num_layers, block_size,
            sliding_window, num_taps, intermediate_size, selector_rank, selector_top_k, mask_token_id).

    Returns:
        The drafter's config (also written as `out/config.json`).

    Raises:
        ConfigError: unreadable target, unsupported target family, non-empty `out` without force.
    """
    from safetensors.torch import save_file

    tpath, opath = Path(target), Path(out)
    target_config = config_from_hf(_read_config(tpath))
    config = small_dflash2_config(target_config, **config_overrides)
    weights = random_dflash2_weights(config, seed=seed)
    _prepare_out(opath, force=force)
    torch_dtype = _DTYPES[dtype]
    save_file(
        {k: v.to(torch_dtype).contiguous() for k, v in weights.items()},
        str(opath / "model.safetensors"),
        metadata={"format": "pt"},
    )
    raw = config.to_hf()
    raw["dtype"] = dtype
    (opath / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    return config


def _set_mtp_fields(raw: dict[str, Any]) -> None:
    """mtp_num_hidden_layers: 1 and mtp_use_dedicated_embeddings: false in the text config (nested
    `text_config` when present), num_nextn_predict_layers: 1 wherever the config already has it."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    assert isinstance(text, dict)
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    for d in (raw, text):
        if "num_nextn_predict_layers" in d:
            d["num_nextn_predict_layers"] = 1


def make_mtp_drafter(
    target: str | Path, out: str | Path, *, seed: int = 0, force: bool = False
) -> HybridConfig:
    """Copy the target folder to `out` and add a random MTP head (module docstring).

    A single `model.safetensors` is rewritten with the head added; a sharded checkpoint gets one more
    shard (`model-mtp.safetensors`) entered in its index. Existing `mtp.*` tensors are replaced.

    Returns:
        The target's family config with mtp_num_hidden_layers = 1.

    Raises:
        ConfigError: unreadable target, a family without an MTP head, non-empty `out` without force.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    tpath, opath = Path(target), Path(out)
    raw = _read_config(tpath)
    config = config_from_hf(raw)
    if not isinstance(config, HybridConfig):
        raise ConfigError(
            f"{tpath}: model_type {raw.get('model_type')!r} has no MTP head; --kind mtp needs a hybrid "
            "target (qwen3_5, qwen3_5_moe, qwen3_next)"
        )
    config = dataclasses.replace(config, mtp_num_hidden_layers=1)
    files = safetensors_files(tpath)
    names: list[str] = []
    stored: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
            stored.extend(handle.get_slice(k).get_dtype() for k in handle.keys())
    layout = "fused" if any(n.endswith(".mlp.experts.gate_up_proj") for n in names) else "per_expert"
    float_dtypes = [_STORED[d] for d in stored if d in _STORED]
    store_dtype = float_dtypes[0] if float_dtypes else torch.float32  # the trunk's stored dtype
    drawn = random_mtp_weights(config, expert_layout=layout, seed=seed)
    head = {k: v.to(store_dtype).contiguous() for k, v in drawn.items()}
    if opath.resolve() == tpath.resolve():
        raise ConfigError(f"{opath}: --out must differ from --target")
    _prepare_out(opath, force=force)
    for item in tpath.iterdir():
        dest = opath / item.name
        if item.is_dir():
            shutil.copytree(item, dest)
        else:
            shutil.copy2(item, dest)
    index = opath / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = {k: v for k, v in data["weight_map"].items() if not k.startswith("mtp.")}
        save_file(head, str(opath / "model-mtp.safetensors"), metadata={"format": "pt"})
        weight_map |= {k: "model-mtp.safetensors" for k in head}
        data["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    else:
        _, tensors = read_hf_folder(opath)
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")} | head
        (single,) = safetensors_files(opath)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(single), metadata={"format": "pt"})
    _set_mtp_fields(raw)
    (opath / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    return config


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--target",
    "target",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The target's HF checkpoint folder (config.json + safetensors).",
)
@click.option("--kind", required=True, type=click.Choice(["dflash2", "mtp"]), help="Which drafter to write.")
@click.option(
    "--out", "out", required=True, type=click.Path(path_type=Path), help="Output folder (new or empty)."
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random weights.")
@click.option("--force", is_flag=True, help="Overwrite a non-empty output folder.")
@click.option(
    "--num-layers", default=5, show_default=True, type=click.IntRange(1), help="dflash2: drafter layers."
)
@click.option(
    "--block-size", default=8, show_default=True, type=click.IntRange(2), help="dflash2: block size."
)
@click.option(
    "--sliding-window",
    default=2048,
    show_default=True,
    type=click.IntRange(0),
    help="dflash2: sliding window (0: full attention).",
)
@click.option(
    "--dtype",
    default="bfloat16",
    show_default=True,
    type=click.Choice(sorted(_DTYPES)),
    help="dflash2: stored dtype (the public checkpoint is bfloat16).",
)
def main(
    target: Path,
    kind: str,
    out: Path,
    seed: int,
    force: bool,
    num_layers: int,
    block_size: int,
    sliding_window: int,
    dtype: str,
) -> None:
    """Write a small random drafter (--kind) for the --target checkpoint folder into --out."""
    try:
        if kind == "dflash2":
            c = make_dflash2_drafter(
                target,
                out,
                seed=seed,
                dtype=dtype,
                force=force,
                num_layers=num_layers,
                block_size=block_size,
                sliding_window=sliding_window,
            )
            click.echo(
                f"wrote a random dflash2 drafter to {out}: {c.num_hidden_layers} layers, "
                f"block {c.block_size}, taps {list(c.target_layer_ids)}, window {c.sliding_window}"
            )
        else:
            hc = make_mtp_drafter(target, out, seed=seed, force=force)
            click.echo(
                f"wrote {out}: a copy of {target} with a random MTP head ({len(mtp_tensor_shapes(hc))} "
                "mtp.* tensors)"
            )
    except (IgnisRuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


if __name__ == "__main__":
    main()
