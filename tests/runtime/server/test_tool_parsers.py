"""Tool-call parsers (`ignis.runtime.server.tool_parsers`) on the text the families' chat templates
write for assistant tool calls (`tool_templates.py`): whole replies, several calls in a turn,
arguments with braces, quotes and newlines, every split of the text into stream chunks, malformed
calls kept as content with an error, the registry's choice by template, and the forced-call grammars
accepting exactly what the templates write."""

from __future__ import annotations

import json
import random

import pytest
from tool_templates import QWEN3_HERMES_TEMPLATE, QWEN3_XML_TEMPLATE

from ignis.runtime.server.agents import AgentPlan, ChatToolStream, call_layout, template_messages
from ignis.runtime.server.tool_parsers import (
    HermesToolParser,
    Qwen3XmlToolParser,
    ToolCall,
    ToolCallStream,
    ToolParser,
    parser_for_template,
    register_tool_parser,
    tool_parsers,
)
from ignis.runtime.tokenizer import Tokenizer, TokenizerSpec

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_code",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string"},
                    "env": {"type": "object"},
                    "args": {"type": "array", "items": {"type": "string"}},
                    "dry": {"type": "boolean"},
                },
                "required": ["code"],
            },
        },
    },
]

CALLS = [
    ("get_weather", {"city": "Köln", "days": 3}),
    (
        "run_code",
        {
            "code": 'def f(d):\n    return {"a": d["b"]} if d else {}\nprint(f({"b": "}{\\"quoted\\""}))',
            "env": {"PATH": "/bin", "nested": {"x": [1, {"y": "}"}]}},
            "args": ["--flag", 'say "hi"', "{}"],
            "dry": False,
        },
    ),
    ("get_weather", {"city": 'Quote "City", {braces}'}),
]

TEMPLATES = {"qwen3_xml": QWEN3_XML_TEMPLATE, "hermes": QWEN3_HERMES_TEMPLATE}


def _tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    hf = HFTokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    spec = TokenizerSpec(tokenizer_json=hf.to_str(), chat_template=template, eos_token_ids=(1,))
    return Tokenizer(spec)


def _assistant_text(template: str, content: str, calls) -> str:
    """What the template writes for an assistant turn (the text a model is trained to produce)."""
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)
    ]
    messages = template_messages(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": content, "tool_calls": tool_calls},
        ]
    )
    rendered = _tokenizer(template).apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)
    turn = rendered.rsplit("<|im_start|>assistant\n", 1)[1]
    return turn[: turn.rindex("<|im_end|>")]


def _check(calls: list[ToolCall], expected) -> None:
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in expected]
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("family", list(TEMPLATES))
@pytest.mark.parametrize("content", ["", "Let me look that up."])
@pytest.mark.parametrize("num_calls", [1, 2, 3])
def test_parser_reads_back_what_the_template_writes(family: str, content: str, num_calls: int) -> None:
    parser_cls = parser_for_template(TEMPLATES[family])
    assert parser_cls.name == family
    text = _assistant_text(TEMPLATES[family], content, CALLS[:num_calls])
    assert text.count("<tool_call>") == num_calls
    res = parser_cls(TOOLS).parse(text)
    _check(res.tool_calls, CALLS[:num_calls])
    assert (res.content or "").strip() == content and not res.errors


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_streamed_in_any_split_equals_whole(family: str) -> None:
    text = _assistant_text(TEMPLATES[family], "Checking both.", CALLS)
    parser = parser_for_template(TEMPLATES[family])(TOOLS)
    whole = parser.parse(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(0)
    for _ in range(50):  # many small chunks, as tokens arrive
        cuts = sorted(rng.sample(range(1, len(text)), 40))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for chunks in splits:
        stream = ToolCallStream(parser)
        events = [e for c in chunks for e in stream.push(c)] + stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert content == (whole.content or "")
        _check(calls, CALLS)
        assert not stream.errors


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_stream_deltas_have_openais_shape(family: str) -> None:
    text = _assistant_text(TEMPLATES[family], "", CALLS[:2])
    plan = AgentPlan(parser=parser_for_template(TEMPLATES[family])(TOOLS))
    stream = ChatToolStream(plan)
    deltas = []
    for i in range(0, len(text), 3):
        deltas += stream.push(text[i : i + 3], i + 3 >= len(text))
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [d["index"] for d in tool_deltas] == [0, 0, 1, 1]
    assert tool_deltas[0]["type"] == "function" and tool_deltas[0]["function"]["arguments"] == ""
    assert tool_deltas[0]["id"].startswith("call_") and "id" not in tool_deltas[1]
    for head, args, (name, expected) in zip(tool_deltas[::2], tool_deltas[1::2], CALLS[:2], strict=True):
        assert head["function"]["name"] == name
        assert json.loads(args["function"]["arguments"]) == expected
    assert "".join(d.get("content", "") for d in deltas) == ""  # not even the newline before a call
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


@pytest.mark.parametrize(
    ("family", "bad", "why"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "not JSON"),
        ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "not one of"),
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', "names no function"),
        (
            "qwen3_xml",
            "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
            "unexpected",
        ),
        ("qwen3_xml", "<tool_call>\n{oops}\n</tool_call>", "no <function=NAME>"),
    ],
)
def test_malformed_call_comes_back_as_content_with_an_error(family: str, bad: str, why: str) -> None:
    good = _assistant_text(TEMPLATES[family], "", CALLS[:1])
    parser = parser_for_template(TEMPLATES[family])(TOOLS)
    res = parser.parse(f"Sure.\n{bad}\n{good}")
    assert bad in (res.content or "") and len(res.errors) == 1 and why in res.errors[0]
    _check(res.tool_calls, CALLS[:1])


