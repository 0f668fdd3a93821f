"""Tokenizer, chat templates (held to HF's apply_chat_template) and the incremental detokenizer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ignis.compiler.importers.hf import read_hf_tokenizer
from ignis.runtime.errors import TokenizerError
from ignis.runtime.tokenizer import Tokenizer, TokenizerSpec

try:
    import hf_tiny
except ImportError:  # tests/ is not on sys.path: load the helper by file path
    _spec = importlib.util.spec_from_file_location(
        "hf_tiny", Path(__file__).resolve().parents[1] / "hf_tiny.py"
    )
    assert _spec is not None and _spec.loader is not None
    hf_tiny = importlib.util.module_from_spec(_spec)
    sys.modules["hf_tiny"] = hf_tiny
    _spec.loader.exec_module(hf_tiny)

# A template using what real ones use: namespace, loop controls, tojson with options, the
# generation tag, raise_exception, tools and documents, is-defined checks and special tokens.
RICH_TEMPLATE = """{{- bos_token if bos_token is defined else '' -}}
{%- set ns = namespace(n_user=0, last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.n_user = ns.n_user + 1 -%}
{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>
{% endif -%}
{%- if documents %}{% for d in documents %}<doc title="{{ d.title }}">{{ d.text }}</doc>
{% endfor %}{% endif -%}
{%- for m in messages %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('bad role: ' + m.role) }}
  {%- endif %}
<|im_start|>{{ m.role }}{% if loop.index0 == ns.last_user %} (last of {{ ns.n_user }}){% endif %}

  {%- if m.role == 'assistant' %}{% generation %}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}
    {%- if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}{% endgeneration %}
  {%- else %}
{{ m.content | trim }}
  {%- endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif -%}
{%- set closing = messages[-1].role == 'assistant' and not add_generation_prompt -%}
{{- eos_token if closing and eos_token is defined else '' -}}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "  2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Grüße 🙂 und 日本語"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get", "arguments": {"city": "Köln"}}]},
        {"role": "tool", "content": '{"t": 3}'},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "3 degrees", "reasoning": "tool said 3", "name": None},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get",
            "description": "weather <b>&</b>",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
