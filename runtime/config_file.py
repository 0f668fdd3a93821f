"""`ignis-run --config FILE`: server settings in a YAML or TOML file, with per-model sections.

The format (YAML shown; TOML has the same keys, `[spec]`, `[spec.NAME]`, ...)::

    artifact: artifacts/qwen38-27b      # any ignis-run option, by its long name (dashes or underscores;
                                        # --spec-X also as spec: {X: ..}, --cuda-graphs as cuda_graphs: true)
    socket: /run/ignis/ignis.sock
    lanes: 8
    max_prefill_tokens: 2048            # prompt tokens prefilled per step (0: whole prompts at once)
    checkpoint_card_memory: 16GiB       # prompt checkpoints on the card / in host RAM (sizes or bytes)
    checkpoint_host_memory: 32GiB
    checkpoint_dir: /var/lib/ignis/checkpoints   # snapshot directory for a warm restart
    expert_cache_bytes: 24GiB           # MoE: routed-expert cache on the card (auto, off, or a size)
    expert_cache_pin: auto              # MoE: page-lock the host experts (auto, on, off)
    expert_cache_lookahead: false       # MoE: router lookahead prefetch into the expert cache
    spec:                               # speculative settings for every model ...
      backend: dflash2
      draft_tokens: 7
      qwen38flashnext:                  # ... and a section for one model (its served name or alias)
        backend: off
    model:
      max_context: 65536                # --model-max-context for every model
      qwen38flashnext: {max_context: 32768}

Precedence, lowest first: the card profile's defaults, the file's `spec`/`model` keys, the file's
section for the served model, the command line. A section for a model this server does not serve is
checked and ignored. YAML's `off` (which YAML 1.1 reads as false) means backend "off".

Paths in the file (artifact, socket) are used as written: a relative one is relative to the working
directory of ignis-run, not to the file. Unknown keys, wrong types and unreadable files raise
`ConfigFileError` naming the file and the key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignis.runtime.errors import ConfigError

__all__ = [
    "MODEL_KEYS",
    "SERVER_KEYS",
    "SPEC_KEYS",
    "ConfigFile",
    "ConfigFileError",
    "load_config_file",
]

# Server options a file may set: key -> (python type, help). The keys are ignis-run's long option names.
SERVER_KEYS: dict[str, type] = {
    "artifact": str,
    "socket": str,
    "socket_group": str,
    "host": str,
    "port": int,
    "lanes": int,
    "queue_size": int,
    "retry_after": int,
    "shutdown_timeout": float,
    "served_model_name": str,
    "profile": str,
    "device": str,
    "log_level": str,
    "model_max_context": int,
    "cuda_graphs": bool,
    "engine_process": bool,
    "graph_warmup_context": int,
    "max_prefill_tokens": int,
    "checkpoint_card_memory": str,
    "checkpoint_host_memory": str,
    "checkpoint_dir": str,
    "api_key": str,
    "max_request_bytes": int,
    "expert_cache_bytes": str,  # a size ("24GiB"), a byte count, "auto" or "off"
    "expert_cache_pin": str,  # "auto", "on" or "off"
    "expert_cache_lookahead": bool,
    "async_rounds": bool,
}

# ignis-run's --spec-* options at the top level of a file: the same knobs as the `spec` section's.
_TOP_SPEC_KEYS = {f"spec_{k}": k for k in ("backend", "draft_tokens", "draft_rows", "draft_head")}
SPEC_KEYS: dict[str, type] = {"backend": str, "draft_tokens": int, "draft_rows": int, "draft_head": str}
MODEL_KEYS: dict[str, type] = {"max_context": int}


class ConfigFileError(ConfigError):
    """A config file cannot be read, is not YAML/TOML, or holds an unknown key or a mistyped value."""


@dataclass(frozen=True)
class ConfigFile:
    """A parsed, checked config file.

    Attributes:
        path: the file.
        server: top-level server options (keys of SERVER_KEYS, underscores).
        spec: the global `spec` knobs (keys of SPEC_KEYS).
        spec_models: model name -> that model's `spec` knobs.
        model: the global `model` knobs (keys of MODEL_KEYS).
        model_models: model name -> that model's `model` knobs.
    """

    path: Path
    server: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    spec_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    model_models: dict[str, dict[str, Any]] = field(default_factory=dict)

    def spec_for(self, names: Iterable[str]) -> dict[str, Any]:
        """The per-model `spec` section of the first of `names` that has one ({} if none)."""
        return dict(next((self.spec_models[n] for n in names if n in self.spec_models), {}))

    def model_for(self, names: Iterable[str]) -> dict[str, Any]:
        """The per-model `model` section of the first of `names` that has one ({} if none)."""
        return dict(next((self.model_models[n] for n in names if n in self.model_models), {}))

    def max_context_for(self, names: Iterable[str]) -> int | None:
        """The context limit the file sets for a model (its section, else `model.max_context`, else the
        top-level `model_max_context`), or None."""
        own = self.model_for(names).get("max_context")
        if own is not None:
            return int(own)
        if "max_context" in self.model:
            return int(self.model["max_context"])
        value = self.server.get("model_max_context")
        return None if value is None else int(value)


def _check_value(path: Path, where: str, key: str, value: Any, kind: type) -> Any:
    if kind is str and where.startswith("spec") and key == "backend" and value is False:
        return "off"  # YAML 1.1 reads a bare `off` as false
    if key in ("checkpoint_card_memory", "checkpoint_host_memory"):  # a size: "16GiB" or bytes
        from ignis.runtime.server.checkpoints import parse_size

        try:
            return parse_size(value, what=key)
        except ConfigError as exc:
            raise ConfigFileError(f"{path}: {where}{exc}") from None
    if key == "expert_cache_bytes" and value is False:
        return "off"  # YAML 1.1 reads a bare `off` as false
    if key == "expert_cache_pin":  # YAML 1.1 reads bare on/off as booleans
        from ignis.runtime.host_pin import parse_pin_mode

        try:
            return parse_pin_mode(value)
        except ConfigError as exc:
            raise ConfigFileError(f"{path}: {where}{exc}") from None
    if key == "expert_cache_bytes" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # a plain byte count
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigFileError(
            f"{path}: {where}{key} must be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return float(value) if kind is float else value


def _section(
    path: Path, name: str, raw: Any, keys: Mapping[str, type]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    if not isinstance(raw, Mapping):
        raise ConfigFileError(f"{path}: `{name}` must be a mapping, got {type(raw).__name__}")
    knobs: dict[str, Any] = {}
    models: dict[str, dict[str, Any]] = {}
    for key, value in raw.items():
        k = str(key).replace("-", "_")
        if k in keys:
            knobs[k] = _check_value(path, f"{name}.", k, value, keys[k])
        elif isinstance(value, Mapping):
            per: dict[str, Any] = {}
            for sub, v in value.items():
                s = str(sub).replace("-", "_")
                if s not in keys:
                    raise ConfigFileError(
                        f"{path}: unknown key {name}.{key}.{sub}; a model section takes {sorted(keys)}"
                    )
                per[s] = _check_value(path, f"{name}.{key}.", s, v, keys[s])
            models[str(key)] = per
        else:
            raise ConfigFileError(
                f"{path}: unknown key {name}.{key}; `{name}` takes {sorted(keys)} or a mapping per model name"
            )
    return knobs, models


def _parse(path: Path, text: str) -> Any:
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileError(f"{path}: not valid TOML: {exc}") from exc
    if suffix in (".yaml", ".yml", ".json"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigFileError(f"{path}: not valid YAML: {exc}") from exc
    raise ConfigFileError(f"{path}: unknown config file type {suffix!r}; use .yaml, .yml, .toml or .json")


def load_config_file(path: str | Path) -> ConfigFile:
    """Read and check a YAML (.yaml/.yml/.json) or TOML (.toml) config file.

    Raises:
        ConfigFileError: unreadable file, bad syntax, an unknown key, or a value of the wrong type.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"cannot read config file {p}: {exc}") from exc
    raw = _parse(p, text)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigFileError(f"{p}: the top level must be a mapping, got {type(raw).__name__}")
    server: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    spec_models: dict[str, dict[str, Any]] = {}
    model: dict[str, Any] = {}
    model_models: dict[str, dict[str, Any]] = {}
    top_spec: dict[str, Any] = {}
    for key, value in raw.items():
        k = str(key).replace("-", "_")
        if k == "spec":
            spec, spec_models = _section(p, "spec", value, SPEC_KEYS)
        elif k == "model":
            model, model_models = _section(p, "model", value, MODEL_KEYS)
        elif k in SERVER_KEYS:
            server[k] = _check_value(p, "", k, value, SERVER_KEYS[k])
        elif k in _TOP_SPEC_KEYS:
            top_spec[_TOP_SPEC_KEYS[k]] = _check_value(
                p, "spec.", _TOP_SPEC_KEYS[k], value, SPEC_KEYS[_TOP_SPEC_KEYS[k]]
            )
        else:
            raise ConfigFileError(
                f"{p}: unknown key {key!r}; the file takes "
                f"{sorted([*SERVER_KEYS, *_TOP_SPEC_KEYS, 'spec', 'model'])}"
            )
    for where, knobs in [("model.", model), *((f"model.{n}.", m) for n, m in model_models.items())]:
        if "max_context" in knobs and knobs["max_context"] < 2:  # as the executors refuse it
            raise ConfigFileError(f"{p}: {where}max_context must be >= 2, got {knobs['max_context']}")
    if server.get("max_prefill_tokens", 0) < 0:  # as the engine refuses it
        raise ConfigFileError(
            f"{p}: max_prefill_tokens must be >= 0 (0 means no limit), got {server['max_prefill_tokens']}"
        )
    for k, value in top_spec.items():  # --spec-X at the top level: as spec.X, given once
        if k in spec:
            raise ConfigFileError(f"{p}: spec_{k} and spec.{k} both given; keep one")
        spec[k] = value
    return ConfigFile(
        path=p, server=server, spec=spec, spec_models=spec_models, model=model, model_models=model_models
    )
