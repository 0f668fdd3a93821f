"""Family registry, the config base class and the executor protocol every family implements.

A *family* is one architecture (HF `model_type`): a frozen config dataclass with HF's field names,
a tensor-name table (HF checkpoint names, which are ignis' canonical names inside `.ninfer` files
too), and a torch executor. Families register themselves in `FAMILIES`; the compiler's importers and
the runtime's loaders both look families up here, so the runtime never imports `ignis.compiler`.

The executor protocol is shaped for the verify round (DESIGN.md, "The verify round"): one call runs
several lanes' columns (a prompt for prefill, anchor + drafts for a verify round), and a separate
`commit` keeps the first n columns of each lane. Attention layers append every column's keys and trim
on commit; recurrent layers (Gated DeltaNet) record the state after every column and keep the one
after the committed prefix, so a rejected column leaves no trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ignis.runtime.errors import ConfigError, TensorSetError, TensorShapeError, UnknownModelTypeError


@dataclass(frozen=True)
class FamilyConfig:
    """Base of the per-family frozen config dataclasses (HF field names, validated on construction).

    Subclasses declare their fields with a one-line comment each and validate in `__post_init__`.
    `from_hf` picks the subclass's fields out of an HF `config.json` dict; unknown keys are ignored,
    missing required ones raise `ConfigError` naming the field.
    """

    model_type: ClassVar[str] = ""

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> FamilyConfig:
        """Build the config from an HF `config.json` dict.

        Raises:
            ConfigError: a required field is missing or a value is invalid.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"{cls.__name__}: config.json lacks required field(s) {missing}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{cls.__name__}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (HF field names plus `model_type`), for artifact metadata."""
        out = dataclasses.asdict(self)
        out["model_type"] = self.model_type
        return out

    def _require(self, ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(f"{type(self).__name__}: {message}")


@dataclass
class ForwardOutput:
    """What one executor call returns, per lane (list index = lane index in the call).

    Attributes:
        logits: per lane, float32 [n_i, vocab_size] (all columns) or [1, vocab_size] (`logits="last"`).
        hidden_states: per lane, [n_i, hidden_size] output of the last decoder layer before the final
            norm (what MTP heads read), in the executor's dtype; None unless requested.
        taps: per lane, [n_i, len(tap_layers) * hidden_size], the outputs of the requested decoder
            layers concatenated in request order (what DFlash2 reads); None unless requested.
    """

    logits: list[torch.Tensor]
    hidden_states: list[torch.Tensor] | None = None
    taps: list[torch.Tensor] | None = None


class LaneState(Protocol):
    """A lane's model state (KV cache, conv and recurrent state). Opaque outside its executor."""

    @property
    def num_tokens(self) -> int:
        """Committed tokens whose effect the state holds."""
        ...


class Executor(Protocol):
    """A family's forward pass over several lanes at once.

    Linear layers: every model-weight matrix product goes through `self.linear`, the executor's
    linear hook, ``linear(x [R, in], weight, bias | None) -> [R, out]`` (x may have more leading
    dims; they are flattened into R). It defaults to `torch.nn.functional.linear`; an artifact passes
    its `ignis.runtime.linear.LinearBackend`, which runs the compiled module for width R (and keeps
    q4 weights as `Q4Weight`s, which only the hook may consume). Executors therefore fuse linear
    weights with `ignis.runtime.linear.cat_rows`, move them with `to_device`, and never slice their
    input dimension; embeddings, norms, convolutions and biases stay plain tensors. On CUDA a q4
    weight may arrive in the tiled layout (`Q4Weight.is_tiled`: row slices on 16-row tiles only);
    an executor that fuses weights fuses their row-major forms (`Q4Weight.to_row_major`) and hands
    the result to `ignis.runtime.linear.place_weight` (which tiles it where the hook's tiled
    functions serve its shape).

    Protocol:
        1. `state = ex.new_lane()` for each lane.
        2. `ex.forward(states, columns)`: columns[i] (int64 [n_i], n_i >= 1) are the next tokens of
           lane i after its committed prefix. Lanes may differ in length and column count.
        3. `ex.commit(states, num_keep)`: keep the first num_keep[i] (1..n_i) columns of lane i;
           afterwards the state equals the state reached by feeding the committed tokens alone.
           Every lane of the forward must be committed; num_keep[i] = 0 discards all its columns
           (a cancelled lane).

    Raises:
        StateError: commit without a pending forward, num_keep outside 0..n_i, a forward with
            `record=False` committed partially, or a lane past `max_position_embeddings`.
    """

    config: FamilyConfig
    linear: Callable[..., torch.Tensor]

    def new_lane(self) -> LaneState: ...

    def forward(
        self,
        states: Sequence[LaneState],
        columns: Sequence[torch.Tensor],
        *,
        logits: str = "all",
        record: bool = True,
        output_hidden_states: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput: ...

    def commit(self, states: Sequence[LaneState], num_keep: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class Family:
    """One registered architecture.

    Attributes:
        model_type: HF `model_type` string.
        config_cls: the frozen config dataclass.
        tensor_shapes: config -> {HF tensor name: shape} of every tensor the executor uses.
        make_executor: ``(config, weights, device, dtype, *, linear=None) -> Executor``. `weights`
            maps name -> tensor (linear weights may be `ignis.runtime.linear.Q4Weight`s when a hook
            is given); `linear` is the hook ``linear(x [R, in], weight, bias | None) -> [R, out]``
            the executor calls for every linear layer (None: `torch.nn.functional.linear`); it lets
            an artifact run its compiled module for width R (`Executor`).
        map_hf_name: HF checkpoint tensor name -> canonical name, or None to drop it (e.g. a vision
            tower of a multimodal checkpoint). Identity by default.
        canonicalize_tensors: optional ``(config, tensors: name -> tensor) -> dict`` rewriting a
            checkpoint's tensor set (after `map_hf_name`) into the layout `tensor_shapes` lists, e.g.
            per-expert MoE tensors into fused stacks. Returns a new dict (input unchanged); tensors
            it does not rewrite pass through as the same objects. It must work on `meta` tensors:
            the HF importer runs it on them to learn the canonical names and shapes before
            `check_tensor_set`. None: the checkpoint's layout is the canonical one.
        fused_linears: the executor's own fusions of the trunk's linear weights: (module path under
            each `model.layers.N`, member projections concatenated in this order along the output
            rows), e.g. ("self_attn", ("q_proj", "k_proj", "v_proj")). The executor fuses the
            members before it places the result in its compiled layout, so a loader must not
            re-lay a member (`is_fused_member`). The build's `FUSED_LINEARS` says the same.
    """

    model_type: str
    config_cls: type[FamilyConfig]
    tensor_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    make_executor: Callable[..., Executor]
    map_hf_name: Callable[[str], str | None] = staticmethod(lambda name: name)  # type: ignore[assignment]  # noqa: RUF009
    canonicalize_tensors: Callable[[Any, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    fused_linears: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def is_fused_member(self, name: str) -> bool:
        """Whether `name` (``model.layers.N.<path>.<member>.weight``) is a member of one of the
        executor's `fused_linears`."""
        parts = name.split(".")
        if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[5] != "weight":
            return False
        if not parts[2].isdigit():
            return False
        return any(parts[3] == path and parts[4] in members for path, members in self.fused_linears)


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family to the registry (module import time). Raises ValueError on a duplicate."""
    if family.model_type in FAMILIES:
        raise ValueError(f"family {family.model_type!r} registered twice")
    FAMILIES[family.model_type] = family
    return family


def get_family(model_type: str) -> Family:
    """Look a family up by HF `model_type`.

    Raises:
        UnknownModelTypeError: naming the type and listing the supported ones.
    """
    import ignis.runtime.families  # noqa: F401  (registers the built-in families)

    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UnknownModelTypeError(
            f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}"
        ) from None


def config_from_hf(raw: Mapping[str, Any]) -> FamilyConfig:
    """Parse an HF `config.json` dict into its family's config (dispatch on `model_type`).

    Raises:
        ConfigError: no `model_type`, or a field is missing/invalid.
        UnknownModelTypeError: the model type is not supported.
    """
    if "model_type" not in raw:
        raise ConfigError("config.json has no 'model_type'")
    return get_family(str(raw["model_type"])).config_cls.from_hf(raw)


def check_tensor_set(
    config: FamilyConfig,
    shapes: Mapping[str, Sequence[int]],
    *,
    source: str,
    ignore_prefixes: Sequence[str] = (),
) -> None:
    """Check a checkpoint's tensor names and shapes against the family's table.

    Args:
        shapes: name -> shape of every tensor present.
        source: file or folder named in the error messages.
        ignore_prefixes: names starting with these are neither required nor unexpected
            (e.g. `mtp.` when the MTP head is handled separately).

    Raises:
        TensorSetError: with *all* missing and unexpected names at once.
        TensorShapeError: the first tensor whose shape differs, with both shapes.
    """
    expected = get_family(config.model_type).tensor_shapes(config)
    present = {k: tuple(v) for k, v in shapes.items() if not k.startswith(tuple(ignore_prefixes))}
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    if missing or unexpected:
        raise TensorSetError(
            f"{source}: {len(missing)} missing tensor(s) {missing}; "
            f"{len(unexpected)} unexpected {unexpected}",
            missing=missing,
            unexpected=unexpected,
        )
    for name, shape in expected.items():
        if tuple(present[name]) != tuple(shape):
            raise TensorShapeError(
                f"{source}: tensor {name!r} has shape {tuple(present[name])}, expected {tuple(shape)}"
            )
