"""Cheap expert misses: precomputed byte addresses, one batched DMA a group, preallocated routing tables.

The expert cache (`ignis.runtime.expert_cache`) copies the routed experts a verify round misses from
page-locked host memory into device slots. Through torch each part of each miss is a tensor copy
(reshape, view, ``copy_``, a stream context, an event): ~150-200 us of host time a miss, which
made the cached decode round host-bound. Here the host side of an expert and the device side of a
slot are fixed at load (the experts are views of the registered artifact mapping; the slots are
fixed buffers), so their raw addresses are computed once (`PartTable`) and a group's misses become
three arrays (destination addresses, source addresses, sizes) gathered with numpy and handed to
the CUDA driver in one call (`DriverBatchCopy`: ``cuMemcpyBatchAsync``, CUDA >= 12.8, else a loop
of ``cuMemcpyHtoDAsync``); one event marks the whole batch. ADR 0013 says why this and not a
gather kernel.

`HostMemmove` runs the same address plan with ``memmove`` on host memory: the CPU tests prove the
plan (every part lands in its slot, merged parts included) with it, end to end through the
executors.

`RoutingBuffers` holds the pinned host buffers of the MoE block's one host sync a layer (the routed
ids, device to host) and of the slot-id tables (host to device), allocated once and reused, so no
layer allocates or pins memory.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "IDS_WAITS",
    "SOURCE_ORDERS",
    "AddressBuffers",
    "DriverBatchCopy",
    "HostMemmove",
    "PartTable",
    "RoutingBuffers",
    "driver_batch_copy",
]

log = logging.getLogger("ignis.runtime.expert_transfer")

#: `RoutingBuffers`' ways of waiting for the routed ids.
IDS_WAITS = ("spin", "block", "hybrid")

# CUDA driver API constants (cuda.h)
_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3
#: `DriverBatchCopy.set_source_order` values -> CUmemcpySrcAccessOrder
SOURCE_ORDERS = {"stream": _CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, "any": _CU_MEMCPY_SRC_ACCESS_ORDER_ANY}
_CUDA_ERROR_INVALID_VALUE = 1
_CUDA_ERROR_NOT_SUPPORTED = 801
_CU_GET_PROC_ADDRESS_DEFAULT = 0
_BATCH_ABI_VERSION = 12080  # cuMemcpyBatchAsync as CUDA 12.8 declared it (with failIdx)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PartTable:
    """The raw addresses of one MoE layer's expert parts, host and device, fixed at load.

    Args:
        host: per expert, its stored tensors in a fixed part order (contiguous CPU tensors; the
            same sizes for every expert).
        slots: per slot, the tensors a miss copies those parts into, in the same order (contiguous,
            the same sizes).

    Parts that lie back to back for every expert on the host and for every slot on the device (a
    fused gate|up stack's gate and up halves, a q4 weight's codes and scales when stored together)
    are merged into one copy.

    Attributes:
        sizes: bytes of each (merged) part, uint64 [P].
        host_addr: uint64 [E, P]; slot_addr: uint64 [S, P].

    Raises:
        ValueError: a tensor that is not contiguous, parts whose sizes differ between experts or
            slots, or a slot part whose size differs from the host part's.
    """

    def __init__(self, host: Sequence[Sequence[torch.Tensor]], slots: Sequence[Sequence[torch.Tensor]]):
        if not host or not slots:
            raise ValueError("a part table needs at least one expert and one slot")
        sizes = [_nbytes(t) for t in host[0]]
        for what, rows in (("expert", host), ("slot", slots)):
            for i, parts in enumerate(rows):
                if [_nbytes(t) for t in parts] != sizes:
                    raise ValueError(f"{what} {i}'s part sizes differ from expert 0's ({sizes})")
                if not all(t.is_contiguous() for t in parts):
                    raise ValueError(f"{what} {i} has a part that is not contiguous")
        h = np.array([[t.data_ptr() for t in parts] for parts in host], dtype=np.uint64)
        d = np.array([[t.data_ptr() for t in parts] for parts in slots], dtype=np.uint64)
        size = np.array(sizes, dtype=np.uint64)
        # merge runs of parts adjacent on both sides, in host order of expert 0
        order = np.argsort(h[0], kind="stable")
        keep_h, keep_d, keep_s = [h[:, order[0]]], [d[:, order[0]]], [int(size[order[0]])]
        for p in order[1:]:
            end_h = keep_h[-1] + np.uint64(keep_s[-1])
            end_d = keep_d[-1] + np.uint64(keep_s[-1])
            if np.array_equal(end_h, h[:, p]) and np.array_equal(end_d, d[:, p]):
                keep_s[-1] += int(size[p])
                continue
            keep_h.append(h[:, p])
            keep_d.append(d[:, p])
            keep_s.append(int(size[p]))
        self.host_addr = np.stack(keep_h, axis=1)
        self.slot_addr = np.stack(keep_d, axis=1)
        self.sizes = np.array(keep_s, dtype=np.uint64)
        self.expert_bytes = int(size.sum())

    @property
    def num_parts(self) -> int:
        """Copies a miss takes (after merging)."""
        return int(self.sizes.shape[0])

    def gather_into(self, experts: Sequence[int], slots: Sequence[int], out: AddressBuffers) -> int:
        """`gather` written into `out`'s fixed arrays (grown when short) instead of new ones; returns
        the copies written (len(experts) * P): out.dst[:n], out.src[:n], out.sizes[:n]."""
        parts = self.num_parts
        n = len(experts) * parts
        out.reserve(n)
        e = np.fromiter(experts, dtype=np.intp, count=len(experts))
        s = np.fromiter(slots, dtype=np.intp, count=len(slots))
        np.take(self.host_addr, e, axis=0, out=out.src[:n].reshape(len(experts), parts))
        np.take(self.slot_addr, s, axis=0, out=out.dst[:n].reshape(len(experts), parts))
        out.sizes[:n].reshape(len(experts), parts)[:] = self.sizes
        return n

    def gather(
        self, experts: Sequence[int], slots: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(destination addresses, source addresses, sizes), uint64 [len(experts) * P] each, of the
        copies that bring expert experts[i] into slot slots[i] for every i."""
        e = np.asarray(experts, dtype=np.intp)
        s = np.asarray(slots, dtype=np.intp)
        src = np.ascontiguousarray(self.host_addr[e].reshape(-1))
        dst = np.ascontiguousarray(self.slot_addr[s].reshape(-1))
        sizes = np.tile(self.sizes, len(e))
        return dst, src, sizes


