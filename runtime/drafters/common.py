"""Pieces shared by the model drafters (`dflash2`, `mtp`): fit errors, checkpoint reading, RoPE, norms.

- The fit errors: what a build (or a runtime load) raises when a drafter does not fit its target.
  All derive from `DrafterFitError`, itself a `ConfigError` of the runtime's taxonomy
  (`ignis.runtime.errors`), so a caller may catch the family or the one kind it handles.
- `read_hf_folder`: config.json plus every tensor of an HF safetensors folder (single file or
  `model.safetensors.index.json` shards), the layout `save_pretrained` and the Hub use.
- RoPE (rotate-half, "neox" style, HF `rotate_half`) on the leading `rotary_dim` dims of each head,
  and the plain-weight RMSNorm of Qwen3 (`Qwen3RMSNorm`: normalize in float32, cast back, times weight).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ignis.runtime.errors import ConfigError, TensorSetError

__all__ = [
    "DrafterFitError",
    "HiddenSizeMismatchError",
    "MaskTokenOutOfRangeError",
    "MissingDrafterWeightsError",
    "TapLayerOutOfRangeError",
    "TargetDepthMismatchError",
    "VocabSizeMismatchError",
    "apply_rope",
    "read_hf_folder",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
]


class DrafterFitError(ConfigError):
    """A drafter does not fit its target model (base of the kinds below)."""


class HiddenSizeMismatchError(DrafterFitError):
    """The drafter's hidden size differs from the target's (it reads the target's hidden states and
    shares its embedding and head, so the two widths must be equal)."""


class TapLayerOutOfRangeError(DrafterFitError):
    """A tapped target layer (`target_layer_ids`) is past the target's last decoder layer."""


class TargetDepthMismatchError(DrafterFitError):
    """The drafter records the depth it was trained against (`num_target_layers`) and the target has
    another number of decoder layers."""


class MaskTokenOutOfRangeError(DrafterFitError):
    """`mask_token_id` is not a row of the target's embedding table."""


class VocabSizeMismatchError(DrafterFitError):
    """The drafter's vocabulary (its codebooks, its head) differs from the target's."""


class MissingDrafterWeightsError(DrafterFitError, TensorSetError):
    """The drafter's tensors are absent (e.g. `--spec-backend mtp` on a checkpoint without `mtp.*`)."""

    def __init__(self, message: str, *, missing: list[str], unexpected: list[str] | None = None) -> None:
        TensorSetError.__init__(self, message, missing=missing, unexpected=unexpected or [])


# ------------------------------------------------------------------------------------------ folders


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read JSON: {exc}") from exc


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder: the index's shards, or `model.safetensors`, or the one
    `*.safetensors` file there.

    Raises:
        ConfigError: no weights, an index without `weight_map`, or a shard the index names is missing.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: no 'weight_map' object")
        names = sorted({str(v) for v in weight_map.values()})
        absent = [n for n in names if not (folder / n).is_file()]
        if absent:
            raise ConfigError(f"{index}: shard file(s) {absent} named in the index are missing")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise ConfigError(
        f"{folder}: no model.safetensors or model.safetensors.index.json"
        + (f" (found {len(found)} loose .safetensors files)" if found else "")
    )


def read_hf_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read an HF checkpoint folder: (config.json as a dict, HF tensor name -> CPU tensor).

    Tensors keep their stored dtype (bf16 checkpoints stay bf16); callers cast on load.

    Raises:
        ConfigError: the folder, config.json or the weights are missing or unreadable.
    """
    from safetensors.torch import load_file

    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"{path}: not a checkpoint folder")
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise ConfigError(f"{path / 'config.json'}: not a JSON object")
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own SafetensorError / OSError
            raise ConfigError(f"{file}: cannot read safetensors: {exc}") from exc
    return config, tensors


def check_names(
    expected: Mapping[str, tuple[int, ...]], present: Mapping[str, torch.Tensor], *, source: str
) -> None:
    """Exactly the expected tensor names, with the expected shapes.

    Raises:
        TensorSetError: with all missing and unexpected names at once.
        TensorShapeError: the first tensor whose shape differs (both shapes named).
        ValueError: a non-floating tensor.
    """
    from ignis.runtime.errors import TensorShapeError

    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    if missing or unexpected:
        raise TensorSetError(
            f"{source}: {len(missing)} missing tensor(s) {missing}; "
            f"{len(unexpected)} unexpected {unexpected}",
            missing=missing,
            unexpected=unexpected,
        )
    for name, shape in expected.items():
        t = present[name]
        if tuple(t.shape) != tuple(shape):
            raise TensorShapeError(
                f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
            )
        if isinstance(t, torch.Tensor) and not t.is_floating_point():  # (a q4 `Q4Weight` passes)
            raise ValueError(f"{source}: tensor {name!r} has non-floating dtype {t.dtype}")


# --------------------------------------------------------------------------------------- math


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over the last dim: ``weight * (x / rms(x))``, normalized in float32 and cast
    back to x's dtype before the (plain, not 1 +) weight. HF: `Qwen3RMSNorm`."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [rotary_dim / 2]: ``theta ** (-2i / rotary_dim)`` (HF default RoPE)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [R, rotary_dim] in `dtype`, for int positions [R] (angles in float32, as HF)."""
    freqs = positions.to(inv_freq.device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of x [R, heads, head_dim]; cos/sin [R, rot]."""
    rot = cos.shape[-1]
    half = rot // 2
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return out if rot == x.shape[-1] else torch.cat((out, xp), dim=-1)
