"""`python -m ignis.tools.chat`: a terminal chat client for an ignis server (Unix socket or TCP).

    python -m ignis.tools.chat --socket "$IGNIS_SOCKET" "What is a verify round?"   # one question
    python -m ignis.tools.chat                                   # a conversation (socket: $IGNIS_SOCKET)
    echo "summarize: ..." | python -m ignis.tools.chat --socket /tmp/ignis.sock

The reply streams as it is generated (POST /v1/chat/completions with "stream": true). With
`--stats`, each reply is followed by its timings (time to first token, tokens per second seen by
the client, token counts) and the server's speculative acceptance over that reply (committed tokens
per verify round and the fraction of draft tokens accepted, from the `ignis_speculative_*` counters of
/metrics). Without `--socket`, the socket comes from the environment variable IGNIS_SOCKET; with
neither, `--url` (a TCP server) is used, and an unreachable one says how to point the client. In a
conversation, `/reset` starts over and `/quit` (or end of input) leaves; a refused turn is reported
and dropped, and the conversation goes on.

Exit status: 0 on success (a conversation ended by /quit or end of input), 1 when the server refuses
the one question or cannot be reached, 2 on bad usage.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import click
import httpx

__all__ = ["ChatClient", "ChatError", "Reply", "SpecCounters", "main"]

#: Appended to "cannot reach" errors when no socket was given: ignis-run serves on a Unix socket.
NO_SOCKET_HINT = (
    "; ignis-run serves on a Unix socket: pass --socket PATH (the path given to `ignis-run --socket`) "
    "or set IGNIS_SOCKET=PATH; --url is for a server started with --host/--port"
)


class ChatError(Exception):
    """The server refused a request (the message is its error message) or could not be reached."""


@dataclass
class Reply:
    """One streamed reply.

    Attributes:
        text: the reply text.
        finish_reason: "stop", "length" or "abort".
        prompt_tokens: tokens of the rendered conversation.
        completion_tokens: tokens generated (the stop token included).
        seconds_to_first_token: from sending the request to the first token, seconds.
        seconds: from sending the request to the last token, seconds.
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    seconds_to_first_token: float
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Completion tokens after the first over the time after the first token (0 if undefined)."""
        span = self.seconds - self.seconds_to_first_token
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else 0.0


@dataclass(frozen=True)
class SpecCounters:
    """The server's speculative counters (ADR 0002), or the difference of two readings.

    Attributes:
        rounds: verify rounds in which a lane carried at least one draft token.
        drafted: draft tokens verified.
        committed: tokens those rounds committed: accepted draft tokens plus the one token the model
            itself yields per round (the bonus / correction token), cut at a stop
            (`ignis_speculative_accepted_tokens_total`).
        drafts_accepted: draft tokens accepted (the per-position accepted counters summed).
    """

    rounds: float = 0.0
    drafted: float = 0.0
    committed: float = 0.0
    drafts_accepted: float = 0.0

    @classmethod
    def parse(cls, metrics_text: str) -> SpecCounters:
        """Read the counters from Prometheus text (all 0 when speculation never ran)."""
        values = {"rounds": 0.0, "drafted": 0.0, "committed": 0.0, "drafts_accepted": 0.0}
        names = {
            "ignis_speculative_rounds_total": "rounds",
            "ignis_speculative_drafted_tokens_total": "drafted",
            "ignis_speculative_accepted_tokens_total": "committed",
        }
        for line in metrics_text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, rest = line.partition(" ")
            if name in names:
                values[names[name]] = float(rest.split()[0])
            elif name.startswith("ignis_speculative_position_accepted_total{"):
                values["drafts_accepted"] += float(rest.split()[0])
        return cls(**values)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.rounds - other.rounds,
            self.drafted - other.drafted,
            self.committed - other.committed,
            self.drafts_accepted - other.drafts_accepted,
        )

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per verify round (1 .. draft tokens + 1); 0 without rounds."""
        return self.committed / self.rounds if self.rounds > 0 else 0.0

    @property
    def draft_acceptance(self) -> float:
        """Fraction of draft tokens accepted (0..1); 0 without drafts."""
        return self.drafts_accepted / self.drafted if self.drafted > 0 else 0.0

    def describe(self) -> str:
        """One line naming both rates unambiguously, or a note that no round ran."""
        if self.rounds <= 0:
            return "no speculative round ran"
        return (
            f"{self.tokens_per_round:.2f} tokens per verify round ({self.committed:.0f} tokens committed "
            f"in {self.rounds:.0f} rounds, each round's model token included); draft acceptance "
            f"{100 * self.draft_acceptance:.1f} % ({self.drafts_accepted:.0f} of {self.drafted:.0f} draft "
            f"tokens accepted)"
        )


