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
