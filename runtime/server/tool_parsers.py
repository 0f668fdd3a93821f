"""Tool-call parsers: the model's tool-call text -> OpenAI `tool_calls`, whole or streamed.

One parser per chat-template family, kept in a registry (`register_tool_parser`) and chosen from the
served model's chat template (`parser_for_template`): the first registered parser whose `detect`
accepts the template source wins, by priority. Shipped:

- `qwen3_xml` (Qwen3-Coder, Qwen3.5): the template writes a call as

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Köln
      </parameter>
      </function>
      </tool_call>

  a parameter's value is raw text for string parameters and JSON otherwise (the template's
  `value | tojson` for mappings and lists); values are typed back with the tool's parameter schema
  (an unparseable non-string value stays a string).
- `hermes` (Qwen2.5, Qwen3, Qwen3-Next, Hermes 2/3 and most ChatML tool templates; the fallback):
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Köln"}}\\n</tool_call>`.

Several calls in one turn follow each other; text before the first call is the reply's `content`.
A call that does not parse (bad JSON, no name, an unknown tool) is not dropped and never an error:
its text stays in `content` and `ToolCallResult.errors` says what was wrong (the server returns it as
`tool_call_errors` beside the content), as a marker a client can check.

Streaming (`ToolCallStream`): text outside calls is released as soon as it cannot be the start of a
call marker; a call is held until its end marker (or the end of the output), then sent as OpenAI's
deltas: first `{index, id, type: "function", function: {name, arguments: ""}}`, then the arguments
string (a whole call is held so that a malformed one can still come back as content).

The parsers also give the grammar that forces a call (`call_grammar`: `tool_choice` "required" or a
named function): llguidance's Lark dialect, with each tool's parameters as an embedded JSON schema.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "HermesToolParser",
    "Qwen3XmlToolParser",
    "ToolCall",
    "ToolCallResult",
    "ToolCallStream",
    "ToolCallSyntaxError",
    "ToolParser",
    "parser_for_template",
    "register_tool_parser",
    "tool_parsers",
]


class ToolCallSyntaxError(ValueError):
    """One call's text does not parse (the message says why)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `arguments` is a JSON object as a string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallResult:
    """A whole reply split into content and calls.

    Attributes:
        content: the text outside the calls (malformed calls' text included), or None when empty.
        tool_calls: the calls, in order.
        errors: one message per call that did not parse (its text is in `content`).
    """

    content: str | None
    tool_calls: list[ToolCall]
    errors: list[str] = field(default_factory=list)


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The function names of an OpenAI `tools` list (entries without one are skipped)."""
    out = []
    for t in tools or ():
        fn = t.get("function") if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            out.append(fn["name"])
    return out


def tool_parameters(tools: Sequence[Mapping[str, Any]] | None, name: str) -> dict[str, Any]:
    """The JSON schema of tool `name`'s parameters ({} when it has none or is unknown)."""
    for t in tools or ():
        fn = t.get("function") if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            return dict(params) if isinstance(params, Mapping) else {}
    return {}


