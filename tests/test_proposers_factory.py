"""From a drafter spec to proposers (``specdecode.proposers.factory``, ``specdecode.build``): the ``--draft``
words read as specs, the checks that run before any model is loaded, the draft-model load, and a factory for
every choice (each lossless through the engine)."""

from __future__ import annotations

import pytest

from specdecode import layer_search
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.lowbit import LOWBIT_TYPES
from specdecode.proposers import (
    PROPOSERS,
    DraftModelConfig,
    DraftModelProposer,
    LayerSkipConfig,
    LayerSkipProposer,
    NgramConfig,
    NgramProposer,
    SuffixConfig,
    SuffixProposer,
    TreeDraftConfig,
    TreeDraftProposer,
)
from specdecode.build import load_draft_for
from specdecode.proposers.factory import (
    config_from_options,
    config_type,
    factory_from_spec,
    registered_factory,
    takes_draft_model,
)
from specdecode.spec import DrafterSpec
from specdecode.types import SamplingParams, SpecDecodeError
from tiny import tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, layers=4, scale=3.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, scale=3.0)


@pytest.fixture()
def no_loading(monkeypatch):
    """Any model load fails the test: the checks must run before it."""
    monkeypatch.setattr("specdecode.models.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr("specdecode.lowbit.load_in_precision", lambda *a, **k: pytest.fail("a model was loaded"))


# --------------------------------------------------------------------------- the --draft words


def _spec(draft, **flags) -> DrafterSpec:
    """The spec of ``--draft DRAFT`` and its flags (``generate`` / ``serve``'s path)."""
    return DrafterSpec.from_settings({"draft": draft, **flags})


@pytest.mark.parametrize("text, kind, spec", [
    (None, "none", None), ("", "none", None), ("  none ", "none", None), ("NONE", "none", None),
    ("ngram", "ngram", None), (" NGram ", "ngram", None), ("layer-skip", "layer-skip", None),
    ("Layer-Skip", "layer-skip", None), ("suffix", "suffix", None), ("suffix:ngram", "suffix", None),
    ("HuggingFaceTB/SmolLM2-135M", "draft-model", "HuggingFaceTB/SmolLM2-135M"),
    ("./My Dir", "draft-model", "./My Dir"), ("Suffix:Org/Draft", "suffix", "Org/Draft"),
])
def test_draft_words_read_case_insensitively_and_keep_model_specs(text, kind, spec):
    choice = DrafterSpec.parse(text)
    assert choice.kind == kind and choice.model_spec == spec


def test_suffix_choices_carry_their_fallback():
    assert DrafterSpec.parse("suffix").fallback is None and DrafterSpec.parse("suffix:").fallback is None
    assert DrafterSpec.parse("suffix:NGRAM").fallback == DrafterSpec("ngram")
    inner = DrafterSpec.parse("suffix:some/model").fallback
    assert inner.kind == "draft-model" and inner.model == "some/model" and inner.fallback is None
    assert DrafterSpec.parse("ngram").fallback is None


# --------------------------------------------------------------------------- checks before loading


@pytest.mark.parametrize("draft, flags, needle", [
    ("layer-skip", dict(skip_layers="1;2"), "comma-separated"),
    ("some/model", dict(tree="bushy"), "tree must be one of"),
    ("some/model", dict(tree="static", tree_nodes=0), "tree nodes"),
    ("suffix", dict(tree_nodes=65), "tree nodes"),
    ("ngram", dict(tree="dynamic"), "needs a draft model"),
    ("layer-skip", dict(tree="static"), "needs a draft model"),
    ("suffix:ngram", dict(tree="static"), "needs a draft model"),
    ("none", dict(tree="static"), "needs a draft model"),
    ("ngram", dict(ngram_min=3, ngram_max=2), "min_ngram <= max_ngram"),
    ("suffix:ngram", dict(ngram_min=0), "min_ngram <= max_ngram"),
])
def test_the_spec_refuses_bad_settings_before_any_load(no_loading, draft, flags, needle):
    with pytest.raises(SpecDecodeError, match=needle):
        _spec(draft, **flags).check()


@pytest.mark.parametrize("draft, flags", [
    ("some/model", dict(ngram_min=3, ngram_max=2)),  # n-gram sizes matter to ngram only
    ("suffix:some/model", dict(tree="dynamic", tree_nodes=64)),
    ("layer-skip", dict(skip_layers=[3, 1])),
    ("some/model", dict(tree=" Static ", tree_nodes=1)),
])
def test_the_spec_accepts_settings_that_fit(no_loading, draft, flags):
    _spec(draft, **flags).check()


def test_a_tree_spec_maps_to_the_tree_config():
    for tree, nodes in (("static", 8), ("Dynamic", 12)):
        spec = _spec("m", tree=tree, tree_nodes=nodes)
        assert spec.kind == "tree-draft"
        assert config_from_options(spec.kind, spec.options) == TreeDraftConfig(kind=tree.lower(), num_nodes=nodes)
    assert _spec("m", tree=" NONE ").kind == "draft-model"


# --------------------------------------------------------------------------- the registry


def test_registered_factories_and_their_config_types():
    assert set(PROPOSERS) == {"cross-vocab", "draft-model", "eagle", "layer-skip", "ngram", "suffix", "tree-draft"}
    assert {n for n in PROPOSERS if takes_draft_model(n)} == {"cross-vocab", "draft-model", "tree-draft"}  # layer-skip: the target
    assert config_type("ngram") is NgramConfig and config_type("draft-model") is DraftModelConfig
    assert config_type("layer-skip") is LayerSkipConfig and config_type("suffix") is SuffixConfig
    assert config_type("tree-draft") is TreeDraftConfig
    from specdecode.proposers.cross_vocab import CrossVocabConfig

    assert config_type("cross-vocab") is CrossVocabConfig
    from specdecode.proposers.eagle import EagleDraftConfig

    assert config_type("eagle") is EagleDraftConfig
    with pytest.raises(KeyError, match="no-such"):
        takes_draft_model("no-such")
    with pytest.raises(KeyError, match="choose one of"):
        registered_factory("no-such")


def test_registered_factory_binds_model_target_config_and_searcher(target, draft):
    skip = registered_factory("layer-skip", target=target, draft=draft,
                              config=LayerSkipConfig(skip_layers=(1,)))()
    assert skip.model is target and skip.searcher is layer_search and skip.skip_layers == (1,)
    dm = registered_factory("draft-model", target=target, draft=draft)()
    assert dm.model is draft
    a, b = (registered_factory("ngram", config=NgramConfig(2, 4)) for _ in range(2))
    assert a().config == NgramConfig(2, 4) and a() is not a()  # a fresh proposer per call


# --------------------------------------------------------------------------- a factory for every choice


def _check(proposer, kind):
    """The built proposer's type and settings for each choice of CHOICES."""
    if kind == "ngram":
        assert isinstance(proposer, NgramProposer) and proposer.config == NgramConfig(2, 4)
    elif kind == "layer-skip":
        assert isinstance(proposer, LayerSkipProposer) and proposer.skip_layers == (1, 2)
    elif kind == "suffix":
        assert isinstance(proposer, SuffixProposer) and proposer.fallback is None
        assert proposer.config.max_spec_nodes == 8
    elif kind == "suffix:ngram":
        assert isinstance(proposer, SuffixProposer) and isinstance(proposer.fallback, NgramProposer)
    elif kind == "suffix:model":
        assert isinstance(proposer, SuffixProposer) and isinstance(proposer.fallback, DraftModelProposer)
    elif kind == "model":
        assert type(proposer) is DraftModelProposer
    elif kind == "model+tree":
        assert isinstance(proposer, TreeDraftProposer) and proposer.config.kind == "static"
        assert proposer.config.num_nodes == 8


CHOICES = {
    "ngram": ("ngram", dict(ngram_min=2, ngram_max=4)),
    "layer-skip": ("layer-skip", dict(skip_layers="1,2")),
    "suffix": ("suffix", dict(tree_nodes=8)),
    "suffix:ngram": ("suffix:ngram", {}),
    "suffix:model": ("suffix:draft/spec", {}),
    "model": ("draft/spec", {}),
    "model+tree": ("draft/spec", dict(tree="static", tree_nodes=8)),
}


@pytest.mark.parametrize("kind", list(CHOICES))
def test_the_factory_builds_every_choice_and_each_is_lossless(target, draft, kind):
    text, flags = CHOICES[kind]
    make = factory_from_spec(_spec(text, **flags), target=target, draft=draft)
    first, second = make(), make()
    assert first is not second  # fresh proposers (the library builds one per decoder)
    _check(first, kind)
    params = SamplingParams(max_new_tokens=24)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    plain = SpeculativeEngine(target, None).generate(prompt, params).token_ids
    assert SpeculativeEngine(target, first, EngineConfig(num_speculative_tokens=3)).generate(
        prompt, params).token_ids == plain


def test_plain_decoding_and_a_missing_draft_model(target):
    assert factory_from_spec(_spec("none")) is None
    assert factory_from_spec(_spec(None), target=target) is None
    for text in ("some/model", "suffix:some/model"):
        with pytest.raises(SpecDecodeError, match="names a draft model, but none was loaded"):
            factory_from_spec(_spec(text), target=target)


# --------------------------------------------------------------------------- loading the draft model


def test_load_draft_for(tiny_model_dir, tiny_loaded, no_loading):
    spec = str(tiny_model_dir)
    for text in ("none", "ngram", "layer-skip", "suffix", "suffix:ngram"):
        assert load_draft_for(DrafterSpec.parse(text), tiny_loaded, spec) is None  # model-free: nothing loaded
    # the target's own spec in the target's precision: the target object itself
    assert load_draft_for(DrafterSpec.parse(spec), tiny_loaded, spec) is tiny_loaded
    assert load_draft_for(DrafterSpec.parse(f"suffix:{spec}"), tiny_loaded, spec) is tiny_loaded


def test_load_draft_for_loads_another_spec_or_precision(tiny_model_dir, tiny_loaded):
    spec = str(tiny_model_dir)
    other = load_draft_for(DrafterSpec.parse(spec), tiny_loaded, "another-target-spec", progress=False)
    assert other is not tiny_loaded and other.model is not tiny_loaded.model
    int8 = load_draft_for(DrafterSpec.parse(spec), tiny_loaded, spec, draft_weights="int8", progress=False)
    assert int8 is not tiny_loaded
    assert any(isinstance(m, LOWBIT_TYPES) for m in int8.model.modules())
    assert not any(isinstance(m, LOWBIT_TYPES) for m in tiny_loaded.model.modules())
