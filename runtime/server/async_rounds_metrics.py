"""/metrics series of the engine's async rounds (`ignis-run --async-rounds`, `ignis.runtime.async_rounds`).

Two counters, present only when the model is served with the option:

* `ignis_async_rounds_issued_total`: decode rounds issued from the device's argmax of the previous
  round before the host read it (the rounds whose host work overlapped the device's);
* `ignis_async_rounds_drained_total`: rounds in flight settled first because a step needed the
  ordinary path (a request joining or a prompt chunk to prefill, a sampled lane, penalties,
  `min_tokens`, logprobs or a grammar); each is followed by an ordinary round.

Both stay 0 when the engine has a drafter (async rounds run with speculation off only; the engine logs
a warning). They count over the server's life: an engine rebuilt after a failure adds to them. The
collector is one of the `ServedModel.collectors`, so in `--engine-process` mode it is collected in the
engine process and shipped with the engine's other series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ignis.runtime.async_rounds import AsyncRounds

__all__ = ["AsyncRoundsCollector"]


class AsyncRoundsCollector(Collector):
    """The two counters over the engines the server builds (`track` each one as it is made)."""

    def __init__(self) -> None:
        self._rounds: AsyncRounds | None = None
        self._base_issued = 0  # counts of engines replaced since (rebuilt after a failure)
        self._base_drained = 0

    def track(self, rounds: AsyncRounds | None) -> None:
        """Count a new engine's async rounds (`SpeculativeEngine.async_rounds`; None: off, e.g. with a
        drafter) from now on, keeping what the engine it replaces counted."""
        old = self._rounds
        if old is not None:
            self._base_issued += old.num_issued
            self._base_drained += old.num_drained
        self._rounds = rounds

    def counts(self) -> tuple[int, int]:
        """(rounds issued ahead, rounds drained) so far."""
        r = self._rounds
        issued = self._base_issued + (r.num_issued if r is not None else 0)
        drained = self._base_drained + (r.num_drained if r is not None else 0)
        return issued, drained

    def collect(self) -> Iterator[Any]:
        issued, drained = self.counts()
        yield CounterMetricFamily(
            "ignis_async_rounds_issued",
            "Decode rounds issued from the previous round's device argmax before the host read it "
            "(ignis-run --async-rounds).",
            value=issued,
        )
        yield CounterMetricFamily(
            "ignis_async_rounds_drained",
            "Async rounds in flight settled first because a step needed the ordinary round "
            "(prefill work, or a lane with sampling, penalties, min_tokens, logprobs or a grammar).",
            value=drained,
        )
