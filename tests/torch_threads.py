"""A module-scoped autouse fixture that runs a test module's torch ops on one CPU thread (restoring
the count after it). A test module takes it with ``from torch_threads import one_torch_thread`` (an
autouse fixture imported into the module applies to the module's tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)
