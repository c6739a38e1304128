"""The benchmark matrix (``specdecode.bench.runner``): method specs, the generic proposer builder, config
and settings, prompt selection and encoding, the cost probe, and the variants on the smoke models."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode.bench.runner import (
    BenchConfig,
    Models,
    build_variants,
    encode_prompt,
    expand_methods,
    load_any,
    main_gamma_of,
    needs_draft_model,
    probe_forward_times,
    quick_config,
    select_prompts,
    smoke_config,
)
from specdecode.build import build_factory
from specdecode.spec import DrafterSpec
from specdecode.bench.smoke import SMOKE_DRAFT, SMOKE_TARGET, load_smoke_model, make_tokenizer
from specdecode.proposers import PROPOSERS, NgramProposer
from specdecode.types import SpecDecodeError


# --------------------------------------------------------------------------- method specs


def parse(text):
    return DrafterSpec.parse(text, bare_model=False)  # as --methods reads it


def build_proposer(spec, target=None, draft=None):
    return build_factory(spec, target, draft)()


def test_method_spec_parsing_and_canonical_form():
    s = parse(" ngram : k=5, max_ngram=4 ,min-ngram=2")
    assert (s.kind, s.num_speculative_tokens, dict(s.options)) == ("ngram", 5, {"max_ngram": "4", "min_ngram": "2"})
    assert str(s) == "ngram:k=5,max_ngram=4,min_ngram=2"
    assert s.family == "ngram:max_ngram=4,min_ngram=2"
    assert str(parse("draft-model")) == "draft-model"
    for bad in ("", ":k=3", "ngram:k=0", "ngram:k=x", "ngram:oops"):
        with pytest.raises(SpecDecodeError):
            DrafterSpec.parse(bad, bare_model=False) if bad else expand_methods(BenchConfig(methods=(bad,)))


def test_methods_default_to_the_registry_and_expand_over_gammas():
    cfg = BenchConfig(methods=(), gammas=(1, 8), datasets=("smoke",))
    specs = expand_methods(cfg)
    names = {s.kind for s in specs}
    assert "ngram" in names and "draft-model" not in names  # no --draft: model-based methods are skipped
    assert sorted(s.num_speculative_tokens for s in specs if s.kind == "ngram") == [1, 4, 8]
    with_draft = expand_methods(dataclasses.replace(cfg, draft="some-draft", methods=("draft-model:k=3",)))
    assert [str(s) for s in with_draft] == ["draft-model:k=3,model=some-draft", "draft-model:k=1,model=some-draft",
                                            "draft-model:k=8,model=some-draft"]
    assert main_gamma_of(with_draft) == {"draft-model:model=some-draft": 3}
    with pytest.raises(SpecDecodeError, match="registered"):
        expand_methods(dataclasses.replace(cfg, methods=("no-such-method",)))


@pytest.mark.parametrize("method, needle", [
    ("ngram:k=0", r"num_speculative_tokens must be an integer in \[1, 64\]"),
    ("ngram:k=3,foo=1", "ngram has no option 'foo'"),
    ("draft-model:k=3", "names none: add model=MODEL .*or give --draft MODEL"),
    ("no-such-method", "unknown method"),
])
def test_a_bad_method_is_refused_naming_methods(method, needle):
    with pytest.raises(SpecDecodeError, match=needle) as err:
        expand_methods(BenchConfig(methods=(method,), datasets=("smoke",)))
    assert str(err.value).startswith("--methods: ") and "\n" not in str(err.value)


def test_generic_builder_fills_config_fields_with_their_types():
    prop = build_proposer(parse("ngram:k=5,max_ngram=4,min_ngram=2"))
    assert isinstance(prop, NgramProposer) and (prop.config.min_ngram, prop.config.max_ngram) == (2, 4)
    with pytest.raises(SpecDecodeError, match="no option"):
        build_proposer(parse("ngram:depth=3"))
    with pytest.raises(SpecDecodeError, match="max_ngram must be .*integer"):  # read when the spec is read
        build_proposer(parse("ngram:max_ngram=many"))
    with pytest.raises(SpecDecodeError, match="must be int"):  # a field the spec reader does not know
        build_proposer(DrafterSpec("tree-draft", options=(("top_k", "x"),)))
    with pytest.raises(SpecDecodeError, match="names a draft model, but none was loaded"):
        build_proposer(parse("draft-model:k=2"))


@dataclasses.dataclass(frozen=True)
class EchoConfig:
    width: int = 1
    scale: float = 1.0
    loud: bool = False
    shape: tuple[int, ...] = (1,)


class Echo:
    """A stand-in proposer factory with the registry's usual shape: a draft ``model`` and a config dataclass."""

    def __init__(self, model, config: EchoConfig | None = None):
        self.model, self.config = model, config


