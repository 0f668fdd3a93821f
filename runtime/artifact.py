"""Load an artifact directory built by `ignis-build`: manifest, weights, tokenizer, drafter, modules.

    from ignis.runtime.artifact import load_artifact
    art = load_artifact("artifacts/smollm2-135m")           # validates; verify="fast" by default
    ex = art.make_executor(device="cpu")                      # the family's executor over the weights
    tok = art.tokenizer()                                     # ignis.runtime.tokenizer.Tokenizer or None
    art.spec_defaults("dflash2"), art.profile.widths          # the card profile recorded at build
    art.linear_backend()                                      # compiled modules per width (runtime/linear.py)
    art.topk_module()                                         # the drafter's compiled top-k, or None
    art.gdn_module(), art.norms_module(), art.mixers_module() # the hybrid rounds' fused kernels, or None
    art.moe_module(torch.bfloat16)                            # the grouped MoE expert kernels, or None

Validation at load (`verify`):

* always: the manifest (schema, versions, references), every listed file present with its size, the
  `.ninfer` headers (magic, version, header crc32, layout), and the containers' metadata against the
  manifest (family, card, dtypes, tensor set, tokenizer blob sha256);
* "fast" (default): also every tensor's crc32 and every padding byte of the `.ninfer` files, and the
  sha256 of the compiled modules: every flipped byte is found, and named (file, tensor, offset);
* "full": also the sha256 of every file against the manifest (authenticity of a shipped artifact);
* "none": only the "always" checks (a data byte flipped inside a tensor goes unnoticed).

Errors are the `ignis.formats` ones, each naming the file and, where known, the tensor and byte
offset: `ManifestError` / `ManifestVersionError`, `ArtifactFileError`, `ArtifactChecksumError`,
`ChecksumMismatchError` (a tensor's crc32), `ArtifactMismatchError` (an intact file that disagrees
with the manifest), and the container errors of `NinferReader`.

Weights are zero-copy views of the memory-mapped containers; q4_g32 tensors are dequantized to the
executor's dtype when the executor is built without compiled modules (`keep_q4=False`). With compiled
modules, `make_executor` places each q4 weight for its `LinearBackend` right after the copy to the
device: on CUDA, the shapes the artifact's "q4_g32_tiled" functions serve are re-laid in the tiled
layout there (`LinearBackend.place`), one tensor at a time.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ignis.formats import (
    MANIFEST_NAME,
    ArtifactChecksumError,
    ArtifactMismatchError,
    Manifest,
    NinferReader,
    hash_file,
    read_manifest,
    verify_artifact,
)
from ignis.formats.manifest import (
    META_ARTIFACT,
    META_CHAT_TEMPLATE,
    META_CONFIG,
    META_FAMILY,
    META_LINEAR_DTYPE,
    META_OTHER_DTYPE,
    META_TOKENIZER,
    SHORTLIST_HEAD,
    SHORTLIST_IDS,
    TOKENIZER_TENSOR,
)
from ignis.runtime.errors import ConfigError, IgnisRuntimeError, TensorSetError, TensorShapeError
from ignis.runtime.families.base import Executor, Family, FamilyConfig, check_tensor_set, get_family
from ignis.runtime.kernels.fused_mixers import FusedMixersKernel
from ignis.runtime.kernels.fused_norms import FusedNormsKernel
from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel
from ignis.runtime.kernels.registry import LIBRARIES, load_library
from ignis.runtime.kernels.topk import TopKModule
from ignis.runtime.linear import CompiledLinears, LinearBackend, Q4Weight, place_weight, row_splits_of
from ignis.runtime.profiles import CardProfile, SpecDefaults

__all__ = ["Artifact", "MissingCompanionError", "load_artifact"]

log = logging.getLogger("ignis.runtime.artifact")

Verify = Literal["none", "fast", "full"]

_TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class MissingCompanionError(IgnisRuntimeError):
    """A part the caller asked for is not in the artifact (the MTP companion for `--spec-backend mtp`,
    a grafted drafter, the shortlist head)."""


def _profile_from_manifest(m: Manifest) -> CardProfile:
    p = m.profile
    try:
        spec = {str(kind): SpecDefaults(**vals) for kind, vals in dict(p.get("spec") or {}).items()}
        return CardProfile(
            name=str(p["name"]),
            arch=str(p["arch"]),
            vram_bytes=int(p["vram_bytes"]),
            linear_dtype=str(p["linear_dtype"]),
            other_dtype=str(p["other_dtype"]),
            decode_widths=tuple(p["decode_widths"]),
            wide_widths=tuple(p["wide_widths"]),
            spec=spec,
        )
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise ArtifactMismatchError(
            f"the manifest's profile is not a valid card profile: {exc}", path=MANIFEST_NAME
        ) from exc


@dataclass
class Artifact:
    """A loaded, validated artifact (see `load_artifact`). Close it (or use `with`) to unmap the files.

    Attributes:
        path: the artifact directory.
        manifest: the parsed manifest.
        weights: the target container (target tensors, drafter, shortlist, tokenizer).
        mtp: the MTP companion container, or None.
        family: the registered family.
        config: the family config stored at build time.
        profile: the card profile recorded in the manifest (arch, dtypes, widths, spec defaults).
    """

    path: Path
    manifest: Manifest
    weights: NinferReader
    mtp: NinferReader | None
    family: Family
    config: FamilyConfig
    profile: CardProfile
    _compiled: CompiledLinears | None = field(default=None, repr=False)
    _kernels: dict[str, Any] = field(default_factory=dict, repr=False)  # library -> loaded or None

    # ---- parts ----
    @property
    def has_drafter(self) -> bool:
        """A DFlash2 drafter is grafted in."""
        return self.manifest.drafter is not None

    @property
    def has_mtp(self) -> bool:
        """The MTP companion container is present."""
        return self.mtp is not None

    def spec_defaults(self, kind: str) -> SpecDefaults | None:
        """The card profile's speculative defaults for a drafter kind ("dflash2", "mtp"), or None."""
        return self.profile.spec.get(kind)

    def tokenizer_spec(self) -> Any:
        """The stored `TokenizerSpec`, or None when the checkpoint had no tokenizer."""
        from ignis.runtime.tokenizer import TokenizerSpec

        loc = self.manifest.tokenizer
        if loc is None:
            return None
        meta = self.weights.metadata
        raw = self.weights.numpy(TOKENIZER_TENSOR).tobytes().decode("utf-8")
        d = dict(meta.get(META_TOKENIZER) or {})
        d["tokenizer_json"] = raw
        d["chat_template"] = meta.get(META_CHAT_TEMPLATE)
        return TokenizerSpec.from_dict(d)

    def tokenizer(self) -> Any:
        """An `ignis.runtime.tokenizer.Tokenizer` over the stored spec, or None."""
        from ignis.runtime.tokenizer import Tokenizer

        spec = self.tokenizer_spec()
        return None if spec is None else Tokenizer(spec)

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None."""
        value = self.weights.metadata.get(META_CHAT_TEMPLATE)
        return value if isinstance(value, str) else None

    # ---- tensors ----
    def _tensor(
        self,
        reader: NinferReader,
        name: str,
        *,
        dtype: torch.dtype | None,
        device: torch.device | str,
        keep_q4: bool,
        linear: LinearBackend | None = None,
        host: bool = False,
    ) -> torch.Tensor | Q4Weight:
        info = reader.info(name)
        # A member of the family's own fusions stays on the host (a view of the mapped file where no
        # conversion is needed): the executor stacks the members and moves the result, so the
        # device never holds a layer's members and their stack at once. So does a routed expert
        # served from an expert cache (`host`).
        fused = host or self.family.is_fused_member(name)
        if info.dtype == "q4_g32":
            parts = reader.torch_parts(name)
            w = Q4Weight(parts["packed"], parts["scales"])
            if keep_q4 or host:  # a cached expert stays q4 on the host (the cache dequantizes on the device)
                if fused:
                    return w
                w = w.to(device)
                if linear is not None:
                    # re-laid on the device right after its copy (the row-major copy is dropped
                    # here, one tensor at a time)
                    w = place_weight(linear, w, row_splits=row_splits_of(name))
                return w
            dense = w.dequantize(dtype or torch.float32)
            return dense if fused else dense.to(device)
        t = reader.torch(name)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return t if fused else t.to(device)

    def _group(self, reader: NinferReader, names: list[str], prefix: str, **kw: Any) -> dict[str, Any]:
        return {n[len(prefix) :]: self._tensor(reader, n, **kw) for n in names}

    def target_weights(
        self,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        keep_q4: bool = False,
        linear: LinearBackend | None = None,
        experts_on_host: bool = False,
    ) -> dict[str, torch.Tensor | Q4Weight]:
        """The trunk's tensors by canonical name (zero-copy CPU views where no conversion is needed).

        Args:
            dtype: float tensors converted to it (None keeps the stored dtype); q4 tensors are
                dequantized to it (float32 when None) unless `keep_q4`.
            keep_q4: return q4_g32 tensors as `Q4Weight` (for an executor that calls the linear hook).
            linear: with `keep_q4`, the backend the weights will run on: each q4 weight is placed
                for it right after its copy to `device` (`LinearBackend.place`: the tiled layout on
                CUDA for the shapes its "q4_g32_tiled" functions serve), except the members of the
                family's own fusions (`Family.fused_linears`): those stay on the host, and the
                executor stacks, moves and places them.
            experts_on_host: routed experts (`ignis.runtime.expert_cache.is_routed_expert`) stay on
                the host, zero-copy views of the memory map (q4 ones as `Q4Weight` whatever
                `keep_q4`), for an executor with an expert cache.
        """
        from ignis.runtime.expert_cache import is_routed_expert

        names = list(self.family.tensor_shapes(self.config))
        kw: dict[str, Any] = dict(dtype=dtype, device=device, keep_q4=keep_q4, linear=linear)
        return {
            n: self._tensor(self.weights, n, host=experts_on_host and is_routed_expert(n), **kw)
            for n in names
        }

    def drafter_weights(
        self,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        keep_q4: bool = False,
        linear: LinearBackend | None = None,
    ) -> dict[str, torch.Tensor | Q4Weight]:
        """The grafted drafter's tensors under their checkpoint names (prefix stripped); the
        arguments are `target_weights`'.

        Raises:
            MissingCompanionError: the artifact has no drafter.
        """
        d = self.manifest.drafter
        if d is None:
            raise MissingCompanionError(
                f"{self.path}: the artifact has no grafted drafter (build with --drafter)"
            )
        prefix = str(d["prefix"])
        names = [n for n in self.weights if n.startswith(prefix)]
        return self._group(
            self.weights, names, prefix, dtype=dtype, device=device, keep_q4=keep_q4, linear=linear
        )

    def drafter_config(self) -> dict[str, Any]:
        """The grafted drafter's config.json (a dict). Raises MissingCompanionError without one."""
        d = self.manifest.drafter
        if d is None:
            raise MissingCompanionError(
                f"{self.path}: the artifact has no grafted drafter (build with --drafter)"
            )
        return dict(self.weights.metadata[str(d["config_key"])])

    def mtp_weights(
        self,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        keep_q4: bool = False,
        linear: LinearBackend | None = None,
    ) -> dict[str, torch.Tensor | Q4Weight]:
        """The MTP head's tensors (`mtp.*` names); the arguments are `target_weights`'.

        Raises:
            MissingCompanionError: the artifact has no `NAME_mtp.ninfer` (the runtime must then refuse
                `--spec-backend mtp`).
        """
        if self.mtp is None:
            raise MissingCompanionError(
                f"{self.path}: the artifact has no MTP companion container; --spec-backend mtp needs a "
                f"checkpoint with mtp.* tensors"
            )
        return self._group(
            self.mtp, list(self.mtp), "", dtype=dtype, device=device, keep_q4=keep_q4, linear=linear
        )

    def shortlist(self, device: torch.device | str = "cpu") -> tuple[Q4Weight, torch.Tensor]:
        """The Q4 shortlist head: (Q4Weight [S, hidden], int32 token ids [S], most frequent first).

        Raises:
            MissingCompanionError: the artifact has no shortlist head.
        """
        if self.manifest.shortlist is None:
            raise MissingCompanionError(f"{self.path}: the artifact has no shortlist head")
        parts = self.weights.torch_parts(SHORTLIST_HEAD)
        ids = self.weights.torch(SHORTLIST_IDS)
        return Q4Weight(parts["packed"], parts["scales"]).to(device), ids.to(device)

    # ---- execution ----
    def compiled_linears(self) -> CompiledLinears:
        """The artifact's compiled modules, loaded once with the lean TVM runtime."""
        if self._compiled is None:
            self._compiled = CompiledLinears.load(self.path, self.manifest)
        return self._compiled

    def linear_backend(self, *, compiled: bool = True) -> LinearBackend:
        """A fresh `LinearBackend` over the compiled modules (or torch only with `compiled=False`)."""
        return LinearBackend(self.compiled_linears() if compiled and self.manifest.modules else None)

    def kernel_library(self, name: str) -> Any:
        """The artifact's compiled kernel library `name` (a key of
        `ignis.runtime.kernels.registry.LIBRARIES`), loaded once with the lean TVM runtime and bound
        (`KernelLibrary.bind`).

        Returns:
            The binding, or None: the manifest lists none of the library's required kinds (a CPU
            card, a model or drafter that does not use it, an artifact built before it), lists only
            some of them or in two files (logged as a warning), a CUDA kernel while torch sees no
            CUDA device, or a library that does not load here (no TVM runtime libraries, a missing
            function: logged as a warning). None means the torch path, with the same result (to
            float32 summation order where the library's docs say so).

        Raises:
            KeyError: `name` is not a library of the registry.
        """
        if name in self._kernels:
            return self._kernels[name]
        lib = LIBRARIES[name]
        entries = [self.manifest.kernel(kind) for kind in lib.required]
        listed = [e for e in entries if e is not None]
        module: Any = None
        if not listed:
            pass
        elif len(listed) != len(lib.required) or len({e.file for e in listed}) != 1:
            log.warning(
                "the manifest lists the %s kernels %s in %s, not all of %s in one library; %s",
                lib.what,
                [e.kind for e in listed],
                sorted({e.file for e in listed}),
                list(lib.required),
                lib.fallback,
            )
        elif any(e.target.get("kind") == "cuda" for e in listed) and not torch.cuda.is_available():
            log.info("no CUDA device: the compiled %s %s is not loaded", lib.what, listed[0].file)
        else:
            from ignis.runtime.kernels.tvm_runtime import TvmRuntimeError

            try:
                module = load_library(lib, self.path, self.manifest)
            except (TvmRuntimeError, ImportError, OSError, KeyError, AttributeError) as exc:
                log.warning("compiled %s %s not loaded (%s); %s", lib.what, listed[0].file, exc, lib.fallback)
        self._kernels[name] = module
        return module

    def topk_module(self) -> TopKModule | None:
        """The compiled top-k (`kernel_library("topk")`): what DFlash2's selector walk takes as its
        `topk_module`, its `supports` limited to the manifest entry's dtypes; None means
        `ignis.runtime.kernels.topk`'s exact torch path."""
        module: TopKModule | None = self.kernel_library("topk")
        return module

    def gdn_module(self) -> GdnRecurrentKernel | None:
        """The fused Gated DeltaNet recurrence (`kernel_library("gdn_recurrent")`, with the stash round
        and the replay when its file lists them): what `StaticHybridExecutor` takes as its
        `gdn_module`; None means the torch recurrence."""
        module: GdnRecurrentKernel | None = self.kernel_library("gdn_recurrent")
        return module

    def norms_module(self) -> FusedNormsKernel | None:
        """The fused row norms (`kernel_library("fused_norms")`, with silu_mul / narrow_linear when its
        file lists them): what `StaticHybridExecutor` takes as its `norms_module`; None means the
        torch norms."""
        module: FusedNormsKernel | None = self.kernel_library("fused_norms")
        return module

    def mixers_module(self) -> FusedMixersKernel | None:
        """The fused mixer pieces (`kernel_library("fused_mixers")`, with gated_attention when its file
        lists it): what `StaticHybridExecutor` takes as its `mixers_module`; None means the torch
        conv1d / norms / RoPE / KV writes / attention."""
        module: FusedMixersKernel | None = self.kernel_library("fused_mixers")
        return module

    def default_dtype(self) -> torch.dtype:
        """The executor dtype the card profile implies (its other_dtype)."""
        return _TORCH_DTYPES.get(self.profile.other_dtype, torch.bfloat16)

    def make_executor(
        self,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        linear: LinearBackend | None = None,
        cuda_graphs: bool | None = None,
        max_lanes: int | None = None,
        max_context: int | None = None,
        expert_cache: Any = None,
    ) -> Executor:
        """Build the family's executor over the artifact's weights.

        Args:
            device: where the weights go.
            dtype: the executor's dtype (default: the profile's other_dtype).
            linear: the linear hook; passed to the family's `make_executor` when it accepts a `linear`
                argument (then q4 weights stay `Q4Weight`), else ignored with a warning (the executor
                then runs torch linears over dequantized weights).
            cuda_graphs: on a CUDA device, build the static executor (pooled lane buffers, verify
                rounds replayed from CUDA graphs): `StaticHybridExecutor` for the hybrid families
                (qwen3_5, qwen3_next, ...; MoE configs run its static path eagerly unless every
                expert is resident and the artifact carries the grouped expert kernels,
                `moe_module`), `StaticLlamaExecutor` for llama and qwen2. None (default) = on for
                CUDA; False = the eager `HybridExecutor` / `LlamaExecutor`. CPU devices ignore it
                (True on a CPU device raises ValueError).
            max_lanes: lane slots of the static executor's pools (default 8; more lanes grow them).
            max_context: tokens per lane of the static executor's pools (default: min(the model's
                max_position_embeddings, 8192)); `SpeculativeEngine` caps its context to it.
            expert_cache: an `ignis.runtime.expert_cache.ExpertCache` (MoE hybrid families): the
                routed experts stay in host memory (the memory map) and run from its device slots.

        The static executor gets the artifact's fused kernels when the manifest lists them for
        `dtype` and they load (`gdn_module()`, `norms_module()`, `mixers_module()`); otherwise it runs
        the torch ops. Either executor gets the grouped MoE expert kernels (`moe_module(dtype)`)
        with a linear hook on CUDA; the routed experts then come from the memory map and the
        executor moves them into its row-major stacks (or its expert cache).

        Raises:
            ValueError: cuda_graphs=True on a CPU device, or bad pool sizes.
        """
        dtype = dtype or self.default_dtype()
        on_cuda = torch.device(device).type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {device}")
        from ignis.runtime.families.qwen3_5 import HybridConfig

        # the grouped expert kernels: the routed experts stay on the host here and the executor
        # moves them into its row-major stacks (never tiled: no second copy on the device)
        moe = self.moe_module(dtype) if on_cuda and linear is not None else None
        moe_kw: dict[str, Any] = {} if moe is None else {"moe_module": moe}
        if isinstance(self.config, HybridConfig) and on_cuda and cuda_graphs is not False:
            from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

            weights = self.target_weights(
                dtype=dtype,
                device=device,
                keep_q4=linear is not None,
                linear=linear,
                experts_on_host=expert_cache is not None or moe is not None,
            )
            return StaticHybridExecutor(
                self.config,
                weights,
                device=device,
                dtype=dtype,
                linear=linear,
                max_lanes=max_lanes or 8,
                max_context=max_context,
                expert_cache=expert_cache,
                **self._hybrid_kernels(dtype),
                **moe_kw,
            )
        from ignis.runtime.families.llama import LlamaConfig, Qwen2Config

        decoder = isinstance(self.config, LlamaConfig | Qwen2Config)
        if decoder and on_cuda and cuda_graphs is not False and expert_cache is None:  # a cache: see below
            from ignis.runtime.families.llama_graphs import StaticLlamaExecutor

            weights = self.target_weights(
                dtype=dtype, device=device, keep_q4=linear is not None, linear=linear
            )
            return StaticLlamaExecutor(
                self.config,
                weights,
                device=device,
                dtype=dtype,
                linear=linear,
                max_lanes=max_lanes or 8,
                max_context=max_context,
                **self._llama_kernels(dtype),
            )
        params = inspect.signature(self.family.make_executor).parameters
        accepts = "linear" in params
        if linear is not None and not accepts:
            log.warning(
                "the %s executor takes no linear hook yet; compiled modules are not used",
                self.family.model_type,
            )
        if expert_cache is not None and "expert_cache" not in params:
            raise ValueError(f"the {self.family.model_type} executor takes no expert cache")
        keep_q4 = linear is not None and accepts
        if "moe_module" not in params:
            moe_kw = {}
        weights = self.target_weights(
            dtype=dtype,
            device=device,
            keep_q4=keep_q4,
            linear=linear if keep_q4 else None,
            experts_on_host=expert_cache is not None or bool(moe_kw and keep_q4),
        )
        extra: dict[str, Any] = {} if expert_cache is None else {"expert_cache": expert_cache}
        if keep_q4:
            extra |= moe_kw
        if linear is not None and accepts:
            return self.family.make_executor(self.config, weights, device, dtype, linear=linear, **extra)
        return self.family.make_executor(self.config, weights, device, dtype, **extra)

    def moe_module(self, dtype: torch.dtype) -> Any:
        """The grouped MoE expert kernels (`kernel_library("moe_experts")`) when the manifest lists
        them for `dtype` and they load; None otherwise (MoE layers then run one linear per routed
        expert)."""
        name = str(dtype).removeprefix("torch.")
        if any(self.manifest.kernel(kind, name) is None for kind in LIBRARIES["moe_experts"].required):
            return None
        return self.kernel_library("moe_experts")

    def _llama_kernels(self, dtype: torch.dtype) -> dict[str, Any]:
        """`StaticLlamaExecutor` keyword arguments: ``norms_module`` when the manifest lists the fused
        norms with ``add_rms_norm_llama`` for `dtype` and the library loads, ``mixers_module`` the
        same for the fused mixers with ``rope_kv`` (artifacts built before them: none, the torch
        ops)."""
        name = str(dtype).removeprefix("torch.")
        out: dict[str, Any] = {}
        for arg, lib, kind, has in (
            ("norms_module", "fused_norms", "add_rms_norm_llama", "has_add_rms_norm_llama"),
            ("mixers_module", "fused_mixers", "rope_kv", "has_rope_kv"),
        ):
            if self.manifest.kernel(kind, name) is None or any(
                self.manifest.kernel(k, name) is None for k in LIBRARIES[lib].required
            ):
                continue
            module = self.kernel_library(lib)
            if module is not None and getattr(module, has):
                out[arg] = module
        return out

    def _hybrid_kernels(self, dtype: torch.dtype) -> dict[str, Any]:
        """`StaticHybridExecutor` keyword arguments for the fused kernels that take `dtype` (only the
        kernels found: an executor without the argument is built as before)."""
        name = str(dtype).removeprefix("torch.")
        out: dict[str, Any] = {}
        for arg, lib in (
            ("gdn_module", "gdn_recurrent"),
            ("norms_module", "fused_norms"),
            ("mixers_module", "fused_mixers"),
        ):
            if any(self.manifest.kernel(kind, name) is None for kind in LIBRARIES[lib].required):
                continue
            if lib == "gdn_recurrent" and not GdnRecurrentKernel.supports(self.config):  # type: ignore[arg-type]
                continue
            module = self.kernel_library(lib)
            if module is not None:
                out[arg] = module
        return out

    def close(self) -> None:
        """Unmap the containers."""
        self.weights.close()
        if self.mtp is not None:
            self.mtp.close()

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_container(reader: NinferReader, m: Manifest, part: str) -> None:
    meta = reader.metadata
    art = meta.get(META_ARTIFACT)
    problems = []
    if not isinstance(art, dict) or art.get("part") != part:
        problems.append(
            f"{META_ARTIFACT} says part {None if not isinstance(art, dict) else art.get('part')!r}, "
            f"the manifest lists it as {part!r}"
        )
    elif art.get("card") != m.card:
        problems.append(f"built for card {art.get('card')!r}, the manifest says {m.card!r}")
    if meta.get(META_FAMILY) != m.family:
        problems.append(f"family {meta.get(META_FAMILY)!r}, the manifest says {m.family!r}")
    if meta.get(META_LINEAR_DTYPE) != m.linear_dtype or meta.get(META_OTHER_DTYPE) != m.other_dtype:
        problems.append(
            f"dtypes {meta.get(META_LINEAR_DTYPE)!r}/{meta.get(META_OTHER_DTYPE)!r}, the manifest "
            f"says {m.linear_dtype!r}/{m.other_dtype!r}"
        )
    if problems:
        raise ArtifactMismatchError(
            "the container does not belong to this artifact: " + "; ".join(problems), path=reader.path
        )


