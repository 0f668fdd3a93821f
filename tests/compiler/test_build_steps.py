"""Unit tests of the build steps: dtype rules, expert layouts, the shortlist, recipes, drafter fit,
linear-shape coverage and the llvm linear kernels (against float64 references)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ignis.compiler.build.convert import (
    is_linear_weight,
    is_quantizable,
    resolve_layout,
    storage_dtype,
    write_tensor,
)
from ignis.compiler.build.errors import DrafterMismatchError, ModuleBuildError, RecipeError, ShortlistError
from ignis.compiler.build.graft import check_fit, load_drafter
from ignis.compiler.build.llvm_linear import LinearSpec, build_llvm_module
from ignis.compiler.build.modules import LinearShape, linear_shapes, plan_modules
from ignis.compiler.build.recipe import load_recipe
from ignis.compiler.build.shortlist import count_corpus, read_counts, select_tokens, write_shortlist
from ignis.compiler.errors import CheckpointError
from ignis.formats import NinferReader, NinferWriter, dequantize_q4_g32, quantize_q4_g32
from ignis.runtime.errors import TensorShapeError
from ignis.runtime.families.llama import LlamaConfig

# ---------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize(
    ("name", "shape", "linear", "quant"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 64), True, True),
        ("model.layers.0.linear_attn.in_proj_qkv.weight", (96, 64), True, True),
        ("model.layers.0.linear_attn.in_proj_b.weight", (4, 64), True, False),
        ("model.layers.0.linear_attn.in_proj_ba.weight", (8, 64), True, False),
        ("model.layers.0.linear_attn.out_proj.weight", (64, 32), True, True),
        ("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 64), True, True),
        ("model.layers.0.mlp.experts.down_proj", (4, 64, 32), True, True),
        ("model.layers.0.mlp.gate.weight", (4, 64), True, False),
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64), True, False),
        ("lm_head.weight", (320, 64), True, True),
        ("mtp.fc.weight", (64, 128), True, True),
        ("dflash2.fc.weight", (64, 128), True, True),
        ("shortlist.head.weight", (320, 64), True, True),
        ("model.embed_tokens.weight", (320, 64), False, False),
        ("model.layers.0.input_layernorm.weight", (64,), False, False),
        ("model.layers.0.self_attn.q_proj.bias", (64,), False, False),
        ("model.layers.0.linear_attn.conv1d.weight", (96, 1, 4), False, False),
    ],
)
def test_linear_and_quantizable(name: str, shape: tuple[int, ...], linear: bool, quant: bool) -> None:
    assert is_linear_weight(name, shape) == linear
    assert is_quantizable(name, shape) == quant


def test_storage_dtype() -> None:
    q = dict(linear_dtype="q4_g32", other_dtype="bf16")
    assert storage_dtype("a.q_proj.weight", (64, 64), **q) == "q4_g32"
    assert storage_dtype("a.q_proj.weight", (64, 48), **q) == "bf16"  # in_features % 32 != 0
    assert storage_dtype("a.norm.weight", (64,), **q) == "bf16"
    assert storage_dtype("a.q_proj.weight", (64, 48), linear_dtype="f32", other_dtype="f32") == "f32"


def test_write_tensor_dtypes(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 64, generator=g)
    with NinferWriter(tmp_path / "t.ninfer") as wr:
        write_tensor(wr, "f32", w, "f32")
        write_tensor(wr, "bf16", w, "bf16")
        write_tensor(wr, "f16", w.to(torch.bfloat16), "f16")
        write_tensor(wr, "q4", w, "q4_g32")
        write_tensor(wr, "q4s", w.reshape(2, 35, 64), "q4_g32")
    with NinferReader(tmp_path / "t.ninfer") as r:
        assert torch.equal(r.torch("f32"), w)
        assert torch.equal(r.torch("bf16"), w.to(torch.bfloat16))
        assert torch.equal(r.torch("f16"), w.to(torch.bfloat16).to(torch.float16))
        packed, scales = quantize_q4_g32(w.numpy())
        q = r.q4_g32("q4")
        np.testing.assert_array_equal(q.packed, packed)
        np.testing.assert_array_equal(q.scales, scales)
        np.testing.assert_array_equal(
            r.q4_g32("q4s").dequantize().reshape(70, 64), dequantize_q4_g32(packed, scales)
        )
    with NinferWriter(tmp_path / "u.ninfer") as wr, pytest.raises(CheckpointError, match="i is int32"):
        write_tensor(wr, "i", torch.zeros(3, dtype=torch.int32), "f32")
    with NinferWriter(tmp_path / "v.ninfer") as wr, pytest.raises(ValueError, match="storage dtype"):
        write_tensor(wr, "x", torch.zeros(3), "f64")


# ---------------------------------------------------------------------------------------------
# expert layouts


def test_resolve_layout_stacks_and_slices() -> None:
    g = torch.Generator().manual_seed(1)
    num_experts, inter, hidden = 3, 8, 32
    per = {}
    for e in range(num_experts):
        for w, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            per[f"L.mlp.experts.{e}.{w}_proj.weight"] = torch.randn(shape, generator=g)
    fused_expected = {
        "L.mlp.experts.gate_up_proj": (num_experts, 2 * inter, hidden),
        "L.mlp.experts.down_proj": (num_experts, hidden, inter),
    }
    shapes = {k: tuple(v.shape) for k, v in per.items()}
    loaders, sources, missing, unused = resolve_layout(fused_expected, shapes, per.__getitem__)
    assert not missing and not unused and "stacked" in sources["L.mlp.experts.gate_up_proj"]
    gu = loaders["L.mlp.experts.gate_up_proj"]()
    assert torch.equal(gu[1, :inter], per["L.mlp.experts.1.gate_proj.weight"])
    assert torch.equal(gu[2, inter:], per["L.mlp.experts.2.up_proj.weight"])
    assert torch.equal(loaders["L.mlp.experts.down_proj"]()[0], per["L.mlp.experts.0.down_proj.weight"])
    # and back: per-expert names from fused tensors
    fused = {
        "L.mlp.experts.gate_up_proj": gu,
        "L.mlp.experts.down_proj": loaders["L.mlp.experts.down_proj"](),
    }
    loaders2, _, missing2, unused2 = resolve_layout(
        shapes, {k: tuple(v.shape) for k, v in fused.items()}, fused.__getitem__
    )
    assert not missing2 and not unused2
    for name, t in per.items():
        assert torch.equal(loaders2[name](), t), name
    # missing and unexpected names are all reported; wrong shapes raise
    _, _, missing3, unused3 = resolve_layout({"a": (1,), "b": (2,)}, {"b": (2,), "c": (3,)}, per.__getitem__)
    assert missing3 == ["a"] and unused3 == ["c"]
    with pytest.raises(TensorShapeError, match=r"b"):
        resolve_layout({"b": (2,)}, {"b": (3,)}, per.__getitem__)


# ---------------------------------------------------------------------------------------------
# shortlist


def test_select_tokens_order() -> None:
    counts = np.array([5, 9, 0, 9, 5, 1], dtype=np.int64)
    assert select_tokens(counts, 4).tolist() == [1, 3, 0, 4]  # count desc, id asc
    assert select_tokens(counts, 100).tolist() == [1, 3, 0, 4, 5, 2]  # whole vocabulary
    assert select_tokens(np.zeros(5, dtype=np.int64), 3).tolist() == [0, 1, 2]
    assert select_tokens(counts, 4).dtype == np.int32


def test_read_counts_formats_and_errors(tmp_path: Path) -> None:
    (tmp_path / "c.tsv").write_text("# id count\n3\t7\n0 2\n\n")
    assert read_counts(tmp_path / "c.tsv", 5).tolist() == [2, 0, 0, 7, 0]
    (tmp_path / "c.json").write_text(json.dumps({"1": 4, "4": 1}))
    assert read_counts(tmp_path / "c.json", 5).tolist() == [0, 4, 0, 0, 1]
    (tmp_path / "l.json").write_text(json.dumps([1, 2, 3]))
    assert read_counts(tmp_path / "l.json", 4).tolist() == [1, 2, 3, 0]
    for text, msg in (
        ("9 1", "outside"),
        ("1 1\n1 2", "twice"),
        ("1 -1", "non-negative"),
        ("x 1", "integer"),
        ("1 2 3", "expected"),
    ):
        (tmp_path / "bad.txt").write_text(text)
        with pytest.raises(ShortlistError, match=msg):
            read_counts(tmp_path / "bad.txt", 5)
    (tmp_path / "bad.json").write_text("[1, 2, 3, 4, 5, 6]")
    with pytest.raises(ShortlistError, match="counts for a vocabulary"):
        read_counts(tmp_path / "bad.json", 5)


def test_count_corpus(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc\nab\n")
    (tmp_path / "b.txt").write_text("c")

    def encode(batch: list[str]) -> list[list[int]]:
        return [[ord(ch) - ord("a") for ch in text if ch != "\n"] for text in batch]

    assert count_corpus([tmp_path / "a.txt", tmp_path / "b.txt"], encode, 4).tolist() == [2, 2, 2, 0]
    with pytest.raises(ShortlistError, match="outside"):
        count_corpus([tmp_path / "a.txt"], encode, 2)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ShortlistError, match="UTF-8"):
        count_corpus([tmp_path / "bin.txt"], encode, 4)


def test_write_shortlist(tmp_path: Path) -> None:
    head = torch.randn(10, 64, generator=torch.Generator().manual_seed(2))
    ids = np.array([7, 2, 9], dtype=np.int32)
    with NinferWriter(tmp_path / "s.ninfer") as w:
        write_shortlist(w, head, ids)
    with NinferReader(tmp_path / "s.ninfer") as r:
        assert r.numpy("shortlist.token_ids").tolist() == [7, 2, 9]
        packed, scales = quantize_q4_g32(head[[7, 2, 9]].numpy())
        q = r.q4_g32("shortlist.head.weight")
        np.testing.assert_array_equal(q.packed, packed)
        np.testing.assert_array_equal(q.scales, scales)
    with NinferWriter(tmp_path / "x.ninfer") as w, pytest.raises(ShortlistError, match="multiple of 32"):
        write_shortlist(w, torch.zeros(4, 48), np.array([0], dtype=np.int32))


# ---------------------------------------------------------------------------------------------
# recipes


def test_recipe_defaults_and_parsing(tmp_path: Path) -> None:
    r = load_recipe(None)
    assert r.shortlist_size == 131072 and r.widths is None and r.drafter_prefix == "dflash2."
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "b.txt").write_text("b")
    (tmp_path / "corpus" / "a.txt").write_text("a")
    (tmp_path / "r.toml").write_text(
        'name = "x"\n[shortlist]\nsize = 10\ncorpus = ["corpus/*.txt"]\n[modules]\nwidths = [8, 1, 8]\n'
        'llvm_mcpu = "x86-64-v3"\n[drafter]\nprefix = "d."\n'
    )
    r = load_recipe(tmp_path / "r.toml")
    assert r.name == "x" and r.shortlist_size == 10 and [p.name for p in r.corpus] == ["a.txt", "b.txt"]
    assert (
        r.widths == (1, 8) and r.llvm_mcpu == "x86-64-v3" and r.drafter_prefix == "d." and len(r.sha256) == 64
    )


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("nme = 1", "unknown key"),
        ("[shortlist]\nsize = 0", "positive"),
        ("[shortlist]\ncorpus = ['none/*.txt']", "matches no file"),
        ("[shortlist]\ncounts = 'missing.tsv'", "does not exist"),
        ("[modules]\nwidths = [0]", "positive"),
        ("[modules]\nwidth = [1]", "unknown key"),
        ("[drafter]\nprefix = 'd'", "ending in"),
        ("name = 'a/b'", "plain file name"),
        ('name = "a\\u0000b"', "control character"),
        ("name = ' '", "blank"),
        ("name = ' a'", "white space"),
        (f"name = '{'n' * 300}'", "300 bytes long"),
        ("[modules]\nllvm_mcpu = ''", "LLVM CPU name"),
        ("[[", "cannot read"),
    ],
)
def test_recipe_errors(tmp_path: Path, text: str, msg: str) -> None:
    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(RecipeError, match=msg):
        load_recipe(tmp_path / "r.toml")


# ---------------------------------------------------------------------------------------------
# drafter fit


def _drafter(folder: Path, target_dir: Path, **changes: object) -> Path:
    """A random DFlash2 drafter for the target (tools/make_test_drafter.py), config fields changed."""
    from ignis.tools.make_test_drafter import make_dflash2_drafter

    make_dflash2_drafter(target_dir, folder, num_layers=1, dtype="float32")
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key in cfg.get("dflash_config", {}):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_drafter_fit(tmp_path: Path) -> None:
    target = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({**target.to_dict(), "model_type": "llama"}))
    folder = _drafter(tmp_path / "ok", tmp_path / "target")
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(100, 64)  # a shared tensor: not grafted
    save_file(tensors, str(folder / "model.safetensors"))
    d = load_drafter(folder)
    assert d.dropped == ["embed_tokens.weight"] and "fc.weight" in d.shapes and d.config is not None
    check_fit(d, target)
    bad = load_drafter(
        _drafter(
            tmp_path / "bad",
            tmp_path / "target",
            hidden_size=32,
            vocab_size=120,
            target_layer_ids=[1, 2, 7],
            mask_token_id=110,
            num_target_layers=0,
        )
    )
    with pytest.raises(DrafterMismatchError) as info:
        check_fit(bad, target)
    text = "\n".join(info.value.problems)
    assert len(info.value.problems) == 4
    assert (
        "hidden_size 32" in text
        and "[2, 7]" in text
        and "mask_token_id 110" in text
        and "vocab_size 120" in text
    )
    with pytest.raises(DrafterMismatchError, match=r"config\.json"):
        load_drafter(tmp_path / "nowhere")
    # a tensor missing from the drafter: every missing name listed
    del tensors["fc.weight"], tensors["norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    from ignis.compiler.build.errors import MissingTensorsError

    with pytest.raises(MissingTensorsError) as minfo:
        check_fit(load_drafter(folder), target)
    assert minfo.value.missing == ["fc.weight", "norm.weight"]


# ---------------------------------------------------------------------------------------------
# linear shapes and the llvm kernels


def test_linear_shapes_llama_fusions_and_tied_head() -> None:
    t = {}
    for i in range(2):
        p = f"model.layers.{i}"
        t |= {
            f"{p}.self_attn.q_proj.weight": ("f32", (64, 64)),
            f"{p}.self_attn.k_proj.weight": ("f32", (32, 64)),
            f"{p}.self_attn.v_proj.weight": ("f32", (32, 64)),
            f"{p}.self_attn.o_proj.weight": ("f32", (64, 64)),
            f"{p}.mlp.gate_proj.weight": ("f32", (96, 64)),
            f"{p}.mlp.up_proj.weight": ("f32", (96, 64)),
            f"{p}.mlp.down_proj.weight": ("f32", (64, 96)),
            f"{p}.input_layernorm.weight": ("f32", (64,)),
        }
    t["model.embed_tokens.weight"] = ("f32", (300, 64))
    t["shortlist.head.weight"] = ("q4_g32", (300, 64))
    shapes = linear_shapes(t, family="llama", tie_word_embeddings=True)
    assert shapes == sorted(
        [
            LinearShape("dense", 128, 64),
            LinearShape("dense", 64, 64),
            LinearShape("dense", 192, 64),
            LinearShape("dense", 64, 96),
            LinearShape("dense", 300, 64),
            LinearShape("q4_g32", 300, 64),
        ]
    )
    # a hybrid: no fusions, expert stacks per expert
    h = {
        "model.layers.0.mlp.experts.gate_up_proj": ("q4_g32", (4, 64, 64)),
        "model.layers.0.mlp.experts.down_proj": ("q4_g32", (4, 64, 32)),
        "model.layers.0.mlp.gate.weight": ("bf16", (4, 64)),
    }
    assert linear_shapes(h, family="qwen3_5_moe") == [
        LinearShape("dense", 4, 64),
        LinearShape("q4_g32", 32, 64),
        LinearShape("q4_g32", 64, 32),
    ]
    plan = plan_modules(
        card="h200",
        arch="sm_90",
        widths=[1, 8, 16, 32],
        other_dtype="bf16",
        shapes=[LinearShape("dense", 4, 64), LinearShape("q4_g32", 32, 128), LinearShape("q4_g32", 64, 32)],
    )
    assert [s.kind for s in plan.shapes] == ["q4_g32", "q4_g32"] and plan.dtype == "bfloat16"
    # K % 128 == 0: the default CUDA route (tiled); the other K on the TensorIR route
    assert plan.q4_cuda_route == "tiled"
    assert plan.route(plan.shapes[0]) == "cuda-tiled" and plan.route(plan.shapes[1]) == "tir-dlight"
    assert plan.kernels == ()  # no drafter, not a hybrid: no kernel library
    assert plan.num_functions() == 3 + 4  # tiled: tiles {1, 2, 4}; tir: one per width
    mma = plan_modules(
        card="h200",
        arch="sm_90",
        widths=[1, 8, 16, 32],
        other_dtype="bf16",
        shapes=plan.shapes,
        q4_cuda_route="mma",
    )
    assert mma.route(mma.shapes[0]) == "cuda-mma" and mma.route(mma.shapes[1]) == "tir-dlight"
    assert mma.num_functions() == 3 + 4
    with pytest.raises(ModuleBuildError, match="q4_cuda_route"):
        plan_modules(card="h200", arch="sm_90", widths=[8], other_dtype="bf16", shapes=[], q4_cuda_route="x")
    # the mma kernels stop at 32 rows: a plan that routes a shape to them refuses wider widths, one
    # with no such shape does not
    with pytest.raises(ModuleBuildError, match="at most 32 rows"):
        plan_modules(
            card="h200",
            arch="sm_90",
            widths=[1, 64],
            other_dtype="bf16",
            shapes=plan.shapes,
            q4_cuda_route="mma",
        )
    plan_modules(
        card="h200", arch="sm_90", widths=[1, 64], other_dtype="bf16", shapes=[], q4_cuda_route="mma"
    )
    with_drafter = plan_modules(
        card="h200", arch="sm_90", widths=[1, 8, 16, 32], other_dtype="bf16", shapes=plan.shapes, dflash2=True
    )
    assert with_drafter.kernels == ("topk",) and with_drafter.num_functions() == 3 + 4 + 1
    hybrid = plan_modules(
        card="h200",
        arch="sm_90",
        widths=[1, 8],
        other_dtype="bf16",
        shapes=[],
        config=_hybrid_config(),
        dflash2=True,
    )
    # the top-k, the GDN recurrence (its round, the stash round and the replay), the fused norms
    # (add_rms_norm + gated_rms_norm + silu_mul + narrow_linear + add_rms_norm_llama) and the fused
    # mixers (gdn_conv_silu + qk_norm_rope_kv + gated_attention + rope_kv + grouped_attention)
    assert hybrid.kernels == ("topk", "gdn_recurrent", "fused_norms", "fused_mixers")
    assert hybrid.num_functions() == 14
    cpu = plan_modules(
        card="cpu",
        arch="llvm",
        widths=[1],
        other_dtype="f32",
        shapes=[LinearShape("dense", 4, 64)],
        config=_hybrid_config(),
        dflash2=True,
    )
    assert cpu.kernels == () and cpu.num_functions() == 1


def _hybrid_config(**changes: object) -> object:
    import dataclasses

    from ignis.runtime.families.qwen3_5 import Qwen3_5Config

    config = Qwen3_5Config.from_hf(
        dict(
            vocab_size=320,
            hidden_size=64,
            num_hidden_layers=4,
            full_attention_interval=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            intermediate_size=96,
            max_position_embeddings=512,
        )
    )
    return dataclasses.replace(config, **changes)


def test_select_kernels_by_drafter_family_and_gdn_shape() -> None:
    from ignis.compiler.build.modules import KERNELS, gdn_kernel_fits, select_kernels
    from ignis.compiler.kernels.gdn_recurrent import MAX_KEY_DIM
    from ignis.formats.manifest import KERNEL_ABIS, KERNEL_TARGETS

    assert select_kernels() == ()
    assert select_kernels(dflash2=True) == ("topk",)
    llama = LlamaConfig.from_hf(
        dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    )
    # add_rms_norm_llama and silu_mul; rope_kv (head_dim 16)
    assert select_kernels(config=llama, dflash2=True) == ("topk", "fused_norms", "fused_mixers")
    assert select_kernels(config=_hybrid_config()) == ("gdn_recurrent", "fused_norms", "fused_mixers")
    # the kernel's limits: k_dim <= MAX_KEY_DIM, value heads a multiple of key heads
    assert gdn_kernel_fits(_hybrid_config(linear_key_head_dim=MAX_KEY_DIM))
    too_wide = _hybrid_config(linear_key_head_dim=MAX_KEY_DIM + 1)
    assert not gdn_kernel_fits(too_wide)
    assert select_kernels(config=too_wide) == ("fused_norms", "fused_mixers")
    # (a family config refuses uneven heads itself; the rule still holds for any config-like object)
    from types import SimpleNamespace

    uneven = SimpleNamespace(
        layer_types=("linear_attention",),
        linear_key_head_dim=16,
        linear_num_key_heads=3,
        linear_num_value_heads=4,
    )
    assert not gdn_kernel_fits(uneven)
    assert gdn_kernel_fits(SimpleNamespace(**{**vars(uneven), "linear_num_value_heads": 6}))
    no_gdn = _hybrid_config(layer_types=("full_attention",) * 4)
    assert not gdn_kernel_fits(no_gdn) and not gdn_kernel_fits(llama)
    # every export of every library is a manifest kind (CUDA), and exports are unique
    kinds = [kind for lib in KERNELS.values() for kind, _name in lib.exports]
    assert len(kinds) == len(set(kinds)) and all(
        KERNEL_TARGETS[k] == "cuda" and k in KERNEL_ABIS for k in kinds
    )


def test_build_modules_records_the_topk_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's wiring in build_modules (the real nvcc build: tests/compiler/test_build_cuda.py):
    built beside the linears, stripped, checked for the arch, listed as a file and as a kernel
    entry; a failure is a ModuleBuildError naming the library."""
    import ignis.compiler.build.modules as modules
    from ignis.compiler.build.errors import ModuleBuildError
    from ignis.formats.manifest import KernelEntry

    built: list[tuple[str, str, Path]] = []
    checked: list[tuple[str, str]] = []

    def fake_build(kind: str, arch: str, dest: Path) -> None:
        built.append((kind, arch, dest))
        dest.write_bytes(b"\x7fELF")

    monkeypatch.setattr(modules, "_build_kernel", fake_build)
    monkeypatch.setattr(modules, "strip_local_symbols", lambda path: checked.append(("strip", path.name)))
    monkeypatch.setattr(modules, "check_cuda_binary", lambda path, arch: checked.append((arch, path.name)))
    plan = plan_modules(
        card="rtx5090", arch="sm_120", widths=[1, 8], other_dtype="bf16", shapes=[], dflash2=True
    )
    seen: list[str] = []
    entries, kernels, files = modules.build_modules(plan, tmp_path, on_file=seen.append)
    assert entries == [] and files == seen == ["modules/rtx5090/topk.so"]
    assert built == [("topk", "sm_120", tmp_path / "modules/rtx5090/topk.so")]
    assert checked == [("strip", "topk.so"), ("sm_120", "topk.so")]
    assert kernels == [
        KernelEntry(
            "topk",
            "topk",
            1,
            "modules/rtx5090/topk.so",
            {"kind": "cuda", "arch": "sm_120"},
            ("bfloat16", "float16", "float32"),
        )
    ]
    # a CPU card builds no kernel
    cpu = plan_modules(card="cpu", arch="llvm", widths=[1], other_dtype="f32", shapes=[])
    assert modules.build_modules(cpu, tmp_path / "cpu") == ([], [], [])

    def failing(kind: str, arch: str, dest: Path) -> None:
        raise RuntimeError("nvcc exploded")

    monkeypatch.setattr(modules, "_build_kernel", failing)
    with pytest.raises(
        ModuleBuildError, match=r"modules/rtx5090/topk\.so \(topk\) for sm_120 failed: nvcc exploded"
    ):
        modules.build_modules(plan, tmp_path / "b")


