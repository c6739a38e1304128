"""Verification in isolation: forced accept / reject, and exact output distributions.

The distribution tests simulate the whole speculative loop over synthetic
context-dependent target and draft distributions (a small vocabulary, every
sequence enumerable), and compare the empirical distribution of generated
sequences with the target's exact one by a chi-square test at fixed seeds.
A negative control shows the same test rejects a verifier with a wrong residual.

``verify_chains`` (the engine's verifier: greedy, sampled and lookup rows of a batch in one call) is
simulated for 150,000 rows at once, which also makes its chi-square tests sharp.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from specdecode import verify
from specdecode.sampling import logits_to_probs
from specdecode.types import SamplingParams
from oracles import verify_greedy, verify_sampling

V = 4  # vocabulary
N = 3  # generated tokens per sample: V**N = 64 outcomes


def _logits(ids: torch.Tensor) -> torch.Tensor:
    """[K+1, V] logits with the argmax at the given positions."""
    logits = torch.zeros(len(ids), 6)
    logits[torch.arange(len(ids)), ids] = 5.0
    return logits


def test_greedy_accepts_matching_prefix_then_target_token():
    r = verify_greedy(torch.tensor([[1, 2, 3]]), _logits(torch.tensor([1, 2, 4, 5])).unsqueeze(0))
    assert r.num_accepted.tolist() == [2]
    assert r.new_token_ids.tolist() == [[1, 2, 4, -1]]
    assert r.kept_nodes.tolist() == [[0, 1, -1, -1]]


def test_greedy_all_accepted_gives_bonus_and_all_rejected_gives_target_token():
    all_ok = verify_greedy(torch.tensor([[1, 2]]), _logits(torch.tensor([1, 2, 5])).unsqueeze(0))
    assert all_ok.num_accepted.tolist() == [2] and all_ok.new_token_ids.tolist() == [[1, 2, 5]]
    none_ok = verify_greedy(torch.tensor([[3, 2]]), _logits(torch.tensor([1, 2, 5])).unsqueeze(0))
    assert none_ok.num_accepted.tolist() == [0] and none_ok.new_token_ids.tolist() == [[1, -1, -1]]


def test_greedy_empty_draft_is_plain_decoding():
    r = verify_greedy(torch.zeros(1, 0, dtype=torch.int64), _logits(torch.tensor([4])).unsqueeze(0))
    assert r.num_accepted.tolist() == [0] and r.new_token_ids.tolist() == [[4]]


def test_sampling_forced_accept_and_reject():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]]).reshape(1, 2, 3)
    # q == p on the draft token: always kept; then the bonus comes from p[1].
    r = verify_sampling(torch.tensor([[1]]), p[:, :1].clone(), p, [g])
    assert r.new_token_ids.tolist() == [[1, 2]]
    # p gives the draft token zero mass: always rejected; recovered from norm(max(0, p - q)).
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    r = verify_sampling(torch.tensor([[0]]), q, p, [g])
    assert r.num_accepted.tolist() == [0] and r.new_token_ids.tolist() == [[1, -1]]


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(verify.residual_distribution(p, q, 1), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(verify.residual_distribution(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    assert torch.allclose(verify.residual_distribution(p, p.clone(), 0), p)  # no mass left: falls back to p


# --- exact distribution of the whole loop ------------------------------------------------


def _table(seed: int, sharp: float) -> dict[tuple[int, ...], torch.Tensor]:
    """Random logits for every prefix of length < N + 8 (context-dependent distributions)."""
    g = torch.Generator().manual_seed(seed)
    return {
        prefix: torch.randn(V, generator=g) * sharp
        for n in range(N + 8)
        for prefix in itertools.product(range(V), repeat=n)
        if n <= N + 1
    }


def _exact(table, params: SamplingParams) -> np.ndarray:
    probs = np.zeros(V**N)
    for i, seq in enumerate(itertools.product(range(V), repeat=N)):
        pr = 1.0
        for t in range(N):
            pr *= float(logits_to_probs(table[seq[:t]], params)[seq[t]])
        probs[i] = pr
    return probs


def _simulate(target, draft, params, gamma, samples, seed, deterministic=False, verifier=verify_sampling):
    """Run the speculative loop over the synthetic tables; return counts of generated sequences."""
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V**N)
    # each prefix's processed probabilities, computed once (the loop asks for each thousands of times)
    target_p = {pre: logits_to_probs(logits, params) for pre, logits in target.items()}
    draft_p = {pre: logits_to_probs(logits, params) for pre, logits in draft.items()}
    for _ in range(samples):
        seq: list[int] = []
        while len(seq) < N:
            k = min(gamma, N - len(seq) - 1)  # as the engine: the bonus token lands inside N
            tokens, qs = [], []
            for _ in range(k):
                prefix = tuple(seq + tokens)
                if deterministic:  # a lookup-like drafter: the draft's argmax, q one-hot
                    tokens.append(int(draft[prefix].argmax()))
                else:
                    q = draft_p[prefix]
                    qs.append(q)
                    tokens.append(int(torch.multinomial(q, 1, generator=g)))
            ps = torch.stack([target_p[tuple(seq + tokens[:i])] for i in range(k + 1)])
            r = verifier(
                torch.tensor([tokens], dtype=torch.int64).reshape(1, -1),
                None if deterministic or not qs else torch.stack(qs).unsqueeze(0),
                ps.unsqueeze(0),
                [g],
            )
            n = int(r.num_accepted[0])
            seq.extend(r.new_token_ids[0, : n + 1].tolist())
        seq = seq[:N]
        counts[int(np.ravel_multi_index(seq, (V,) * N))] += 1
    return counts


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5  # pool the rare outcomes into one bin
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "topk2": SamplingParams(temperature=1.0, top_k=2),
    "topp0.8": SamplingParams(temperature=0.9, top_p=0.8),
}


@pytest.mark.parametrize("gamma, name", [  # the fast lane keeps two; the slow lane every gamma and processor
    pytest.param(g, n, marks=() if (g, n) in ((1, "t1"), (3, "topp0.8")) else pytest.mark.slow)
    for g in (1, 3) for n in PARAMS])
def test_speculative_sampling_matches_target_distribution(name, gamma):
    params = PARAMS[name]
    target, draft = _table(1, 1.5), _table(2, 1.5)
    counts = _simulate(target, draft, params, gamma, samples=6000, seed=10 + gamma)
    assert _chi2_pvalue(counts, _exact(target, params)) > 1e-3


@pytest.mark.parametrize("name", ["t1", pytest.param("topp0.8", marks=pytest.mark.slow)])
def test_deterministic_drafter_matches_target_distribution(name):
    params = PARAMS[name]
    target, draft = _table(3, 1.5), _table(4, 1.5)
    counts = _simulate(target, draft, params, 3, samples=6000, seed=5, deterministic=True)
    assert _chi2_pvalue(counts, _exact(target, params)) > 1e-3


def _wrong_residual(draft_ids, draft_probs, target_probs, generators):
    """A broken verifier: on rejection it resamples from p instead of norm(max(0, p - q))."""
    orig = verify.residual_distribution
    verify.residual_distribution = lambda p, q, tok: p
    try:
        return verify_sampling(draft_ids, draft_probs, target_probs, generators)
    finally:
        verify.residual_distribution = orig


def _off_by_one_bonus(draft_ids, draft_probs, target_probs, generators):
    """A broken verifier: when every draft token is kept, the bonus comes from p at the wrong position."""
    r = verify_sampling(draft_ids, draft_probs, target_probs, generators)
    k = draft_ids.shape[1]
    if int(r.num_accepted[0]) == k and k > 0:
        r.new_token_ids[0, k] = int(torch.multinomial(target_probs[0, k - 1], 1, generator=generators[0]))
    return r


@pytest.mark.slow  # negative controls of the test above (kept in the slow lane)
@pytest.mark.parametrize("broken", [_wrong_residual, _off_by_one_bonus])
def test_distribution_test_catches_broken_verifiers(broken):
    """Negative control: the same sample size rejects a verifier that is wrong."""
    params = PARAMS["t1"]
    target, draft = _table(1, 1.5), _table(2, 1.5)
    counts = _simulate(target, draft, params, 3, samples=6000, seed=13, verifier=broken)
    assert _chi2_pvalue(counts, _exact(target, params)) < 1e-3


# --- the engine's verifier: verify_chains, every row of a batch in one call ----------------------

N4 = 4  # generated tokens per sample here: V**4 = 256 outcomes


class _Tables:
    """The synthetic target / draft tables as [prefixes, V] tensors indexed by a prefix code."""

    def __init__(self, target, draft, params: SamplingParams, n: int) -> None:
        self.offsets = [sum(V**m for m in range(length)) for length in range(n + 1)]
        prefixes = [p for length in range(n) for p in itertools.product(range(V), repeat=length)]
        self.logits = torch.stack([target[p] for p in prefixes])  # raw: greedy rows verify on these
        self.p = logits_to_probs(self.logits, params)
        self.q = logits_to_probs(torch.stack([draft[p] for p in prefixes]), params)

    def code(self, seqs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B] prefix codes of each row's first ``lengths[i]`` tokens of ``seqs`` [B, T]."""
        t = torch.arange(seqs.shape[1])
        power = (lengths.unsqueeze(1) - 1 - t).clamp_min(0)
        digits = torch.where(t < lengths.unsqueeze(1), seqs * V**power, 0)
        return torch.tensor(self.offsets)[lengths] + digits.sum(1)


