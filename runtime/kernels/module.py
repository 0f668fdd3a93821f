"""What every binding of a compiled kernel library shares: named exports called on torch's stream.

A compiled library (a tvm-ffi ``.so`` built by the compiler's kernel builders) is loaded with the
lean runtime (`ignis.runtime.kernels.tvm_runtime.load_module`) and indexed by export name. The
bindings (`GdnRecurrentKernel`, `FusedNormsKernel`, `FusedMixersKernel`) take either such a module,
the path of its ``.so``, or a dict of callables (the CPU tests' stand-ins, which run eagerly without
a stream context).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

__all__ = ["ModuleFunctions", "optional_export"]


def optional_export(module: Any, name: str) -> Any:
    """module[name], or None when the module does not export it (a library built before the export)."""
    try:
        return module[name]
    except (KeyError, AttributeError):  # a dict / a tvm_ffi.Module without it
        return None


class ModuleFunctions:
    """The named functions of a compiled module, called on torch's current stream (capturable).

    Subclasses name the exports in `function_names` (required) and `optional_function_names` (used
    when the module has them). `source` is a loaded module (anything indexable by those names: a
    ``tvm_ffi.Module`` or, for CPU tests, a dict of callables), the path of its ``.so`` (loaded with
    the lean runtime), or another instance of the same class.

    Raises:
        TvmRuntimeError: a path that is missing or cannot be loaded.
        KeyError: a module without the required functions.
    """

    function_names: ClassVar[tuple[str, ...]] = ()
    #: exports used when the module has them (libraries built before an export lack it)
    optional_function_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, source: Any) -> None:
        if isinstance(source, type(self)):
            source = source.funcs
        if isinstance(source, str | os.PathLike):
            from ignis.runtime.kernels.tvm_runtime import load_module

            source = load_module(source, cuda=True)
        self.funcs = {name: source[name] for name in self.function_names}
        for name in self.optional_function_names:
            try:  # (not `optional_export`: a CPU test's stand-in may be None)
                self.funcs[name] = source[name]
            except (KeyError, AttributeError):  # a dict / a tvm_ffi.Module without it
                pass

    #: set while `_stream` holds tvm-ffi's stream on torch's current one: calls inside skip their own
    _on_stream: bool = False

    def _call(self, name: str, args: tuple[Any, ...], cuda: bool) -> None:
        if not cuda or self._on_stream:  # a CPU stand-in (tests), or inside `_stream` already
            self.funcs[name](*args)
            return
        from ignis.runtime.kernels.tvm_runtime import torch_stream

        with torch_stream():
            self.funcs[name](*args)

    @contextmanager
    def _stream(self) -> Iterator[None]:
        """Several CUDA calls under one switch of tvm-ffi's stream to torch's current one (the calls
        inside must not change torch's current stream)."""
        if self._on_stream:
            yield
            return
        from ignis.runtime.kernels.tvm_runtime import torch_stream

        with torch_stream():
            self._on_stream = True
            try:
                yield
            finally:
                self._on_stream = False