def test_build_modules_records_the_hybrid_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model on a CUDA card: the GDN recurrence, the fused norms and the fused mixers built
    beside the linears (after the top-k), one manifest entry per exported function, the norms' two
    in one library and the mixers' two in another."""
    import ignis.compiler.build.modules as modules
    from ignis.formats.manifest import KernelEntry

    built: list[str] = []

    def fake_build(kind: str, arch: str, dest: Path) -> None:
        built.append(kind)
        dest.write_bytes(b"\x7fELF")

    monkeypatch.setattr(modules, "_build_kernel", fake_build)
    monkeypatch.setattr(modules, "strip_local_symbols", lambda path: True)
    monkeypatch.setattr(modules, "check_cuda_binary", lambda path, arch: None)
    plan = plan_modules(
        card="h200", arch="sm_90", widths=[1, 8], other_dtype="bf16", shapes=[], config=_hybrid_config()
    )
    entries, kernels, files = modules.build_modules(plan, tmp_path)
    assert entries == [] and sorted(built) == ["fused_mixers", "fused_norms", "gdn_recurrent"]
    assert files == [
        "modules/h200/gdn_recurrent.so",
        "modules/h200/fused_norms.so",
        "modules/h200/fused_mixers.so",
    ]
    target = {"kind": "cuda", "arch": "sm_90"}
    dtypes = ("bfloat16", "float16", "float32")
    assert kernels == [
        KernelEntry("gdn_recurrent", "gdn_recurrent", 1, "modules/h200/gdn_recurrent.so", target, dtypes),
        KernelEntry(
            "gdn_recurrent_stash", "gdn_recurrent_stash", 1, "modules/h200/gdn_recurrent.so", target, dtypes
        ),
        KernelEntry("gdn_replay", "gdn_replay", 1, "modules/h200/gdn_recurrent.so", target, ("float32",)),
        KernelEntry("add_rms_norm", "add_rms_norm", 1, "modules/h200/fused_norms.so", target, dtypes),
        KernelEntry("gated_rms_norm", "gated_rms_norm", 1, "modules/h200/fused_norms.so", target, dtypes),
        KernelEntry("silu_mul", "silu_mul", 1, "modules/h200/fused_norms.so", target, dtypes),
        KernelEntry("narrow_linear", "narrow_linear", 1, "modules/h200/fused_norms.so", target, dtypes),
        KernelEntry(
            "add_rms_norm_llama", "add_rms_norm_llama", 1, "modules/h200/fused_norms.so", target, dtypes
        ),
        KernelEntry("gdn_conv_silu", "gdn_conv_silu", 1, "modules/h200/fused_mixers.so", target, dtypes),
        KernelEntry("qk_norm_rope_kv", "qk_norm_rope_kv", 1, "modules/h200/fused_mixers.so", target, dtypes),
        KernelEntry(
            "gated_attention",
            "gated_attention",
            1,
            "modules/h200/fused_mixers.so",
            target,
            ("bfloat16", "float16"),
        ),
        KernelEntry("rope_kv", "rope_kv", 1, "modules/h200/fused_mixers.so", target, dtypes),
        KernelEntry(
            "grouped_attention",
            "grouped_attention",
            1,
            "modules/h200/fused_mixers.so",
            target,
            ("bfloat16", "float16"),
        ),
    ]