def _simulate_chains(target, draft, params, gamma, kinds: torch.Tensor, seed: int, claimed_q=None) -> torch.Tensor:
    """The speculative loop for every row at once through ``verify.verify_chains``.

    ``kinds`` [B]: 0 = sampled draft with q, 1 = deterministic draft (q's argmax, one-hot), 2 = greedy row.
    ``claimed_q``: a broken caller's q (a function of the true [b, V] q), handed to the verifier instead
    of the one the tokens were drawn from.

    Returns:
        [B, N4] int64 generated sequences.
    """
    tables = _Tables(target, draft, params, N4)
    g = torch.Generator().manual_seed(seed)
    b = kinds.shape[0]
    seqs = torch.zeros(b, N4 + gamma + 1, dtype=torch.int64)
    lengths = torch.zeros(b, dtype=torch.int64)
    greedy = kinds == 2
    while bool((lengths < N4).any()):
        rows = torch.nonzero(lengths < N4).squeeze(1)
        n, seq, kind = lengths[rows], seqs[rows], kinds[rows]
        k = (N4 - n - 1).clamp(max=gamma)  # as the engine: the bonus token lands inside N4
        big_k = int(k.max())
        ids = torch.full((len(rows), big_k), -1, dtype=torch.int64)
        q = torch.zeros(len(rows), big_k, V)
        p = torch.zeros(len(rows), big_k + 1, V)
        for j in range(big_k + 1):
            live = j <= k
            codes = tables.code(seq, (n + j).clamp(max=N4 - 1))  # rows past their k_i: any valid prefix
            p[:, j] = torch.where(greedy[rows].unsqueeze(1), tables.logits[codes], tables.p[codes]) * live.unsqueeze(1)
            if j == big_k:
                break
            drafting = j < k
            qj = tables.q[codes]
            tok = torch.where(kind == 0, torch.multinomial(qj, 1, generator=g).squeeze(1), qj.argmax(-1))
            tok = torch.where(drafting, tok, -1)
            ids[:, j] = tok
            seq[torch.arange(len(rows)), n + j] = tok.clamp_min(0)
            used = qj if claimed_q is None else claimed_q(qj)
            q[:, j] = torch.where((drafting & (kind == 0)).unsqueeze(1), used, 0.0)
        uniforms = torch.rand(len(rows), big_k + 1, generator=g, dtype=torch.float64)
        r = verify.verify_chains(ids, k, q, p, greedy[rows], uniforms)
        new = r.new_token_ids  # [b, K+1], PAD after num_accepted + 1
        cols = n.unsqueeze(1) + torch.arange(new.shape[1])
        keep = new >= 0
        seq[torch.arange(len(rows)).unsqueeze(1).expand_as(new)[keep], cols[keep]] = new[keep]
        seqs[rows] = seq
        lengths[rows] = n + r.num_accepted + 1
    return seqs[:, :N4]