class AddressBuffers:
    """Fixed host arrays for one batched copy's operands (destination and source addresses, sizes:
    uint64 [capacity] each) and their raw addresses, reused call after call (a batch's arrays are
    read by the driver during the call), so no batch allocates arrays or builds ctypes views."""

    def __init__(self, capacity: int = 256) -> None:
        self.dst = self.src = self.sizes = np.zeros(0, dtype=np.uint64)
        self.dst_ptr = self.src_ptr = self.sizes_ptr = 0
        self.reserve(capacity)

    def reserve(self, n: int) -> None:
        """Room for at least `n` copies (the arrays replaced by larger ones when short)."""
        if n <= self.dst.shape[0]:
            return
        cap = max(n, 2 * self.dst.shape[0], 64)
        self.dst, self.src, self.sizes = (np.zeros(cap, dtype=np.uint64) for _ in range(3))
        self.dst_ptr, self.src_ptr, self.sizes_ptr = (a.ctypes.data for a in (self.dst, self.src, self.sizes))


class HostMemmove:
    """`DriverBatchCopy`'s interface over host memory: each copy is a ``memmove`` (the stream is
    ignored; done on return). For CPU slots (tests, and CPU executors that ask for it)."""

    name = "memmove"

    def copy(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        sizes: np.ndarray,
        stream: int | None,
        ptrs: tuple[int, int, int] | None = None,
    ) -> None:
        for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(d, s, n)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    # CUmemcpyAttributes (cuda.h, CUDA >= 12.8)
    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_BATCH_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # dsts (CUdeviceptr *)
    ctypes.c_void_p,  # srcs (CUdeviceptr *)
    ctypes.c_void_p,  # sizes (size_t *)
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # attrs (CUmemcpyAttributes *)
    ctypes.c_void_p,  # attrsIdxs (size_t *)
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # failIdx (size_t *)
    ctypes.c_void_p,  # hStream
)