@pytest.mark.parametrize(
    ("kind", "module", "builder", "symbols"),
    [
        ("topk", "topk", "build_topk", ("topk",)),
        (
            "gdn_recurrent",
            "gdn_recurrent",
            "build_gdn_recurrent",
            ("gdn_recurrent", "gdn_recurrent_stash", "gdn_replay"),
        ),
        (
            "fused_norms",
            "fused_norms",
            "build_fused_norms",
            ("add_rms_norm", "gated_rms_norm", "silu_mul", "narrow_linear", "add_rms_norm_llama"),
        ),
        (
            "fused_mixers",
            "fused_mixers",
            "build_fused_mixers",
            ("gdn_conv_silu", "qk_norm_rope_kv", "gated_attention", "rope_kv", "grouped_attention"),
        ),
    ],
)
def test_each_kernel_library_calls_its_builder(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    module: str,
    builder: str,
    symbols: tuple[str, ...],
) -> None:
    """`_build_kernel` reaches the kernel engineer's builder with the arch and the destination, and the
    table's symbols are those the kernel module exports."""
    import importlib

    import ignis.compiler.build.modules as modules
    from ignis.compiler.build.errors import ModuleBuildError

    mod = importlib.import_module(f"ignis.compiler.kernels.{module}")
    exported = getattr(mod, "FUNCTION_NAMES", None) or (mod.FUNCTION_NAME,)
    assert tuple(name for _kind, name in modules.KERNELS[kind].exports) == tuple(exported) == symbols
    calls: list[tuple[object, object]] = []
    monkeypatch.setattr(mod, builder, lambda target, *, out_path: calls.append((target, out_path)))
    modules._build_kernel(kind, "sm_120", tmp_path / "k.so")
    assert calls == [({"kind": "cuda", "arch": "sm_120"}, tmp_path / "k.so")]
    with pytest.raises(ModuleBuildError, match="no builder for the 'nope' kernel"):
        modules._build_kernel("nope", "sm_120", tmp_path / "k.so")