class ChatClient:
    """A small client over httpx (no OpenAI SDK needed).

    Args:
        socket: Unix socket path of the server, or None to use `url`.
        url: base URL of a TCP server (ignored with a socket).
        timeout: seconds to wait for the server between bytes.
    """

    def __init__(
        self, *, socket: str | None = None, url: str = "http://localhost:8000", timeout: float = 600.0
    ):
        self.where = f"unix socket {socket}" if socket else url
        self._hint = "" if socket else NO_SOCKET_HINT
        transport = httpx.HTTPTransport(uds=socket) if socket else None
        key = os.environ.get("IGNIS_API_KEY")  # a server run with --api-key wants it as a Bearer token
        self.http = httpx.Client(
            transport=transport,
            base_url="http://ignis" if socket else url,
            timeout=timeout,
            headers={"Authorization": f"Bearer {key}"} if key else None,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def _check(self, response: httpx.Response) -> None:
        if response.status_code >= 400:
            response.read()
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):  # not an ignis error body (a proxy's page, ...)
                text = " ".join(response.text.split())
                message = text if len(text) <= 200 else text[:200] + f"... ({len(text)} chars)"
            raise ChatError(f"HTTP {response.status_code} from {self.where}: {message}")

    def model(self) -> str:
        """The served model's id (the first of /v1/models).

        Raises:
            ChatError: the server cannot be reached or lists no model.
        """
        try:
            r = self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach the server at {self.where}: {exc}{self._hint}") from exc
        self._check(r)
        try:
            data = r.json().get("data") or []
            if not data:
                raise ChatError(f"the server at {self.where} lists no model")
            return str(data[0]["id"])
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise ChatError(
                f"{self.where} is not an ignis server: GET /v1/models answered "
                f"{r.headers.get('content-type', 'no content type')} {r.text[:80]!r}"
            ) from exc

    def speculative_counters(self) -> SpecCounters:
        """The server's speculative counters now (all 0 when /metrics cannot be read)."""
        try:
            return SpecCounters.parse(self.http.get("/metrics").text)
        except httpx.HTTPError:
            return SpecCounters()

    def stream_chat(self, messages: list[dict[str, Any]], **params: Any) -> Iterator[str | Reply]:
        """Stream a chat completion: yields text deltas, then the `Reply` last.

        Args:
            messages: the conversation ({"role", "content"} dicts).
            **params: request fields (model, temperature, max_tokens, seed, ...); None values are left out.

        Raises:
            ChatError: the server refused the request, failed mid-stream, or cannot be reached.
        """
        body = {"messages": messages, "stream": True, **{k: v for k, v in params.items() if v is not None}}
        start = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        finish = None
        usage: dict[str, int] = {}
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                self._check(r)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError as exc:
                        raise ChatError(f"the server sent a malformed stream event: {data[:80]!r}") from exc
                    if "error" in chunk:
                        raise ChatError(f"the server failed mid-reply: {chunk['error'].get('message')}")
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        if first is None:
                            first = time.perf_counter() - start
                        delta = choice.get("delta", {}).get("content") or ""
                        if delta:
                            parts.append(delta)
                            yield delta
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach the server at {self.where}: {exc}{self._hint}") from exc
        total = time.perf_counter() - start
        yield Reply(
            text="".join(parts),
            finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            seconds_to_first_token=first if first is not None else total,
            seconds=total,
        )


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def _stats_line(reply: Reply, before: SpecCounters, after: SpecCounters) -> str:
    d = after - before
    spec = (
        f", {d.tokens_per_round:.2f} tokens/round over {d.rounds:.0f} rounds, draft acceptance "
        f"{100 * d.draft_acceptance:.0f} %"
        if d.rounds > 0
        else ""
    )
    return (
        f"[{reply.completion_tokens} tokens ({reply.finish_reason}), prompt {reply.prompt_tokens}; "
        f"first token {reply.seconds_to_first_token * 1000:.0f} ms, "
        f"{reply.tokens_per_second:.1f} tok/s{spec}]"
    )


