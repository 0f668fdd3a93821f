"""Greedy acceptance (table-driven) and rejection sampling (deterministic edge cases + statistics).

Statistical tests: chi-square goodness of fit (scipy) of emitted tokens against the model's p, at
significance ALPHA = 1e-6 per test. Under a correct sampler a test fails with probability <= 1e-6
(over the choice of seeds; the seeds here are fixed, so the suite is deterministic), and the whole
file holds at most 12 such tests: a false failure has probability < 1.2e-5. Power is checked too:
the same test at the same sample size rejects a sampler with a classic bug (on rejection,
resampling from p instead of the residual max(0, p - q)).
"""

import pytest
import torch
from scipy import stats

from ignis.runtime.acceptance import greedy_accept, rejection_sample


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny tensors: intra-op threads only add dispatch overhead (and the CI cores are shared)."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


ALPHA = 1e-6
NUM_TRIALS = 10_000


def chi2_pvalue(tokens, probs):
    """p-value of tokens (list of ids) ~ probs (float [vocab]); tokens outside the support fail outright."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=probs.numel()).double()
    probs = probs.double()
    assert counts[probs == 0].sum() == 0, f"tokens outside the support: {counts.tolist()} vs {probs.tolist()}"
    expected = probs * n
    big = expected >= 5
    obs = [*counts[big].tolist(), counts[~big & (probs > 0)].sum().item()]
    exp = [*expected[big].tolist(), expected[~big & (probs > 0)].sum().item()]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = torch.tensor(exp, dtype=torch.float64) * (sum(obs) / sum(exp))
    if len(obs) < 2:
        return 1.0
    return stats.chisquare(obs, exp.tolist()).pvalue


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    "drafts,targets,n",
    [
        ([], [4], 0),
        ([4, 5, 6], [4, 5, 6, 7], 3),
        ([4, 5, 6], [9, 5, 6, 7], 0),
        ([4, 5, 6], [4, 9, 6, 7], 1),
        ([4, 5, 6], [4, 5, 9, 7], 2),
        ([4, 9, 6], [4, 5, 6, 7], 1),  # a later match after a miss does not count
        ([1] * 7, [1] * 8, 7),
    ],
)
def test_greedy_accept_table(drafts, targets, n):
    res = greedy_accept(torch.tensor(drafts, dtype=torch.int64), torch.tensor(targets))
    assert res.num_accepted == n
    assert res.output_token_ids.tolist() == targets[: n + 1]
    assert res.output_token_ids.dtype == torch.int64
    assert res.bonus_token_id == targets[n]


def test_greedy_accept_shape_errors():
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept(torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="1-D"):
        greedy_accept(torch.tensor([[1]]), torch.tensor([1, 2]))


# ----------------------------------------------------------------------------- rejection sampling


def _dist(vocab, gen, zeros=()):
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, dim=0)
    p[list(zeros)] = 0
    return (p / p.sum()).float()


def test_shape_errors():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="k \\+ 1"):
        rejection_sample(torch.tensor([1]), torch.rand(1, 5), None, g)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.tensor([1]), torch.rand(2, 5), torch.rand(2, 5), g)


def test_q_equal_p_always_accepts_and_disjoint_always_rejects():
    gen = torch.Generator().manual_seed(0)
    p = torch.stack([_dist(6, gen, zeros=(3, 4, 5)) for _ in range(3)])  # support {0, 1, 2}
    off = torch.zeros(2, 6)
    off[:, 3:] = 1 / 3  # support {3, 4, 5}
    for _ in range(300):
        d = torch.multinomial(p[:2], 1, generator=gen).flatten()
        res = rejection_sample(d, p, p[:2], gen)
        assert res.num_accepted == 2 and res.output_token_ids[:2].tolist() == d.tolist()
        bad = torch.multinomial(off, 1, generator=gen).flatten()
        res = rejection_sample(bad, p, off, gen)
        assert res.num_accepted == 0 and res.output_token_ids.numel() == 1 and res.bonus_token_id in (0, 1, 2)
        res = rejection_sample(bad, p, None, gen)  # point mass outside the support: rejected too
        assert res.num_accepted == 0 and res.bonus_token_id in (0, 1, 2)


def test_point_mass_on_a_sure_token_is_accepted_and_rejection_never_repeats_the_draft():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    assert rejection_sample(torch.tensor([1]), p, None, gen).num_accepted == 1
    q = torch.tensor([[0.1, 0.8, 0.1]])
    p = torch.tensor([[0.3, 0.4, 0.3], [1 / 3] * 3])
    for _ in range(300):
        res = rejection_sample(torch.tensor([1]), p, q, gen)
        if res.num_accepted == 0:  # the residual max(0, p - q) has no mass on the rejected draft
            assert res.bonus_token_id != 1


def test_seeded_generator_reproduces():
    p = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(3)), dim=-1)
    q = torch.softmax(torch.randn(3, 9, generator=torch.Generator().manual_seed(4)), dim=-1)
    d = torch.tensor([1, 2, 3])
    a = [
        rejection_sample(d, p, q, g).output_token_ids.tolist()
        for g in [torch.Generator().manual_seed(7)] * 50
    ]
    b = [
        rejection_sample(d, p, q, g).output_token_ids.tolist()
        for g in [torch.Generator().manual_seed(7)] * 50
    ]
    assert a == b


def _broken_rejection_sample(draft_token_ids, target_probs, draft_probs, generator):
    """A classic bug, for the power check: on rejection, resample from p instead of max(0, p - q)."""
    d = int(draft_token_ids[0])
    p, q = target_probs.double(), draft_probs.double()
    if torch.rand(1, generator=generator, dtype=torch.float64).item() * q[0, d] < p[0, d]:
        return [d, int(torch.multinomial(p[1], 1, generator=generator))]
    return [int(torch.multinomial(p[0], 1, generator=generator))]


def _cases():
    gen = torch.Generator().manual_seed(2024)
    vocab = 6
    p = torch.stack([_dist(vocab, gen, zeros=z) for z in [(5,), (0, 4), (2,)]])  # [3, vocab], k = 2
    disjoint = torch.zeros(2, vocab)
    disjoint[0, 5] = 1.0
    disjoint[1, [0, 4]] = 0.5
    mixed = torch.stack([_dist(vocab, gen), _dist(vocab, gen, zeros=(1,))])
    return {
        "accept-always (q = p)": (p, p[:2].clone()),
        "reject-always (disjoint support)": (p, disjoint),
        "mixed (random q)": (p, mixed),
        "greedy drafter (point mass q)": (p, None),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_output_distribution_is_p_at_every_position(case):
    """Drafts d_i ~ q_i (or a fixed argmax for the greedy drafter); emitted token j must follow p_j.

    Token j (j >= 1) is emitted only when drafts 0..j-1 were accepted; since p_j here does not depend
    on them, its conditional law must still be p_j.
    """
    p, q = _cases()[case]
    draft_gen = torch.Generator().manual_seed(11)
    gen = torch.Generator().manual_seed(12)
    fixed = torch.tensor([int(torch.argmax(p[0] + torch.arange(6) * 0.05)), 3])  # the greedy drafter's drafts
    emitted = [[], [], []]
    for _ in range(NUM_TRIALS):
        d = fixed if q is None else torch.multinomial(q, 1, generator=draft_gen).flatten()
        res = rejection_sample(d, p, q, gen)
        for j, t in enumerate(res.output_token_ids.tolist()):
            emitted[j].append(t)
    for j in range(3):
        if case.startswith("reject"):
            assert not emitted[1]
        if len(emitted[j]) < 500:
            continue
        pv = chi2_pvalue(emitted[j], p[j])
        assert pv > ALPHA, (
            f"{case}: position {j} deviates from p (p-value {pv:.2e}, {len(emitted[j])} samples)"
        )
    if case.startswith("accept"):
        assert len(emitted[2]) == NUM_TRIALS


def test_the_chi_square_test_has_power_against_a_wrong_residual():
    p, q = _cases()["mixed (random q)"]
    draft_gen, gen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    first = []
    for _ in range(NUM_TRIALS):
        d = torch.multinomial(q, 1, generator=draft_gen).flatten()
        first.append(_broken_rejection_sample(d, p, q, gen)[0])
    assert chi2_pvalue(first, p[0]) < ALPHA


@pytest.mark.parametrize("seed", range(20))
def test_greedy_accept_ids_is_greedy_accept_on_the_host(seed: int) -> None:
    """The engine's batched form takes the same run as the tensor form: drafts always right, always
    wrong, and right by chance (a small vocabulary), k = 0..7."""
    from ignis.runtime.acceptance import greedy_accept_ids

    g = torch.Generator().manual_seed(seed)
    k = seed % 8
    target = torch.randint(0, 4, (k + 1,), generator=g)
    for drafts in (target[:k].clone(), (target[:k] + 1) % 4, torch.randint(0, 4, (k,), generator=g)):
        want = greedy_accept(drafts, target)
        run, n = greedy_accept_ids(drafts.tolist(), target.tolist())
        assert run == want.output_token_ids.tolist() and n == want.num_accepted
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept_ids([1, 2], [1, 2])
