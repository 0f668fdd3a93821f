"""Test-suite wide settings: the `long` group.

Tests of about a minute and more each (a full artifact build per family, the end-to-end benchmark
run as a subprocess, the real SmolLM2 model built and served) get the `long` marker here, by node-id
prefix (`tests/long_tests.py`), so that the README's command (`-m "not slow and not long"`, two
xdist workers) stays near ten minutes on a 2-core machine. CI runs them too: `.ci/run` runs the
README's command, then `-m long`.
"""

from __future__ import annotations

import pytest
from long_tests import LONG


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(LONG):
            item.add_marker(pytest.mark.long)
