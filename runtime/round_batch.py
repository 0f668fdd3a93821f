"""The verify round's host<->device traffic, batched over lanes (`ignis.runtime.engine`'s `_round`).

A round moves token ids across the host/device boundary twice, each time in ONE copy for every lane:

1. **Columns in** (`RoundColumns.build`): every lane's column [anchor, d_1..d_k] is laid out in one
   flat int64 list on the host and copied to the device at once (from page-locked memory without a
   host sync on CUDA, as vLLM's `async_tensor_h2d`); each lane's column is a view of it. Drafts a
   drafter returned on the host (ngram, replay, the draft lists of a CPU drafter) are checked there
   (ids in [0, vocab)) before anything runs. Drafts a drafter returned on the device (DFlash2 and MTP
   on CUDA) are copied into the flat tensor on the device, clamped into [0, vocab) so that the
   forward can never index outside the embedding, and checked after the forward, in copy 2: there is
   no host sync between the drafter's proposal and the verify forward.
2. **Results out** (`round_host_ids`): the argmax of every greedy lane's rows, the device drafts and
   the sampled lanes' runs, in one device->host copy after the forward. When the lanes' logits are
   row blocks of one buffer (the static, graphed executors return views of their round's output
   buffer) a single argmax runs over the rows they span instead of one per lane. A prefill's first
   tokens (lanes without penalties or a grammar, greedy or sampled) come the same way.

`LaneTokens` gives a drafter a lane's prompt + output without copying the context every round.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from ignis.runtime.drafters.base import DrafterError, DraftProposal

__all__ = ["HostKnownColumns", "InRangeColumns", "LaneTokens", "RoundColumns", "device_ids", "round_host_ids"]


class LaneTokens(Sequence[int]):
    """A read-only view of a lane's context: its prompt (a tuple) followed by its output (the engine's
    list, which grows between rounds). Indexing, slicing (a tuple, as slicing the concatenation would
    give), `len`, iteration and `==` (against any sequence of the same ids) read both without building
    the concatenation (`DraftRequest.token_ids`: O(1) to make, O(slice) to slice). It follows the lane:
    a caller keeping the context past the call copies it (`tuple(view)`)."""

    __slots__ = ("_out", "_prompt")

    def __init__(self, prompt: tuple[int, ...], output: list[int]) -> None:
        self._prompt = prompt
        self._out = output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._out)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        p = self._prompt
        n = len(p)
        if isinstance(index, slice):
            start, stop, step = index.indices(n + len(self._out))
            if step != 1:
                return tuple(self[i] for i in range(start, stop, step))
            if stop <= start:
                return ()
            if start >= n:
                return tuple(self._out[start - n : stop - n])
            if stop <= n:
                return p[start:stop]
            return (*p[start:], *self._out[: stop - n])
        i = index.__index__()
        if i < 0:
            i += n + len(self._out)
            if i < 0:
                raise IndexError("lane token index out of range")
        return p[i] if i < n else self._out[i - n]

    def __iter__(self) -> Iterator[int]:
        yield from self._prompt
        yield from self._out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LaneTokens | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # it changes as the lane's output grows

    def __repr__(self) -> str:
        return f"LaneTokens({len(self._prompt)} prompt + {len(self._out)} output tokens)"


def device_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    """int64 [len(ids)] on `device`. The host tensor wraps an `array('q')` of the ids (a fraction of
    `torch.tensor(list)`'s cost); on CUDA it is copied to page-locked memory and sent without waiting
    for the copy (the forward that reads it is ordered after it on the stream; the caching host
    allocator keeps the page-locked block until the copy is done).

    Raises:
        OverflowError: an id outside int64.
    """
    if not ids:
        return torch.empty(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(array("q", ids), dtype=torch.int64)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class HostKnownColumns(list):  # type: ignore[type-arg]
    """A round's columns (per lane an int64 [1 + k_i] tensor on the device) that also carry their
    values on the host: `host` per lane [anchor, d_1..d_k] as ints, equal to the device tensors'
    values (the engine laid them out from those ints). A static executor checks token ids on `host`
    (`static_rounds.host_columns`) instead of reading the device: no sync before the round."""

    host: list[list[int]]

    def __init__(self, columns: Sequence[torch.Tensor], host: list[list[int]]) -> None:
        super().__init__(columns)
        self.host = host


class InRangeColumns(list):  # type: ignore[type-arg]
    """A round's columns (per lane an int64 [n_i] tensor on the device) whose ids lie in [0, vocab) by
    construction: the argmax rows of the same executor's logits (`ignis.runtime.async_rounds`). An
    executor skips their token-id range check (`static_rounds.host_columns` returns them as they are),
    so the forward reads nothing from the device."""

    in_range = True


@dataclass
class RoundColumns:
    """Every lane's verify columns for one round (module docstring, 1).

    Attributes:
        columns: per lane int64 [1 + k_i] on the device: [anchor, d_1..d_k] (views of one tensor); a
            `HostKnownColumns` when every draft came from the host.
        host_drafts: per lane its drafts on the host, or None for drafts left on the device (not
            checked yet: `device_drafts`).
        device_drafts: (lane index, the drafter's tensor [k] as returned) for drafts on the device;
            they reach the forward clamped into [0, vocab) and are checked by `round_host_ids`.
    """

    columns: list[torch.Tensor]
    host_drafts: list[list[int] | None]
    device_drafts: list[tuple[int, torch.Tensor]]

    @classmethod
    def build(
        cls,
        anchor_ids: Sequence[int],
        proposals: Sequence[DraftProposal],
        device: torch.device,
        vocab_size: int | None,
        *,
        lane_ids: Sequence[int],
        drafter_name: str,
    ) -> RoundColumns:
        """Lay out and copy the round's columns (one host->device copy; module docstring, 1).

        Raises:
            DrafterError: a host draft id outside [0, vocab_size) (the message names the lane).
        """
        flat: list[int] = []
        sizes: list[int] = []
        host: list[list[int] | None] = []
        on_device: list[tuple[int, torch.Tensor]] = []
        at: list[int] = []  # where each device lane's drafts go in `flat`
        for i, (anchor, prop) in enumerate(zip(anchor_ids, proposals, strict=True)):
            ids = prop.draft_token_ids
            k = ids.numel()
            flat.append(anchor)
            sizes.append(1 + k)
            if k == 0:
                host.append([])
            elif ids.device.type == "cpu":
                drafts = ids.tolist()
                if vocab_size is not None and (min(drafts) < 0 or max(drafts) >= vocab_size):
                    raise DrafterError(
                        f"drafter {drafter_name!r}, lane {lane_ids[i]}: draft ids {drafts} outside "
                        f"[0, {vocab_size})"
                    )
                host.append(drafts)
                flat.extend(drafts)
            else:
                host.append(None)
                on_device.append((i, ids))
                at.append(len(flat))
                flat.extend([0] * k)
        t = device_ids(flat, device)
        for (_, ids), a in zip(on_device, at, strict=True):
            t[a : a + ids.numel()] = ids  # device to device, no sync
        if on_device and vocab_size is not None:
            t.clamp_(0, vocab_size - 1)  # the forward never indexes outside the vocabulary
        columns: list[torch.Tensor] = [t] if len(sizes) == 1 else list(t.split(sizes))
        if not on_device:  # every value known here: the executor's checks need not read the device
            starts = itertools.accumulate(sizes, initial=0)
            host_ids = [flat[a : a + n] for a, n in zip(starts, sizes, strict=False)]
            columns = HostKnownColumns(columns, host_ids)
        return cls(columns, host, on_device)


def shared_row_span(logits: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """When every tensor is a 2-D block of whole rows of one row-major buffer (the same storage, row
    stride = vocab, unit column stride): a 2-D view over the rows they span and each block's first row
    in it; otherwise None."""
    t0 = logits[0]
    if t0.dim() != 2:
        return None
    v = t0.shape[1]
    ptr = t0.untyped_storage().data_ptr()
    offs = []
    for t in logits:
        if t.dim() != 2 or t.shape[1] != v or t.stride() != (v, 1) or t.dtype != t0.dtype:
            return None
        if t.untyped_storage().data_ptr() != ptr:
            return None
        offs.append(t.storage_offset())
    lo = min(offs)
    if any((o - lo) % v for o in offs):
        return None
    starts = [(o - lo) // v for o in offs]
    rows = max(s + int(t.shape[0]) for s, t in zip(starts, logits, strict=True))
    return t0.as_strided((rows, v), (v, 1), lo), starts


def round_host_ids(
    logits: Sequence[torch.Tensor],
    greedy: Sequence[int],
    tensors: Sequence[torch.Tensor] = (),
) -> tuple[dict[int, list[int]], list[list[int]]]:
    """The greedy lanes' argmax rows and some integer tensors (device drafts, sampled runs) on the
    host, in one device->host copy (module docstring, 2).

    Args:
        logits: per lane of the round float [k_i + 1, vocab] (as the acceptance sees them).
        greedy: indices of the lanes accepted greedily.
        tensors: integer tensors of any shape, on the logits' device, each wanted as a flat list.

    Returns:
        (lane index -> argmax of each of its rows, each of `tensors` flattened, in order).
    """
    parts: list[torch.Tensor] = []
    span = shared_row_span([logits[i] for i in greedy]) if len(greedy) > 1 else None
    if span is not None:
        view, starts = span
        parts.append(view.argmax(dim=-1))
    else:
        parts.extend(logits[i].argmax(dim=-1) for i in greedy)
    parts.extend(t.reshape(-1) for t in tensors)
    if not parts:
        return {}, []
    flat = (torch.cat([p.to(torch.int64) for p in parts]) if len(parts) > 1 else parts[0]).tolist()
    targets: dict[int, list[int]] = {}
    pos = 0
    if span is not None:
        for i, s in zip(greedy, starts, strict=True):
            targets[i] = flat[s : s + int(logits[i].shape[0])]
        pos = int(span[0].shape[0])
    else:
        for i in greedy:
            n = int(logits[i].shape[0])
            targets[i] = flat[pos : pos + n]
            pos += n
    out: list[list[int]] = []
    for t in tensors:
        n = t.numel()
        out.append(flat[pos : pos + n])
        pos += n
    return targets, out