class DriverBatchCopy:
    """Host-to-device copies of a batch through the CUDA driver API (ctypes on ``libcuda.so.1``),
    enqueued on a given stream; the host memory must be page-locked (registered) for the copies to
    be asynchronous DMAs.

    ``cuMemcpyBatchAsync`` (looked up with ``cuGetProcAddress`` at the CUDA 12.8 ABI, the one with
    ``failIdx``, which CUDA 13 drivers still serve) takes the whole batch in one call, with one
    attribute entry (source accessed in stream order). Where the driver lacks it, or refuses the
    batch as invalid or unsupported (logged once; the batch is then re-issued), each copy is one
    ``cuMemcpyHtoDAsync_v2``. The driver API is used rather than the runtime's so that an error
    is reported here and not left pending on the thread for torch's next launch check (ADR 0011).
    Calls act on the calling thread's current context: torch's primary context of the slots'
    device on the engine thread.

    Raises (constructor):
        OSError: no ``libcuda.so.1``.
        AttributeError: no ``cuMemcpyHtoDAsync_v2`` either.
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        one = lib.cuMemcpyHtoDAsync_v2
        one.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        one.restype = ctypes.c_int
        self._one = one
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorName.restype = ctypes.c_int
        self._batch = self._lookup_batch(lib)
        self._attrs = _MemcpyAttributes(srcAccessOrder=_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self.source_order = "stream"
        self._attr_idx = ctypes.c_size_t(0)
        self._fail_idx = ctypes.c_size_t(0)
        self._marshal()
        self.name = "cuMemcpyBatchAsync" if self._batch is not None else "cuMemcpyHtoDAsync"

    def set_source_order(self, order: str) -> None:
        """The batch's source access order: "stream" (the default: sources read in stream order) or
        "any" (``CU_MEMCPY_SRC_ACCESS_ORDER_ANY``: the driver may read a source out of stream order,
        also after the call returns; valid for the routed experts, read-only artifact bytes that no
        stream work writes). Process-wide (one `DriverBatchCopy` a process).

        Raises:
            ValueError: an unknown order.
        """
        if order not in SOURCE_ORDERS:
            raise ValueError(f"source order must be one of {sorted(SOURCE_ORDERS)}, got {order!r}")
        self._attrs.srcAccessOrder = SOURCE_ORDERS[order]
        self.source_order = order

    def _marshal(self) -> None:
        """The batch call's constant arguments as raw addresses, computed once (not per call)."""
        self._attrs_ptr = ctypes.addressof(self._attrs)
        self._attr_idx_ptr = ctypes.addressof(self._attr_idx)
        self._fail_idx_ptr = ctypes.addressof(self._fail_idx)
        self._handles: dict[int, ctypes.c_void_p] = {}

    @staticmethod
    def _lookup_batch(lib: Any) -> Any:
        ptr = ctypes.c_void_p()
        get = getattr(lib, "cuGetProcAddress_v2", None)
        if get is not None:
            get.argtypes = [
                ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_int),
            ]  # fmt: skip
            get.restype = ctypes.c_int
            status = ctypes.c_int(0)
            rc = get(
                b"cuMemcpyBatchAsync", ctypes.byref(ptr), _BATCH_ABI_VERSION, _CU_GET_PROC_ADDRESS_DEFAULT,
                ctypes.byref(status),
            )  # fmt: skip
        else:
            get = getattr(lib, "cuGetProcAddress", None)
            if get is None:
                return None
            get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]
            get.restype = ctypes.c_int
            rc = get(
                b"cuMemcpyBatchAsync", ctypes.byref(ptr), _BATCH_ABI_VERSION, _CU_GET_PROC_ADDRESS_DEFAULT
            )
        if rc != 0 or not ptr.value:
            return None
        return _BATCH_FN(ptr.value)

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {code}"

    def copy(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        sizes: np.ndarray,
        stream: int | None,
        ptrs: tuple[int, int, int] | None = None,
    ) -> None:
        """Enqueue copies src[i] -> dst[i] of sizes[i] bytes (uint64 arrays, C-contiguous) on
        `stream` (a CUstream handle; 0 or None: the legacy default stream). `ptrs`: the three
        arrays' addresses when the caller has them (`AddressBuffers`), else read from the arrays.

        Raises:
            RuntimeError: the driver refused a copy (its error name).
        """
        count = int(sizes.shape[0])
        if not count:
            return
        handle = self._handles.get(stream or 0)
        if handle is None:
            handle = self._handles[stream or 0] = ctypes.c_void_p(stream or 0)
        if self._batch is not None:
            d, s, z = ptrs if ptrs is not None else (dst.ctypes.data, src.ctypes.data, sizes.ctypes.data)
            rc = self._batch(
                d, s, z, count, self._attrs_ptr, self._attr_idx_ptr, 1, self._fail_idx_ptr, handle
            )
            if rc == 0:
                return
            if rc not in (_CUDA_ERROR_INVALID_VALUE, _CUDA_ERROR_NOT_SUPPORTED):
                raise RuntimeError(f"cuMemcpyBatchAsync failed: {self.error_name(rc)}")
            log.warning(
                "cuMemcpyBatchAsync refused a batch of %d copies (%s at copy %d): expert misses are "
                "copied one cuMemcpyHtoDAsync each from now on",
                count,
                self.error_name(rc),
                self._fail_idx.value,
            )
            self._batch = None
            self.name = "cuMemcpyHtoDAsync"
        one = self._one
        for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
            rc = one(d, s, n, handle)
            if rc != 0:
                raise RuntimeError(f"cuMemcpyHtoDAsync failed: {self.error_name(rc)}")


