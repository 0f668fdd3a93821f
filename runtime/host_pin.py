"""Page-locked host memory for the expert cache: routed experts registered with CUDA so that a miss is
one DMA from the host bytes straight into its device slot (`ignis.runtime.expert_cache`, "Copies").

A host-to-device copy from pageable memory goes through the driver's own bounce buffer at a fraction
of the link's speed; from page-locked (pinned or registered) memory it is a DMA at the link's rate
(the figures of both on the GPU host are in docs/perf, measured by tools/bench/expert_cache.py). The
routed experts are views of the memory-mapped artifact, pageable file-backed pages, so `HostPin`
registers the memory they live in (`HostPin.adopt`, one MoE layer at a time):

* memory that is page-locked already (torch's `pin_memory`, a range registered before) is used as is;
* bytes of a private file mapping (the artifact's: `NinferReader` maps copy-on-write) are mapped again,
  read-only and shared (``mmap(PROT_READ, MAP_SHARED)`` of the same file range, found through
  ``/proc/self/maps``), and the tensors become views of that mapping. A writable registration of a
  private (copy-on-write) mapping copies every page into anonymous memory (the experts' size again),
  and so may a read-only one (Linux unshares the page-cache pages of a copy-on-write mapping on a
  long-term pin), while the pages of a read-only shared mapping are the page cache's own. The range
  is prefetched (``MADV_WILLNEED``), populated (``MADV_POPULATE_READ``, Linux >= 5.14) and registered
  with ``CU_MEMHOSTREGISTER_READ_ONLY``. A device without read-only registration
  (``CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED`` 0) gets a copy instead: the ranges read
  into anonymous memory and registered there (the experts' size in RAM: `HostPin.copied`);
* other host memory (anonymous: an expert stack converted to the model's dtype) is copied into an
  anonymous mapping of its own and registered there (the experts' size in RAM again, `HostPin.copied_bytes`):
  registering it in place would lock pages other tensors share, and the driver refuses a copy from a
  range that straddles a registered region's edge.

Registrations cover whole pages, one per contiguous range (a layer's stacked experts are one or two
tensors in the artifact, so one or two registrations a layer), are made through the CUDA driver API
(``cuMemHostRegister``, ctypes on ``libcuda.so.1``: a failing runtime ``cudaHostRegister`` leaves its
error pending on the thread, and torch's next kernel-launch check raises it against an unrelated
kernel), and are undone by `HostPin.close` (or when the object is collected).

Refusals: no CUDA driver or context; a device without host registration
(``CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED``); more file-backed bytes to lock (or to copy) than
``MemAvailable`` (and the cgroup's ``memory.max``) less a margin (the page cache must hold the experts
locked beside everything else; files on tmpfs are resident already and need nothing more unless
copied); a mapped file that cannot be opened again (deleted, replaced or
truncated); a driver error (named, with ``RLIMIT_MEMLOCK``). Mode "auto" then undoes every
registration of the object and leaves the copies to the cache's staging ring (logged once with the
reason); mode "on" raises `ConfigError`.

Cost at load: the locked pages must be resident, so registering reads every expert byte that is not
in the page cache yet (at the disk's rate; a warm page cache or tmpfs: only the page-table walk) and
the driver pins each page; `HostPin.populate_seconds` and `HostPin.register_seconds` time both
(reported at load, `HostPin.describe`).
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import logging
import mmap
import os
import resource
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ignis.runtime.errors import ConfigError

__all__ = [
    "PIN_MODES",
    "HostPin",
    "PinRefused",
    "page_spans",
    "parse_pin_mode",
]

log = logging.getLogger("ignis.runtime.host_pin")

#: `--expert-cache-pin` values: "auto" registers when it can and falls back to the staging ring;
#: "on" refuses to load without registration; "off" never registers.
PIN_MODES = ("auto", "on", "off")

PAGE = mmap.PAGESIZE
_GIB = 1024**3

# CUDA driver API constants (cuda.h)
_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_MEMHOSTREGISTER_READ_ONLY = 0x08
_CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 99
_CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_MADV_POPULATE_READ = 22  # linux/mman.h (Linux >= 5.14); not in Python 3.11's mmap module
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")

_logged: set[str] = set()  # fallback reasons already logged at warning level (once a process)


def parse_pin_mode(value: object) -> str:
    """`--expert-cache-pin` / config key `expert_cache_pin`: "auto", "on" or "off" (case and blanks
    ignored; None is "auto"; YAML's bare on/off arrive as True/False).

    Raises:
        ConfigError: anything else.
    """
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    if text not in PIN_MODES:
        raise ConfigError(f"expert cache pin must be one of {', '.join(PIN_MODES)}, got {value!r}")
    return text


class PinRefused(Exception):
    """Registration is not possible here; the message says why."""


def page_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte spans [start, end) widened to whole pages and merged where they overlap or touch: the
    ascending, disjoint, page-aligned ranges that cover them (empty spans dropped)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((s // PAGE * PAGE, -(-e // PAGE) * PAGE) for s, e in spans if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _subtract(spans: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `spans` outside every range of `taken` (both ascending and disjoint)."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        cur = start
        for t0, t1 in taken:
            if t1 <= cur or t0 >= end:
                continue
            if t0 > cur:
                out.append((cur, t0))
            cur = max(cur, t1)
        if cur < end:
            out.append((cur, end))
    return out


@dataclass(frozen=True)
class _Vma:
    """One line of /proc/self/maps."""

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str

    @property
    def private_file(self) -> bool:
        return self.inode != 0 and self.path.startswith("/") and self.perms[3:4] == "p"


def _vmas() -> list[_Vma]:
    """The process's mappings, ascending."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            lo, hi = fields[0].split("-")
            path = fields[5] if len(fields) > 5 else ""
            out.append(_Vma(int(lo, 16), int(hi, 16), fields[1], int(fields[2], 16), int(fields[4]), path))
    return out


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _cgroup_limit() -> int | None:
    """The cgroup v2 memory.max of this process in bytes, None when unlimited or unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.strip().split(":", 2)[2] for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        with open(os.path.join("/sys/fs/cgroup", rel.lstrip("/"), "memory.max")) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding `path` (/proc/self/mounts, longest prefix)."""
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        pass
    return kind


def _human(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if abs(n) >= _GIB else f"{n / 2**20:.2f} MiB"


class _Driver:
    """The few CUDA driver API calls registration needs (ctypes on libcuda.so.1)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise PinRefused(f"the CUDA driver library cannot be loaded ({exc})") from None
        self._lib = lib
        register = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
        register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        register.restype = ctypes.c_int
        self._register = register
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuMemHostUnregister.restype = ctypes.c_int
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cuDeviceGetAttribute.restype = ctypes.c_int
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceGet.restype = ctypes.c_int
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxGetCurrent.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorName.restype = ctypes.c_int

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode()} ({code})"
        return f"CUresult {code}"

    def attribute(self, attr: int, ordinal: int) -> int:
        dev, value = ctypes.c_int(), ctypes.c_int()
        rc = self._lib.cuDeviceGet(ctypes.byref(dev), ordinal)
        if rc == 0:
            rc = self._lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev)
        if rc != 0:
            raise PinRefused(f"cuDeviceGetAttribute({attr}) failed: {self.error_name(rc)}")
        return int(value.value)

    def has_context(self) -> bool:
        ctx = ctypes.c_void_p()
        return self._lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and bool(ctx.value)

    def register(self, ptr: int, size: int, flags: int) -> int:
        return int(self._register(ctypes.c_void_p(ptr), size, flags))

    def unregister(self, ptr: int) -> int:
        return int(self._lib.cuMemHostUnregister(ctypes.c_void_p(ptr)))


#: releases that came due while a CUDA graph was being captured (a finalizer run by the garbage
#: collector mid-capture must not synchronize): done at the next `HostPin` load or close
_deferred: list[tuple[Any, ...]] = []


def _bytes_of(mm: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over a mapping's bytes (no copy; numpy's warning about a read-only buffer is
    silenced: these views are only read, or written once by `HostPin` before registration)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # a torch without CUDA
        return False


def _release(driver: _Driver | None, owned: list[int], held: list[Any], device: torch.device) -> None:
    """Undo registrations (after the device's queued work, which may still read them), then drop what
    kept the registered memory mapped: the read-only mappings (unmapped unless tensors still view
    them) and the tensors registered in place (held so their memory is not freed, and the address
    reused, while registered). Deferred while this thread captures a CUDA graph."""
    if owned and driver is not None and _capturing():
        _deferred.append((driver, list(owned), list(held), device))
        owned.clear()
        held.clear()
        return
    if owned and driver is not None:
        try:
            torch.cuda.synchronize(device)  # in-flight copies read these pages; binds the context too
        except Exception:  # a dead context: the registrations died with it
            pass
        for ptr in owned:
            rc = driver.unregister(ptr)
            if rc != 0:
                log.debug("cuMemHostUnregister(%#x): %s", ptr, driver.error_name(rc))
    owned.clear()
    for item in held:
        if isinstance(item, mmap.mmap):
            try:
                item.close()
            except BufferError:
                pass  # tensors still view it: unmapped with the last of them
    held.clear()


def _release_deferred() -> None:
    if _capturing():
        return
    while _deferred:
        _release(*_deferred.pop())


class HostPin:
    """The page-locked host memory of one expert cache (module docstring).

    Args:
        device: the cache's device; only CUDA registers (elsewhere copies are plain `copy_`).
        mode: "auto", "on" or "off" (`parse_pin_mode`).
        margin_bytes: host memory left unlocked beyond the experts (None: max(4 GiB, MemTotal / 16)).

    Attributes:
        mode: as given.
        reason: why the experts are not page-locked (None while they are, or before any layer).
        registered_bytes: bytes this object registered (whole pages).
        pinned_bytes: bytes of adopted tensors that are page-locked (registered here or before).
        regions: registrations made.
        populate_seconds, register_seconds: wall time spent faulting pages in and pinning them.

    Raises (constructor):
        ConfigError: a bad mode, or "on" for a device that is not CUDA.
    """

    def __init__(self, device: torch.device | str, mode: str = "auto", *, margin_bytes: int | None = None):
        self.device = torch.device(device)
        self.mode = parse_pin_mode(mode)
        if self.mode == "on" and self.device.type != "cuda":
            raise ConfigError(f"--expert-cache-pin on needs a CUDA device (the cache is on {self.device})")
        self.reason: str | None = None
        if self.mode == "off":
            self.reason = "--expert-cache-pin off"
        elif self.device.type != "cuda":
            self.reason = f"{self.device.type} device: copies are plain tensor copies"
        self.active = self.reason is None
        self.margin_bytes = margin_bytes
        self.registered_bytes = 0
        self.pinned_bytes = 0
        self.regions = 0
        self.populate_seconds = 0.0
        self.register_seconds = 0.0
        self.files: set[str] = set()
        #: the device cannot register read-only memory: mapped experts were copied into registered
        #: anonymous memory instead of being registered where they are
        self.copied = False
        #: bytes of anonymous host tensors copied into a registered mapping of their own (`_copy_in`)
        self.copied_bytes = 0
        self._driver: _Driver | None = None
        self._read_only = False
        self._ranges: list[tuple[int, int]] = []  # page-locked [start, end), ascending
        self._starts: list[int] = []
        self._owned: list[int] = []  # registration base addresses to unregister
        self._held: list[Any] = []  # read-only mmaps and tensors registered in place
        self._budget: tuple[int, int | None] | None = None  # (MemAvailable at first use, cgroup max)
        self._locked_file_bytes = 0  # file-backed bytes registered (not on tmpfs)
        self._finalizer = weakref.finalize(self, _release, None, self._owned, self._held, self.device)
        self._finalizer.atexit = False  # process exit unpins everything; no CUDA calls at shutdown

    # ---- queries ----
    @property
    def on(self) -> bool:
        """Whether adopted tensors are being page-locked (False after a fallback)."""
        return self.active

    def covers(self, t: torch.Tensor) -> bool:
        """Whether `t` (a CPU tensor) is contiguous and lies inside one page-locked range: a copy from
        it can be a DMA straight to the device."""
        if not self._starts or not t.is_contiguous():
            return False
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + t.numel() * t.element_size() <= self._ranges[i][1]

    def describe(self) -> str:
        """One line: which copy path the cache's misses take, and what registration cost."""
        if self.device.type != "cuda":
            return f"routed experts in host memory ({self.reason}): misses are copied into their slots"
        if not self.active or not self.pinned_bytes:
            return (
                f"routed experts not page-locked ({self.reason or 'nothing adopted'}): misses copy "
                "through the pinned staging ring (a CPU memcpy, then a DMA)"
            )
        how = (
            "copies in anonymous memory (no read-only registration here)"
            if self.copied
            else "read-only shared maps"
        )
        files = f" ({how} of {', '.join(sorted(self.files))})" if self.files else ""
        return (
            f"routed experts page-locked: {_human(self.pinned_bytes)} in {self.regions} registrations"
            f"{files}, {self.populate_seconds + self.register_seconds:.1f} s (populate "
            f"{self.populate_seconds:.1f} s, pin {self.register_seconds:.1f} s); misses copy by DMA "
            "straight into their slots"
        )

    # ---- adoption ----
    def expect(self, nbytes: int) -> None:
        """Check up front that `nbytes` of experts can be locked (the memory rule of `adopt`); falls
        back (or raises for "on") now rather than after some layers."""
        if not self.active:
            return
        try:
            self._check_memory(nbytes)
        except PinRefused as exc:
            self._fail(str(exc))

    def adopt(self, tensors: Sequence[Any]) -> list[Any]:
        """Page-lock the memory of `tensors` (CPU tensors; other items pass through) and return them,
        each either itself (page-locked in place, or not lockable) or a view of the same bytes in a
        read-only shared mapping (module docstring). After a refusal every registration of this
        object is undone and the tensors come back as given.

        Raises:
            ConfigError: mode "on" and registration is refused (the reason in the message).
        """
        items = list(tensors)
        if not self.active:
            return items
        try:
            return self._adopt(items)
        except PinRefused as exc:
            self._fail(str(exc))
        except (OSError, RuntimeError, ValueError) as exc:  # not foreseen: say so, keep serving
            log.warning("page-locking the routed experts failed", exc_info=True)
            self._fail(f"unexpected {type(exc).__name__}: {exc}")
        return items

    def adopt_experts(self, experts: Sequence[Any]) -> list[Any]:
        """`adopt` over every stored tensor of a layer's experts (`SwiGLUWeights`: dense weights or
        `Q4Weight` parts), returning experts of the same structure over the adopted tensors."""
        from ignis.runtime.linear import Q4Weight

        fields = ("gate", "up", "down", "gate_up")
        flat: list[torch.Tensor] = []
        for w in experts:
            for name in fields:
                v = getattr(w, name)
                if isinstance(v, Q4Weight):
                    flat += [v.packed, v.scales]
                elif isinstance(v, torch.Tensor):
                    flat.append(v)
        if not self.active:
            return list(experts)
        adopted = iter(self.adopt(flat))
        out = []
        for w in experts:
            values: dict[str, Any] = {}
            for name in fields:
                v = getattr(w, name)
                if isinstance(v, Q4Weight):
                    values[name] = dataclasses.replace(v, packed=next(adopted), scales=next(adopted))
                elif isinstance(v, torch.Tensor):
                    values[name] = next(adopted)
            out.append(dataclasses.replace(w, **values))
        return out

    def close(self) -> None:
        """Undo every registration (after the device's queued copies) and unmap the read-only maps no
        tensor views any more. Idempotent."""
        self._ranges.clear()
        self._starts.clear()
        self._finalizer()
        _release_deferred()
        if self.active:
            self.active, self.reason = False, "closed"

    # ---- internals ----
    def _fail(self, reason: str) -> None:
        if self.mode == "on":
            self.close()
            raise ConfigError(f"--expert-cache-pin on: cannot page-lock the routed experts: {reason}")
        self.close()
        self.active = False
        self.reason = reason
        self.pinned_bytes = self.registered_bytes = self.regions = 0
        level = logging.DEBUG if reason in _logged else logging.WARNING
        _logged.add(reason)
        log.log(level, "routed experts not page-locked (%s): expert misses copy through the pinned "
                "staging ring at the pageable rate", reason)  # fmt: skip

    def _prepare(self) -> _Driver:
        _release_deferred()
        if self._driver is not None:
            return self._driver
        driver = _Driver()
        ordinal = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(self.device)  # the runtime binds the primary context to this thread
        if not driver.has_context():
            raise PinRefused("no current CUDA context on the loading thread")
        if not driver.attribute(_CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, ordinal):
            raise PinRefused(f"cuda:{ordinal} does not support registering host memory")
        read_only = driver.attribute(_CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, ordinal)
        self._read_only = bool(read_only)
        self._driver = driver
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, driver, self._owned, self._held, self.device)
        self._finalizer.atexit = False
        return driver

    def _check_memory(self, new_file_bytes: int) -> None:
        if self._budget is None:
            self._budget = (_meminfo().get("MemAvailable", 0), _cgroup_limit())
        avail, cgroup = self._budget
        total = _meminfo().get("MemTotal", 0)
        margin = self.margin_bytes if self.margin_bytes is not None else max(4 * _GIB, total // 16)
        want = self._locked_file_bytes + new_file_bytes
        if want > avail - margin:
            raise PinRefused(
                f"locking {_human(want)} of file-backed experts in the page cache would leave less than "
                f"{_human(margin)} of the {_human(avail)} MemAvailable at load"
            )
        if cgroup is not None and want > cgroup - margin:
            raise PinRefused(
                f"locking {_human(want)} of file-backed experts exceeds the cgroup's memory.max "
                f"{_human(cgroup)} less {_human(margin)}"
            )

    def _adopt(self, items: list[Any]) -> list[Any]:
        driver = self._prepare()
        out = list(items)
        vmas = _vmas()
        starts = [v.start for v in vmas]
        files: dict[tuple[str, int], list[tuple[int, int, _Vma]]] = {}  # (path, inode) -> (i, file off)
        in_place: list[int] = []
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
                continue
            if not t.is_contiguous():
                continue  # copied through the staging ring (`covers` is False for it)
            if self.covers(t):
                self.pinned_bytes += t.numel() * t.element_size()
                continue
            if t.is_pinned():  # page-locked by its allocator or by someone else's registration
                storage = t.untyped_storage()  # the whole block: its other views are covered too
                self._add_range(storage.data_ptr(), storage.data_ptr() + storage.nbytes())
                self.pinned_bytes += t.numel() * t.element_size()
                continue
            ptr = t.data_ptr()
            j = bisect.bisect_right(starts, ptr) - 1
            vma = vmas[j] if j >= 0 and ptr < vmas[j].end else None
            if vma is not None and vma.private_file:
                files.setdefault((vma.path, vma.inode), []).append((i, ptr - vma.start + vma.offset, vma))
            else:
                in_place.append(i)
        for (path, inode), members in files.items():
            self._remap_file(driver, path, inode, members, items, out)
        if in_place:
            self._copy_in(driver, [(i, items[i]) for i in in_place], out)
        return out

    def _copy_in(self, driver: _Driver, members: list[tuple[int, torch.Tensor]], out: list[Any]) -> None:
        """Copy anonymous host tensors into one anonymous mapping of their own (each at a page
        boundary), register it, and put views of the copies into `out`. Registering the tensors in
        place would lock whole pages that other tensors of the same allocator share; a host copy from a
        range that straddles a registered region's edge is refused by the driver (invalid argument),
        so the neighbours' own copies would fail."""
        offsets, total = [], 0
        for _, t in members:
            offsets.append(total)
            total += -(-(t.numel() * t.element_size()) // PAGE) * PAGE
        try:
            mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError) as exc:
            raise PinRefused(f"cannot map {total} bytes for a page-locked copy: {exc}") from None
        self._held.append(mm)
        base = _bytes_of(mm)
        t0 = time.perf_counter()
        views = []
        for (i, t), off in zip(members, offsets, strict=True):
            n = t.numel() * t.element_size()
            view = base[off : off + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append((i, view))
        self.populate_seconds += time.perf_counter() - t0
        self.copied_bytes += total
        self._register(driver, base.data_ptr(), total)
        self._held.append(base)
        for i, view in views:
            out[i] = view
            self.pinned_bytes += view.numel() * view.element_size()

    def _flags(self) -> int:
        """PORTABLE, and READ_ONLY where the device has it (every copy only reads the host bytes)."""
        return _CU_MEMHOSTREGISTER_PORTABLE | (_CU_MEMHOSTREGISTER_READ_ONLY if self._read_only else 0)

    def _register(self, driver: _Driver, ptr: int, size: int) -> None:
        t0 = time.perf_counter()
        rc = driver.register(ptr, size, self._flags())
        self.register_seconds += time.perf_counter() - t0
        if rc == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            # someone else registered (part of) it: not ours to undo. Copies from it take the direct
            # path; a part the driver finds unregistered is staged by the driver itself (correct,
            # at the pageable rate)
            self._add_range(ptr, ptr + size)
            return
        if rc != 0:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else _human(soft)
            raise PinRefused(
                f"cuMemHostRegister of {_human(size)} failed: {driver.error_name(rc)} "
                f"(RLIMIT_MEMLOCK {limit})"
            )
        self._owned.append(ptr)
        self._add_range(ptr, ptr + size)
        self.registered_bytes += size
        self.regions += 1

    def _add_range(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ranges.insert(i, (start, end))

    def _remap_file(
        self,
        driver: _Driver,
        path: str,
        inode: int,
        members: list[tuple[int, int, _Vma]],
        items: list[Any],
        out: list[Any],
    ) -> None:
        """Map the file ranges of `members` read-only and shared, register them, and put views of them
        into `out` (checked against the bytes of `items`). A device that cannot register read-only
        memory gets a copy instead: the ranges read into anonymous memory, registered writable (the
        experts' size in RAM beside the page cache, which may then evict the file's pages)."""
        copy = not self._read_only
        nbytes = {i: items[i].numel() * items[i].element_size() for i, _, _ in members}
        spans = page_spans((off, off + nbytes[i]) for i, off, _ in members)
        on_memory_fs = _fs_type(path) in _MEMORY_FILESYSTEMS
        size = sum(e - s for s, e in spans)
        if copy or not on_memory_fs:
            self._check_memory(size)
        if copy:
            self.copied = True
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise PinRefused(f"cannot open the mapped file {path} again: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != inode or st.st_size < max(off + nbytes[i] for i, off, _ in members):
                raise PinRefused(f"{path} was replaced or truncated since it was mapped")
            bases: list[tuple[int, int, torch.Tensor]] = []
            for start, end in spans:
                length = min(end, st.st_size) - start  # mmap refuses a length past the file's end
                try:
                    if copy:
                        mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                    else:
                        mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
                except (OSError, ValueError) as exc:
                    raise PinRefused(f"cannot map {length} bytes for {path} at {start}: {exc}") from None
                self._held.append(mm)
                t0 = time.perf_counter()
                if copy:
                    with memoryview(mm) as view:
                        done = 0
                        while done < length:
                            n = os.preadv(fd, [view[done:]], start + done)
                            if n <= 0:
                                raise PinRefused(f"{path} ended at {start + done} while being read")
                            done += n
                else:
                    for advice in (mmap.MADV_WILLNEED, _MADV_POPULATE_READ):
                        try:
                            mm.madvise(advice)
                        except OSError:
                            pass  # an older kernel: the driver faults the pages in itself
                self.populate_seconds += time.perf_counter() - t0
                base = _bytes_of(mm)
                self._register(driver, base.data_ptr(), -(-length // PAGE) * PAGE)
                bases.append((start, start + length, base))
        finally:
            os.close(fd)
        if copy or not on_memory_fs:
            self._locked_file_bytes += size
        self.files.add(path)
        base_starts = [b[0] for b in bases]
        for i, off, _ in members:
            k = bisect.bisect_right(base_starts, off) - 1
            start, _end, base = bases[k]
            t = items[i]
            view = base[off - start : off - start + nbytes[i]].view(t.dtype).view(t.shape)
            a, b = view.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
            n = min(64, a.numel())
            if not (torch.equal(a[:n], b[:n]) and torch.equal(a[-n:], b[-n:])):
                raise PinRefused(f"{path} no longer holds the bytes mapped at offset {off}")
            out[i] = view
            self.pinned_bytes += nbytes[i]
