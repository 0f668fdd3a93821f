"""Text that is not valid Unicode: a JSON body may spell a lone UTF-16 surrogate (`"\\ud800"`), which
Python's json module decodes into a str the tokenizer library cannot take. Such a prompt or message is
a 400 naming its field, like any other bad input, and the server goes on serving (in the default mode
and with the engine in its own process)."""

from __future__ import annotations

import json

import pytest
from server_helpers import serve
from toy_model import toy_tokenizer

from ignis.runtime.errors import TokenizerError

LONE = '"x \\ud800 y"'  # JSON text of a string holding a lone high surrogate

BODIES = [
    ("/v1/completions", '{"prompt": LONE, "max_tokens": 2}'.replace("LONE", LONE), "prompt"),
    ("/v1/completions", '{"prompt": [LONE], "max_tokens": 2}'.replace("LONE", LONE), "prompt"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": LONE}], "max_tokens": 2}'.replace("LONE", LONE),
        "messages",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": PARTS}], "max_tokens": 2}'.replace(
            "PARTS", '[{"type": "text", "text": LONE}]'
        ).replace("LONE", LONE),
        "messages",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "\\udfff"}], '
        '"max_tokens": 2, "stream": true}',
        "messages",
    ),
]


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_a_lone_surrogate_is_a_400_and_the_server_goes_on(engine_process: bool) -> None:
    with serve(engine_process=engine_process) as running, running.client() as c:
        for path, body, param in BODIES:
            r = c.post(path, content=body.encode(), headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, error
            assert "surrogate" in error["message"], error
        ok = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        # a surrogate pair (an emoji spelled in JSON escapes) is valid text
        pair = c.post(
            "/v1/completions",
            content=b'{"prompt": "a \\ud83d\\ude00", "max_tokens": 2}',
            headers={"content-type": "application/json"},
        )
        assert pair.status_code == 200, pair.text


def test_the_tokenizer_refuses_it_typed() -> None:
    tok = toy_tokenizer()
    with pytest.raises(TokenizerError, match=r"lone UTF-16 surrogate U\+D800 at character 2"):
        tok.encode(json.loads(LONE))
    assert tok.encode("x y") == tok.encode(json.loads('"x y"'))
