"""Step 4: the MTP companion container `NAME_mtp.ninfer`, from the checkpoint's `mtp.*` tensors.

The multi-token-prediction head of the hybrid families (`mtp.fc`, its norms, `mtp_num_hidden_layers`
decoder layers, `mtp.norm`; `ignis.runtime.families.qwen3_5.mtp_tensor_shapes`) ships as its own
container beside the target's, so a deployment that never drafts with MTP does not map it, and the
runtime refuses `--spec-backend mtp` when it is absent. The head shares the target's embedding and
output head (not copied). Tensors keep their `mtp.*` names, routed experts in the family's canonical
layout, dtypes by the card profile's rule (`convert.storage_dtype`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ignis.compiler.build.convert import TensorJob, make_jobs, resolve_layout
from ignis.compiler.build.errors import MissingTensorsError

MTP_PREFIX = "mtp."


def has_mtp(names: Mapping[str, object] | set[str]) -> bool:
    """Whether a checkpoint's tensor names include an MTP head."""
    return any(n.startswith(MTP_PREFIX) for n in names)


def plan_mtp(
    config: object,
    shapes: Mapping[str, tuple[int, ...]],
    get: Callable[[str], torch.Tensor],
    *,
    linear_dtype: str,
    other_dtype: str,
    source: str,
) -> list[TensorJob]:
    """The companion's tensor jobs, or [] when the checkpoint has no `mtp.*` tensors.

    Args:
        config: the target's family config.
        shapes: checkpoint name -> shape (all tensors; only `mtp.*` are looked at).
        get: checkpoint name -> tensor.
        source: the checkpoint, for messages.

    Raises:
        MissingTensorsError: the family defines no MTP head, or `mtp.*` tensors are missing or
            unexpected (all listed).
        ConfigError: the runtime's MTP drafter cannot run the head (more than one MTP layer, dedicated
            MTP embeddings), from `ignis.runtime.drafters.mtp.check_mtp_fits`.
    """
    mtp_shapes = {n: s for n, s in shapes.items() if n.startswith(MTP_PREFIX)}
    if not mtp_shapes:
        return []
    from ignis.runtime.families.qwen3_5 import HybridConfig, mtp_tensor_shapes

    if not isinstance(config, HybridConfig):
        raise MissingTensorsError(
            f"{source}: the checkpoint has {len(mtp_shapes)} mtp.* tensor(s), but family "
            f"{getattr(config, 'model_type', '?')!r} defines no MTP head",
            missing=[],
            unexpected=sorted(mtp_shapes),
        )
    expected = mtp_tensor_shapes(config)
    if not expected:
        raise MissingTensorsError(
            f"{source}: the checkpoint has mtp.* tensors but mtp_num_hidden_layers is 0",
            missing=[],
            unexpected=sorted(mtp_shapes),
        )
    loaders, sources, missing, unused = resolve_layout(expected, mtp_shapes, get)
    if missing or unused:
        raise MissingTensorsError(
            f"{source}: MTP head: {len(missing)} missing tensor(s) {missing}; "
            f"{len(unused)} unexpected {unused}",
            missing=missing,
            unexpected=unused,
        )
    try:  # the runtime MTP drafter's own checks (one layer, no dedicated embeddings), on meta tensors
        from ignis.runtime.drafters.mtp import check_mtp_fits
    except ImportError:  # pragma: no cover - the drafter module ships with the runtime
        check_mtp_fits = None
    if check_mtp_fits is not None:
        check_mtp_fits(config, {n: torch.empty(s, device="meta") for n, s in expected.items()}, source=source)
    return make_jobs(expected, loaders, linear_dtype=linear_dtype, other_dtype=other_dtype, sources=sources)


__all__ = ["MTP_PREFIX", "has_mtp", "plan_mtp"]
