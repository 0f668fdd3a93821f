"""The artifact manifest (formats/manifest.py): canonical bytes, validation, file checks, fuzzing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ignis.formats import (
    MANIFEST_NAME,
    ArtifactChecksumError,
    ArtifactFileError,
    FileEntry,
    FormatError,
    Manifest,
    ManifestError,
    ManifestVersionError,
    ModuleEntry,
    ModuleFunction,
    hash_file,
    parse_manifest,
    read_manifest,
    verify_artifact,
)
from ignis.formats.manifest import BLOCK_SIZE, FUNCTION_KINDS, KERNEL_ABIS, KernelEntry, file_entry


def _write(root: Path, rel: str, data: bytes) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)


def _artifact(root: Path, *, block_size: int = BLOCK_SIZE) -> Manifest:
    """A small artifact directory with a weights file, an MTP file and a module, and its manifest."""
    _write(root, "m.ninfer", bytes(range(256)) * 40)  # 10240 bytes
    _write(root, "m_mtp.ninfer", b"mtp" * 100)
    _write(root, "modules/cpu/linear_w1.so", b"\x7fELF" + b"\0" * 60)
    _write(root, "modules/cpu/topk.so", b"\x7fELF" + b"\1" * 60)
    files = []
    for rel, role in (
        ("m.ninfer", "weights"),
        ("m_mtp.ninfer", "mtp"),
        ("modules/cpu/linear_w1.so", "module"),
        ("modules/cpu/topk.so", "module"),
    ):
        size, sha, _ = hash_file(root / rel)
        _, _, blocks = hash_file(root / rel, block_size=block_size)
        files.append(FileEntry(rel, role, size, sha, blocks))
    fn = ModuleFunction("dense_n8_k4", "dense", 8, 4, "float32")
    m = Manifest(
        name="m",
        card="cpu",
        arch="llvm",
        family="llama",
        linear_dtype="f32",
        other_dtype="f32",
        widths=(1, 2),
        weights="m.ninfer",
        files=tuple(sorted(files, key=lambda f: f.path)),
        mtp="m_mtp.ninfer",
        tokenizer={
            "file": "m.ninfer",
            "tensor": "ignis.tokenizer.json",
            "metadata_key": "ignis.tokenizer",
            "sha256": "0" * 64,
        },
        chat_template=None,
        drafter={
            "kind": "dflash2",
            "file": "m.ninfer",
            "prefix": "dflash2.",
            "config_key": "ignis.dflash2.config",
        },
        shortlist={
            "file": "m.ninfer",
            "prefix": "shortlist.",
            "size": 4,
            "vocab_size": 8,
            "source": {"kind": "none", "files": []},
        },
        modules=(ModuleEntry(1, "modules/cpu/linear_w1.so", {"kind": "llvm"}, "llvm-te", False, (fn,)),),
        kernels=(
            KernelEntry(
                "topk", "topk", 1, "modules/cpu/topk.so", {"kind": "cuda", "arch": "sm_90"}, ("float32",)
            ),
        ),
        profile={"name": "cpu", "spec": {}},
        provenance={"ignis_version": "0.1.0", "inputs": []},
        block_size=block_size,
    )
    (root / MANIFEST_NAME).write_bytes(m.to_bytes())
    return m


def _mutated(m: Manifest, change) -> bytes:  # type: ignore[no-untyped-def]
    obj = m.to_json()
    change(obj)
    return json.dumps(obj).encode()


def test_roundtrip_and_canonical_bytes(tmp_path: Path) -> None:
    m = _artifact(tmp_path)
    data = (tmp_path / MANIFEST_NAME).read_bytes()
    assert data.endswith(b"\n") and json.loads(data)["format"] == "ignis-artifact"
    back = read_manifest(tmp_path)
    assert back == m
    assert back.to_bytes() == data  # canonical: parse + serialise is the identity
    assert list(json.loads(data)) == sorted(json.loads(data))  # keys sorted
    assert back.modules_for(1)[0].functions[0].name == "dense_n8_k4" and back.modules_for(2) == ()
    assert back.file("m_mtp.ninfer").role == "mtp"
    with pytest.raises(ManifestError):
        back.file("nope")


def test_hash_file_blocks(tmp_path: Path) -> None:
    data = bytes(range(256)) * 100  # 25600 bytes
    (tmp_path / "f").write_bytes(data)
    size, sha, blocks = hash_file(tmp_path / "f", block_size=4096)
    assert size == len(data) and sha == hashlib.sha256(data).hexdigest()
    assert len(blocks) == 7
    assert blocks[6] == hashlib.sha256(data[6 * 4096 :]).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert hash_file(tmp_path / "empty")[2] == ()
    with pytest.raises(ArtifactFileError):
        hash_file(tmp_path / "missing")
    entry = file_entry(tmp_path, "f", "weights")
    assert entry.size == len(data) and entry.block_sha256 == (sha,)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda o: o.pop("card"), "missing key"),
        (lambda o: o.update(extra=1), "unknown key"),
        (lambda o: o.update(widths=[2, 1]), "widths"),
        (lambda o: o.update(widths=[0]), "widths"),
        (lambda o: o.update(widths=[1, 65]), "widths"),
        (lambda o: o.update(weights="../m.ninfer"), "relative POSIX path"),
        (lambda o: o.update(weights="/abs/m.ninfer"), "relative POSIX path"),
        (lambda o: o.update(weights="a\\b"), "relative POSIX path"),
        (lambda o: o.update(weights="m_mtp.ninfer"), "role 'weights'"),
        (lambda o: o.update(mtp="nope.ninfer"), "does not list"),
        (lambda o: o["files"].reverse(), "sorted"),
        (lambda o: o["files"][0].update(sha256="X" * 64), "hex"),
        (lambda o: o["files"][0].update(size=-1), "integer >= 0"),
        (lambda o: o["files"][0].update(size=True), "integer"),
        (lambda o: o["files"][0].update(block_sha256=[]), "block_sha256"),
        (lambda o: o["files"][0].update(role="other"), "role"),
        (lambda o: o["modules"][0].update(width=3), "not in widths"),
        (lambda o: o["modules"].append(dict(o["modules"][0])), "listed twice"),
        (lambda o: o["modules"][0]["functions"].append(dict(o["modules"][0]["functions"][0])), "repeated"),
        (lambda o: o["modules"][0]["functions"][0].update(kind="int8"), "kind"),
        (lambda o: o["modules"][0]["functions"][0].update(name="not an id"), "identifier"),
        (lambda o: o["shortlist"].update(size=9), "exceeds"),
        (lambda o: o["drafter"].pop("prefix"), "missing key"),
        (lambda o: o.update(profile=[]), "JSON object"),
        (lambda o: o.update(block_size=100), "block_size"),
        # the compiled kernels (version 2): every malformed field is named
        (lambda o: o.pop("kernels"), r"missing key\(s\) \['kernels'\]"),
        (lambda o: o.update(kernels={}), "kernels must be list"),
        (lambda o: o["kernels"][0].pop("abi"), r"kernels\[0\]\. has missing key\(s\) \['abi'\]"),
        (lambda o: o["kernels"][0].update(extra=1), r"kernels\[0\]\. has .*unknown key\(s\) \['extra'\]"),
        (lambda o: o["kernels"][0].update(kind="softmax"), r"kernels\[0\]\.kind 'softmax' is not one of"),
        (lambda o: o["kernels"][0].update(abi=2), r"kernels\[0\]\.abi 2 is not the topk calling"),
        (lambda o: o["kernels"][0].update(abi="1"), r"kernels\[0\]\.abi must be an integer"),
        (lambda o: o["kernels"][0].update(abi=True), r"kernels\[0\]\.abi must be an integer"),
        (lambda o: o["kernels"][0].update(name="top k"), r"kernels\[0\]\.name 'top k' is not a C identifier"),
        (lambda o: o["kernels"][0].update(name=7), r"kernels\[0\]\.name must be str"),
        (lambda o: o["kernels"][0].update(file="../topk.so"), r"kernels\[0\]\.file '\.\./topk\.so' is not"),
        (lambda o: o["kernels"][0].update(file="m.ninfer"), r"kernels\[0\]\.file names 'm\.ninfer'"),
        (lambda o: o["kernels"][0].update(file="modules/cpu/x.so"), r"kernels\[0\]\.file .* does not list"),
        (
            lambda o: o["kernels"][0].update(target={"kind": "llvm"}),
            r"kernels\[0\]\.target .* target kind 'cuda'",
        ),
        (lambda o: o["kernels"][0].update(target="cuda"), r"kernels\[0\]\.target must be a JSON object"),
        (lambda o: o["kernels"][0].update(dtypes=[]), r"kernels\[0\]\.dtypes must be a non-empty"),
        (
            lambda o: o["kernels"][0].update(dtypes=["float32", "bfloat16"]),
            r"kernels\[0\]\.dtypes .* ascending",
        ),
        (lambda o: o["kernels"][0].update(dtypes=["float32", "float32"]), r"kernels\[0\]\.dtypes"),
        (lambda o: o["kernels"][0].update(dtypes=["int8"]), r"kernels\[0\]\.dtypes"),
        (lambda o: o["kernels"][0].update(dtypes="float32"), r"kernels\[0\]\.dtypes must be list"),
        (
            lambda o: o["kernels"].append(dict(o["kernels"][0])),
            r"kernels\[1\]: 'modules/cpu/topk\.so' exports",
        ),
        (
            lambda o: o["kernels"].append(
                {**o["kernels"][0], "name": "topk2", "dtypes": ["bfloat16", "float32"]}
            ),
            r"kernels\[1\]: a second topk kernel for float32",
        ),
        (lambda o: o["kernels"].append(None), r"kernels\[1\]\. must be a JSON object"),
    ],
)
def test_schema_violations_are_refused(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    m = _artifact(tmp_path)
    with pytest.raises(ManifestError, match=message) as info:
        parse_manifest(_mutated(m, change), path="manifest.json")
    assert "manifest.json" in str(info.value)


def test_tiled_q4_functions_are_a_module_function_kind(tmp_path: Path) -> None:
    """kind "q4_g32_tiled" (route "cuda-tiled") round-trips; an unknown kind is still refused."""
    m = _artifact(tmp_path)

    def tiled(o):  # type: ignore[no-untyped-def]
        o["modules"][0]["route"] = "cuda-tiled"
        o["modules"][0]["functions"][0].update(kind="q4_g32_tiled", name="q4t_n8_k128", in_features=128)

    back = parse_manifest(_mutated(m, tiled), path="manifest.json")
    fn = back.modules[0].functions[0]
    assert (fn.kind, fn.name, back.modules[0].route) == ("q4_g32_tiled", "q4t_n8_k128", "cuda-tiled")
    assert "q4_g32_tiled" in FUNCTION_KINDS
    with pytest.raises(ManifestError, match=r"functions\[0\]\. kind 'q4_g32_nt'"):
        parse_manifest(
            _mutated(m, lambda o: o["modules"][0]["functions"][0].update(kind="q4_g32_nt")),
            path="manifest.json",
        )


def test_padded_tiled_q4_functions(tmp_path: Path) -> None:
    """A q4_g32_tiled function of K = 576 (not a multiple of 128) names the K it computes over,
    padded_in_features = 640, and round-trips with it; the key is absent on every other function;
    a wrong or missing padded K, or one on another kind, is refused naming the field."""
    m = _artifact(tmp_path)

    def padded(value: object = 640, kind: str = "q4_g32_tiled", k: int = 576):  # type: ignore[no-untyped-def]
        def change(o):  # type: ignore[no-untyped-def]
            o["modules"][0]["route"] = "cuda-tiled"
            fn = o["modules"][0]["functions"][0]
            fn.update(kind=kind, name="q4t_n8_k576_pad640", in_features=k)
            if value is not None:
                fn["padded_in_features"] = value

        return change

    back = parse_manifest(_mutated(m, padded()), path="manifest.json")
    fn = back.modules[0].functions[0]
    assert (fn.in_features, fn.padded_in_features) == (576, 640)
    assert fn.to_json()["padded_in_features"] == 640
    assert "padded_in_features" not in m.modules[0].functions[0].to_json()  # absent when unset
    assert parse_manifest(back.to_bytes(), path="manifest.json") == back
    for change, message in (
        (padded(None), r"functions\[0\]\.padded_in_features: .* in_features 576 .* must give .* 640"),
        (padded(768), r"must give padded_in_features 640, got 768"),
        (padded(640, k=580), r"in_features 580"),
        (padded(128, k=128), r"only allowed on q4_g32_tiled functions whose in_features is not a multiple"),
        (padded(640, kind="q4_g32"), r"only allowed on q4_g32_tiled"),
        (padded("640"), r"padded_in_features"),
    ):
        with pytest.raises(ManifestError, match=message):
            parse_manifest(_mutated(m, change), path="manifest.json")


def test_versions_and_json_errors(tmp_path: Path) -> None:
    m = _artifact(tmp_path)
    with pytest.raises(ManifestVersionError) as info:
        parse_manifest(_mutated(m, lambda o: o.update(version=3)), path=None)
    assert info.value.version == 3
    for bad in (0, True, "2", 2.0, None):
        with pytest.raises(ManifestVersionError):
            parse_manifest(_mutated(m, lambda o, v=bad: o.update(version=v)), path=None)
    with pytest.raises(ManifestVersionError):
        parse_manifest(_mutated(m, lambda o: o.update(format="other")), path=None)
    with pytest.raises(ManifestVersionError):
        parse_manifest(_mutated(m, lambda o: o.update(ninfer_version=2)), path=None)
    with pytest.raises(ManifestError, match="JSON"):
        parse_manifest(b"{not json", path=None)
    with pytest.raises(ManifestError, match="duplicate"):
        parse_manifest(b'{"format": "ignis-artifact", "format": "ignis-artifact"}', path=None)
    with pytest.raises(ManifestError, match="NaN"):
        parse_manifest(b'{"format": "ignis-artifact", "version": 1, "x": NaN}', path=None)
    with pytest.raises(ManifestError, match="UTF-8"):
        parse_manifest(b"\xff\xfe", path=None)
    with pytest.raises(ManifestError, match="JSON object"):
        parse_manifest(b"[]", path=None)
    with pytest.raises(ManifestError, match="cannot read"):
        read_manifest(tmp_path / "nowhere")


def test_kernels_roundtrip_and_version_1_manifests(tmp_path: Path) -> None:
    m = _artifact(tmp_path)
    back = read_manifest(tmp_path)
    assert back.version == 2 and back.kernels == m.kernels
    assert back.kernel("topk") == m.kernels[0] and back.kernel("topk", "float32") == m.kernels[0]
    assert back.kernel("topk", "bfloat16") is None and back.kernel("other") is None
    assert json.loads((tmp_path / MANIFEST_NAME).read_bytes())["kernels"][0] == {
        "name": "topk",
        "kind": "topk",
        "abi": 1,
        "file": "modules/cpu/topk.so",
        "target": {"kind": "cuda", "arch": "sm_90"},
        "dtypes": ["float32"],
    }
    # a version 1 manifest (written before `kernels` existed) reads as one without kernels, and its
    # bytes stay canonical
    v1 = Manifest(**{**m.__dict__, "version": 1, "kernels": ()})
    data = v1.to_bytes()
    assert "kernels" not in json.loads(data) and json.loads(data)["version"] == 1
    old = parse_manifest(data, path=None)
    assert old.version == 1 and old.kernels == () and old.kernel("topk") is None and old.to_bytes() == data
    # a version 1 manifest holding kernels is refused (an unknown key of that version), by the writer too
    with pytest.raises(ManifestError, match=r"unknown key\(s\) \['kernels'\]"):
        parse_manifest(_mutated(m, lambda o: o.update(version=1)), path="manifest.json")
    with pytest.raises(ManifestError):
        Manifest(**{**m.__dict__, "version": 1}).to_bytes()
    # version 2 with no kernels: an empty list, not an absent key
    none = Manifest(**{**m.__dict__, "kernels": ()})
    assert json.loads(none.to_bytes())["kernels"] == []


def _hybrid_kernels() -> tuple[KernelEntry, ...]:
    cuda, dtypes = {"kind": "cuda", "arch": "sm_90"}, ("bfloat16", "float16", "float32")
    return (
        KernelEntry("gdn_recurrent", "gdn_recurrent", 1, "modules/cpu/linear_w1.so", cuda, dtypes),
        KernelEntry("add_rms_norm", "add_rms_norm", 1, "modules/cpu/topk.so", cuda, dtypes),
        KernelEntry("gated_rms_norm", "gated_rms_norm", 1, "modules/cpu/topk.so", cuda, dtypes),
    )


def test_gdn_recurrent_and_norm_kernels_roundtrip(tmp_path: Path) -> None:
    """The kinds added after topk: one entry per exported function, two entries may share a library
    (the fused norms), each kind at most once per dtype."""
    m = _artifact(tmp_path)
    both = Manifest(**{**m.__dict__, "kernels": (*m.kernels, *_hybrid_kernels())})
    back = parse_manifest(both.to_bytes(), path=None)
    assert back.kernels == both.kernels
    gdn = back.kernel("gdn_recurrent", "bfloat16")
    assert gdn is not None and (gdn.name, gdn.abi, gdn.file) == (
        "gdn_recurrent",
        1,
        "modules/cpu/linear_w1.so",
    )
    add, gated = back.kernel("add_rms_norm", "float16"), back.kernel("gated_rms_norm", "float32")
    assert add is not None and gated is not None and add.file == gated.file == "modules/cpu/topk.so"
    assert back.kernel("topk", "bfloat16") is None  # dtypes are per entry


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda o: o["kernels"][1].update(abi=2), r"kernels\[1\]\.abi 2 is not the gdn_recurrent calling"),
        (lambda o: o["kernels"][1].update(abi=0), r"kernels\[1\]\.abi must be"),
        (
            lambda o: o["kernels"][1].update(target={"kind": "llvm"}),
            r"kernels\[1\]\.target .* a gdn_recurrent kernel is built for target kind 'cuda'",
        ),
        (
            lambda o: o["kernels"][1].update(dtypes=["float32", "float16"]),
            r"kernels\[1\]\.dtypes .* ascending",
        ),
        (lambda o: o["kernels"][1].update(kind="gdn"), r"kernels\[1\]\.kind 'gdn' is not one of"),
        (lambda o: o["kernels"][1].update(file="modules/cpu/gdn.so"), r"kernels\[1\]\.file .* does not list"),
        (
            lambda o: o["kernels"].append({**o["kernels"][1], "name": "gdn2", "dtypes": ["float16"]}),
            r"kernels\[4\]: a second gdn_recurrent kernel for float16",
        ),
        (
            lambda o: o["kernels"][3].update(name="add_rms_norm"),
            r"kernels\[3\]: 'modules/cpu/topk\.so' exports 'add_rms_norm' for a second entry",
        ),
        (lambda o: o["kernels"][2].update(abi=3), r"kernels\[2\]\.abi 3 is not the add_rms_norm calling"),
        (lambda o: o["kernels"][3].pop("target"), r"kernels\[3\]\. has missing key\(s\) \['target'\]"),
    ],
)
def test_hybrid_kernel_violations_name_the_field(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    m = _artifact(tmp_path)
    both = Manifest(**{**m.__dict__, "kernels": (*m.kernels, *_hybrid_kernels())})
    with pytest.raises(ManifestError, match=message) as info:
        parse_manifest(_mutated(both, change), path="art/manifest.json")
    assert "art/manifest.json" in str(info.value)


def _mixers_kernels() -> tuple[KernelEntry, ...]:
    cuda = {"kind": "cuda", "arch": "sm_90"}
    return (
        KernelEntry(
            "gdn_conv_silu", "gdn_conv_silu", 1, "modules/cpu/topk.so", cuda, ("bfloat16", "float32")
        ),
        KernelEntry("qk_norm_rope_kv", "qk_norm_rope_kv", 1, "modules/cpu/topk.so", cuda, ("float16",)),
    )


def test_mixers_kernels_roundtrip(tmp_path: Path) -> None:
    """gdn_conv_silu / qk_norm_rope_kv: abi 1, CUDA, one library shared with other entries' files."""
    assert KERNEL_ABIS["gdn_conv_silu"] == KERNEL_ABIS["qk_norm_rope_kv"] == 1
    m = _artifact(tmp_path)
    both = Manifest(**{**m.__dict__, "kernels": (*m.kernels, *_mixers_kernels())})
    back = parse_manifest(both.to_bytes(), path=None)
    assert back.kernels == both.kernels and back.to_bytes() == both.to_bytes()
    conv, qk = back.kernel("gdn_conv_silu", "float32"), back.kernel("qk_norm_rope_kv", "float16")
    assert conv is not None and qk is not None
    assert (conv.name, conv.abi, conv.target) == ("gdn_conv_silu", 1, {"kind": "cuda", "arch": "sm_90"})
    assert conv.file == qk.file == "modules/cpu/topk.so"
    assert (
        back.kernel("gdn_conv_silu", "float16") is None and back.kernel("qk_norm_rope_kv", "bfloat16") is None
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda o: o["kernels"][1].update(abi=2), r"kernels\[1\]\.abi 2 is not the gdn_conv_silu calling"),
        (lambda o: o["kernels"][2].update(abi=0), r"kernels\[2\]\.abi must be"),
        (
            lambda o: o["kernels"][2].update(target={"kind": "llvm"}),
            r"kernels\[2\]\.target .* a qk_norm_rope_kv kernel is built for target kind 'cuda'",
        ),
        (lambda o: o["kernels"][1].update(dtypes=[]), r"kernels\[1\]\.dtypes"),
        (
            lambda o: o["kernels"][1].update(dtypes=["float32", "bfloat16"]),
            r"kernels\[1\]\.dtypes .* ascending",
        ),
        (
            lambda o: o["kernels"][2].update(kind="qk_norm_rope"),
            r"kernels\[2\]\.kind 'qk_norm_rope' is not one of",
        ),
        (
            lambda o: o["kernels"][2].update(file="modules/cpu/mixers.so"),
            r"kernels\[2\]\.file .* does not list",
        ),
        (
            lambda o: o["kernels"].append({**o["kernels"][2], "name": "qk2"}),
            r"kernels\[3\]: a second qk_norm_rope_kv kernel for float16",
        ),
        (
            lambda o: o["kernels"][2].update(name="gdn_conv_silu"),
            r"kernels\[2\]: 'modules/cpu/topk\.so' exports 'gdn_conv_silu' for a second entry",
        ),
        (lambda o: o["kernels"][1].pop("abi"), r"kernels\[1\]\. has missing key\(s\) \['abi'\]"),
    ],
)
def test_mixers_kernel_violations_name_the_field(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    m = _artifact(tmp_path)
    both = Manifest(**{**m.__dict__, "kernels": (*m.kernels, *_mixers_kernels())})
    with pytest.raises(ManifestError, match=message) as info:
        parse_manifest(_mutated(both, change), path="art/manifest.json")
    assert "art/manifest.json" in str(info.value)


def test_verify_artifact_files(tmp_path: Path) -> None:
    m = _artifact(tmp_path, block_size=4096)
    verify_artifact(tmp_path, m)
    # a flipped byte: named by file and the offset of its block
    data = bytearray((tmp_path / "m.ninfer").read_bytes())
    data[5000] ^= 0x01
    (tmp_path / "m.ninfer").write_bytes(bytes(data))
    verify_artifact(tmp_path, m, check_hashes=False)  # sizes still right
    with pytest.raises(ArtifactChecksumError) as info:
        verify_artifact(tmp_path, m)
    assert info.value.mismatches == [("m.ninfer", 4096)] and info.value.offset == 4096
    assert "m.ninfer" in str(info.value) and "4096" in str(info.value)
    data[5000] ^= 0x01
    (tmp_path / "m.ninfer").write_bytes(bytes(data))
    # truncation, a missing file and an unlisted file: all listed at once
    (tmp_path / "m_mtp.ninfer").write_bytes(b"mtp")
    (tmp_path / "modules/cpu/linear_w1.so").unlink()
    (tmp_path / "stray.txt").write_text("x")
    with pytest.raises(ArtifactFileError) as finfo:
        verify_artifact(tmp_path, m)
    problems = "\n".join(finfo.value.problems)
    assert "m_mtp.ninfer: 3 bytes" in problems and "linear_w1.so: missing" in problems
    assert "stray.txt: not listed" in problems


def test_allow_extra(tmp_path: Path) -> None:
    m = _artifact(tmp_path)
    (tmp_path / "README").write_text("x")
    verify_artifact(tmp_path, m, allow_extra=True)
    with pytest.raises(ArtifactFileError, match="not listed"):
        verify_artifact(tmp_path, m)


def test_to_bytes_refuses_an_invalid_manifest(tmp_path: Path) -> None:
    m = _artifact(tmp_path)
    bad = Manifest(**{**m.__dict__, "weights": "absent.ninfer"})
    with pytest.raises(ManifestError):
        bad.to_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_manifests_raise_only_manifest_errors(tmp_path: Path, data: st.DataObject) -> None:
    root = tmp_path / "fuzz"
    if not (root / MANIFEST_NAME).exists():
        _artifact(root)
    raw = bytearray((root / MANIFEST_NAME).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if kind == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "delete" and raw:
            del raw[pos]
        elif kind == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del raw[pos:]
    try:
        m = parse_manifest(bytes(raw), path="fuzz/manifest.json")
    except FormatError as exc:
        assert isinstance(exc, ManifestError)
        return
    assert isinstance(m, Manifest)


def test_a_tiled_q4_function_off_the_q4_groups_is_refused_for_what_it_is(tmp_path: Path) -> None:
    """A q4_g32_tiled function whose in_features is not whole q4 groups of 32 (K = 580) is refused
    naming in_features and saying it is not a multiple of 32 (not that its padded K is wrong, which
    the right padded K 640 would contradict)."""
    m = _artifact(tmp_path)

    def change(o):  # type: ignore[no-untyped-def]
        o["modules"][0]["route"] = "cuda-tiled"
        fn = o["modules"][0]["functions"][0]
        fn.update(kind="q4_g32_tiled", name="q4t_n8_k580_pad640", in_features=580, padded_in_features=640)

    with pytest.raises(ManifestError) as info:
        parse_manifest(_mutated(m, change), path="manifest.json")
    message = str(info.value)
    assert "functions[0].in_features" in message and "580 (not a multiple of 32)" in message, message
    assert "a multiple of 32, not of" not in message, message
