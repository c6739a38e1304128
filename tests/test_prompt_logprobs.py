"""Prompt logprobs (``SpeculativeEngine.add(prompt_logprobs=n)``): every prompt token scored by the target
given the tokens before it, and a request that asks for them decodes exactly as one that does not."""

from __future__ import annotations

import pytest
import torch

from specdecode.engine import PROMPT_SCORE_CHUNK, EngineConfig, SpeculativeEngine
from specdecode.proposers import NgramProposer
from specdecode.proposers.ngram import NgramConfig
from specdecode.types import SamplingParams
from tiny import reference


@pytest.mark.parametrize("forward", ["owned", "hf"])
def test_prompt_logprobs_are_the_targets_and_change_nothing_else(target, forward):
    prompt = [3, 4, 5, 3, 4, 5, 3, 9, 11, 2]
    params = SamplingParams(max_new_tokens=12)
    engine = SpeculativeEngine(target, NgramProposer(NgramConfig(1, 3)),
                               EngineConfig(num_speculative_tokens=3, forward=forward))
    plain_req, plain_first = engine.add(prompt, params)
    assert plain_req.prompt_logprobs is None and plain_first.prompt_logprobs is None
    while plain_req.finish_reason is None:
        engine.step()
    req, first = engine.add(prompt, params, logprobs=2, prompt_logprobs=3)
    assert first.prompt_logprobs is req.prompt_logprobs and len(req.prompt_logprobs) == len(prompt)
    assert req.prompt_logprobs[0] == (None, None, [])
    want = torch.log_softmax(reference(target, prompt).double(), -1)  # [L, V]
    for i, (lp, rank, top) in enumerate(req.prompt_logprobs[1:], start=1):
        row = want[i - 1]
        assert lp == pytest.approx(float(row[prompt[i]]), abs=1e-5)
        assert rank == int((row > row[prompt[i]]).sum()) + 1
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-5)
    while req.finish_reason is None:
        engine.step()
    assert req.generated == plain_req.generated  # the prefill, the cache and the first token are untouched
    assert first.token_ids == plain_first.token_ids and first.logprobs is not None


def test_long_prompts_are_scored_in_chunks_and_one_token_prompts_need_no_forward(target):
    engine = SpeculativeEngine(target, None, EngineConfig(forward="owned"))
    prompt = [(7 * i) % 60 + 2 for i in range(PROMPT_SCORE_CHUNK + 20)]
    req, _ = engine.add(prompt, SamplingParams(max_new_tokens=1), prompt_logprobs=0)
    want = torch.log_softmax(reference(target, prompt).double(), -1)
    got = [lp for lp, _, _ in req.prompt_logprobs[1:]]
    assert got == pytest.approx([float(want[i - 1, prompt[i]]) for i in range(1, len(prompt))], abs=1e-5)
    assert all(top == [] for _, _, top in req.prompt_logprobs)
    one, _ = engine.add([5], SamplingParams(max_new_tokens=1), prompt_logprobs=2)
    assert one.prompt_logprobs == [(None, None, [])]
