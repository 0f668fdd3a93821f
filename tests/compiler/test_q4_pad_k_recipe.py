"""A recipe's `[modules] q4_pad_k` where it cannot apply: refused on the cpu card before anything is
written (the `ignis-build` command exits 2 naming the recipe), and a plan where it pads nothing says so
in its notes. The plans only are made here (no modules compiled)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ignis.compiler.build.errors import RecipeError
from ignis.compiler.build.plan import make_plan

TESTS = Path(__file__).resolve().parents[1]
NOTHING_PADDED = "modules.q4_pad_k: no q4 linear"


def _tiny_llama(root: Path, **shape: int) -> Path:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(TESTS))
    import hf_tiny

    model = hf_tiny.tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, **shape)
    return Path(hf_tiny.save_tiny(model, root / "ckpt", tokenizer=hf_tiny.tiny_tokenizer()))


def _recipe(root: Path) -> Path:
    path = root / "pad.toml"
    path.write_text('name = "tiny"\n[modules]\nwidths = [8]\nq4_pad_k = true\n')
    return path


def test_q4_pad_k_on_the_cpu_card_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    ckpt = _tiny_llama(tmp_path, hidden_size=128, intermediate_size=160)
    recipe, out = _recipe(tmp_path), tmp_path / "out" / "tiny"
    with pytest.raises(RecipeError, match=r"pad\.toml: modules\.q4_pad_k .* card cpu"):
        make_plan(card="cpu", model=ckpt, recipe=recipe, out=out)
    args = ["--card", "cpu", "--model", str(ckpt), "--recipe", str(recipe), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "ignis.compiler.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "modules.q4_pad_k" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    # the same recipe plans for a CUDA card, its K = 160 linears padded (no note)
    plan = make_plan(card="h200", model=ckpt, recipe=recipe, out=out)
    assert any(plan.modules.pads(s) for s in plan.modules.shapes)
    assert not any(n.startswith(NOTHING_PADDED) for n in plan.notes), plan.notes


def test_a_plan_where_q4_pad_k_pads_nothing_says_so(tmp_path: Path) -> None:
    """Every linear's K a multiple of 128 (128, 256): q4_pad_k has nothing to pad; the plan's notes
    say so (the build prints them), the plan itself is the same as without the option."""
    ckpt = _tiny_llama(tmp_path, hidden_size=128, intermediate_size=256)
    plan = make_plan(card="h200", model=ckpt, recipe=_recipe(tmp_path), out=tmp_path / "out" / "tiny")
    assert not any(plan.modules.pads(s) for s in plan.modules.shapes)
    assert any(n.startswith(NOTHING_PADDED) for n in plan.notes), plan.notes
