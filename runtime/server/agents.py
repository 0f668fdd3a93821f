"""The agents' API of /v1/chat/completions: `tools` / `tool_choice` / `parallel_tool_calls` and
`response_format`, between the request models and the engine.

`plan_chat(req, model, vocab_size)` reads a request once and returns an `AgentPlan`:

- **response_format**: `text` (nothing to do), `json_object` (any JSON object) or `json_schema`
  (`{"json_schema": {"name", "schema", "strict"}}`) become a `Grammar` the engine enforces at every
  column of every verify round (`ignis.runtime.grammar`), so the reply is valid JSON (for the schema)
  whenever it finishes with "stop".
- **tool_choice**: `none` (tools are still shown to the template; the reply is plain content),
  `auto` (the default with tools: the reply is parsed for calls), `required` (a grammar forces one
  call, or one or more with `parallel_tool_calls`, to one of the tools, arguments valid against its
  parameter schema), or `{"type": "function", "function": {"name": N}}` (a grammar forces one call
  to N). The call syntax is the served template's (`ignis.runtime.server.tool_parsers`).
- **parallel_tool_calls** false: at most one call (the grammar allows one; with `auto` only the first
  parsed call is returned, later ones are dropped).

Conversation messages (`template_messages`): an assistant message's `tool_calls[].function.arguments`
(a JSON string in OpenAI's API) is handed to the chat template as an object, since templates iterate
it (`arguments | items`) or serialise it (`arguments | tojson`); a `tool` message is passed as is
(`tool_call_id`, `content`), as the templates expect.

Replies (`chat_message`, `ChatToolStream`): the text is split into `content` and `tool_calls`; a call
that does not parse stays in `content` and is named in `tool_call_errors`; `finish_reason` is
"tool_calls" when the model stopped after at least one call.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ignis.runtime.grammar import Grammar, GrammarError, GrammarTokenizer
from ignis.runtime.server.errors import InvalidRequestError
from ignis.runtime.server.tool_parsers import (
    ToolCall,
    ToolCallStream,
    ToolParser,
    parser_for_template,
    tool_names,
)
from ignis.runtime.stops import FINISH_STOP

__all__ = ["AgentPlan", "ChatToolStream", "chat_message", "plan_chat", "template_messages"]

logger = logging.getLogger("ignis.runtime.server")

FINISH_TOOL_CALLS = "tool_calls"


@dataclass
class AgentPlan:
    """What a chat request asks beyond plain text (module docstring).

    Attributes:
        parser: parses the reply for tool calls, or None (tool_choice none, or no tools).
        grammar: the constraint for the engine (`SamplingParams.grammar`), or None.
        parallel: more than one call may be returned.
    """

    parser: ToolParser | None = None
    grammar: Grammar | None = None
    parallel: bool = True
    text_tokenizer: Any = None  # decodes the reply keeping the call markers when they are special tokens


class KeepMarkers:
    """A tokenizer whose decode drops special tokens except `keep` (a parser's call markers that the
    vocabulary marks special, e.g. Hermes-2-Pro's `<tool_call>`): the reply's text keeps the markers
    the parser needs and loses the other special tokens (EOS, turn markers) as usual.

    Args:
        tokenizer: the served tokenizer (`encode`, `decode`, `special_token_ids`).
        keep: the special ids to keep in the text.
    """

    def __init__(self, tokenizer: Any, keep: frozenset[int]) -> None:
        self._tok = tokenizer
        self._drop = frozenset(getattr(tokenizer, "special_token_ids", ())) - keep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [t for t in ids if t not in self._drop]
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def detokenizer(self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True) -> Any:
        from ignis.runtime.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)  # type: ignore[arg-type]


def _marker_ids(tokenizer: Any, parser: ToolParser) -> frozenset[int]:
    special = frozenset(getattr(tokenizer, "special_token_ids", ()))
    to_id = getattr(tokenizer, "token_to_id", None)
    if not special or to_id is None:
        return frozenset()
    ids = {to_id(m) for m in (parser.start, parser.end)}
    return frozenset(i for i in ids if i is not None and i in special)


_TOKENIZERS: dict[int, tuple[Any, GrammarTokenizer]] = {}
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Any, vocab_size: int | None) -> GrammarTokenizer:
    """The served tokenizer's `GrammarTokenizer`, built once per tokenizer object.

    Raises:
        InvalidRequestError: the tokenizer cannot be read by the grammar library.
    """
    with _TOKENIZERS_LOCK:
        got = _TOKENIZERS.get(id(tokenizer))
        if got is not None and got[0] is tokenizer:
            return got[1]
        try:
            gt = GrammarTokenizer.from_tokenizer(tokenizer, vocab_size)
        except GrammarError as exc:
            raise InvalidRequestError(
                f"structured output is not available for this model: {exc}", param="response_format"
            ) from exc
        _TOKENIZERS[id(tokenizer)] = (tokenizer, gt)
        return gt


def _chat_template(tokenizer: Any, tools: Any) -> str | None:
    get = getattr(tokenizer, "get_chat_template", None)
    if get is None:
        return None
    try:
        return str(get(None, tools))
    except Exception:  # no template: plain chat models still get the fallback parser
        return None


def _response_format_grammar(rf: Mapping[str, Any], tokenizer: Any, vocab_size: int | None) -> Grammar | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object(grammar_tokenizer(tokenizer, vocab_size))
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidRequestError(
                'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                param="response_format.json_schema",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, Mapping | bool):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        name = spec.get("name") if isinstance(spec.get("name"), str) else None
        try:
            return Grammar.json_schema(grammar_tokenizer(tokenizer, vocab_size), schema, name=name)
        except GrammarError as exc:
            raise InvalidRequestError(str(exc), param="response_format.json_schema.schema") from exc
    raise InvalidRequestError(
        f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
        param="response_format.type",
    )


def plan_chat(req: Any, tokenizer: Any, vocab_size: int | None) -> AgentPlan:
    """Read a `ChatCompletionRequest`'s tools, tool_choice, parallel_tool_calls and response_format.

    Raises:
        InvalidRequestError: an unknown response_format type, a schema that does not compile, a
            tool_choice that is not none/auto/required/a named function, a named function not in
            `tools`, required/named without tools, or a JSON response_format with a forced call.
    """
    tools = req.tools or []
    plan = _plan(req, tokenizer, vocab_size, tools)
    if plan.parser is not None and (keep := _marker_ids(tokenizer, plan.parser)):
        plan.text_tokenizer = KeepMarkers(tokenizer, keep)
    if plan.grammar is not None and req.ignore_eos:
        raise InvalidRequestError(
            "ignore_eos cannot be combined with a response_format or a forced tool call: the grammar "
            "ends the reply with the end-of-sequence token",
            param="ignore_eos",
        )
    return plan


def _plan(req: Any, tokenizer: Any, vocab_size: int | None, tools: list[Any]) -> AgentPlan:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(
                'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                param=f"tools[{i}]",
            )
    rf = req.response_format
    if rf is not None and not isinstance(rf, Mapping):
        raise InvalidRequestError("response_format must be an object", param="response_format")
    grammar = _response_format_grammar(rf, tokenizer, vocab_size) if rf else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = req.parallel_tool_calls is not False
    names: list[str] | None = None
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in tool_names(tools):
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice"
            )
        names, parallel = [name], False
    elif choice == "required":
        if not tools:
            raise InvalidRequestError('tool_choice "required" needs tools', param="tool_choice")
        names = tool_names(tools)
    elif choice not in ("none", "auto"):
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if choice == "none" or not tools:
        return AgentPlan(grammar=grammar)
    parser = parser_for_template(_chat_template(tokenizer, tools))(tools)
    if names is None:
        return AgentPlan(parser=parser, grammar=grammar, parallel=parallel)
    if grammar is not None:
        raise InvalidRequestError(
            "response_format json_object/json_schema cannot be combined with a forced tool call "
            '(tool_choice "required" or a named function)',
            param="response_format",
        )
    gt = grammar_tokenizer(tokenizer, vocab_size)
    prefix, separator = call_layout(tokenizer, tools, parser)
    try:
        source = parser.call_grammar(names, parallel=parallel, prefix=prefix, separator=separator)
        grammar = Grammar.lark(gt, source, description=f"{parser.name} tool call")
    except GrammarError as exc:
        raise InvalidRequestError(
            f"the tools' parameter schemas cannot be compiled into a grammar: {exc}", param="tools"
        ) from exc
    return AgentPlan(parser=parser, grammar=grammar, parallel=parallel)


_PROBE_ARGS = {"a": 1}


def call_layout(tokenizer: Any, tools: Sequence[Mapping[str, Any]], parser: ToolParser) -> tuple[str, str]:
    """(prefix, separator): what the chat template writes before the first tool call of an assistant
    turn without content, and between two calls, read off the template by rendering a probe turn of
    two calls; ("", "\\n") when the template cannot render one (the forced-call grammar then makes
    the calls the parser reads, if not exactly the template's layout)."""
    name = tool_names(tools)[0]
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(_PROBE_ARGS)}}
    user = {"role": "user", "content": "u"}
    turn = {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", **call}, {"id": "c1", **call}]}
    try:
        head = str(tokenizer.apply_chat_template([user], add_generation_prompt=True, tools=list(tools)))
        full = str(
            tokenizer.apply_chat_template(
                template_messages([user, turn]), add_generation_prompt=False, tools=list(tools)
            )
        )
    except Exception:  # a template that refuses the probe: keep the default layout
        return "", "\n"
    if not full.startswith(head):
        return "", "\n"
    text = full[len(head) :]
    first = text.find(parser.start)
    end = text.find(parser.end, first)
    second = text.find(parser.start, end)
    if (
        first < 0
        or end < 0
        or second < 0
        or text[:first].strip()
        or text[end + len(parser.end) : second].strip()
    ):
        return "", "\n"
    return text[:first], text[end + len(parser.end) : second]


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool calls' `arguments` JSON strings become objects
    (an argument string that is not JSON, and anything not shaped like a tool call, is left as is:
    the template decides). The input is not modified."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not isinstance(calls, list):
            out.append(m)
            continue
        fixed = []
        for c in calls:
            if not isinstance(c, Mapping):
                fixed.append(c)
                continue
            c = dict(c)
            fn = c.get("function")
            if isinstance(fn, Mapping):
                fn = dict(fn)
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass
                c["function"] = fn
            fixed.append(c)
        out.append({**m, "tool_calls": fixed})
    return out


def _finish(plan: AgentPlan, finish_reason: str | None, num_calls: int) -> str | None:
    if finish_reason == FINISH_STOP and num_calls:
        return FINISH_TOOL_CALLS
    return finish_reason


def chat_message(plan: AgentPlan, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """A whole reply's `message` and `finish_reason` (module docstring, Replies)."""
    if plan.parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    res = plan.parser.parse(text)
    calls = res.tool_calls
    content = res.content
    if not plan.parallel and len(calls) > 1:
        calls = calls[:1]
    for err in res.errors:
        logger.warning("%s", err)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    if res.errors:
        msg["tool_call_errors"] = res.errors
    return msg, str(_finish(plan, finish_reason, len(calls)))


class ChatToolStream:
    """A streamed reply's deltas with tool calls parsed out (module docstring; the call deltas are
    OpenAI's: `{index, id, type, function: {name, arguments: ""}}`, then `{index, function:
    {arguments}}`)."""

    def __init__(self, plan: AgentPlan) -> None:
        assert plan.parser is not None
        self.plan = plan
        self.stream = ToolCallStream(plan.parser)
        self.num_calls = 0
        self.num_errors = 0

    def _deltas(self, events: list[str | ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, str):
                if out and "content" in out[-1] and len(out[-1]) == 1:
                    out[-1]["content"] += e
                else:
                    out.append({"content": e})
                continue
            if not self.plan.parallel and self.num_calls >= 1:
                continue  # parallel_tool_calls false: only the first call
            index = self.num_calls
            self.num_calls += 1
            head = {
                "index": index,
                "id": e.id,
                "type": "function",
                "function": {"name": e.name, "arguments": ""},
            }
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": e.arguments}}]})
        while self.num_errors < len(self.stream.errors):
            err = self.stream.errors[self.num_errors]
            self.num_errors += 1
            logger.warning("%s", err)
            out.append({"content": "", "tool_call_errors": [err]})
        return out

    def push(self, text: str, is_last: bool) -> list[dict[str, Any]]:
        """Deltas for one token's text (`is_last`: the reply's last token, flushes what is held)."""
        events = self.stream.push(text)
        if is_last:
            events += self.stream.finish()
        return self._deltas(events)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _finish(self.plan, finish_reason, self.num_calls)
