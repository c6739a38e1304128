"""The coupled mode's noise and choice (``specdecode.coupled``), and the sampler's fallback when a
request's own constraints contradict each other (``sampling.RequestSampler``)."""

from __future__ import annotations

import numpy as np
import torch

from specdecode.coupled import CoupledNoise, exponential, key
from specdecode.sampling import RequestSampler
from specdecode.types import SamplingParams
from tiny import chi2_pvalue


def test_noise_is_float64_positive_and_keyed_by_seed_and_position():
    e = exponential(7, 3, 200_000)
    assert e.dtype == torch.float64 and bool((e > 0).all())  # a float32 uniform would hit 0 about once here
    assert torch.equal(e, exponential(7, 3, 200_000))
    assert not torch.equal(e, exponential(7, 4, 200_000)) and not torch.equal(e, exponential(8, 3, 200_000))
    assert key(1, 2) != key(2, 1) and 0 <= key(1, 2) < 2**63
    assert abs(float(e.mean()) - 1.0) < 0.01  # standard exponential


def test_choice_never_picks_a_token_of_probability_zero_and_follows_p():
    p = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    counts = np.zeros(5)
    for seed in range(3000):
        tok = int(CoupledNoise(seed, 5).choose(p.unsqueeze(0), [0])[0])
        counts[tok] += 1
    assert counts[1] == 0 and counts[4] == 0
    assert chi2_pvalue(counts, p.numpy()) > 1e-3


def test_a_smaller_draft_vocabulary_sees_the_same_noise_per_token():
    noise = CoupledNoise(5, 10)
    q = torch.zeros(1, 6)
    q[0, 2] = q[0, 4] = 0.5
    p = torch.nn.functional.pad(q, (0, 4))  # the same law over the target's 10 tokens
    assert int(noise.choose(q, [3])[0]) == int(noise.choose(p, [3])[0])


class _OnlyEos:
    """A constraint that allows only token 0 (a complete grammar whose EOS is 0)."""

    def masks(self, paths):
        m = torch.zeros(len(paths), 8, dtype=torch.bool)
        m[:, 0] = True
        return m

    def valid_prefix(self, tokens):
        return 0

    def commit(self, tokens):
        pass


def test_contradicting_constraints_end_the_request_with_a_stop_token():
    # allowed_token_ids lacks the EOS the grammar requires: the position allows nothing, so it ends
    params = SamplingParams(temperature=1.0, allowed_token_ids=(3, 4), eos_token_ids=(0,))
    s = RequestSampler(params, [1, 2], 8, _OnlyEos())
    probs = s.probs(torch.randn(2, 8), [[], [3]])
    assert torch.equal(probs.argmax(-1), torch.tensor([0, 0])) and float(probs[:, 0].min()) == 1.0
    # without stop tokens the grammar yields to the static masks: only allowed tokens
    s = RequestSampler(SamplingParams(temperature=1.0, allowed_token_ids=(3, 4)), [1], 8, _OnlyEos())
    probs = s.probs(torch.randn(1, 8), [[]])
    assert set(torch.nonzero(probs[0]).flatten().tolist()) <= {3, 4}
