"""User-facing error paths of ignis-build, ignis-inspect and ignis-chat: every refusal is one clear
message naming the offending file, field or offset, a non-zero exit, no Python traceback, and
nothing half-written (or destroyed) left behind.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import pytest
from click.testing import CliRunner

from ignis.compiler.cli import main as build_cli
from ignis.tools.chat import main as chat_cli
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


def _no_traceback(result: Any) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_tiny = _helper("hf_tiny")
    root = tmp_path_factory.mktemp("ckpt")
    hf_tiny.save_tiny(hf_tiny.tiny_model("llama"), root / "llama", tokenizer=hf_tiny.tiny_tokenizer())
    return root / "llama"


@pytest.fixture(scope="module")
def artifact(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("art")
    recipe = root / "w1.toml"
    recipe.write_text('name = "t"\n[modules]\nwidths = [1]\n')
    out = root / "t"
    result = CliRunner().invoke(
        build_cli, ["--card", "cpu", "--model", str(ckpt), "--recipe", str(recipe), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return out


# ---------------------------------------------------------------------------------------------
# ignis-build


def test_build_refuses_an_out_that_is_the_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    before = _tree(model)
    result = CliRunner().invoke(
        build_cli, ["--card", "cpu", "--model", str(model), "--out", str(model), "--force"]
    )
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert "--out" in result.output and "checkpoint" in result.output and str(model) in result.output
    assert _tree(model) == before  # the checkpoint was neither replaced nor touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_build_refuses_an_out_that_contains_an_input(tmp_path: Path) -> None:
    model = tmp_path / "work" / "ckpt"
    model.mkdir(parents=True)
    recipe = tmp_path / "work" / "r.toml"
    recipe.write_text('name = "x"\n')
    with mock.patch("ignis.compiler.build.build_artifact") as build:
        result = CliRunner().invoke(
            build_cli,
            ["--card", "cpu", "--model", str(model), "--out", str(tmp_path / "work"), "--force", "--dry-run"],
        )
        assert result.exit_code == 2 and "contains the --model checkpoint" in result.output, result.output
        other = tmp_path / "m2"
        other.mkdir()
        result = CliRunner().invoke(
            build_cli,
            ["--card", "cpu", "--model", str(other), "--recipe", str(recipe), "--out", str(recipe.parent)],
        )
        assert result.exit_code == 2 and "contains the --recipe" in result.output, result.output
        build.assert_not_called()


def test_build_force_replaces_only_an_artifact_directory(ckpt: Path, artifact: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"  # e.g. `--out ~/work --force` by mistake
    (home / "src").mkdir(parents=True)
    (home / "src" / "precious.txt").write_text("keep me")
    recipe = tmp_path / "w1.toml"
    recipe.write_text('name = "t"\n[modules]\nwidths = [1]\n')
    args = ["--card", "cpu", "--model", str(ckpt), "--recipe", str(recipe), "--force"]
    result = CliRunner().invoke(build_cli, [*args, "--out", str(home)])
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert "not an ignis artifact (no manifest.json)" in result.output
    assert (home / "src" / "precious.txt").read_text() == "keep me"
    # an artifact directory is still replaced
    old = shutil.copytree(artifact, tmp_path / "old")
    (old / "stale.txt").write_text("x")
    result = CliRunner().invoke(build_cli, [*args, "--out", str(old)])
    assert result.exit_code == 0, result.output
    assert (old / "manifest.json").is_file() and not (old / "stale.txt").exists()


def test_build_refuses_an_out_below_a_file_even_in_a_dry_run(ckpt: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for extra in (["--dry-run"], []):
        result = CliRunner().invoke(
            build_cli, ["--card", "cpu", "--model", str(ckpt), "--out", str(a_file / "sub" / "art"), *extra]
        )
        _no_traceback(result)
        assert result.exit_code == 2, result.output
        assert f"{a_file} exists and is not a directory" in result.output
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_build_reports_an_unexpected_exception_without_a_traceback(ckpt: Path, tmp_path: Path) -> None:
    # a bug inside the build (simulated: the weights step raises a plain ValueError)
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "art"\n[modules]\nwidths = [1]\n')
    out = tmp_path / "out" / "art"

    def bug(*_a: Any, **_k: Any) -> Any:
        raise ValueError("simulated bug")

    with mock.patch("ignis.compiler.build.pipeline._write_weights", bug):
        result = CliRunner().invoke(
            build_cli, ["--card", "cpu", "--model", str(ckpt), "--recipe", str(recipe), "--out", str(out)]
        )
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert (
        "ignis-build: error: internal error (ValueError" in result.output and "IGNIS_DEBUG" in result.output
    )
    assert not (tmp_path / "out").exists()  # nor the parent the build created


@pytest.mark.parametrize(
    ("edit", "kind", "says"),
    [
        (lambda c: c.pop("model_type"), "ConfigError", "has no 'model_type'"),
        (lambda c: c.__setitem__("hidden_size", "64"), "ConfigError", "hidden_size must be a positive int"),
        (lambda c: c.__setitem__("model_type", "gpt9"), "UnknownModelTypeError", "unknown model_type 'gpt9'"),
    ],
)
def test_build_names_the_config_file_of_a_bad_config(
    ckpt: Path, tmp_path: Path, edit: Any, kind: str, says: str
) -> None:
    from ignis.compiler.importers import load_checkpoint
    from ignis.runtime.errors import ConfigError, UnknownModelTypeError

    model = shutil.copytree(ckpt, tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    edit(cfg)
    (model / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(
        build_cli, ["--card", "cpu", "--model", str(model), "--out", str(tmp_path / "o")]
    )
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert f"ignis-build: error: {kind}: {model / 'config.json'}: " in result.output and says in result.output
    with pytest.raises((ConfigError, UnknownModelTypeError)) as err:  # the type is kept for callers
        load_checkpoint(model)
    assert type(err.value).__name__ == kind and str(model / "config.json") in str(err.value)
    assert not (tmp_path / "o").exists()


def test_build_refuses_integer_weights_as_a_checkpoint_error(ckpt: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(ckpt, tmp_path / "model")
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int32)  # as a GPTQ/AWQ-style checkpoint would store it
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    for extra in (["--dry-run"], []):
        result = CliRunner().invoke(
            build_cli, ["--card", "cpu", "--model", str(model), "--out", str(tmp_path / "o"), *extra]
        )
        _no_traceback(result)
        assert result.exit_code == 1, result.output
        assert "ignis-build: error: CheckpointError:" in result.output
        assert f"{name} (I32) in model.safetensors" in result.output
    assert not (tmp_path / "o").exists()


def test_build_recognises_a_gguf_by_its_magic_and_hints_at_the_folder(ckpt: Path, tmp_path: Path) -> None:
    import gguf
    import numpy as np

    blob = tmp_path / "model.bin"  # a GGUF file saved without the .gguf suffix
    w = gguf.GGUFWriter(str(blob), "gemma3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    result = CliRunner().invoke(
        build_cli, ["--card", "cpu", "--model", str(blob), "--out", str(tmp_path / "o")]
    )
    _no_traceback(result)
    assert (
        result.exit_code == 1
        and "UnsupportedArchitectureError" in result.output
        and "'gemma3'" in result.output
    )
    st = ckpt / "model.safetensors"
    result = CliRunner().invoke(
        build_cli, ["--card", "cpu", "--model", str(st), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 1 and f"pass the folder that holds it ({ckpt})" in result.output, result.output


def test_build_names_an_unreadable_drafter(ckpt: Path, tmp_path: Path) -> None:
    drafter = tmp_path / "dflash2"
    drafter.mkdir()
    (drafter / "config.json").write_text("{bad")
    result = CliRunner().invoke(
        build_cli,
        ["--card", "cpu", "--model", str(ckpt), "--drafter", str(drafter), "--out", str(tmp_path / "o")],
    )
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert f"the drafter {drafter} does not fit the target or cannot be read" in result.output
    assert "cannot read config.json" in result.output and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("cli", "want"),
    [
        (build_cli, ["Exit status: 0 built", "130 interrupted", "IGNIS_DEBUG"]),
        (inspect_cli, ["Exit status: 0 valid", "1 --verify found corrupt data", "2 not a valid"]),
        (chat_cli, ["Exit status: 0", "[default: 1, off]", "[default: 0, off]", "fresh one per request"]),
    ],
)
def test_help_states_exit_codes_and_defaults(cli: Any, want: list[str]) -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert all(w in text for w in want), [w for w in want if w not in text]


# ---------------------------------------------------------------------------------------------
# ignis-inspect


def test_inspect_without_verify_refuses_a_truncated_or_missing_file(artifact: Path, tmp_path: Path) -> None:
    a = shutil.copytree(artifact, tmp_path / "a")
    assert CliRunner().invoke(inspect_cli, [str(a)]).exit_code == 0
    weights = a / "t.ninfer"
    weights.write_bytes(weights.read_bytes()[:-10])
    result = CliRunner().invoke(inspect_cli, [str(a)])
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert "t.ninfer" in result.output and "truncated" in result.output
    (a / "modules" / "cpu" / "linear_w1.so").unlink()
    result = CliRunner().invoke(inspect_cli, [str(a)])
    assert result.exit_code == 2 and "linear_w1.so: missing" in result.output, result.output


def test_inspect_without_verify_refuses_a_corrupt_container_header(artifact: Path, tmp_path: Path) -> None:
    from ignis.formats import NinferReader

    a = shutil.copytree(artifact, tmp_path / "a")
    weights = a / "t.ninfer"
    with NinferReader(weights) as r:
        header = r.header_offset
    data = bytearray(weights.read_bytes())
    data[header + 10] ^= 0x01
    weights.write_bytes(bytes(data))
    result = CliRunner().invoke(inspect_cli, [str(a)])
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert f"{weights}, byte offset" in result.output


def test_inspect_verify_names_the_corrupt_block_range(artifact: Path, tmp_path: Path) -> None:
    a = shutil.copytree(artifact, tmp_path / "a")
    lib = a / "modules" / "cpu" / "linear_w1.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0x01
    lib.write_bytes(bytes(data))
    result = CliRunner().invoke(inspect_cli, [str(a), "--verify"])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert (
        f"linear_w1.so: sha256 differs from the manifest (first corrupt block: bytes 0 to {len(data) - 1}"
        in (result.output)
    )


def test_inspect_verify_tells_a_damaged_manifest_entry(artifact: Path, tmp_path: Path) -> None:
    """Only the manifest's whole-file sha256 of a file is wrong (its blocks all match): the report
    says so instead of naming a block past the end of the file."""
    a = shutil.copytree(artifact, tmp_path / "a")
    manifest = json.loads((a / "manifest.json").read_text())
    entry = next(f for f in manifest["files"] if f["path"].endswith("linear_w1.so"))
    entry["sha256"] = "0" * 64
    (a / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(inspect_cli, [str(a), "--verify"])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert "the manifest's sha256 of this file is damaged" in result.output
    assert "first corrupt block" not in result.output


# ---------------------------------------------------------------------------------------------
# ignis-chat


class _Fake(http.server.BaseHTTPRequestHandler):
    models: bytes = b"<html>not ignis</html>"
    stream: bytes = b""

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(self.status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    status: int = 200

    def do_GET(self) -> None:
        self._send(self.models, "text/html" if self.models.startswith(b"<") else "application/json")

    posts: ClassVar[list[tuple[int, bytes]]] = []  # (status, body) answers to POST, in turn; else `stream`

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.posts:
            status, body = self.posts.pop(0)
            self.send_response(status)
            self.send_header("content-type", "application/json" if status >= 400 else "text/event-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._send(self.stream, "text/event-stream")

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[tuple[str, type[_Fake]]]:
    handler = type("Handler", (_Fake,), {"posts": []})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_chat_names_the_socket_it_cannot_reach(tmp_path: Path) -> None:
    sock = tmp_path / "absent.sock"
    result = CliRunner().invoke(chat_cli, ["--socket", str(sock), "hi"])
    _no_traceback(result)
    assert result.exit_code == 1 and f"cannot reach the server at unix socket {sock}" in result.output


def test_chat_refuses_a_server_that_is_not_ignis(fake_server: tuple[str, type[_Fake]]) -> None:
    url, _handler = fake_server
    result = CliRunner().invoke(chat_cli, ["--url", url, "hi"])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert f"{url} is not an ignis server" in result.output


def test_chat_refuses_a_malformed_stream_event(fake_server: tuple[str, type[_Fake]]) -> None:
    url, handler = fake_server
    handler.models = json.dumps({"data": [{"id": "m"}]}).encode()
    handler.stream = b"data: {not json\n\n"
    result = CliRunner().invoke(chat_cli, ["--url", url, "hi"])
    _no_traceback(result)
    assert result.exit_code == 1 and "malformed stream event" in result.output, result.output


def test_chat_refuses_a_bad_url_and_empty_input() -> None:
    result = CliRunner().invoke(chat_cli, ["--url", "http://[::1", "hi"])
    _no_traceback(result)
    assert result.exit_code == 2 and "--url" in result.output, result.output
    result = CliRunner().invoke(chat_cli, ["--url", "http://127.0.0.1:9"], input="  \n")
    _no_traceback(result)
    assert result.exit_code == 1 and "nothing to send" in result.output, result.output


def test_inspect_refuses_a_fifo_instead_of_blocking(tmp_path: Path) -> None:
    import os
    import subprocess

    fifo = tmp_path / "pipe.ninfer"
    os.mkfifo(fifo)
    # a subprocess with a timeout: opening a FIFO for reading blocks until a writer appears
    proc = subprocess.run(
        [sys.executable, "-m", "ignis.tools.inspect_artifact", str(fifo)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{fifo}: not a regular file" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_shortens_an_error_page(fake_server: tuple[str, type[_Fake]]) -> None:
    url, handler = fake_server
    handler.status = 502
    handler.models = b"<html>\n<body>" + b"bad gateway " * 500 + b"</body></html>"
    result = CliRunner().invoke(chat_cli, ["--url", url, "hi"])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert f"HTTP 502 from {url}: <html> <body>bad gateway" in result.output and "chars)" in result.output
    assert len(result.output) < 400


def test_chat_conversation_survives_a_refused_turn(fake_server: tuple[str, type[_Fake]]) -> None:
    from ignis.tools import chat

    url, handler = fake_server
    handler.models = json.dumps({"data": [{"id": "m"}]}).encode()
    refusal = json.dumps({"error": {"message": "the context is full"}}).encode()
    chunk = {"choices": [{"delta": {"content": "four"}, "finish_reason": "stop"}]}
    ok = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
    handler.posts = [(400, refusal), (200, ok)]
    with mock.patch.object(chat, "_stdin_is_tty", return_value=True):
        result = CliRunner().invoke(chat_cli, ["--url", url], input="a long question\n2+2?\n/quit\n")
    _no_traceback(result)
    assert result.exit_code == 0, result.output
    assert "HTTP 400 from" in result.output and "the context is full" in result.output
    assert "that message was dropped" in result.output and "four" in result.output