def test_llvm_linears_match_float64(tmp_path: Path) -> None:
    import tvm_ffi

    g = torch.Generator().manual_seed(3)
    specs = []
    for rows in (1, 3, 8):
        for n, k in ((40, 64), (1, 32), (7, 33)):
            specs.append(LinearSpec(f"d_r{rows}_n{n}_k{k}", "dense", rows, n, k))
            if k % 32 == 0:
                specs.append(LinearSpec(f"q_r{rows}_n{n}_k{k}", "q4_g32", rows, n, k))
    path = build_llvm_module(specs, tmp_path / "lin.so")
    mod = tvm_ffi.load_module(str(path))
    for s in specs:
        x = torch.randn(s.rows, s.in_features, generator=g)
        w = torch.randn(s.out_features, s.in_features, generator=g)
        y = torch.empty(s.rows, s.out_features)
        if s.kind == "dense":
            mod[s.name](x, w, y)
            ref = x.double() @ w.double().T
        else:
            packed, scales = quantize_q4_g32(w.numpy())
            mod[s.name](x, torch.from_numpy(packed), torch.from_numpy(scales), y)
            ref = x.double() @ torch.from_numpy(dequantize_q4_g32(packed, scales)).double().T
        err = float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        assert err < 1e-5, (s, err)


