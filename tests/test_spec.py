"""Drafter specs (``specdecode.spec``): every kind reads the same from the flags, a ``--config`` file and the
compact form, ``str()`` reads back, bad values are refused in one line, and every front end builds the same
engine (proposer config and weights) from one spec (``specdecode.build``)."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.errors import SpecDecodeError
from specdecode.spec import BUILTIN_KINDS, DEFAULTS, OPTIONS, DrafterSpec

MODEL = "some/draft-model"

#: (the --draft flags, the compact form of the same drafter), one row per kind and its options.
SAME = [
    ({"draft": "none"}, "none"),
    ({"draft": "ngram", "num_speculative_tokens": 4}, "ngram:k=4"),
    ({"draft": "ngram", "num_speculative_tokens": 4, "ngram_min": 2, "ngram_max": 5}, "ngram:k=4,min_ngram=2,max_ngram=5"),
    ({"draft": "layer-skip", "skip_layers": "5,3"}, "layer-skip:k=5,skip_layers=3/5"),
    ({"draft": "layer-skip"}, "layer-skip:k=5"),
    ({"draft": "suffix", "tree_nodes": 16}, "suffix:k=5"),
    ({"draft": "suffix"}, "suffix:k=5,max_spec_nodes=15"),
    ({"draft": "suffix:ngram", "ngram_max": 4}, "suffix:k=5,max_spec_nodes=15,fallback=(ngram:max_ngram=4)"),
    ({"draft": f"suffix:{MODEL}", "tree": "static", "tree_nodes": 8},
     f"suffix:k=5,max_spec_nodes=8,fallback=(tree-draft:model={MODEL},kind=static,num_nodes=8)"),
    ({"draft": "eagle", "num_speculative_tokens": 3}, "eagle:k=3"),
    ({"draft": "eagle:/heads/h1", "tree": "dynamic"}, "eagle:k=5,tree=dynamic,head=/heads/h1"),
    ({"draft": MODEL, "num_speculative_tokens": 3}, f"draft-model:k=3,model={MODEL}"),
    ({"draft": MODEL, "tree": "static", "tree_nodes": 8}, f"tree-draft:k=5,model={MODEL},kind=static,num_nodes=8"),
    ({"draft": "smoke:tiny-draft"}, "draft-model:k=5,model=smoke:tiny-draft"),
]


def _toml(flags: dict) -> dict:
    """The flags as a --config file holds them, read back with tomllib."""
    lines = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in flags.items())
    return tomllib.loads(lines)


@pytest.mark.parametrize("flags, compact", SAME, ids=[c for _, c in SAME])
def test_every_kind_reads_the_same_from_flags_config_and_compact(flags, compact):
    from_flags = DrafterSpec.from_settings(flags)
    from_config = DrafterSpec.from_settings(_toml(flags))
    from_compact = DrafterSpec.parse(compact)
    assert from_flags == from_config == from_compact
    assert DrafterSpec.parse(str(from_flags)) == from_flags  # one canonical form
    assert DrafterSpec.from_settings(from_flags.settings()) == from_flags  # what tune writes reads back
    # --draft takes the compact form (--tree-nodes, default 15, is suffix decoding's node budget: its own default
    # is 16, so the flag goes with it)
    assert DrafterSpec.from_settings({**from_compact.settings(), "draft": compact}) == from_compact


def test_canonical_form_sorts_and_drops_defaults():
    assert str(DrafterSpec.parse(" ngram : k=5, max_ngram=3 ,min-ngram=2")) == "ngram:k=5,min_ngram=2"
    assert str(DrafterSpec.parse("ngram:max_ngram=04")) == "ngram:max_ngram=4"
    assert DrafterSpec.parse("layer-skip:skip_layers=7/3/5").skip_layers == (3, 5, 7)
    assert DrafterSpec.parse("eagle:/x/y").head_path == "/x/y"
    assert DrafterSpec.parse("suffix:ngram").fallback == DrafterSpec("ngram")
    assert DrafterSpec.parse("tree-draft:model=m").tree == "dynamic" and DrafterSpec.parse("m").tree == "none"
    assert DrafterSpec.parse("echo-test:k=2,width=3", bare_model=False).kind == "echo-test"
    assert DrafterSpec.parse("echo-test").model_spec == "echo-test"  # --draft: a bare word is a model


@pytest.mark.parametrize("text, needle", [
    ("ngram:k=0", r"num_speculative_tokens must be an integer in \[1, 64\], got 0"),
    ("ngram:k=x", "must be an integer in"),
    ("ngram:k=65", "num_speculative_tokens must be an integer in"),
    ("ngram:oops", "'oops' .* is not KEY=VALUE"),
    (":k=3", "empty drafter kind"),
    ("ngram:min_ngram=4,max_ngram=2", "1 <= min_ngram <= max_ngram"),
    ("ngram:max_ngram=many", "max_ngram must be a non-negative integer, got 'many'"),
    ("eagle:tree=bushy", "tree must be one of none, static, dynamic; got 'bushy'"),
    ("tree-draft:model=m,kind=none", "kind must be one of static, dynamic"),
    ("tree-draft:model=m,num_nodes=65", r"num nodes \(num_nodes, a node budget\) must be an integer in \[1, 64\]"),
    ("suffix:max_spec_nodes=0", "max_spec_nodes"),
    ("layer-skip:skip_layers=a/b", "--skip-layers takes comma-separated layer indices"),
    ("suffix:eagle", "a draft head cannot be suffix decoding's fallback"),
    ("ngram:k=3,k=4", "given twice"),
    ("ngram:k=3,gamma=4", "given twice"),
    ("draft-model:model=a,model=b", "'model' given twice"),
    ("suffix:fallback=(ngram),fallback=(ngram)", "'fallback' given twice"),
    ("suffix:fallback=(ngram", r"unbalanced '\('"),
])
def test_bad_compact_values_are_refused_in_one_line(text, needle):
    with pytest.raises(SpecDecodeError, match=needle) as err:
        DrafterSpec.parse(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flags, needle", [
    ({"draft": "ngram", "tree": "static"}, "--tree static needs a draft model or head"),
    ({"draft": "suffix", "tree": "dynamic"}, "--tree dynamic needs a draft model or head"),
    ({"draft": "suffix:ngram", "tree": "static"}, "--tree static needs a draft model or head"),
    ({"draft": MODEL, "tree": "bushy"}, "tree must be one of"),
    ({"draft": MODEL, "tree": "static", "tree_nodes": 0}, "tree_nodes"),
    ({"draft": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
    ({"draft": "ngram", "ngram_min": 3, "ngram_max": 2}, "min_ngram <= max_ngram"),
    ({"draft": "layer-skip", "skip_layers": "x"}, "--skip-layers"),
])
def test_bad_flags_are_refused_with_the_same_words(flags, needle):
    with pytest.raises(SpecDecodeError, match=needle):
        DrafterSpec.from_settings(flags)


def test_a_head_path_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(SpecDecodeError, match="is not a draft-head checkpoint"):
        DrafterSpec.parse(f"eagle:{tmp_path}").check()


@pytest.mark.parametrize("text, needle", [
    ("ngram:k=3,foo=1", "ngram has no option 'foo' (in 'ngram:k=3,foo=1'); its options: k, max_ngram, min_ngram"),
    ("none:foo=1", "none has no option 'foo'"),
    ("layer-skip:skip=3/5", "layer-skip has no option 'skip'.*its options: k, cache_dir, min_confidence, "),
    ("draft-model:model=m,kind=static", "draft-model has no option 'kind'.*its options: k, model, forward, vocab"),
    ("suffix:fallback=(ngram:depth=2)", "ngram has no option 'depth'"),
    ("suffix:nodes=3", "suffix has no option 'nodes'.*its options: k, model, fallback, global_max_nodes"),
    ("eagle:tree=static,kind=static", "eagle has no option 'kind'"),
])
def test_an_unknown_option_of_a_builtin_kind_is_refused_when_read(text, needle):
    with pytest.raises(SpecDecodeError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        DrafterSpec.parse(text)
    assert "\n" not in str(err.value)
    assert DrafterSpec.parse("echo-test:width=3", bare_model=False).options == (("width", "3"),)  # checked at build


@pytest.mark.parametrize("text", ["draft-model:k=3", "tree-draft:kind=static", "cross-vocab", "suffix:fallback=(draft-model)"])
def test_a_model_kind_without_its_model_is_refused_by_check(text):
    spec = DrafterSpec.parse(text)
    with pytest.raises(SpecDecodeError, match="drafts with a second model, but the spec names none: add model=MODEL"):
        spec.check()


@pytest.mark.parametrize("draft", ["ngram:k=3,foo=1", "draft-model:k=3", "tree-draft:kind=static"])
def test_the_spec_refuses_before_any_model_loads(monkeypatch, draft):
    """The library, serve and generate refuse a bad spec before a model loads: with a target path that does not
    exist (a load would fail otherwise) and every loader failing the test."""
    from specdecode import cli
    from specdecode.generator import SpecDecoder
    from specdecode.server.launch import ServeOptions, check_options

    for name in ("specdecode.models.load_model", "specdecode.lowbit.load_in_precision",
                 "specdecode.precision.load_target", "specdecode.generator.load_target"):
        monkeypatch.setattr(name, lambda *a, **k: pytest.fail("a model was loaded"))
    bogus = "/nonexistent/target-model"
    with pytest.raises(SpecDecodeError, match="no option 'foo'|names none"):
        SpecDecoder.from_pretrained(bogus, draft, progress=False)
    with pytest.raises(SpecDecodeError, match="no option 'foo'|names none"):
        check_options(ServeOptions(target=bogus, draft=draft))
    assert cli.main(["generate", "--target", bogus, "--draft", draft, "--prompt", "hi"]) != 0


_keys = st.sampled_from(["min_ngram", "max_ngram"])


@st.composite
def specs(draw):
    kind = draw(st.sampled_from(["none", "ngram", "layer-skip", "suffix", "eagle", "draft-model", "tree-draft"]))
    if kind == "none":
        return DrafterSpec()
    gamma = draw(st.none() | st.integers(1, 64))
    model = draw(st.sampled_from(["m", "org/model-1", "smoke:tiny"])) if kind in ("draft-model", "tree-draft") else None
    opts: dict = {}
    if kind == "ngram":
        low = draw(st.integers(1, 6))
        opts = {"min_ngram": low, "max_ngram": draw(st.integers(low, 8))}
    elif kind == "layer-skip":
        opts = {"skip_layers": "/".join(map(str, draw(st.sets(st.integers(0, 40), max_size=5))))}
    elif kind == "suffix":
        opts = {"max_spec_nodes": draw(st.integers(1, 64))}
    elif kind == "eagle":
        opts = {"tree": draw(st.sampled_from(["none", "static", "dynamic"])), "num_nodes": draw(st.integers(1, 64))}
    elif kind == "tree-draft":
        opts = {"kind": draw(st.sampled_from(["static", "dynamic"])), "num_nodes": draw(st.integers(1, 64))}
    text = kind + ":" + ",".join([f"k={gamma}"] * (gamma is not None) + [f"model={model}"] * (model is not None)
                                 + [f"{k}={v}" for k, v in opts.items()])
    spec = DrafterSpec.parse(text)
    if kind == "suffix" and draw(st.booleans()):
        spec = dataclasses.replace(spec, fallback=DrafterSpec.parse(draw(st.sampled_from(["ngram:max_ngram=5", "m"]))))
    return spec


@settings(max_examples=200, deadline=None)
@given(specs())
def test_str_reads_back_as_the_same_spec(spec):
    assert DrafterSpec.parse(str(spec)) == spec
    assert DrafterSpec.from_settings({"num_speculative_tokens": spec.num_speculative_tokens or 5,
                                      **spec.settings()}).with_gamma(spec.num_speculative_tokens) == spec


def test_the_defaults_copied_without_torch_equal_the_proposers_configs():
    from specdecode.proposers.factory import config_type

    for kind, fields in DEFAULTS.items():
        config = config_type(kind)()
        assert {k: str(getattr(config, k)) for k in fields} == fields, kind
    for kind, options in OPTIONS.items():  # the option names: every config field, no other
        config = config_type(kind) if kind != "none" else None
        assert options == (tuple(f.name for f in dataclasses.fields(config)) if config else ()), kind
    assert set(OPTIONS) == set(BUILTIN_KINDS)


# --------------------------------------------------------------------------- one engine from one spec


SPECS = ["ngram:k=4,max_ngram=4", "suffix:k=3,max_spec_nodes=8,fallback=(ngram)", "draft-model:k=3,model=DRAFT",
         "tree-draft:k=3,model=DRAFT,kind=static,num_nodes=6", "none"]


def _facts(engine, target_model):
    """What must agree: the proposer's type and config (and its fallback's), γ, and the weights run."""
    from specdecode.lowbit import weight_digest

    prop = engine.proposer
    fallback = getattr(prop, "fallback", None)
    return (type(prop).__name__, getattr(prop, "config", None), type(fallback).__name__,
            getattr(fallback, "config", None), engine.config.num_speculative_tokens, weight_digest(target_model))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from conftest import save_tiny_model_dir

    root = tmp_path_factory.mktemp("pair")
    return str(save_tiny_model_dir(root / "target", seed=0)), str(save_tiny_model_dir(root / "draft", seed=1))


@pytest.mark.parametrize("text", SPECS)
def test_every_front_end_builds_the_same_engine_from_one_spec(pair, text, tmp_path):
    from specdecode.bench.runner import BenchConfig, Models, build_variants, load_any
    from specdecode.generator import SpecDecoder
    from specdecode.server.launch import ServeOptions, load_state
    from specdecode.tune import Candidate
    from specdecode.tune.measure import _Session

    target_dir, draft_dir = pair
    spec = DrafterSpec.parse(text.replace("DRAFT", draft_dir))
    # the library
    lib = SpecDecoder.from_pretrained(target_dir, spec, weights="fp32", progress=False)
    want = _facts(lib.engine, lib.target.model)
    # serve: the flags of the same spec (its compact form in --draft)
    state = load_state(ServeOptions(target=target_dir, draft=str(spec), weights="fp32", policy="fixed"),
                       progress=False)
    assert _facts(state.engine, state.target.model) == want
    # audit runs SpecDecoder.from_pretrained (above) and assembles its in-process engine with build.assemble
    from specdecode.build import assemble

    audit = assemble(lib.target, lib.proposer, num_speculative_tokens=lib.num_speculative_tokens, policy=lib.policy)
    assert _facts(audit, lib.target.model) == want
    # bench: --methods is the compact form
    target, _ = load_any(target_dir, "float32", weights="fp32", target=True)
    if spec.kind != "none":
        cfg = BenchConfig(target=target_dir, methods=(str(spec),), datasets=("smoke",), weights="fp32",
                          output=str(tmp_path / "b"))
        variants = build_variants(cfg, Models(target), "float32", status=lambda line: None)
        mine = [v for v in variants if v.key == f"specdecode/{spec}"]
        assert len(mine) == 1
        assert _facts(mine[0].run.engine, target.model) == want
    # tune: a candidate is the spec, built through the same builder
    session = _Session.__new__(_Session)
    session.config = type("C", (), {"max_new_tokens": 4, "temperature": 0.0, "cache_dir": None})()
    session.target, session.eos, session.drafts = target, target.eos_token_ids, {}
    if spec.model_spec:
        session.drafts[spec.model_spec] = load_any(spec.model_spec, "float32", weights="fp32")[0]
    if spec.kind != "none":
        run = session.runner(Candidate("c", spec), spec.num_speculative_tokens)
        assert _facts(run.engine, target.model) == want


def test_options_written_in_the_compact_form_win_over_the_flags_even_at_their_default():
    """``--draft ngram:max_ngram=3 --ngram-max 5`` runs max_ngram 3 (the spec's own option), as ``ngram:max_ngram=4``
    runs 4; without the option the flag applies."""
    assert DrafterSpec.from_settings({"draft": "ngram:max_ngram=3", "ngram_max": 5}).option("max_ngram", "3") == "3"
    assert DrafterSpec.from_settings({"draft": "ngram:max_ngram=4", "ngram_max": 5}).option("max_ngram") == "4"
    assert DrafterSpec.from_settings({"draft": "ngram", "ngram_max": 5}).option("max_ngram") == "5"


@pytest.mark.parametrize("draft, skip_ok, draft_weights_ok", [
    ("layer-skip:k=3", True, False), ("layer-skip", True, False), ("ngram:k=3", False, False),
    ("suffix:ngram", False, False), ("eagle", False, False), ("smollm2-135m", False, True),
    ("draft-model:model=smollm2-135m,k=3", False, True), ("suffix:smollm2-135m", False, True),
])
def test_the_command_line_reads_a_compact_draft_as_the_spec_does(draft, skip_ok, draft_weights_ok):
    """--skip-layers goes with a layer-skip drafter and --draft-weights with one that loads a draft model, whether
    --draft names it in a word or in the compact form."""
    import argparse

    from specdecode.cliargs import check_drafter_flags

    def check(**flags):
        base = {"draft": draft, "skip_layers": None, "draft_weights": None, "dtype": None, "weights": None}
        check_drafter_flags(argparse.Namespace(**{**base, **flags}))

    for flags, ok in (({"skip_layers": "3,5"}, skip_ok), ({"draft_weights": "int8"}, draft_weights_ok)):
        if ok:
            check(**flags)
        else:
            with pytest.raises(SpecDecodeError):
                check(**flags)


@pytest.mark.parametrize(("word", "kind"), [("ngam", "ngram"), ("sufix", "suffix"), ("eagel", "eagle")])
def test_a_misspelt_drafter_is_named_before_any_model_loads(word, kind):
    with pytest.raises(SpecDecodeError, match=f"did you mean the drafter '{kind}'"):
        DrafterSpec.parse(word)


@pytest.mark.parametrize("word", ["qwen2.5-coder-0.5b", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M", "smoke:tiny"])
def test_model_words_stay_draft_models(word):
    assert DrafterSpec.parse(word).model == word
