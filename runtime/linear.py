"""Linear-layer dispatch for the verify round: torch dense, q4_g32 torch reference, compiled TVM modules.

The executors compute every linear layer of a round on all R rows at once. `LinearBackend` is the
one function they call for it, in place of `torch.nn.functional.linear`:

    y = linear(x, weight, bias)    # x [..., K]; weight torch [N, K] or Q4Weight [N, K]; -> [..., N]

Dispatch, per call, with R = the rows of x (all leading dims flattened):

1. When the artifact has compiled modules: the width is the smallest compiled width W >= R; the
   module function for (weight kind, N, K, x dtype) at W runs on x padded with zero rows to W (no
   padding for dynamic-row modules), writing y [W, N]; the first R rows are returned (+ bias).
2. R above every compiled width (a prompt's prefill): torch, silently.
3. No function for that width and shape (a module missing, or a shape the build did not cover):
   torch, with one logged warning per (width, kind, N, K, dtype).
4. Torch: `F.linear` for a dense weight; for a `Q4Weight` the reference dequantizes the weight to
   x's dtype on the fly (exact: (q - 8) * scale) and then runs `F.linear`.

`LinearBackend.counts` counts calls per route ("compiled", "torch", "fallback"), so tests and
benchmarks can see which path ran.

Executors that take the hook receive linear weights that are dense tensors or `Q4Weight`s (q4_g32
artifacts keep their codes when compiled modules run them); they fuse weights with `cat_rows`, move
them with `to_device`, and may index a `Q4Weight`'s leading dims or slice its rows (`w[e]`,
`w[e, :I]`), never its input dimension.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CompiledLinears",
    "LinearBackend",
    "LinearFn",
    "Q4Weight",
    "cat_rows",
    "dequantize_q4",
    "to_device",
    "torch_linear",
]

log = logging.getLogger("ignis.runtime.linear")

#: torch dtype -> the activation dtype names used in the manifest.
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)

#: The executors' linear hook: ``linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]``
#: (`F.linear`, or a `LinearBackend`, which also takes `Q4Weight`s).
LinearFn = Callable[..., torch.Tensor]

# Bound once at import: the torch route must not re-enter a hook that replaced F.linear.
_F_LINEAR = F.linear


def dequantize_q4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize q4_g32 parts: value of input i = (q_i - 8) * scales[..., i // 32], computed exactly.

    Args:
        packed: uint32 or int32 [*lead, K/8]; nibble j of word c holds input 8c + j.
        scales: float16 [*lead, K/32].
        dtype: result dtype (float32 is exact; bf16/f16 round the exact product once).

    Returns:
        [*lead, K] of `dtype`, on packed's device.

    Raises:
        ValueError: the part shapes do not match.
    """
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 8 != scales.shape[-1] * 32:
        raise ValueError(
            f"q4_g32 parts do not match: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}"
        )
    words = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed
    codes = (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 15
    k = packed.shape[-1] * 8
    values = (codes.reshape(*packed.shape[:-1], k) - 8).to(torch.float32)
    out = values.reshape(*packed.shape[:-1], k // 32, 32) * scales.to(torch.float32).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], k).to(dtype)


@dataclass(frozen=True)
class Q4Weight:
    """A q4_g32 linear weight [N, K] (or a stack [*lead, N, K]) as its two stored parts.

    Attributes:
        packed: uint32 (or int32) [*lead, N, K/8].
        scales: float16 [*lead, N, K/32].
    """

    packed: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        p, s = self.packed, self.scales
        if p.dim() < 2 or p.shape[:-1] != s.shape[:-1] or p.shape[-1] * 8 != s.shape[-1] * 32:
            raise ValueError(f"Q4Weight parts do not match: packed {tuple(p.shape)}, scales {tuple(s.shape)}")
        if s.dtype != torch.float16 or p.dtype not in (torch.uint32, torch.int32):
            raise ValueError(f"Q4Weight needs u32/i32 packed and f16 scales, got {p.dtype}, {s.dtype}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [*lead, N, K]."""
        return (*self.scales.shape[:-1], self.scales.shape[-1] * 32)

    @property
    def out_features(self) -> int:
        """N."""
        return int(self.scales.shape[-2])

    @property
    def in_features(self) -> int:
        """K."""
        return int(self.scales.shape[-1]) * 32

    @property
    def device(self) -> torch.device:
        """Where the parts live."""
        return self.packed.device

    def __getitem__(self, index: Any) -> Q4Weight:
        """Index the leading dims or slice rows (never the K axis): w[e], w[e, :I], w[a:b]."""
        p, s = self.packed[index], self.scales[index]
        return Q4Weight(p, s)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense tensor of `dtype` (exact in float32)."""
        return dequantize_q4(self.packed, self.scales, dtype)

    def to(self, device: torch.device | str) -> Q4Weight:
        """The same weight on `device`."""
        return Q4Weight(self.packed.to(device), self.scales.to(device))

    def contiguous(self) -> Q4Weight:
        """Both parts contiguous (no copy when they already are)."""
        return Q4Weight(self.packed.contiguous(), self.scales.contiguous())

    @staticmethod
    def cat_rows(weights: Sequence[Q4Weight]) -> Q4Weight:
        """Concatenate along the output rows (a fused projection such as q|k|v); all K equal."""
        return Q4Weight(
            torch.cat([w.packed for w in weights], dim=-2), torch.cat([w.scales for w in weights], dim=-2)
        )


def cat_rows(weights: Sequence[torch.Tensor | Q4Weight]) -> torch.Tensor | Q4Weight:
    """Concatenate linear weights along their output rows (a fused q|k|v or gate|up projection).

    Dense tensors go through `torch.cat(dim=0)`; `Q4Weight`s through `Q4Weight.cat_rows`.

    Raises:
        TypeError: a mix of dense and q4 weights.
    """
    if all(isinstance(w, Q4Weight) for w in weights):
        return Q4Weight.cat_rows([w for w in weights if isinstance(w, Q4Weight)])
    if any(isinstance(w, Q4Weight) for w in weights):
        raise TypeError("cat_rows: cannot fuse dense and q4_g32 weights into one")
    return torch.cat([w for w in weights if isinstance(w, torch.Tensor)], dim=0)


def to_device(
    weight: torch.Tensor | Q4Weight, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor | Q4Weight:
    """Move a linear weight to `device`; a dense weight is also cast to `dtype` (a `Q4Weight` keeps
    its packed codes and f16 scales)."""
    if isinstance(weight, Q4Weight):
        return weight.to(device)
    return weight.to(device=device, dtype=dtype) if dtype is not None else weight.to(device)


class WeightLoader:
    """Fetches a module's weights by name onto one device and dtype: plain tensors (embeddings, norms,
    convolution kernels) and linear weights (dense or `Q4Weight`, which keeps its packed dtype).

    Args:
        weights: name -> tensor or `Q4Weight`.
        device: where every fetched weight lands.
        dtype: the dtype of fetched dense weights.
        source: named in errors (e.g. "mtp weights").

    Raises (from `plain`):
        TypeError: a `Q4Weight` where only a plain tensor is allowed.
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor | Q4Weight],
        device: torch.device,
        dtype: torch.dtype,
        *,
        source: str,
    ) -> None:
        self.weights, self.device, self.dtype, self.source = weights, device, dtype, source

    def plain(self, name: str) -> torch.Tensor:
        """A non-linear weight as a dense tensor on the device, in the dtype."""
        t = self.weights[name]
        if isinstance(t, Q4Weight):
            raise TypeError(f"{self.source}: {name} is q4_g32; only linear weights may be Q4Weight")
        return t.detach().to(device=self.device, dtype=self.dtype)

    def linear(self, name: str) -> torch.Tensor | Q4Weight:
        """A linear weight (dense or Q4Weight) on the device."""
        t = self.weights[name]
        return to_device(t if isinstance(t, Q4Weight) else t.detach(), self.device, self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        """`plain(name)`, or None when the checkpoint has no such tensor (e.g. an absent bias)."""
        return self.plain(name) if name in self.weights else None

    def optional_linear(self, name: str) -> torch.Tensor | Q4Weight | None:
        """`linear(name)`, or None when absent."""
        return self.linear(name) if name in self.weights else None


def torch_linear(
    x: torch.Tensor, weight: torch.Tensor | Q4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch route: `F.linear`, dequantizing a `Q4Weight` to x's dtype first."""
    w = weight.dequantize(x.dtype) if isinstance(weight, Q4Weight) else weight
    return _F_LINEAR(x, w, bias)


@dataclass(frozen=True)
class _Fn:
    call: Any  # the tvm_ffi function
    dynamic_rows: bool
    cuda: bool


class CompiledLinears:
    """The compiled linear functions of an artifact, by (width, kind, N, K, dtype).

    Args:
        functions: (width, kind, out_features, in_features, dtype) -> (tvm_ffi function, dynamic_rows,
            is_cuda).
        widths: every width the artifact was built for (ascending), whether or not a module loaded.
    """

    def __init__(
        self,
        functions: Mapping[tuple[int, str, int, int, str], tuple[Any, bool, bool]],
        widths: Sequence[int],
    ) -> None:
        self._fns = {k: _Fn(*v) for k, v in functions.items()}
        self.widths = tuple(sorted(set(widths)))
        # Weight kinds the build compiled at all: a CUDA build compiles q4_g32 functions only and keeps
        # small precise linears (router, gates) dense on purpose, so those run on torch by design.
        self.kinds = frozenset(key[1] for key in self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def width_for(self, rows: int) -> int | None:
        """The smallest width >= rows, or None when rows exceeds every width."""
        return next((w for w in self.widths if w >= rows), None)

    def get(self, width: int, kind: str, n: int, k: int, dtype: str) -> _Fn | None:
        """The function for this width and shape, or None."""
        return self._fns.get((width, kind, n, k, dtype))

    @classmethod
    def load(cls, artifact_dir: str | Path, manifest: Any) -> CompiledLinears:
        """Load every module of `manifest` (an `ignis.formats.Manifest`) with the lean TVM runtime.

        A module that cannot be loaded (no TVM runtime libraries on this host, CUDA modules without a
        GPU: one warning for all of them) is skipped with a logged warning; its widths then fall back
        to torch.
        """
        from ignis.runtime.tvm_runtime import TvmRuntimeError, load_module

        root = Path(artifact_dir)
        loaded: dict[str, Any] = {}
        functions: dict[tuple[int, str, int, int, str], tuple[Any, bool, bool]] = {}
        cuda_files = sorted({e.file for e in manifest.modules if e.target.get("kind") == "cuda"})
        if cuda_files and not torch.cuda.is_available():
            log.warning(
                "no CUDA device: the artifact's %d CUDA module(s) are not loaded; linears run on torch",
                len(cuda_files),
            )
            loaded = dict.fromkeys(cuda_files)
        for entry in manifest.modules:
            is_cuda = entry.target.get("kind") == "cuda"
            if entry.file not in loaded:
                try:
                    loaded[entry.file] = load_module(root / entry.file, cuda=is_cuda)
                except (TvmRuntimeError, ImportError, OSError) as exc:
                    log.warning(
                        "compiled module %s not loaded (%s); widths it serves run on torch", entry.file, exc
                    )
                    loaded[entry.file] = None
            mod = loaded[entry.file]
            if mod is None:
                continue
            for fn in entry.functions:
                try:
                    call = mod[fn.name]
                except Exception as exc:  # tvm_ffi raises AttributeError / its own errors
                    log.warning("module %s lacks function %s (%s)", entry.file, fn.name, exc)
                    continue
                key = (entry.width, fn.kind, fn.out_features, fn.in_features, fn.dtype)
                functions[key] = (call, entry.dynamic_rows, is_cuda)
        return cls(functions, manifest.widths)


class LinearBackend:
    """`linear(x, weight, bias)` with the dispatch of the module docstring.

    Args:
        compiled: the artifact's compiled functions, or None (torch only).

    Attributes:
        counts: calls per route: "compiled" (a q4 weight with R above every width runs as chunks of
            the widest, one count per chunk), "torch" (a dense weight with R above every width, no
            rows, no modules at all, or a
            weight kind the build compiles no function for, e.g. dense gates beside q4 modules),
            "fallback" (a module function was missing for the width and shape: logged once).
    """

    def __init__(self, compiled: CompiledLinears | None = None) -> None:
        self.compiled = compiled
        self.counts = {"compiled": 0, "torch": 0, "fallback": 0}
        self._warned: set[tuple[int, str, int, int, str]] = set()
        self._lock = threading.Lock()

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | Q4Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """y = x @ weight^T + bias.

        Args:
            x: [..., K], float32 / bfloat16 / float16.
            weight: dense [N, K] (x's dtype) or `Q4Weight` [N, K].
            bias: [N] or None.

        Returns:
            [..., N] in x's dtype.
        """
        compiled = self.compiled
        if compiled is None or not compiled.widths:
            self.counts["torch"] += 1
            return torch_linear(x, weight, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        rows = int(x2.shape[0])
        if rows > compiled.widths[-1] and isinstance(weight, Q4Weight):
            # A q4 weight wider than every compiled width (e.g. 8 lanes x 8 columns = 64 rows): run the
            # compiled modules on chunks of the widest width rather than dequantizing on torch. A dense
            # weight at that many rows goes to torch's GEMM (cuBLAS / MKL), which is built for it.
            step = compiled.widths[-1]
            parts = [self(x2[i : i + step], weight, bias) for i in range(0, rows, step)]
            return torch.cat(parts).reshape(*lead, parts[0].shape[-1])
        width = compiled.width_for(rows) if rows > 0 else None
        if width is None:
            self.counts["torch"] += 1
            return torch_linear(x, weight, bias)
        is_q4 = isinstance(weight, Q4Weight)
        n = weight.out_features if isinstance(weight, Q4Weight) else int(weight.shape[0])
        k = int(x2.shape[1])
        dtype = _DTYPE_NAMES.get(x.dtype, str(x.dtype))
        kind = "q4_g32" if is_q4 else "dense"
        if kind not in compiled.kinds:  # by design (see CompiledLinears.kinds): not a missing module
            self.counts["torch"] += 1
            return torch_linear(x, weight, bias)
        fn = compiled.get(width, kind, n, k, dtype)
        if fn is None or (not is_q4 and isinstance(weight, torch.Tensor) and weight.dtype != x.dtype):
            key = (width, kind, n, k, dtype)
            with self._lock:
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning(
                        "no compiled %s linear [%d, %d] %s for width %d (rows %d): running on torch",
                        kind,
                        n,
                        k,
                        dtype,
                        width,
                        rows,
                    )
            self.counts["fallback"] += 1
            return torch_linear(x, weight, bias)
        if fn.dynamic_rows or rows == width:
            xp = x2.contiguous()
        else:
            xp = x2.new_zeros((width, k))
            xp[:rows] = x2
        y = x2.new_empty((xp.shape[0], n))
        if isinstance(weight, Q4Weight):
            w = weight.contiguous()
            args: tuple[Any, ...] = (xp, w.packed, w.scales, y)
        else:
            args = (xp, weight.contiguous(), y)
        if fn.cuda:
            from ignis.runtime.tvm_runtime import torch_stream

            with torch_stream():
                fn.call(*args)
        else:
            fn.call(*args)
        out = y[:rows]
        if bias is not None:
            out = out + bias
        self.counts["compiled"] += 1
        return out.reshape(*lead, n)
