"""Verification in isolation: forced accept / reject, and exact output distributions.

The distribution tests simulate the whole speculative loop over synthetic
context-dependent target and draft distributions (a small vocabulary, every
sequence enumerable), and compare the empirical distribution of generated
sequences with the target's exact one by a chi-square test at fixed seeds.
A negative control shows the same test rejects a verifier with a wrong residual.
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
from specdecode.verify import verify_greedy, verify_sampling

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
                    q = logits_to_probs(draft[prefix], params)
                    qs.append(q)
                    tokens.append(int(torch.multinomial(q, 1, generator=g)))
            ps = torch.stack([logits_to_probs(target[tuple(seq + tokens[:i])], params) for i in range(k + 1)])
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


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("gamma", [1, 3])
def test_speculative_sampling_matches_target_distribution(name, gamma):
    params = PARAMS[name]
    target, draft = _table(1, 1.5), _table(2, 1.5)
    counts = _simulate(target, draft, params, gamma, samples=6000, seed=10 + gamma)
    assert _chi2_pvalue(counts, _exact(target, params)) > 1e-3


@pytest.mark.parametrize("name", ["t1", "topp0.8"])
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


@pytest.mark.parametrize("broken", [_wrong_residual, _off_by_one_bonus])
def test_distribution_test_catches_broken_verifiers(broken):
    """Negative control: the same sample size rejects a verifier that is wrong."""
    params = PARAMS["t1"]
    target, draft = _table(1, 1.5), _table(2, 1.5)
    counts = _simulate(target, draft, params, 3, samples=6000, seed=13, verifier=broken)
    assert _chi2_pvalue(counts, _exact(target, params)) < 1e-3
