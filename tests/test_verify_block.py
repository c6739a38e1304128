"""Block verification (Sun et al. 2024, Algorithm 2): exact output distributions, acceptance, edges, the engine.

The exact tests run the whole speculative loop over a tiny Markov "model" (a vocabulary of 3, target and
draft distributions that depend on the last token, every probability a multiple of 1/256 so float32 holds
it exactly) and compute the probability of every 4-token output *exactly*: for every draft, the unit cube
of the uniforms is cut into cells at every threshold either verifier can use, the verifier under test is
called once at each cell's midpoint, and each outcome gets its cell's volume. Whatever the verifier
computes inside is therefore what is measured; the cells only need to be fine enough. The result must
equal the target's own sequence distribution to 1e-9; deliberately broken variants must miss it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from specdecode import verify
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import DraftModelProposer, NgramProposer
from specdecode.types import SamplingParams
from tiny import chi2_pvalue, exact_joint3, tiny_llama

V = 3  # vocabulary of the Markov models
N = 4  # tokens per output sequence: V**N = 81 outcomes
PROMPT_LAST = 0  # the token before the first generated one


def _markov(seed: int, sharp: float = 1.5) -> np.ndarray:
    """[V, V] float64 rows p(. | last token), each entry a multiple of 1/256 (exact in float32, rows sum to 1)."""
    g = np.random.default_rng(seed)
    rows = []
    for _ in range(V):
        w = np.exp(g.normal(size=V) * sharp)
        rows.append(g.multinomial(256, w / w.sum()) / 256)
    return np.array(rows)


# --------------------------------------------------------------------------- the algorithm, one draft, float64


def _thresholds(x, ps, qs, variant: str = "block") -> tuple[list[float], list[float]]:
    """Per-position thresholds [k] and weights [k+1] of one draft ``x`` (ps [k+1, V], qs [k, V] its p and q).

    variant "block": Algorithm 2's h_i; "token": min(1, p/q) (kept while eta_i < a_i, first rejection
    stops); "weights-as-h" (broken): h_i = w_i at every position.
    """
    k = len(x)
    w = [1.0]
    for i in range(k):
        p, q = ps[i][x[i]], qs[i][x[i]]
        w.append(min(1.0, w[-1] * p / q) if q > 0 else (1.0 if p > 0 else 0.0))
    if variant == "token":
        return [min(1.0, ps[i][x[i]] / qs[i][x[i]]) for i in range(k)], w
    if variant == "weights-as-h":
        return w[1:], w
    h = []
    for i in range(1, k):
        s = float(np.maximum(0.0, w[i] * ps[i] - qs[i]).sum())
        d = s + 1.0 - w[i]
        h.append(s / d if d > 0 else 1.0)
    return h + [w[k]] if k else [], w


def _final(ps, qs, w, tau: int, weighted: bool = True) -> np.ndarray:
    """[V] the distribution the round's last token is drawn from after keeping ``tau`` of k tokens."""
    if tau == len(qs):
        return ps[tau]
    cut = np.maximum(0.0, (w[tau] if weighted else 1.0) * ps[tau] - qs[tau])
    return cut / cut.sum() if cut.sum() > 1e-12 else ps[tau]


def _drafts(Q, prev: int, k: int, deterministic: bool):
    """(tokens, probability, qs [k, V], context) for every k-token draft after ``prev`` with nonzero probability.

    A deterministic draft is Q's argmax chain with q one-hot on it (handed to verifiers as zeros).
    """
    if deterministic:
        x, c = [], prev
        for _ in range(k):
            c = int(np.argmax(Q[c]))
            x.append(c)
        candidates = [(tuple(x), 1.0)]
    else:
        candidates = []
        for x in itertools.product(range(V), repeat=k):
            ctx = (prev,) + x
            pr = math.prod(Q[ctx[i], x[i]] for i in range(k))
            if pr > 0:
                candidates.append((x, pr))
    for x, pr in candidates:
        ctx = (prev,) + x
        qs = np.eye(V)[list(x)] if deterministic else Q[list(ctx[:-1])]
        yield x, pr, qs.reshape(k, V), ctx


