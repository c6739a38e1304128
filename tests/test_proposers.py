"""The proposers package (``specdecode.proposers``): every drafter registered and built by name."""

from __future__ import annotations

import pytest

from specdecode import proposers
from specdecode.proposers import PROPOSERS, build_proposer
from tiny import tiny_llama


def test_every_proposer_module_registers_its_drafter_under_its_own_name():
    assert set(PROPOSERS) == {"draft-model", "layer-skip", "ngram", "suffix", "tree-draft"}
    for name, factory in PROPOSERS.items():
        assert factory.name == name


def test_build_proposer_by_name():
    model = tiny_llama(vocab_size=64, seed=0, layers=4)
    built = {name: build_proposer(name, **({"model": model} if name in ("draft-model", "layer-skip", "tree-draft")
                                           else {}))
             for name in PROPOSERS}
    for name, proposer in built.items():
        assert isinstance(proposer, PROPOSERS[name]) and proposer.name == name
    assert built["suffix"].produces_trees and built["tree-draft"].produces_trees
    assert not built["ngram"].produces_trees and not built["draft-model"].produces_trees


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown proposer 'eagle'.*'ngram'"):
        build_proposer("eagle")
    assert set(proposers.__all__) >= {"build_proposer", "PROPOSERS", "register", "ProposeContext"}