def test_llvm_tile_schedule_for_wide_q4_rounds_on_a_named_cpu(tmp_path: Path) -> None:
    """q4_g32 functions of 5+ rows built for a named CPU get the dequantized-tile schedule (float32,
    out_features % 16, in_features % 64); built for this host's CPU they match float64 at 5, 8 and 16
    rows, next to the per-element schedule's 1-4-row functions of the same library."""
    import tvm_ffi

    from ignis.compiler.build.llvm_linear import llvm_target, uses_tile_schedule
    from ignis.tools.quickstart import host_llvm_cpu

    named = llvm_target("x86-64-v3")
    assert uses_tile_schedule(LinearSpec("a", "q4_g32", 5, 32, 128), named)
    assert not uses_tile_schedule(LinearSpec("a", "q4_g32", 4, 32, 128), named)  # 1-4 rows
    assert not uses_tile_schedule(LinearSpec("a", "q4_g32", 8, 32, 128), llvm_target(None))  # generic
    assert not uses_tile_schedule(LinearSpec("a", "q4_g32", 8, 40, 128), named)  # 40 % 16
    assert not uses_tile_schedule(LinearSpec("a", "q4_g32", 8, 32, 96), named)  # 96 % 64
    assert not uses_tile_schedule(LinearSpec("a", "dense", 8, 32, 128), named)
    assert not uses_tile_schedule(LinearSpec("a", "q4_g32", 8, 32, 128, "bfloat16"), named)
    host = host_llvm_cpu()
    if host is None:
        pytest.skip("TVM's LLVM does not name this host's CPU")
    g = torch.Generator().manual_seed(4)
    specs = [LinearSpec(f"q_r{rows}", "q4_g32", rows, 48, 192) for rows in (1, 3, 5, 8, 16)]
    target = llvm_target(host)
    assert [uses_tile_schedule(s, target) for s in specs] == [False, False, True, True, True]
    mod = tvm_ffi.load_module(str(build_llvm_module(specs, tmp_path / "tile.so", target=target)))
    for s in specs:
        x = torch.randn(s.rows, s.in_features, generator=g)
        packed, scales = quantize_q4_g32(torch.randn(s.out_features, s.in_features, generator=g).numpy())
        y = torch.empty(s.rows, s.out_features)
        mod[s.name](x, torch.from_numpy(packed), torch.from_numpy(scales), y)
        ref = x.double() @ torch.from_numpy(dequantize_q4_g32(packed, scales)).double().T
        err = float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        assert err < 1e-5, (s, err)