def _round_analytic(P, Q, prev: int, k: int, deterministic: bool, variant: str = "block",
                    weighted: bool = True) -> dict[tuple[int, ...], float]:
    """Exact distribution of one round's committed tokens, integrating over the uniforms by formula:
    block rules keep the *largest* i with eta_i < h_i (P(tau = i) = h_i prod_{j>i} (1 - h_j)); token
    rules stop at the first eta_i >= a_i."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for x, pr, qs, ctx in _drafts(Q, prev, k, deterministic):
        ps = P[list(ctx)]
        h, w = _thresholds(x, ps, qs, variant)
        for tau in range(k + 1):
            if variant == "token":
                pt = math.prod(h[:tau]) * ((1.0 - h[tau]) if tau < k else 1.0)
            else:
                pt = (h[tau - 1] if tau else 1.0) * math.prod(1.0 - hj for hj in h[tau:])
            if pt > 0:
                for y, py in enumerate(_final(ps, qs, w, tau, weighted and variant != "token")):
                    out[x[:tau] + (y,)] += pr * pt * py
    return out


def _cells(breaks) -> list[tuple[float, float]]:
    """(midpoint, width) of the pieces of [0, 1) cut at ``breaks``."""
    edges = [0.0] + sorted({b for b in breaks if 0.0 < b < 1.0}) + [1.0]
    return [((a + b) / 2, b - a) for a, b in zip(edges, edges[1:]) if b > a]


def _cdf_breaks(dists) -> list[float]:
    return [c for d in dists for c in np.cumsum(d)[:-1]]


def _round_cells(verifier, P, Q, prev: int, k: int, deterministic: bool,
                 q_none: bool = False) -> dict[tuple[int, ...], float]:
    """Exact distribution of one round's committed tokens from ``verifier`` itself, by case splits.

    ``verifier(draft_ids, num_drafted, draft_probs, target_probs, uniforms) -> VerifyResult``. Every
    uniform eta_i is split at the block and the token thresholds of its position, the last uniform at the
    CDF steps of every distribution the last token may come from (p, the block residual, the plain
    residual); the verifier runs at each cell's midpoint. ``q_none`` hands a deterministic draft's q
    as None rather than zeros.
    """
    rows = []  # (x, weight, etas, ps, qs)
    for x, pr, qs, ctx in _drafts(Q, prev, k, deterministic):
        ps = P[list(ctx)]
        hb, _ = _thresholds(x, ps, qs, "block")
        ht, _ = _thresholds(x, ps, qs, "token")
        for combo in itertools.product(*[_cells([hb[i], ht[i]]) for i in range(k)]):
            rows.append((x, pr * math.prod(c[1] for c in combo), [c[0] for c in combo], ps, qs))

    def call(batch, u_last):
        r = len(batch)
        ids = torch.tensor([row[0] for row in batch], dtype=torch.int64).reshape(r, k)
        p = torch.tensor(np.stack([row[3] for row in batch]), dtype=torch.float32)
        q = None if deterministic and q_none else torch.tensor(
            np.stack([np.zeros((k, V)) if deterministic else row[4] for row in batch]), dtype=torch.float32)
        u = torch.tensor([row[2] + [ul] for row, ul in zip(batch, u_last)], dtype=torch.float64).reshape(r, k + 1)
        return verifier(ids, torch.full((r,), k, dtype=torch.int64), q, p, u)

    taus = call(rows, [0.5] * len(rows)).num_accepted.tolist()  # tau does not depend on the last uniform
    split, u_last = [], []
    for row, tau in zip(rows, taus):
        x, weight, _, ps, qs = row
        _, w = _thresholds(x, ps, qs, "block")
        dists = [ps[tau]] + ([_final(ps, qs, w, tau, True), _final(ps, qs, w, tau, False)] if tau < k else [])
        for mid, width in _cells(_cdf_breaks(dists)):
            split.append((row, weight * width))
            u_last.append(mid)
    res = call([s[0] for s in split], u_last)
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for (row, weight), n, new in zip(split, res.num_accepted.tolist(), res.new_token_ids.tolist()):
        out[tuple(new[: n + 1])] += weight
    return out


def _sequences(round_fn, gamma: int) -> np.ndarray:
    """[V**N] exact probability of every N-token output of repeated rounds (``round_fn(prev, k)``), each round
    drafting min(gamma, tokens left - 1) tokens as the engine does."""
    cache: dict[tuple[int, int], dict] = {}
    live, done = {(): 1.0}, np.zeros(V**N)
    while live:
        grown: dict[tuple[int, ...], float] = defaultdict(float)
        for seq, pr in live.items():
            key = (seq[-1] if seq else PROMPT_LAST, min(gamma, N - len(seq) - 1))
            if key not in cache:
                cache[key] = round_fn(*key)
            for tokens, po in cache[key].items():
                s = (seq + tokens)[:N]
                if len(s) == N:
                    done[np.ravel_multi_index(s, (V,) * N)] += pr * po
                else:
                    grown[s] += pr * po
        live = grown
    return done


def _target(P) -> np.ndarray:
    out = np.zeros(V**N)
    for seq in itertools.product(range(V), repeat=N):
        ctx = (PROMPT_LAST,) + seq
        out[np.ravel_multi_index(seq, (V,) * N)] = math.prod(P[ctx[i], seq[i]] for i in range(N))
    return out


def _block(ids, counts, q, p, u):
    return verify.verify_block(ids, counts, q, p, u)


def _token(ids, counts, q, p, u):
    return verify.verify_chains(ids, counts, q, p, torch.zeros(len(ids), dtype=torch.bool), u)


def _unweighted_residual(ids, counts, q, p, u):
    """Broken: block verification's tau, but the last token after a stop drawn from norm(max(0, p - q))."""
    r = verify.verify_block(ids, counts, q, p, u)
    stop = r.num_accepted < counts
    for i in torch.nonzero(stop).squeeze(1).tolist():  # the plain residual at tau, with the same last uniform
        n = int(r.num_accepted[i])
        qi = torch.nn.functional.one_hot(ids[i, n], p.shape[-1]).float() if q is None or q[i, n].sum() == 0 else q[i, n]
        cdf = (p[i, n] - qi).clamp_min(0).double().cumsum(0)
        y = int(torch.searchsorted(cdf, u[i, int(counts[i])] * cdf[-1], right=True).clamp(max=p.shape[-1] - 1))
        r.new_token_ids[i, n] = y
    return r


