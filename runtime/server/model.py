"""What the server serves: a `ServedModel` (engine factory + tokenizer + name), built by a `ModelSource`.

The server never reads artifacts itself. A `ModelSource` knows a model before it is loaded (its
name, the speculative backends it can serve, its card profile's defaults) so that the settings can be
resolved (`ignis.runtime.server.settings`) and refused early; `load(settings)` then builds the
`ServedModel`. `ArtifactSource` (`ignis.runtime.server.artifact_source`) is the source for artifact
directories built by ignis-build; tests use a toy source over the toy executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import ConfigError
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.profiles import CardProfile, SpecDefaults
from ignis.runtime.scheduler import DEFAULT_MAX_PREFILL_TOKENS, check_max_prefill_tokens
from ignis.runtime.tokenizer import ChatPrompt

__all__ = [
    "ChatTokenizer",
    "EngineFactory",
    "IncrementalDecoder",
    "ModelSettings",
    "ModelSource",
    "ServedModel",
]


class IncrementalDecoder(Protocol):
    """Streams text from generated ids (`ignis.runtime.tokenizer.IncrementalDetokenizer`)."""

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is incomplete)."""
        ...

    def flush(self) -> str:
        """End of stream: any held-back text."""
        ...


@runtime_checkable
class ChatTokenizer(Protocol):
    """The tokenizer interface the server needs (`ignis.runtime.tokenizer.Tokenizer` implements it)."""

    def encode(
        self, text: str, *, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]:
        """Token ids of text (at most max_length of them), without holding the GIL while tokenizing."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ids."""
        ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """The prompt text of a conversation (HF `apply_chat_template(tokenize=False)` semantics).

        Raises:
            TokenizerError: no template, an invalid template, or the template's raise_exception.
        """
        ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, parse_special_tokens: bool = False, **kwargs: Any
    ) -> ChatPrompt:
        """`apply_chat_template`, remembering the special-token text that came from the inputs
        (`ignis.runtime.tokenizer.Tokenizer.render_chat`)."""
        ...

    def encode_chat_prompt(self, prompt: ChatPrompt, *, max_length: int | None = None) -> list[int]:
        """Ids of a rendered conversation; the inputs' special-token text stays plain text."""
        ...

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """A streaming detokenizer for the tokens after prompt_ids."""
        ...


EngineFactory = Callable[[int, SpeculativeMetrics], SpeculativeEngine]
"""(max_lanes, metrics) -> a fresh engine. Called once at start and again after an engine failure."""


