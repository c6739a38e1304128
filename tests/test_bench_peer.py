"""The Hugging Face peer (``specdecode.bench.peer``): explicit generation settings, plain / assisted /
prompt-lookup generate decoding what our engine decodes greedily, the constant assistant, and errors."""

from __future__ import annotations

import pytest

from specdecode.bench.peer import PEER_OF, constant_assistant, generation_config, hf_generate
from specdecode.bench.smoke import SMOKE_DRAFT, SMOKE_TARGET, load_smoke_model
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import DraftModelProposer, NgramProposer
from specdecode.types import SamplingParams

PROMPT = [1, 20, 11, 24, 5, 20, 11, 24, 5, 20]


@pytest.fixture(scope="module")
def smoke():
    return load_smoke_model(SMOKE_TARGET), load_smoke_model(SMOKE_DRAFT)


def test_generation_config_turns_every_model_default_off():
    greedy = generation_config(12, 0.0, [2, 7])
    assert (greedy.max_new_tokens, greedy.do_sample, greedy.num_beams) == (12, False, 1)
    assert (greedy.top_k, greedy.top_p, greedy.repetition_penalty) == (0, 1.0, 1.0)
    assert greedy.eos_token_id == [2, 7] and greedy.pad_token_id == 2
    sampled = generation_config(5, 0.7, [])
    assert sampled.do_sample and sampled.temperature == 0.7 and sampled.eos_token_id is None
    assert sampled.pad_token_id == 0


@pytest.mark.parametrize("method", ["plain", "assisted", "prompt-lookup"])
def test_peer_greedy_outputs_equal_our_engine(smoke, method):
    target, draft = smoke
    n = 16
    res = hf_generate(target.model, PROMPT, max_new_tokens=n, method=method, gamma=3, draft=draft.model)
    proposer = {"plain": None, "assisted": DraftModelProposer(draft.model), "prompt-lookup": NgramProposer()}[method]
    ours = SpeculativeEngine(target.model, proposer, EngineConfig(num_speculative_tokens=3)).generate(
        PROMPT, SamplingParams(max_new_tokens=n))
    assert res.token_ids == ours.token_ids and len(res.token_ids) == n
    assert res.finish_reason == "length" and res.wall_s > 0


def test_eos_ends_the_peer_with_stop(smoke):
    target, _ = smoke
    free = hf_generate(target.model, PROMPT, max_new_tokens=12).token_ids
    eos = free[4]
    res = hf_generate(target.model, PROMPT, max_new_tokens=12, eos_token_ids=[eos])
    assert res.token_ids == free[: free.index(eos) + 1] and res.finish_reason == "stop"


def test_constant_assistant_restores_the_drafts_config(smoke):
    _, draft = smoke
    cfg = draft.model.generation_config
    before = (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold)
    with constant_assistant(draft.model, 7):
        assert (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule) == (7, "constant")
        assert cfg.assistant_confidence_threshold == 0.0
    assert (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold) == before
    with pytest.raises(RuntimeError), constant_assistant(draft.model, 3):
        raise RuntimeError("generate failed")
    assert cfg.num_assistant_tokens == before[0]  # restored on errors too


def test_bad_methods_are_refused(smoke):
    target, _ = smoke
    with pytest.raises(ValueError, match="needs a draft model"):
        hf_generate(target.model, PROMPT, max_new_tokens=2, method="assisted")
    with pytest.raises(ValueError, match="unknown peer method"):
        hf_generate(target.model, PROMPT, max_new_tokens=2, method="medusa")
    assert PEER_OF == {"draft-model": "assisted", "cross-vocab": "assisted", "ngram": "prompt-lookup"}
