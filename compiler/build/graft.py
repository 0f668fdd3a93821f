"""Step 2: graft a DFlash2 drafter into the target's `.ninfer`, under its own name prefix.

The drafter checkpoint is a folder in the public layout (`config.json` plus safetensors, single or
sharded with `model.safetensors.index.json`). Its tensors keep their checkpoint names behind the
prefix (`dflash2.` by default: `layers.0.self_attn.q_proj.weight` -> `dflash2.layers.0...`), so the
runtime's DFlash2 family loads a real drafter unchanged; they are converted by the card profile's
rule like the target's (`convert.storage_dtype`). The drafter shares the target's embedding and
output head: a copy of either in the drafter checkpoint (`embed_tokens.weight`, `lm_head.weight`)
is not grafted (the plan says so).

Fit checks (`check_fit`, every misfit listed at once, `DrafterMismatchError`; fields are read at the
top level of config.json or in its `dflash_config` table, as the public DFlash checkpoints nest them):

- `hidden_size` equals the target's (the drafter reads the target's hidden states);
- every `target_layer_ids` entry is a layer of the target (0 .. num_hidden_layers - 1);
- `mask_token_id` is inside the target's embedding (0 .. vocab_size - 1);
- a `vocab_size` in the drafter config, if any, equals the target's (the head is shared).

When the runtime's DFlash2 module (`ignis.runtime.drafters.dflash2`) is installed, its definitions
are used as well: `DFlash2Config.from_hf(raw)` validates the config, `check_dflash2_fits(config,
target)` adds its own checks (e.g. the target depth the drafter was trained on), checkpoint aliases
are mapped to the public names (`normalize_dflash2_names`), and `dflash2_tensor_shapes(config)` makes
missing, unexpected and misshapen tensors an error (all listed).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ignis.compiler.build.errors import DrafterMismatchError, MissingTensorsError

#: Drafter checkpoint tensors not grafted: the target's embedding and head are shared.
SHARED_WITH_TARGET = ("embed_tokens.weight", "model.embed_tokens.weight", "lm_head.weight")

_INDEX = "model.safetensors.index.json"


@dataclass
class DrafterCheckpoint:
    """A drafter checkpoint folder, read lazily.

    Attributes:
        source: the folder.
        kind: the drafter kind ("dflash2").
        raw_config: config.json as a dict.
        config: the runtime's DFlash2 config object when its module is installed, else None.
        shapes: tensor name -> shape (checkpoint names, shared tensors dropped).
        dropped: names not grafted (shared with the target).
        files: the files read (config + safetensors), for provenance.
    """

    source: Path
    kind: str
    raw_config: dict[str, Any]
    config: Any
    shapes: dict[str, tuple[int, ...]]
    dropped: list[str]
    files: list[Path]
    _get: Callable[[str], torch.Tensor] = field(repr=False)

    def load(self, name: str) -> torch.Tensor:
        """Read one tensor (checkpoint name)."""
        return self._get(name)

    def loaders(self) -> dict[str, Callable[[], torch.Tensor]]:
        """name -> zero-argument loader, for `convert.make_jobs`."""
        return {n: (lambda n=n: self._get(n)) for n in self.shapes}


def _drafter_module() -> Any:
    try:
        return importlib.import_module("ignis.runtime.drafters.dflash2")
    except ImportError:
        return None


def _fail(folder: Path, msg: str) -> DrafterMismatchError:
    return DrafterMismatchError(f"{folder}: {msg}", problems=[msg])


def load_drafter(path: str | Path) -> DrafterCheckpoint:
    """Open a DFlash2 drafter checkpoint folder.

    Raises:
        DrafterMismatchError: not a folder, no/unreadable config.json or safetensors, or a config the
            runtime's DFlash2 config class refuses.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise _fail(folder, "the drafter must be a checkpoint folder (config.json + safetensors)")
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(folder, f"cannot read config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise _fail(folder, "config.json must be a JSON object")
    config = None
    module = _drafter_module()
    cls = getattr(module, "DFlash2Config", None) if module is not None else None
    if cls is not None and hasattr(cls, "from_hf"):
        try:
            config = cls.from_hf(raw)
        except Exception as exc:  # the family's ConfigError, TypeError, ValueError
            raise _fail(folder, f"invalid DFlash2 config: {exc}") from exc

    from safetensors import safe_open

    index = folder / _INDEX
    where: dict[str, Path] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise _fail(folder, f"cannot read {_INDEX}: {exc}") from exc
        where = {str(k): folder / str(v) for k, v in weight_map.items()}
    else:
        files = sorted(folder.glob("*.safetensors"))
        if len(files) != 1:
            raise _fail(
                folder, f"expected one .safetensors file or {_INDEX}, found {[f.name for f in files]}"
            )
    handles: dict[Path, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    current: Path | None = None  # the file being read, named in the error
    try:
        if where:
            for p in sorted(set(where.values())):
                current = p
                handles[p] = safe_open(str(p), framework="pt")
        else:
            p = sorted(folder.glob("*.safetensors"))[0]
            current = p
            handles[p] = safe_open(str(p), framework="pt")
            where = {name: p for name in handles[p].keys()}
        for name in sorted(where):
            current = where[name]
            shapes[name] = tuple(int(d) for d in handles[current].get_slice(name).get_shape())
    except Exception as exc:  # SafetensorError, OSError, KeyError
        what = str(current) if current is not None else "the safetensors"
        raise _fail(folder, f"cannot read {what}: {exc}") from exc
    dropped = [n for n in shapes if n in SHARED_WITH_TARGET]
    for n in dropped:
        del shapes[n]
    # public names for accepted aliases (the runtime module's mapping), e.g. codebook ".weight" suffixes
    normalize = getattr(module, "normalize_dflash2_names", None) if module is not None else None
    source_of = {n: n for n in shapes}
    if normalize is not None:
        source_of = {str(k): str(v) for k, v in normalize({n: n for n in shapes}).items()}
        shapes = {k: shapes[v] for k, v in source_of.items()}

    def get(name: str) -> torch.Tensor:
        src = source_of[name]
        return handles[where[src]].get_tensor(src)

    return DrafterCheckpoint(
        source=folder,
        kind="dflash2",
        raw_config=raw,
        config=config,
        shapes=shapes,
        dropped=dropped,
        files=[folder / "config.json", *sorted(handles)] + ([index] if index.is_file() else []),
        _get=get,
    )


def _field(raw: Mapping[str, Any], config: Any, name: str) -> Any:
    """A config field: the runtime config's attribute, else config.json's top level, else its nested
    `dflash_config` table (where the public z-lab DFlash checkpoints keep `target_layer_ids` and
    `mask_token_id`)."""
    if config is not None and hasattr(config, name):
        return getattr(config, name)
    if name in raw:
        return raw[name]
    nested = raw.get("dflash_config")
    return nested.get(name) if isinstance(nested, Mapping) else None


def check_fit(drafter: DrafterCheckpoint, target_config: Any) -> None:
    """Check that the drafter fits the target (module docstring); every misfit is listed.

    Raises:
        DrafterMismatchError: with `problems` listing each misfit.
        MissingTensorsError: the runtime's DFlash2 table lists tensors the checkpoint lacks (or the
            checkpoint holds tensors it does not list).
    """
    raw, cfg = drafter.raw_config, drafter.config
    problems: list[str] = []
    t_hidden = int(target_config.hidden_size)
    t_layers = int(target_config.num_hidden_layers)
    t_vocab = int(target_config.vocab_size)
    hidden = _field(raw, cfg, "hidden_size")
    if hidden is None:
        problems.append("config has no hidden_size")
    elif int(hidden) != t_hidden:
        problems.append(f"hidden_size {hidden} differs from the target's {t_hidden}")
    taps = _field(raw, cfg, "target_layer_ids")
    if taps is None:
        problems.append("config has no target_layer_ids (the target layers the drafter taps)")
    else:
        bad = [int(t) for t in taps if not 0 <= int(t) < t_layers]
        if bad:
            problems.append(
                f"target_layer_ids {bad} lie past the target's last layer (it has {t_layers} layers, "
                f"0..{t_layers - 1})"
            )
    mask = _field(raw, cfg, "mask_token_id")
    if mask is None:
        problems.append("config has no mask_token_id")
    elif not 0 <= int(mask) < t_vocab:
        problems.append(f"mask_token_id {mask} is outside the target's embedding (0..{t_vocab - 1})")
    vocab = _field(raw, cfg, "vocab_size")
    if vocab is not None and int(vocab) != t_vocab:
        problems.append(f"vocab_size {vocab} differs from the target's {t_vocab} (the output head is shared)")
    module = _drafter_module()
    check = getattr(module, "check_dflash2_fits", None) if module is not None else None
    if check is not None and cfg is not None and not problems:
        try:
            check(cfg, target_config)
        except Exception as exc:  # the drafter module's DrafterFitError family
            problems.append(str(exc))
    if problems:
        raise DrafterMismatchError(
            f"the drafter {drafter.source} does not fit the target: " + "; ".join(problems),
            problems=problems,
        )
    table = getattr(module, "dflash2_tensor_shapes", None) if module is not None and cfg is not None else None
    if table is not None:
        expected = {k: tuple(v) for k, v in table(cfg).items() if k not in SHARED_WITH_TARGET}
        missing = sorted(set(expected) - set(drafter.shapes))
        unexpected = sorted(set(drafter.shapes) - set(expected))
        if missing or unexpected:
            raise MissingTensorsError(
                f"{drafter.source}: {len(missing)} missing drafter tensor(s) {missing}; "
                f"{len(unexpected)} unexpected {unexpected}",
                missing=missing,
                unexpected=unexpected,
            )
        wrong = [
            f"{n}: {drafter.shapes[n]} (expected {s})" for n, s in expected.items() if drafter.shapes[n] != s
        ]
        if wrong:
            raise DrafterMismatchError(
                f"{drafter.source}: drafter tensor shapes differ from its config: {wrong}", problems=wrong
            )


__all__ = ["SHARED_WITH_TARGET", "DrafterCheckpoint", "check_fit", "load_drafter"]
