"""The ASGI app (FastAPI): OpenAI-compatible endpoints over one `ServedModel` and its `LaneLoop`.

Endpoints:

- `POST /v1/chat/completions`, `POST /v1/completions`: generation; JSON, or server-sent events with
  `"stream": true` (one token per chunk, whatever the committed run; then `data: [DONE]`).
- `GET /v1/models`, `GET /v1/models/{model}`: the served model.
- `GET /health`: 200 while the lane loop runs, else 503.
- `GET /metrics`: Prometheus text (`ignis.runtime.server.metrics`).
- `GET /openapi.json`, `GET /docs`: the API's schema and its browser view.
- `GET /status`: settings and live state as JSON; `GET /playground/`: the Playground, a browser UI
  (`ignis.runtime.server.status`, `ignis.runtime.server.playground`).

Errors are OpenAI-style bodies (`{"error": {"message", "type", "param", "code"}}`) whose message names
the field as the client wrote it (`messages[0].content`), what is allowed and what was sent: 400 for
malformed JSON, wrong types, out-of-range values, unknown top-level fields (named, with the closest
known one), unsupported parameters, a prompt that does not fit the context or a max_tokens that runs
past it (code "context_length_exceeded", never a silent clamp); 401 for a missing or wrong API key
when the server has one (`ignis.runtime.server.auth`; /health stays open); 404 for an unknown model or
path; 405 for a wrong method; 413 for a body over the server's limit
(`default_max_body_bytes`, `--max-request-bytes`; checked from Content-Length before reading); 415 for
a generation request whose Content-Type is not JSON; 503 with Retry-After when every lane is busy and
the waiting queue is full; 500 only for a server fault (an engine failure, reported to the requests it
hit, after which the lanes restart; or a bug, logged, with the connection kept usable). Every answer of
a generation endpoint is counted in `ignis_requests_total{endpoint, status}`.

A client that disconnects, streaming or not, has its lane aborted before the next round.

No request stalls the others: a body over the limit is refused before it is read, and prompts are
rendered and tokenized in a worker thread whose tokenizer releases the GIL, keeping at most the
context's worth of ids (`Tokenizer.encode(max_length=...)`). Chat content is encoded as plain text
(`Tokenizer.render_chat`): only the chat template writes control tokens unless the request sets
`parse_special_tokens`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ignis.runtime.errors import IgnisRuntimeError
from ignis.runtime.logits_processors import TokenLogprob
from ignis.runtime.sampling import SamplingParams, SamplingParamsError
from ignis.runtime.server.agents import AgentPlan, ChatToolStream, chat_message, plan_chat, template_messages
from ignis.runtime.server.auth import ApiKeyCheck
from ignis.runtime.server.checkpoints import chat_opener
from ignis.runtime.server.errors import (
    APIError,
    InvalidRequestError,
    ModelNotFoundError,
    describe_validation_errors,
    error_body,
)
from ignis.runtime.server.lanes import ErrorEvent, LaneLoop, RequestHandle, TokenEvent
from ignis.runtime.server.logprobs import choice_logprobs, requested_logprobs
from ignis.runtime.server.metrics import ServerMetrics
from ignis.runtime.server.model import ChatTokenizer, ServedModel
from ignis.runtime.server.playground import install_playground
from ignis.runtime.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from ignis.runtime.server.sse import SSE_DONE, ChunkTemplate, sse
from ignis.runtime.server.warmup import warm_up_text
from ignis.runtime.stops import FINISH_STOP, stop_string_holdback

__all__ = ["MAX_BODY_BYTES", "MAX_NESTING", "MIN_TEMPERATURE", "create_app", "default_max_body_bytes"]

logger = logging.getLogger("ignis.runtime.server")

MIN_TEMPERATURE = 0.01  # temperatures in (0, MIN_TEMPERATURE) are raised to it (vLLM's rule)
MAX_BODY_BYTES = 32 * 1024 * 1024  # the default limit's cap (a 262,144-token prompt is ~1-2 MB of JSON)
_BODY_BYTES_PER_TOKEN = 16  # JSON bytes one prompt token can take (an escaped emoji "\ud83d\ude00" is 12)
_BODY_BYTES_SLACK = 1024 * 1024  # for tools, message fields the template drops, JSON structure


def default_max_body_bytes(max_context: int | None) -> int:
    """The default request body limit: room for a prompt filling the context at 16 JSON bytes a token
    plus 1 MiB, at most MAX_BODY_BYTES (all of it without a context limit). A body that large cannot
    be a prompt that fits, and refusing it before reading keeps JSON parsing (which holds the event
    loop) bounded."""
    if max_context is None:
        return MAX_BODY_BYTES
    return min(MAX_BODY_BYTES, _BODY_BYTES_SLACK + _BODY_BYTES_PER_TOKEN * max_context)


# Levels of lists/objects a value handed to the chat template may nest (tools, tool calls, ...).
MAX_NESTING = 64
_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
_REQUEST_MODELS: dict[str, type[ChatCompletionRequest | CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
_TEMPLATE_RESERVED = frozenset(
    {
        "self",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
    }
)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers or None)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (cancelling the body iterator) as soon as the client disconnects.

    Starlette only listens for `http.disconnect` under ASGI spec < 2.4; this response always does, so
    a lane is freed when its client goes away even between tokens (e.g. while waiting in the queue).
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:  # the transport broke under us: the client is gone
                pass
            tg.cancel_scope.cancel()

        async def listen() -> None:
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            tg.start_soon(listen)


class _RequestCounter:
    """The outermost middleware: counts every request to the generation endpoints by status code,
    refusals included (413, 415, 400, 404, 405, 503, ...), and answers an error that escapes the app
    with a 500 (OpenAI-style body, logged) itself, so the connection stays usable: past Starlette's own
    error middleware uvicorn would drop the keep-alive connection and the client's next request on it
    would fail with a reset. An error after the response started (mid-stream) still propagates and
    closes the connection. A pure ASGI middleware, so streaming and disconnect detection pass through
    untouched."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path")
        is_started = False

        async def counting_send(message: Any) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start" and not is_started:
                is_started = True
                if path in _GENERATION_PATHS:
                    self.metrics.requests.labels(endpoint=path, status=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if is_started:
                raise
            logger.exception("unhandled error on %s %s", scope.get("method"), path)
            body = error_body("internal server error (the server log has the details)", "server_error")
            await JSONResponse(body, status_code=500)(scope, receive, counting_send)


class _BodyChecks:
    """413 (OpenAI-style body) for a request body over `limit` bytes: at once when its Content-Length
    says so, else as soon as the bytes read pass the limit (the endpoint's body parser re-raises the
    HTTPException, and the app's handler renders it). 415 for a POST to a generation endpoint whose
    Content-Type is not JSON (the body would not be parsed; a browser form cannot send JSON, so the
    JSON type is kept required)."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        value = headers.get(b"content-length", b"")
        if value.isdigit() and int(value) > self.limit:
            body = error_body(
                _too_large(int(value), self.limit), "invalid_request_error", code="request_too_large"
            )
            await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)
            return
        if scope.get("method") == "POST" and scope.get("path") in _GENERATION_PATHS:
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            media = content_type.split(";", 1)[0].strip().lower()
            if media != "application/json" and not (
                media.startswith("application/") and media.endswith("+json")
            ):
                got = f"got {content_type!r}" if content_type else "none was sent"
                message = (
                    f"the request body must be JSON with Content-Type: application/json ({got}; "
                    "with curl, add -H 'Content-Type: application/json')"
                )
                body = error_body(message, "invalid_request_error", code="unsupported_media_type")
                await JSONResponse(body, status_code=415)(scope, receive, send)
                return
        num_read = 0

        async def limited_receive() -> Any:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > self.limit:
                    raise StarletteHTTPException(413, detail=_too_large(num_read, self.limit))
            return message

        await self.app(scope, limited_receive, send)


def _check_nesting(value: Any, param: str) -> None:
    """Refuse a value nesting lists/objects deeper than MAX_NESTING (walked without recursion): the chat
    template and its helpers recurse into what they are handed, and Python's recursion limit would make
    a client's deep JSON a 500.

    Raises:
        InvalidRequestError: the value nests deeper, naming `param`.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 >= MAX_NESTING:
                    raise InvalidRequestError(
                        f"{param} nests lists and objects more than {MAX_NESTING} levels deep", param=param
                    )
                stack.append((child, depth + 1))


def _too_large(num_bytes: int, limit: int) -> str:
    return (
        f"the request body has {num_bytes} bytes or more; at most {limit} are taken (the server's "
        "--max-request-bytes)"
    )


def _whole_text(
    tokenizer: Any, prompt_ids: list[int], params: SamplingParams, out_ids: list[int], last: TokenEvent
) -> str:
    """A non-streamed reply's text: the same incremental detokenization and stop-string cut as the
    stream, so streamed and whole texts are equal."""
    text = _TextStream(tokenizer, prompt_ids, params)
    return "".join(text.push(t, last if i == len(out_ids) - 1 else None) for i, t in enumerate(out_ids)) + (
        "" if out_ids else text.finish_empty()
    )


class _TextStream:
    """One request's text, token by token, as a client sees it.

    Without stop strings the model's incremental detokenizer gives each token's text. With stop
    strings the text is the decode of the whole output (the way the engine finds stops), and a suffix
    that could still become a stop string is held back until a later token decides it; the last token
    of a stop-string finish releases the engine's text cut before the stop. The text of a stop token
    (EOS, `stop_token_ids`) is never included, as in vLLM.
    """

    def __init__(self, tokenizer: ChatTokenizer, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._stop = params.stop
        self._decoder = None if self._stop else tokenizer.detokenizer(prompt_ids, skip_special_tokens=True)
        self._ids: list[int] = []
        self.text = ""  # text sent so far

    def push(self, token_id: int, event: TokenEvent | None) -> str:
        """Add one token; `event` is the request's last event when this is its last token, else None.
        Returns the text to send for it (may be "")."""
        finish = event.finish_reason if event is not None else None
        reason = event.stop_reason if event is not None else None
        last = finish is not None
        stop_string = finish == FINISH_STOP and isinstance(reason, str)
        stop_token = finish == FINISH_STOP and not isinstance(reason, str)
        if self._decoder is not None:
            delta = "" if stop_token else self._decoder.add(token_id)
            if last:
                delta += self._decoder.flush()
            self.text += delta
            return delta
        # Stop strings: whole-output decode, as the engine does.
        if stop_string:
            final = (event.stop_text if event is not None else None) or ""
            delta = final[len(self.text) :] if final.startswith(self.text) else ""
            self.text += delta
            return delta
        if not stop_token:
            self._ids.append(token_id)
        full = str(self._tok.decode(self._ids, skip_special_tokens=True))
        if last:
            end = len(full)
        else:
            end = len(full) - stop_string_holdback(full, self._stop)
            if full[:end].endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its next byte
                end -= 1
        if end <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text) : end]
        self.text += delta
        return delta

    def finish_empty(self) -> str:
        """A last event with no token (an abort): release whatever is held back."""
        if self._decoder is not None:
            delta = self._decoder.flush()
        else:
            full = str(self._tok.decode(self._ids, skip_special_tokens=True))
            delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


