"""The proposers package (``specdecode.proposers``): every drafter registered and built by name."""

from __future__ import annotations

import pytest

from specdecode import proposers
from specdecode.proposers import PROPOSERS, build_proposer
from tiny import tiny_llama


def test_every_proposer_module_registers_its_drafter_under_its_own_name():
    assert set(PROPOSERS) == {"cross-vocab", "draft-model", "eagle", "layer-skip", "ngram", "suffix", "tree-draft"}
    for name, factory in PROPOSERS.items():
        assert factory.name == name


def test_build_proposer_by_name(tmp_path):
    from specdecode.eagle.head import EagleConfig, EagleHead, save_head
    from specdecode.proposers.eagle import EagleDraftConfig, EagleProposer

    model = tiny_llama(vocab_size=64, seed=0, layers=4)
    save_head(EagleHead(EagleConfig.for_target(model, list(range(64)))).attach(model, init=True), tmp_path / "h")
    from conftest import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    args = {"draft-model": {"model": model}, "layer-skip": {"model": model}, "tree-draft": {"model": model},
            "cross-vocab": {"model": model, "target_tokenizer": tok, "draft_tokenizer": tok, "target_vocab": 64},
            "eagle": {"target": model, "config": EagleDraftConfig(head=str(tmp_path / "h"))}}
    built = {name: build_proposer(name, **args.get(name, {})) for name in PROPOSERS}
    for name, proposer in built.items():
        kind = EagleProposer if name == "eagle" else PROPOSERS[name]  # eagle's factory is a function
        assert isinstance(proposer, kind) and proposer.name == name
    assert built["suffix"].produces_trees and built["tree-draft"].produces_trees
    assert not built["ngram"].produces_trees and not built["draft-model"].produces_trees
    assert not built["eagle"].produces_trees and not built["cross-vocab"].produces_trees


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown proposer 'medusa'.*'ngram'"):
        build_proposer("medusa")
    assert set(proposers.__all__) >= {"build_proposer", "PROPOSERS", "register", "ProposeContext"}


# --------------------------------------------------------------------------- lookup indexes follow their context

#: The contexts a request's ``ctx.token_ids`` goes through, each made from the one before *in place* (the same
#: list object): a repeated pattern; replaced whole at the same length; the middle changed with the last tokens
#: kept; cut and extended; replaced by a shorter list object; appended to as the engine does; tokens that never
#: repeat (hybrids then fall back to their inner drafter); the middle changed again.
STAGES = [
    ("start", lambda ids: None),
    ("same length, replaced", lambda ids: ids.__setitem__(slice(None), [20, 21, 22, 23, 20, 21, 22, 23, 20, 21])),
    ("middle changed, last kept", lambda ids: ids.__setitem__(slice(2, 8), [30, 31, 20, 21, 30, 31])),
    ("cut and extended", lambda ids: (ids.__delitem__(slice(5, None)), ids.extend([24, 25, 20, 21]))),
    ("appended", lambda ids: ids.extend([30, 31, 20])),
    ("no repeats", lambda ids: ids.__setitem__(slice(None), [40 + i for i in range(len(ids))])),
    ("no repeats, middle changed", lambda ids: ids.__setitem__(slice(3, 9), [9, 8, 7, 6, 5, 4])),
]
FIRST = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]


def _lookup_kinds():
    """Each drafter keeping an index of the context, alone and as the inner drafter of suffix decoding."""
    from specdecode.proposers import CrossVocabProposer, DraftModelProposer, NgramProposer, SuffixConfig, SuffixProposer
    from specdecode.proposers.suffix import GlobalSuffixTree

    shared = GlobalSuffixTree(8, 10_000)  # a global tree both proposers under comparison read
    shared.add([20, 21, 22, 23, 24, 25, 20, 21, 30])

    def suffix(fallback=None, use_global=False, min_score=1.0):
        return SuffixProposer(SuffixConfig(max_depth=8, max_match=4, min_token_prob=0.0, use_global=use_global,
                                           min_score=min_score),
                              global_tree=shared if use_global else None, fallback=fallback)

    def cross(model, tok):
        return CrossVocabProposer(model, tok, tok, model.config.vocab_size)

    return {
        "ngram": lambda model, tok: NgramProposer(),
        "suffix": lambda model, tok: suffix(),
        "suffix (global tree)": lambda model, tok: suffix(use_global=True),
        "cross-vocab": cross,
        "suffix:ngram": lambda model, tok: suffix(NgramProposer()),
        "suffix:draft-model": lambda model, tok: suffix(DraftModelProposer(model)),
        "suffix:cross-vocab": lambda model, tok: suffix(cross(model, tok)),
        # the inner drafter drafting every step (every suffix tree scores below min_score): its own index
        "suffix:ngram, inner": lambda model, tok: suffix(NgramProposer(), min_score=1e9),
        "suffix:draft-model, inner": lambda model, tok: suffix(DraftModelProposer(model), min_score=1e9),
        "suffix:cross-vocab, inner": lambda model, tok: suffix(cross(model, tok), min_score=1e9),
    }


@pytest.mark.parametrize("kind", list(_lookup_kinds()))
def test_every_lookup_index_describes_the_context_it_is_given(kind):
    """Whatever happened to ``ctx.token_ids`` (replaced in place at the same length, changed in the middle with
    its last tokens kept, cut, replaced, appended to), a drafter proposes what a fresh drafter proposes for the
    same tokens: its index (n-gram mirror, suffix tries, a cross-vocabulary drafter's text) never describes an
    older context. Checked for both lookup drafters and every hybrid of suffix decoding."""
    import torch

    from conftest import make_tiny_model, make_tiny_tokenizer
    from specdecode.engine import EngineConfig, SpeculativeEngine
    from specdecode.proposers.base import ProposeContext
    from specdecode.types import SamplingParams

    tok = make_tiny_tokenizer()
    model = make_tiny_model(len(tok), seed=0).to(torch.float64)
    make = _lookup_kinds()[kind]
    params = SamplingParams(max_new_tokens=8)

    def bound(proposer):
        SpeculativeEngine(model, proposer, EngineConfig(num_speculative_tokens=4))  # binds draft models to slot 0
        return proposer

    def ctx_of(ids):
        return ProposeContext(ids, len(ids), params, torch.Generator().manual_seed(0), len(tok), slot=0)

    def drafted(proposer, ctx):
        d = proposer.propose([ctx], [4])[0]
        return d.token_ids[0].tolist(), d.parents[0].tolist()

    proposer = bound(make(model, tok))
    ctx = ctx_of(list(FIRST))
    proposer.start(ctx)
    seen = set()
    for name, change in STAGES:
        if name == "cut and extended":
            ctx.token_ids = list(ctx.token_ids)  # and a new list object from here on
        change(ctx.token_ids)
        fresh, fresh_ctx = bound(make(model, tok)), ctx_of(list(ctx.token_ids))
        fresh.start(fresh_ctx)
        want = drafted(fresh, fresh_ctx)
        assert drafted(proposer, ctx) == want, name
        seen.add(tuple(want[0]))
    assert len(seen) > 3  # the stages ask for different drafts