def _exact_n(table, params: SamplingParams, n: int) -> np.ndarray:
    probs = np.zeros(V**n)
    for i, seq in enumerate(itertools.product(range(V), repeat=n)):
        pr = 1.0
        for t in range(n):
            pr *= float(logits_to_probs(table[seq[:t]], params)[seq[t]])
        probs[i] = pr
    return probs


def _counts(seqs: torch.Tensor) -> np.ndarray:
    flat = np.ravel_multi_index(seqs.T.numpy(), (V,) * N4)
    return np.bincount(flat, minlength=V**N4).astype(float)


@pytest.mark.parametrize("name", ["t1", "topk2", "topp0.8"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_verify_chains_matches_the_target_distribution_on_100k_rows(name, gamma):
    """100,000 sampled rows with q, 50,000 with a deterministic draft and 1,000 greedy rows, all in the same
    verify_chains calls: each sampled kind follows the target's exact 4-token joint (chi-square), and
    every greedy row is the target's greedy sequence."""
    params = PARAMS[name]
    target, draft = _table(1, 1.5), _table(2, 1.5)
    kinds = torch.cat([torch.zeros(100_000), torch.ones(50_000), torch.full((1_000,), 2)]).long()
    kinds = kinds[torch.randperm(len(kinds), generator=torch.Generator().manual_seed(0))]  # interleaved rows
    seqs = _simulate_chains(target, draft, params, gamma, kinds, seed=20 + gamma)
    exact = _exact_n(target, params, N4)
    assert _chi2_pvalue(_counts(seqs[kinds == 0]), exact) > 1e-3
    assert _chi2_pvalue(_counts(seqs[kinds == 1]), exact) > 1e-3
    greedy_seq = []
    for _ in range(N4):
        greedy_seq.append(int(target[tuple(greedy_seq)].argmax()))
    assert (seqs[kinds == 2] == torch.tensor(greedy_seq)).all()


CLAIMS = {
    "uniform-q": lambda q: torch.full_like(q, 1.0 / V),
    "sharpened-q": lambda q: q**2 / (q**2).sum(-1, keepdim=True),
}


@pytest.mark.parametrize("broken", list(CLAIMS))
def test_verify_chains_distribution_test_catches_a_wrong_q(broken):
    """Negative controls at the same size: the verifier told a q other than the one the tokens came from
    (uniform, or sharpened) gives a detectably wrong joint. (A sampled token verified as a lookup's,
    q one-hot, is *not* wrong: that rule is exact for any draft drawn independently of the verifier.)"""
    params = PARAMS["t1"]
    target, draft = _table(1, 1.5), _table(2, 1.5)
    kinds = torch.zeros(100_000, dtype=torch.int64)
    seqs = _simulate_chains(target, draft, params, 3, kinds, seed=7, claimed_q=CLAIMS[broken])
    assert _chi2_pvalue(_counts(seqs), _exact_n(target, params, N4)) < 1e-3


def test_verify_chains_consumes_k_plus_one_uniforms_per_row():
    """A row's result depends on its own first k_i + 1 uniforms only (not on the batch around it)."""
    g = torch.Generator().manual_seed(0)
    b, k = 6, 4
    p = torch.softmax(torch.randn(b, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(b, k, V, generator=g), -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(b, k)
    counts = torch.tensor([0, 1, 2, 3, 4, 2])
    ids = torch.where(torch.arange(k) < counts.unsqueeze(1), ids, -1)
    greedy = torch.tensor([False, False, True, False, False, False])
    u = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    together = verify.verify_chains(ids, counts, q, p, greedy, u)
    for i in range(b):
        c = int(counts[i])
        noisy = u[i : i + 1].clone()
        noisy[0, c + 1 :] = 0.999  # uniforms past the row's k_i + 1 are never read
        alone = verify.verify_chains(ids[i : i + 1, :c], counts[i : i + 1], q[i : i + 1, :c], p[i : i + 1, : c + 1],
                                     greedy[i : i + 1], noisy[:, : c + 1])
        assert alone.num_accepted.item() == together.num_accepted[i].item()
        assert alone.new_token_ids[0].tolist() == together.new_token_ids[i, : c + 1].tolist()


def test_greedy_rows_verify_alike_whatever_the_score_dtype():
    """verify_chains' one greedy rule gives the same result on float32 scores (numpy's argmax) and float64 ones
    (torch's): ragged drafts with PAD, no draft, every draft kept, the first rejected, tied scores."""
    gen = torch.Generator().manual_seed(1)
    for b, k, v in ((1, 0, 50), (1, 5, 50), (3, 4, 7), (4, 6, 3)):
        for trial in range(20):
            scores = torch.randint(0, 3, (b, k + 1, v), generator=gen).float()
            best = scores.argmax(-1)
            drafts = torch.where(torch.rand(b, k, generator=gen) < 0.7, best[:, :k], torch.randint(0, v, (b, k), generator=gen))
            drafted = torch.randint(0, k + 1, (b,), generator=gen)
            drafts = torch.where(torch.arange(k)[None, :] < drafted[:, None], drafts, torch.full_like(drafts, -1))
            uniforms = torch.rand(b, k + 1, generator=gen, dtype=torch.float64)
            greedy = torch.ones(b, dtype=torch.bool)
            fast = verify.verify_chains(drafts, drafted, None, scores, greedy, uniforms)
            slow = verify.verify_chains(drafts, drafted, None, scores.double(), greedy, uniforms)
            for name in ("num_accepted", "new_token_ids", "kept_nodes"):
                a, c = getattr(fast, name), getattr(slow, name)
                assert a.dtype == c.dtype and torch.equal(a, c), (b, k, trial, name)


def test_a_greedy_row_verifies_the_same_beside_sampled_rows_as_in_an_all_greedy_batch():
    """The greedy rows of a mixed batch (greedy and sampled rows) keep the drafts and get the next token that the
    same rows get in a batch of greedy rows only (one greedy rule for both, verify._greedy_accepted), and that the
    row-at-a-time oracle gives them."""
    gen = torch.Generator().manual_seed(2)
    for b, k, v in ((2, 0, 20), (3, 4, 7), (5, 6, 3)):
        for trial in range(20):
            p = torch.softmax(torch.randn(b, k + 1, v, generator=gen) * 3, -1)
            best = p.argmax(-1)
            drafts = torch.where(torch.rand(b, k, generator=gen) < 0.7, best[:, :k], torch.randint(0, v, (b, k), generator=gen))
            drafted = torch.randint(0, k + 1, (b,), generator=gen)
            drafts = torch.where(torch.arange(k)[None, :] < drafted[:, None], drafts, torch.full_like(drafts, -1))
            uniforms = torch.rand(b, k + 1, generator=gen, dtype=torch.float64)
            mixed = torch.arange(b) % 2 == 0  # rows 0, 2, 4 greedy; the others sampled
            together = verify.verify_chains(drafts, drafted, None, p, mixed, uniforms)
            rows = mixed.nonzero().squeeze(1)
            alone = verify.verify_chains(drafts[rows], drafted[rows], None, p[rows], torch.ones(len(rows), dtype=torch.bool),
                                         uniforms[rows])
            assert torch.equal(together.num_accepted[rows], alone.num_accepted), (b, k, trial)
            assert torch.equal(together.new_token_ids[rows], alone.new_token_ids), (b, k, trial)
            assert torch.equal(together.kept_nodes[rows], alone.kept_nodes), (b, k, trial)
            reference = verify_greedy(drafts[rows], p[rows])  # its own argmax and cumprod; PAD never matches
            assert torch.equal(together.num_accepted[rows], reference.num_accepted), (b, k, trial)
            assert torch.equal(together.new_token_ids[rows], reference.new_token_ids), (b, k, trial)


def test_greedy_chain_results_are_verify_chains_on_all_greedy_rows():
    """The engine's path for batches of plain greedy rows gives, row by row, what verify_chains gives the same batch:
    random drafts of 0..5 tokens, some copying the target's argmax for a while, ties in the logits."""
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        b, v = int(torch.randint(1, 5, (1,), generator=g)), 7
        counts = torch.randint(0, 6, (b,), generator=g)
        k = int(counts.max())
        logits = torch.randint(0, 3, (b, k + 1, v), generator=g).float()  # small integers: ties
        best = logits.argmax(-1)
        ids = torch.full((b, k), -1, dtype=torch.int64)
        for i in range(b):
            n = int(counts[i])
            copy = int(torch.randint(0, n + 1, (1,), generator=g))
            ids[i, :n] = torch.randint(0, v, (n,), generator=g)
            ids[i, :copy] = best[i, :copy]
        want = verify.verify_chains(ids, counts, None, logits, torch.ones(b, dtype=torch.bool),
                                    torch.zeros(b, k + 1, dtype=torch.float64))
        got = verify.greedy_chain_results(ids.numpy(), counts.numpy(), logits)
        for i in range(b):
            n = int(counts[i])
            assert int(got[i].num_accepted[0]) == int(want.num_accepted[i])
            assert torch.equal(got[i].new_token_ids[0], want.new_token_ids[i, : n + 1])
            assert torch.equal(got[i].kept_nodes[0], want.kept_nodes[i, : n + 1])