class _Service:
    """Request handling shared by the endpoints."""

    def __init__(self, model: ServedModel, lanes: LaneLoop, metrics: ServerMetrics) -> None:
        self.model = model
        self.lanes = lanes
        self.metrics = metrics

    # ---------------------------------------------------------------- validation

    def check_model(self, name: str | None) -> None:
        if name is not None and not self.model.accepts(name):
            raise ModelNotFoundError(
                f"the model {name!r} does not exist; this server serves {self.model.name!r}",
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self, req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None
    ) -> SamplingParams:
        if req.stream_options is not None and not req.stream:
            raise InvalidRequestError(
                'stream_options is only allowed with "stream": true', param="stream_options"
            )
        if req.n != 1:
            raise InvalidRequestError(
                f"n = {req.n} is not supported: one choice per request is served (n = 1); send separate "
                "requests for more",
                param="n",
            )
        if req.logit_bias:
            raise InvalidRequestError(
                "logit_bias is not supported: only an empty bias is served", param="logit_bias"
            )
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE
        stop = req.stop if req.stop is not None else ()
        try:
            return SamplingParams(
                temperature=temperature,
                top_k=0 if req.top_k is None else req.top_k,
                top_p=1.0 if req.top_p is None else float(req.top_p),
                seed=req.seed,
                max_tokens=max_tokens,
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                presence_penalty=float(req.presence_penalty or 0.0),
                frequency_penalty=float(req.frequency_penalty or 0.0),
                repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
                min_tokens=req.min_tokens or 0,
                logprobs=requested_logprobs(req),
            )
        except SamplingParamsError as exc:  # min_tokens > max_tokens; the protocol bounds the rest
            param = "min_tokens" if "min_tokens" in str(exc) else None
            raise InvalidRequestError(f"the sampling parameters are not valid: {exc}", param=param) from exc

    def check_prompt(self, ids: Sequence[int]) -> None:
        """Refuse an empty prompt, one that fills the context (checked first: it costs nothing), or ids
        outside the vocabulary (a min/max scan; the offenders are listed only then)."""
        if not ids:
            raise InvalidRequestError("the prompt is empty: it must hold at least one token", param="prompt")
        ctx = self.lanes.max_context
        if ctx is not None and len(ids) >= ctx:
            raise InvalidRequestError(
                f"this model's maximum context length is {ctx} tokens; the prompt has {len(ids)} tokens and "
                "no room is left for an output token",
                param="prompt",
                code="context_length_exceeded",
            )
        vocab = self.lanes.vocab_size
        if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
            bad = [t for t in ids if not 0 <= t < vocab]
            raise InvalidRequestError(
                f"prompt token ids {bad[:8]} are outside the vocabulary [0, {vocab})", param="prompt"
            )

    def refuse_oversized_text(self, text: str, *, param: str) -> None:
        """Refuse a text that cannot fit the context *before* tokenizing it: tokenizing megabytes holds
        the GIL for seconds and would stall every other lane (the bound is `Tokenizer.min_tokens`)."""
        ctx = self.lanes.max_context
        if ctx is not None and (floor := self.model.tokenizer.min_tokens(text)) >= ctx:
            raise InvalidRequestError(
                f"this model's maximum context length is {ctx} tokens; the prompt has at least {floor} "
                f"tokens ({len(text)} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(_TEMPLATE_RESERVED.intersection(kwargs))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: use the request's own fields",
                param="chat_template_kwargs",
            )
        _check_nesting(req.tools, "tools")
        _check_nesting(req.response_format, "response_format")
        _check_nesting(kwargs, "chat_template_kwargs")
        messages = []
        for i, m in enumerate(req.messages):
            for key, value in (m.model_extra or {}).items():
                _check_nesting(value, f"messages[{i}].{key}")
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text" or not isinstance(part.text, str):
                        raise InvalidRequestError(
                            f"messages[{i}].content[{j}] must be a text part "
                            '{"type": "text", "text": "..."} (the model reads text only), '
                            f"got type {part.type!r}",
                            param=f"messages[{i}].content[{j}]",
                        )
                msg["content"] = "".join(p.text or "" for p in m.content)
            elif m.content is None:  # allowed (e.g. an assistant turn of tool calls): the template reads ""
                msg["content"] = ""
            messages.append(msg)
        messages = template_messages(messages)  # tool calls' arguments as objects (agents.py)
        if req.continue_final_message and req.add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message needs add_generation_prompt false", param="continue_final_message"
            )
        try:
            prompt = self.model.tokenizer.render_chat(
                messages,
                parse_special_tokens=req.parse_special_tokens,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                **kwargs,
            )
        except TypeError as exc:  # a template variable the call rejects
            raise InvalidRequestError(
                "chat_template_kwargs holds a name the chat template cannot take",
                param="chat_template_kwargs",
            ) from exc
        except IgnisRuntimeError as exc:  # the template refused the conversation (its raise_exception)
            raise InvalidRequestError(
                f"the model's chat template refused the messages: {exc}", param="messages"
            ) from exc
        self.refuse_oversized_text(prompt.text, param="messages")
        try:
            ids = list(self.model.tokenizer.encode_chat_prompt(prompt, max_length=self.lanes.max_context))
        except IgnisRuntimeError as exc:
            raise InvalidRequestError(
                f"the rendered messages could not be tokenized: {exc}", param="messages"
            ) from exc
        self.refuse_truncated(ids, prompt.text, param="messages")
        return ids

    def refuse_truncated(self, ids: Sequence[int], text: str, *, param: str) -> None:
        """Refuse a prompt tokenized up to the context length (`encode(max_length=...)`) that reached it:
        it has at least that many tokens, so no room is left for an output token."""
        ctx = self.lanes.max_context
        if ctx is not None and len(ids) >= ctx:
            raise InvalidRequestError(
                f"this model's maximum context length is {ctx} tokens; the prompt has at least {ctx} "
                f"tokens ({len(text)} characters) and no room is left for an output token",
                param=param,
                code="context_length_exceeded",
            )

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if req.echo:
            raise InvalidRequestError("echo is not supported: only false is served", param="echo")
        if req.suffix is not None:
            raise InvalidRequestError("suffix is not supported: only null is served", param="suffix")
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    f"one prompt per request is served, got {len(prompt)}", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.refuse_oversized_text(prompt, param="prompt")
            try:
                ids = list(
                    self.model.tokenizer.encode(
                        prompt, add_special_tokens=req.add_special_tokens, max_length=self.lanes.max_context
                    )
                )
            except IgnisRuntimeError as exc:
                raise InvalidRequestError(
                    f"the prompt could not be tokenized: {exc}", param="prompt"
                ) from exc
            self.refuse_truncated(ids, prompt, param="prompt")
            return ids
        return [int(t) for t in prompt]

    # ---------------------------------------------------------------- running

    def check_room(self, num_prompt: int, requested: tuple[str, int] | None) -> None:
        """Refuse a max_tokens that runs past the context (as vLLM does) instead of clamping it.

        Args:
            num_prompt: prompt tokens.
            requested: (the request field, its value) when the client set the output limit; None when
                it did not (then the output runs to its default, at most the context end).

        Raises:
            InvalidRequestError: num_prompt + the value > the context length (code context_length_exceeded).
        """
        ctx = self.lanes.max_context
        if ctx is None or requested is None:
            return
        param, num_out = requested
        if num_prompt + num_out > ctx:
            raise InvalidRequestError(
                f"this model's maximum context length is {ctx} tokens; this request asks for "
                f"{num_prompt + num_out} tokens ({num_prompt} in the prompt, {num_out} in {param}): "
                f"lower {param} to at most {ctx - num_prompt} or shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        requested: tuple[str, int] | None,
        checkpoint_at: Sequence[int] = (),
    ) -> RequestHandle:
        """Check the prompt and the output limit against the model, then queue the request.

        Raises:
            InvalidRequestError: an empty prompt, ids outside the vocabulary, or no room in the context.
            ServerBusyError, ServerUnavailableError: from `LaneLoop.submit`.
        """
        self.check_prompt(ids)
        self.check_room(len(ids), requested)
        return self.lanes.submit(ids, params, checkpoint_at=checkpoint_at)

    async def events(self, handle: RequestHandle) -> AsyncGenerator[TokenEvent, None]:
        """The request's events until its last; aborts the lane if the consumer stops early."""
        try:
            while True:
                event = await handle.next_event()
                if isinstance(event, ErrorEvent):
                    raise event.error
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not handle.is_done:
                self.lanes.abort(handle)

    async def collect(
        self, handle: RequestHandle, request: Request
    ) -> tuple[list[int], TokenEvent, list[TokenLogprob]] | None:
        """Wait for a non-streamed request's tokens (and their logprobs, when asked); None when the
        client disconnected first."""
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        events = self.events(handle)

        async def run() -> TokenEvent:
            async for event in events:
                ids.extend(event.token_ids)
                lps.extend(event.logprobs or ())
                if event.finish_reason is not None:
                    return event
            raise AssertionError("events ended without a last event")

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                await events.aclose()
        if work.cancelled():
            return None
        return ids, work.result(), lps


