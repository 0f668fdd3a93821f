"""ignis-build's steps, one module each, and the typed API over them.

    from ignis.compiler.build import build_artifact
    result = build_artifact(card="cpu", model="path/to/ckpt", out="artifacts/NAME")

Steps: `plan` (resolve and check, printed first) -> `convert` (weights to the card's dtypes) ->
`graft` (DFlash2 drafter under its prefix) -> `shortlist` (Q4 head of the most frequent tokens) ->
`mtp_companion` (NAME_mtp.ninfer) -> `modules` (TVM linears per verify row width; `llvm_linear`
for the cpu card) -> `manifest`; `pipeline.build_artifact` runs them atomically.
"""

from ignis.compiler.build.errors import (
    BuildError,
    DrafterMismatchError,
    InsufficientDiskError,
    MissingTensorsError,
    ModuleBuildError,
    OutputExistsError,
    OutputNotWritableError,
    RecipeError,
    ShortlistError,
    UnknownCardError,
)
from ignis.compiler.build.pipeline import BuildResult, build_artifact
from ignis.compiler.build.plan import BuildPlan, make_plan
from ignis.compiler.build.recipe import Recipe, load_recipe

__all__ = [
    "BuildError",
    "BuildPlan",
    "BuildResult",
    "DrafterMismatchError",
    "InsufficientDiskError",
    "MissingTensorsError",
    "ModuleBuildError",
    "OutputExistsError",
    "OutputNotWritableError",
    "Recipe",
    "RecipeError",
    "ShortlistError",
    "UnknownCardError",
    "build_artifact",
    "load_recipe",
    "make_plan",
]