SEEDS = [(1, 2), (3, 4), (5, 6)]  # (target, draft) Markov seeds


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("seeds", SEEDS)
def test_block_output_distribution_is_exactly_the_targets(gamma, seeds):
    P, Q = _markov(seeds[0]), _markov(seeds[1])
    got = _sequences(lambda prev, k: _round_cells(_block, P, Q, prev, k, False), gamma)
    np.testing.assert_allclose(got, _target(P), atol=1e-9, rtol=0)
    formula = _sequences(lambda prev, k: _round_analytic(P, Q, prev, k, False), gamma)
    np.testing.assert_allclose(formula, _target(P), atol=1e-12, rtol=0)


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("q_none", [False, True])
def test_block_with_deterministic_drafts_is_exactly_the_targets(gamma, q_none):
    """One-hot q (a lookup drafter), handed to the verifier as zeros or as None."""
    for seeds in SEEDS:
        P, Q = _markov(seeds[0]), _markov(seeds[1], sharp=0.5)
        got = _sequences(lambda prev, k: _round_cells(_block, P, Q, prev, k, True, q_none), gamma)
        np.testing.assert_allclose(got, _target(P), atol=1e-9, rtol=0)


def test_the_exact_check_passes_token_verification_too():
    """The harness is not tuned to block verification: verify_chains passes the same check."""
    P, Q = _markov(1), _markov(2)
    got = _sequences(lambda prev, k: _round_cells(_token, P, Q, prev, k, False), 3)
    np.testing.assert_allclose(got, _target(P), atol=1e-9, rtol=0)


