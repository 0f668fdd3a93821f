"""The lean TVM runtime: load compiled modules without the TVM compiler (no ``import tvm``).

A deployment host needs only the ``tvm_ffi`` package (apache-tvm-ffi) and TVM's runtime
libraries, ``libtvm_runtime.so`` and, for CUDA modules, ``libtvm_runtime_cuda.so`` (about 4 MB,
from the apache-tvm wheel's ``tvm/lib``). They are loaded once with ``RTLD_GLOBAL`` so that
exported modules resolve their symbols; then ``tvm_ffi.load_module`` loads a module and torch
tensors are passed straight in (DLPack). Run CUDA calls under :func:`torch_stream` to launch on
torch's current stream (and to be captured by CUDA graphs).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ignis.runtime.errors import IgnisRuntimeError

__all__ = [
    "TvmRuntimeError",
    "capture",
    "find_runtime_lib_dir",
    "gc_paused",
    "load_module",
    "load_tvm_runtime",
    "torch_stream",
]

RUNTIME_LIB_DIR_ENV = "IGNIS_TVM_LIB_DIR"
_CORE_LIB = "libtvm_runtime.so"
_CUDA_LIB = "libtvm_runtime_cuda.so"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class TvmRuntimeError(IgnisRuntimeError):
    """The TVM runtime libraries or a compiled module could not be loaded."""


def find_runtime_lib_dir() -> Path:
    """Where ``libtvm_runtime*.so`` live: ``$IGNIS_TVM_LIB_DIR``, else the installed tvm package.

    The package is located without importing it (importing tvm pulls in the compiler).
    """
    env = os.environ.get(RUNTIME_LIB_DIR_ENV)
    if env:
        path = Path(env)
        if not (path / _CORE_LIB).exists():
            raise TvmRuntimeError(f"{RUNTIME_LIB_DIR_ENV}={env} holds no {_CORE_LIB}")
        return path
    spec = importlib.util.find_spec("tvm")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / "lib"
            if (path / _CORE_LIB).exists():
                return path
    raise TvmRuntimeError(
        f"cannot find {_CORE_LIB}: set {RUNTIME_LIB_DIR_ENV} to a folder holding {_CORE_LIB} "
        f"(and {_CUDA_LIB} for CUDA modules), e.g. the apache-tvm wheel's tvm/lib"
    )


def _preload_cudart() -> None:
    """Make ``libcudart.so.13`` resolvable for libtvm_runtime_cuda.so (torch's copy if present)."""
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    spec = importlib.util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for cand in sorted(Path(loc).glob("*/lib/libcudart.so.1*")):
            try:
                ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


def load_tvm_runtime(*, cuda: bool = False, lib_dir: str | os.PathLike[str] | None = None) -> None:
    """Load the TVM runtime libraries once per process (``RTLD_GLOBAL``)."""
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so, which the runtime libraries link against)

    names = [_CORE_LIB] + ([_CUDA_LIB] if cuda else [])
    with _lock:
        if all(n in _loaded for n in names):
            return
        base = Path(lib_dir) if lib_dir is not None else find_runtime_lib_dir()
        for name in names:
            if name in _loaded:
                continue
            path = base / name
            if name == _CUDA_LIB:
                _preload_cudart()
            try:
                _loaded[name] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise TvmRuntimeError(f"cannot load {path}: {exc}") from exc


