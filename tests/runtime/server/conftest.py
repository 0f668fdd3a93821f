"""Fixtures of the server tests: torch on one intra-op thread, a shared server (8 lanes, dflash2 at
3 draft tokens, the toy model) for tests that do not depend on lane counts, and `captured` (the
CLI's server, stubbed before it serves)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
import torch
from server_helpers import Running, remove_short_tmpdirs, serve

from ignis.runtime.server.runner import IgnisServer


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """Tiny tensors: intra-op threads only add dispatch overhead (and the CI cores are shared)."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)
    remove_short_tmpdirs()


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    """A shared server: 8 lanes, dflash2 at 3 draft tokens (the drafter is the target: greedy drafts pass)."""
    with serve(lanes=8, queue_size=16) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Running) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[IgnisServer]]:
    """Stub the serving loop of `ignis-run`: record the server that would run, release its sockets;
    the root logger's level (the CLI sets it) is put back after."""
    servers: list[IgnisServer] = []

    def fake_run(self: IgnisServer) -> None:
        servers.append(self)
        self._release_sockets()

    monkeypatch.setattr(IgnisServer, "run", fake_run)
    root = logging.getLogger()
    level = root.level
    yield servers
    root.setLevel(level)