@pytest.mark.parametrize("broken", ["unweighted-residual", "weights-as-h", "unweighted-residual-formula"])
def test_the_exact_check_catches_broken_block_variants(broken):
    """Negative controls: the residual norm(max(0, p - q)) in place of the weighted one (through the cells
    with verify_block's own tau, and by formula), and thresholds h_i = w_i, all miss the target's distribution."""
    P, Q = _markov(1), _markov(2)
    if broken == "unweighted-residual":
        got = _sequences(lambda prev, k: _round_cells(_unweighted_residual, P, Q, prev, k, False), 3)
    elif broken == "weights-as-h":
        got = _sequences(lambda prev, k: _round_analytic(P, Q, prev, k, False, "weights-as-h"), 3)
    else:
        got = _sequences(lambda prev, k: _round_analytic(P, Q, prev, k, False, "block", weighted=False), 3)
    assert np.abs(got - _target(P)).sum() > 5e-3  # L1 distance: millions of times the 1e-9 the check allows


# --------------------------------------------------------------------------- accepted length


def _expected_accepted(dist: dict[tuple[int, ...], float]) -> float:
    return sum((len(t) - 1) * pr for t, pr in dist.items())


def test_paper_example_block_keeps_11_9_tokens_against_10_9():
    """Sun et al. 2024, Section 2: context-free p = (1/3, 2/3), q = (2/3, 1/3), gamma 2."""
    P = np.tile([1 / 3, 2 / 3, 0.0], (V, 1))
    Q = np.tile([2 / 3, 1 / 3, 0.0], (V, 1))
    block = _expected_accepted(_round_cells(_block, P, Q, 0, 2, False))
    token = _expected_accepted(_round_cells(_token, P, Q, 0, 2, False))
    assert block == pytest.approx(11 / 9, abs=1e-6) and token == pytest.approx(10 / 9, abs=1e-6)


def test_block_keeps_at_least_as_many_tokens_as_token_verification():
    """Exact E[accepted] per round, every state and k in 1..3 over several random p / q: block >= token,
    equal at k = 1, and strictly more somewhere."""
    gains = []
    for seed in range(6):
        P, Q = _markov(10 + seed), _markov(20 + seed, sharp=0.8)
        for prev, k in itertools.product(range(V), [1, 2, 3]):
            block = _expected_accepted(_round_cells(_block, P, Q, prev, k, False))
            token = _expected_accepted(_round_cells(_token, P, Q, prev, k, False))
            assert block >= token - 1e-9
            if k == 1:
                assert block == pytest.approx(token, abs=1e-9)
            gains.append(block - token)
    assert max(gains) > 1e-2


def test_deterministic_drafts_gain_nothing_from_block_verification():
    """With q one-hot no verifier keeps X_1..X_i more often than the target produces them, w_i = prod p_j(X_j),
    and token verification already keeps them exactly that often: the two are equal in expectation."""
    for seed in range(6):
        P, Q = _markov(10 + seed), _markov(20 + seed, sharp=0.8)
        for prev, k in itertools.product(range(V), [1, 2, 3]):
            block = _expected_accepted(_round_cells(_block, P, Q, prev, k, True))
            token = _expected_accepted(_round_cells(_token, P, Q, prev, k, True))
            assert block == pytest.approx(token, abs=1e-9)