def test_a_call_cut_at_the_end_of_the_output_is_parsed() -> None:
    text = _assistant_text(QWEN3_HERMES_TEMPLATE, "", CALLS[:1])
    res = HermesToolParser(TOOLS).parse(text[: text.rindex("</tool_call>")])
    _check(res.tool_calls, CALLS[:1])
    res = HermesToolParser(TOOLS).parse('<tool_call>\n{"name": "get_weather", "argu')  # max_tokens cut
    assert not res.tool_calls and res.errors and "<tool_call>" in (res.content or "")


def test_text_that_only_looks_like_a_marker_is_content() -> None:
    parser = HermesToolParser(TOOLS)
    for text in ("a < b and <tool_ and <tool_callx>", "ends with <tool_cal"):
        stream = ToolCallStream(parser)
        events = [e for ch in text for e in stream.push(ch)] + stream.finish()
        assert "".join(events) == text and not stream.errors  # type: ignore[arg-type]


def test_whitespace_around_calls_is_not_content_but_text_keeps_its_own() -> None:
    parser = HermesToolParser(TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>'
    for text, content, num_calls in (
        (f"\n\n{call}\n", None, 1),
        (f"{call}\n{call}", None, 2),
        ("  indented answer", "  indented answer", 0),
        (f"Answer:\n{call}", "Answer:\n", 1),
        ("\n<tool", "\n<tool", 0),  # a marker's prefix at the end is text after all
    ):
        res = parser.parse(text)
        assert (res.content, len(res.tool_calls)) == (content, num_calls), text


def test_registry_chooses_by_template_and_falls_back_to_hermes() -> None:
    assert list(tool_parsers())[:2] == ["qwen3_xml", "hermes"]
    assert parser_for_template(QWEN3_XML_TEMPLATE) is Qwen3XmlToolParser
    assert parser_for_template(QWEN3_HERMES_TEMPLATE) is HermesToolParser
    assert parser_for_template("{{ messages }}") is HermesToolParser
    assert parser_for_template(None) is HermesToolParser

    class Custom(ToolParser):
        name = "custom"

        @classmethod
        def detect(cls, chat_template: str) -> bool:
            return "[CALL]" in chat_template

        def parse_call(self, body: str) -> ToolCall:
            raise NotImplementedError

        def call_grammar(self, names, *, parallel: bool, prefix: str = "", separator: str = "") -> str:
            raise NotImplementedError

    from ignis.runtime.server import tool_parsers as mod

    saved = list(mod._REGISTRY)
    try:
        register_tool_parser(Custom, priority=100)
        assert parser_for_template("[CALL] <tool_call>") is Custom
        assert parser_for_template(QWEN3_XML_TEMPLATE) is Qwen3XmlToolParser
    finally:
        mod._REGISTRY[:] = saved


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_forced_call_grammar_accepts_the_templates_calls_only(family: str) -> None:
    pytest.importorskip("llguidance")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hf_tiny import tiny_tokenizer

    from ignis.runtime.grammar import Grammar, GrammarTokenizer

    fast = tiny_tokenizer(384)
    gt = GrammarTokenizer(fast.backend_tokenizer.to_str(), 384, [fast.eos_token_id])
    parser = parser_for_template(TEMPLATES[family])(TOOLS)

    def accepts(grammar: Grammar, text: str) -> bool:
        m = grammar.matcher()
        return m.consume(fast.encode(text)) and m.is_accepting

    prefix, separator = call_layout(_tokenizer(TEMPLATES[family]), TOOLS, parser)
    assert (prefix, separator) == {"qwen3_xml": ("\n", "\n"), "hermes": ("", "\n")}[family]
    layout = {"prefix": prefix, "separator": separator}
    one = Grammar.lark(gt, parser.call_grammar(["get_weather"], parallel=False, **layout))
    many = Grammar.lark(gt, parser.call_grammar(["get_weather", "run_code"], parallel=True, **layout))
    first = _assistant_text(TEMPLATES[family], "", CALLS[:1])
    both = _assistant_text(TEMPLATES[family], "", CALLS[:2])
    assert accepts(one, first) and accepts(many, first) and accepts(many, both)
    assert not accepts(one, both)  # one call only
    assert not accepts(one, first.replace("get_weather", "get_weathe"))
    assert not accepts(one, "Sure! " + first)  # no text before a forced call


def test_chat_message_splits_content_calls_and_errors() -> None:
    from ignis.runtime.server.agents import chat_message

    parser = HermesToolParser(TOOLS)
    text = _assistant_text(QWEN3_HERMES_TEMPLATE, "", CALLS[:2]) + "\n<tool_call>\n{bad}\n</tool_call>"
    msg, finish = chat_message(AgentPlan(parser=parser), text, "stop")
    assert finish == "tool_calls" and [c["function"]["name"] for c in msg["tool_calls"]] == [
        "get_weather",
        "run_code",
    ]
    assert msg["content"] == "<tool_call>\n{bad}\n</tool_call>" and "not JSON" in msg["tool_call_errors"][0]
    one, _ = chat_message(AgentPlan(parser=parser, parallel=False), text, "stop")
    assert [c["function"]["name"] for c in one["tool_calls"]] == ["get_weather"]  # parallel_tool_calls false
    cut, finish = chat_message(AgentPlan(parser=parser), text, "length")
    assert finish == "length" and len(cut["tool_calls"]) == 2
    plain, finish = chat_message(AgentPlan(parser=parser), "no calls here", "stop")
    assert plain == {"role": "assistant", "content": "no calls here"} and finish == "stop"


def test_call_layout_falls_back_when_the_template_writes_no_calls() -> None:
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert call_layout(_tokenizer(plain), TOOLS, HermesToolParser(TOOLS)) == ("", "\n")


def test_call_markers_that_are_special_tokens_stay_in_the_reply_text() -> None:
    """A vocabulary that marks `<tool_call>` / `</tool_call>` special (Hermes-2-Pro's): decoding with
    skip_special_tokens would drop them and the call would be lost; the plan's text tokenizer keeps
    them and still drops the other special tokens (the EOS)."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from ignis.runtime.server.agents import plan_chat

    chars = sorted(set('abcdefghijklmnopqrstuvwxyz_ {}":,0123456789\n'))
    hf = HFTokenizer(
        models.WordLevel({c: i for i, c in enumerate(chars)} | {"<unk>": len(chars)}, unk_token="<unk>")
    )
    hf.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(["<eos>", "<tool_call>", "</tool_call>"])
    spec = TokenizerSpec(
        tokenizer_json=hf.to_str(),
        chat_template=QWEN3_HERMES_TEMPLATE,
        eos_token_ids=(hf.token_to_id("<eos>"),),
    )
    tok = Tokenizer(spec)
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "koln"}}\n</tool_call><eos>'
    ids = tok.encode(reply, add_special_tokens=False)
    assert "<tool_call>" not in tok.decode(ids, skip_special_tokens=True)  # what the plain path would see
    req = SimpleNamespace(
        tools=TOOLS, tool_choice="auto", parallel_tool_calls=None, response_format=None, ignore_eos=False
    )
    plan = plan_chat(req, tok, None)
    assert plan.parser is not None and plan.text_tokenizer is not None
    text = plan.text_tokenizer.decode(ids, skip_special_tokens=True)
    assert text == reply[: -len("<eos>")]
    streamed = plan.text_tokenizer.detokenizer([], skip_special_tokens=True)
    assert "".join(streamed.add(t) for t in ids) + streamed.flush() == text
    res = plan.parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in res.tool_calls] == [("get_weather", {"city": "koln"})]
    plain = plan_chat(SimpleNamespace(**{**vars(req), "tools": None, "tool_choice": None}), tok, None)
    assert plain.text_tokenizer is None
