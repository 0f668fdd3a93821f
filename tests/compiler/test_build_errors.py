"""Refusals of `ignis-build` found by a new-user pass: each is a typed error with a clear message,
raised before anything is written (and, through the CLI, no traceback).

Covers: recipe names that are not file names, `modules.widths = []` (cpu only), an unknown
`llvm_mcpu`, an `out` that is or contains the checkpoint (also through the Python API with
`overwrite=True`), `overwrite` of a directory that is not an artifact, an unwritable or too long
`out` (also in a dry run), parents left behind by a failed build, non-float tensors and unreadable
drafter safetensors named with their file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from click.testing import CliRunner

from ignis.compiler.build import build_artifact
from ignis.compiler.build.convert import TensorJob, write_jobs
from ignis.compiler.build.errors import (
    DrafterMismatchError,
    ModuleBuildError,
    OutputExistsError,
    OutputNotWritableError,
    RecipeError,
)
from ignis.compiler.build.graft import load_drafter
from ignis.compiler.cli import main as build_cli
from ignis.compiler.errors import CheckpointError
from ignis.formats import NinferWriter


def _helper(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hf_tiny = _helper("hf_tiny")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    return hf_tiny.save_tiny(hf_tiny.tiny_model("llama"), root / "llama", tokenizer=hf_tiny.tiny_tokenizer())


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _build(model: Path, out: Path, **kw: Any) -> Any:
    lines: list[str] = []
    kw.setdefault("card", "cpu")
    result = build_artifact(model=model, out=out, progress=False, echo=lines.append, **kw)
    return result, lines


# ---------------------------------------------------------------------------------------------
# recipe values


@pytest.mark.parametrize(
    ("name_toml", "msg"),
    [
        ('"a\\u0000b"', "control character"),
        ('"a\\nb"', "control character"),
        ('" "', "blank"),
        ('""', "blank"),
        ('"x "', "white space"),
        ('"a\\\\b"', "path separator"),
        ('".hidden"', "starts with '.'"),
        ('"' + "n" * 300 + '"', "300 bytes long"),
    ],
)
def test_recipe_name_must_be_a_file_name(tmp_path: Path, name_toml: str, msg: str) -> None:
    (tmp_path / "r.toml").write_text(f"name = {name_toml}\n")
    with pytest.raises(RecipeError, match=msg):
        build_artifact(
            card="cpu", model=tmp_path / "none", recipe=tmp_path / "r.toml", out=tmp_path / "o", dry_run=True
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.toml"]


def test_recipe_name_at_the_limit_builds_its_files(llama: Path, tmp_path: Path) -> None:
    name = "n" * 226  # the writer's temporary .NAME_mtp.ninfer.<12 hex>.tmp is 255 bytes
    (tmp_path / "r.toml").write_text(f'name = "{name}"\n[modules]\nwidths = []\n')
    result, _ = _build(llama, tmp_path / "o", recipe=tmp_path / "r.toml")
    assert (result.out / f"{name}.ninfer").is_file()


def test_empty_widths_cpu_only(llama: Path, tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('name = "t"\n[modules]\nwidths = []\n')
    with pytest.raises(RecipeError, match=r"only on the cpu card"):
        _build(llama, tmp_path / "g", card="h200", recipe=tmp_path / "r.toml", dry_run=True)
    # on cpu it is a torch-linears artifact: no modules, said in the plan; the runtime loads it
    result, lines = _build(llama, tmp_path / "o", recipe=tmp_path / "r.toml")
    assert "no compiled modules" in "\n".join(lines)
    assert list(result.manifest.modules) == [] and not (result.out / "modules").exists()
    from ignis.runtime.artifact import load_artifact

    art = load_artifact(result.out)
    assert art.linear_backend() is not None


def test_unknown_llvm_mcpu_is_refused(llama: Path, tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('[modules]\nllvm_mcpu = "bogus-cpu"\n')
    with pytest.raises(RecipeError, match=r"'bogus-cpu' is not a CPU.*x86-64-v3"):
        _build(llama, tmp_path / "o", recipe=tmp_path / "r.toml", dry_run=True)
    (tmp_path / "r.toml").write_text('[modules]\nllvm_mcpu = "x86-64-v3"\n')
    _build(llama, tmp_path / "o", recipe=tmp_path / "r.toml", dry_run=True)


# ---------------------------------------------------------------------------------------------
# the output directory


def test_api_refuses_an_out_that_is_or_contains_the_checkpoint(llama: Path, tmp_path: Path) -> None:
    before = _files(llama)
    for out in (llama, llama.parent):
        with pytest.raises(OutputExistsError, match="replace the input"):
            _build(llama, out, overwrite=True)
    assert _files(llama) == before
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "t"\n')
    with pytest.raises(OutputExistsError, match="recipe"):
        _build(llama, tmp_path, recipe=recipe, overwrite=True)
    assert recipe.exists()


def test_overwrite_replaces_only_an_artifact(llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not an ignis artifact"):
        _build(llama, out, overwrite=True, dry_run=True)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("dry_run", [True, False])
def test_unwritable_out_is_refused_before_the_plan(llama: Path, tmp_path: Path, dry_run: bool) -> None:
    lines: list[str] = []
    with pytest.raises(OutputNotWritableError, match="not writable"):
        build_artifact(card="cpu", model=llama, out="/proc/x/y", dry_run=dry_run, echo=lines.append)
    assert lines == []  # refused before the plan was printed
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(OutputNotWritableError, match="not a directory"):
        build_artifact(card="cpu", model=llama, out=a_file / "sub" / "o", dry_run=dry_run, echo=lines.append)
    with pytest.raises(OutputNotWritableError, match="too long"):
        build_artifact(
            card="cpu", model=llama, out=tmp_path / ("n" * 250), dry_run=dry_run, echo=lines.append
        )
    assert lines == [] and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_failed_build_removes_the_parents_it_created(llama: Path, tmp_path: Path) -> None:
    def fail(*_a: Any, **_k: Any) -> Any:
        raise ModuleBuildError("simulated")

    def interrupt(*_a: Any, **_k: Any) -> Any:
        raise KeyboardInterrupt

    (tmp_path / "keep").mkdir()
    for target, bad, exc in (
        ("build_modules", fail, ModuleBuildError),
        ("write_jobs", interrupt, KeyboardInterrupt),
    ):
        for out in (tmp_path / "nodir" / "deeper" / "art", tmp_path / "keep" / "deeper" / "art"):
            with mock.patch(f"ignis.compiler.build.pipeline.{target}", bad), pytest.raises(exc):
                _build(llama, out)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
            assert list((tmp_path / "keep").iterdir()) == []


def test_cli_reports_typed_errors_without_traceback(llama: Path, tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('name = "a\\u0000b"\n')
    runner = CliRunner()
    r = runner.invoke(
        build_cli,
        ["--card", "cpu", "--model", str(llama), "--recipe", str(tmp_path / "r.toml"), "--out", "o"],
    )
    assert r.exit_code == 2 and "control character" in r.output and "Traceback" not in r.output
    r = runner.invoke(build_cli, ["--card", "cpu", "--model", str(llama), "--out", "/proc/x", "--dry-run"])
    assert r.exit_code == 2 and "not writable" in r.output and "disk" not in r.output


# ---------------------------------------------------------------------------------------------
# tensors and drafter files


def test_non_float_tensor_names_tensor_dtype_and_file(tmp_path: Path) -> None:
    job = TensorJob(
        name="model.embed_tokens.weight",
        shape=(4, 2),
        dtype="f32",
        load=lambda: torch.zeros(4, 2, dtype=torch.int8),
        source="token_embd.weight",
        file="/models/m.gguf",
    )
    with NinferWriter(tmp_path / "t.ninfer") as w, pytest.raises(CheckpointError) as info:
        write_jobs(w, [job])
    msg = str(info.value)
    assert "/models/m.gguf" in msg and "token_embd.weight" in msg and "int8" in msg


@pytest.mark.parametrize("dtype", ["bf16", "q4_g32"])
def test_non_finite_tensor_is_refused_with_its_name_and_file(tmp_path: Path, dtype: str) -> None:
    """A NaN or inf in a weight (a corrupt checkpoint: GGUF has no checksums) is refused, naming
    the tensor, the file and the first bad index, whatever the storage dtype."""
    w = torch.randn(4, 64)
    w[2, 5] = float("nan")
    w[3, 0] = float("inf")
    job = TensorJob(
        name="model.layers.0.mlp.up_proj.weight",
        shape=(4, 64),
        dtype=dtype,
        load=lambda: w,
        source="blk.0.ffn_up.weight",
        file="/models/m.gguf",
    )
    with NinferWriter(tmp_path / "t.ninfer") as writer, pytest.raises(CheckpointError) as info:
        write_jobs(writer, [job])
    msg = str(info.value)
    assert "/models/m.gguf" in msg and "blk.0.ffn_up.weight" in msg
    assert "2 non-finite value(s)" in msg and "flat index 133" in msg


def test_unreadable_drafter_safetensors_names_the_file(llama: Path, tmp_path: Path) -> None:
    from ignis.tools.make_test_drafter import make_dflash2_drafter

    folder = tmp_path / "drafter"
    make_dflash2_drafter(llama, folder, num_layers=1, dtype="float32")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) == 1
    shards[0].write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(DrafterMismatchError, match=r"cannot read .*\.safetensors") as info:
        load_drafter(folder)
    assert any(str(shards[0]) in p for p in info.value.problems)
