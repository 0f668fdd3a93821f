"""Clients over the Unix socket: the `openai` Python client (httpx transport) and `ignis.tools.chat`."""

from __future__ import annotations

import httpx
import openai
import pytest
from click.testing import CliRunner
from server_helpers import Running

from ignis.tools import chat

MESSAGES = [{"role": "user", "content": "tell me about lanes"}]


@pytest.fixture(scope="module")
def oai(server: Running) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket)))
    return openai.OpenAI(base_url="http://ignis/v1", api_key="unused", http_client=http, max_retries=0)


def test_openai_client_chat_stream_and_not(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=20, temperature=0)
    text = full.choices[0].message.content
    assert full.usage is not None and full.usage.completion_tokens <= 20
    stream = oai.chat.completions.create(
        model="toy",
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
    assert "".join(parts) == text
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_openai_client_completions_with_token_ids(oai: openai.OpenAI) -> None:
    out = oai.completions.create(
        model="toy",
        prompt=[4, 5, 6],
        max_tokens=7,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = out.choices[0]
    assert len(choice.token_ids) == 7 and choice.prompt_token_ids == [4, 5, 6]  # type: ignore[attr-defined]
    assert [m.id for m in oai.models.list().data] == ["toy"]


def test_openai_client_sees_openai_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="toy", messages=MESSAGES, max_tokens=0)
    assert "max_tokens" in str(err.value)


def test_chat_tool_one_question(server: Running, client: httpx.Client) -> None:
    want = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 15, "temperature": 0}
    ).json()["choices"][0]["message"]["content"]
    result = CliRunner().invoke(
        chat.main,
        ["--socket", str(server.socket), "--max-tokens", "15", "--stats", "tell", "me", "about", "lanes"],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == want + "\n"
    assert "tokens/round" in result.stderr and "first token" in result.stderr


def test_chat_tool_reads_stdin_and_reports_errors(server: Running) -> None:
    result = CliRunner().invoke(
        chat.main, ["--socket", str(server.socket), "--max-tokens", "4"], input="hi\n"
    )
    assert result.exit_code == 0 and result.stdout.endswith("\n")
    result = CliRunner().invoke(chat.main, ["--socket", str(server.socket), "--model", "nope", "hi"])
    assert result.exit_code == 1 and "HTTP 404" in result.output
    result = CliRunner().invoke(chat.main, ["--socket", str(server.socket) + ".missing", "hi"])
    assert result.exit_code == 1 and "cannot reach the server" in result.output
