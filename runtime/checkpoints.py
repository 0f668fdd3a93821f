"""Prompt checkpoints: a lane's whole state at one position, captured and restored exactly.

A `LaneCheckpoint` holds what a lane needs to continue from position N as if it had been fed its
first N tokens from zero (DESIGN.md, "The second wave's parts"):

* the target's state (`model`, canonical names, the same for every executor of a family so a
  checkpoint captured by one executor restores into another, e.g. the eager and the static hybrid
  executors, or a snapshot file into a restarted server):

  - ``attn.keys`` / ``attn.values``: [attention_layers, kv_heads, N, head_dim], executor dtype
    (keys after q/k norm and RoPE);
  - ``gdn.conv``: [gdn_layers, conv_dim, kernel - 1], executor dtype, the last kernel - 1 conv inputs;
  - ``gdn.recurrent``: [gdn_layers, v_heads, k_head_dim, v_head_dim], float32;

* the drafter's context at N (`drafter`, from the drafter's `snapshot_lane`: DFlash2 its per-layer
  window keys/values, MTP its KV and the trunk's hidden state at N - 1, draft-model its own executor
  state, ngram nothing: its index is rebuilt from the tokens);
* optionally the logits of position N - 1 (float32 [vocab]) so that a prompt equal to the
  checkpoint's tokens takes its first output token without any forward.

Only committed state is captured (between steps, no pending forward), so a rejected draft never
reaches a checkpoint. Recurrent (Gated DeltaNet) state exists only at the position it was taken:
such a checkpoint restores at exactly N. Attention-only state (llama / qwen2) may also restore at any
M < N (`is_truncatable`): the first M keys and values are the state at M.

Executors are served by a registry keyed by executor class (`register_state_io`; the lookup walks the
class's MRO, so a subclass may register its own): `LlamaExecutor`, `HybridExecutor` (lane-owned
tensors), `StaticLlamaExecutor` and `StaticHybridExecutor` (pooled lane slots: restore copies into
the lane's slot). Capture
clones (device to device); `LaneCheckpoint.to` moves a checkpoint between the card and host RAM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ignis.runtime.errors import IgnisRuntimeError, StateError

__all__ = [
    "CheckpointError",
    "DrafterSnapshot",
    "LaneCheckpoint",
    "StateIO",
    "capture_lane",
    "capture_model_state",
    "model_state_io",
    "register_state_io",
    "restore_lane",
    "restore_model_state",
    "tensors_nbytes",
]


class CheckpointError(IgnisRuntimeError):
    """A checkpoint does not fit the executor or drafter it is restored into (shapes, dtypes, a
    position past the lane's capacity, a truncation of recurrent state), or the executor has no
    state capture registered."""


def tensors_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors' elements (their storage views only)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _move(tensors: Mapping[str, torch.Tensor], device: torch.device, pin: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if t.device == device:
            out[name] = t
            continue
        if device.type == "cpu" and pin and torch.cuda.is_available():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t)
            out[name] = host
        else:
            out[name] = t.to(device)
    return out


@dataclass
class DrafterSnapshot:
    """A drafter's context for one lane at a position (what `restore_lane` takes back).

    Attributes:
        num_tokens: the target position it belongs to (the checkpoint's N).
        tensors: name -> tensor, the drafter's own layout (its `snapshot_lane` docstring names them).
        meta: small integers the drafter needs besides the tensors; ``is_truncatable`` = 1 when the
            snapshot also restores at any M < num_tokens (`is_truncatable`).
    """

    num_tokens: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, int] = field(default_factory=dict)

    @property
    def is_truncatable(self) -> bool:
        """Whether the snapshot restores at any prefix of its position too (meta ``is_truncatable``)."""
        return bool(self.meta.get("is_truncatable", 0))

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return tensors_nbytes(self.tensors)

    def to(self, device: torch.device | str, *, pin: bool = True) -> DrafterSnapshot:
        """A copy on `device` (tensors already there are shared)."""
        return replace(self, tensors=_move(self.tensors, torch.device(device), pin))


@dataclass
class LaneCheckpoint:
    """A lane's state after its first `len(token_ids)` tokens (module docstring).

    Attributes:
        token_ids: the N tokens the state holds the effect of.
        model: the target's state, canonical names (module docstring).
        drafter: the drafter's context at N, or None (speculation off, or a stateless drafter).
        drafter_name: the drafter backend it belongs to ("off" without one).
        last_logits: float32 [vocab], the logits of position N - 1, or None.
        is_truncatable: the model state may be cut to any M < N (attention only).
        kind: where it was taken: "prompt" (end of a prompt), "opener" (a chat template's turn
            boundary inside a prompt) or "reply" (end of a reply).
    """

    token_ids: tuple[int, ...]
    model: dict[str, torch.Tensor]
    drafter: DrafterSnapshot | None = None
    drafter_name: str = "off"
    last_logits: torch.Tensor | None = None
    is_truncatable: bool = False
    kind: str = "prompt"

    @property
    def num_tokens(self) -> int:
        """N, the checkpoint's position."""
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes the checkpoint's tensors take (model, drafter, logits)."""
        n = tensors_nbytes(self.model)
        if self.drafter is not None:
            n += self.drafter.nbytes
        if self.last_logits is not None:
            n += self.last_logits.numel() * self.last_logits.element_size()
        return n

    @property
    def device(self) -> torch.device:
        """Where the model state lives (the first tensor's device; CPU when empty)."""
        for t in self.model.values():
            return t.device
        return torch.device("cpu")

    def to(self, device: torch.device | str, *, pin: bool = True) -> LaneCheckpoint:
        """A copy on `device` (a host copy goes to pinned memory when CUDA is present and `pin`)."""
        dev = torch.device(device)
        return replace(
            self,
            model=_move(self.model, dev, pin),
            drafter=None if self.drafter is None else self.drafter.to(dev, pin=pin),
            last_logits=None if self.last_logits is None else _move({"x": self.last_logits}, dev, pin)["x"],
        )


@dataclass(frozen=True)
class StateIO:
    """How to capture and restore one executor class's lane state.

    Attributes:
        capture: ``(executor, state) -> dict`` of canonical tensors (fresh copies) at the lane's
            committed length.
        restore: ``(executor, state, tensors, num_tokens)``: make the fresh lane `state` equal to
            one fed the checkpoint's first num_tokens tokens.
        is_truncatable: ``executor -> bool``: whether any M < N restores exactly (no recurrent state).
    """

    capture: Callable[[Any, Any], dict[str, torch.Tensor]]
    restore: Callable[[Any, Any, Mapping[str, torch.Tensor], int], None]
    is_truncatable: Callable[[Any], bool]


_STATE_IO: dict[type, StateIO] = {}


def register_state_io(executor_cls: type, io: StateIO) -> None:
    """Register the state capture of an executor class (subclasses inherit it unless they register)."""
    _STATE_IO[executor_cls] = io


def model_state_io(executor: Any) -> StateIO | None:
    """The `StateIO` of the executor's class (nearest in its MRO), or None."""
    _register_builtin()
    for cls in type(executor).__mro__:
        io = _STATE_IO.get(cls)
        if io is not None:
            return io
    return None


def _io(executor: Any) -> StateIO:
    io = model_state_io(executor)
    if io is None:
        raise CheckpointError(f"{type(executor).__name__} has no lane state capture (register_state_io)")
    return io


def capture_model_state(executor: Any, state: Any) -> dict[str, torch.Tensor]:
    """The lane's committed state as canonical tensors (copies on the executor's device).

    Raises:
        CheckpointError: no capture for this executor.
        StateError: the lane has a pending forward.
    """
    if getattr(state, "is_pending", False) or getattr(state, "_pending", None) is not None:
        raise StateError("a lane with a pending forward cannot be checkpointed (commit first)")
    return _io(executor).capture(executor, state)


def restore_model_state(
    executor: Any, state: Any, tensors: Mapping[str, torch.Tensor], num_tokens: int
) -> None:
    """Load a checkpoint's model state into a fresh lane, at `num_tokens` (<= its N; < N only for a
    truncatable state).

    Raises:
        CheckpointError: shapes or dtypes do not fit, or no capture for this executor.
        StateError: the lane is not fresh (committed tokens or a pending forward).
    """
    if state.num_tokens != 0 or getattr(state, "_pending", None) is not None:
        raise StateError(f"restore needs a fresh lane, this one holds {state.num_tokens} tokens")
    _io(executor).restore(executor, state, tensors, int(num_tokens))


def _expect(
    tensors: Mapping[str, torch.Tensor], name: str, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"checkpoint has no {name!r} tensor (have {sorted(tensors)})")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise CheckpointError(
            f"checkpoint tensor {name!r} is {t.dtype} {tuple(t.shape)}; "
            f"this executor needs {dtype} {tuple(shape)}"
        )
    return t


def _kv_shape(ex: Any, n_layers: int, n: int) -> tuple[int, int, int, int]:
    c = ex.config
    return (n_layers, c.num_key_value_heads, n, c.head_dim)


def _kv_len(tensors: Mapping[str, torch.Tensor]) -> int:
    keys = tensors.get("attn.keys")
    if keys is None:
        raise CheckpointError(f"checkpoint has no 'attn.keys' tensor (have {sorted(tensors)})")
    return int(keys.shape[2])


# ---- llama / qwen2 -------------------------------------------------------------------------------


def _llama_capture(ex: Any, state: Any) -> dict[str, torch.Tensor]:
    n = state.num_tokens
    kv = state.kv[:, :, :, :n]  # [L, 2, nkv, n, hd]
    return {"attn.keys": kv[:, 0].clone(), "attn.values": kv[:, 1].clone()}


def _llama_restore(ex: Any, state: Any, tensors: Mapping[str, torch.Tensor], n: int) -> None:
    c = ex.config
    full = _kv_len(tensors)
    if not 0 <= n <= full:
        raise CheckpointError(f"restore at {n} outside the checkpoint's 0..{full} tokens")
    shape = _kv_shape(ex, c.num_hidden_layers, full)
    keys = _expect(tensors, "attn.keys", shape, ex.dtype)
    values = _expect(tensors, "attn.values", shape, ex.dtype)
    ex._ensure_capacity(state, n)
    state.kv[:, 0, :, :n].copy_(keys[:, :, :n])
    state.kv[:, 1, :, :n].copy_(values[:, :, :n])
    state._num_tokens = n


# ---- llama / qwen2 (static, pooled lane slots) ---------------------------------------------------


def _static_llama_capture(ex: Any, state: Any) -> dict[str, torch.Tensor]:
    n, s = state.num_tokens, state.slot
    # pools [layers, lanes, capacity, kv_heads, head_dim] -> [layers, kv_heads, n, head_dim]
    return {
        "attn.keys": ex._keys[:, s, :n].transpose(1, 2).clone(),
        "attn.values": ex._values[:, s, :n].transpose(1, 2).clone(),
    }


def _static_llama_restore(ex: Any, state: Any, tensors: Mapping[str, torch.Tensor], n: int) -> None:
    full = _kv_len(tensors)
    if not 0 <= n <= full:
        raise CheckpointError(f"restore at {n} outside the checkpoint's 0..{full} tokens")
    if n > ex.max_context:
        raise CheckpointError(
            f"a checkpoint of {n} tokens does not fit the lanes' max_context {ex.max_context}"
        )
    shape = _kv_shape(ex, ex.config.num_hidden_layers, full)
    keys = _expect(tensors, "attn.keys", shape, ex.dtype)
    values = _expect(tensors, "attn.values", shape, ex.dtype)
    s = state.slot
    ex._keys[:, s, :n].copy_(keys[:, :, :n].transpose(1, 2))
    ex._values[:, s, :n].copy_(values[:, :, :n].transpose(1, 2))
    state._num_tokens = n


# ---- hybrid (eager) ------------------------------------------------------------------------------


def _hybrid_gdn_shapes(ex: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    c = ex.config
    g = len(ex._gdn_slot)
    conv = (g, c.linear_conv_dim, c.linear_conv_kernel_dim - 1)
    rec = (g, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    return conv, rec


def _hybrid_capture(ex: Any, state: Any) -> dict[str, torch.Tensor]:
    n = state.num_tokens
    out: dict[str, torch.Tensor] = {}
    c = ex.config
    if ex._attn_slot:
        out["attn.keys"] = torch.stack([k[:, :n] for k in state._keys])
        out["attn.values"] = torch.stack([v[:, :n] for v in state._values])
    else:
        out["attn.keys"] = torch.zeros(
            0, c.num_key_value_heads, n, c.head_dim, dtype=ex.dtype, device=ex.device
        )
        out["attn.values"] = out["attn.keys"].clone()
    if ex._gdn_slot:
        out["gdn.conv"] = torch.stack(list(state._conv))
        out["gdn.recurrent"] = torch.stack(list(state._rec))
    return out


def _hybrid_check(ex: Any, tensors: Mapping[str, torch.Tensor], n: int) -> tuple[torch.Tensor, ...]:
    full = _kv_len(tensors)
    if n != full and ex._gdn_slot:
        raise CheckpointError(
            f"a checkpoint of {full} tokens with recurrent (Gated DeltaNet) state restores at {full} only, "
            f"not {n}"
        )
    if not 0 <= n <= full:
        raise CheckpointError(f"restore at {n} outside the checkpoint's 0..{full} tokens")
    shape = _kv_shape(ex, len(ex._attn_slot), full)
    keys = _expect(tensors, "attn.keys", shape, ex.dtype)
    values = _expect(tensors, "attn.values", shape, ex.dtype)
    if not ex._gdn_slot:
        return keys, values
    conv_shape, rec_shape = _hybrid_gdn_shapes(ex)
    conv = _expect(tensors, "gdn.conv", conv_shape, ex.dtype)
    rec = _expect(tensors, "gdn.recurrent", rec_shape, torch.float32)
    return keys, values, conv, rec


def _hybrid_restore(ex: Any, state: Any, tensors: Mapping[str, torch.Tensor], n: int) -> None:
    parts = _hybrid_check(ex, tensors, n)
    keys, values = parts[0], parts[1]
    for slot in range(len(state._keys)):
        k, v = state._reserve_kv(slot, n)
        k[:, :n].copy_(keys[slot, :, :n])
        v[:, :n].copy_(values[slot, :, :n])
    if len(parts) == 4:
        conv, rec = parts[2], parts[3]
        for slot in range(len(state._conv)):
            state._conv[slot] = conv[slot].to(ex.device).clone()
            state._rec[slot] = rec[slot].to(ex.device).clone()
    state._num_tokens = n


def _hybrid_truncatable(ex: Any) -> bool:
    return not ex._gdn_slot


# ---- hybrid (static, pooled lane slots) -----------------------------------------------------------


def _static_capture(ex: Any, state: Any) -> dict[str, torch.Tensor]:
    n, s = state.num_tokens, state.slot
    c = ex.config
    out: dict[str, torch.Tensor] = {}
    if ex._attn_slot:  # pools [lanes, capacity, kv_heads, head_dim] -> [A, kv_heads, n, head_dim]
        out["attn.keys"] = torch.stack([k[s, :n].transpose(0, 1) for k in ex._keys])
        out["attn.values"] = torch.stack([v[s, :n].transpose(0, 1) for v in ex._values])
    else:
        out["attn.keys"] = torch.zeros(
            0, c.num_key_value_heads, n, c.head_dim, dtype=ex.dtype, device=ex.device
        )
        out["attn.values"] = out["attn.keys"].clone()
    if ex._gdn_slot:
        out["gdn.conv"] = ex._conv[:, s].clone()
        out["gdn.recurrent"] = ex._rec[:, s].clone()
    return out


def _static_restore(ex: Any, state: Any, tensors: Mapping[str, torch.Tensor], n: int) -> None:
    if n > ex.max_context:
        raise CheckpointError(
            f"a checkpoint of {n} tokens does not fit the lanes' max_context {ex.max_context}"
        )
    parts = _hybrid_check(ex, tensors, n)
    keys, values, s = parts[0], parts[1], state.slot
    for a in range(len(ex._keys)):
        ex._keys[a][s, :n].copy_(keys[a, :, :n].transpose(0, 1))
        ex._values[a][s, :n].copy_(values[a, :, :n].transpose(0, 1))
    if len(parts) == 4:
        ex._conv[:, s].copy_(parts[2])
        ex._rec[:, s].copy_(parts[3])
    state._num_tokens = n


@functools.cache
def _register_builtin() -> None:
    """Register the built-in executors (once, lazily: the families import torch models)."""
    from ignis.runtime.families.hybrid_executor import HybridExecutor
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
    from ignis.runtime.families.llama import LlamaExecutor
    from ignis.runtime.families.llama_graphs import StaticLlamaExecutor

    _STATE_IO.setdefault(LlamaExecutor, StateIO(_llama_capture, _llama_restore, lambda ex: True))
    _STATE_IO.setdefault(
        StaticLlamaExecutor, StateIO(_static_llama_capture, _static_llama_restore, lambda ex: True)
    )
    _STATE_IO.setdefault(HybridExecutor, StateIO(_hybrid_capture, _hybrid_restore, _hybrid_truncatable))
    _STATE_IO.setdefault(StaticHybridExecutor, StateIO(_static_capture, _static_restore, _hybrid_truncatable))


# ---- a whole lane: the target's state and the drafter's context ------------------------------------


def capture_lane(
    executor: Any,
    state: Any,
    token_ids: Sequence[int],
    *,
    drafter: Any = None,
    lane_id: int = -1,
    last_logits: torch.Tensor | None = None,
    kind: str = "prompt",
) -> LaneCheckpoint:
    """A checkpoint of a lane between steps: the executor's state (which must hold exactly
    len(token_ids) tokens) and, with a drafter, its `snapshot_lane` at that position.

    Args:
        token_ids: the tokens the lane's state holds the effect of.
        drafter: the engine's drafter, or None (speculation off).
        lane_id: the lane's id in the drafter.
        last_logits: float32 [vocab], logits of the last of token_ids' positions, or None.
        kind: "prompt", "opener" or "reply".

    Raises:
        CheckpointError: the state does not hold len(token_ids) tokens, or the drafter cannot be
            checkpointed; StateError: a pending forward.
    """
    tokens = tuple(int(t) for t in token_ids)
    if state.num_tokens != len(tokens):
        raise CheckpointError(f"the lane holds {state.num_tokens} tokens, the checkpoint names {len(tokens)}")
    io = _io(executor)
    model = capture_model_state(executor, state)
    snap = None
    name = "off"
    truncatable = io.is_truncatable(executor)
    if drafter is not None:
        name = str(drafter.name)
        if not getattr(drafter, "supports_checkpoints", False):
            raise CheckpointError(f"drafter {name!r} cannot be checkpointed")
        snap = drafter.snapshot_lane(lane_id, len(tokens))
        if snap is None:
            raise CheckpointError(f"drafter {name!r} returned no snapshot for lane {lane_id}")
        truncatable = truncatable and snap.is_truncatable
    logits = None if last_logits is None else last_logits.detach().reshape(-1).float().clone()
    return LaneCheckpoint(
        token_ids=tokens,
        model=model,
        drafter=snap,
        drafter_name=name,
        last_logits=logits,
        is_truncatable=truncatable,
        kind=kind,
    )


def restore_lane(
    executor: Any,
    state: Any,
    checkpoint: LaneCheckpoint,
    num_tokens: int,
    prompt_token_ids: Sequence[int],
    *,
    drafter: Any = None,
    lane_id: int = -1,
) -> None:
    """Make a fresh lane (and the drafter's lane `lane_id`) continue from `checkpoint` at num_tokens
    (its N, or M < N for a truncatable one): the model state is copied into the lane's own buffers
    (the checkpoint stays as it is) and the drafter gets `restore_lane` in place of `start_lane`.

    Raises:
        CheckpointError: the checkpoint does not fit the executor or drafter, its tokens are not a
            prefix of the prompt up to num_tokens, or it belongs to another drafter.
    """
    prompt = tuple(int(t) for t in prompt_token_ids)
    n = int(num_tokens)
    if not 0 < n <= checkpoint.num_tokens or prompt[:n] != checkpoint.token_ids[:n]:
        raise CheckpointError(
            f"checkpoint of {checkpoint.num_tokens} tokens does not start the prompt at {n}"
        )
    if n < checkpoint.num_tokens and not checkpoint.is_truncatable:
        raise CheckpointError(
            f"checkpoint of {checkpoint.num_tokens} tokens restores at its position only, not {n}"
        )
    name = "off" if drafter is None else str(drafter.name)
    if name != checkpoint.drafter_name:
        raise CheckpointError(
            f"checkpoint taken with drafter {checkpoint.drafter_name!r}, the engine runs {name!r}"
        )
    restore_model_state(executor, state, checkpoint.model, n)
    if drafter is not None:
        assert checkpoint.drafter is not None
        snap = checkpoint.drafter if n == checkpoint.num_tokens else replace(checkpoint.drafter, num_tokens=n)
        drafter.restore_lane(lane_id, prompt, snap)