# --------------------------------------------------------------------------- sampled, gamma 8


def _simulate(P, Q, gamma: int, rows: int, n: int, seed: int, deterministic: torch.Tensor) -> torch.Tensor:
    """The loop for ``rows`` rows at once through verify_block, k = gamma every round (a round may run past
    ``n``; the first n tokens are kept). Returns [rows, n] int64."""
    g = torch.Generator().manual_seed(seed)
    Pt, Qt = torch.tensor(P, dtype=torch.float32), torch.tensor(Q, dtype=torch.float32)
    seqs = torch.zeros(rows, n + gamma + 1, dtype=torch.int64)
    lengths = torch.zeros(rows, dtype=torch.int64)
    while bool((lengths < n).any()):
        live = torch.nonzero(lengths < n).squeeze(1)
        b, det = len(live), deterministic[live]
        last = torch.where(lengths[live] > 0, seqs[live, (lengths[live] - 1).clamp_min(0)], PROMPT_LAST)
        ids = torch.zeros(b, gamma, dtype=torch.int64)
        q = torch.zeros(b, gamma, V)
        p = torch.zeros(b, gamma + 1, V)
        for j in range(gamma + 1):
            p[:, j] = Pt[last]
            if j == gamma:
                break
            qj = Qt[last]
            tok = torch.where(det, qj.argmax(-1), torch.multinomial(qj, 1, generator=g).squeeze(1))
            ids[:, j] = tok
            q[:, j] = torch.where(det.unsqueeze(1), 0.0, qj)
            last = tok
        u = torch.rand(b, gamma + 1, generator=g, dtype=torch.float64)
        r = verify.verify_block(ids, torch.full((b,), gamma, dtype=torch.int64), q, p, u)
        for i in range(gamma + 1):
            put = i <= r.num_accepted
            at = (lengths[live] + i).clamp(max=seqs.shape[1] - 1)
            rows_i = live[put]
            seqs[rows_i, at[put]] = r.new_token_ids[put, i]
        lengths[live] += r.num_accepted + 1
    return seqs[:, :n]


def test_block_gamma_8_sampled_matches_the_target_by_chi_square():
    """60,000 rows (half sampled drafts with q, half deterministic drafts) through verify_block with k = 8:
    the first 5 tokens follow the target's exact joint."""
    n = 5
    P, Q = _markov(1, sharp=1.0), _markov(2, sharp=1.0)
    det = torch.arange(60_000) % 2 == 1
    seqs = _simulate(P, Q, 8, 60_000, n, seed=0, deterministic=det)
    exact = np.zeros(V**n)
    for seq in itertools.product(range(V), repeat=n):
        ctx = (PROMPT_LAST,) + seq
        exact[np.ravel_multi_index(seq, (V,) * n)] = math.prod(P[ctx[i], seq[i]] for i in range(n))
    for part in (seqs[~det], seqs[det]):
        counts = np.bincount(np.ravel_multi_index(part.T.numpy(), (V,) * n), minlength=V**n)
        assert chi2_pvalue(counts, exact) > 1e-3


# --------------------------------------------------------------------------- edge cases


def _reference_row(x, ps, qs, us) -> tuple[int, int]:
    """(tau, next token) of Algorithm 2 for one row in float64 (qs rows of zeros: one-hot on the token)."""
    k = len(x)
    qs = np.array([qs[i] if qs[i].sum() > 0 else np.eye(ps.shape[1])[x[i]] for i in range(k)]).reshape(k, ps.shape[1])
    h, w = _thresholds(x, ps, qs, "block")
    tau = max([i + 1 for i in range(k) if us[i] < h[i]], default=0)
    cdf = np.cumsum(_final(ps, qs, w, tau))
    return tau, min(int(np.searchsorted(cdf, us[k] * cdf[-1], side="right")), ps.shape[1] - 1)


