"""Lanes under load: 8 concurrent streams equal to each request alone; disconnects free lanes; the queue.

The toy model's logits do not depend on batching (float64, column by column), so a greedy request
must give exactly the same tokens alone and among 7 others, with any drafts. Seeded sampling is
compared too: with dflash2 a lane's drafts do not depend on the other lanes, so its random stream
draws the same numbers either way.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from server_helpers import serve
from toy_model import ToySource

from ignis.runtime.profiles import SpecDefaults

REQUESTS = [
    (
        "/v1/completions",
        {"prompt": [5, 9, 13, 2, 40], "max_tokens": 40, "temperature": 0, "ignore_eos": True},
    ),
    ("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 33, "temperature": 0}),
    (
        "/v1/completions",
        {"prompt": [1], "max_tokens": 57, "temperature": 0, "ignore_eos": True, "stop": ["q7"]},
    ),
    (
        "/v1/completions",
        {"prompt": [3, 3, 3, 3], "max_tokens": 25, "temperature": 0.8, "top_k": 10, "seed": 7},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "why?"}],
            "max_tokens": 19,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 123,
        },
    ),
    ("/v1/completions", {"prompt": [44, 1, 17, 28, 30, 31, 2], "max_tokens": 1, "temperature": 0}),
    (
        "/v1/completions",
        {
            "prompt": "abc def ghi",
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stop_token_ids": [11],
        },
    ),
]


def _parse(body: str) -> tuple[list[int], str, dict, str | None, int]:
    """(token ids, text, usage, finish_reason, number of token chunks) of an SSE body."""
    ids: list[int] = []
    text: list[str] = []
    usage: dict = {}
    finish = None
    num_chunks = 0
    blocks = [b for b in body.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    for block in blocks[:-1]:
        chunk = json.loads(block[len("data: ") :])
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        ids.extend(choice["token_ids"])
        num_chunks += bool(choice["token_ids"])
        text.append(choice["delta"]["content"] if "delta" in choice else choice["text"])
        finish = choice["finish_reason"] or finish
    return ids, "".join(text), usage, finish, num_chunks


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict
) -> tuple[list[int], str, dict, str | None, int]:
    r = await client.post(path, json={**body, "stream": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return _parse(r.text)


@pytest.mark.parametrize(
    "spec",
    [SpecDefaults("dflash2", 3), SpecDefaults("mtp", 3, 16), SpecDefaults("off")],
    ids=["dflash2", "mtp", "off"],
)
@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_eight_concurrent_streams_equal_each_alone(spec: SpecDefaults, engine_process: bool) -> None:
    with serve(
        ToySource(drafter_seed=0 if spec.backend != "mtp" else 1),
        spec,
        lanes=8,
        engine_process=engine_process,
    ) as running:

        async def main() -> None:
            async with running.async_client() as client:
                alone = [await _stream(client, path, body) for path, body in REQUESTS]
                together = await asyncio.gather(*(_stream(client, path, body) for path, body in REQUESTS))
            for (path, body), a, t in zip(REQUESTS, alone, together, strict=True):
                ids, _text, usage, finish, num_chunks = t
                sampled = body.get("temperature", 1) != 0
                if not sampled or spec.backend != "mtp":  # mtp's drafts depend on the lane count
                    assert t == a, (path, body)
                assert num_chunks == len(ids) == usage["completion_tokens"]
                assert usage["total_tokens"] == usage["prompt_tokens"] + len(ids)
                assert finish in ("stop", "length")
                if "max_tokens" in body:
                    assert len(ids) <= body["max_tokens"]
                if finish == "length":
                    assert len(ids) == body["max_tokens"]

        asyncio.run(main())
        # Every lane was released.
        assert running.server.lanes.num_inflight == 0


def _raw_stream_request(path: str, body: dict) -> bytes:
    payload = json.dumps({**body, "stream": True}).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: ignis\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_client_killed_mid_stream_frees_its_lane(engine_process: bool) -> None:
    # One lane, 20 ms a forward: the killed request alone would hold the lane for ~4 s.
    with serve(
        ToySource(step_delay=0.02), SpecDefaults("off"), lanes=1, queue_size=4, engine_process=engine_process
    ) as running:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(running.socket))
        sock.sendall(
            _raw_stream_request(
                "/v1/completions", {"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True, "temperature": 0}
            )
        )
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
        sock.close()  # the client dies mid-stream
        t0 = time.monotonic()
        with running.client() as client:
            r = client.post("/v1/completions", json={"prompt": [3], "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200
            assert time.monotonic() - t0 < 2.0  # far less than the ~4 s the killed request needed
            assert _metric(client, 'ignis_request_finished_total{finish_reason="abort"}') == 1
            deadline = time.monotonic() + 5
            while running.server.lanes.num_inflight and time.monotonic() < deadline:
                time.sleep(0.01)
            assert running.server.lanes.num_inflight == 0
            assert client.get("/health").json()["lanes_active"] == 0


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_non_streaming_client_that_disconnects_frees_its_lane(engine_process: bool) -> None:
    with serve(
        ToySource(step_delay=0.02), SpecDefaults("off"), lanes=1, queue_size=4, engine_process=engine_process
    ) as running:
        payload = json.dumps({"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True}).encode()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(running.socket))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: ignis\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        deadline = time.monotonic() + 5
        while running.server.lanes.snapshot.num_active == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()
        deadline = time.monotonic() + 2
        while running.server.lanes.num_inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.server.lanes.num_inflight == 0


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_full_queue_gets_503_with_retry_after_and_waiters_are_served(engine_process: bool) -> None:
    with serve(
        ToySource(step_delay=0.01),
        SpecDefaults("off"),
        lanes=1,
        queue_size=1,
        retry_after=7,
        engine_process=engine_process,
    ) as running:

        async def main() -> None:
            async with running.async_client() as client:
                long_body = {"prompt": [1, 2], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
                first = asyncio.ensure_future(client.post("/v1/completions", json=long_body))
                while running.server.lanes.num_inflight < 1:
                    await asyncio.sleep(0.005)
                second = asyncio.ensure_future(
                    client.post("/v1/completions", json={**long_body, "max_tokens": 5})
                )
                while running.server.lanes.num_inflight < 2:
                    await asyncio.sleep(0.005)
                third = await client.post("/v1/completions", json=long_body)
                assert third.status_code == 503
                assert third.headers["retry-after"] == "7"
                assert third.json()["error"]["code"] == "queue_full"
                assert third.json()["error"]["message"] == (
                    "the lane is busy and 1 request is already waiting; retry after 7 s"
                )
                r1, r2 = await first, await second
                assert r1.status_code == r2.status_code == 200
                assert r2.json()["usage"]["completion_tokens"] == 5
                # The queue drained: a new request is taken again.
                assert (await client.post("/v1/completions", json=long_body)).status_code == 200

        asyncio.run(main())
        with running.client() as client:
            assert _metric(client, 'ignis_requests_total{endpoint="/v1/completions",status="503"}') == 1


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_engine_failure_fails_the_requests_in_flight_and_the_server_recovers(engine_process: bool) -> None:
    with (
        serve(
            ToySource(fail_after_steps=3), SpecDefaults("off"), lanes=2, engine_process=engine_process
        ) as running,
        running.client() as client,
    ):
        r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        streamed = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5, "stream": True})
        assert streamed.status_code == 200 and "error" not in streamed.text
        assert running.server.lanes.num_engine_restarts == 1
        assert client.get("/health").status_code == 200


def test_health_counts_a_lane_while_its_prefill_runs() -> None:
    """/health and the gauges see a request as active from the step that prefills it (a long prefill
    is not an idle server), and a second one behind it as waiting."""
    with serve(ToySource(step_delay=1.5), SpecDefaults("off"), lanes=1, queue_size=4) as running:

        async def main() -> None:
            async with running.async_client() as client:
                body = {"prompt": [1, 2], "max_tokens": 1, "temperature": 0}
                first = asyncio.ensure_future(client.post("/v1/completions", json=body))
                t0 = time.monotonic()
                while (await client.get("/health")).json()["lanes_active"] != 1:
                    assert time.monotonic() - t0 < 1.0, "the prefilling request is not counted"
                    await asyncio.sleep(0.02)
                second = asyncio.ensure_future(client.post("/v1/completions", json=body))
                while running.server.lanes.num_inflight < 2:
                    await asyncio.sleep(0.005)
                health = (await client.get("/health")).json()
                assert (health["lanes_active"], health["requests_waiting"]) == (1, 1)
                assert _metric(client_sync, "ignis_requests_waiting") == 1
                assert (await first).status_code == 200 and (await second).status_code == 200

        with running.client() as client_sync:
            asyncio.run(main())
