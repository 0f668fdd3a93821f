"""`--spec-backend replay`: a benchmarking drafter with a fixed acceptance rate (not for production).

It measures what the verify round costs and gives at a chosen acceptance, with no drafter model:
each prompt's greedy speculation-off output is recorded first (`ignis-bench --save-outputs FILE`
writes it), then the server replays it as drafts, each draft right with probability p.

    ignis-bench --socket S --endpoint completions --input-len 32 --max-tokens 256 --save-outputs ref.jsonl
    ignis-run --artifact A --spec-backend replay --spec-replay ref.jsonl --spec-replay-accept 0.885

The file (`load_replay_file`): JSON lines `{"prompt_token_ids": [...], "output_token_ids": [...]}`
(the engine's prompt ids, so chat prompts count after the chat template); a prompt may have several
recorded outputs (runs at other lane counts whose numerics differed). A lane whose prompt is in it
follows the recorded output that agrees with what it has generated so far: for an output of L
tokens it drafts reference[L + j] for draft j with probability p and otherwise another token
(uniform over the other vocab_size - 1 ids), so with k drafts a round commits 1 + sum_{j=1..k} p^j
tokens on average (greedy). The coin flips come from the lane's own `random.Random`, seeded by
(seed, prompt): a request's acceptance pattern does not depend on what else is running. A prompt
not in the file, a lane past its reference's end, and a lane whose output agrees with no recorded
output (sampling, numerics) draft nothing from there on: plain decode rounds. The output stays
exact whatever is drafted: the verify round decides every token.

Drafts are point masses (no q): under sampling they are verified by rejection sampling like any
deterministic drafter, and the acceptance is then not p.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters import DRAFTERS, register_drafter
from ignis.runtime.drafters.base import BaseDrafter, DraftProposal, DraftRequest
from ignis.runtime.errors import ConfigError

__all__ = ["ReplayDrafter", "ReplayOptions", "build_replay_drafter", "load_replay_file"]

log = logging.getLogger("ignis.runtime.drafters.replay")


def load_replay_file(path: str | Path) -> dict[tuple[int, ...], list[list[int]]]:
    """Read a replay file (module docstring): prompt token ids -> its distinct recorded outputs,
    longest first (an output that is a prefix of another is dropped).

    Raises:
        ConfigError: the file cannot be read, or a line is not an object with integer lists
            `prompt_token_ids` (non-empty) and `output_token_ids` (named with its line number).
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--spec-replay {p}: cannot read it: {exc}") from exc
    out: dict[tuple[int, ...], list[list[int]]] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"--spec-replay {p}:{n}: not JSON: {exc}") from exc
        prompt = row.get("prompt_token_ids") if isinstance(row, dict) else None
        output = row.get("output_token_ids") if isinstance(row, dict) else None
        ok = (
            isinstance(prompt, list)
            and isinstance(output, list)
            and len(prompt) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in (*prompt, *output))
        )
        if not ok:
            raise ConfigError(
                f"--spec-replay {p}:{n}: expected {{'prompt_token_ids': [ids...], 'output_token_ids': "
                f"[ids...]}} with non-negative integer ids and a non-empty prompt"
            )
        out.setdefault(tuple(prompt), []).append(list(output))
    return {k: _distinct(v) for k, v in out.items()}