def _usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def create_app(
    model: ServedModel,
    lanes: LaneLoop,
    metrics: ServerMetrics,
    *,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """Build the app. Its lifespan starts the lane loop and stops it (aborting what is left) at shutdown.

    Args:
        model: the served model.
        lanes: the lane loop over the model's engine (not started yet, or started).
        metrics: the server's metrics (`ServerMetrics` over `lanes.snapshot`).
        api_key: the key every endpoint but /health requires as `Authorization: Bearer KEY`
            (`ignis.runtime.server.auth`), or None for none.
        max_body_bytes: request bodies over this get 413; None: `default_max_body_bytes` of the
            lanes' context.
    """
    svc = _Service(model, lanes, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lanes.start()
        try:
            await run_in_threadpool(warm_up_text, model.tokenizer, lanes.max_context)  # not the 1st request
            yield
        finally:
            await run_in_threadpool(lanes.stop)

    app = FastAPI(
        title="ignis",
        summary="OpenAI-compatible speculative-decoding server",
        version="0.1.0",
        lifespan=lifespan,
        redoc_url=None,
    )
    errors: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorResponse, "description": "Malformed or invalid request"},
        404: {"model": ErrorResponse, "description": "Unknown model"},
        413: {"model": ErrorResponse, "description": "Request body over the server's limit"},
        401: {"model": ErrorResponse, "description": "Missing or wrong API key (with --api-key)"},
        415: {"model": ErrorResponse, "description": "Content-Type is not application/json"},
        500: {"model": ErrorResponse, "description": "Engine failure"},
        503: {"model": ErrorResponse, "description": "Busy (Retry-After) or shutting down"},
    }

    # ---------------------------------------------------------------- error handlers

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            loc = first.get("loc", ())
            if detail and len(loc) > 1 and isinstance(loc[1], int):
                detail += f"{'' if detail.endswith(' at') else ' at'} character {loc[1]}"
            message = "the request body is not valid JSON" + (f" ({detail})" if detail else "")
            return _error_response(InvalidRequestError(message))
        if first.get("type") == "missing" and len(first.get("loc", ())) <= 1:
            return _error_response(InvalidRequestError("the request needs a JSON object body"))
        fields = _REQUEST_MODELS.get(request.url.path)
        message, param = describe_validation_errors(errs, fields.model_fields if fields else ())
        return _error_response(InvalidRequestError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        headers = getattr(exc, "headers", None)
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = f"there is no endpoint {path}; the API is listed at /docs"
        elif exc.status_code == 405:
            allowed = (headers or {}).get("allow", (headers or {}).get("Allow", ""))
            message = f"{method} is not allowed on {path}" + (f"; use {allowed}" if allowed else "")
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            if isinstance(exc.__cause__, RecursionError):
                message = "the request body nests lists and objects too deeply to be read"
            else:
                message = "the request body could not be read as JSON (it must be UTF-8 text)"
        else:
            message = str(exc.detail)
        return JSONResponse(
            error_body(message, kind, code=code), status_code=exc.status_code, headers=headers
        )

    # The last added is the outermost: the counter sees every response, the 413/415 refusals included.
    body_limit = max_body_bytes if max_body_bytes is not None else default_max_body_bytes(lanes.max_context)
    app.add_middleware(_BodyChecks, limit=body_limit)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    app.add_middleware(_RequestCounter, metrics=metrics)

    # ---------------------------------------------------------------- plain endpoints

    def model_card() -> ModelCard:
        return ModelCard(id=model.name, created=model.created, max_model_len=lanes.max_context)

    @app.get("/v1/models", response_model=ModelList, tags=["models"])
    async def list_models() -> ModelList:
        """The served model."""
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id}", response_model=ModelCard, responses={404: errors[404]}, tags=["models"])
    async def get_model(model_id: str) -> ModelCard:
        """One model by id (404 unless it is the served model or an alias of it)."""
        svc.check_model(model_id)
        return model_card()

    @app.get("/health", response_model=HealthResponse, responses={503: errors[503]}, tags=["server"])
    async def health() -> Any:
        """200 while the lane loop runs; 503 when it stopped (shutdown, or an engine that cannot restart)."""
        snap = lanes.snapshot
        if not lanes.is_alive:
            why = getattr(lanes, "unavailable_reason", None) or "the lane loop is not running"
            return JSONResponse(error_body(why, "service_unavailable_error"), 503)
        return HealthResponse(lanes_active=snap.num_active, requests_waiting=snap.num_waiting)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
        tags=["server"],
    )
    async def prometheus_metrics() -> Response:
        """Prometheus metrics (text exposition format)."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---------------------------------------------------------------- generation

    def stream_doc(chunk: type) -> dict[str, Any]:
        event = {
            "type": "object",
            "description": "One server-sent event (OpenAPI < 3.2: the schema describes each event).",
            "required": ["data"],
            "properties": {
                "data": {
                    "type": "string",
                    "description": f"A JSON {chunk.__name__} (one token), an error object, or [DONE] last.",
                    "contentMediaType": "application/json",
                },
                "event": {"type": "string"},
            },
        }
        return {
            "description": "The completion (JSON), or with stream=true server-sent events (a token a chunk)",
            "content": {"text/event-stream": {"schema": event}},
        }

    async def generate(
        req: ChatCompletionRequest | CompletionRequest,
        request: Request,
        ids: list[int],
        params: SamplingParams,
        requested: tuple[str, int] | None,
        *,
        is_chat: bool,
        agent: AgentPlan | None = None,
        checkpoint_at: Sequence[int] = (),
    ) -> Response:
        """Submit the request; stream its tokens, or wait for them and answer the whole completion."""
        handle = svc.submit(ids, params, requested, checkpoint_at)
        rid, created = f"{'chatcmpl' if is_chat else 'cmpl'}-{handle.request_id}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            if is_chat:
                events = _chat_stream(
                    svc, handle, rid, created, req.return_token_ids, include_usage, req, agent
                )
            else:
                events = _completion_stream(
                    svc, handle, rid, created, req.return_token_ids, include_usage, req
                )
            return EventStreamResponse(events)
        got = await svc.collect(handle, request)
        if got is None:
            return Response(status_code=499)
        out_ids, last, lps = got
        text_tok = agent.text_tokenizer if agent is not None and agent.text_tokenizer else model.tokenizer
        content = _whole_text(text_tok, ids, params, out_ids, last)
        choice: dict[str, Any] = {"index": 0}
        finish_reason = last.finish_reason
        if is_chat and agent is not None:  # tool calls parsed out of the reply (agents.py)
            choice["message"], finish_reason = chat_message(agent, content, str(last.finish_reason))
        elif is_chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        choice.update(
            finish_reason=finish_reason,
            stop_reason=last.stop_reason,
            logprobs=choice_logprobs(model.tokenizer, req, lps),
        )
        if req.return_token_ids:
            choice["token_ids"] = out_ids
            choice["prompt_token_ids"] = ids
        body = {
            "id": rid,
            "object": "chat.completion" if is_chat else "text_completion",
            "created": created,
            "model": model.name,
            "choices": [choice],
            "usage": _usage(len(ids), len(out_ids), last.num_cached_tokens),
        }
        return JSONResponse(body)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: stream_doc(ChatCompletionChunk), **errors},
        tags=["generation"],
    )
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        """Chat completion: the messages rendered with the model's chat template, then decoded."""
        svc.check_model(req.model)
        requested: tuple[str, int] | None = None
        if req.max_completion_tokens is not None:
            requested = ("max_completion_tokens", req.max_completion_tokens)
        elif req.max_tokens is not None:
            requested = ("max_tokens", req.max_tokens)
        params = svc.sampling_params(req, requested[1] if requested else None)
        ids = await run_in_threadpool(svc.chat_prompt, req)
        agent = await run_in_threadpool(plan_chat, req, model.tokenizer, svc.lanes.vocab_size)
        if agent.grammar is not None:
            params = dataclasses.replace(params, grammar=agent.grammar)
        opener = await run_in_threadpool(chat_opener, model.tokenizer, req, ids)  # prompt checkpoint
        return await generate(
            req, request, ids, params, requested, is_chat=True, agent=agent, checkpoint_at=opener
        )

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: stream_doc(CompletionChunk), **errors},
        tags=["generation"],
    )
    async def completions(req: CompletionRequest, request: Request) -> Any:
        """Text completion of one prompt (a text, or a list of token ids)."""
        svc.check_model(req.model)
        if req.best_of not in (None, 1):
            raise InvalidRequestError(
                f"best_of = {req.best_of} is not supported: only best_of 1 (or null) is served",
                param="best_of",
            )
        # The default 16 stops at the context end; a max_tokens the client set must fit.
        is_set = "max_tokens" in req.model_fields_set
        requested = ("max_tokens", req.max_tokens) if is_set and req.max_tokens is not None else None
        params = svc.sampling_params(req, req.max_tokens)
        ids = await run_in_threadpool(svc.completion_prompt, req)
        return await generate(req, request, ids, params, requested, is_chat=False)

    # Document the chunk schemas (they travel as SSE data, not as a JSON response).
    app.openapi_schema = None
    _extra_models = (ChatCompletionChunk, CompletionChunk)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in _extra_models:
                comps.setdefault(m.__name__, m.model_json_schema(ref_template="#/components/schemas/{model}"))
                for name, sub in comps[m.__name__].pop("$defs", {}).items():
                    comps.setdefault(name, sub)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    install_playground(app, model, lanes)  # GET /status and /playground/ (last: its asset layer is outermost)
    return app


