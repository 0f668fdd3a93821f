"""`ignis-inspect`: the table and metadata are printed; --verify exits non-zero on a flipped data byte;
invalid files and directories exit non-zero with a message."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from ninfer_golden import GOLDEN_PATH

from ignis.formats import write_ninfer
from ignis.tools.inspect_artifact import EXIT_CORRUPT_DATA, EXIT_INVALID, main


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_prints_metadata_and_table() -> None:
    code, out, _ = run(str(GOLDEN_PATH))
    assert code == 0
    assert ".ninfer v1" in out and "metadata: 8 key(s)" in out and "tensors: 11" in out
    assert "ignis.family = 'llama'" in out and "blob = <8 bytes>" in out
    line = next(row for row in out.splitlines() if row.strip().startswith("q4.weight"))
    assert line.split() == ["q4.weight", "q4_g32", "[4,", "64]", "36864", "144", "b2bbbbef"]


def test_verify_ok() -> None:
    code, out, _ = run(str(GOLDEN_PATH), "--verify")
    assert code == 0 and "verify: ok: 11 tensor(s)" in out


def test_verify_flipped_data_byte(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ninfer"
    data = bytearray(GOLDEN_PATH.read_bytes())
    data[36864 + 3] ^= 0x08  # inside q4.weight
    bad.write_bytes(bytes(data))
    code, _, _ = run(str(bad))  # without --verify the header alone is valid
    assert code == 0
    code, _, err = run(str(bad), "--verify")
    assert code == EXIT_CORRUPT_DATA
    assert "MISMATCH" in err and "'q4.weight'" in err and "36864" in err and "FAILED" in err


def test_verify_bad_padding(tmp_path: Path) -> None:
    bad = tmp_path / "pad.ninfer"
    data = bytearray(GOLDEN_PATH.read_bytes())
    data[4096 + 1024 + 5] = 1  # padding after f32.weight
    bad.write_bytes(bytes(data))
    code, _, err = run(str(bad), "--verify")
    assert code == EXIT_CORRUPT_DATA and "padding" in err


def test_invalid_file_and_directory(tmp_path: Path) -> None:
    bad = tmp_path / "t.ninfer"
    bad.write_bytes(GOLDEN_PATH.read_bytes()[:-1])
    code, _, err = run(str(bad))
    assert code == EXIT_INVALID and "TruncatedFileError" in err and str(bad) in err
    code, _, err = run(str(tmp_path))
    assert code == EXIT_INVALID and "manifest" in err


def test_long_metadata_is_truncated(tmp_path: Path) -> None:
    path = write_ninfer(
        tmp_path / "m.ninfer",
        {"t": np.zeros(1, np.float32)},
        metadata={"tokenizer.json": "x" * 10_000, "list": list(range(1000))},
    )
    code, out, _ = run(path)
    assert code == 0 and "(10000 chars)" in out and "(1000 items)" in out
    assert max(len(line) for line in out.splitlines()) < 200


def test_console_script_is_installed() -> None:
    exe = shutil.which("ignis-inspect", path=str(Path(sys.executable).parent))
    assert exe is not None
    proc = subprocess.run([exe, str(GOLDEN_PATH)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "q4.weight" in proc.stdout


EVIL_NAME = "w\x1b[2J\x1b]0;pwned\x07\nforged.weight  f32  [1]\u202egnp.exe"
EVIL_KEY = "note\r\x1b[31m\u2028key"


def _printed_controls(text: str) -> set[str]:
    """The non-printable characters in `text` other than the line ends the tool writes itself."""
    return {c for c in text if not c.isprintable() and c != "\n"}


def test_names_and_keys_with_control_characters_are_escaped(tmp_path: Path) -> None:
    """Tensor names, metadata keys and values are UTF-8 strings the spec allows to hold any character:
    the table and the metadata lines show them escaped, one line each, never raw."""
    path = tmp_path / "evil.ninfer"
    write_ninfer(
        path,
        {EVIL_NAME: np.arange(4, dtype=np.float32), "plain.weight": np.zeros(2, np.float32)},
        metadata={EVIL_KEY: "value\x1b[0m\nline", "ok": 1},
    )
    code, out, err = run(str(path))
    assert code == 0, err
    assert _printed_controls(out) == set()
    assert repr(EVIL_NAME) in out and repr(EVIL_KEY) in out
    # one metadata line per key and one table line per tensor (+ the table head): no forged lines
    lines = out.splitlines()
    assert sum(line.startswith("  ") for line in lines) == 2 + 3
    assert not any(line.lstrip().startswith("forged.weight") for line in lines)
    assert "  plain.weight " in out  # a printable name is shown as it is


def test_verify_mismatch_names_an_escaped_tensor(tmp_path: Path) -> None:
    """--verify's MISMATCH line quotes the corrupt tensor's name escaped as well."""
    from ignis.formats import NinferReader

    path = tmp_path / "evil.ninfer"
    write_ninfer(path, {EVIL_NAME: np.arange(64, dtype=np.float32)})
    with NinferReader(path) as r:
        offset = r.tensors[EVIL_NAME].offset
    data = bytearray(path.read_bytes())
    data[offset + 5] ^= 0x10
    path.write_bytes(bytes(data))
    code, out, err = run(str(path), "--verify")
    assert code == EXIT_CORRUPT_DATA
    assert "MISMATCH" in err
    assert _printed_controls(out) == set() and _printed_controls(err) == set()


def test_artifact_manifest_fields_with_control_characters_are_escaped(tmp_path: Path) -> None:
    """`ignis-inspect DIR`: file paths, module files and provenance strings from manifest.json (which
    allows any character in a relative path) are printed escaped, one table line per file."""
    from ignis.formats import MANIFEST_NAME, FileEntry, Manifest, ModuleEntry, ModuleFunction, hash_file

    evil_module = "modules/cpu/w\x1b[2J\x1b]0;pwned\x07\nforged.so"
    write_ninfer(tmp_path / "m.ninfer", {"t": np.zeros(4, np.float32)})
    (tmp_path / "modules" / "cpu").mkdir(parents=True)
    (tmp_path / evil_module).write_bytes(b"\x7fELF" + b"\0" * 60)
    files = []
    for rel, role in (("m.ninfer", "weights"), (evil_module, "module")):
        size, sha, blocks = hash_file(tmp_path / rel)
        files.append(FileEntry(rel, role, size, sha, blocks))
    fn = ModuleFunction("dense_n8_k4", "dense", 8, 4, "float32")
    m = Manifest(
        name="m",
        card="cpu",
        arch="llvm",
        family="llama",
        linear_dtype="f32",
        other_dtype="f32",
        widths=(1,),
        weights="m.ninfer",
        files=tuple(sorted(files, key=lambda f: f.path)),
        mtp=None,
        tokenizer=None,
        chat_template=None,
        drafter=None,
        shortlist=None,
        modules=(ModuleEntry(1, evil_module, {"kind": "llvm"}, "llvm-te", False, (fn,)),),
        profile={"name": "cpu", "spec": {}},
        provenance={"ignis_version": "0.1.0\x1b[31m", "inputs": []},
    )
    (tmp_path / MANIFEST_NAME).write_bytes(m.to_bytes())
    code, out, err = run(str(tmp_path))
    assert code == 0, err
    assert _printed_controls(out) == set() and _printed_controls(err) == set()
    assert repr(evil_module) in out and "'0.1.0\\x1b[31m'" in out
    assert not any(line.lstrip().startswith("forged.so") for line in out.splitlines())