def test_llvm_tree_schedule_for_one_and_two_row_q4(tmp_path: Path) -> None:
    """float32 q4_g32 functions of 1-2 rows sum their 16 lane partials as a tree (`_tree_schedule`),
    on the generic target and on a named CPU; they match float64 and the per-element schedule's
    results to float32 rounding, and re-runs give the same bits."""
    import tvm_ffi

    import ignis.compiler.build.llvm_linear as llvm_linear
    from ignis.compiler.build.llvm_linear import llvm_target, uses_tree_schedule

    generic, named = llvm_target(None), llvm_target("x86-64-v3")
    for target in (generic, named):
        assert uses_tree_schedule(LinearSpec("a", "q4_g32", 1, 40, 64), target)
        assert uses_tree_schedule(LinearSpec("a", "q4_g32", 2, 40, 64), target)
        assert not uses_tree_schedule(LinearSpec("a", "q4_g32", 3, 40, 64), target)  # 8 lanes from 3 rows
        assert not uses_tree_schedule(LinearSpec("a", "dense", 1, 40, 64), target)
        assert not uses_tree_schedule(LinearSpec("a", "q4_g32", 1, 40, 64, "bfloat16"), target)
    g = torch.Generator().manual_seed(6)
    specs = [LinearSpec(f"q_r{rows}_n{n}", "q4_g32", rows, n, 96) for rows in (1, 2) for n in (40, 7)]
    path = build_llvm_module(specs, tmp_path / "tree.so")
    mod = tvm_ffi.load_module(str(path))
    old = llvm_linear.uses_tree_schedule
    try:  # the same specs through the per-element schedule
        llvm_linear.uses_tree_schedule = lambda spec, target=None: False  # type: ignore[assignment]
        ref_mod = tvm_ffi.load_module(str(build_llvm_module(specs, tmp_path / "flat.so")))
    finally:
        llvm_linear.uses_tree_schedule = old  # type: ignore[assignment]
    for s in specs:
        x = torch.randn(s.rows, s.in_features, generator=g)
        packed, scales = quantize_q4_g32(torch.randn(s.out_features, s.in_features, generator=g).numpy())
        args = (x, torch.from_numpy(packed), torch.from_numpy(scales))
        y, y2, flat = (torch.empty(s.rows, s.out_features) for _ in range(3))
        mod[s.name](*args, y)
        mod[s.name](*args, y2)
        ref_mod[s.name](*args, flat)
        ref = x.double() @ torch.from_numpy(dequantize_q4_g32(packed, scales)).double().T
        err = float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        assert err < 1e-5 and torch.equal(y, y2), (s, err)
        torch.testing.assert_close(y, flat, rtol=1e-5, atol=1e-5)


