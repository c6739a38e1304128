"""The proposer contract (``specdecode.proposers.base``): the context and its policy hook, the room a draft
model has, the per-row loop, the slot-cache base of model drafters, and the registry decorator."""

from __future__ import annotations

import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import PROPOSERS, DraftModelProposer
from specdecode.proposers.base import ProposeContext, Proposer, RowProposer, draft_room, register
from specdecode.types import Draft, SamplingParams, SpecDecodeError
from tiny import tiny_llama


def _ctx(tokens, **kw):
    return ProposeContext(list(tokens), len(tokens), SamplingParams(), torch.Generator().manual_seed(0), 64, **kw)


def test_keep_drafting_asks_the_policy_hook_with_the_distribution():
    probs = torch.tensor([0.7, 0.3])
    assert _ctx([1]).keep_drafting(probs)  # no hook: always go on
    seen = []
    ctx = _ctx([1], should_continue=lambda p: seen.append(p) or p.max() > 0.8)
    assert not ctx.keep_drafting(probs) and seen[0] is probs
    assert ctx.keep_drafting(torch.tensor([0.9, 0.1]))
    assert _ctx([1], should_continue=lambda p: torch.tensor(True)).keep_drafting(probs) is True  # a plain bool


def test_contexts_do_not_share_state():
    a, b = _ctx([1]), _ctx([2])
    a.state["x"] = 1
    assert b.state == {} and a.slot == b.slot == 0


@pytest.mark.parametrize("max_context, n, room", [(16, 3, 14), (16, 15, 2), (16, 16, 1), (16, 17, 0), (16, 20, -3)])
def test_draft_room_counts_the_positions_a_draft_model_can_still_feed(max_context, n, room):
    """k drafts feed the context and k - 1 draft tokens: len + k - 1 <= max_context."""
    assert draft_room(max_context, _ctx(range(n))) == room


class _Counting(RowProposer):
    name = "counting"

    def __init__(self):
        self.calls = []

    def propose_row(self, ctx, max_tokens):
        self.calls.append((ctx.token_ids[0], max_tokens))
        return Draft.chain(torch.arange(max_tokens).reshape(1, -1))


def test_row_proposer_loops_rows_and_skips_rows_asked_for_nothing():
    proposer = _Counting()
    drafts = proposer.propose([_ctx([5]), _ctx([6]), _ctx([7])], [2, 0, 3])
    assert proposer.calls == [(5, 2), (7, 3)]  # the row asked for 0 tokens is not called
    assert [d.num_tokens for d in drafts] == [2, 0, 3]


def test_base_defaults_do_nothing_and_propose_must_be_implemented():
    p = Proposer()
    assert p.nbytes == 0 and not p.produces_trees
    for call in (lambda: p.bind(None, 1), lambda: p.start(_ctx([1])), lambda: p.finish(_ctx([1])),
                 lambda: p.move(0, 1), lambda: p.release(), lambda: p.observe([], [])):
        assert call() is None
    with pytest.raises(NotImplementedError):
        p.propose([_ctx([1])], [1])
    with pytest.raises(NotImplementedError):
        RowProposer().propose([_ctx([1])], [1])


def test_draft_model_slots_follow_the_engines_rows_and_need_binding():
    target = tiny_llama(vocab_size=64, seed=0, max_positions=64)
    draft = tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, max_positions=200)
    proposer = DraftModelProposer(draft)
    with pytest.raises(SpecDecodeError, match="not bound to an engine"):
        proposer.start(_ctx([1]))
    proposer.release()  # unbound: nothing to free, no error
    engine = SpeculativeEngine(target, proposer, EngineConfig(max_batch_size=3))
    runner = proposer.runner
    assert runner.num_slots == 3 and proposer.max_context == 64  # the shorter of both contexts
    runner.forward(slice(0, 2), [[1, 2, 3], [4, 5]])
    proposer.move(1, 0)
    assert runner.ids[0] == [4, 5] and runner.ids[1] == []
    proposer.finish(_ctx([4], slot=0))
    assert runner.ids[0] == []
    assert engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5)).token_ids  # still serves
    proposer.release()
    assert proposer.nbytes == 0


def test_register_names_the_class_and_makes_it_buildable():
    from specdecode.proposers import build_proposer

    try:
        @register("test-echo")
        class Echo(RowProposer):
            def propose_row(self, ctx, max_tokens):
                return Draft.chain(torch.tensor([ctx.token_ids[-1:] * max_tokens]))

        assert PROPOSERS["test-echo"] is Echo and Echo.name == "test-echo"
        built = build_proposer("test-echo")
        assert isinstance(built, Echo)
        assert built.propose([_ctx([4, 9])], [2])[0].token_ids.tolist() == [[9, 9]]
        factory = register("test-fn")(lambda: Echo())  # a plain function registers without a name change
        assert PROPOSERS["test-fn"] is factory
    finally:
        PROPOSERS.pop("test-echo", None)
        PROPOSERS.pop("test-fn", None)
