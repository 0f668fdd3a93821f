"""Grammar-constrained decoding: token masks from llguidance, applied at every column of a verify round.

A request that must produce JSON (OpenAI `response_format` json_object / json_schema) or a tool call in
a fixed syntax (`tool_choice` required / named) carries a `Grammar` in its `SamplingParams.grammar`.
The engine gives each such lane a `GrammarMatcher` (llguidance's `LLMatcher`, an Earley parser over
the grammar with a lexer over the tokenizer's byte spellings) and, every verify round:

1. computes the lane's token bitmasks for all its columns at once: row 0 is the matcher's current
   state, row j (j = 1..k) is the state after consuming drafts d_1..d_j. Drafts are consumed while
   the grammar allows them; rows after the first disallowed draft are left all-ones (they are never
   read: the disallowed draft is rejected at the row before, so acceptance stops there). The matcher
   is rolled back to its state before the drafts (llguidance's `LLExecutor
   .unsafe_compute_mask_ptr_with_draft_token`, which does this for every lane in parallel threads
   with the GIL released);
2. masks the target's logits with them (disallowed tokens -> -inf), before greedy acceptance or
   rejection sampling. A draft outside the grammar has p = 0 at its row, so greedy acceptance (argmax
   differs) and rejection sampling (u * q < 0 never holds) both reject it;
3. consumes the committed run (accepted drafts and the bonus token) into the matcher.

Exactness: with speculation off, each decode step masks the single row with the current state. With
speculation on, row j's mask is the state after the drafts d_1..d_j, which is the state speculation
off would be in whenever those drafts are accepted, and row j is only read in that case. So greedy
output with speculation on equals speculation off, and rejection sampling keeps the output
distribution equal to the masked p, for every drafter (the drafters themselves stay unconstrained).

The masks are computed on the host while the device runs the round's forward (the engine starts
them on a worker thread before launching the forward and waits for them after it), so on a GPU the
grammar's cost is hidden behind the forward where the forward is the longer of the two.

Library: llguidance (Microsoft, MIT; https://github.com/guidance-ai/llguidance), a Rust parser with
Python bindings and no Python dependencies; its token masks are 32-bit words, bit i of word w is
token 32 * w + i (the layout of vLLM's and SGLang's structured-output backends).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ignis.runtime.errors import IgnisRuntimeError

__all__ = [
    "Grammar",
    "GrammarError",
    "GrammarMatcher",
    "GrammarTokenizer",
    "RoundMasks",
    "apply_token_bitmask",
    "compute_round_masks",
    "mask_first_logits",
    "mask_round_logits",
    "start_round_masks",
]


class GrammarError(IgnisRuntimeError, ValueError):
    """A grammar or JSON schema that cannot be compiled (the message says why), or llguidance is not
    installed."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - the runtime extra installs it
        raise GrammarError(
            "structured output needs the llguidance package (pip install 'ignis[runtime]')"
        ) from exc
    return llguidance


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it: each token id's byte spelling, the EOS ids.

    Building it walks the whole vocabulary (tens of milliseconds to about a second for 150k tokens);
    build it once per served model and share it between requests (it is immutable and thread-safe).

    Args:
        tokenizer_json: the HF `tokenizers` JSON of the model (`tokenizers.Tokenizer.to_str()`).
        vocab_size: the model's vocabulary (logit columns), >= the tokenizer's; ids the tokenizer
            does not spell (embedding padding) are never allowed.
        eos_token_ids: the ids that end generation; a grammar allows them once it is complete.

    Raises:
        GrammarError: llguidance cannot read the tokenizer, or no EOS id is given.
    """

    def __init__(self, tokenizer_json: str | Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if not eos_token_ids:
            raise GrammarError("a grammar needs the model's end-of-sequence token ids, got none")
        llg = _llguidance()
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if not isinstance(tokenizer_json, str):  # a vocabulary spelled id by id (`from_tokenizer`)
            tokenizer_json = llg.TokenizerWrapper(tokenizer_json)
        try:
            self.ll = llg.LLTokenizer(tokenizer_json, eos_token=list(self.eos_token_ids))
            if int(vocab_size) > int(self.ll.vocab_size):  # padded embedding: ids past the tokenizer's
                self.ll = llg.LLTokenizer(
                    tokenizer_json, n_vocab=int(vocab_size), eos_token=list(self.eos_token_ids)
                )
        except Exception as exc:  # llguidance raises ValueError / RuntimeError with its message
            raise GrammarError(f"llguidance cannot read the tokenizer: {exc}") from exc
        self.vocab_size = int(self.ll.vocab_size)  # mask columns (>= the model's logit columns)
        self.num_words = (self.vocab_size + 31) // 32  # int32 words per mask row

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> GrammarTokenizer:
        """From an `ignis.runtime.tokenizer.Tokenizer` (its `backend` and `eos_token_ids`).

        Raises:
            GrammarError: the tokenizer has no `tokenizers` backend or no EOS ids.
        """
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise GrammarError("structured output needs a Hugging Face `tokenizers` tokenizer")
        n = int(vocab_size) if vocab_size is not None else int(tokenizer.vocab_size)
        eos = tuple(tokenizer.eos_token_ids)
        try:
            return cls(backend.to_str(), n, eos)
        except GrammarError as exc:
            if not eos:
                raise
            # A pipeline llguidance does not read (e.g. a `Fuse` decoder): spell each id by decoding it.
            first = exc
        special = set(getattr(tokenizer, "special_token_ids", ()))
        spellings: list[bytes] = []
        for i in range(int(tokenizer.vocab_size)):
            text = backend.id_to_token(i) if i in special else backend.decode([i], skip_special_tokens=False)
            # llguidance marks special tokens with a leading 0xFF byte (never valid UTF-8)
            spellings.append(b"\xff" + (text or "").encode() if i in special else (text or "").encode())
        try:
            return cls(_SpelledVocabulary(spellings, eos[0], backend), n, eos)
        except GrammarError:
            raise first from None


class _SpelledVocabulary:
    """A vocabulary as llguidance's `TokenizerWrapper` reads it: each id's bytes and an encoder."""

    def __init__(self, tokens: list[bytes], eos_token_id: int, backend: Any) -> None:
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)


# llguidance JSON options: `json.dumps` separators and no free whitespace (Grammar.json_schema).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar for one tokenizer: immutable, shared by the lanes that use it.

    Build with `json_schema`, `json_object`, `lark` or `regex`; each lane gets its own `matcher()`.

    Attributes:
        tokenizer: the vocabulary it is compiled for.
        source: llguidance's grammar JSON.
        description: what it constrains to, for messages and logs (e.g. "json_schema 'weather'").
    """

    tokenizer: GrammarTokenizer
    source: str
    description: str
    _prototype: Any = field(default=None, repr=False)  # a compiled LLMatcher at the start; lanes copy it

    @staticmethod
    def _compile(tokenizer: GrammarTokenizer, source: str, description: str) -> Grammar:
        # Compiling is the expensive part (milliseconds for a JSON schema, more for large grammars):
        # done here, on the caller's thread, once; each lane's matcher is a cheap copy.
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(source, tokenizer.ll)
        if is_error:
            raise GrammarError(f"{description} cannot be compiled: {messages[0] if messages else '?'}")
        prototype = llg.LLMatcher(tokenizer.ll, source, log_level=0)
        if prototype.is_error():
            raise GrammarError(f"{description} cannot be compiled: {prototype.get_error()}")
        return Grammar(tokenizer, source, description, prototype)

    @classmethod
    def from_source(cls, tokenizer: GrammarTokenizer, source: str, description: str) -> Grammar:
        """Compile llguidance grammar JSON (`Grammar.source` of a grammar built by the constructors
        below): how a grammar crosses a process boundary (`ignis.runtime.server.engine_process`).

        Raises:
            GrammarError: llguidance cannot compile it.
        """
        return cls._compile(tokenizer, source, description)

    @classmethod
    def json_schema(
        cls, tokenizer: GrammarTokenizer, schema: Mapping[str, Any] | bool, *, name: str | None = None
    ) -> Grammar:
        """JSON text valid against `schema` (JSON Schema draft 2020-12 as llguidance supports it:
        types, properties/required, additionalProperties, enum/const, anyOf/oneOf/allOf, $ref/$defs,
        string/number/array bounds, pattern, format). Whitespace is Python's `json.dumps` style:
        ", " between items, ": " after keys, no other whitespace, so a model cannot pad the output
        with whitespace forever (a schema's `x-guidance` options may change it).

        Raises:
            GrammarError: the schema is not JSON-serialisable or llguidance cannot compile it.
        """
        llg = _llguidance()
        what = f"json_schema {name!r}" if name else "json_schema"
        try:
            text = json.dumps(schema)
            source = llg.LLMatcher.grammar_from_json_schema(text, defaults=dict(_JSON_STYLE))
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"{what} is not a valid JSON schema: {exc}") from exc
        return cls._compile(tokenizer, source, what)

    @classmethod
    def json_object(cls, tokenizer: GrammarTokenizer) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        g = cls.json_schema(tokenizer, {"type": "object"})
        return Grammar(g.tokenizer, g.source, "json_object", g._prototype)

    @classmethod
    def lark(cls, tokenizer: GrammarTokenizer, grammar: str, *, description: str = "lark grammar") -> Grammar:
        """llguidance's Lark dialect (`%json { schema }` embeds a JSON schema as a rule).

        Raises:
            GrammarError: the grammar does not compile.
        """
        return cls._compile(tokenizer, _llguidance().LLMatcher.grammar_from_lark(grammar), description)

    @classmethod
    def regex(cls, tokenizer: GrammarTokenizer, pattern: str) -> Grammar:
        """Text matching the regular expression `pattern` (whole output).

        Raises:
            GrammarError: the pattern does not compile.
        """
        return cls._compile(tokenizer, _llguidance().LLMatcher.grammar_from_regex(pattern), "regex")

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (one per lane)."""
        return GrammarMatcher(self)


class GrammarMatcher:
    """One lane's position in its grammar.

    Args:
        grammar: the compiled grammar.

    Raises:
        GrammarError: llguidance refuses the grammar (checked when the grammar was built, so only a
            resource limit can trip here).
    """

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.tokenizer = grammar.tokenizer
        if grammar._prototype is not None:
            self.ll = grammar._prototype.deep_copy()
        else:
            self.ll = _llguidance().LLMatcher(grammar.tokenizer.ll, grammar.source, log_level=0)
        if self.ll.is_error():
            raise GrammarError(f"{grammar.description}: {self.ll.get_error()}")

    @property
    def is_error(self) -> bool:
        return bool(self.ll.is_error())

    @property
    def is_accepting(self) -> bool:
        """The tokens so far form a complete sentence of the grammar (EOS is allowed)."""
        return bool(self.ll.is_accepting())

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the current state's mask into `out` (int32 [num_words], CPU, contiguous).

        A matcher in an error state (a token outside the grammar was consumed: an engine bug or a
        grammar resource limit) allows the EOS ids only, so the lane ends instead of producing NaNs.
        """
        if self.ll.is_error():
            _eos_only(out, self.tokenizer)
            return
        self.ll.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if self.ll.is_error() or not bool(out.any()):  # no token of the vocabulary fits: end the lane
            _eos_only(out, self.tokenizer)

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance by committed tokens. Returns False if one was outside the grammar (the matcher is
        then in its error state and allows EOS only) or followed the grammar's end without being EOS."""
        ok = True
        for t in token_ids:
            if self.ll.is_stopped():  # complete (or EOS consumed): only EOS may follow
                ok = ok and int(t) in self.tokenizer.eos_token_ids
                continue
            ok = bool(self.ll.consume_token(int(t))) and ok
        return ok


