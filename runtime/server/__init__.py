"""The ignis server: OpenAI-compatible HTTP/1.1 over a Unix socket (and optionally TCP).

- `model`: `ServedModel` (engine factory + tokenizer + name) and `ModelSource` (a model before loading).
- `settings`: the speculative settings from profile, config file and command line.
- `lanes`: the lane loop, one thread running `engine.step()` and fanning tokens out per request.
- `app`: the FastAPI app (endpoints, SSE streaming, OpenAI-style errors).
- `protocol`: request and response models (the OpenAPI schema).
- `metrics`: Prometheus metrics.
- `sockets`: the Unix socket's creation rules; `runner`: uvicorn, signals, shutdown.

`ignis-run` (`ignis.runtime.cli`) is the command over these; docs/serving.md shows client use.
"""

from ignis.runtime.server.app import create_app
from ignis.runtime.server.lanes import LaneLoop
from ignis.runtime.server.model import ModelSettings, ModelSource, ServedModel
from ignis.runtime.server.runner import IgnisServer, ServerOptions

__all__ = [
    "IgnisServer",
    "LaneLoop",
    "ModelSettings",
    "ModelSource",
    "ServedModel",
    "ServerOptions",
    "create_app",
]