class ToolParser(ABC):
    """One template family's tool-call syntax.

    Subclasses set `name`, `start`, `end` (the markers around one call) and implement `detect`,
    `parse_call` and `call_grammar`.

    Args:
        tools: the request's OpenAI `tools` (names are checked against it; parameter schemas type
            the XML format's values).
    """

    name: ClassVar[str]
    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = list(tools or [])
        self.names = set(tool_names(self.tools))

    @classmethod
    @abstractmethod
    def detect(cls, chat_template: str) -> bool:
        """True when `chat_template` (the Jinja source) writes tool calls in this syntax."""

    @abstractmethod
    def parse_call(self, body: str) -> ToolCall:
        """One call from the text between `start` and `end`.

        Raises:
            ToolCallSyntaxError: it does not parse, names no function, or names one not in `tools`.
        """

    @abstractmethod
    def call_grammar(
        self, names: Sequence[str], *, parallel: bool, prefix: str = "", separator: str = "\n"
    ) -> str:
        """llguidance Lark grammar of one call (or, with `parallel`, one or more calls) to one of the
        functions `names`, arguments valid against their parameter schemas; `prefix` is the text the
        template writes before the first call of a turn without content, `separator` between calls
        (`ignis.runtime.server.agents` reads both off the template)."""

    def is_complete(self, body: str) -> bool:
        """Whether a call's text without its end marker (the output ended) is a whole call."""
        return True

    def _check_name(self, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise ToolCallSyntaxError("the call names no function")
        if self.names and name not in self.names:
            raise ToolCallSyntaxError(f"the call names {name!r}, which is not one of the request's tools")
        return name

    def parse(self, text: str) -> ToolCallResult:
        """Split a whole reply into content and calls (module docstring)."""
        stream = ToolCallStream(self)
        events = stream.push(text) + stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        return ToolCallResult(
            content=content if content.strip() else None,
            tool_calls=[e for e in events if isinstance(e, ToolCall)],
            errors=list(stream.errors),
        )


def _hold_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallStream:
    """Incremental splitting of a reply into content text and calls (module docstring, Streaming).

    `push(text)` and `finish()` return events in order: str (content to send) or `ToolCall` (a whole
    call). A malformed call comes back as str (its raw text) and its message goes to `errors`.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._buf = ""
        self._in_call = False
        self._after_call = True  # at the start of the reply, as after a call
        self.errors: list[str] = []
        self.num_calls = 0

    def push(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        p = self.parser
        while True:
            if not self._in_call:
                if self._after_call:  # whitespace before, between or after calls is not content
                    stripped = self._buf.lstrip()
                    if not stripped or (p.start.startswith(stripped) and stripped != p.start):
                        return out  # undecided: only whitespace, or what may still become a marker
                    if stripped.startswith(p.start):
                        self._buf = stripped
                    self._after_call = False
                at = self._buf.find(p.start)
                if at < 0:
                    keep = _hold_back(self._buf, p.start)
                    send, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                    if send:
                        out.append(send)
                    return out
                if at:
                    out.append(self._buf[:at])
                self._buf = self._buf[at:]
                self._in_call = True
            at = self._buf.find(p.end, len(p.start))
            if at < 0:
                return out
            raw = self._buf[: at + len(p.end)]
            self._buf = self._buf[at + len(p.end) :]
            self._in_call = False
            out.append(self._call(raw, raw[len(p.start) : at]))
            self._after_call = not isinstance(out[-1], str)

    def finish(self) -> list[str | ToolCall]:
        """The end of the output: a call without its end marker is parsed as if it were closed
        (a model that stops right after a complete call); text held back is released."""
        rest, self._buf = self._buf, ""
        if not rest or (self._after_call and not rest.strip()):
            return []
        if self._in_call:
            self._in_call = False
            body = rest[len(self.parser.start) :]
            if not self.parser.is_complete(body):
                self.errors.append(f"malformed tool call ({self.parser.name} syntax): the call is cut off")
                return [rest]
            return [self._call(rest, body)]
        return [rest]

    def _call(self, raw: str, body: str) -> str | ToolCall:
        try:
            call = self.parser.parse_call(body)
        except ToolCallSyntaxError as exc:
            self.errors.append(f"malformed tool call ({self.parser.name} syntax): {exc}")
            return raw
        self.num_calls += 1
        return call


# ---------------------------------------------------------------- the registry

_REGISTRY: list[tuple[int, type[ToolParser]]] = []


def register_tool_parser(cls: type[ToolParser], *, priority: int = 0) -> type[ToolParser]:
    """Add a parser; higher priorities are tried first by `parser_for_template` (ties: first added)."""
    _REGISTRY.append((priority, cls))
    _REGISTRY.sort(key=lambda pc: -pc[0])
    return cls


def tool_parsers() -> dict[str, type[ToolParser]]:
    """The registered parsers by name, in the order they are tried."""
    return {cls.name: cls for _, cls in _REGISTRY}


def parser_for_template(chat_template: str | None) -> type[ToolParser]:
    """The parser for a chat template: the first registered one that detects it, else `hermes`
    (the common fallback)."""
    for _, cls in _REGISTRY:
        if chat_template and cls.detect(chat_template):
            return cls
    return HermesToolParser


# ---------------------------------------------------------------- hermes


def _call_schema(tools: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    options = []
    for name in names:
        params = tool_parameters(tools, name) or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _lark_string(text: str) -> str:
    return json.dumps(text)


_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _start_rule(parallel: bool, prefix: str, separator: str) -> str:
    """One call after `prefix`, or with `parallel` one or more separated by `separator`."""
    head = f"{_lark_string(prefix)} call" if prefix else "call"
    sep = f"{_lark_string(separator)} " if separator else ""
    return f"start: {head}" + (f" ({sep}call)*" if parallel else "")


def _json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro, Qwen2.5/3, Qwen3-Next)."""

    name = "hermes"

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return "<tool_call>" in chat_template

    def parse_call(self, body: str) -> ToolCall:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            raise ToolCallSyntaxError(f"the call is not JSON: {exc.msg} at character {exc.pos}") from None
        if not isinstance(obj, dict):
            raise ToolCallSyntaxError("the call is not a JSON object")
        name = self._check_name(obj.get("name"))
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolCallSyntaxError("the call's arguments are a string that is not JSON") from None
        if not isinstance(args, dict):
            raise ToolCallSyntaxError("the call's arguments are not a JSON object")
        return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))

    def call_grammar(
        self, names: Sequence[str], *, parallel: bool, prefix: str = "", separator: str = "\n"
    ) -> str:
        call = f"{_lark_string(self.start + chr(10))} {_json_rule(_call_schema(self.tools, names))} " + (
            _lark_string(chr(10) + self.end)
        )
        return f"{_start_rule(parallel, prefix, separator)}\ncall: {call}\n"