def load_module(path: str | os.PathLike[str], *, cuda: bool | None = None) -> Any:
    """Load an exported module (``.so``) with the lean runtime; returns a ``tvm_ffi.Module``.

    ``cuda``: load the CUDA runtime library first (default: when torch sees a CUDA device).
    """
    import tvm_ffi

    path = Path(path)
    if not path.exists():
        raise TvmRuntimeError(f"compiled module {path} does not exist")
    if cuda is None:
        cuda = _torch_has_cuda()
    load_tvm_runtime(cuda=cuda)
    try:
        return tvm_ffi.load_module(str(path))
    except Exception as exc:  # tvm_ffi raises its own error types
        raise TvmRuntimeError(f"cannot load module {path}: {exc}") from exc


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@contextmanager
def torch_stream(context: Any = None) -> Iterator[None]:
    """Launch tvm-ffi CUDA calls on torch's current stream inside this block.

    ``context``: a ``torch.cuda.stream(...)`` or ``torch.cuda.graph(...)`` context to enter and
    follow (e.g. to capture the calls into a CUDA graph).
    """
    import tvm_ffi

    with tvm_ffi.use_torch_stream(context):
        yield


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (back to its previous state after,
    also on an exception).

    A CUDA graph capture needs it: a collection that runs while a stream captures (any allocation of
    a Python object can start one) finalizes unreachable objects then, and destroying a dead
    ``torch.cuda.CUDAGraph`` (of an engine dropped before, its executor in a reference cycle) calls
    ``cudaGraphExecDestroy``, which CUDA forbids during a capture: the call fails ("operation not
    permitted when stream is capturing") and invalidates the capture in progress
    (cudaErrorStreamCaptureInvalidated at its end). Unreachable cycles are collected after the block.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def capture(graph: Any, *, pool: Any = None) -> Iterator[None]:
    """Capture a CUDA graph with tvm-ffi calls launched on the capture stream.

    ``graph``: a ``torch.cuda.CUDAGraph``; ``pool``: a ``torch.cuda.graph_pool_handle()`` to share
    (None: the graph's own). Without the ``tvm_ffi`` package (no compiled modules can run then) this
    is plain ``torch.cuda.graph``. Python's cyclic garbage collector is paused for the capture
    (`gc_paused`: a dead graph finalized mid-capture would invalidate it). A capture that fails
    leaves the thread's current stream and torch's caching allocator as they were before it
    (`_undo_failed_capture`), so that the process can go on, without graphs or with graphs in a fresh
    pool: on torch 2.11 (H200, session 15) the next capture into the failed one's `pool` was still
    refused ("already recording to mempool_id") after the allocator's own record of it was ended, so
    the executors and drafters drop a pool whose capture failed and take a new one.
    """
    import torch

    try:
        import tvm_ffi
    except ImportError:
        tvm_ffi = None
    with gc_paused():
        before = torch.cuda.current_stream() if torch.cuda.is_available() else None
        try:
            with torch.cuda.graph(graph, pool=pool):
                if tvm_ffi is None:
                    yield
                else:
                    # tvm-ffi's stream follows torch's (the capture stream) inside the graph's context
                    # and is restored before the capture ends (an end that fails cannot skip it)
                    with tvm_ffi.use_torch_stream():
                        yield
        except BaseException:
            _undo_failed_capture(pool, before)
            raise


def _undo_failed_capture(pool: Any, stream: Any) -> None:
    """After a failed capture into `pool`, what torch's ``capture_end`` leaves behind when
    ``cudaStreamEndCapture`` fails (it raises before its own clean-up):

    * the thread's current stream: still torch's capture stream (``torch.cuda.graph.__exit__`` never
      exits its stream context): set back to `stream`, the one current before the capture;
    * the caching allocator: the pool stays among its captures underway (``endAllocateToPool`` not
      called), so every later capture into the pool is refused ("already recording to mempool_id"),
      every later allocation of the process checks the capture's stream and blocks freed after a use
      on another stream are never reclaimed (their events wait for the end of a capture): taken out;
      and the use the capture took of the pool is never given back (a graph releases its pool only
      after a capture that ended), so the pool's memory would stay reserved after every other graph
      of it is gone: released. Neither when the capture's end already took the pool out (its graph
      then releases it), nor for ``pool=None`` (the graph's own pool, unknown after a failure).

    Nothing without CUDA (`stream` None)."""
    import torch

    if stream is None:
        return
    torch.cuda.set_stream(stream)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if pool is None or end is None:
        return
    device = torch.cuda.current_device()
    try:
        end(device, pool)
    except RuntimeError:  # "not currently recording to mempool_id": the capture's end did it
        return
    if release is not None:
        release(device, pool)
