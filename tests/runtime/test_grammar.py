"""Grammar-constrained decoding (`ignis.runtime.grammar`) and its place in the verify round.

- the bitmask layout and `apply_token_bitmask` against a per-token loop;
- a round's masks equal the masks of feeding the drafts one by one, rows after a disallowed draft are
  never narrower than all-ones, and the matcher is left where it was;
- greedy speculation on equals speculation off under a JSON schema, on tiny hybrid targets with the
  real drafters (ngram, draft-model, dflash2, mtp), plain and steered (the first n drafts of each
  proposal replaced by the constrained speculation-off output, so accepted runs of every length
  occur and the rest of each proposal is mostly outside the grammar); every output is JSON valid
  against the schema;
- sampled output under a grammar has the masked model's distribution (chi-square against the exact
  enumeration, `tests/sampling_checks.py`), with drafters that sample, point-mass drafters and drafters
  whose drafts mostly leave the grammar.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import pytest
import torch
from sampling_checks import pooled_chi2
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

pytest.importorskip("llguidance")

from steered_drafter import SteeredDrafter

from ignis.runtime.drafters.testing import BigramDrafter, ModelDrafter
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.grammar import (
    Grammar,
    GrammarError,
    GrammarTokenizer,
    apply_token_bitmask,
    compute_round_masks,
)
from ignis.runtime.sampling import SamplingParams, logits_to_probs


def _load(name: str, path: Path):  # tests/*.py helpers by path (tests/ is not a package)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


TESTS = Path(__file__).resolve().parents[1]
hf_tiny = _load("hf_tiny", TESTS / "hf_tiny.py")
hf_tiny_hybrid = _load("hf_tiny_hybrid", TESTS / "hf_tiny_hybrid.py")
toy = _load("toy_executor", TESTS / "toy_executor.py")
toy_model = _load("toy_model", TESTS / "runtime" / "server" / "toy_model.py")

VOCAB = 320  # the tiny hybrids' vocabulary
EOS = 2  # tiny_tokenizer's <|im_end|>
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
MAX_TOKENS = 48


@cache
def _tokenizer():
    return hf_tiny.tiny_tokenizer(VOCAB)


@cache
def _grammar_tokenizer() -> GrammarTokenizer:
    return GrammarTokenizer(_tokenizer().backend_tokenizer.to_str(), VOCAB, [EOS])


@cache
def _schema_grammar() -> Grammar:
    return Grammar.json_schema(_grammar_tokenizer(), SCHEMA, name="record")


# ----------------------------------------------------------------------------- masks


def test_apply_token_bitmask_matches_a_per_token_loop() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word's high bits lie past the vocabulary
    words = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    got = apply_token_bitmask(logits, words)
    for r in range(3):
        for t in range(vocab):
            allowed = (int(words[r, t // 32]) >> (t % 32)) & 1
            assert (got[r, t] == logits[r, t]) if allowed else got[r, t] == float("-inf"), (r, t)
    with pytest.raises(ValueError, match="agree on n"):
        apply_token_bitmask(logits, words[:2])


def _allowed(rows: torch.Tensor) -> list[set[int]]:
    masked = apply_token_bitmask(torch.zeros(rows.shape[0], VOCAB), rows)
    return [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in masked]


def test_round_masks_equal_feeding_the_drafts_one_by_one() -> None:
    tok = _tokenizer()
    valid = tok.encode('{"name": "ab", "ok": true, "n": 7}')
    m = _schema_grammar().matcher()
    m.consume(valid[:3])
    drafts = [*valid[3:8], tok.encode("]")[0], *valid[8:10]]  # the 6th draft leaves the grammar
    rows = compute_round_masks([m], [drafts])[0]
    assert rows.shape == (len(drafts) + 1, _grammar_tokenizer().num_words)
    got = _allowed(rows)
    for j in range(6):  # rows 0..5: the state after drafts 1..j
        ref = _schema_grammar().matcher()
        ref.consume([*valid[:3], *drafts[:j]])
        assert got[j] == _allowed(compute_round_masks([ref], [[]])[0])[0], j
    assert drafts[5] not in got[5]  # the disallowed draft is masked at its row
    assert all(got[j] == set(range(VOCAB)) for j in range(6, len(drafts) + 1))  # never read
    assert got[0] == _allowed(compute_round_masks([m], [[]])[0])[0]  # the matcher did not move
    assert m.consume(valid[3:]) and m.is_accepting
    assert _allowed(compute_round_masks([m], [[]])[0])[0] == {EOS}  # complete: only EOS


def test_bad_schema_is_a_typed_error() -> None:
    with pytest.raises(GrammarError, match="json_schema 'x'"):
        Grammar.json_schema(_grammar_tokenizer(), {"type": "no-such-type"}, name="x")
    with pytest.raises(GrammarError, match="end-of-sequence"):
        GrammarTokenizer(_tokenizer().backend_tokenizer.to_str(), VOCAB, [])


# ----------------------------------------------------------------------------- greedy exactness


class Target:
    """A tiny hybrid target with a random MTP head, a random DFlash2 drafter and a draft model."""

    def __init__(self, family: str, base: Path) -> None:
        from ignis.runtime.drafters.mtp import load_mtp_checkpoint
        from ignis.runtime.families import get_family
        from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors
        from ignis.tools.make_test_drafter import make_dflash2_drafter, make_mtp_drafter

        tiny = hf_tiny_hybrid.make_tiny_hybrid(family, base / "target")
        make_mtp_drafter(tiny.folder, base / "with_mtp", seed=11)
        make_dflash2_drafter(tiny.folder, base / "dflash2", seed=12, sliding_window=8)
        self.config, self.tensors = load_mtp_checkpoint(base / "with_mtp")
        self.dflash2_dir = base / "dflash2"
        fam = get_family(self.config.model_type)
        weights = canonicalize_moe_tensors(self.config, self.tensors)
        self.ex = fam.make_executor(self.config, weights, "cpu", torch.float32)
        other = hf_tiny_hybrid.make_tiny_hybrid(family, base / "draft", seed=5)
        self.draft_ex = fam.make_executor(
            other.config, canonicalize_moe_tensors(other.config, other.tensors), "cpu", torch.float32
        )
        tok = _tokenizer()
        self.prompts = [
            tuple(tok.encode(t)) for t in ("Give me JSON:", "The quick brown fox", "0123 numbers", "ok")
        ]

    def drafter(self, kind: str):
        from ignis.runtime.drafters.dflash2 import build_dflash2_drafter
        from ignis.runtime.drafters.draft_model import build_draft_model_drafter
        from ignis.runtime.drafters.mtp import build_mtp_drafter
        from ignis.runtime.drafters.ngram import NgramDrafter
        from ignis.runtime.tokenizer import TokenizerSpec

        if kind == "ngram":
            return NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
        if kind == "draft-model":
            spec = TokenizerSpec(tokenizer_json=_tokenizer().backend_tokenizer.to_str(), eos_token_ids=(EOS,))
            return build_draft_model_drafter(
                target_tokenizer=spec, executor=self.draft_ex, tokenizer=spec, target_config=self.config
            )
        if kind == "dflash2":
            return build_dflash2_drafter(
                target_config=self.config, target_weights=self.tensors, checkpoint=self.dflash2_dir
            )
        return build_mtp_drafter(target_config=self.config, target_weights=self.tensors)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Target] = {}

    def get(family: str) -> Target:
        if family not in made:
            made[family] = Target(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=_schema_grammar(), **kw)


@cache
def _reference(target: Target, prompt: tuple[int, ...]) -> tuple[int, ...]:
    engine = SpeculativeEngine(target.ex, eos_token_ids=(EOS,))
    return engine.generate([prompt], _greedy())[0].output_token_ids


def _check_json(tokens: Sequence[int]) -> None:
    assert tokens[-1] == EOS, f"the grammar did not finish within {MAX_TOKENS} tokens: {tokens}"
    value = json.loads(_tokenizer().decode(list(tokens[:-1])))
    assert set(value) == {"name", "ok", "n"} and isinstance(value["ok"], bool), value
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 99 and len(value["name"]) <= 5, value


CASES = [
    ("qwen3_5", "ngram"),
    ("qwen3_5", "draft-model"),
    ("qwen3_5", "dflash2"),
    ("qwen3_5", "mtp"),
    ("qwen3_next", "mtp"),
]


@pytest.mark.parametrize("variant", ["plain", "steered"])
@pytest.mark.parametrize("k, num_lanes", [(1, 1), (3, 4), (7, 2)])
@pytest.mark.parametrize("family, backend", CASES, ids=[f"{f}-{b}" for f, b in CASES])
def test_greedy_spec_on_equals_spec_off_under_a_json_schema(
    targets, family: str, backend: str, k: int, num_lanes: int, variant: str
) -> None:
    target = targets(family)
    prompts = target.prompts[:num_lanes]
    refs = {p: _reference(target, p) for p in prompts}
    for ref in refs.values():
        _check_json(ref)
    drafter = target.drafter(backend)
    if variant == "steered":
        drafter = SteeredDrafter(drafter, refs, seed=k * 10 + num_lanes)
    engine = SpeculativeEngine(target.ex, drafter, draft_tokens=k, eos_token_ids=(EOS,))
    ids = {engine.add_lane(p, _greedy()): p for p in prompts}
    while engine.has_unfinished:
        engine.step()
    for lane_id, prompt in ids.items():
        got = engine.pop_result(lane_id).output_token_ids
        assert got == refs[prompt], f"{family}+{backend} {variant} k={k}: {got} != {refs[prompt]}"
    assert engine.metrics.drafted_tokens_total > 0
    if variant == "steered":
        assert engine.metrics.accepted_tokens_total > engine.metrics.rounds_total


def test_unconstrained_lanes_beside_a_constrained_one_are_untouched(targets) -> None:
    target = targets("qwen3_5")
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = SpeculativeEngine(target.ex).generate([target.prompts[1]], free)[0].output_token_ids
    engine = SpeculativeEngine(target.ex, target.drafter("mtp"), draft_tokens=3, eos_token_ids=(EOS,))
    got = engine.generate([target.prompts[0], target.prompts[1]], [_greedy(), free])
    assert got[1].output_token_ids == alone
    assert got[0].output_token_ids == _reference(target, target.prompts[0])


# ----------------------------------------------------------------------------- sampled distribution

SAMPLE_PROMPT = (4, 17)
NUM_SAMPLES = 2000
ALPHA = 1e-6
TOY_VOCAB = 50
# Four characters from a small alphabet: the toy model's top tokens are mostly outside it, so the
# mask changes the distribution a lot and unconstrained drafts are mostly rejected by it.
REGEX = r"[a-f][a-f0-3][0-3 ][a-z]"
SAMPLING = SamplingParams(temperature=1.0, max_tokens=4)


@cache
def _toy_grammar() -> Grammar:
    tok = toy_model.toy_tokenizer()
    return Grammar.regex(GrammarTokenizer.from_tokenizer(tok, TOY_VOCAB), REGEX)


@cache
def _masked_joint() -> tuple[dict[tuple[int, ...], float], torch.Tensor]:
    """P(t1, t2, t3) of the masked toy model and the marginal P(t4), enumerated (float64)."""
    ex = toy.ToyExecutor()

    def p(prefix: tuple[int, ...]) -> torch.Tensor:
        m = _toy_grammar().matcher()
        assert m.consume(prefix)
        rows = compute_round_masks([m], [[]])[0]
        logits = apply_token_bitmask(ex.next_logits([*SAMPLE_PROMPT, *prefix]).double().unsqueeze(0), rows)
        return logits_to_probs(logits[0], SAMPLING).double()

    joint: dict[tuple[int, ...], float] = {}
    t4 = torch.zeros(TOY_VOCAB, dtype=torch.float64)
    p1 = p(())
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = p((a,))
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = p((a, b))
            for c in torch.nonzero(p3).flatten().tolist():
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
                t4 += joint[(a, b, c)] * p((a, b, c))
    return joint, t4


SAMPLING_DRAFTERS = {
    "off": lambda: None,
    "model sampling its own p (unconstrained q)": lambda: ModelDrafter(toy.ToyExecutor(), mode="sample"),
    "greedy drafter (point-mass q)": lambda: ModelDrafter(toy.ToyExecutor(), mode="greedy"),
    "bigram (random q)": lambda: BigramDrafter(TOY_VOCAB, seed=9, temperature=0.5),
}


@pytest.mark.parametrize("name", list(SAMPLING_DRAFTERS))
def test_sampled_output_under_a_grammar_has_the_masked_distribution(name: str) -> None:
    drafter = SAMPLING_DRAFTERS[name]()
    engine = SpeculativeEngine(
        toy.ToyExecutor(), drafter, draft_tokens=3 if drafter else None, eos_token_ids=(0,)
    )
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, seed=20_000 + i, grammar=_toy_grammar())
        for i in range(NUM_SAMPLES)
    ]
    results = engine.generate([SAMPLE_PROMPT] * NUM_SAMPLES, params)
    joint, t4 = _masked_joint()
    counts = dict.fromkeys(joint, 0)
    fourth = torch.zeros(TOY_VOCAB)
    for r in results:
        assert len(r.output_token_ids) == 4
        head = tuple(r.output_token_ids[:3])
        assert head in counts, f"{name}: {head} is outside the grammar or has probability 0"
        counts[head] += 1
        fourth[r.output_token_ids[3]] += 1
    assert torch.all(fourth[t4 == 0] == 0)
    pv = pooled_chi2([counts[c] for c in joint], [joint[c] * NUM_SAMPLES for c in joint])
    assert pv > ALPHA, f"{name}: (t1, t2, t3) deviates from the masked model (p-value {pv:.2e})"
    pv4 = pooled_chi2(fourth[t4 > 0].tolist(), (t4[t4 > 0] * NUM_SAMPLES).tolist())
    assert pv4 > ALPHA, f"{name}: t4 deviates from the masked model (p-value {pv4:.2e})"
    if drafter is not None:
        assert engine.metrics.drafted_tokens_total > 0


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_apply_token_bitmask_on_cuda_equals_cpu() -> None:
    g = torch.Generator().manual_seed(1)
    words = torch.randint(-(2**31), 2**31 - 1, (8, 7762), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(8, 248_320, generator=g)
    ref = apply_token_bitmask(logits, words)
    got = apply_token_bitmask(logits.cuda(), words)  # the mask moves to the logits' device
    assert torch.equal(got.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_spec_on_equals_spec_off_under_a_json_schema_on_cuda(targets, k: int) -> None:
    """The grammar path with the executor, the MTP drafter and the masks' application on the GPU (the
    masks computed on the host's grammar thread while the forward runs)."""
    from ignis.runtime.drafters.mtp import build_mtp_drafter
    from ignis.runtime.families import get_family
    from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors

    target = targets("qwen3_5")
    weights = canonicalize_moe_tensors(target.config, target.tensors)
    ex = get_family(target.config.model_type).make_executor(target.config, weights, "cuda", torch.float32)
    prompts = target.prompts[:3]
    refs = [
        SpeculativeEngine(ex, eos_token_ids=(EOS,)).generate([p], _greedy())[0].output_token_ids
        for p in prompts
    ]
    for ref in refs:
        _check_json(ref)
    drafter = build_mtp_drafter(target_config=target.config, target_weights=target.tensors, device="cuda")
    steered = SteeredDrafter(drafter, dict(zip(prompts, refs, strict=True)), seed=k)
    engine = SpeculativeEngine(ex, steered, draft_tokens=k, eos_token_ids=(EOS,))
    got = [r.output_token_ids for r in engine.generate(list(prompts), _greedy())]
    assert got == refs
    assert engine.metrics.accepted_tokens_total > engine.metrics.rounds_total
