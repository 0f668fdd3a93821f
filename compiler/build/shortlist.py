"""Step 3: the Q4 shortlist head, the output head's rows for the most frequent tokens.

A drafter may propose with this smaller head instead of the full one (`--spec-draft-head shortlist`):
the rows of the target's output head (`lm_head.weight`, or the embedding when tied) for the
`size` most frequent tokens (131,072 by default; the whole vocabulary when it is smaller), stored
as q4_g32 whatever the card, with an int32 map from shortlist row to token id:

    shortlist.head.weight   q4_g32 [S, hidden]   row i = head row of token shortlist.token_ids[i]
    shortlist.token_ids     i32    [S]           token ids, most frequent first (count desc, id asc)

Token frequencies come from the source the recipe names: a text corpus tokenized with the model's
own tokenizer (no special tokens added), or a counts file: "id<whitespace>count" lines ('#' starts a
comment), or JSON (a list of counts indexed by id, or an object {"id": count}). Without a source
every count is 0, which orders the ids ascending; that is allowed only when the whole vocabulary fits.
The order is deterministic: count descending, then token id ascending.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ignis.compiler.build.convert import q4_chunks
from ignis.compiler.build.errors import ShortlistError
from ignis.formats import NinferWriter, TensorInfo
from ignis.formats.manifest import SHORTLIST_HEAD, SHORTLIST_IDS

PREFIX = "shortlist."
HEAD_NAME = SHORTLIST_HEAD.removeprefix(PREFIX)
IDS_NAME = SHORTLIST_IDS.removeprefix(PREFIX)

#: Characters of corpus text tokenized per batch item.
_TEXT_PIECE = 1 << 20


@dataclass(frozen=True)
class FrequencySource:
    """Where the token counts come from.

    Attributes:
        kind: "corpus", "counts" or "none".
        files: the corpus files or the counts file (empty for "none").
    """

    kind: str
    files: tuple[Path, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Manifest form (file names only; their sha256s are in the provenance's inputs)."""
        return {"kind": self.kind, "files": [p.name for p in self.files]}


def shortlist_size(vocab_size: int, size: int) -> int:
    """Rows of the shortlist: `size`, or the whole vocabulary when it is smaller."""
    return min(int(vocab_size), int(size))


def _text_pieces(path: Path) -> Iterator[str]:
    """The file's text in pieces of about `_TEXT_PIECE` characters, cut after a newline."""
    try:
        with open(path, encoding="utf-8") as f:
            buf = ""
            for line in f:
                buf += line
                if len(buf) >= _TEXT_PIECE:
                    yield buf
                    buf = ""
            if buf:
                yield buf
    except (OSError, UnicodeDecodeError) as exc:
        raise ShortlistError(f"{path}: cannot read the corpus file as UTF-8 text: {exc}") from exc