def test_batched_rows_of_different_lengths_match_a_row_at_a_time_reference():
    """A batch of 48 rows, V = 500, k_i in 0..6 (PAD past each), a third of the rows deterministic: every row
    equals Algorithm 2 computed alone in float64, and ignores uniforms past its k_i + 1."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 48, 6, 500
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 3, -1)
    q = 0.5 * q + 0.5 * p[:, :k]  # some agreement, so long blocks are kept
    ids = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(b, k)
    counts = torch.arange(b) % (k + 1)
    ids = torch.where(torch.arange(k) < counts.unsqueeze(1), ids, -1)
    q[torch.arange(b) % 3 == 0] = 0.0
    u = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    res = verify.verify_block(ids, counts, q, p, u)
    taus = []
    for i in range(b):
        c = int(counts[i])
        tau, y = _reference_row(ids[i, :c].tolist(), p[i, : c + 1].double().numpy(), q[i, :c].double().numpy(),
                                u[i].tolist())
        taus.append(tau)
        assert int(res.num_accepted[i]) == tau
        assert res.new_token_ids[i].tolist() == ids[i, :tau].tolist() + [y] + [-1] * (k - tau)
        noisy = u[i : i + 1].clone()
        noisy[0, c + 1 :] = 0.999
        alone = verify.verify_block(ids[i : i + 1, :c], counts[i : i + 1], q[i : i + 1, :c], p[i : i + 1, : c + 1],
                                    noisy[:, : c + 1])
        assert alone.new_token_ids[0].tolist() == res.new_token_ids[i, : c + 1].tolist()
    assert len(set(taus)) > 3  # the batch exercised many stopping points


def test_consumes_exactly_k_plus_one_uniforms_and_the_last_picks_the_token():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]])
    q = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])  # q == p: both kept whatever eta
    ids = torch.tensor([[1, 2]])
    for last, want in [(0.05, 0), (0.15, 1), (0.5, 2)]:
        u = torch.tensor([[0.99, 0.99, last]], dtype=torch.float64)
        r = verify.verify_block(ids, torch.tensor([2]), q, p, u)
        assert r.num_accepted.tolist() == [2] and r.new_token_ids.tolist() == [[1, 2, want]]
    # k_i = 1 in a K = 2 batch: the row's second uniform picks the token, the third is never read
    ids1 = torch.tensor([[1, -1]])
    for third in (0.0, 0.7, 0.999):
        r = verify.verify_block(ids1, torch.tensor([1]), q, p, torch.tensor([[0.99, 0.5, third]], dtype=torch.float64))
        assert r.new_token_ids.tolist() == [[1, 1, -1]]  # p_1 = (0.2, 0.3, 0.5) at 0.5: token 1


def test_empty_drafts_sample_from_the_first_distribution():
    p = torch.tensor([[[0.2, 0.5, 0.3]]]).expand(3, 1, 3).contiguous()
    u = torch.tensor([[0.1], [0.5], [0.95]], dtype=torch.float64)
    r = verify.verify_block(torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), None, p, u)
    assert r.num_accepted.tolist() == [0, 0, 0] and r.new_token_ids.tolist() == [[0], [1], [2]]
    # k_i = 0 beside k_i = 2 in one batch
    p2 = torch.tensor([[[0.2, 0.5, 0.3], [0.3, 0.3, 0.4], [1.0, 0.0, 0.0]]]).expand(2, 3, 3).contiguous()
    q2 = torch.zeros(2, 2, 3)
    q2[1] = p2[1, :2]
    r = verify.verify_block(torch.tensor([[-1, -1], [1, 2]]), torch.tensor([0, 2]), q2, p2,
                            torch.tensor([[0.5, 0.9, 0.9], [0.9, 0.9, 0.5]], dtype=torch.float64))
    assert r.num_accepted.tolist() == [0, 2] and r.new_token_ids.tolist() == [[1, -1, -1], [1, 2, 0]]


def test_drafts_where_p_has_no_mass_are_all_rejected():
    """q puts every draft token where p has none: w = 0 everywhere, nothing kept whatever the uniforms,
    and the token comes from norm(max(0, p_1 - q_1))."""
    p = torch.tensor([[[0.0, 0.4, 0.6], [0.0, 0.5, 0.5], [0.3, 0.3, 0.4]]])
    q = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    for u0 in (0.0, 0.3, 0.999):
        for last, want in [(0.1, 1), (0.9, 2)]:
            r = verify.verify_block(torch.tensor([[0, 0]]), torch.tensor([2]), q, p,
                                    torch.tensor([[u0, u0, last]], dtype=torch.float64))
            assert r.num_accepted.tolist() == [0] and r.new_token_ids.tolist() == [[want, -1, -1]]


def test_a_token_q_gave_no_mass_has_ratio_one_and_no_nan():
    """q(X) = 0 < p(X): kept as token level keeps it (u q < p); after w = 0 such a token stays at w = 0."""
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    r = verify.verify_block(torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[[1.0, 0.0, 0.0]]]), p,
                            torch.tensor([[0.999, 0.5]], dtype=torch.float64))
    assert r.new_token_ids.tolist() == [[1, 1]]
    p2 = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    q2 = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    h, w = verify.block_stop_probabilities(torch.tensor([[0, 1]]), torch.tensor([2]), q2, p2)
    assert w.tolist() == [[1.0, 0.0, 0.0]] and not h.isnan().any()


def test_q_equal_to_p_keeps_everything():
    g = torch.Generator().manual_seed(1)
    b, k, v = 16, 7, 50
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    ids = torch.multinomial(p[:, :k].reshape(-1, v), 1, generator=g).reshape(b, k)
    u = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    r = verify.verify_block(ids, torch.full((b,), k), p[:, :k].clone(), p, u)
    assert r.num_accepted.tolist() == [k] * b
    assert (r.new_token_ids[:, :k] == ids).all()


def test_one_token_drafts_are_token_verification():
    """At k = 1, h_1 = min(1, p/q) and the residual is the plain one: block and token agree draw for draw."""
    g = torch.Generator().manual_seed(2)
    b, v = 200, 300
    p = torch.softmax(torch.randn(b, 2, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(b, 1, v, generator=g) * 2, -1)
    q[::4] = 0.0  # deterministic rows
    ids = torch.multinomial(torch.where(q[:, 0].sum(-1, keepdim=True) > 0, q[:, 0], p[:, 0]), 1, generator=g)
    u = torch.rand(b, 2, generator=g, dtype=torch.float64)
    block = verify.verify_block(ids, torch.ones(b, dtype=torch.int64), q, p, u)
    token = verify.verify_chains(ids, torch.ones(b, dtype=torch.int64), q, p, torch.zeros(b, dtype=torch.bool), u)
    assert torch.equal(block.new_token_ids, token.new_token_ids)


# --------------------------------------------------------------------------- through the engine


def _spy(monkeypatch) -> list[int]:
    """Count the draft tokens the engine hands to verify_block."""
    import specdecode.engine as engine_module

    seen: list[int] = []
    real = engine_module.verify_block

    def spy(ids, counts, *args):
        seen.append(int(counts.sum()))
        return real(ids, counts, *args)

    monkeypatch.setattr(engine_module, "verify_block", spy)
    return seen


@pytest.mark.slow  # block verification through the engine is in the fast lane in test_sampling_surface.py
@pytest.mark.parametrize("proposer", ["draft-model", "ngram"])
def test_block_verification_through_the_engine_follows_the_target(proposer, monkeypatch):
    """First three sampled tokens with EngineConfig(verification="block") vs the target's exact joint."""
    vocab = 5
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=1, hidden=32, scale=4.0)
    if proposer == "draft-model":
        prop, prompt = DraftModelProposer(tiny_llama(vocab_size=vocab, seed=4, layers=1, hidden=32, scale=4.0)), [1, 2]
    else:
        prop, prompt = NgramProposer(), [1, 2, 3, 1, 2, 3, 1, 2]
    seen = _spy(monkeypatch)
    # 2,000 seeded requests decoded 64 at a time (a request's tokens do not depend on the rest of the batch)
    engine = SpeculativeEngine(tgt, prop, EngineConfig(num_speculative_tokens=3, verification="block", max_batch_size=64))
    exact = exact_joint3(tgt, prompt)
    counts = np.zeros(vocab**3)
    for out in engine.generate_batch([prompt] * 2000, [SamplingParams(temperature=1.0, max_new_tokens=3, seed=s,
                                                                      coupled=False) for s in range(2000)]):
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 3)] += 1
    assert sum(seen) > 1000  # block verification ran, over many drafted tokens
    assert chi2_pvalue(counts, exact) > 1e-3


