"""The agents' API end to end on the tiny hybrids with their families' templates, over the socket with
the `openai` client: qwen3_5 (Qwen3.5's XML tool calls, `qwen3_xml` parser) with the MTP drafter and
qwen3_next (Hermes tool calls) with the MTP drafter. The models are random, so their calls are what the
forced-call grammar allows: the test checks that a named or required call comes back as `tool_calls`
with arguments valid for the tool's schema, streamed deltas equal the whole reply, and a json_schema
reply is JSON for the schema and equal (greedy token ids) to the in-process speculation-off run."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_helpers import serve
from tool_templates import _HEAD, QWEN3_HERMES_TEMPLATE, QWEN3_XML_TEMPLATE

pytest.importorskip("llguidance")

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.server.model import ModelSettings, ServedModel
from ignis.runtime.tokenizer import Tokenizer, TokenizerSpec

TESTS = Path(__file__).resolve().parents[2]
VOCAB = 320
EOS = 2  # tiny_tokenizer's <|im_end|>


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@cache
def _tokenizer(template: str) -> Tokenizer:
    fast = _load("hf_tiny").tiny_tokenizer(VOCAB)
    spec = TokenizerSpec(
        tokenizer_json=fast.backend_tokenizer.to_str(),
        chat_template=template,
        special_tokens={"eos_token": "<|im_end|>"},
        eos_token_ids=(EOS,),
    )
    return Tokenizer(spec)


@dataclass
class HybridSource:
    """A `ModelSource` over a tiny hybrid target with its random MTP head."""

    family: str
    folder: Path
    template: str
    name: str = "tiny"
    aliases: tuple[str, ...] = ()
    spec_kinds: tuple[str, ...] = ("mtp",)
    profile: str | None = None
    checkpoint_bytes: int = 0  # a card pool of prompt checkpoints (`PrefixCache`); 0: none

    def __post_init__(self) -> None:
        from ignis.runtime.drafters.mtp import load_mtp_checkpoint
        from ignis.runtime.families import get_family
        from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors
        from ignis.tools.make_test_drafter import make_mtp_drafter

        tiny = _load("hf_tiny_hybrid").make_tiny_hybrid(self.family, self.folder / "target")
        make_mtp_drafter(tiny.folder, self.folder / "with_mtp", seed=11)
        self.config, self.tensors = load_mtp_checkpoint(self.folder / "with_mtp")
        weights = canonicalize_moe_tensors(self.config, self.tensors)
        self.ex = get_family(self.config.model_type).make_executor(self.config, weights, "cpu", torch.float32)

    def missing_backend_reason(self, backend: str) -> str:
        return f"no {backend} drafter"

    def load(self, settings: ModelSettings) -> ServedModel:
        from ignis.runtime.drafters.mtp import build_mtp_drafter
        from ignis.runtime.prefix_cache import PrefixCache

        tok = _tokenizer(self.template)
        spec = settings.spec
        cache = None
        if self.checkpoint_bytes:
            cache = PrefixCache(card_bytes=self.checkpoint_bytes, host_bytes=0, pin_host_memory=False)

        def make_engine(max_lanes: int, metrics: SpeculativeMetrics) -> SpeculativeEngine:
            drafter = None
            if spec.backend == "mtp":
                drafter = build_mtp_drafter(target_config=self.config, target_weights=self.tensors)
            return SpeculativeEngine(
                self.ex,
                drafter,
                draft_tokens=spec.draft_tokens if drafter else None,
                eos_token_ids=(EOS,),
                detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
                max_lanes=max_lanes,
                metrics=metrics,
                prefix_cache=cache,
            )

        return ServedModel(
            name=self.name, tokenizer=tok, make_engine=make_engine, spec=spec, prefix_cache=cache
        )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
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
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Weather in Köln for three days?"}]
# The tools' list is left out of the system turn: the tiny BPE spells it a byte a token, past the tiny
# models' 512-token context. The call syntax (what the parsers and grammars use) is the family's.
CASES = [
    ("qwen3_5", QWEN3_XML_TEMPLATE.replace(_HEAD, "")),
    ("qwen3_next", QWEN3_HERMES_TEMPLATE.replace(_HEAD, "")),
]


def _stream(oai: openai.OpenAI, **kwargs):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def _check_args(name: str, args: dict) -> None:
    if name == "get_weather":
        assert set(args) == {"city", "days"} and isinstance(args["city"], str), args
        assert len(args["city"]) <= 12 and 1 <= args["days"] <= 7, args
    else:
        assert args in ({"zone": "UTC"}, {"zone": "CET"}), args


@pytest.mark.parametrize(("family", "template"), CASES, ids=[c[0] for c in CASES])
def test_tiny_hybrid_tool_calls_and_json_over_the_socket(tmp_path: Path, family: str, template: str) -> None:
    source = HybridSource(family, tmp_path, template, checkpoint_bytes=1 << 30)
    with serve(source, SpecDefaults(backend="mtp", draft_tokens=3), lanes=2) as running:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(running.socket)), timeout=120)
        oai = openai.OpenAI(base_url="http://ignis/v1", api_key="x", http_client=http, max_retries=0)
        base = {
            "model": "tiny",
            "messages": USER,
            "tools": [WEATHER, TIME],
            "temperature": 0,
            "max_tokens": 240,
        }
        named = {**base, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        whole = oai.chat.completions.create(**named, extra_body={"return_token_ids": True})
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        _check_args("get_weather", args)
        calls, finish = _stream(oai, **named)
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)]
        # required, several calls allowed; sampled (seeded) so the model picks among both tools.
        for seed in range(3):
            out = oai.chat.completions.create(
                **{**base, "temperature": 1.0, "seed": seed}, tool_choice="required"
            )
            c = out.choices[0]
            assert c.finish_reason in ("tool_calls", "length"), c
            if c.finish_reason == "tool_calls":
                assert c.message.tool_calls and not getattr(c.message, "tool_call_errors", None)
                for tc in c.message.tool_calls:
                    _check_args(tc.function.name, json.loads(tc.function.arguments))
        # A conversation carrying the call and its result is rendered through the family's template.
        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        follow = oai.chat.completions.create(
            **{**base, "max_tokens": 8, "messages": history}, extra_body={"return_token_ids": True}
        )
        assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
        rendered = _tokenizer(template).decode(follow.choices[0].prompt_token_ids)  # type: ignore[attr-defined]
        spelled = {
            args["city"],
            json.dumps(args["city"])[1:-1],
            json.dumps(args["city"], ensure_ascii=False)[1:-1],
        }
        assert "get_weather" in rendered and any(c in rendered for c in spelled), rendered
        assert "<tool_response>\nsunny" in rendered
        # The conversation grows append-only: the next turn's prompt text starts with the last turn's
        # prompt and reply (the call re-rendered as the model wrote it), so its prefix can be reused.
        tok = _tokenizer(template)
        before = tok.decode([*choice.prompt_token_ids, *choice.token_ids])  # type: ignore[attr-defined]
        assert rendered.startswith(before), (before, rendered)
        assert follow.choices[0].prompt_token_ids[: len(choice.prompt_token_ids)] == choice.prompt_token_ids  # type: ignore[attr-defined]
        # ... and it is reused: the turn carrying the tool result starts from a prompt checkpoint
        # (the last turn's prompt or reply), prefilling only the call's rendering and the result.
        assert follow.usage is not None and follow.usage.prompt_tokens_details is not None
        cached = follow.usage.prompt_tokens_details.cached_tokens
        assert len(choice.prompt_token_ids) <= cached < follow.usage.prompt_tokens, cached  # type: ignore[attr-defined]
        # json_schema: valid JSON; greedy ids served with MTP equal the in-process spec-off run.
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
        js = oai.chat.completions.create(
            model="tiny",
            messages=USER,
            response_format=fmt,
            temperature=0,
            max_tokens=40,
            extra_body={"return_token_ids": True},
        )
        jc = js.choices[0]
        assert jc.finish_reason == "stop", jc
        value = json.loads(jc.message.content)
        assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
        from ignis.runtime.grammar import Grammar, GrammarTokenizer
        from ignis.runtime.sampling import SamplingParams

        tok = _tokenizer(template)
        grammar = Grammar.json_schema(GrammarTokenizer.from_tokenizer(tok, VOCAB), SCHEMA)
        prompt = tok.encode_chat(USER, add_generation_prompt=True)
        ref = SpeculativeEngine(source.ex, eos_token_ids=(EOS,)).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=40, grammar=grammar)
        )[0]
        assert list(ref.output_token_ids) == jc.token_ids  # type: ignore[attr-defined]