register_tool_parser(HermesToolParser, priority=0)


# ---------------------------------------------------------------- qwen3 xml

_FUNCTION = re.compile(r"^\s*<function=([^>\n]*)>(.*?)(?:</function>\s*)?$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed_value(raw: str, schema: Mapping[str, Any]) -> Any:
    """A parameter's value typed with its schema: strings raw, everything else JSON when it parses."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if types and all(t == "string" for t in types):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if types and "string" not in types and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        return raw  # no schema or an unparseable value: the text itself


def _length_bounds(schema: Mapping[str, Any]) -> str:
    """A regex repetition for a string schema's minLength / maxLength ("*" when unbounded)."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    lo = lo if isinstance(lo, int) and lo > 0 else 0
    if isinstance(hi, int) and hi >= lo:
        return f"{{{lo},{hi}}}"
    return f"{{{lo},}}" if lo else "*"


class Qwen3XmlToolParser(ToolParser):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`
    (Qwen3-Coder, Qwen3.5)."""

    name = "qwen3_xml"

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return "<function=" in chat_template and "<parameter=" in chat_template

    def is_complete(self, body: str) -> bool:
        return "</function>" in body

    def parse_call(self, body: str) -> ToolCall:
        m = _FUNCTION.match(body)
        if m is None:
            raise ToolCallSyntaxError("no <function=NAME> in the call")
        name = self._check_name(m.group(1).strip())
        props = tool_parameters(self.tools, name).get("properties", {})
        args: dict[str, Any] = {}
        inner = m.group(2)
        rest = _PARAMETER.sub("", inner).strip()
        if rest:
            raise ToolCallSyntaxError(f"unexpected text in the call: {rest[:40]!r}")
        for key, raw in _PARAMETER.findall(inner):
            key = key.strip()
            if not key:
                raise ToolCallSyntaxError("a <parameter=> has no name")
            schema = props.get(key, {}) if isinstance(props, Mapping) else {}
            args[key] = _typed_value(_strip_one_newline(raw), schema if isinstance(schema, Mapping) else {})
        return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))

    def call_grammar(
        self, names: Sequence[str], *, parallel: bool, prefix: str = "", separator: str = "\n"
    ) -> str:
        close = _lark_string("\n</parameter>\n")
        rules, alts = [], []
        for i, name in enumerate(names):
            params = tool_parameters(self.tools, name)
            props = params.get("properties", {}) if isinstance(params.get("properties"), Mapping) else {}
            required = set(params.get("required", []) or [])
            parts = []
            for j, (key, schema) in enumerate(props.items()):
                sch = schema if isinstance(schema, Mapping) else {}
                head = _lark_string(f"<parameter={key}>\n")
                if isinstance(sch.get("enum"), list) and all(isinstance(v, str) for v in sch["enum"]):
                    options = " | ".join(_lark_string(v) for v in sch["enum"]) or '""'
                    rules.append(f"p{i}_{j}: {head} ({options}) {close}")
                elif sch.get("type") == "string" or sch.get("type") == ["string"]:
                    # raw text up to the first closing tag (a lazy rule ending in its suffix), within
                    # the schema's length bounds
                    rules.append(f"p{i}_{j}: {head} v{i}_{j}")
                    rules.append(f"v{i}_{j}[suffix={close}]: /(.|\\n){_length_bounds(sch)}/")
                elif sch.get("type") == "boolean":  # the template's `value | string` writes True/False
                    rules.append(f'p{i}_{j}: {head} ("true" | "false" | "True" | "False") {close}')
                else:
                    rules.append(f"p{i}_{j}: {head} {_json_rule(sch)} {close}")
                parts.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
            rules.append(
                f"f{i}: {_lark_string(f'<function={name}>' + chr(10))} {' '.join(parts)} "
                f"{_lark_string('</function>' + chr(10))}"
            )
            alts.append(f"f{i}")
        call = f"{_lark_string(self.start + chr(10))} ({' | '.join(alts)}) {_lark_string(self.end)}"
        return "\n".join([_start_rule(parallel, prefix, separator), f"call: {call}", *rules]) + "\n"


register_tool_parser(Qwen3XmlToolParser, priority=10)