def test_a_newly_registered_proposer_plugs_in_without_harness_changes():
    PROPOSERS["echo-test"] = Echo
    try:
        spec = parse("echo-test:k=3,width=7,scale=0.5,loud=yes,shape=4/2/1,model=d1")
        assert spec.model_spec == "d1"
        prop = build_proposer(spec, draft=type("M", (), {"model": "d1", "tokenizer": None})())
        assert prop.config == EchoConfig(width=7, scale=0.5, loud=True, shape=(4, 2, 1)) and prop.model == "d1"
    finally:
        del PROPOSERS["echo-test"]


def test_prompt_selection_caps_per_category_round_robin():
    prompts = select_prompts(["smoke"], limit=1)
    assert [p.category for p in prompts] == ["summarization", "qa", "coding"]
    assert prompts[2].is_completion and not prompts[0].is_completion
    all_smoke = select_prompts(["smoke"], limit=None)
    assert [p.category for p in all_smoke[:3]] == ["summarization", "qa", "coding"] and len(all_smoke) == 6


def test_settings_added_later_keep_old_output_dirs_resumable():
    # what ran by default before --weights auto and --policy auto
    base = BenchConfig(datasets=("smoke",), weights="fp32", policy="fixed")
    assert set(base.settings()) == {"target", "max_new_tokens", "temperature", "seed", "dtype", "chat", "batch_size",
                                    "kernel"}
    assert dataclasses.replace(base, draft_weights="int8").settings_id() != base.settings_id()
    assert dataclasses.replace(base, verification="block").settings()["verification"] == "block"
    assert dataclasses.replace(base, policy="auto").settings()["policy"] == "auto"  # not the fixed records of old
    assert dataclasses.replace(base, gammas=(1, 2), limit=9, repeats=3).settings_id() == base.settings_id()
    # the thread count a run measured at (the runner always sets it): a resume at another count redoes the runs
    one, two = dataclasses.replace(base, threads=1), dataclasses.replace(base, threads=2)
    assert one.settings()["threads"] == 1 and len({one.settings_id(), two.settings_id(), base.settings_id()}) == 3


def test_method_spec_options_and_the_draft_model_it_uses():
    s = parse("draft-model:k=3,model=tiny-draft")
    assert s.model == "tiny-draft" and s.option("missing", "x") == "x"
    assert str(s.with_gamma(5)) == "draft-model:k=5,model=tiny-draft" and s.num_speculative_tokens == 3
    assert s.model_spec == "tiny-draft"
    cfg = BenchConfig(methods=("draft-model",), draft="default", datasets=("smoke",))
    assert expand_methods(cfg)[0].model_spec == "default"
    assert parse("ngram:model=x").model_spec is None  # model-free methods
    assert needs_draft_model("tree-draft") and not needs_draft_model("layer-skip")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=-1.0), "temperature"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(gamma=0), "gamma"), (dict(gammas=(2, 65)), "gamma"), (dict(limit=0), "--limit"),
    (dict(repeats=0), "--repeats"), (dict(threads=0), "--threads"), (dict(datasets=()), "no dataset"),
    (dict(weights="int3"), "precision"), (dict(draft_weights="fp16"), "precision"), (dict(kernel="fast"), "kernel"),
    (dict(verification="tree"), "--verification"),
])
def test_bench_config_is_validated(kwargs, needle):
    with pytest.raises(SpecDecodeError, match=needle):
        BenchConfig(**kwargs)


def test_presets_take_overrides():
    quick = quick_config(limit=1)
    assert (quick.preset, quick.methods, quick.gammas, quick.repeats) == ("quick", ("ngram",), (2, 4), 2)
    assert quick.limit == 1
    smoke = smoke_config(output="x", repeats=3)
    assert (smoke.target, smoke.draft, smoke.datasets, smoke.threads) == (SMOKE_TARGET, SMOKE_DRAFT, ("smoke",), 1)
    assert smoke.output == "x" and smoke.repeats == 3 and smoke.dtype == "float64"
    assert quick.settings_id() != smoke.settings_id()


