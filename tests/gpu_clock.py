"""The GPU at its working clock before a timing that compares a first run with later ones.

A GPU left idle drops its SM clock to its idle level, and the driver raises it again only after
some time under load; under a light, launch-bound load (a tiny model's decode rounds) the GPU part
of every round runs several times slower until then. A test that times the first served request
against the tenth right after the load (which leaves the GPU mostly idle: a capture launches
nothing) would measure that ramp, not the engine's first-use costs. `busy_gpu` keeps the GPU fully
busy for a moment with torch's spin kernel (`torch.cuda._sleep`: no kernel, library or allocation
the engine uses), which brings the clock up before the first timed run.
"""

from __future__ import annotations

import time

import torch

SPIN_CYCLES = 1_000_000
"""Clock cycles one spin kernel waits."""


def busy_gpu(seconds: float = 0.3) -> int:
    """Keep the current CUDA device busy with spin kernels for about `seconds` of wall time (launched
    eight at a time, synchronized after each eight). Returns the kernels launched."""
    launched = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(8):
            torch.cuda._sleep(SPIN_CYCLES)
        launched += 8
        torch.cuda.synchronize()
    return launched
