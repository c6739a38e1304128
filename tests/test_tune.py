"""``specdecode tune``: the decision from measurements (pure), and whole runs on tiny random models.

The whole runs are built so that wall-clock noise cannot flip the choice: a *bigram* target (attention
output zeroed, so each token is a function of the one before) falls into a short cycle that prompt
lookup copies (tau near gamma + 1, several times plain decoding even on a loaded machine), and a
flat target sampled at temperature 1 gives prompt lookup nothing (acceptance ~ 1/V); the useless case
also asks for a 30% gain, which a drafter that is never accepted cannot reach. Where only the costs
decide (a draft identical to the target: 100% acceptance but each draft token costs a target step),
the measured acceptance is kept and the draft cost is injected.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from specdecode.spec import DrafterSpec
from dataclasses import replace
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode.errors import SpecDecodeError
from specdecode.tune import (
    Candidate,
    drafter_spec,
    Choice,
    Confirmation,
    Prediction,
    TuneConfig,
    TuneResult,
    choose,
    confirmation_plan,
    predict,
    read_prompts_file,
    run_tune,
    split_prompts,
    write_settings,
)

PROMPTS = ("the cat sat on the mat. the cat sat on the mat.\n---\nhello there, hello there, hello\n---\n"
           "abc abc abc abc\n---\none two one two one two\n")


def _save(path: Path, *, seed: int = 0, scale: float = 1.0, bigram: bool = False) -> Path:
    tokenizer = make_tiny_tokenizer()
    model = make_tiny_model(len(tokenizer), seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.lm_head.weight[2].zero_()  # EOS logit 0: runs go the full length
        if bigram:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tune")
    return {"bigram": _save(root / "bigram", bigram=True), "other": _save(root / "other", seed=5),
            "flat": _save(root / "flat", scale=0.05)}


@pytest.fixture()
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS)
    return path


def _config(target: Path, prompts: Path, tmp_path: Path, **kw) -> TuneConfig:
    base = dict(target=str(target), prompts_file=str(prompts), weights="fp32", threads=1, max_new_tokens=48,
                budget_s=120.0, repeats=2, output=str(tmp_path / "tuned.toml"))
    return TuneConfig(**{**base, **kw})


# --------------------------------------------------------------------------- whole runs


@pytest.mark.slow
def test_repetitive_workload_picks_ngram(models, prompts_file, tmp_path):
    """A target whose output cycles: prompt lookup is best by construction; a random draft model as slow as the
    target is not."""
    cfg = _config(models["bigram"], prompts_file, tmp_path, drafts=(str(models["other"]),),
                  drafters=("ngram", "draft-model"), top=2, max_new_tokens=96)
    result = run_tune(cfg, progress=False, log=lambda _: None)
    ngram = result.measured["ngram"][2]
    assert ngram["acceptance_rate"] > 0.8 and ngram["tau"] > 3.0
    assert result.choice.key == "ngram" and result.choice.measured > 1.5
    confirmed = {c.key: c for c in result.confirmations}
    assert confirmed["ngram"].mismatches == 0  # greedy: the same tokens as plain decoding
    text = "\n".join(result.decision)
    assert "repetitive" in text and "→ ngram" in text
    data = tomllib.loads(Path(cfg.output).read_text())
    assert data["draft"] == "ngram" and data["num_speculative_tokens"] == result.choice.gamma
    assert data["policy"] == result.choice.policy and data["threads"] == 1 and data["weights"] == "fp32"
    assert data["tune"]["chosen"] == "ngram" and data["bench"]["methods"].startswith("ngram:k=")
    report = json.loads(Path(cfg.output).with_suffix(".json").read_text())
    assert report["choice"]["key"] == "ngram" and report["predictions"]


def test_useless_drafters_pick_plain_decoding(models, prompts_file, tmp_path):
    """A flat target sampled at temperature 1: prompt lookup is (almost) never accepted, so plain decoding."""
    cfg = _config(models["flat"], prompts_file, tmp_path, temperature=1.0, drafters=("ngram",), min_gain=0.3,
                  repeats=1)
    result = run_tune(cfg, progress=False, log=lambda _: None)
    assert result.measured["ngram"][2]["acceptance_rate"] < 0.2
    assert result.choice.key == "plain"
    assert "plain decoding" in result.decision[-1]
    data = tomllib.loads(Path(cfg.output).read_text())
    assert data["draft"] == "none" and data["tune"]["chosen"] == "plain"


def test_draft_identical_to_target_is_accepted_and_wins_when_drafting_is_cheap(models, prompts_file, tmp_path):
    """Draft == target: ~100% acceptance measured. Its real draft cost is a target step per token; with the draft
    cost injected as free, the cost model must pick it, at a long gamma."""
    spec = str(models["bigram"])
    cfg = _config(models["bigram"], prompts_file, tmp_path, drafts=(spec,), drafters=("draft-model",), top=1,
                  repeats=1, max_new_tokens=32)
    result = run_tune(cfg, progress=False, log=lambda _: None)
    key = f"draft-model:{spec}"
    cand, cap, pooled = result.measured[key]
    assert pooled["acceptance_rate"] > 0.95
    real = predict(result.plain, result.measured, result.ratio(), cfg.max_gamma)
    free = dict(result.measured)
    free[key] = (cand, cap, {**pooled, "draft_time_s": 0.0})
    cheap = predict(result.plain, free, result.ratio(), cfg.max_gamma)
    chosen = choose(cheap, [], 0.05)
    assert chosen.key == key and chosen.gamma >= 4
    best_real = max(p.speedup for p in real if p.key == key and p.policy == "fixed")
    best_free = max(p.speedup for p in cheap if p.key == key and p.policy == "fixed")
    assert best_free > best_real
    assert any(s.what == "tree:" + spec or s.what.startswith("tree") for s in result.skipped) or \
        "tree:" + spec in result.measured  # its token trees were tried too (or said why not)


def test_a_budget_that_measures_no_drafter_writes_nothing_and_says_what_it_needs(models, prompts_file, tmp_path):
    """The measuring share went to loading and plain decoding: no decision is written (a config pinning plain
    decoding would be a guess), and the refusal says how much budget a drafter needs."""
    cfg = _config(models["bigram"], prompts_file, tmp_path, drafters=("ngram", "suffix"), budget_s=0.01)
    with pytest.raises(SpecDecodeError) as info:
        run_tune(cfg, progress=False, log=lambda _: None)
    message = str(info.value)
    assert "--budget 0.01 s measured no drafter" in message and "give --budget" in message
    assert "nothing written" in message and "\n" not in message
    budget = float(message.split("give --budget ")[1].split()[0])
    assert budget > 0.01
    assert not Path(cfg.output).exists() and not Path(cfg.output).with_suffix(".json").exists()


def test_the_cli_refuses_a_budget_that_measures_nothing_in_one_line(models, prompts_file, tmp_path, capsys):
    from specdecode.cli import main

    out = tmp_path / "cli.toml"
    rc = main(["tune", "--target", str(models["bigram"]), "--prompts", str(prompts_file), "--weights", "fp32",
               "--threads", "1", "--max-new-tokens", "8", "--drafters", "ngram", "--budget", "0.01",
               "--output", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: --budget 0.01 s measured no drafter") and not out.exists()


# --------------------------------------------------------------------------- the decision (pure)


def _p(key, gamma, speedup, policy="fixed", basis="cost model"):
    return Prediction(key, gamma, policy, speedup, 1.0 + speedup, 0.5, basis)


def _c(key, gamma, speedup, policy="fixed"):
    return Confirmation(key, gamma, policy, speedup, speedup, speedup, 2.0, 0.5, 100.0, 3)


def test_choose_rules():
    preds = [_p("ngram", 4, 1.4), _p("suffix", 8, 1.2, basis="tree run"), _p("ngram", 8, 1.3)]
    assert choose(preds, [_c("ngram", 4, 1.35), _c("suffix", 8, 1.5)], 0.05).key == "suffix"
    slow = choose(preds, [_c("ngram", 4, 1.02)], 0.05)
    assert slow.key == "plain" and "1.02x" in slow.reason
    unconfirmed = choose(preds, [], 0.05)
    assert (unconfirmed.key, unconfirmed.gamma, unconfirmed.measured) == ("ngram", 4, None)
    losing = choose([_p("ngram", 1, 0.8), _p("layer-skip", 2, 0.9)], [], 0.05)
    assert losing.key == "plain" and "would be slower" in losing.reason
    assert choose([], [], 0.05).key == "plain"


def test_confirmation_plan_takes_the_best_distinct_drafters_and_the_policy():
    preds = [_p("ngram", 4, 1.4), _p("ngram", 3, 1.39), _p("suffix", 8, 1.2, basis="tree run"),
             _p("layer-skip", 3, 0.5), _p("ngram", 4, 1.4, policy="cost-model", basis="policy")]
    plan = confirmation_plan(preds, top=3)
    assert [(p.key, p.gamma, p.policy) for p in plan] == [("ngram", 4, "fixed"), ("suffix", 8, "fixed"),
                                                          ("ngram", 4, "cost-model")]
    only_losers = confirmation_plan([_p("layer-skip", 3, 0.5, basis="tree run")], top=3)
    assert [p.key for p in only_losers] == ["layer-skip"]  # the best one is still run, to check the prediction


def test_predict_from_pooled_metrics():
    """Chains: a curve over gamma from survival and costs; the cost-model policy never below plain."""
    plain = {"num_verify_steps": 10, "verify_time_s": 1.0, "other_time_s": 0.0, "num_generated_tokens": 10}
    spec = {"num_verify_steps": 10, "verify_time_s": 1.2, "other_time_s": 0.0, "draft_time_s": 0.0,
            "num_drafted_tokens": 40, "survival": [0.9, 0.8, 0.7, 0.6], "draft_lengths": [4] * 10, "tau": 4.0,
            "acceptance_rate": 0.75, "is_tree": False}
    cand = Candidate("ngram", drafter_spec("ngram"))
    preds = predict(plain, {"ngram": (cand, 4, spec)}, lambda k: 1.0 + 0.05 * k, 4)
    fixed = {p.gamma: p for p in preds if p.policy == "fixed"}
    assert set(fixed) == {1, 2, 3, 4}
    assert fixed[4].speedup == pytest.approx((1 + 0.9 + 0.8 + 0.7 + 0.6) / 1.2)
    policy = [p for p in preds if p.policy == "cost-model"]
    assert len(policy) == 1 and policy[0].speedup >= 1.0 and policy[0].gamma == preds[0].gamma


# --------------------------------------------------------------------------- settings file, config, prompts


def _result(tmp_path, cand: Candidate, gamma: int, policy: str) -> TuneResult:
    cfg = TuneConfig(target="smollm2-135m", datasets=("humaneval:2",), output=str(tmp_path / "t.toml"),
                     max_new_tokens=64, threads=2)
    r = TuneResult(config=cfg, weights="int8", threads=2, candidates={cand.key: cand})
    r.predictions = [_p(cand.key, gamma, 1.4, policy)]
    r.confirmations = [_c(cand.key, gamma, 1.3, policy)]
    r.choice = Choice(cand.key, gamma, policy, 1.3, 1.4, "because")
    r.decision = ["a line", "→ because"]
    return r


@pytest.mark.parametrize("cand,gamma,policy", [
    (Candidate("ngram", drafter_spec("ngram")), 4, "fixed"),
    (Candidate("layer-skip", DrafterSpec.parse("layer-skip:skip_layers=3/5/7")), 3, "cost-model"),
    (Candidate("tree:qwen2.5-coder-0.5b", drafter_spec("qwen2.5-coder-0.5b", "dynamic"), trees=True), 6, "fixed"),
])
def test_settings_round_trip_into_generate_serve_and_bench(tmp_path, cand, gamma, policy):
    from specdecode.cli import build_parser
    from specdecode.configfile import parse_with_config

    path = write_settings(_result(tmp_path, cand, gamma, policy), tmp_path / "t.toml")
    skip = cand.spec.skip_layers
    want = {"target": "smollm2-135m", "draft": cand.spec.settings()["draft"], "num_speculative_tokens": gamma,
            "policy": policy, "weights": "int8", "threads": 2, "tree": cand.tree,
            "skip_layers": ",".join(map(str, skip)) if skip else None}
    for command in ("generate", "serve"):
        args = parse_with_config(build_parser(), [command, "--config", str(path)])
        assert {k: getattr(args, k) for k in want} == want, command
        if cand.model:
            assert args.draft_weights == "int8"
    gen = parse_with_config(build_parser(), ["generate", "--config", str(path)])
    plain = build_parser().parse_args(["generate"])
    # what tune measured with (--max-new-tokens 64, its temperature) is no setting of generate: never carried
    assert (gen.max_new_tokens, gen.temperature) == (plain.max_new_tokens, plain.temperature)
    assert "generate" not in tomllib.loads(path.read_text())
    over = parse_with_config(build_parser(), ["generate", "--config", str(path), "-k", "2", "--threads", "1",
                                              "--policy", "heuristic"])
    assert (over.num_speculative_tokens, over.threads, over.policy, over.draft) == (2, 1, "heuristic", want["draft"])
    assert DrafterSpec.from_settings(vars(over)) == cand.spec.with_gamma(2)  # the file reads back as the spec
    bench = parse_with_config(build_parser(), ["bench", "--config", str(path)])
    assert bench.methods == str(cand.spec.with_gamma(gamma)) and bench.weights == "int8" and bench.target == "smollm2-135m"
    assert bench.draft == cand.model
    data = tomllib.loads(path.read_text())
    assert data["tune"]["candidates"][0]["method"].startswith(cand.key)
    assert path.with_suffix(".json").is_file()


def test_plain_choice_writes_draft_none(tmp_path):
    r = _result(tmp_path, Candidate("ngram", drafter_spec("ngram")), 4, "fixed")
    r.choice = Choice("plain", 0, "fixed", 1.0, None, "plain")
    data = tomllib.loads(write_settings(r, tmp_path / "p.toml").read_text())
    assert data["draft"] == "none" and "methods" not in data["bench"]


def test_config_values(tmp_path):
    with pytest.raises(SpecDecodeError, match="--budget"):
        TuneConfig(target="x", datasets=("humaneval",), budget_s=0)
    with pytest.raises(SpecDecodeError, match="--budget"):
        TuneConfig(target="x", datasets=("humaneval",), budget_s=-5)
    with pytest.raises(SpecDecodeError, match="unknown drafter 'medusa'"):
        TuneConfig(target="x", datasets=("humaneval",), drafters=("ngram", "medusa"))
    with pytest.raises(SpecDecodeError, match="one of --prompts FILE or --dataset"):
        TuneConfig(target="x")
    with pytest.raises(SpecDecodeError, match="one of --prompts FILE or --dataset"):
        TuneConfig(target="x", datasets=("humaneval",), prompts_file="p.txt")
    with pytest.raises(SpecDecodeError, match="--max-gamma"):
        TuneConfig(target="x", datasets=("humaneval",), max_gamma=0)
    with pytest.raises(SpecDecodeError, match="needs --draft"):
        TuneConfig(target="x", datasets=("humaneval",), drafters=("draft-model",))
    assert dataclasses.replace(TuneConfig(target="x", datasets=("humaneval",)), top=2).top == 2


def test_prompts_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('"one"\n\n{"prompt": "two", "category": "code", "id": 7}\n{"turns": ["three"]}\n')
    got = read_prompts_file(tmp_path / "a.jsonl")
    assert [(p.text, p.category, p.key) for p in got] == [("one", "prompts", "prompts/0"), ("two", "code", "prompts/7"),
                                                          ("three", "prompts", "prompts/2")]
    (tmp_path / "b.json").write_text('["x", {"text": "y"}]')
    assert [p.text for p in read_prompts_file(tmp_path / "b.json")] == ["x", "y"]
    (tmp_path / "c.txt").write_text("line one\n\nline two\n")
    assert [p.text for p in read_prompts_file(tmp_path / "c.txt")] == ["line one", "line two"]
    (tmp_path / "d.txt").write_text("def f():\n    pass\n---\nsecond\nprompt\n")
    assert [p.text for p in read_prompts_file(tmp_path / "d.txt")] == ["def f():\n    pass", "second\nprompt"]
    for name, text, match in (("e.txt", "\n\n", "no prompt"), ("f.jsonl", '"ok"\n{bad\n', "line 2 is not JSON"),
                              ("g.jsonl", '{"id": 1}\n', "entry 1 has no prompt"), ("h.json", '{"a": 1}', "a list")):
        (tmp_path / name).write_text(text)
        with pytest.raises(SpecDecodeError, match=match):
            read_prompts_file(tmp_path / name)
    with pytest.raises(SpecDecodeError, match="no such file"):
        read_prompts_file(tmp_path / "missing.txt")


def test_split_prompts():
    assert split_prompts(["a"], 4, 6) == (["a"], ["a"])
    assert split_prompts(list("abcdefgh"), 4, 6) == (list("abcd"), list("efgh"))
    assert split_prompts(list("abcdefghij"), 2, 3) == (list("ab"), list("cde"))


def test_cli_tune_and_its_errors(models, prompts_file, tmp_path, capsys):
    from specdecode.cli import main

    out = tmp_path / "cli.toml"
    rc = main(["tune", "--target", str(models["bigram"]), "--prompts", str(prompts_file), "--weights", "fp32",
               "--threads", "1", "--max-new-tokens", "24", "--drafters", "ngram", "--repeats", "1", "--budget", "60",
               "--output", str(out), "--no-progress"])
    assert rc == 0 and out.is_file()
    assert "decision:" in capsys.readouterr().out
    rc = main(["generate", "--config", str(out), "--prompt", "abc abc", "--max-new-tokens", "4", "--json",
               "--no-warmup"])
    assert rc == 0 and json.loads(capsys.readouterr().out.splitlines()[0])["num_generated_tokens"] == 4
    for argv, msg in ((["--budget", "0"], "--budget must be"), (["--drafters", "ngram,medusa"], "unknown drafter"),
                      (["--prompts", str(tmp_path / "none.txt")], "no such file")):
        base = ["tune", "--target", str(models["bigram"]), "--weights", "fp32"]
        if "--prompts" not in argv:
            base += ["--prompts", str(prompts_file)]
        assert main(base + argv) == 2
        assert msg in capsys.readouterr().err


def test_a_busy_machine_is_said_in_the_decision():
    from specdecode.tune import busy_line

    assert busy_line(1.9, 2.2, threads=2, cores=2) is None  # the run's own two threads
    assert busy_line(None, None, threads=2, cores=2) is None
    line = busy_line(1.0, 4.6, threads=2, cores=2)
    assert line is not None and "4.6" in line and "noisy" in line
    assert busy_line(5.0, None, threads=8, cores=8) is None


def test_an_unwritable_output_is_refused_before_measuring(tmp_path):
    from specdecode.tune import check_output
    from specdecode.types import SpecDecodeError

    check_output(tmp_path / "new" / "t.toml")  # a folder that can be made (a library caller's path)
    assert not (tmp_path / "new").exists()  # probed, then removed: nothing left behind
    with pytest.raises(SpecDecodeError, match="does not exist"):
        check_output(tmp_path / "new" / "t.toml", default=False)  # the command line: a named folder must exist
    with pytest.raises(SpecDecodeError, match="is a folder"):
        check_output(tmp_path)
    with pytest.raises(SpecDecodeError, match="cannot write it"):
        check_output("/proc/no-such-dir/t.toml")
    (tmp_path / "t.json").mkdir()  # the report beside the settings file cannot be written
    with pytest.raises(SpecDecodeError, match="its .json report"):
        check_output(tmp_path / "t.toml")


def test_a_thread_count_is_written_only_when_the_user_chose_one(tmp_path):
    r = _result(tmp_path, Candidate("ngram", drafter_spec("ngram")), 4, "fixed")
    assert r.chosen_settings()["threads"] == 2
    r.config = replace(r.config, threads=None)  # tune sampled the idle cores: each later run samples its own
    assert "threads" not in r.chosen_settings()


def test_a_run_that_measured_nothing_says_to_raise_the_budget(tmp_path):
    from specdecode.tune import decision_lines

    r = TuneResult(config=TuneConfig(target="smollm2-135m", datasets=("humaneval:2",), budget_s=5,
                                     output=str(tmp_path / "t.toml")))
    assert any("raise --budget" in line for line in decision_lines(r))
    r.measured = {"ngram": None}
    assert not any("raise --budget" in line for line in decision_lines(r))