def _distinct(outputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """The outputs longest first, without duplicates and without one that is a prefix of another."""
    kept: list[list[int]] = []
    for o in sorted((list(o) for o in outputs), key=len, reverse=True):
        if not any(k[: len(o)] == o for k in kept):
            kept.append(o)
    return kept


@dataclass(frozen=True)
class ReplayOptions:
    """`ignis-run`'s replay settings: `--spec-replay PATH`, `--spec-replay-accept`, `--spec-replay-seed`."""

    path: Path
    accept: float = 0.885
    seed: int = 0


@dataclass
class _Lane:
    references: list[list[int]]  # empty: the prompt is not in the file
    rng: random.Random
    current: int = 0  # the reference the lane follows; -1 once it agrees with none
    checked: int = 0  # output tokens already found equal to it


class ReplayDrafter(BaseDrafter):
    """Replays recorded outputs as drafts, each right with probability `accept` (module docstring).

    Args:
        references: prompt token ids -> its recorded outputs (`load_replay_file`), or one output.
        vocab_size: the model's vocabulary (wrong drafts are drawn in [0, vocab_size)).
        accept: probability that each draft is right, in [0, 1].
        seed: mixed with each prompt into its lane's random stream.

    Raises:
        ConfigError: accept outside [0, 1] or vocab_size < 2.
    """

    name = "replay"
    supports_checkpoints = True

    def __init__(
        self,
        references: Mapping[tuple[int, ...], Sequence[Sequence[int]] | Sequence[int]],
        *,
        vocab_size: int,
        accept: float,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= float(accept) <= 1.0:
            raise ConfigError(f"--spec-replay-accept must be in [0, 1], got {accept}")
        if vocab_size < 2:
            raise ConfigError(f"the replay drafter needs vocab_size >= 2, got {vocab_size}")
        self.references: dict[tuple[int, ...], list[list[int]]] = {}
        for k, v in references.items():
            many = [list(o) for o in v] if v and not isinstance(v[0], int) else [list(v)]  # type: ignore[arg-type]
            self.references[tuple(k)] = _distinct(many)
        self.vocab_size = int(vocab_size)
        self.accept = float(accept)
        self.seed = int(seed)
        self._lanes: dict[int, _Lane] = {}
        #: lanes started without a reference, and lanes that left theirs (for the log and tests)
        self.unknown_prompts = 0
        self.left_reference = 0

    def _rng(self, prompt: tuple[int, ...]) -> random.Random:
        digest = hashlib.blake2b(repr((self.seed, prompt)).encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little"))

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Look the prompt up; a prompt not in the file drafts nothing."""
        prompt = tuple(int(t) for t in prompt_token_ids)
        refs = self.references.get(prompt, [])
        if not refs:
            self.unknown_prompts += 1
            log.debug("lane %d: prompt of %d tokens not in the replay file: no drafts", lane_id, len(prompt))
        self._lanes[lane_id] = _Lane(refs, self._rng(prompt), current=0 if refs else -1)

    def end_lane(self, lane_id: int) -> None:
        self._lanes.pop(lane_id, None)

    def snapshot_lane(self, lane_id: int, num_tokens: int) -> DrafterSnapshot:
        """Nothing to keep: the lane is a function of its prompt (`restore_lane` looks it up again)."""
        return DrafterSnapshot(num_tokens=int(num_tokens), meta={"is_truncatable": 1})

    def restore_lane(self, lane_id: int, prompt_token_ids: Sequence[int], snapshot: DrafterSnapshot) -> None:
        """As `start_lane`."""
        self.start_lane(lane_id, prompt_token_ids)

    def _wrong(self, token: int, rng: random.Random) -> int:
        return (token + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def _follow(self, lane: _Lane, produced: Sequence[int]) -> list[int] | None:
        """The reference the lane's output so far agrees with (switching to another recorded output
        when the current one stops agreeing), or None when none does."""
        done = len(produced)
        if lane.current >= 0:
            ref = lane.references[lane.current]
            fresh = [int(t) for t in produced[lane.checked :]]
            if done <= len(ref) and fresh == ref[lane.checked : done]:
                lane.checked = done
                return ref
        out = [int(t) for t in produced]
        for i, ref in enumerate(lane.references):
            if i != lane.current and done <= len(ref) and ref[:done] == out:
                lane.current, lane.checked = i, done
                return ref
        if lane.current >= 0:
            self.left_reference += 1
            log.debug("lane output agrees with no recorded output after %d tokens: no drafts", done)
        lane.current = -1
        return None

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        out = []
        for req in requests:
            lane = self._lanes.get(req.lane_id)
            drafts: list[int] = []
            if lane is not None and lane.current >= 0:
                produced = req.token_ids[req.num_prompt_tokens :]
                ref = self._follow(lane, produced)
                if ref is not None:
                    done = len(produced)
                    for j in range(min(req.num_drafts, len(ref) - done)):
                        truth = ref[done + j]
                        ok = lane.rng.random() < self.accept
                        drafts.append(truth if ok else self._wrong(truth, lane.rng))
            out.append(DraftProposal(torch.tensor(drafts, dtype=torch.int64)))
        return out


def build_replay_drafter(*, path: str | Path, vocab_size: int, accept: float, seed: int = 0) -> ReplayDrafter:
    """The registered `replay` factory: `ReplayDrafter` over `load_replay_file(path)`.

    Raises:
        ConfigError: an unreadable or malformed file, accept outside [0, 1].
    """
    refs = load_replay_file(path)
    log.info(
        "replay drafter (benchmarking only): %d recorded prompt(s) from %s, each draft right with p = %g",
        len(refs),
        path,
        accept,
    )
    return ReplayDrafter(refs, vocab_size=vocab_size, accept=accept, seed=seed)


if "replay" not in DRAFTERS:
    register_drafter("replay", build_replay_drafter)