@dataclass(frozen=True)
class ModelSettings:
    """Resolved settings a source loads a model with.

    Attributes:
        spec: the speculative settings (backend, draft_tokens, draft_rows, draft_head).
        max_context: the context limit in tokens (prompt + output), or None for the model's own.
        device: torch device to load on ("cuda", "cpu", ...), or None for the source's default.
        cuda_graphs: on CUDA, replay verify rounds from CUDA graphs where the executor can
            (`Artifact.make_executor`); False runs them eagerly.
        graph_warmup_context: the KV length (tokens a round reads) up to which the static hybrid
            executor captures its round shapes at load (`StaticHybridExecutor.warm_up`); longer rounds
            capture theirs on first use; None: the whole context.
        max_prefill_tokens: the engine's prefill budget, prompt tokens prefilled per step across all
            lanes (`SpeculativeEngine`; a longer prompt is prefilled in chunks over several steps while
            the other lanes decode); 0 = no limit.
        checkpoint_card_bytes, checkpoint_host_bytes: byte budgets of the prompt checkpoint pool
            (`ignis.runtime.prefix_cache.PrefixCache`) on the card and in host RAM; both 0: off.
        checkpoint_dir: a snapshot directory (`ignis.runtime.snapshots.SnapshotDirectory`): loaded
            into the pool at start and written at shutdown, so a restarted server starts warm; None.
        expert_cache: MoE models: the device budget of the routed-expert cache (bytes or a size
            string, `ignis.runtime.expert_cache.parse_bytes`), "off" (every expert resident), or None /
            "auto" (the card profile's default: `ignis.runtime.expert_cache.cache_for_artifact`).
        expert_cache_pin: "auto", "on" or "off": page-lock the routed experts in host memory so that
            cache misses are DMAs (`ignis.runtime.host_pin`); auto falls back to the staging ring.
        expert_cache_lookahead: router lookahead prefetch into the expert cache
            (`ignis.runtime.expert_cache.ExpertCache`'s lookahead).
        async_rounds: the engine's `async_rounds` (`ignis.runtime.async_rounds`): decode rounds
            issued from the device's argmax of the previous round before the host reads it.

    Raises:
        ConfigError: max_prefill_tokens is not an integer >= 0, a bad expert cache size, an
            expert_cache_pin other than auto/on/off, or graph_warmup_context < 1.
    """

    spec: SpecDefaults
    max_context: int | None = None
    device: str | None = None
    cuda_graphs: bool = True
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    checkpoint_card_bytes: int = 0
    checkpoint_host_bytes: int = 0
    checkpoint_dir: str | None = None
    expert_cache: str | int | None = None
    expert_cache_pin: str = "auto"
    expert_cache_lookahead: bool = False
    graph_warmup_context: int | None = None
    async_rounds: bool = False

    def __post_init__(self) -> None:
        check_max_prefill_tokens(self.max_prefill_tokens)  # refused before a long load
        if self.graph_warmup_context is not None and (
            isinstance(self.graph_warmup_context, bool)
            or not isinstance(self.graph_warmup_context, int)
            or self.graph_warmup_context < 1
        ):
            raise ConfigError(
                f"graph_warmup_context {self.graph_warmup_context!r} must be an integer >= 1 (tokens)"
            )
        if self.expert_cache not in (None, "auto", "off"):  # a bad size refused before a long load
            from ignis.runtime.expert_cache import parse_bytes

            parse_bytes(self.expert_cache)  # type: ignore[arg-type]
        from ignis.runtime.host_pin import parse_pin_mode

        object.__setattr__(self, "expert_cache_pin", parse_pin_mode(self.expert_cache_pin))


@dataclass
class ServedModel:
    """A loaded model, ready to serve.

    Attributes:
        name: the model id clients send as "model" and /v1/models lists.
        tokenizer: encodes prompts, renders chats, streams text.
        make_engine: builds a fresh `SpeculativeEngine` (max_lanes, metrics); its detokenize callback
            and eos ids come from the same tokenizer.
        spec: the speculative settings the engine runs with (reported at load and by /v1/models).
        aliases: further names accepted as "model" (e.g. the artifact directory's name).
        created: Unix time of the load (seconds).
        close: releases what the model holds (GPU memory, mmaps), or None.
        prefix_cache: the prompt checkpoint pool every engine `make_engine` builds shares (it
            outlives an engine restart), or None; the server exports its metrics.
        save_checkpoints: writes the pool to the snapshot directory (at shutdown), or None.
        collectors: further `prometheus_client` collectors for /metrics (e.g. the expert cache's).
    """

    name: str
    tokenizer: ChatTokenizer
    make_engine: EngineFactory
    spec: SpecDefaults
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    close: Callable[[], None] | None = None
    prefix_cache: PrefixCache | None = None
    save_checkpoints: Callable[[], None] | None = None
    collectors: tuple[Any, ...] = ()

    def accepts(self, name: str) -> bool:
        """True when a request's "model" names this model."""
        return name == self.name or name in self.aliases


@runtime_checkable
class ModelSource(Protocol):
    """A model known before it is loaded.

    Attributes:
        name: the default served name.
        aliases: further names for config-file sections and requests.
        spec_kinds: speculative backends this model can run besides "off" (e.g. ("dflash2",) when the
            artifact carries a grafted drafter, ("mtp",) when the MTP companion container is beside it).
        profile: the model's card profile (an artifact's, recorded in its manifest), a built-in
            profile's name, or None.
    """

    name: str
    aliases: tuple[str, ...]
    spec_kinds: tuple[str, ...]
    profile: str | CardProfile | None

    def missing_backend_reason(self, backend: str) -> str:
        """Why `backend` cannot run on this model (used in the refusal message)."""
        ...

    def load(self, settings: ModelSettings) -> ServedModel:
        """Load the model with resolved settings.

        Raises:
            IgnisRuntimeError: the model cannot be loaded (the message names the file and the fix).
        """
        ...
