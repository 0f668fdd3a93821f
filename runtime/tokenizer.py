"""Tokenizer, chat template and incremental detokenizer (no transformers at run time).

- `TokenizerSpec`: what an artifact stores: the `tokenizers` JSON, the chat template(s), the named
  special tokens the template sees, and the ids that end generation. Importers build it (HF folders
  copy `tokenizer.json`; GGUF files rebuild it from `tokenizer.ggml.*`).
- `Tokenizer`: encode/decode through the `tokenizers` library, and `apply_chat_template`, which
  renders exactly what HF transformers' `apply_chat_template(..., tokenize=False)` renders: the same
  sandboxed jinja2 environment (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, the `{% generation %}`
  tag, `tojson` without HTML escaping, `raise_exception`, `strftime_now`, the restricted `dict` and
  `namespace`), the same inputs (messages with None-valued keys dropped and reasoning fields aliased,
  `tools`, `documents`, `add_generation_prompt`, the named special tokens as strings, extra kwargs),
  and `continue_final_message`. Source: transformers 5.24 `utils/chat_template_utils.py` and
  `tokenization_utils_base.py`.
- `IncrementalDetokenizer`: streams text from a growing list of token ids without ever emitting a
  partial UTF-8 character (the prefix-offset / read-offset technique of TGI and vLLM's
  `detokenize_incrementally`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from ignis.runtime.errors import TokenizerError

# HF's SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a chat template sees as variables.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as stored in an artifact; JSON-serializable via `to_dict` / `from_dict`.

    Attributes:
        tokenizer_json: the `tokenizers` serialization (the text of a `tokenizer.json`).
        chat_template: the default jinja2 chat template, or None.
        named_chat_templates: further templates by name (HF's list form, e.g. "tool_use").
        special_tokens: named special tokens as strings (bos_token, eos_token, ...), the variables
            HF passes to the chat template.
        eos_token_ids: ids that end generation (eos plus e.g. generation_config's extra ids).
        add_bos_token: the tokenizer's post-processor prepends bos (informational; encoding follows
            the post-processor in `tokenizer_json`).
    """

    tokenizer_json: str
    chat_template: str | None = None
    named_chat_templates: dict[str, str] = field(default_factory=dict)
    special_tokens: dict[str, str] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (eos_token_ids as a list)."""
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TokenizerSpec:
        """Inverse of `to_dict`. Raises TokenizerError on a missing `tokenizer_json`."""
        if "tokenizer_json" not in d:
            raise TokenizerError("tokenizer spec lacks 'tokenizer_json'")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["eos_token_ids"] = tuple(int(i) for i in kw.get("eos_token_ids", ()))
        return cls(**kw)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation (`Tokenizer.render_chat`).

    Attributes:
        text: the prompt text, as `apply_chat_template` renders it.
        plain_spans: [start, end) character ranges of `text` holding special-token text that came from
            the inputs (message content, tools, ...): encoded as plain text, not as control tokens.
    """

    text: str
    plain_spans: tuple[tuple[int, int], ...] = ()


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    Args:
        spec: the stored tokenizer.

    Raises:
        TokenizerError: `spec.tokenizer_json` cannot be parsed by `tokenizers`.
    """

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        try:
            self._tok = _HFTokenizer.from_str(spec.tokenizer_json)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"cannot parse the tokenizer JSON: {exc}") from exc
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._lock = threading.Lock()
        self._truncating_by_length: dict[int, _HFTokenizer] = {}
        self._plain: _HFTokenizer | None = None  # special-token matching off (`_plain_encode`)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation."""
        return self.spec.eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (skipped by `decode(skip_special_tokens=True)`)."""
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (vocabulary spelling), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of an id, or None."""
        return self._tok.id_to_token(token_id)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token can cover (the longest vocabulary or
        added-token spelling, in UTF-8 bytes: byte-level spellings over-count, which keeps it a bound)."""
        spellings = [*self._tok.get_vocab(with_added_tokens=True)]
        return max((len(t.encode("utf-8", "surrogatepass")) for t in spellings), default=1) or 1

    def min_tokens(self, text: str) -> int:
        """A cheap lower bound on `len(self.encode(text))`, computed without tokenizing (so a huge
        prompt can be refused in microseconds): bytes / (4 x max_token_bytes); the factor 4 covers
        normalizers that shorten text (NFC composition) before the model splits it."""
        return len(text.encode("utf-8", "surrogatepass")) // (4 * self.max_token_bytes)

    def encode(
        self, text: str, *, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. bos), as in HF.

        Tokenizes through `tokenizers`' batch call, which releases the GIL (its single-text `encode`
        holds it): a long text tokenized in a worker thread leaves the other Python threads (a
        server's event loop) running.

        Args:
            max_length: keep only the first max_length ids (special tokens the post-processor adds
                included), or None for all. The ids then reach Python as a list of at most max_length
                (building a list of millions holds the GIL): a caller that refuses prompts of
                max_length tokens or more learns all it needs (len == max_length means "at least").

        Raises:
            ValueError: max_length < 1.
            TokenizerError: text is not valid Unicode (a lone UTF-16 surrogate, which a JSON body can
                spell as `"\\ud800"`).
        """
        tok = self._tok if max_length is None else self._truncating(max_length)
        return _backend_ids(tok, text, add_special_tokens)

    def _truncating(self, max_length: int) -> _HFTokenizer:
        """A copy of the backend that truncates to max_length ids (cached; the backend's truncation
        setting is shared state, so the copy keeps `encode` thread-safe)."""
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        with self._lock:
            tok = self._truncating_by_length.get(max_length)
            if tok is None:
                tok = _HFTokenizer.from_str(self._tok.to_str())
                tok.enable_truncation(max_length)
                self._truncating_by_length[max_length] = tok
        return tok

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD, as in HF)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # ---- chat ----------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template source to render, chosen like HF's `get_chat_template`.

        `chat_template` may be a template source, or the name of one of `named_chat_templates`;
        with no argument, "tool_use" is taken when tools are given and it exists, else the default.

        Raises:
            TokenizerError: no template is available.
        """
        named = dict(self.spec.named_chat_templates)
        if self.spec.chat_template is not None:
            named.setdefault("default", self.spec.chat_template)
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise TokenizerError(
            "this tokenizer has no chat template; pass chat_template= or import a checkpoint whose "
            "tokenizer_config.json / chat_template.jinja / GGUF metadata carries one"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text, as HF's `apply_chat_template(tokenize=False)`.

        Args:
            messages: dicts with at least "role" and "content".
            add_generation_prompt: append the assistant header.
            continue_final_message: leave the last message open (True: its "content"; a str: that field).
            tools, documents: JSON-schema tool list / RAG documents, passed to the template.
            chat_template: a template source or a named template (see `get_chat_template`).
            **kwargs: further template variables (they override the special tokens of the same name).

        Raises:
            TokenizerError: no template, an invalid template, or the template's `raise_exception`.
        """
        source = self.get_chat_template(chat_template, tools)
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message and add_generation_prompt are not compatible")
        if not messages:
            raise TokenizerError("cannot apply the chat template to an empty conversation")
        try:
            template = _compile_template(source)
        except Exception as exc:
            raise TokenizerError(f"invalid chat template: {exc}") from exc

        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        chat = _alias_reasoning_fields(_plain(chat))
        final_message: str | None = None
        continue_fields: list[str] = []
        if continue_final_message:
            key = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = chat[-1].get(key)
            if final is None:
                raise TokenizerError(f'continue_final_message: the final message has no "{key}" to continue')
            continue_fields = [key]
            if key in _REASONING_FIELDS:
                continue_fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
            if not any(f in source for f in continue_fields):
                raise TokenizerError(
                    f'continue_final_message: "{key}" is not a field the chat template reads'
                )
            if isinstance(final, (list, tuple)):
                for block in reversed(final):
                    if "text" in block:
                        final_message = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise TokenizerError("continue_final_message: no text block in the final message")
            else:
                final_message = str(final)
                for f in continue_fields:
                    chat[-1][f] = chat[-1][f] + _CONTINUE_TAG

        variables = {**self.spec.special_tokens, **kwargs}
        try:
            rendered = template.render(
                messages=chat,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=_plain(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **_plain(variables),
            )
        except Exception as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

        if continue_final_message:
            assert final_message is not None
            tag = _CONTINUE_TAG.strip()
            if final_message.strip() not in rendered or tag not in rendered:
                raise TokenizerError("continue_final_message: the template dropped part of the final message")
            loc = rendered.rindex(tag)
            if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                rendered = rendered[:loc]
            else:
                rendered = rendered[:loc].rstrip()
        return rendered

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        parse_special_tokens: bool = False,
        max_length: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """The prompt ids of a conversation: `encode_chat_prompt(render_chat(...))`.

        With `parse_special_tokens` this is HF's `encode(apply_chat_template(...),
        add_special_tokens=False)` (the template writes any bos itself); without it (the default) the
        same except that special-token text the inputs carry is encoded as plain text.
        """
        prompt = self.render_chat(messages, parse_special_tokens=parse_special_tokens, **kwargs)
        return self.encode_chat_prompt(prompt, max_length=max_length)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        parse_special_tokens: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> ChatPrompt:
        """Render a conversation (`apply_chat_template`), remembering which special-token text came
        from the inputs rather than from the template.

        Without `parse_special_tokens`, every string of the inputs (messages, tools, documents, the
        template variables; keys and values) has each special token's text (e.g. "<|im_start|>")
        broken by a sentinel noncharacter (U+FDD0..U+FDEF, one the inputs do not hold) before
        rendering, so the template's own logic sees it as ordinary text; after rendering the
        sentinels are removed and the places they marked are returned as `ChatPrompt.plain_spans`,
        which `encode_chat_prompt` encodes as plain text. A client's content thus cannot forge a
        turn (a system message, a tool result): only the template writes control tokens.

        Raises:
            TokenizerError: as `apply_chat_template`; or every sentinel candidate occurs in the inputs.
        """
        specials = self._special_texts
        if parse_special_tokens or not specials:
            text = self.apply_chat_template(messages, tools=tools, documents=documents, **kwargs)
            return ChatPrompt(text)
        chat_template = kwargs.pop("chat_template", None)  # the template's own text is not an input
        used: set[str] = set(self.get_chat_template(chat_template, tools))
        _collect_chars((messages, tools, documents, kwargs), used)
        sentinel = next((chr(c) for c in range(0xFDD0, 0xFDF0) if chr(c) not in used), None)
        if sentinel is None:
            raise TokenizerError("the messages hold every sentinel character U+FDD0..U+FDEF")

        pattern, first_chars = self._special_pattern, self._special_first_chars

        def escape(text: str) -> str:  # one regex pass, only over strings that could hold a special token
            if not any(c in text for c in first_chars):
                return text
            return pattern.sub(lambda m: m.group()[0] + sentinel + m.group()[1:], text)

        text = self.apply_chat_template(
            _map_strings(messages, escape),
            tools=_map_strings(tools, escape),
            documents=_map_strings(documents, escape),
            chat_template=chat_template,
            **_map_strings(kwargs, escape),
        )
        if sentinel not in text:
            return ChatPrompt(text)
        pieces = text.split(sentinel)
        clean = "".join(pieces)
        spans: list[tuple[int, int]] = []
        pos = 0
        for piece in pieces[:-1]:
            pos += len(piece)  # the sentinel stood here, right after a special token's first character
            start = pos - 1
            length = next((len(t) for t in specials if clean.startswith(t, start)), 1)
            spans.append((start, start + length))
        return ChatPrompt(clean, tuple(spans))

    def encode_chat_prompt(self, prompt: ChatPrompt, *, max_length: int | None = None) -> list[int]:
        """Token ids of a rendered conversation (`render_chat`), `add_special_tokens=False`.

        The text is split at the special tokens the template wrote (as `tokenizers` splits at added
        tokens before normalizing), each of those becomes its id, and the text between them is
        encoded with special-token matching off, so the spans that came from the inputs stay plain
        text. With no such spans this is `encode(prompt.text, add_special_tokens=False)`.

        Args:
            max_length: keep only the first max_length ids (see `encode`).
        """
        if not prompt.plain_spans:
            return self.encode(prompt.text, add_special_tokens=False, max_length=max_length)
        text, spans = prompt.text, prompt.plain_spans
        ids: list[int] = []
        start = 0
        j = 0  # spans (increasing) that end at or before this match are behind us
        for match in self._special_pattern.finditer(text):
            a, b = match.span()
            while j < len(spans) and spans[j][1] <= a:
                j += 1
            if j < len(spans) and spans[j][0] < b:
                continue  # special-token text from the inputs: plain text
            if a > start:
                ids += self._plain_encode(text[start:a])
            token_id = self._tok.token_to_id(match.group())
            assert token_id is not None
            ids.append(token_id)
            start = b
            if max_length is not None and len(ids) >= max_length:
                return ids[:max_length]
        if start < len(text):
            ids += self._plain_encode(text[start:])
        return ids if max_length is None else ids[:max_length]

    def _plain_encode(self, text: str) -> list[int]:
        """Ids of text with special-token matching off (`encode_special_tokens`), on a copy of the
        backend (the flag is shared state); no post-processor."""
        with self._lock:
            if self._plain is None:
                self._plain = _HFTokenizer.from_str(self._tok.to_str())
                self._plain.encode_special_tokens = True
            tok = self._plain
        return _backend_ids(tok, text, False)

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """The text of every special added token, longest first."""
        found = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content}
        return tuple(sorted(found, key=lambda t: (-len(t), t)))

    @functools.cached_property
    def _special_first_chars(self) -> frozenset[str]:
        return frozenset(t[0] for t in self._special_texts)

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(re.escape(t) for t in self._special_texts))

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming detokenizer for the tokens that follow `prompt_ids`."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, never splitting a UTF-8 character.

    Technique (TGI `decode_token`, vLLM `detokenize_incrementally`): keep two offsets into the ids,
    `prefix_offset` <= `read_offset`. For each new id decode ids[prefix_offset:read_offset] and
    ids[prefix_offset:]; if the latter is longer and does not end in U+FFFD (an incomplete byte
    sequence), emit the difference and advance both offsets. Decoding with a few tokens of left
    context keeps decoders that treat the first token specially (leading-space stripping) right.
    `flush()` emits whatever is held back at the end of a stream (a truly invalid sequence).

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt (its last 5 ids serve as left context; never emitted).
        skip_special_tokens: drop special tokens (eos, ChatML markers) from the text.
    """

    _CONTEXT = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._read = len(self._ids)
        self._prefix = max(self._read - self._CONTEXT, 0)
        self._num_prompt = len(self._ids)

    @property
    def generated_ids(self) -> list[int]:
        """Ids added after the prompt."""
        return self._ids[self._num_prompt :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return delta
        return ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several ids (e.g. a committed speculative run); return the text they complete."""
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: return any held-back text (may contain U+FFFD for invalid bytes)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