DOCS = [{"title": "a", "text": "alpha"}, {"title": "b", "text": "beta"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ignis Tokenizer, HF PreTrainedTokenizerFast) over the same tiny tokenizer folder."""
    import transformers

    folder = tmp_path_factory.mktemp("tok")
    hf_tiny.tiny_tokenizer().save_pretrained(folder)
    spec = read_hf_tokenizer(folder)
    assert spec is not None
    return Tokenizer(spec), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [False, True])
def test_chatml_template_matches_hf(tiny, conv, gen):
    ours, hf = tiny
    msgs = CONVERSATIONS[conv][:2] if conv == 2 else CONVERSATIONS[conv]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert ours.encode_chat(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=gen, return_dict=False
    )


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize(
    "kwargs",
    [
        {"add_generation_prompt": True},
        {"add_generation_prompt": True, "tools": TOOLS, "documents": DOCS, "enable_thinking": False},
        {"add_generation_prompt": False, "bos_token": "<BOS>"},
    ],
)
def test_rich_template_matches_hf(tiny, conv, kwargs):
    ours, hf = tiny
    msgs = CONVERSATIONS[conv]
    want = hf.apply_chat_template(msgs, tokenize=False, chat_template=RICH_TEMPLATE, **kwargs)
    assert ours.apply_chat_template(msgs, chat_template=RICH_TEMPLATE, **kwargs) == want


def test_continue_final_message_matches_hf(tiny):
    ours, hf = tiny
    msgs = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    want = hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(msgs, continue_final_message=True) == want
    assert want.endswith("1, 2,")


def test_template_errors_are_typed(tiny):
    ours, _ = tiny
    with pytest.raises(TokenizerError, match="bad role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}], chat_template=RICH_TEMPLATE)
    with pytest.raises(TokenizerError, match="invalid chat template"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
    with pytest.raises(TokenizerError, match="not compatible"):
        ours.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True
        )
    bare = Tokenizer(TokenizerSpec(tokenizer_json=ours.spec.tokenizer_json))
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="tokenizer JSON"):
        Tokenizer(TokenizerSpec(tokenizer_json="{not json"))
    # The sandbox refuses attribute tricks, as HF's does.
    with pytest.raises(TokenizerError):
        ours.apply_chat_template(
            [{"role": "user", "content": "x"}],
            chat_template="{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}",
        )


def test_named_templates_and_spec_roundtrip(tiny):
    ours, _ = tiny
    spec = TokenizerSpec(
        tokenizer_json=ours.spec.tokenizer_json,
        chat_template="D{{ messages|length }}",
        named_chat_templates={"tool_use": "T{{ tools|length }}"},
        special_tokens={"eos_token": "<|im_end|>"},
        eos_token_ids=(2,),
    )
    assert TokenizerSpec.from_dict(spec.to_dict()) == spec
    tok = Tokenizer(spec)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=TOOLS) == "T1"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"
    assert tok.eos_token_ids == (2,)


TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnewlines",
    "Grüße aus Köln 🙂🚀 日本語のテキスト",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # 3.14159",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(tiny, text):
    ours, hf = tiny
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    d = tok.detokenizer(prompt, skip_special_tokens=skip)
    deltas = [d.add(t) for t in ids]
    deltas.append(d.flush())
    return deltas


def test_detokenizer_never_splits_a_character(tiny):
    ours, _ = tiny
    text = "Emoji 🙂🚀 and 日本語, then Grüße."
    ids = ours.encode(text)
    # The tiny vocabulary spells these characters with several byte tokens each.
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    deltas = _stream(ours, [], ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d == "") > 0  # some tokens completed no character


def test_detokenizer_prompt_context_and_special_tokens(tiny):
    ours, _ = tiny
    prompt = ours.encode("<|im_start|>user\nSay 🙂<|im_end|>\n<|im_start|>assistant\n")
    reply = ours.encode("Sure: 🙂 done<|im_end|>")
    assert "".join(_stream(ours, prompt, reply)) == "Sure: 🙂 done"
    assert "".join(_stream(ours, prompt, reply, skip=False)) == "Sure: 🙂 done<|im_end|>"
    d = ours.detokenizer(prompt)
    assert d.add_many(reply) + d.flush() == "Sure: 🙂 done"
    assert d.generated_ids == reply


def test_detokenizer_flushes_invalid_bytes(tiny):
    ours, _ = tiny
    ids = ours.encode("ok 🙂")
    deltas = _stream(ours, [], ids[:-1])  # the emoji cut short: held back, then flushed
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert deltas[-1].endswith("\ufffd")
    assert "".join(deltas) == ours.decode(ids[:-1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24),
    st.text(alphabet="ab 🙂é日\n", max_size=6),
)
def test_detokenizer_stream_equals_full_decode(tiny, text, prompt_text):
    ours, _ = tiny
    prompt = ours.encode(prompt_text)
    ids = ours.encode(text)
    deltas = _stream(ours, prompt, ids)
    full = ours.decode(prompt + ids, skip_special_tokens=True)
    assert full.startswith(ours.decode(prompt, skip_special_tokens=True))
    assert "".join(deltas) == full[len(ours.decode(prompt, skip_special_tokens=True)) :]
    assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in text


def test_min_tokens_is_a_lower_bound_of_the_token_count(tiny):
    """The server refuses huge prompts from `min_tokens` without tokenizing; it must never exceed the
    real count, or a prompt that fits would be refused."""
    import random

    tok, _ = tiny
    rng = random.Random(0)
    alphabet = "ab c\n\t\u00e9\u20ac\U0001f600<|im_start|>" + "".join(chr(i) for i in range(0x300, 0x310))
    for n in (0, 1, 10, 1000, 20000):
        text = "".join(rng.choice(alphabet) for _ in range(n))
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False))
    assert tok.min_tokens("x" * (4 * tok.max_token_bytes * 10)) == 10
