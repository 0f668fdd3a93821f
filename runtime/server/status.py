"""`GET /status`: the server's settings and live state as one JSON object (the Playground's Monitor
reads it beside `/metrics`; any client may).

The object (every figure is read at request time; nothing is cached):

- `model`: the served name; `aliases`; `created` (Unix seconds of the load); `max_context` (tokens,
  prompt + output, or null for the model's own).
- `speculative`: `backend` (dflash2, mtp, ngram, draft-model, off), `draft_tokens` (drafts per lane
  per round, 0 with off), `draft_rows` (the row budget, 0 means 8), `draft_head` (full, shortlist).
- `lanes`: `max` (`--lanes`), `active` (decoding or being prefilled), `waiting` (queued for a lane),
  `queue_size` (`--queue-size`), `engine_restarts` (engines rebuilt after a failure).
- `started`: Unix seconds the app was built; `uptime_s`: seconds since (monotonic clock).
- `version`: the installed ignis version (null when not installed as a distribution).
- `gpu`: null unless this process (with `--engine-process`: the engine process, as last shipped)
  holds CUDA memory; else, for the device it holds most on, `index`,
  `name`, `total_bytes`,
  `used_bytes` (the whole device, other processes included: total minus `cudaMemGetInfo`'s free),
  `allocated_bytes` and `reserved_bytes` (this process's tensors and its caching allocator's pool),
  `peak_allocated_bytes` (since start or the last peak reset). Reading it never creates a CUDA context.

It sits behind the same authentication as the rest of the API (an API key, when one is set, guards
every path but `/health`).
"""

from __future__ import annotations

import sys
import time
from importlib import metadata
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from ignis.runtime.server.lanes import LaneLoop
from ignis.runtime.server.model import ServedModel

__all__ = ["STATUS_PATH", "ServerStatus", "gpu_memory", "status_router"]

STATUS_PATH = "/status"


def _version() -> str | None:
    try:
        return metadata.version("ignis")
    except metadata.PackageNotFoundError:
        return None


def gpu_memory() -> dict[str, Any] | None:
    """This process's CUDA device memory on the device it holds most on (module docstring), or None
    when it holds none (a CPU server, or torch not imported): the check never initializes CUDA itself.

    Raises:
        RuntimeError: from torch when the device cannot be queried (a lost device).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    # The device this process holds most memory on (the allocator's figures are host-side; asking a
    # device this process never used for its free memory would create a context on it). The calling
    # thread's current device is no guide: a request handler's thread sits on device 0.
    reserved, index = max((int(torch.cuda.memory_reserved(i)), i) for i in range(torch.cuda.device_count()))
    if reserved == 0:
        return None
    free, total = torch.cuda.mem_get_info(index)
    return {
        "index": index,
        "name": torch.cuda.get_device_name(index),
        "total_bytes": int(total),
        "used_bytes": int(total - free),
        "allocated_bytes": int(torch.cuda.memory_allocated(index)),
        "reserved_bytes": int(torch.cuda.memory_reserved(index)),
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(index)),
    }


class SpeculativeStatus(BaseModel):
    """The speculative settings the engine runs with."""

    backend: str = Field(description="dflash2, mtp, ngram, draft-model or off")
    draft_tokens: int = Field(description="drafts per lane per round (0 with off)")
    draft_rows: int = Field(description="row budget of a round across lanes (0 means 8)")
    draft_head: str = Field(description="proposal head: full or shortlist")


class LanesStatus(BaseModel):
    """The lane loop now."""

    max: int = Field(description="lanes decoding at once (--lanes)")
    active: int = Field(description="lanes decoding or being prefilled")
    waiting: int = Field(description="requests queued for a lane")
    queue_size: int = Field(description="requests that may wait beyond max (--queue-size)")
    engine_restarts: int = Field(description="engines rebuilt after a failure")


class GpuStatus(BaseModel):
    """CUDA device memory, in bytes."""

    index: int
    name: str
    total_bytes: int
    used_bytes: int = Field(description="the whole device's use, other processes included")
    allocated_bytes: int = Field(description="this process's tensors")
    reserved_bytes: int = Field(description="this process's caching allocator pool")
    peak_allocated_bytes: int


class ServerStatus(BaseModel):
    """`GET /status` (module docstring)."""

    model: str
    aliases: list[str]
    created: int = Field(description="Unix seconds of the model's load")
    max_context: int | None = Field(description="tokens, prompt + output; null: the model's own")
    speculative: SpeculativeStatus
    lanes: LanesStatus
    started: float = Field(description="Unix seconds the app was built")
    uptime_s: float
    version: str | None
    gpu: GpuStatus | None = Field(description="null unless this process holds CUDA memory")


def status_router(model: ServedModel, lanes: LaneLoop) -> APIRouter:
    """A router with `GET /status` over the served model and its lane loop (module docstring)."""
    router = APIRouter()
    started, started_mono = time.time(), time.monotonic()
    version = _version()

    @router.get(STATUS_PATH, response_model=ServerStatus, tags=["server"])
    def status() -> dict[str, Any]:
        """The served model, its speculative settings, the lanes and GPU memory (JSON)."""
        snap = lanes.snapshot
        spec = model.spec
        return {
            "model": model.name,
            "aliases": list(model.aliases),
            "created": model.created,
            "max_context": lanes.max_context,
            "speculative": {
                "backend": spec.backend,
                "draft_tokens": spec.draft_tokens if spec.backend != "off" else 0,
                "draft_rows": spec.draft_rows,
                "draft_head": spec.draft_head,
            },
            "lanes": {
                "max": lanes.max_lanes,
                "active": snap.num_active,
                "waiting": snap.num_waiting,
                "queue_size": lanes.queue_size,
                "engine_restarts": lanes.num_engine_restarts,
            },
            "started": started,
            "uptime_s": time.monotonic() - started_mono,
            "version": version,
            "gpu": getattr(lanes, "gpu_memory", gpu_memory)(),  # an engine process's, as shipped
        }

    return router
