"""The Playground: a browser UI served by `ignis-run` at `/playground/` (Chat and Monitor).

The UI is three hand-written static files shipped in this package (`static/`: index.html,
playground.css, playground.js; no build step, no CDN, no third-party script). The page talks only to
endpoints the API itself offers, by relative URLs (so a proxy may mount the server under a prefix):
`POST ../v1/chat/completions` (streamed), `GET ../v1/models`, `GET ../metrics` and `GET ../status`
(`ignis.runtime.server.status`).

Authentication: the static files hold no data and are answered without a key, by `PlaygroundAssets`,
the outermost ASGI layer (so a browser can load the page that then asks for the key). Every request
the page makes carries `Authorization: Bearer KEY` once the user gave the key, so with an API key set
the data endpoints, `/status` included, answer 401 to anyone without it, exactly as for any client.

`install_playground(app, model, lanes)` is the whole hook: it adds the status route and the asset
layer; call it after the app's other middleware is added (the last added is the outermost).
"""

from __future__ import annotations

import hashlib
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from ignis.runtime.server.lanes import LaneLoop
from ignis.runtime.server.model import ServedModel
from ignis.runtime.server.status import status_router

__all__ = ["ASSETS", "PLAYGROUND_PATH", "PlaygroundAssets", "install_playground"]

PLAYGROUND_PATH = "/playground"
# file name -> Content-Type; the only files served (nothing else in the package is reachable).
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
# The page may load only its own files and talk only to its own origin.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _read_assets() -> dict[str, bytes]:
    from importlib import resources  # at app start, not at import

    folder = resources.files(__name__).joinpath("static")
    return {name: folder.joinpath(name).read_bytes() for name in ASSETS}


class PlaygroundAssets:
    """Pure ASGI middleware answering GET and HEAD for the Playground's static files.

    - `/playground` -> 308 to `/playground/` (relative URLs in the page resolve from the folder).
    - `/playground/` -> index.html; `/playground/NAME` -> NAME for NAME in `ASSETS`.
    - Anything else, and other methods, go to the wrapped app (which answers 404 / 405 as usual).

    The files are read from the package once, at construction. Responses carry `Cache-Control:
    no-cache` (an upgraded server is picked up at the next load), an ETag of the build, a
    Content-Security-Policy allowing only the page's own origin, and `X-Content-Type-Options: nosniff`.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._files = _read_assets()
        digest = hashlib.sha256(b"".join(self._files[name] for name in sorted(self._files)))
        self._etag = f'"{digest.hexdigest()[:16]}"'.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(PLAYGROUND_PATH) or scope.get("method") not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        rest = path[len(PLAYGROUND_PATH) :]
        if rest == "":
            root = scope.get("root_path", "")
            await _send(send, 308, [(b"location", f"{root}{PLAYGROUND_PATH}/".encode())], b"")
            return
        name = rest[1:] if rest.startswith("/") else None
        if name == "":
            name = "index.html"
        if name not in ASSETS:
            await self.app(scope, receive, send)
            return
        headers = [
            (b"content-type", ASSETS[name].encode()),
            (b"cache-control", b"no-cache"),
            (b"etag", self._etag),
            (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer"),
        ]
        if name == "index.html":
            headers.append((b"content-security-policy", _CSP.encode()))
        request_headers = dict(scope.get("headers", ()))
        if request_headers.get(b"if-none-match") == self._etag:
            await _send(send, 304, headers, b"")
            return
        body = self._files[name]
        headers.append((b"content-length", str(len(body)).encode()))
        await _send(send, 200, headers, b"" if scope.get("method") == "HEAD" else body)


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_playground(app: FastAPI, model: ServedModel, lanes: LaneLoop) -> None:
    """Add `GET /status` to the app and serve the Playground's files at `/playground/` (module
    docstring). Call it after the app's other middleware (the asset layer must be the outermost)."""
    app.include_router(status_router(model, lanes))
    app.add_middleware(PlaygroundAssets)
