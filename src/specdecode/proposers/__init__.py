"""Proposers (drafters), one file each, built by name through a registry."""

from specdecode.proposers import cross_vocab, draft_model, eagle, layer_skip, ngram, suffix, tree_draft  # noqa: F401 - registers them
from specdecode.proposers.base import PROPOSERS, Proposer, ProposeContext, register
from specdecode.proposers.cross_vocab import CrossVocabConfig, CrossVocabProposer, VocabMap
from specdecode.proposers.draft_model import DraftModelConfig, DraftModelProposer
from specdecode.proposers.eagle import EagleDraftConfig, EagleProposer
from specdecode.proposers.layer_skip import LayerSkipConfig, LayerSkipProposer
from specdecode.proposers.ngram import NgramConfig, NgramProposer
from specdecode.proposers.suffix import GlobalSuffixTree, SuffixConfig, SuffixProposer
from specdecode.proposers.tree_draft import TreeDraftConfig, TreeDraftProposer


def build_proposer(name: str, **kwargs) -> Proposer:
    """Build a registered proposer: ``build_proposer("ngram")``, ``build_proposer("draft-model", model=m)``.

    Raises:
        KeyError: unknown name (the message lists the registered ones).
    """
    if name not in PROPOSERS:
        raise KeyError(f"unknown proposer {name!r}; choose one of {sorted(PROPOSERS)}")
    return PROPOSERS[name](**kwargs)


__all__ = [
    "PROPOSERS",
    "CrossVocabConfig",
    "CrossVocabProposer",
    "VocabMap",
    "DraftModelConfig",
    "DraftModelProposer",
    "EagleDraftConfig",
    "EagleProposer",
    "LayerSkipConfig",
    "LayerSkipProposer",
    "NgramConfig",
    "NgramProposer",
    "GlobalSuffixTree",
    "ProposeContext",
    "Proposer",
    "SuffixConfig",
    "SuffixProposer",
    "TreeDraftConfig",
    "TreeDraftProposer",
    "build_proposer",
    "register",
]
