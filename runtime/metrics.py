"""Speculative-decoding counters (plain Python; the Prometheus exporter reads `samples()` later).

Unit of counting: the **lane-round**, one lane's share of one verify round in which that lane carried
at least one draft token. A lane that took a plain decode row (0 drafts: backend `off`, a row budget
too small for the lane count, or a drafter that proposed nothing) is not a speculative lane-round and
changes no counter here. Tokens past a stop condition are never counted (`ignis.runtime.stops`).

Counters (all monotonic, starting at 0):

- `ignis_speculative_rounds_total`: speculative lane-rounds.
- `ignis_speculative_drafted_tokens_total`: draft tokens proposed in them (sum of each lane-round's k).
- `ignis_speculative_accepted_tokens_total`: tokens those lane-rounds committed and emitted: the
  accepted drafts plus the model's own (bonus or recovered) token, i.e. the committed run of 1..k+1
  tokens, cut at a stop. Hence

      accepted_tokens_total / rounds_total = tokens per round (the seeds' "acceptance", >= 1;
      e.g. 3.46 for DFlash2 at 7 draft tokens).

- `ignis_speculative_position_drafted_total{position}`: lane-rounds that proposed a draft at
  `position` (0 = the first draft after the anchor, ..., k-1), i.e. lane-rounds with k > position.
- `ignis_speculative_position_accepted_total{position}`: lane-rounds whose draft at `position` was
  accepted and emitted (so all drafts before it were too). accepted{i} / drafted{i} is the
  acceptance rate at position i; sum over i of accepted{i} = accepted drafts emitted.

Identity: accepted_tokens_total = sum_i position_accepted_total{i} + (number of lane-rounds whose
bonus token was emitted), and the latter equals rounds_total unless a stop fell on an accepted draft.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

__all__ = ["SpeculativeMetrics"]


class SpeculativeMetrics:
    """The five speculative counters (module docstring). Not thread-safe: one engine thread updates it.

    Attributes:
        rounds_total: `ignis_speculative_rounds_total`.
        drafted_tokens_total: `ignis_speculative_drafted_tokens_total`.
        accepted_tokens_total: `ignis_speculative_accepted_tokens_total`.
        position_drafted_total: position -> `ignis_speculative_position_drafted_total{position}`.
        position_accepted_total: position -> `ignis_speculative_position_accepted_total{position}`.
    """

    def __init__(self) -> None:
        self.rounds_total = 0
        self.drafted_tokens_total = 0
        self.accepted_tokens_total = 0
        self.position_drafted_total: defaultdict[int, int] = defaultdict(int)
        self.position_accepted_total: defaultdict[int, int] = defaultdict(int)

    def record_round(self, *, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Count one speculative lane-round.

        Args:
            num_drafted: k, drafts the lane carried (>= 1).
            num_accepted: accepted drafts that were emitted (0..k); drafts after a stop are not.
            num_emitted: tokens of the committed run emitted: num_accepted + 1 normally, num_accepted
                when a stop fell on an accepted draft (then num_accepted >= 1).

        Raises:
            ValueError: the numbers are inconsistent.
        """
        self._check(num_drafted, num_accepted, num_emitted)
        self.rounds_total += 1
        self.drafted_tokens_total += num_drafted
        self.accepted_tokens_total += num_emitted
        for i in range(num_drafted):
            self.position_drafted_total[i] += 1
        for i in range(num_accepted):
            self.position_accepted_total[i] += 1

    def record_rounds(self, rounds: Iterable[tuple[int, int, int]]) -> None:
        """Count several speculative lane-rounds at once (a step's): each (num_drafted, num_accepted,
        num_emitted) as `record_round`'s arguments. Every tuple is checked before any counter moves.

        Raises:
            ValueError: as `record_round`, for the first inconsistent tuple (no counter changed).
        """
        rounds = list(rounds)
        for k, acc, em in rounds:
            if k < 1 or not 0 <= acc <= k or em not in (acc, acc + 1) or em < 1:
                self._check(k, acc, em)  # raises with `record_round`'s message
        pos_d, pos_a = self.position_drafted_total, self.position_accepted_total
        for k, acc, em in rounds:
            self.drafted_tokens_total += k
            self.accepted_tokens_total += em
            for i in range(k):
                pos_d[i] += 1
            for i in range(acc):
                pos_a[i] += 1
        self.rounds_total += len(rounds)

    @staticmethod
    def _check(num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        if num_drafted < 1:
            raise ValueError(f"a speculative round has >= 1 draft, got num_drafted={num_drafted}")
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"num_accepted={num_accepted} outside 0..num_drafted={num_drafted}")
        if num_emitted not in (num_accepted, num_accepted + 1) or num_emitted < 1:
            raise ValueError(
                f"num_emitted={num_emitted} must be num_accepted or num_accepted + 1 and >= 1 "
                f"(num_accepted={num_accepted})"
            )

    @property
    def tokens_per_round(self) -> float:
        """accepted_tokens_total / rounds_total (0.0 before the first speculative round)."""
        return self.accepted_tokens_total / self.rounds_total if self.rounds_total else 0.0

    def acceptance_rate(self, position: int) -> float:
        """position_accepted_total{position} / position_drafted_total{position} (0.0 if never drafted)."""
        drafted = self.position_drafted_total.get(position, 0)
        return self.position_accepted_total.get(position, 0) / drafted if drafted else 0.0

    def samples(self) -> list[tuple[str, dict[str, str], int]]:
        """Every counter as (metric name, labels, value), positions ascending, for an exporter."""
        out: list[tuple[str, dict[str, str], int]] = [
            ("ignis_speculative_rounds_total", {}, self.rounds_total),
            ("ignis_speculative_drafted_tokens_total", {}, self.drafted_tokens_total),
            ("ignis_speculative_accepted_tokens_total", {}, self.accepted_tokens_total),
        ]
        for pos in sorted(self.position_drafted_total):
            out.append(
                (
                    "ignis_speculative_position_drafted_total",
                    {"position": str(pos)},
                    self.position_drafted_total[pos],
                )
            )
        for pos in sorted(self.position_drafted_total):
            out.append(
                (
                    "ignis_speculative_position_accepted_total",
                    {"position": str(pos)},
                    self.position_accepted_total.get(pos, 0),
                )
            )
        return out