_driver: DriverBatchCopy | None = None
_driver_failed = False


def driver_batch_copy() -> DriverBatchCopy | None:
    """The process's `DriverBatchCopy`, or None where the driver library cannot serve it (logged once)."""
    global _driver, _driver_failed
    if _driver is None and not _driver_failed:
        try:
            _driver = DriverBatchCopy()
        except (OSError, AttributeError) as exc:
            _driver_failed = True
            log.warning("no CUDA driver copy calls (%s): expert misses are copied through torch", exc)
    return _driver


class RoutingBuffers:
    """Preallocated buffers of the grouped MoE block's host round trip (one per expert cache, shared
    by its layers): the routed ids to the host once a layer, and per group of experts the slot-id
    table to the device.

    Reuse is safe without events of its own: a layer's ids copy waits (host) for everything queued
    before it on the compute stream, so the previous layer's table uploads have run before any
    buffer is written again; within a layer each group writes its own region.

    How the host waits for the ids (`ids_wait`, `IDS_WAITS`): "spin" (CUDA's default for a context
    with fewer active contexts than cores: the thread polls, the lowest wake-up latency, one core
    busy for the whole wait), "block" (the event made with ``cudaEventBlockingSync``: the thread
    sleeps until the driver wakes it, no core spent, a wake-up latency added to each layer) or
    "hybrid" (``cudaEventQuery`` polled for `spin_us`, then the blocking wait: short waits as
    "spin", long ones, e.g. a wide round's copies, without burning the core).

    Raises (constructor):
        ValueError: an unknown `ids_wait`.
    """

    def __init__(self, device: torch.device, *, ids_wait: str = "spin", spin_us: float = 100.0) -> None:
        if ids_wait not in IDS_WAITS:
            raise ValueError(f"ids_wait must be one of {IDS_WAITS}, got {ids_wait!r}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.ids_wait = ids_wait
        self.spin_ns = int(spin_us * 1e3)
        self._ids_host: torch.Tensor | None = None  # pinned int64 [capacity]
        self._tables_host: torch.Tensor | None = None  # pinned int32 [groups, capacity]
        self._tables_dev: torch.Tensor | None = None  # int32 [groups, capacity]
        self._event: Any = None
        self._table: np.ndarray | None = None  # int32 [experts]: expert -> slot of the current group
        #: wall seconds the host spent waiting for the routed ids (every layer, since creation)
        self.wait_seconds = 0.0
        #: the cache's `ignis.runtime.host_breakdown.HostBreakdown`, or None (off)
        self.timer: Any = None

    def to_host(self, ids: torch.Tensor) -> np.ndarray:
        """`ids` (int64 [R, k], any device) as a host int64 array [R, k]: on CUDA one non-blocking copy
        into the pinned buffer and one host wait on its event (the layer's host sync). The array is
        valid until the next call."""
        timer = self.timer
        if timer is not None:  # a MoE layer's host part starts here: what ran before was its piece
            timer.layer()
            timer.lap("piece")
        if not ids.is_cuda:
            out = ids.to(torch.int64).numpy()
            if timer is not None:
                timer.lap("ids_copy")
            return out
        n = ids.numel()
        if self._ids_host is None or self._ids_host.numel() < n:
            self._ids_host = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True)
            self._event = torch.cuda.Event(blocking=self.ids_wait != "spin")
        buf = self._ids_host[:n].view(ids.shape)
        buf.copy_(ids, non_blocking=True)
        self._event.record()
        if timer is not None:
            timer.lap("ids_copy")
        t0 = time.perf_counter_ns()
        if self.ids_wait == "hybrid":
            event = self._event
            while not event.query() and time.perf_counter_ns() - t0 < self.spin_ns:
                pass
        self._event.synchronize()
        self.wait_seconds += (time.perf_counter_ns() - t0) * 1e-9
        if timer is not None:
            timer.lap("ids_wait")
        return buf.numpy()

    def slot_ids(
        self, group: int, num_experts: int, pairs: Sequence[tuple[int, int]], host_ids: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot id of every routed pair for one group: (on the device, on the host), int32 [R, k];
        -1 for pairs whose expert is not in `pairs` ((expert, slot) of the group). On CUDA the table
        is written into the group's pinned region and uploaded with one non-blocking copy into a
        fixed device buffer (valid until the next layer's call for the same group)."""
        table = self._table
        if table is None or table.shape[0] != num_experts:
            table = self._table = np.full(num_experts, -1, dtype=np.int32)
        e = np.fromiter((p[0] for p in pairs), dtype=np.intp, count=len(pairs))
        table[e] = np.fromiter((p[1] for p in pairs), dtype=np.int32, count=len(pairs))
        try:
            if not self.cuda:
                host = torch.from_numpy(table[host_ids])
                return host, host
            n = host_ids.size
            self._reserve(group + 1, n)
            assert self._tables_host is not None and self._tables_dev is not None
            region = self._tables_host[group, :n]
            np.take(table, host_ids.reshape(-1), out=region.numpy())
            dev = self._tables_dev[group, :n]
            dev.copy_(region, non_blocking=True)
            shape = host_ids.shape
            return dev.view(shape), region.view(shape)
        finally:
            table[e] = -1  # back to all -1 for the next group
            if self.timer is not None:
                self.timer.lap("table")

    def _reserve(self, groups: int, n: int) -> None:
        held = self._tables_host
        if held is not None and held.shape[0] >= groups and held.shape[1] >= n:
            return
        rows = max(groups, held.shape[0] if held is not None else 0, 2)
        cols = max(n, held.shape[1] if held is not None else 0, 64)
        # the old pinned buffer may still feed an upload queued by an earlier group of this layer:
        # torch's pinned allocator keeps it until that copy has run
        self._tables_host = torch.empty((rows, cols), dtype=torch.int32, pin_memory=True)
        self._tables_dev = torch.empty((rows, cols), dtype=torch.int32, device=self.device)