# ---- jinja2 environment, as transformers builds it ---------------------------------------------------


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for HF's assistant-token
        # masks; rendering-wise it is transparent.
        tags = {"generation"}  # noqa: RUF012  (jinja2's Extension API)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class _TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _collect_chars(value: Any, out: set[str]) -> None:
    """Add every character of every string in value (nested dicts, lists, tuples; keys too) to out."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.update(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """value with fn applied to every string in it (nested dicts, lists, tuples; keys too)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_strings(v, fn) for v in value)
    return value


def _alias_reasoning_fields(chat: list[Any]) -> list[Any]:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types (HF's `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    with suppress(ImportError):
        import numpy as np

        if isinstance(value, np.generic):
            return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


__all__ = ["SPECIAL_TOKEN_NAMES", "ChatPrompt", "IncrementalDetokenizer", "Tokenizer", "TokenizerSpec"]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _backend_ids(tok: _HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Ids of one text through the backend's batch call (`encode_batch_fast` where it exists: no offsets).

    Raises:
        TokenizerError: text holds a lone UTF-16 surrogate (U+D800..U+DFFF: not Unicode scalar values,
            so `tokenizers` refuses the str with a TypeError); the message names the first one.
    """
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    try:
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)
    except TypeError:
        found = _SURROGATE.search(text)
        if found is None:
            raise
        raise TokenizerError(
            f"the text is not valid Unicode: it holds a lone UTF-16 surrogate U+{ord(found.group()):04X} "
            f"at character {found.start()}"
        ) from None