async def _stream_tokens(
    svc: _Service,
    handle: RequestHandle,
    head: Mapping[str, Any],
    make_choice: Callable[[str, int | None, TokenEvent | None, bool], dict[str, Any] | list[dict[str, Any]]],
    include_usage: bool,
    req: ChatCompletionRequest | CompletionRequest,
    tokenizer: ChatTokenizer | None = None,
    template: ChunkTemplate | None = None,
) -> AsyncIterator[bytes]:
    """SSE bytes: one chunk per token; the last carries finish_reason and usage; then [DONE].

    The chunks of one event (a committed run) are yielded together, as one write; the last event's
    with the usage chunk and [DONE].

    Args:
        head: the fields every chunk starts with (id, object, created, model).
        make_choice: (text delta, token id or None, the last event or None, is_first) -> the chunk's choice,
            or a list of choices sent as one chunk each (tool call deltas).
        include_usage: send a last chunk with empty `choices` and the usage (stream_options).
        tokenizer: decodes the text (default: the model's; agents.py's keeps special call markers).
        req: the request (its logprobs options: each chunk carries its token's logprobs).
        template: the bytes of a chunk that is neither the first nor the last (`ChunkTemplate`, equal to
            what `make_choice` gives for it), or None to serialize every chunk.
    """
    text = _TextStream(tokenizer or svc.model.tokenizer, handle.prompt_token_ids, handle.params)
    num_prompt = len(handle.prompt_token_ids)
    num_out, cached = 0, 0
    offset = 0  # completions' text_offset of the next token
    out: list[bytes] = []
    try:
        while True:
            event = await handle.next_event()
            if isinstance(event, ErrorEvent):
                raise event.error
            n = len(event.token_ids)
            cached = event.num_cached_tokens or cached
            for i, token in enumerate(event.token_ids):
                last = event if (i == n - 1 and event.finish_reason is not None) else None
                if template is not None and last is None and num_out > 0:
                    out.append(template.render(text.push(token, None), token))
                    num_out += 1
                    continue
                made = make_choice(text.push(token, last), token, last, num_out == 0)
                if event.logprobs is not None:
                    (made[-1] if isinstance(made, list) else made)["logprobs"] = choice_logprobs(
                        svc.model.tokenizer, req, event.logprobs[i : i + 1], offset
                    )
                    offset += len(svc.model.tokenizer.decode([token], skip_special_tokens=False))
                num_out += 1
                choices = made if isinstance(made, list) else [made]
                for j, choice in enumerate(choices):
                    chunk = {**head, "choices": [choice]}
                    if last is not None and j == len(choices) - 1:
                        chunk["usage"] = _usage(num_prompt, num_out, cached)
                    out.append(sse(chunk))
            if event.finish_reason is not None and n == 0:
                made = make_choice(text.finish_empty(), None, event, num_out == 0)
                choices = made if isinstance(made, list) else [made]
                for j, choice in enumerate(choices):
                    chunk = {**head, "choices": [choice]}
                    if j == len(choices) - 1:
                        chunk["usage"] = _usage(num_prompt, num_out, cached)
                    out.append(sse(chunk))
            if event.finish_reason is not None:
                break
            if out:
                yield b"".join(out)
                out = []
        if include_usage:
            out.append(sse({**head, "choices": [], "usage": _usage(num_prompt, num_out, cached)}))
    except APIError as exc:
        out.append(sse(exc.body()))
    finally:
        if not handle.is_done:  # the client went away (the stream was closed) or a bug: free the lane
            svc.lanes.abort(handle)
    out.append(SSE_DONE)
    yield b"".join(out)


