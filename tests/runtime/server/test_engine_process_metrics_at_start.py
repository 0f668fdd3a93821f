"""`/metrics` before the first request lists the engine's own series (the prompt checkpoint pool's and
the async rounds' counters at 0) with `--engine-process` as in a thread: the engine process ships them
with its ready message. A Prometheus counter that first appears at a non-zero value loses that
increase to `rate()` / `increase()`, and a dashboard sees no series until a request was served."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from server_helpers import build_tiny_hybrid_artifact, serve

from ignis.runtime.server.model import SpecDefaults

pytest.importorskip("ignis.compiler.build")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hybrid_artifact(tmp_path_factory.mktemp("art"))


class _AsyncSource:
    """The artifact source loaded with `async_rounds` on (what `ignis-run --async-rounds` passes)."""

    def __init__(self, artifact: Path) -> None:
        from ignis.runtime.server.artifact_source import ArtifactSource

        self._inner = ArtifactSource(artifact)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "_inner":  # not set yet (unpickled in an engine process)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def load(self, settings):  # type: ignore[no-untyped-def]
        return self._inner.load(dataclasses.replace(settings, async_rounds=True))


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_the_engine_series_are_listed_before_the_first_request(artifact: Path) -> None:
    seen = {}
    for engine_process in (False, True):
        source = _AsyncSource(artifact)
        with serve(source, SpecDefaults("off"), engine_process=engine_process) as running:  # type: ignore[arg-type]
            with running.client() as c:
                seen[engine_process] = _samples(c.get("/metrics").text)
    thread, process = seen[False], seen[True]
    for name in ("ignis_async_rounds_issued_total", "ignis_async_rounds_drained_total"):
        assert thread.get(name) == 0.0, sorted(thread)
        assert process.get(name) == 0.0, sorted(process)
    engine_own = {n for n in thread if n.startswith(("ignis_prompt_checkpoint", "ignis_async_rounds"))}
    assert engine_own - set(process) == set(), sorted(engine_own - set(process))
