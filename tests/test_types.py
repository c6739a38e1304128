"""Plain data of the loop (``specdecode.types``): SamplingParams validation, Draft chains, the error classes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdecode import types
from specdecode.types import (
    MAX_NEW_TOKENS_LIMIT,
    Draft,
    EmptyPromptError,
    EngineFullError,
    GenerationOutput,
    InvalidSamplingParams,
    PromptTooLongError,
    ProposerContractError,
    SamplingParams,
    SpecDecodeError,
    StepOutput,
)

# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
     dict(max_new_tokens=0), dict(max_new_tokens=10**9), dict(seed=-3)],
)
def test_sampling_params_are_validated(kwargs):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field, shown", [
    (dict(temperature=-0.5), "temperature", "-0.5"),
    (dict(temperature=101.0), "temperature", "101.0"),
    (dict(temperature="0.7"), "temperature", "'0.7'"),
    (dict(top_k=2.5), "top_k", "2.5"),
    (dict(top_p=float("nan")), "top_p", "nan"),
    (dict(top_p=0.0), "top_p", "0.0"),
    (dict(max_new_tokens=1.5), "max_new_tokens", "1.5"),
    (dict(max_new_tokens=MAX_NEW_TOKENS_LIMIT + 1), "max_new_tokens", str(MAX_NEW_TOKENS_LIMIT + 1)),
    (dict(seed=1.0), "seed", "1.0"),
])
def test_sampling_param_errors_name_the_field_its_range_and_the_value(kwargs, field, shown):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(field) and shown in message
    assert " must be " in message  # what is allowed, then what was given


def test_sampling_params_accept_the_edges_of_every_range():
    for kwargs in (dict(temperature=0), dict(temperature=100), dict(top_k=0), dict(top_k=10**6), dict(top_p=1.0),
                   dict(top_p=1e-9), dict(max_new_tokens=1), dict(max_new_tokens=MAX_NEW_TOKENS_LIMIT),
                   dict(seed=0), dict(seed=None), dict(seed=2**62)):
        SamplingParams(**kwargs)  # no error


def test_sampling_params_are_frozen_and_greedy_means_temperature_zero():
    params = SamplingParams(temperature=0.0)
    assert params.greedy and not SamplingParams(temperature=1e-6).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(InvalidSamplingParams):  # replace() validates again
        dataclasses.replace(params, top_p=2.0)


# --------------------------------------------------------------------------- Draft


def test_draft_chain_has_parents_minus_one_then_each_previous_node():
    tokens = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    q = torch.softmax(torch.randn(2, 4, 10), -1)
    draft = Draft.chain(tokens, q, catch_up_s=0.25)
    assert draft.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, 1, 2]]
    assert draft.parents.dtype == torch.int64 and draft.parents.shape == tokens.shape
    assert draft.token_ids is tokens and draft.draft_probs is q and draft.catch_up_s == 0.25
    assert draft.num_tokens == 4
    one = Draft.chain(torch.tensor([[9]]))
    assert one.parents.tolist() == [[-1]] and one.draft_probs is None and one.catch_up_s == 0.0


def test_empty_draft_is_a_zero_length_chain():
    for b in (1, 3):
        empty = Draft.empty(b)
        assert empty.token_ids.shape == empty.parents.shape == (b, 0)
        assert empty.token_ids.dtype == empty.parents.dtype == torch.int64
        assert empty.num_tokens == 0 and empty.draft_probs is None and empty.catch_up_s == 0.0
        assert empty.parents is not empty.token_ids
    zero = Draft.chain(torch.zeros(1, 0, dtype=torch.int64))
    assert zero.num_tokens == 0 and zero.parents.shape == (1, 0)


# --------------------------------------------------------------------------- errors and outputs


@pytest.mark.parametrize("cls", [InvalidSamplingParams, ProposerContractError, EngineFullError, PromptTooLongError,
                                 EmptyPromptError])
def test_every_user_facing_error_is_a_specdecode_error_and_a_value_error(cls):
    assert issubclass(cls, SpecDecodeError) and issubclass(cls, ValueError)
    with pytest.raises(SpecDecodeError, match="what to do"):
        raise cls("what to do")


def test_outputs_do_not_share_mutable_defaults():
    a, b = GenerationOutput([1], "length", None), GenerationOutput([2], "stop", None)
    a.prompt_token_ids.append(7)
    assert b.prompt_token_ids == []
    step = StepOutput([3])
    assert (step.num_drafted, step.num_accepted, step.finished, step.finish_reason, step.error) == (0, 0, False,
                                                                                                    None, None)
    assert types.PAD_TOKEN_ID == -1
