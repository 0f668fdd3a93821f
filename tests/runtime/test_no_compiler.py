"""A deployment host without the compiler: the runtime opens an artifact and serves it with
`ignis.compiler` (and the TVM compiler package `tvm`) not importable.

The artifact is built here, with the compiler, for the `cpu` card (its linears compiled into LLVM
modules). A subprocess then installs a meta-path finder that makes every `import ignis.compiler*` and
`import tvm*` raise ImportError -- as on a host with only the runtime extra and TVM's runtime
libraries (`IGNIS_TVM_LIB_DIR`) -- opens the artifact, generates through the engine with the compiled
modules, and serves a completion over the real HTTP server. Its greedy tokens must equal those this
process gets with the compiler present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.artifact_source import ArtifactSource
from ignis.runtime.server.model import ModelSettings

build = pytest.importorskip("ignis.compiler.build")
pytest.importorskip("transformers")

TESTS = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 33, 2, 90, 41]
MAX_TOKENS = 8

# Runs in a fresh interpreter: argv[1] is the artifact. Prints one JSON line with what it saw.
_HOST = r"""
import importlib.abc
import json
import sys

BLOCKED = ("ignis.compiler", "tvm")


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} is not installed on this host")
        return None


sys.meta_path.insert(0, NotInstalled())
for name in BLOCKED:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"the import hook does not hide {name}")

from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.artifact_source import ArtifactSource
from ignis.runtime.server.model import ModelSettings
from server_helpers import serve

artifact, prompt, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = ArtifactSource(artifact).load(ModelSettings(SpecDefaults("ngram", 3), device="cpu"))
try:
    engine = model.make_engine(2, SpeculativeMetrics())
    backend = engine.executor.linear
    (res,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))
    engine_tokens, counts = list(res.output_token_ids), dict(backend.counts)
finally:
    if model.close is not None:
        model.close()
with serve(ArtifactSource(artifact), SpecDefaults("off"), lanes=2) as running, running.client() as c:
    r = c.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["token_ids"]
# the kernel bindings' host-side checks and sizing (they once read the compiler's limits and formulas),
# with CPU stand-ins for the compiled functions
import torch
from ignis.runtime.kernels.fused_mixers import FusedMixersKernel

names = ("gdn_conv_silu", "qk_norm_rope_kv", "gated_attention")
mixers = FusedMixersKernel({n: (lambda *a: None) for n in names})
takes = [mixers.gated_attention_takes(torch.bfloat16, hd) for hd in (128, 96)]
q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
kc = torch.zeros(1, 600, 2, 64, dtype=torch.bfloat16)
out = mixers.gated_attention(q, kc, kc, q, torch.tensor([0, 1]), torch.tensor([0]), 600, 0.125)
takes.append(tuple(out.shape))
leaked = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
print(json.dumps({"engine": engine_tokens, "served": served, "counts": counts, "leaked": leaked,
                  "takes": takes}))
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import hf_tiny

    root = tmp_path_factory.mktemp("nocompiler")
    ckpt = hf_tiny.save_tiny(hf_tiny.tiny_model("qwen2"), root / "ckpt", tokenizer=hf_tiny.tiny_tokenizer())
    (root / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = [1, 4]\n')
    res = build.build_artifact(
        card="cpu",
        model=ckpt,
        recipe=root / "r.toml",
        out=root / "tiny",
        progress=False,
        echo=lambda _l: None,
    )
    assert res.out is not None
    return Path(res.out)


def _greedy_here(artifact: Path) -> list[int]:
    model = ArtifactSource(artifact).load(ModelSettings(SpecDefaults("off"), device="cpu"))
    try:
        engine = model.make_engine(2, SpeculativeMetrics())
        (res,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        return list(res.output_token_ids)
    finally:
        if model.close is not None:
            model.close()


def test_the_runtime_serves_an_artifact_without_the_compiler(artifact: Path) -> None:
    from ignis.runtime.kernels.tvm_runtime import RUNTIME_LIB_DIR_ENV, find_runtime_lib_dir

    want = _greedy_here(artifact)
    env = dict(os.environ)
    env[RUNTIME_LIB_DIR_ENV] = str(find_runtime_lib_dir())  # the host's TVM runtime libraries
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(TESTS / "runtime" / "server"), *filter(None, [env.get("PYTHONPATH")])]
    )
    proc = subprocess.run(
        [sys.executable, "-c", _HOST, str(artifact), json.dumps(PROMPT), str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["leaked"] == []
    assert seen["counts"]["compiled"] > 0 and seen["counts"]["fallback"] == 0  # the compiled modules ran
    assert seen["engine"] == want and len(want) == MAX_TOKENS  # spec on (ngram) == spec off, no compiler
    assert seen["served"] == want
    assert seen["takes"] == [True, False, [2, 256]]