def _choice_end(
    choice: dict[str, Any], token: int | None, last: TokenEvent | None, with_ids: bool
) -> dict[str, Any]:
    """The fields a streamed choice of either endpoint ends with (finish, stop reason, the token id)."""
    choice["logprobs"] = None
    choice["finish_reason"] = None if last is None else last.finish_reason
    if last is not None:
        choice["stop_reason"] = last.stop_reason
    if with_ids:
        choice["token_ids"] = [] if token is None else [token]
    return choice


def _chat_stream(
    svc: _Service,
    handle: RequestHandle,
    rid: str,
    created: int,
    with_ids: bool,
    include_usage: bool,
    req: ChatCompletionRequest | CompletionRequest,
    agent: AgentPlan | None = None,
) -> AsyncIterator[bytes]:
    tools = ChatToolStream(agent) if agent is not None and agent.parser is not None else None

    def choice(
        delta: str, token: int | None, last: TokenEvent | None, first: bool
    ) -> dict[str, Any] | list[dict[str, Any]]:
        if tools is not None:  # tool calls parsed out of the text (agents.py)
            return _tool_choices(tools, delta, token, last, first, with_ids)
        d: dict[str, Any] = {"role": "assistant", "content": delta} if first else {"content": delta}
        return _choice_end({"index": 0, "delta": d}, token, last, with_ids)

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": svc.model.name}
    text_tok = agent.text_tokenizer if agent is not None else None
    template = None
    if tools is None and handle.params.logprobs is None:
        template = _template(lambda t, tok: {**head, "choices": [choice(t, tok, None, False)]}, with_ids)
    return _stream_tokens(svc, handle, head, choice, include_usage, req, text_tok, template)