def load_artifact(path: str | Path, *, verify: Verify = "fast") -> Artifact:
    """Open and validate an artifact directory (module docstring for what each `verify` level checks).

    Raises:
        ManifestError, ManifestVersionError: the manifest is missing, invalid or of another version.
        ArtifactFileError: a listed file is missing or has the wrong size.
        ArtifactChecksumError: a file's sha256 differs ("full"; "fast" for modules), naming file and
            the offset of the first corrupt block.
        ChecksumMismatchError, NonZeroPaddingError: a tensor's crc32 or a padding byte ("fast", "full").
        ignis.formats.FormatError: a container header is invalid (named file, tensor, offset).
        ArtifactMismatchError: an intact container disagrees with the manifest (family, card, dtypes,
            tensor set, tokenizer).
        UnknownModelTypeError: the family is not registered in this runtime.
    """
    if verify not in ("none", "fast", "full"):
        raise ValueError(f"verify must be 'none', 'fast' or 'full', got {verify!r}")
    root = Path(path)
    manifest = read_manifest(root)
    verify_artifact(root, manifest, check_hashes=verify == "full", allow_extra=True)
    if verify == "fast":
        bad = []
        for f in manifest.files:
            if f.role == "module":
                _size, sha, _ = hash_file(root / f.path)
                if sha != f.sha256:
                    bad.append((f.path, 0))
        if bad:
            raise ArtifactChecksumError(
                f"{len(bad)} compiled module(s) do not match their sha256: {[p for p, _ in bad]}; "
                f"the artifact is corrupt: copy it again or rebuild it",
                path=root / bad[0][0],
                offset=0,
                mismatches=bad,
            )
    family = get_family(manifest.family)
    weights = NinferReader(root / manifest.weights)
    mtp: NinferReader | None = None
    try:
        if verify != "none":
            weights.verify()
        _check_container(weights, manifest, "target")
        try:
            config = family.config_cls.from_hf(dict(weights.metadata[META_CONFIG]))
        except (KeyError, TypeError, ConfigError) as exc:
            raise ArtifactMismatchError(
                f"no valid family config in {META_CONFIG}: {exc}", path=weights.path
            ) from exc
        shapes = {n: weights.info(n).shape for n in weights if n in family.tensor_shapes(config)}
        try:
            check_tensor_set(config, shapes, source=str(weights.path))
        except (TensorSetError, TensorShapeError) as exc:
            raise ArtifactMismatchError(str(exc), path=weights.path) from exc
        if manifest.tokenizer is not None:
            if TOKENIZER_TENSOR not in weights:
                raise ArtifactMismatchError(
                    f"the manifest lists a tokenizer but {TOKENIZER_TENSOR} is absent", path=weights.path
                )
            blob = weights.numpy(TOKENIZER_TENSOR).tobytes()
            if hashlib.sha256(blob).hexdigest() != manifest.tokenizer["sha256"]:
                raise ArtifactMismatchError(
                    "the stored tokenizer.json differs from the manifest's sha256",
                    path=weights.path,
                    tensor=TOKENIZER_TENSOR,
                    offset=weights.info(TOKENIZER_TENSOR).offset,
                )
        for key, names in (("drafter", None), ("shortlist", (SHORTLIST_HEAD, SHORTLIST_IDS))):
            loc: Mapping[str, Any] | None = getattr(manifest, key)
            if loc is None:
                continue
            if names is None:
                prefix = str(loc["prefix"])
                if (
                    not any(n.startswith(prefix) for n in weights)
                    or str(loc["config_key"]) not in weights.metadata
                ):
                    raise ArtifactMismatchError(
                        f"the manifest lists a drafter under {prefix!r}, the container holds none",
                        path=weights.path,
                    )
            elif not all(n in weights for n in names):
                raise ArtifactMismatchError(
                    f"the manifest lists a shortlist head, the container lacks {names}", path=weights.path
                )
        if manifest.mtp is not None:
            mtp = NinferReader(root / manifest.mtp)
            if verify != "none":
                mtp.verify()
            _check_container(mtp, manifest, "mtp")
        profile = _profile_from_manifest(manifest)
    except BaseException:
        weights.close()
        if mtp is not None:
            mtp.close()
        raise
    return Artifact(
        path=root, manifest=manifest, weights=weights, mtp=mtp, family=family, config=config, profile=profile
    )