def test_encode_prompt_templates_chat_prompts_only():
    tok = make_tokenizer()
    chat, completion = select_prompts(["smoke"], limit=1)[0], select_prompts(["smoke"], limit=1)[2]
    assert not chat.is_completion and completion.is_completion
    ids, templated = encode_prompt(tok, chat, chat=True)
    assert templated and tok.decode(ids).startswith("<s>user: summarize") and tok.decode(ids).endswith("assistant: ")
    plain, templated = encode_prompt(tok, chat, chat=False)
    assert not templated and "user:" not in tok.decode(plain) and all(isinstance(t, int) for t in plain)
    code, templated = encode_prompt(tok, completion, chat=True)  # completion text is never templated
    assert not templated and tok.decode(code).startswith("def add")
    tok.chat_template = None
    assert encode_prompt(tok, chat, chat=True)[1] is False


def test_probe_times_every_k_and_leaves_no_trace():
    target = load_smoke_model(SMOKE_TARGET).model
    times = probe_forward_times(target, [5, 6, 7, 8], [0, 4, 2, 2], reps=2)
    assert sorted(times) == [0, 2, 4] and all(t > 0 for t in times.values())


def test_variants_of_the_smoke_models_agree_greedily(tmp_path):
    """Our plain decoding, every method and the HF peers decode the same greedy tokens on the smoke target."""
    config = smoke_config(methods=("ngram:k=3", "draft-model:k=2"), gammas=(), output=str(tmp_path))
    models = Models(target=load_any(SMOKE_TARGET, "float64")[0])
    variants = build_variants(config, models, "float64", status=lambda msg: None)
    keys = [v.key for v in variants]
    assert keys == ["specdecode/plain", "specdecode/ngram:k=3", "specdecode/draft-model:k=2,model=smoke:draft",
                    "hf/plain", "hf/prompt-lookup:k=3,max_ngram=3", "hf/assisted:k=2,model=smoke:draft"]
    assert list(models.drafts) == [SMOKE_DRAFT]  # loaded once for ours and the peer
    assert variants[4].peer_of == "specdecode/ngram:k=3" and variants[5].draft == SMOKE_DRAFT
    ids = encode_prompt(models.target.tokenizer, select_prompts(["smoke"], limit=1)[0], chat=True)[0]
    outs = [v.run(ids, 0) for v in variants]
    assert all(o.token_ids == outs[0].token_ids for o in outs) and len(outs[0].token_ids) == config.max_new_tokens
    assert outs[0].metrics["num_drafted_tokens"] == 0 and outs[2].metrics["num_drafted_tokens"] > 0
    assert outs[3].metrics is None and all(o.wall_s > 0 for o in outs)
    assert all(v.run.engine.config.verification == "auto" for v in variants if v.engine == "specdecode")
    blocky = build_variants(dataclasses.replace(config, verification="block"), models, "float64", lambda msg: None)
    assert blocky[1].run.engine.config.verification == "block"
    described = models.describe()
    assert described["target"]["layers"] == 2 and SMOKE_DRAFT in described["drafts"]


def test_methods_is_a_semicolon_separated_list_of_specs():
    from specdecode.bench import config_from_args
    from specdecode.cli import build_parser

    args = build_parser().parse_args(["bench", "--methods", "draft-model:k=3; ngram:k=4,max_ngram=4;"])
    assert config_from_args(args).methods == ("draft-model:k=3", "ngram:k=4,max_ngram=4")


def test_without_a_terminal_progress_is_a_plain_line_every_30_seconds(tmp_path, monkeypatch, capsys):
    """In a log or CI (stderr not a terminal) the bar draws nothing: a plain line says runs done and time left."""
    from types import SimpleNamespace

    from specdecode.bench import runner
    from specdecode.bench.config import quick_config
    from specdecode.bench.records import RecordStore

    clock = iter(range(0, 10_000, 31))  # each reading 31 s after the last
    monkeypatch.setattr(runner.time, "monotonic", lambda: next(clock))
    result = SimpleNamespace(token_ids=[1], wall_s=0.1, finish_reason="length", metrics={}, engine_stats=None)
    variant = SimpleNamespace(key="plain", run=lambda ids, seed: result, info=lambda: {})
    prompts = [SimpleNamespace(key=f"p{i}", dataset="d", category="c") for i in range(3)]
    todo = [(p, variant, 0) for p in prompts]
    runner._run_matrix(todo, prompts, [variant], {p.key: ([1, 2], False) for p in prompts},
                       quick_config(repeats=1), RecordStore(tmp_path, "x"), progress=True)
    err = capsys.readouterr().err
    assert "specdecode bench: 1/3 runs" in err and "s left (p1 plain)" in err
