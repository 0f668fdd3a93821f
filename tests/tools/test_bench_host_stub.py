"""`ignis.tools.bench.host_stub`: the engine and `StaticLlamaExecutor` with the model's math stubbed out
(in-process figures on a tiny llama)."""

from __future__ import annotations

import hf_tiny  # tests/ is on pytest's pythonpath
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.sampling import SamplingParams
from ignis.tools.bench.host_stub import in_process, stub_executor


def test_in_process_on_a_tiny_llama(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ignis.compiler.importers import load_checkpoint

    ckpt = load_checkpoint(hf_tiny.save_tiny(hf_tiny.tiny_model("llama", seed=0), tmp_path / "c"))
    ex = stub_executor(ckpt.config, ckpt.tensors.load_all(), max_lanes=4, max_context=128)
    engine = SpeculativeEngine(ex, None, max_lanes=4)
    # the stub's greedy choice: (token * 7 + 3) % (vocab - 1) + 1 after each column
    v = int(ckpt.config.vocab_size)
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    a = (7 * 7 + 3) % (v - 1) + 1
    b = (a * 7 + 3) % (v - 1) + 1
    assert list(out.output_token_ids) == [a, b, (b * 7 + 3) % (v - 1) + 1]
    rows = [in_process(engine, lanes=n, tokens=6, repeat=1) for n in (2, 4)]
    for row in rows:
        assert row["cpu_us_round"] > 0 and row["cpu_argmax_us"] > 0
        assert 0 < row["torch_calls_round"] <= 24
    assert rows[0]["torch_calls_round"] == rows[1]["torch_calls_round"]  # not a lane's worth more
    assert not engine.has_unfinished
