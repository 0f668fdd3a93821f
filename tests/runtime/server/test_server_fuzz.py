"""Fuzz the API with schemathesis against the server's own OpenAPI schema: never a 5xx.

The schema is built from the app at collection time (the same code the running server serves; a
test checks the served /openapi.json equals it). Every generated request, valid per the schema or
deliberately invalid (schemathesis' negative mode), is sent over the Unix socket to the real server,
and the response is checked: not a server error, a documented status code and content type, a body
that matches the documented schema, and schema-invalid input rejected with a 4xx. Kept short for CI
(FUZZ_EXAMPLES per operation and mode); raise IGNIS_FUZZ_EXAMPLES for a longer run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks
from server_helpers import Running, serve
from toy_model import ToySource

from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.server.app import create_app
from ignis.runtime.server.lanes import LaneLoop
from ignis.runtime.server.metrics import ServerMetrics
from ignis.runtime.server.model import ModelSettings

FUZZ_EXAMPLES = int(os.environ.get("IGNIS_FUZZ_EXAMPLES", "30"))
# Both fuzzers: reproducible (derandomized, no example database), no deadline on a shared CPU.
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
SPEC = SpecDefaults("dflash2", 2)
CONTEXT = 48  # short outputs keep every example fast


def _schema_dict() -> dict:
    model = ToySource(context=CONTEXT).load(ModelSettings(spec=SPEC))
    lanes = LaneLoop(model.make_engine, max_lanes=4, queue_size=64)
    return create_app(model, lanes, ServerMetrics(lambda: lanes.snapshot, 4)).openapi()


SCHEMA_DICT = _schema_dict()
schema = schemathesis.openapi.from_dict(SCHEMA_DICT)

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[Running]:
    with serve(ToySource(context=CONTEXT), SPEC, lanes=4, queue_size=64) as running:
        yield running


@pytest.fixture(scope="module")
def fuzz_client(fuzz_server: Running) -> Iterator[httpx.Client]:
    with fuzz_server.client(timeout=30) as c:
        yield c


def test_served_schema_is_the_fuzzed_schema(fuzz_client: httpx.Client) -> None:
    assert fuzz_client.get("/openapi.json").json() == SCHEMA_DICT


@schema.parametrize()
@FUZZ_SETTINGS
def test_api_never_fails_with_a_server_error(case: schemathesis.Case, fuzz_client: httpx.Client) -> None:
    kwargs = case.as_transport_kwargs(base_url="http://ignis")
    request = fuzz_client.build_request(
        kwargs["method"],
        kwargs["url"],
        headers=kwargs.get("headers"),
        params=kwargs.get("params"),
        json=kwargs.get("json"),
        content=kwargs.get("data"),
        cookies=kwargs.get("cookies"),
    )
    response = fuzz_client.send(request)
    assert response.status_code < 500, (response.status_code, response.text[:500], case.as_curl_command())
    case.validate_response(response, checks=CHECKS)


def test_server_still_healthy_after_fuzzing(fuzz_server: Running, fuzz_client: httpx.Client) -> None:
    assert fuzz_client.get("/health").status_code == 200
    assert fuzz_server.server.lanes.num_inflight == 0
    assert fuzz_server.server.lanes.num_engine_restarts == 0


# ---------------------------------------------------------------- valid requests, many settings

VALID_COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.lists(st.integers(0, 49), min_size=1, max_size=30),
            st.text(alphabet="abcdefgh ij.\n", min_size=1, max_size=30),
        ),
        "max_tokens": st.integers(1, 40),
        "return_token_ids": st.just(True),
    },
    optional={
        "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0)),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.integers(-1, 60),
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(st.text(alphabet="abcdefgh ", min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 60), max_size=3),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
    },
)


@given(body=VALID_COMPLETION)
@FUZZ_SETTINGS
def test_valid_completions_are_served_consistently(fuzz_client: httpx.Client, body: dict) -> None:
    r = fuzz_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        out = r.json()
        choice, usage = out["choices"][0], out["usage"]
        ids = choice["token_ids"]
    else:
        blocks = [b for b in r.text.split("\n\n") if b.strip()]
        assert blocks[-1] == "data: [DONE]"
        chunks = [json.loads(b[len("data: ") :]) for b in blocks[:-1]]
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert sum(bool(c["choices"][0]["token_ids"]) for c in chunks) == len(ids)  # one token per chunk
        choice, usage = chunks[-1]["choices"][0], chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(ids) <= body["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + len(ids)
    assert choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "length":
        assert len(ids) == body["max_tokens"] or usage["total_tokens"] == CONTEXT
