"""`ArtifactSource`: the `ModelSource` for an artifact directory built by ignis-build.

It adapts `ignis.runtime.artifact` (manifest, weights, tokenizer, recorded card profile, grafted
DFlash2 drafter, MTP companion container) to what the server needs:

- before loading: the model's name (the manifest's), the directory's name as an alias, the backends
  it can run (`dflash2` when a drafter is grafted in, `mtp` when `NAME_mtp.ninfer` is beside it), and
  the card profile recorded at build (its speculative defaults);
- `load(settings)`: a `ServedModel` whose engine factory builds the family's executor and the drafter
  the settings ask for. When the artifact has compiled modules, the executor and the drafter share
  one linear backend (`Artifact.linear_backend()`, runtime/linear.py): their linears run the compiled
  module for the round's row width, and q4_g32 weights stay packed (`Q4Weight`). The drafter shares
  the executor's embedding and output head (no second copy on the card). The proposal head
  "shortlist" uses the artifact's Q4 shortlist head: kept packed for the compiled modules, else
  dequantized to the drafter's dtype. On a CUDA device the DFlash2 drafter's selector walk takes the
  artifact's compiled top-k (`Artifact.topk_module()`) when the manifest lists one (else torch's
  exact path), and beside a static target the drafter runs its static route (pooled lane windows,
  its proposal and commit replayed from CUDA graphs captured at load: `dflash2_graphs`). The MTP
  and draft-model drafters select by argmax or by sampling (whose top-k filter only thresholds on
  the k-th value): no full-vocabulary top-k to route. Hybrid targets on CUDA get the artifact's
  fused GDN recurrence and row norms through `Artifact.make_executor`
  (`gdn_module()`, `norms_module()`) when the manifest lists them.

The artifact is validated when the source is opened (`load_artifact(verify=...)`): a corrupt or
truncated file is refused there, naming the file and offset.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ignis.runtime.artifact_guard import watch_artifact
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import TokenizerError
from ignis.runtime.expert_cache import ExpertCache, ExpertCacheStats, cache_for_artifact, prometheus_collector
from ignis.runtime.families.static_rounds import warm_up_static
from ignis.runtime.linear import Q4Weight
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.profiles import CardProfile
from ignis.runtime.server.async_rounds_metrics import AsyncRoundsCollector
from ignis.runtime.server.checkpoints import build_checkpoint_pool
from ignis.runtime.server.model import ModelSettings, ServedModel
from ignis.runtime.server.warmup import warm_up_engine

if TYPE_CHECKING:
    from ignis.runtime.drafters.replay import ReplayOptions
    from ignis.runtime.tokenizer import Tokenizer

__all__ = ["ArtifactSource", "attach_topk"]

log = logging.getLogger("ignis.runtime.server")

# Executor attribute names of the shared tensors, per family layout (llama: public; hybrid: private).
_SHARED_ATTRS = {
    "model.embed_tokens.weight": ("embed", "_embed"),
    "lm_head.weight": ("lm_head", "_lm_head"),
    "model.norm.weight": ("norm", "_final_norm"),
}


def _shared_tensors(art: Any, executor: Any, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The target's embedding, head and final norm: the executor's own tensors where it exposes them
    (the head may be a `Q4Weight` when the executor runs compiled linears), else read from the
    artifact (CPU views, then moved)."""
    out: dict[str, Any] = {}
    for name, attrs in _SHARED_ATTRS.items():
        for attr in attrs:
            value = getattr(executor, attr, None)
            if isinstance(value, torch.Tensor) or (name == "lm_head.weight" and isinstance(value, Q4Weight)):
                out[name] = value
                break
    missing = [n for n in _SHARED_ATTRS if n not in out]
    if missing:
        cpu = art.target_weights(dtype=dtype, device="cpu")
        for name in missing:
            if name in cpu:
                out[name] = cpu[name].to(device)
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied
    return out


def _close_all(caches: Any, art: Any) -> None:
    """The served model's close: undo the expert caches' host registrations, then unmap the artifact."""
    for cache in list(caches):
        cache.close()
    art.close()