def count_corpus(
    files: Sequence[Path], encode: Callable[[list[str]], list[list[int]]], vocab_size: int
) -> np.ndarray:
    """Count token ids over text files.

    Args:
        files: UTF-8 text files, read in the given order.
        encode: a batch of texts -> their token ids (the model's tokenizer, no special tokens).
        vocab_size: the model's vocabulary; ids at or above it are refused.

    Returns:
        int64 [vocab_size] counts.

    Raises:
        ShortlistError: an unreadable file, or the tokenizer produced an id outside the vocabulary.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in files:
        batch: list[str] = []
        pieces = _text_pieces(path)
        while True:
            batch = [p for _, p in zip(range(8), pieces, strict=False)]
            if not batch:
                break
            for ids in encode(batch):
                arr = np.asarray(ids, dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                    raise ShortlistError(
                        f"{path}: the tokenizer produced id {int(arr.max())} outside the model's vocabulary "
                        f"of {vocab_size}"
                    )
                counts += np.bincount(arr, minlength=vocab_size)
    return counts


def read_counts(path: Path, vocab_size: int) -> np.ndarray:
    """Read a counts file (module docstring) into int64 [vocab_size]; absent ids count 0.

    Raises:
        ShortlistError: unreadable or malformed, an id outside 0..vocab_size-1 or repeated, a negative
            or non-integer count.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    seen: set[int] = set()

    def put(token: object, count: object, where: str) -> None:
        try:
            tid = int(str(token))
        except ValueError:
            raise ShortlistError(f"{path}: {where}: token id {token!r} is not an integer") from None
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ShortlistError(f"{path}: {where}: count {count!r} must be a non-negative integer")
        if not 0 <= tid < vocab_size:
            raise ShortlistError(
                f"{path}: {where}: token id {tid} outside the vocabulary 0..{vocab_size - 1}"
            )
        if tid in seen:
            raise ShortlistError(f"{path}: {where}: token id {tid} appears twice")
        seen.add(tid)
        counts[tid] = count

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ShortlistError(f"{path}: cannot read the counts file: {exc}") from exc
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ShortlistError(f"{path}: not valid JSON: {exc}") from exc
        if isinstance(data, list):
            if len(data) > vocab_size:
                raise ShortlistError(f"{path}: {len(data)} counts for a vocabulary of {vocab_size}")
            for i, c in enumerate(data):
                put(i, c, f"entry {i}")
        elif isinstance(data, dict):
            for k, c in data.items():
                put(k, c, f"key {k!r}")
        else:
            raise ShortlistError(f"{path}: expected a JSON list or object of counts")
        return counts
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ShortlistError(f"{path}: line {lineno}: expected 'id count', got {line!r}")
        try:
            count = int(parts[1])
        except ValueError:
            raise ShortlistError(f"{path}: line {lineno}: count {parts[1]!r} is not an integer") from None
        put(parts[0], count, f"line {lineno}")
    return counts


def select_tokens(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent ids: int32 [min(size, vocab)], count descending then id ascending."""
    ids = np.arange(counts.shape[0], dtype=np.int64)
    order = np.lexsort((ids, -counts.astype(np.int64)))
    return order[: shortlist_size(counts.shape[0], size)].astype(np.int32)


def write_shortlist(
    writer: NinferWriter,
    head: torch.Tensor,
    token_ids: np.ndarray,
    *,
    prefix: str = PREFIX,
) -> tuple[TensorInfo, TensorInfo]:
    """Write the q4_g32 head rows of `token_ids` and the id map: the rows are gathered (one copy of
    the selected rows, none when the shortlist is the whole vocabulary in order) and quantized in row
    chunks on the build's worker threads (`convert.q4_chunks`).

    Args:
        head: float [vocab, hidden] (the output head, or the tied embedding); hidden % 32 == 0.
        token_ids: int32 [S], the shortlist in order.

    Returns:
        The table entries of the head and of the id map.

    Raises:
        ShortlistError: hidden is not a multiple of 32, or an id is outside the head's rows.
    """
    vocab, hidden = int(head.shape[0]), int(head.shape[1])
    if hidden % 32:
        raise ShortlistError(f"the shortlist head is q4_g32: hidden size {hidden} must be a multiple of 32")
    ids = np.asarray(token_ids, dtype=np.int32)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ShortlistError(f"shortlist ids must lie in 0..{vocab - 1}")
    if ids.shape[0] == vocab and np.array_equal(ids, np.arange(vocab, dtype=np.int32)):
        rows = head  # the whole vocabulary in order: no copy
    else:
        rows = head.index_select(0, torch.from_numpy(ids.astype(np.int64)))
    # quantized on the build's worker threads (`convert.q4_chunks`: the one-thread bytes)
    info_head = writer.add_tensor_chunks(
        prefix + HEAD_NAME, dtype="q4_g32", shape=(ids.shape[0], hidden), chunks=q4_chunks(rows)
    )
    info_ids = writer.add_tensor(prefix + IDS_NAME, np.ascontiguousarray(ids, dtype="<i4"))
    return info_head, info_ids


__all__ = [
    "HEAD_NAME",
    "IDS_NAME",
    "PREFIX",
    "FrequencySource",
    "count_corpus",
    "read_counts",
    "select_tokens",
    "shortlist_size",
    "write_shortlist",
]