def _completion_stream(
    svc: _Service,
    handle: RequestHandle,
    rid: str,
    created: int,
    with_ids: bool,
    include_usage: bool,
    req: ChatCompletionRequest | CompletionRequest,
) -> AsyncIterator[bytes]:
    def choice(delta: str, token: int | None, last: TokenEvent | None, first: bool) -> dict[str, Any]:
        out = _choice_end({"index": 0, "text": delta}, token, last, with_ids)
        if with_ids and first:
            out["prompt_token_ids"] = list(handle.prompt_token_ids)
        return out

    head = {"id": rid, "object": "text_completion", "created": created, "model": svc.model.name}
    template = None
    if handle.params.logprobs is None:
        template = _template(lambda t, tok: {**head, "choices": [choice(t, tok, None, False)]}, with_ids)
    return _stream_tokens(svc, handle, head, choice, include_usage, req, template=template)


def _template(make: Callable[[str, int], Mapping[str, Any]], with_ids: bool) -> ChunkTemplate | None:
    """The middle chunks' template, or None when the chunk cannot be templated (`ChunkTemplate`)."""
    try:
        return ChunkTemplate(make, with_token=with_ids)
    except ValueError:  # a placeholder also in a fixed field (e.g. the model's name): serialize each chunk
        return None


def _tool_choices(
    tools: ChatToolStream, text: str, token: int | None, last: TokenEvent | None, first: bool, with_ids: bool
) -> list[dict[str, Any]]:
    """One token's chunks with tool calls parsed out: the content and tool call deltas it releases
    (at least one chunk; the last carries the finish reason, "tool_calls" after calls)."""
    deltas = tools.push(text, last is not None) or [{"content": ""}]
    if first:
        deltas[0] = {"role": "assistant", **deltas[0]}
    out = []
    for j, d in enumerate(deltas):
        is_end = j == len(deltas) - 1
        choice = _choice_end({"index": 0, "delta": d}, token if is_end else None, None, with_ids)
        if is_end and last is not None:
            choice["stop_reason"] = last.stop_reason
            choice["finish_reason"] = tools.finish_reason(last.finish_reason)
        out.append(choice)
    return out