def attach_topk(drafter: Any, art: Any, device: torch.device) -> Any:
    """Give a DFlash2 drafter the artifact's compiled top-k (`Artifact.topk_module()`, possibly None:
    torch's exact path) on a CUDA device; on any other device leave it as built (the kernel is CUDA
    only, and the artifact is not asked). Returns the drafter."""
    if device.type == "cuda":
        drafter.topk_module = art.topk_module()
    return drafter


def _reopen(path: str, draft_model: Path | None, replay: ReplayOptions | None) -> ArtifactSource:
    """An unpickled `ArtifactSource` (`ArtifactSource.__reduce__`)."""
    return ArtifactSource(path, verify="none", draft_model=draft_model, replay=replay)


class ArtifactSource:
    """An artifact directory, opened and validated (weights memory-mapped, nothing on the card yet).

    Args:
        path: the artifact directory.
        verify: `load_artifact`'s check level: "none", "fast" (default: every tensor's crc32) or "full".
        draft_model: `--spec-draft-model`: the draft model's artifact (enables backend "draft-model").
        replay: `--spec-replay`: the benchmarking drafter's settings (enables backend "replay").

    Raises:
        ignis.formats errors: a missing, corrupt or mismatched file (named, with the offset).
        UnknownModelTypeError: the artifact's family is not in this runtime.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        verify: Literal["none", "fast", "full"] = "fast",
        draft_model: str | Path | None = None,
        replay: ReplayOptions | None = None,
    ) -> None:
        from ignis.runtime.artifact import load_artifact

        self.path = Path(path)
        self.draft_model = None if draft_model is None else Path(draft_model)  # --spec-draft-model
        self.artifact = load_artifact(self.path, verify=verify)
        art = self.artifact
        self.name: str = art.manifest.name
        self.aliases: tuple[str, ...] = tuple(a for a in (self.path.resolve().name,) if a != self.name)
        kinds = []
        if art.has_drafter:
            kinds.append("dflash2")
        if art.has_mtp:
            kinds.append("mtp")
        kinds.append("ngram")  # prompt lookup needs no weights: every artifact can run it
        if self.draft_model is not None:
            kinds.append("draft-model")
        self.replay = replay  # --spec-replay: the benchmarking drafter (drafters/replay.py)
        if replay is not None:
            kinds.append("replay")
        self.spec_kinds: tuple[str, ...] = tuple(kinds)
        self.profile: CardProfile | None = art.profile

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its path and options (for the engine process, `ignis.runtime.server.engine_process`):
        the copy opens the directory again without re-checking the checksums this one checked."""
        return (_reopen, (str(self.path), self.draft_model, self.replay))

    def _tokenizer(self) -> Tokenizer:
        """The artifact's tokenizer (`load` and `load_text`).

        Raises:
            TokenizerError: the artifact carries no tokenizer.
        """
        tokenizer = self.artifact.tokenizer()
        if tokenizer is None:
            raise TokenizerError(f"{self.path}: the artifact has no tokenizer; the server needs one")
        return tokenizer

    def load_text(self, settings: ModelSettings) -> ServedModel:
        """The server process's side of the model when the engine runs in its own process: the
        tokenizer, names and speculative settings; the artifact is unmapped here (the engine process
        maps its own) and the engine factory refuses to be called.

        Raises:
            TokenizerError: the artifact carries no tokenizer.
        """
        art = self.artifact
        tokenizer = self._tokenizer()
        art.close()

        def no_engine(max_lanes: int, metrics: SpeculativeMetrics) -> SpeculativeEngine:
            raise RuntimeError("this model's engine runs in the engine process (load_text)")

        return ServedModel(
            name=self.name,
            tokenizer=tokenizer,
            make_engine=no_engine,
            spec=settings.spec,
            aliases=self.aliases,
        )

    def serves_on_cuda(self, settings: ModelSettings) -> bool:
        """Whether `load(settings)` would put the model on a CUDA device."""
        return self._device(settings).type == "cuda"

    def missing_backend_reason(self, backend: str) -> str:
        """Why the artifact cannot run `backend`."""
        if backend == "mtp":
            return (
                f"the MTP companion container {self.name}_mtp.ninfer is not in {self.path} "
                "(ignis-build writes it from a checkpoint with mtp.* tensors)"
            )
        if backend == "dflash2":
            return f"the artifact in {self.path} carries no grafted DFlash2 drafter (ignis-build --drafter)"
        if backend == "draft-model":
            return "it needs --spec-draft-model ARTIFACT (an artifact of a model with the same tokenizer)"
        if backend == "replay":
            return "it needs --spec-replay FILE (prompt ids -> recorded outputs, ignis-bench --save-outputs)"
        return f"unknown backend {backend}"

    def _device(self, settings: ModelSettings) -> torch.device:
        if settings.device is not None:
            return torch.device(settings.device)
        on_gpu = self.artifact.profile.arch != "llvm" and torch.cuda.is_available()
        return torch.device("cuda" if on_gpu else "cpu")

    def load(self, settings: ModelSettings) -> ServedModel:
        """Build the tokenizer and the engine factory for `settings` (the first engine is built by the
        server at start, so load errors surface before the socket is created). The served model's
        `close` unmaps the artifact: load once per source.

        Raises:
            TokenizerError: the artifact carries no tokenizer.
        """
        art = self.artifact
        tokenizer = self._tokenizer()
        device = self._device(settings)
        dtype = art.default_dtype() if device.type != "cpu" else torch.float32
        spec = settings.spec
        linear = None
        takes_linear = "linear" in inspect.signature(art.family.make_executor).parameters
        if art.manifest.modules and takes_linear:
            try:
                linear = art.linear_backend()
            except Exception as exc:  # the lean TVM runtime is missing or the modules do not load here
                log.warning("compiled modules not loaded (%s); the linears run in torch", exc)
        elif art.manifest.modules:
            log.info("the %s executor takes no compiled linears yet (torch linears)", art.family.model_type)
        keep_q4 = linear is not None
        shortlist: tuple[torch.Tensor | Q4Weight, torch.Tensor] | None = None

        def make_drafter(executor: Any) -> Any:
            nonlocal shortlist
            if spec.backend == "ngram":
                from ignis.runtime.drafters.ngram import build_ngram_drafter

                return build_ngram_drafter()
            if spec.backend == "replay" and self.replay is not None:
                from ignis.runtime.drafters.replay import build_replay_drafter

                r = self.replay
                return build_replay_drafter(
                    path=r.path, vocab_size=int(art.config.vocab_size), accept=r.accept, seed=r.seed
                )
            if spec.backend == "draft-model":
                from ignis.runtime.drafters.draft_model import build_draft_model_drafter

                return build_draft_model_drafter(
                    target_tokenizer=art.tokenizer_spec(),
                    artifact=self.draft_model,
                    target_config=art.config,
                    device=device,
                    dtype=dtype,
                )
            shared = _shared_tensors(art, executor, dtype, device)
            if spec.backend == "dflash2":
                from ignis.runtime.drafters.dflash2 import DFlash2Config, build_dflash2_drafter

                kwargs: dict[str, Any] = {}
                if spec.draft_head == "shortlist":
                    if shortlist is None:
                        head, ids = art.shortlist(device)
                        shortlist = (head if keep_q4 else head.dequantize(dtype), ids.long())
                    kwargs = {"shortlist_weight": shortlist[0], "shortlist_token_ids": shortlist[1]}
                drafter = build_dflash2_drafter(
                    target_config=art.config,
                    target_weights=shared,
                    config=DFlash2Config.from_hf(art.drafter_config()),
                    weights=art.drafter_weights(dtype=dtype, device=device, keep_q4=keep_q4, linear=linear),
                    draft_head=spec.draft_head,
                    device=device,
                    dtype=dtype,
                    linear=linear,
                    # pooled like a static target's lanes and context (an eager target: eager)
                    static=None if getattr(executor, "max_context", None) else False,
                    max_lanes=getattr(executor, "max_lanes", None),
                    max_context=getattr(executor, "max_context", None),
                    cuda_graphs=None if settings.cuda_graphs else False,
                    **kwargs,
                )
                return attach_topk(drafter, art, device)
            from ignis.runtime.drafters.mtp import build_mtp_drafter

            on_cuda = torch.device(device).type == "cuda"
            return build_mtp_drafter(
                target_config=art.config,
                target_weights=shared,
                mtp_weights=art.mtp_weights(dtype=dtype, device=device, keep_q4=keep_q4, linear=linear),
                device=device,
                dtype=dtype,
                linear=linear,
                moe_module=art.moe_module(dtype) if keep_q4 and on_cuda else None,
                # pooled like a static target's lanes and context (an eager target: the eager head)
                static=None if getattr(executor, "max_context", None) else False,
                max_lanes=getattr(executor, "max_lanes", None),
                max_context=getattr(executor, "max_context", None),
                cuda_graphs=None if settings.cuda_graphs else False,
            )

        eos = tuple(tokenizer.eos_token_ids)
        cache, save_checkpoints = build_checkpoint_pool(
            card_bytes=settings.checkpoint_card_bytes,
            host_bytes=settings.checkpoint_host_bytes,
            device=device,
            snapshot_dir=settings.checkpoint_dir,
            binding=self._snapshot_binding(spec.backend) if settings.checkpoint_dir else None,
        )

        def detokenize(ids: Any) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=True))

        cache_stats = ExpertCacheStats()
        expert_caches: weakref.WeakSet[ExpertCache] = weakref.WeakSet()  # closed with the model

        rounds_metrics = AsyncRoundsCollector() if settings.async_rounds else None

        def make_engine(max_lanes: int, metrics: SpeculativeMetrics) -> SpeculativeEngine:
            expert_cache = self._expert_cache(settings, device, dtype, linear, max_lanes, cache_stats)
            if expert_cache is not None:
                expert_caches.add(expert_cache)
            executor = art.make_executor(
                device=device,
                dtype=dtype,
                linear=linear,
                cuda_graphs=None if settings.cuda_graphs else False,
                max_lanes=max_lanes,
                max_context=settings.max_context,
                **({} if expert_cache is None else {"expert_cache": expert_cache}),
            )
            if expert_cache is not None:  # the host experts were registered as the layers were built
                log.info("expert cache: %s", expert_cache.describe_host())
                if expert_cache.lookahead and not getattr(executor, "piecewise_graphs", False):
                    log.warning(
                        "--expert-cache-lookahead has no effect here: router lookahead runs only in "
                        "verify rounds replayed from CUDA graphs in pieces (a CUDA device with "
                        "--cuda-graphs); this engine runs its rounds eagerly (device %s)",
                        device,
                    )
            elif settings.expert_cache_lookahead:
                log.warning(
                    "--expert-cache-lookahead has no effect here: no expert cache (not a MoE model, or "
                    "every routed expert resident on the device)"
                )
            drafter = None if spec.backend == "off" else make_drafter(executor)
            verify = (spec.draft_tokens + 1,) if drafter is not None and spec.draft_tokens else ()
            # at load: the round shapes of the target (with the outputs the drafter asks every forward
            # for) and of a draft model's executor
            asks = {
                "hidden": bool(getattr(drafter, "needs_hidden_states", False)),
                "taps": tuple(getattr(drafter, "tap_layers", ())),
            }
            warm_up_static(executor, columns=verify, context=settings.graph_warmup_context, **asks)
            warm_up_static(getattr(drafter, "executor", None), columns=verify)
            warm_up_static(drafter, columns=verify, context=settings.graph_warmup_context)  # a static head
            engine = SpeculativeEngine(
                executor,
                drafter,
                draft_tokens=spec.draft_tokens if drafter is not None else None,
                draft_rows=spec.draft_rows,
                eos_token_ids=eos,
                detokenize=detokenize,
                max_context=settings.max_context,
                max_lanes=max_lanes,
                max_prefill_tokens=settings.max_prefill_tokens,
                device=device,
                metrics=metrics,
                prefix_cache=cache,
                async_rounds=settings.async_rounds,
            )
            if device.type == "cuda":  # a first request as fast as the tenth (runtime/server/warmup.py)
                warm_up_engine(engine)
            if rounds_metrics is not None:
                rounds_metrics.track(engine.async_rounds)
            return engine

        log.info(
            "artifact %s: family %s, card %s, device %s, dtype %s",
            self.path,
            art.manifest.family,
            art.manifest.card,
            device,
            str(dtype).removeprefix("torch."),
        )
        watch_artifact(art)  # a file modified in place stops the server with a clear log (artifact_guard)
        return ServedModel(
            name=self.name,
            tokenizer=tokenizer,
            make_engine=make_engine,
            spec=spec,
            aliases=self.aliases,
            close=lambda: _close_all(expert_caches, art),
            prefix_cache=cache,
            save_checkpoints=save_checkpoints,
            collectors=(
                *((prometheus_collector(cache_stats),) if self._serves_experts(settings, device) else ()),
                *((rounds_metrics,) if rounds_metrics is not None else ()),
            ),
        )

    def _serves_experts(self, settings: ModelSettings, device: torch.device) -> bool:
        """Whether the expert cache may be on (an MoE model, not "off"; auto only on CUDA)."""
        config = self.artifact.config
        if not (getattr(config, "is_moe", False) and getattr(config, "num_experts", 0)):
            return False
        return settings.expert_cache not in ("off",) and (
            device.type == "cuda" or settings.expert_cache not in (None, "auto")
        )

    def _expert_cache(
        self,
        settings: ModelSettings,
        device: torch.device,
        dtype: torch.dtype,
        linear: Any,
        lanes: int,
        stats: ExpertCacheStats,
    ) -> ExpertCache | None:
        """The routed-expert cache of one engine (`cache_for_artifact`), sized for `lanes` lanes, the
        context limit and the verify round's rows; None: every expert resident."""
        art, spec = self.artifact, settings.spec
        config = art.config
        if settings.expert_cache not in (None, "auto", "off") and not getattr(config, "num_experts", 0):
            log.warning("--expert-cache-bytes applies to MoE models; %s has no routed experts", self.name)
            return None
        context = settings.max_context or min(int(getattr(config, "max_position_embeddings", 8192)), 8192)
        if spec.backend == "mtp":
            rows = max(lanes, spec.draft_rows or 8)
        else:
            rows = lanes * (1 + (spec.draft_tokens if spec.backend != "off" else 0))
        cache = cache_for_artifact(
            art,
            settings.expert_cache,
            device=device,
            dtype=dtype,
            keep_q4=linear is not None,
            lanes=lanes,
            context=context,
            rows=rows,
            mtp=spec.backend == "mtp",
            stats=stats,
            pin=settings.expert_cache_pin,
            lookahead=settings.expert_cache_lookahead,
        )
        if cache is None and settings.expert_cache_pin == "on":
            log.warning("--expert-cache-pin on: no expert cache here (every routed expert on the device)")
        return cache

    def _snapshot_binding(self, backend: str) -> Any:
        """What prompt snapshots of this model are bound to (`ignis.formats.snapshot`): the target
        `.ninfer`'s sha256 and the drafter's (the grafted DFlash2 is in the target file; MTP has its
        companion; a draft model its own artifact's weights; ngram has no weights)."""
        from ignis.formats.manifest import read_manifest
        from ignis.formats.snapshot import SnapshotBinding

        def weights_sha(files: Any, role: str) -> str:
            return next((f.sha256 for f in files if f.role == role), "")

        files = self.artifact.manifest.files
        target = weights_sha(files, "weights")
        drafter = {"dflash2": target, "mtp": weights_sha(files, "mtp")}.get(backend, "")
        if backend == "draft-model" and self.draft_model is not None:
            drafter = weights_sha(read_manifest(self.draft_model).files, "weights")
        return SnapshotBinding(artifact_sha256=target, drafter=backend, drafter_sha256=drafter)
