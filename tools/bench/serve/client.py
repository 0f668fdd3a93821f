"""The HTTP side of `ignis-bench`: an httpx.AsyncClient over a Unix socket or TCP, one streamed request
timed client-side, and /metrics and /v1/models reads.

A request is sent with `"stream": true` and `"stream_options": {"include_usage": true}`; every
server-sent event with a non-empty `choices` is one token (ignis sends one token per chunk whatever
the committed run, as vLLM does). The arrival of each is stamped with `time.perf_counter` when its
line is parsed. The usage the server reports at the end is authoritative for the token counts: a
closing chunk that carries only `finish_reason` (no token) is dropped from the token times when the
chunk count exceeds `usage.completion_tokens` by one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ignis.tools.bench.serve.stats import MetricsSnapshot, RequestResult, parse_metrics

__all__ = ["BenchClient", "ServerError", "Target"]


class ServerError(Exception):
    """The server cannot be reached or does not answer as an OpenAI-compatible server (message says why)."""


@dataclass(frozen=True)
class Target:
    """Where the server is: a Unix socket path, or a TCP base URL.

    Attributes:
        socket: Unix socket path (None for TCP).
        url: base URL of a TCP server, e.g. http://127.0.0.1:8000 (ignored with a socket).
    """

    socket: str | None = None
    url: str = "http://127.0.0.1:8000"

    @property
    def where(self) -> str:
        return f"unix socket {self.socket}" if self.socket else self.url

    def client(self, timeout: float, max_connections: int) -> httpx.AsyncClient:
        """An AsyncClient for this target with room for `max_connections` streams at once."""
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        t = httpx.Timeout(timeout, connect=min(timeout, 30.0))
        if self.socket:
            transport = httpx.AsyncHTTPTransport(uds=self.socket, limits=limits)
            return httpx.AsyncClient(transport=transport, base_url="http://ignis", timeout=t)
        return httpx.AsyncClient(base_url=self.url.rstrip("/"), timeout=t, limits=limits)


def _error_message(response: httpx.Response) -> str:
    """The error code and message of an error response (OpenAI's shape), or its text cut to 200 chars."""
    try:
        err = response.json()["error"]
        code = err.get("code") or err.get("type") or ""
        return f"{code}: {err.get('message', '')}" if code else str(err.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        text = " ".join(response.text.split())
        return text[:200]


class BenchClient:
    """The benchmark's connection to one server.

    Args:
        target: where the server is.
        timeout: seconds to wait for the server between bytes (and for a whole non-streamed read).
        max_connections: streams that may be open at once (the run's concurrency).
    """

    def __init__(self, target: Target, *, timeout: float = 600.0, max_connections: int = 64) -> None:
        self.target = target
        self.http = target.client(timeout, max(1, max_connections) + 2)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def model_info(self) -> dict[str, Any]:
        """The first model of GET /v1/models ({"id", "max_model_len", ...}).

        Raises:
            ServerError: the server cannot be reached, refuses, or lists no model.
        """
        try:
            r = await self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach the server at {self.target.where}: {exc!r}") from exc
        if r.status_code != 200:
            raise ServerError(
                f"GET /v1/models at {self.target.where}: HTTP {r.status_code} {_error_message(r)}"
            )
        try:
            data = r.json()["data"]
            if not data:
                raise ServerError(f"the server at {self.target.where} lists no model")
            return dict(data[0])
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerError(
                f"{self.target.where} is not an OpenAI-compatible server: "
                f"GET /v1/models answered {r.text[:80]!r}"
            ) from exc

    async def metrics(self) -> MetricsSnapshot | None:
        """The server's /metrics now, or None when it has none (404) or cannot be read."""
        try:
            r = await self.http.get("/metrics")
            if r.status_code != 200:
                return None
            return parse_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            return None

    async def stream(
        self, path: str, body: dict[str, Any], result: RequestResult, t0: float
    ) -> RequestResult:
        """Send one streamed request and fill `result` with what the client saw.

        Args:
            path: "/v1/chat/completions" or "/v1/completions".
            body: the request (stream and stream_options are set here).
            result: the record to fill (index and prompt_id set by the caller).
            t0: the run's start (perf_counter), for `result.start`.

        Returns:
            `result`: ok with timings and usage, or not ok with `error` ("HTTP <status> <code>: <message>",
            "stream error: ...", "connection error: ...", "incomplete stream: ..."). Never raises for a
            failed request; asyncio.CancelledError propagates (the record then says "cancelled").
        """
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        result.start = sent - t0
        times: list[float] = []
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        finish: str | None = None
        done = False
        try:
            async with self.http.stream("POST", path, json=body) as r:
                result.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    result.error = f"HTTP {r.status_code}: {_error_message(r)}"
                    return result
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        result.error = f"stream error: a malformed event {data[:80]!r}"
                        return result
                    if "error" in chunk:
                        err = (
                            chunk["error"]
                            if isinstance(chunk["error"], dict)
                            else {"message": chunk["error"]}
                        )
                        result.error = (
                            f"stream error: {err.get('code') or ''} {err.get('message', '')}".strip()
                        )
                        return result
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    choices = chunk.get("choices") or []
                    if choices:
                        c = choices[0]
                        parts.append(str((c.get("delta") or {}).get("content") or c.get("text") or ""))
                        finish = c.get("finish_reason") or finish
                        prompt_ids = c.get("prompt_token_ids")
                        if isinstance(prompt_ids, list) and not result.prompt_ids:
                            result.prompt_ids = [int(t) for t in prompt_ids]
                        ids = c.get("token_ids")
                        if isinstance(ids, list):  # the server says which token the chunk carries
                            result.generated_ids.extend(int(t) for t in ids)
                            if not ids:
                                continue
                        times.append(now - sent)
        except httpx.HTTPError as exc:
            result.error = f"connection error: {exc!r}"
            return result
        except BaseException:
            result.error = "cancelled: the run was interrupted"
            raise
        finally:
            result.e2e = time.perf_counter() - sent
        result.text = "".join(parts)
        result.finish_reason = finish
        if usage is not None:
            n = int(usage.get("completion_tokens", len(times)))
            if len(times) == n + 1:
                times.pop()  # a closing chunk with finish_reason only
            result.prompt_tokens = int(usage.get("prompt_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
            result.output_tokens = n
        else:
            result.output_tokens = len(times)
        result.token_times = times
        result.ttft = times[0] if times else None
        if not done:
            result.error = "incomplete stream: the server closed it before [DONE]"
            return result
        result.ok = True
        return result
