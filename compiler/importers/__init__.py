"""Checkpoint importers: HF folders (`hf`) and GGUF files (`gguf`), one typed result.

    from ignis.compiler.importers import load_checkpoint
    ckpt = load_checkpoint("path/to/hf_folder_or.gguf")
    ckpt.config                         # the family's frozen config (HF field names)
    ckpt.tensors["model.norm.weight"]   # canonical (HF) names, loaded on access
    ckpt.tokenizer                      # ignis.runtime.tokenizer.TokenizerSpec or None

Both importers are generic over families: the config is parsed by `config_from_hf`, names are mapped
by the family's `map_hf_name` (GGUF names first through gguf-py's tensor-name tables), and the
tensor set is validated by `check_tensor_set`, which lists every missing and unexpected tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ignis.compiler.errors import CheckpointError
from ignis.runtime.errors import ConfigError, UnknownModelTypeError
from ignis.runtime.families.base import FamilyConfig
from ignis.runtime.tokenizer import TokenizerSpec


class LazyTensors(Mapping[str, torch.Tensor]):
    """Read-only name -> tensor mapping whose shapes are known up front and data is read on access.

    Each `tensors[name]` reads (and for GGUF dequantizes) the tensor again; keep the result if it is
    needed twice. `load_all()` returns a plain dict.

    Args:
        shapes: name -> shape (logical, HF layout) of every tensor.
        encodings: name -> storage encoding ("BF16", "F32", "Q4_1", ...), informational.
        loader: name -> tensor.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        encodings: Mapping[str, str],
        loader: Callable[[str], torch.Tensor],
    ) -> None:
        self._shapes = dict(shapes)
        self._encodings = dict(encodings)
        self._loader = loader

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of every tensor (no data read)."""
        return dict(self._shapes)

    @property
    def encodings(self) -> dict[str, str]:
        """name -> storage encoding as found in the checkpoint."""
        return dict(self._encodings)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        return self._loader(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def load_all(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every tensor, read now (converted to `dtype` when given)."""
        out = {}
        for name in self._shapes:
            t = self._loader(name)
            out[name] = t if dtype is None else t.to(dtype)
        return out


@dataclass
class Checkpoint:
    """An imported checkpoint.

    Attributes:
        config: the family config (`config.model_type` names the family).
        tensors: canonical name -> tensor, lazy; holds every mapped tensor, including those under
            the `ignore_prefixes` the importer was given (e.g. `mtp.*`), which were not validated.
        tokenizer: the tokenizer and chat template, or None when the checkpoint has none.
        source: the folder or file imported.
        format: "hf" or "gguf".
        raw_config: the config dict the family config was parsed from (HF `config.json`, or the one
            built from GGUF metadata).
        metadata: format-specific extras (e.g. GGUF `general.*` keys, the safetensors files read).
    """

    config: FamilyConfig
    tensors: LazyTensors
    tokenizer: TokenizerSpec | None
    source: Path
    format: str
    raw_config: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)


def naming_file(exc: ConfigError | UnknownModelTypeError, path: Path) -> Exception:
    """`exc` again, of the same type, its message prefixed with the file the config came from (a
    subclass with fields of its own is returned unchanged)."""
    if type(exc) not in (ConfigError, UnknownModelTypeError):
        return exc
    return type(exc)(f"{path}: {exc}")


def load_checkpoint(path: str | Path, *, ignore_prefixes: tuple[str, ...] = ()) -> Checkpoint:
    """Import an HF folder or a `.gguf` file (dispatch on what `path` is).

    Raises:
        CheckpointError: the path does not exist or is neither a folder nor a GGUF file (a `.gguf`
            name or the GGUF magic); or
            whatever the chosen importer raises (see `import_hf`, `import_gguf`).
    """
    p = Path(path)
    if p.is_dir():
        from ignis.compiler.importers.hf import import_hf

        return import_hf(p, ignore_prefixes=ignore_prefixes)
    if p.is_file() and (p.suffix.lower() == ".gguf" or _starts_with(p, b"GGUF")):
        from ignis.compiler.importers.gguf import import_gguf

        return import_gguf(p)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    hint = ""
    if p.is_file() and (
        p.suffix == ".safetensors" or p.name in ("config.json", "model.safetensors.index.json")
    ):
        hint = f"; pass the folder that holds it ({p.parent})"
    raise CheckpointError(
        f"{p}: expected an HF checkpoint folder (config.json + safetensors) or a GGUF file{hint}"
    )


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


__all__ = ["Checkpoint", "LazyTensors", "load_checkpoint"]
