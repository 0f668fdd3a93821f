"""Fixtures of the server tests: torch on one intra-op thread, and a shared server (8 lanes, dflash2 at
3 draft tokens, the toy model) for tests that do not depend on lane counts."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from server_helpers import Running, remove_short_tmpdirs, serve


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