class _ClaimsQ(DraftModelProposer):
    """A draft model that reports ``claim(q)`` in place of the q [1, k, V] its tokens were drawn from."""

    name = "claims-q"

    def __init__(self, model, claim):
        super().__init__(model)
        self.claim = claim

    def propose(self, batch, max_tokens):
        drafts = super().propose(batch, max_tokens)
        for d in drafts:
            if d.draft_probs is not None:
                d.draft_probs = self.claim(d.draft_probs)
        return drafts


#: q's that bias the verifier they reach: NaN entries (read as a deterministic drafter's q in ratios, but summed
#: into block verification's thresholds) and a q half its size (every ratio p / q doubled).
BIASING_Q = {"nan": lambda q: q.index_fill(2, torch.tensor([q.shape[2] - 1]), float("nan")), "half": lambda q: q * 0.5}


@pytest.mark.slow  # each runs a distribution test to show the bias
@pytest.mark.parametrize("verification,fault", [("block", "nan"), ("block", "half"), ("token", "half")])
def test_a_broken_q_is_refused_at_the_door_where_it_would_bias_the_output(verification, fault, monkeypatch):
    """First three of four sampled tokens through the engine (the first step drafts two: the prefill made one), the
    draft reporting a broken q: every such request fails at the door (no output from that q is delivered). Controls: the honest q follows the target's exact joint, and
    the broken q let through (the door's q check off) misses it, so this test could tell."""
    import specdecode.drafts as drafts_module

    vocab, prompt, samples = 5, [1, 2], 1000
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=1, hidden=32, scale=4.0)
    drf = tiny_llama(vocab_size=vocab, seed=4, layers=1, hidden=32, scale=4.0)
    exact = exact_joint3(tgt, prompt)
    config = EngineConfig(num_speculative_tokens=3, verification=verification)

    def counts(claim) -> np.ndarray:  # the requests decoded 64 at a time (each row's tokens are its own)
        engine = SpeculativeEngine(tgt, _ClaimsQ(drf, claim), dataclasses.replace(config, max_batch_size=64))
        out = np.zeros(vocab**3)
        params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=s, coupled=False) for s in range(samples)]
        for ids in engine.generate_batch([prompt] * samples, params):
            out[np.ravel_multi_index(ids.token_ids[:3], (vocab,) * 3)] += 1
        return out

    door = SpeculativeEngine(tgt, _ClaimsQ(drf, BIASING_Q[fault]), config)
    for s in range(20):
        out = door.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=4, seed=s, coupled=False))
        assert out.finish_reason == "error" and len(out.token_ids) == 1  # the prefill's token, nothing verified
    assert chi2_pvalue(counts(lambda q: q), exact) > 1e-3
    monkeypatch.setattr(drafts_module, "_draft_probs_problem", lambda q, ids, vocab: None)
    assert chi2_pvalue(counts(BIASING_Q[fault]), exact) < 1e-3
