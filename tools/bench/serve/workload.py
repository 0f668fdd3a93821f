"""What `ignis-bench` sends: prompts from a JSONL file, seeded random token-id prompts, and the synthetic
agent sessions of `--multi-turn`.

The JSONL format is the one of `shared/bench/prompts.jsonl`: one JSON object a line with an optional
`"id"` (string), an optional `"kind"`, and either `"messages"` (OpenAI chat messages) or `"prompt"` (a
string, or a list of token ids). Blank lines and lines starting with `#` are skipped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_DATASET_NAMES",
    "AgentSession",
    "DatasetError",
    "Prompt",
    "default_dataset",
    "load_jsonl",
    "random_token_prompts",
    "tool_output_text",
]

# Where the shared prompt set lives relative to a checkout (../shared/bench/prompts.jsonl).
DEFAULT_DATASET_NAMES = ("shared", "bench", "prompts.jsonl")


class DatasetError(Exception):
    """A prompt file is missing, unreadable or malformed (the message names the file and line)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a run.

    Attributes:
        id: the dataset's id, or "random-<i>".
        messages: chat messages (None for a plain prompt).
        prompt: a text or token-id prompt for /v1/completions (None for chat messages).
        kind: the dataset's "kind" field ("code", "prose", ...; "random" for token-id prompts).
    """

    id: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    kind: str | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The prompt as chat messages (a text prompt becomes one user message).

        Raises:
            DatasetError: a token-id prompt, which the chat endpoint cannot take.
        """
        if self.messages is not None:
            return self.messages
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        raise DatasetError(f"prompt {self.id!r} is a list of token ids: send it to --endpoint completions")

    def warmup_variant(self) -> Prompt:
        """A prompt of the same size and kind that shares no prefix with this one (token ids and the
        last message's words in reverse order), for warm-up requests: a server with prompt
        checkpoints would otherwise hold this prompt's checkpoint when it is measured, and its TTFT
        would be a restore, not a prefill."""
        if isinstance(self.prompt, list):
            return Prompt(f"warm-up-{self.id}", prompt=self.prompt[::-1], kind=self.kind)
        if isinstance(self.prompt, str):
            return Prompt(f"warm-up-{self.id}", prompt=" ".join(self.prompt.split()[::-1]), kind=self.kind)
        assert self.messages is not None
        messages = [dict(m) for m in self.messages]
        last = messages[-1]
        last["content"] = " ".join(str(last.get("content") or "").split()[::-1])
        return Prompt(f"warm-up-{self.id}", messages=messages, kind=self.kind)

    def completion_prompt(self) -> str | list[int]:
        """The prompt for /v1/completions: the text or ids, or for chat messages their contents joined
        by blank lines (the chat template is the server's and is not applied)."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None
        return "\n\n".join(str(m.get("content") or "") for m in self.messages)


def default_dataset(checkout: Path, cwd: Path) -> tuple[Path | None, list[Path]]:
    """The shared prompt set: (the first existing candidate or None, every candidate tried).

    Candidates: `<checkout>/../shared/bench/prompts.jsonl`; for a git worktree (`.git` is a file naming
    `<main>/.git/worktrees/<name>`), `<main>/../shared/bench/prompts.jsonl`; then
    `<cwd>/../shared/bench/prompts.jsonl`.
    """
    bases = [checkout]
    git = checkout / ".git"
    if git.is_file():
        try:
            line = git.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            line = ""
        if line.startswith("gitdir:"):
            gitdir = Path(line[len("gitdir:") :].strip())
            if gitdir.parent.name == "worktrees" and gitdir.parent.parent.name == ".git":
                bases.append(gitdir.parent.parent.parent)
    bases.append(cwd)
    tried: list[Path] = []
    for base in bases:
        path = (base / ".." / Path(*DEFAULT_DATASET_NAMES)).resolve()
        if path not in tried:
            tried.append(path)
    for path in tried:
        if path.is_file():
            return path, tried
    return None, tried


def load_jsonl(path: Path) -> list[Prompt]:
    """Read a prompt file (module docstring).

    Raises:
        DatasetError: the file cannot be read, a line is not a JSON object, lacks both "messages" and
            "prompt", or holds a field of the wrong type; or the file has no prompt.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read prompt file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise DatasetError(f"prompt file {path} is not UTF-8: {exc}") from exc
    out: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DatasetError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        pid = obj.get("id", f"line-{number}")
        kind = obj.get("kind")
        messages = obj.get("messages")
        prompt = obj.get("prompt")
        if messages is None and prompt is None:
            raise DatasetError(f'{where}: a prompt line needs "messages" or "prompt"')
        if messages is not None and (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise DatasetError(
                f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects'
            )
        if prompt is not None and not (
            isinstance(prompt, str)
            or (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            )
        ):
            raise DatasetError(f'{where}: "prompt" must be a string or a non-empty list of token ids')
        out.append(
            Prompt(id=str(pid), messages=messages, prompt=prompt, kind=None if kind is None else str(kind))
        )
    if not out:
        raise DatasetError(f"prompt file {path} holds no prompt")
    return out


def random_token_prompts(
    num: int, lengths: Sequence[int], id_range: tuple[int, int], seed: int, prefix_len: int = 0
) -> list[Prompt]:
    """`num` prompts of uniform random token ids, seeded; prompt i has `prefix_len` ids shared by every
    prompt, then lengths[i % len(lengths)] ids of its own.

    Args:
        num: how many prompts.
        lengths: prompt lengths in tokens after the shared prefix (each >= 1), cycled.
        id_range: ids are drawn uniformly from [low, high).
        seed: the random seed (the same seed gives the same prompts).
        prefix_len: tokens of the prefix every prompt starts with (a system prompt, for prefix reuse).
    """
    low, high = id_range
    rng = random.Random(seed)
    prefix = [rng.randrange(low, high) for _ in range(prefix_len)]
    return [
        Prompt(
            id=f"random-{i}",
            prompt=prefix + [rng.randrange(low, high) for _ in range(lengths[i % len(lengths)])],
            kind="random",
        )
        for i in range(num)
    ]


_TOOL_WORDS = (
    "status ok error warn path src lib test build value count index file line return module call "
    "result cache token round lane draft commit prefix state layer bytes time ms request server"
).split()


def tool_output_text(rng: random.Random, num_words: int) -> str:
    """Synthetic tool output (log-like lines of words, numbers and paths) of about `num_words` words."""
    lines = []
    left = num_words
    n = 0
    while left > 0:
        k = min(left, rng.randint(6, 12))
        words = []
        for _ in range(k):
            r = rng.random()
            if r < 0.2:
                words.append(str(rng.randint(0, 99999)))
            elif r < 0.3:
                words.append("/" + "/".join(rng.choice(_TOOL_WORDS) for _ in range(3)) + ".py")
            else:
                words.append(rng.choice(_TOOL_WORDS))
        lines.append(f"{n:04d}: " + " ".join(words))
        left -= k
        n += 1
    return "\n".join(lines)


@dataclass
class AgentSession:
    """One synthetic agent conversation of `--multi-turn`: a system prompt, a task, then per turn the
    model's reply and a tool output of a drawn token count.

    Chat sessions hold messages; completions sessions hold the conversation as token ids (the reply's
    ids as generated, the tool output as random ids), so every turn's prompt extends the previous
    turn's prompt plus reply exactly.

    Attributes:
        index: the session's number.
        rng: its own random stream (seeded from the run's seed and the index).
        messages: the chat conversation so far.
        token_ids: the completions conversation so far.
        turn: turns completed.
        tokens_per_word: prompt tokens per tool-output word (chat), measured before the run.
        done_reason: None while running; "turns" when all turns ran, "context" when the next turn would
            not fit the context, "error" after a failed turn.
    """

    index: int
    rng: random.Random
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    turn: int = 0
    tokens_per_word: float = 2.0
    done_reason: str | None = None