def _answer(
    client: ChatClient, messages: list[dict[str, Any]], params: dict[str, Any], out: TextIO, stats: bool
) -> Reply:
    before = client.speculative_counters() if stats else SpecCounters()
    reply: Reply | None = None
    for item in client.stream_chat(messages, **params):
        if isinstance(item, Reply):
            reply = item
        else:
            out.write(item)
            out.flush()
    assert reply is not None
    out.write("\n")
    if stats:
        click.echo(_stats_line(reply, before, client.speculative_counters()), err=True)
    return reply


@click.command(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit status: 0 every reply arrived (a conversation: ended by /quit or end of input; a refused "
    "turn there is reported and dropped); 1 the server refused the question, failed mid-reply or cannot be "
    "reached (the socket or URL is named), or the message is empty; 2 bad usage.",
)
@click.argument("message", nargs=-1)
@click.option(
    "--socket", metavar="PATH", envvar="IGNIS_SOCKET", help="Unix socket of the server (env IGNIS_SOCKET)."
)
@click.option(
    "--url",
    default="http://localhost:8000",
    show_default=True,
    help="Base URL of a TCP server (used without --socket).",
)
@click.option("--model", help="Model id to ask for. [default: the server's model]")
@click.option("--system", "system_prompt", help="A system message to start the conversation with.")
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Sampling temperature (0 is greedy).",
)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    help="Nucleus mass in (0, 1]. [default: 1, off]",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=-1),
    help="Keep the k most likely tokens (0 or -1: off). [default: 0, off]",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), help="Most tokens per reply. [default: to the context end]"
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**64 - 1),
    help="Seed of the request's random stream. [default: a fresh one per request]",
)
@click.option(
    "--stats", is_flag=True, help="After each reply, print timings and tokens per verify round (stderr)."
)
def main(
    message: tuple[str, ...],
    socket: str | None,
    url: str,
    model: str | None,
    system_prompt: str | None,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    max_tokens: int | None,
    seed: int | None,
    stats: bool,
) -> None:
    """Chat with an ignis server: MESSAGE as one question, stdin when piped, else a conversation."""
    try:
        client = ChatClient(socket=socket, url=url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise click.BadParameter(f"{url!r}: {exc}", param_hint="'--url'") from exc
    try:
        one_shot = " ".join(message) if message else (None if _stdin_is_tty() else sys.stdin.read())
        if one_shot is not None and not one_shot.strip():
            raise ChatError("nothing to send: the message (or piped stdin) is empty")
        params = {
            "model": model or client.model(),
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_tokens": max_tokens,
            "seed": seed,
        }
        history: list[dict[str, Any]] = (
            [{"role": "system", "content": system_prompt}] if system_prompt else []
        )
        if one_shot is not None:
            _answer(client, [*history, {"role": "user", "content": one_shot}], params, sys.stdout, stats)
            return
        click.echo(f"chatting with {params['model']}; /reset starts over, /quit leaves", err=True)
        messages = list(history)
        while True:
            try:
                line = input("> ")
            except EOFError:
                click.echo(err=True)
                return
            if line.strip() in ("/quit", "/exit"):
                return
            if line.strip() == "/reset":
                messages = list(history)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                reply = _answer(client, messages, params, sys.stdout, stats)
            except ChatError as exc:  # one refused turn (e.g. the context is full) does not end the chat
                messages.pop()
                click.echo(
                    f"\nError: {exc}\n(that message was dropped; /reset starts over, /quit leaves)", err=True
                )
                continue
            messages.append({"role": "assistant", "content": reply.text})
    except ChatError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        client.close()


if __name__ == "__main__":
    main()