def _eos_only(row: torch.Tensor, tok: GrammarTokenizer) -> None:
    row.zero_()
    for t in tok.eos_token_ids:
        if t < tok.vocab_size:
            row[t // 32] |= _bit(t % 32)


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else 1 << i  # the int32 value with bit i set


_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _llguidance().LLExecutor()
        return _EXECUTOR


def compute_round_masks(
    matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Every constrained lane's masks for one verify round (module docstring, step 1).

    Args:
        matchers: one matcher per constrained lane (all on the same `GrammarTokenizer`'s word count
            or not: each lane's rows are sized by its own tokenizer).
        drafts: each lane's draft ids d_1..d_k (k may be 0).

    Returns:
        per lane, int32 [k + 1, num_words] on the CPU: row j is the mask after d_1..d_j (all-ones after
        the first draft the grammar rejects). The matchers are left where they were.
    """
    out: list[torch.Tensor] = []
    groups: dict[int, list[int]] = {}
    for i, (m, d) in enumerate(zip(matchers, drafts, strict=True)):
        rows = torch.full((len(d) + 1, m.tokenizer.num_words), -1, dtype=torch.int32)
        out.append(rows)
        if m.ll.is_error():
            _eos_only(rows[0], m.tokenizer)
            continue
        groups.setdefault(m.tokenizer.num_words, []).append(i)
    for num_words, lanes in groups.items():
        # One contiguous buffer per mask width: llguidance writes lane i's rows at its offset.
        offsets, total = {}, 0
        for i in lanes:
            offsets[i] = total
            total += out[i].shape[0]
        buf = torch.full((total, num_words), -1, dtype=torch.int32)
        with_drafts = [
            (matchers[i].ll, offsets[i], [int(t) for t in drafts[i]]) for i in lanes if len(drafts[i])
        ]
        plain = [(matchers[i].ll, offsets[i]) for i in lanes if not len(drafts[i])]
        if with_drafts:
            _executor().unsafe_compute_mask_ptr_with_draft_token(
                with_drafts, buf.data_ptr(), num_words * 4, total
            )
        if plain:
            _executor().unsafe_compute_mask_ptr(plain, buf.data_ptr(), num_words * 4, total)
        for i in lanes:
            out[i].copy_(buf[offsets[i] : offsets[i] + out[i].shape[0]])
            if matchers[i].ll.is_error():  # a resource limit while computing: end the lane cleanly
                out[i].fill_(-1)
                _eos_only(out[i][0], matchers[i].tokenizer)
            for r in (out[i] == 0).all(dim=1).nonzero().flatten().tolist():  # no token fits: end the lane
                _eos_only(out[i][r], matchers[i].tokenizer)
    return out


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token whose mask bit is 0 set to -inf (a new tensor).

    Args:
        logits: float [n, vocab] (any float dtype, any device).
        bitmask: int32 [n, num_words] (any device; moved to the logits' device), bit i of word w is
            token 32 * w + i; tokens at or past 32 * num_words are disallowed.

    Raises:
        ValueError: the row counts differ.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"logits [n, vocab] and bitmask [n, words] must agree on n, got {tuple(logits.shape)} and "
            f"{tuple(bitmask.shape)}"
        )
    dev = logits.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    words = bitmask.to(dev, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(words.shape[0], -1)  # [n, 32 * words]
    vocab = logits.shape[1]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        pad = torch.zeros(words.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=dev)
        allowed = torch.cat([allowed, pad], dim=1)
    return logits.masked_fill(~allowed, float("-inf"))


# ---------------------------------------------------------------- the engine's hooks

_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _EXECUTOR_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ignis-grammar")
        return _POOL


@dataclass
class RoundMasks:
    """The masks of one verify round, being computed on the grammar thread.

    Attributes:
        lanes: the round's lane indices that are constrained.
        future: resolves to their masks (`compute_round_masks`, same order as `lanes`).
    """

    lanes: list[int]
    future: Future[list[torch.Tensor]]


def start_round_masks(
    matchers: Sequence[GrammarMatcher | None], drafts: Sequence[torch.Tensor]
) -> RoundMasks | None:
    """Start computing the round's masks for the constrained lanes on the grammar thread (the engine
    calls this before launching the forward, so the masks are computed while the forward runs).

    Args:
        matchers: per lane of the round, its matcher or None (unconstrained).
        drafts: per lane, its draft ids int64 [k] (any device; constrained lanes' are read on the host).

    Returns:
        None when no lane is constrained.
    """
    lanes = [i for i, m in enumerate(matchers) if m is not None]
    if not lanes:
        return None
    ms = [matchers[i] for i in lanes]
    ds = [drafts[i].tolist() for i in lanes]
    return RoundMasks(lanes, _pool().submit(compute_round_masks, ms, ds))  # type: ignore[arg-type]


def mask_round_logits(logits: Sequence[torch.Tensor], masks: RoundMasks | None) -> list[torch.Tensor]:
    """Each lane's logits float [k+1, vocab], masked where the lane is constrained (waits for the masks).

    Raises:
        whatever computing the masks raised (a bug in the grammar library).
    """
    out = list(logits)
    if masks is None:
        return out
    for i, rows in zip(masks.lanes, masks.future.result(), strict=True):
        out[i] = apply_token_bitmask(out[i], rows)
    return out


def mask_first_logits(matcher: GrammarMatcher | None, logits: torch.Tensor) -> torch.Tensor:
    """A prefill's last-position logits float [vocab], masked with the matcher's current state."""
    if matcher is None:
        return logits
    row = torch.empty(matcher.tokenizer.num_words, dtype=torch.int32)
    matcher.fill_mask(row)
    return apply_token_bitmask(logits.unsqueeze(0), row.unsqueeze(0)).squeeze(0)