def test_select_kernels_fused_mixers_only_where_their_limits_hold() -> None:
    """The fused mixers' rule: a hybrid config whose GDN conv taps are 2..MAX_CONV_KERNEL and whose
    attention heads are at most MAX_HEAD_DIM wide with an even rotary dim (fused_mixers.py's limits,
    the ones its exports check)."""
    from types import SimpleNamespace

    from ignis.compiler.build.modules import mixers_kernel_fits, select_kernels
    from ignis.compiler.kernels.fused_mixers import MAX_CONV_KERNEL, MAX_HEAD_DIM

    assert mixers_kernel_fits(_hybrid_config())
    assert mixers_kernel_fits(_hybrid_config(linear_conv_kernel_dim=MAX_CONV_KERNEL))
    assert mixers_kernel_fits(_hybrid_config(linear_conv_kernel_dim=2))
    for too_many in (MAX_CONV_KERNEL + 1,):
        cfg = _hybrid_config(linear_conv_kernel_dim=too_many)
        assert not mixers_kernel_fits(cfg)
        assert select_kernels(config=cfg) == ("gdn_recurrent", "fused_norms")
    assert not mixers_kernel_fits(_hybrid_config(linear_conv_kernel_dim=1))
    wide = _hybrid_config(head_dim=MAX_HEAD_DIM * 2)
    assert not mixers_kernel_fits(wide) and "fused_mixers" not in select_kernels(config=wide)
    assert mixers_kernel_fits(_hybrid_config(head_dim=MAX_HEAD_DIM))
    # the conv limit only matters with GDN layers, the head limits only with attention layers
    no_gdn = _hybrid_config(layer_types=("full_attention",) * 4, linear_conv_kernel_dim=MAX_CONV_KERNEL + 1)
    assert mixers_kernel_fits(no_gdn)
    no_attention = _hybrid_config(layer_types=("linear_attention",) * 4, head_dim=MAX_HEAD_DIM * 2)
    assert mixers_kernel_fits(no_attention)
    # an odd rotary dim (a config-like object: the family config refuses it itself)
    odd = SimpleNamespace(
        layer_types=("full_attention",),
        linear_conv_kernel_dim=4,
        head_dim=30,
        rotary_dim=15,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    assert not mixers_kernel_fits(odd)
    assert mixers_kernel_fits(SimpleNamespace(**{**vars(odd), "rotary_dim": 16}))
    assert not mixers_kernel_fits(SimpleNamespace(**{**vars(odd), "num_attention_heads": 65535}))
    assert not mixers_kernel_fits(SimpleNamespace(**{**vars(odd), "layer_types": ()}))
    assert not mixers_kernel_fits(object())


def test_q4_pad_k_puts_every_q4_linear_on_the_tiled_route(tmp_path: Path) -> None:
    """`q4_pad_k` (a recipe's [modules] q4_pad_k): the q4 shapes with K % 128 != 0 (K % 32 == 0) take
    the tiled route with functions over K padded to the next multiple of 128 (named and recorded so:
    `padded_in_features`), and need no TVM; off (the default) they stay on the TensorIR route."""
    from ignis.compiler.build.modules import _functions, tiled_function_name

    shapes = [
        LinearShape("q4_g32", 1728, 576),
        LinearShape("q4_g32", 576, 1536),
        LinearShape("q4_g32", 8, 100),
    ]
    off = plan_modules(card="h200", arch="sm_90", widths=[1, 8], other_dtype="bf16", shapes=shapes)
    assert [off.route(s) for s in shapes] == ["tir-dlight", "cuda-tiled", "tir-dlight"]
    on = plan_modules(
        card="h200", arch="sm_90", widths=[1, 8], other_dtype="bf16", shapes=shapes, q4_pad_k=True
    )
    # K = 100 is not whole q4 groups of 32 (no q4_g32 weight has it): never padded
    assert [on.route(s) for s in shapes] == ["cuda-tiled", "cuda-tiled", "tir-dlight"]
    assert on.tvm_shapes() == (shapes[2],) and off.tvm_shapes() == (shapes[0], shapes[2])
    fns = _functions(shapes[:2], "bfloat16", tiled=True)
    assert [(f.name, f.in_features, f.padded_in_features) for f in fns] == [
        ("q4t_n1728_k576_pad640", 576, 640),
        ("q4t_n576_k1536", 1536, None),
    ]
    assert tiled_function_name(shapes[0]) == "q4t_n1728_k576_pad640"
    # the mma route never pads; the cpu card ignores the option
    mma = plan_modules(
        card="h200",
        arch="sm_90",
        widths=[8],
        other_dtype="bf16",
        shapes=shapes,
        q4_pad_k=True,
        q4_cuda_route="mma",
    )
    assert mma.route(shapes[0]) == "tir-dlight"
    cpu = plan_modules(card="cpu", arch="llvm", widths=[8], other_dtype="f32", shapes=shapes, q4_pad_k=True)
    assert cpu.route(shapes[0]) == "llvm-te"
    # the recipe option
    (tmp_path / "r.toml").write_text('name = "x"\n[modules]\nq4_pad_k = true\n')
    assert load_recipe(tmp_path / "r.toml").q4_pad_k and load_recipe(None).q4_pad_k is False
    (tmp_path / "bad.toml").write_text('name = "x"\n[modules]\nq4_pad_k = 1\n')
    with pytest.raises(RecipeError, match="q4_pad_k must be true or false"):
        load_recipe(tmp_path / "bad.toml")
