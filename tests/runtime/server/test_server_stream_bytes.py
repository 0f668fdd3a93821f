"""The streamed bytes: the exact SSE body of fixed requests (a golden file written by the server before
its stream path was made cheaper, ids and timestamps normalized), one token per `data:` event, and a
committed run of several tokens written as one HTTP chunk.

Regenerate the golden file only for an intended change of the wire format:
IGNIS_WRITE_STREAM_GOLDEN=1 pytest tests/runtime/server/test_server_stream_bytes.py
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Running, serve

from ignis.runtime.profiles import SpecDefaults

GOLDEN = Path(__file__).parent / "data" / "stream_golden.json"

# (name, path, body): greedy requests whose output does not depend on timing or lanes
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("completion text", "/v1/completions", {"prompt": "hello there", "max_tokens": 12}),
    (
        "completion ids, usage, token ids",
        "/v1/completions",
        {
            "prompt": [5, 9, 14, 20],
            "max_tokens": 9,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    ),
    ("completion stop string", "/v1/completions", {"prompt": "abc", "max_tokens": 30, "stop": ["e", "zz"]}),
    ("completion logprobs", "/v1/completions", {"prompt": "abc", "max_tokens": 6, "logprobs": 2}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}),
    (
        "chat usage, token ids, non-ASCII",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "é, é: 'quoted'"}],
            "max_tokens": 14,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "chat logprobs",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    ("chat long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": 60}),
    (
        "completion stop token",
        "/v1/completions",
        {"prompt": "hello there", "max_tokens": 12, "stop_token_ids": [7]},
    ),
    (
        "chat stop token, usage",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10,
            "stop_token_ids": [7],
            "stream_options": {"include_usage": True},
        },
    ),
]


def raw_stream(running: Running, path: str, body: dict[str, Any]) -> tuple[int, list[bytes]]:
    """POST a streamed request over the socket with a plain HTTP/1.1 client; returns the status and the
    body's HTTP chunks (Transfer-Encoding: chunked), in order."""
    payload = json.dumps({**body, "stream": True, "temperature": 0}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(running.socket))
        s.sendall(
            b"POST %s HTTP/1.1\r\nHost: ignis\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (path.encode(), len(payload), payload)
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
    return status, chunks


def normalized(body: bytes) -> str:
    """The body with each request's random id and its creation time replaced by fixed values."""
    text = body.decode()
    text = re.sub(r'"id":"(chatcmpl|cmpl)-[0-9a-f]+"', r'"id":"\1-ID"', text)
    return re.sub(r'"created":\d+', '"created":0', text)


@pytest.fixture(scope="module", params=["dflash2", "off"])
def spec_server(request: pytest.FixtureRequest):
    spec = SpecDefaults(backend="dflash2", draft_tokens=3) if request.param != "off" else SpecDefaults("off")
    with serve(spec=spec, lanes=4) as running:
        yield running


def test_streams_are_byte_identical_to_the_golden_file(spec_server: Running) -> None:
    got = {}
    for name, path, body in REQUESTS:
        status, chunks = raw_stream(spec_server, path, body)
        assert status == 200, (name, chunks)
        got[name] = normalized(b"".join(chunks))
    if os.environ.get("IGNIS_WRITE_STREAM_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for name, _, _ in REQUESTS:
        assert got[name] == golden[name], name


def test_one_token_per_event_and_one_write_per_committed_run(spec_server: Running) -> None:
    """Each `data:` event carries one token (its token_ids), and the events of one committed run (a
    verify round's accepted drafts plus the bonus token) arrive in one HTTP chunk: with dflash2 at 3
    drafts that the target accepts (the toy drafter is the target), 4 tokens per chunk."""
    body = {"prompt": [3, 4, 5], "max_tokens": 21, "return_token_ids": True, "ignore_eos": True}
    status, chunks = raw_stream(spec_server, "/v1/completions", body)
    assert status == 200
    per_chunk = []
    for chunk in chunks:
        events = chunk.decode().split("\n\n")
        assert events[-1] == ""  # whole events only
        ids = [json.loads(e[6:])["choices"][0]["token_ids"] for e in events[:-1] if e != "data: [DONE]"]
        assert all(len(i) == 1 for i in ids), ids  # one token per event
        per_chunk.append(len(ids))
    assert sum(per_chunk) == 21
    assert chunks[-1].endswith(b"data: [DONE]\n\n")  # written with the last token
    # the first step emits the prefill's token and the first round's run (a lane prefilled in a step
    # joins that step's round); then one chunk per round
    if spec_server.server.model.spec.backend == "off":
        assert per_chunk == [2] + [1] * 19, per_chunk
    else:
        assert per_chunk == [5, 4, 4, 4, 4], per_chunk
