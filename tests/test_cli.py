"""The ``specdecode`` command line, run in-process through ``main(argv)`` on the tiny model directory."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode import cli

JSON_FIELDS = {
    "text", "token_ids", "num_generated_tokens", "num_drafted_tokens", "num_accepted_tokens", "acceptance_rate",
    "mean_accepted_length", "acceptance_by_position", "num_target_forwards", "draft_time_s", "verify_time_s",
    "other_time_s", "wall_time_s", "tokens_per_s", "finish_reason", "prompt_id",
}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_generate_json_has_every_field(capsys, tiny_model_dir, tiny_loaded):
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "the cat and the dog",
                          "--max-new-tokens", "30", "--ignore-eos", "--json")
    assert code == 0, err
    (rec,) = _json_lines(out)
    assert JSON_FIELDS <= rec.keys()
    assert rec["prompt_id"] == "prompt" and rec["finish_reason"] == "length"
    assert rec["num_generated_tokens"] == len(rec["token_ids"]) == 30
    assert tiny_loaded.tokenizer.decode(rec["token_ids"], skip_special_tokens=True) == rec["text"]
    assert rec["num_target_forwards"] <= 30 and 0.0 <= rec["acceptance_rate"] <= 1.0
    assert "loading target" in err  # status goes to stderr, not into the JSON stream


def test_compare_baseline_matches_greedily(capsys, tiny_model_dir):
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "once upon a time",
                          "--max-new-tokens", "40", "--ignore-eos", "-k", "3", "--compare-baseline", "--json")
    assert code == 0, err
    (rec,) = _json_lines(out)
    assert rec["matches_baseline"] is True
    assert rec["baseline"]["token_ids"] == rec["token_ids"] and rec["baseline"]["text"] == rec["text"]
    assert rec["baseline"]["tokens_per_s"] > 0 and rec["speedup"] > 0


@pytest.mark.parametrize(("extra", "once"), [([], False), (["--draft", "suffix"], True),
                                             (["--temperature", "0.8"], True),
                                             (["--temperature", "0.8", "--seed", "3"], False)])
def test_compare_baseline_says_when_a_prompt_was_timed_once(capsys, tiny_model_dir, extra, once):
    """A run a repeat would not reproduce (suffix decoding's global tree, unseeded sampling) is timed once, not
    the faster of two runs: the summary line says so, and says nothing when both runs were timed."""
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "once upon a time",
                          "--max-new-tokens", "8", "--ignore-eos", "--compare-baseline", *extra)
    assert code == 0, err
    assert ("timed once" in out) is once


@pytest.mark.parametrize(("extra", "runs"), [([], 2), (["--draft", "suffix"], 1),
                                             (["--draft", "suffix:use_global=false"], 2),
                                             (["--temperature", "0.8"], 1), (["--temperature", "0.8", "--seed", "3"], 2),
                                             (["--policy", "heuristic"], 2), (["--policy", "cost-model"], 2)])
def test_compare_baseline_times_the_faster_of_two_interleaved_runs(capsys, tiny_model_dir, monkeypatch, extra, runs):
    """Greedy or seeded: baseline, speculative, baseline, speculative, the faster of each kept (here the second
    baseline and the first speculative run, by scripted wall times); once each where a repeat would not be the
    same run (unseeded sampling; suffix decoding's global tree drafting from the first answer). An adaptive
    policy is put back as it was before the first run, so its repeat is the same run too."""
    from specdecode.generator import SpecDecoder

    calls, states = [], []
    real = SpecDecoder.generate
    scripted = {"plain": [2.0, 1.0], "spec": [1.0, 2.0]}  # seconds of wall time, run 1 and run 2

    def scripted_times(self, *args, **kwargs):
        who = "spec" if self.proposer is not None else "plain"
        if who == "spec" and kwargs.get("max_new_tokens") != 2:
            pol = self.policy  # what an adaptive policy has learned before this run (heuristic: gamma; cost-model: steps)
            states.append((getattr(pol, "gamma", None), getattr(pol, "_steps", None),
                           list(getattr(getattr(pol, "accept", None), "hits", []))))
        out = real(self, *args, **kwargs)
        if kwargs.get("max_new_tokens") == 2:  # the warm-up
            return out
        wall = scripted[who][sum(c[0] == who for c in calls)]
        calls.append((who, out.token_ids))
        out.metrics.wall_time_s = wall
        return out

    monkeypatch.setattr(SpecDecoder, "generate", scripted_times)
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt",
                          "the cat and the dog and the cat and the dog", "--max-new-tokens", "12", "--ignore-eos",
                          "--compare-baseline", "--json", *extra)
    assert code == 0, err
    assert [c[0] for c in calls] == ["plain", "spec"] * runs
    (rec,) = _json_lines(out)
    assert rec["timed_runs"] == runs
    assert rec["baseline"]["wall_time_s"] == (1.0 if runs == 2 else 2.0) and rec["wall_time_s"] == 1.0
    assert rec["speedup"] == pytest.approx(rec["baseline"]["wall_time_s"] / 1.0)
    if "--temperature" not in extra or "--seed" in extra:  # a repeatable run: every run commits the same tokens
        assert rec["matches_baseline"] and all(ids == calls[0][1] for _, ids in calls)
    if runs == 2:
        assert states[0] == states[1]  # the repeat starts where the first run started


def test_a_decoder_that_does_not_repeat_itself_is_named(capsys, tiny_model_dir, monkeypatch):
    """Of the four runs of a prompt, the second plain run commits another token and is the faster plain run (so
    the fastest runs compared would blame speculation): the line says that plain decoding did not repeat itself in
    this process, not that speculation left its path, and the prompt does not match."""
    from specdecode.generator import SpecDecoder

    real, seen = SpecDecoder.generate, []

    def second_plain_run_differs(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.proposer is None and kwargs.get("max_new_tokens") != 2:
            seen.append(1)
            out.metrics.wall_time_s = 2.0 if len(seen) == 1 else 1.0
            if len(seen) == 2:
                out.token_ids = [*out.token_ids[:-1], (out.token_ids[-1] + 1) % 50]
        return out

    monkeypatch.setattr(SpecDecoder, "generate", second_plain_run_differs)
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "the cat and the dog",
                          "--max-new-tokens", "8", "--ignore-eos", "--compare-baseline", "--json")
    assert code == 0, err
    (rec,) = _json_lines(out)
    assert not rec["matches_baseline"]
    assert rec["difference"].startswith("plain decoding gave different tokens in two runs of this prompt")
    assert "speculative" not in rec["difference"]


@pytest.mark.parametrize("width", [80, 160])
def test_the_prompt_table_keeps_every_figure_whole_on_an_80_column_terminal(monkeypatch, capsys, width):
    import io

    from rich.console import Console

    from specdecode import cli_generate

    rec = {"prompt_id": "spec-bench/131", "num_generated_tokens": 128, "num_drafted_tokens": 128,
           "num_accepted_tokens": 97, "acceptance_rate": 0.758, "mean_accepted_length": 4.23,
           "num_target_forwards": 31, "tokens_per_s": 357.7, "baseline": {"tokens_per_s": 184.7}, "speedup": 1.94,
           "matches_baseline": True}
    buf = io.StringIO()
    monkeypatch.setattr(cli_generate, "_console", lambda: Console(file=buf, width=width, highlight=False))
    cli_generate._print_aggregate([rec, rec], True)
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    for cell in ("spec-bench/131", "75.8%", "4.23", "357.7", "184.7", "1.94x", "yes", "2/2", "base tok/s", "match"):
        assert cell in text, (cell, text)
    assert ("drafted" in text) == (width >= 110)


def test_every_proposer_says_whether_it_remembers_requests(tiny_model_dir):
    """A repeat is timed only where nothing carries from one request to the next: suffix decoding with its
    global tree (or a fallback that remembers) and layer skipping (its searched set) say they remember."""
    from specdecode.proposers import GlobalSuffixTree, NgramProposer, SuffixConfig, SuffixProposer
    from specdecode.proposers.base import DraftModelSlots, Proposer, RowProposer
    from specdecode.proposers.layer_skip import LayerSkipProposer

    assert Proposer.remembers_requests  # unknown proposers: assume they do
    assert not RowProposer.remembers_requests and not DraftModelSlots.remembers_requests
    assert not NgramProposer.remembers_requests and LayerSkipProposer.remembers_requests
    assert SuffixProposer().remembers_requests
    assert not SuffixProposer(SuffixConfig(use_global=False)).remembers_requests
    assert not SuffixProposer(SuffixConfig(use_global=False), fallback=NgramProposer()).remembers_requests
    remembering = SuffixProposer(SuffixConfig(use_global=True), global_tree=GlobalSuffixTree(SuffixConfig().max_depth, 1000))
    assert SuffixProposer(SuffixConfig(use_global=False), fallback=remembering).remembers_requests


def test_generate_streams_text_then_metrics(capsys, tiny_model_dir):
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "the cat and the dog",
                          "--max-new-tokens", "25", "--ignore-eos", "--compare-baseline")
    assert code == 0, err
    code2, out2, _ = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "the cat and the dog",
                          "--max-new-tokens", "25", "--ignore-eos", "--json")
    text = _json_lines(out2)[0]["text"]
    assert text in out
    for word in ("acceptance rate", "tau", "acceptance by position", "target forwards", "tokens/s", "speedup",
                 "matches baseline: yes"):
        assert word in out


def test_stop_flag_cuts_the_output(capsys, tiny_model_dir):
    argv = ["generate", "--target", str(tiny_model_dir), "--prompt", "the cat and the dog", "--max-new-tokens", "40",
            "--ignore-eos", "--json"]
    _, out, _ = _run(capsys, *argv)
    full = _json_lines(out)[0]["text"]
    stop = full[10:13]
    code, out, err = _run(capsys, *argv, "--stop", stop, "--stop", "never-there")
    assert code == 0, err
    rec = _json_lines(out)[0]
    assert rec["finish_reason"] == "stop" and full[: full.find(stop)].startswith(rec["text"])
    assert rec["num_generated_tokens"] == len(rec["token_ids"]) < 40


@pytest.mark.shared_data
def test_dataset_prompts_use_the_chat_template_by_default(capsys, tiny_model_dir):
    base = ["generate", "--target", str(tiny_model_dir), "--dataset", "spec-bench:writing:2", "--max-new-tokens", "8",
            "--json"]
    code, out, err = _run(capsys, *base)
    assert code == 0, err
    recs = _json_lines(out)
    assert [r["prompt_id"] for r in recs] == ["spec-bench/81", "spec-bench/82"]
    assert all(r["chat"] and r["category"] == "writing" for r in recs)
    code, out, err = _run(capsys, *base[:-3], "--dataset", "spec-bench:writing:1", "--max-new-tokens", "8", "--json",
                          "--no-chat")
    assert code == 0, err
    assert _json_lines(out)[0]["chat"] is False


@pytest.mark.shared_data
def test_several_prompts_print_an_aggregate(capsys, tiny_model_dir):
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--dataset", "spec-bench:writing:2",
                          "--max-new-tokens", "8", "--ignore-eos", "--compare-baseline")
    assert code == 0, err
    assert "median" in out and "2 prompts" in out and "2/2" in out


@pytest.mark.shared_data
def test_default_prompts_are_the_first_five_spec_bench_extraction_questions():
    args = cli.build_parser().parse_args(["generate"])
    jobs = cli.read_jobs(args)
    assert args.target == "smollm2-135m" and args.draft == "ngram"
    assert [j.id for j in jobs] == [f"spec-bench/{i}" for i in range(131, 136)]
    assert all(j.category == "extraction" and j.chat_default for j in jobs)
    assert jobs[0].text.startswith("Evaluate the following movie reviews")


def test_without_shared_data_the_default_prompt_falls_back_to_humaneval_and_says_so(monkeypatch):
    from specdecode import cli_generate
    from specdecode.data import SharedDataMissing

    real = cli_generate.load_prompts

    def no_shared(spec, say=None):
        if spec.startswith("spec-bench"):
            raise SharedDataMissing("../shared/data is not beside the project")
        return real(spec, say=say)

    monkeypatch.setattr(cli_generate, "load_prompts", no_shared)
    notes = []
    jobs = cli.read_jobs(cli.build_parser().parse_args(["generate"]), say=notes.append)
    assert [j.id for j in jobs] == ["HumanEval/0"]
    assert "using humaneval:1 instead" in notes[0]
    assert "no prompt given" in notes[1] and "HumanEval/0" in notes[1] and "extraction" not in notes[1]


def test_a_bad_flag_without_a_prompt_flag_is_one_error_line_before_any_notice(capsys):
    code, out, err = _run(capsys, "generate", "--target", "/nonexistent/model/dir")
    assert code != 0 and "no such file or directory" in err
    assert "no prompt given" not in err  # the default prompts are named only once the flags pass


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--target", "/nonexistent/model/dir"], "no such file or directory"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--temperature", "hot"], "invalid float value"),
        (["-k", "-1"], "num_speculative_tokens"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
        (["--prompt", "a" * 300], "exceeds the model's context"),
        (["--prompt", "x", "--dataset", "gsm8k:1"], "not allowed with"),
        (["--dataset", "nope:3"], "unknown dataset"),
        (["--dataset", "gsm8k:0"], "positive integer"),
        (["--ngram-min", "4", "--ngram-max", "2"], "min_ngram"),
        (["--stop", ""], "stop strings"),
        (["--dtype", "int3"], "invalid choice"),
    ],
)
def test_bad_inputs_exit_2_with_one_error_line(capsys, tiny_model_dir, argv, needle):
    full = ["generate", "--max-new-tokens", "4", *argv]
    if "--target" not in argv:
        full += ["--target", str(tiny_model_dir)]
    if not {"--prompt", "--prompt-file", "--dataset"} & set(argv):
        full += ["--prompt", "hello"]
    code, out, err = _run(capsys, *full)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err and out == ""


def test_help_in_process(capsys):
    code, out, _ = _run(capsys, "generate", "--help")
    assert code == 0
    for flag in ("--target", "--draft", "--prompt", "--prompt-file", "--dataset", "--chat", "--max-new-tokens",
                 "--temperature", "--top-k", "--top-p", "--seed", "--num-speculative-tokens", "--ngram-min",
                 "--ngram-max", "--stop", "--ignore-eos", "--compare-baseline", "--json", "--cache-dir", "--dtype",
                 "--min-p", "--repetition-penalty", "--presence-penalty", "--frequency-penalty", "--logit-bias",
                 "--min-tokens", "--stop-token-id", "--sampling-mode", "--verification"):
        assert flag in out
    assert cli.main([]) == 2
    assert "choose a command" in capsys.readouterr().err


def test_help_as_a_subprocess():
    exe = shutil.which("specdecode") or str(Path(sys.executable).parent / "specdecode")
    cmd = [exe, "--help"] if Path(exe).exists() else [sys.executable, "-m", "specdecode.cli", "--help"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout and "speculative" in result.stdout


def test_python_m_specdecode_is_the_command():
    result = subprocess.run([sys.executable, "-m", "specdecode", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("specdecode "), result.stderr


#: Run in a fresh interpreter: each argv through ``main``, then which heavy modules got imported.
_LIGHT_COMMANDS_SCRIPT = """
import contextlib, io, json, sys
from specdecode.cli import main
codes, errors = [], []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        codes.append(main(argv))
    errors.append(err.getvalue())
heavy = [m for m in ("torch", "transformers", "fastapi", "uvicorn", "pydantic", "numpy") if m in sys.modules]
print(json.dumps({"codes": codes, "errors": errors, "heavy": heavy}))
"""


#: Range errors and contradictions found with no model, each with a word its one error line must hold.
_REFUSED_WITHOUT_MODEL_CODE = [
    (["generate", "-k", "0"], "-k/--num-speculative-tokens: num_speculative_tokens"),
    (["generate", "--temperature", "-1"], "--temperature: temperature"),
    (["generate", "--top-p", "0"], "--top-p: top_p"),
    (["generate", "--top-k", "-3"], "--top-k: top_k"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens: max_new_tokens"),
    (["generate", "--seed", "-1"], "--seed"),
    (["generate", "--tree-nodes", "0"], "--tree-nodes"),
    (["generate", "--tree", "static"], "needs a draft model"),
    (["generate", "--ngram-min", "3", "--ngram-max", "1"], "min_ngram <= max_ngram"),
    (["generate", "--stop", ""], "--stop"),
    (["generate", "--draft", "layer-skip", "--skip-layers", "x"], "comma-separated"),
    (["serve", "--max-batch-size", "0"], "--max-batch-size: max_batch_size"),
    (["serve", "--max-queue", "-1"], "--max-queue"),
    (["serve", "-k", "65"], "num_speculative_tokens"),
    (["serve", "--max-request-bytes", "10"], "--max-request-bytes"),
    (["serve", "--default-max-tokens", "0"], "--default-max-tokens"),
    (["serve", "--draft", "suffix", "--tree-nodes", "65"], "--tree-nodes"),
    (["serve", "--draft", "ngram", "--tree", "dynamic"], "needs a draft model"),
    (["serve", "--draft", "layer-skip", "--forward", "hf"], "--forward auto or owned"),
    (["serve", "--port", "70000"], "--port"),
    (["generate", "--threads", "0"], "--threads"),
    (["generate", "--dataset", "nope"], "unknown dataset"),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
    (["generate", "--prompt-file", "/"], "is a directory"),
    (["serve", "--threads", "-2"], "--threads"),
    (["serve", "--threads", "100000"], "--threads 100000: this process may use"),
    (["generate", "--threads", "100000"], "--threads 100000: this process may use"),
    (["tune", "--dataset", "humaneval:1", "--threads", "100000"], "--threads 100000"),
    (["train-drafter", "--threads", "100000"], "--threads 100000"),
    (["bench", "--smoke", "--threads", "100000"], "--threads 100000"),
    (["audit", "--local", "--prompt", "hi", "--threads", "100000"], "--threads 100000"),
    (["tune", "--dataset", "humaneval:1", "--output", "/proc/specdecode-t.toml"], "--output /proc/specdecode-t.toml"),
    (["train-drafter", "--work-dir", "/proc/specdecode-no"], "--work-dir /proc/specdecode-no: cannot write"),
    (["train-drafter", "--out", "/proc/specdecode-no"], "--out /proc/specdecode-no: cannot write"),
    (["bench", "--smoke", "--output", "/proc/specdecode-no"], "--output /proc/specdecode-no: cannot write"),
    (["audit", "--local", "--prompt", "hi", "--output", "/proc/specdecode-no"], "--output /proc/specdecode-no"),
    (["train-drafter", "--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["tune", "--dataset", "humaneval:1", "--drafters", ""], "--drafters is empty"),
    (["tune", "--dataset", "humaneval:1", "--max-new-tokens", "0"], "--max-new-tokens: max_new_tokens"),
    (["generate", "--config", "/"], "--config /: is a folder"),
    (["bench", "--smoke", "--output", ""], "--output is empty"),
    (["generate", "--min-p", "2"], "--min-p: min_p"),
    (["generate", "--repetition-penalty", "0"], "--repetition-penalty: repetition_penalty"),
    (["generate", "--presence-penalty", "3"], "--presence-penalty: presence_penalty"),
    (["generate", "--frequency-penalty", "-3"], "--frequency-penalty: frequency_penalty"),
    (["generate", "--logit-bias", "5=200"], "--logit-bias: logit_bias values"),
    (["generate", "--logit-bias", "5"], "TOKEN_ID=BIAS"),
    (["generate", "--logit-bias=-1=3"], "--logit-bias: logit_bias keys"),
    (["generate", "--max-new-tokens", "5", "--min-tokens", "9"], "--min-tokens: min_tokens"),
    (["generate", "--stop-token-id", "-4"], "--stop-token-id: stop_token_ids"),
    (["generate", "--sampling-mode", "weird"], "invalid choice"),
    (["generate", "--verification", "tree"], "invalid choice"),
    (["serve", "--verification", "tree"], "invalid choice"),
    (["serve", "--router", "prefix"], "only to replicas"),
    (["serve", "--replicas", "2", "--route-imbalance", "5"], "give --router prefix"),
    (["serve", "--replicas", "2", "--ray-config", "/"], "is a directory"),
    (["serve", "--replicas", "0"], "--replicas must be"),
    (["serve", "--replicas", "2", "--min-replicas", "3"], "within"),
    (["serve", "--replicas", "2", "--ray-config", "/no/such.yaml"], "no such file"),
    (["serve", "--api-key", ""], "--api-key is empty"),
    (["serve", "--api-key", "  "], "--api-key is empty"),
    (["serve", "--served-model-name", ""], "--served-model-name is empty"),
]


def test_help_and_argument_errors_import_no_model_code():
    """--help of every command, an unknown flag and every refusal that needs no model (a value out of range, a
    drafter that does not fit its flags) answer without torch, transformers or the server stack."""
    argvs = [["--help"], ["generate", "--help"], ["bench", "--help"], ["serve", "--help"], ["--version"],
             ["generate", "--bad-flag"], ["serve", "--port", "many"], ["bench", "--limit", "x"],
             *(argv for argv, _ in _REFUSED_WITHOUT_MODEL_CODE)]
    result = subprocess.run([sys.executable, "-c", _LIGHT_COMMANDS_SCRIPT, json.dumps(argvs)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["heavy"] == []
    assert report["codes"] == [0, 0, 0, 0, 0] + [2] * (len(argvs) - 5), report["errors"]
    for err in report["errors"][5:]:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "--bad-flag" in report["errors"][5] and "specdecode generate --help" in report["errors"][5]
    for (argv, needle), err in zip(_REFUSED_WITHOUT_MODEL_CODE, report["errors"][8:]):
        assert needle in err, (argv, err)


def test_top_level_help_lists_each_command_once(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for command in ("generate", "bench", "serve"):
        assert sum(line.split()[:1] == [command] for line in out.splitlines()) == 1, out
    assert "{generate,bench,serve}" not in out


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_help_says_each_default_once(capsys, command):
    code, out, _ = _run(capsys, command, "--help")
    assert code == 0
    assert "(default: None)" not in out
    blocks = re.split(r"\n  (?=-)", out.split("\nexamples:")[0])[1:]  # one block per flag
    assert len(blocks) > 10
    for block in blocks:
        text = re.split(r"\s{2,}", block, maxsplit=1)[-1].lower()  # the help, without the flag's names
        assert text.count("default") - text.count(": default (") <= 1, block


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-k", "0"], "num_speculative_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--tree-nodes", "0"], "tree"),
        (["--tree", "static"], "needs a draft model"),
    ],
)
def test_range_errors_come_before_any_model_load(capsys, monkeypatch, argv, needle):
    """A missing --target is only found by loading it: the range error must be the one reported."""
    from specdecode.generator import SpecDecoder

    def no_load(*args, **kwargs):
        raise AssertionError("a model load was started")

    monkeypatch.setattr(SpecDecoder, "from_pretrained", no_load)
    code, out, err = _run(capsys, "generate", "--target", "/nonexistent/model/dir", "--prompt", "hi", *argv)
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--skip-layers", "1,2"], "--skip-layers chooses the layers --draft layer-skip skips"),
        (["serve", "--draft", "suffix", "--skip-layers", "1"], "add --draft layer-skip"),
        (["generate", "--draft-weights", "int8"], "loads no draft model"),
        (["serve", "--draft", "layer-skip", "--draft-weights", "bf16"], "loads no draft model"),
        (["generate", "--draft", "suffix:ngram", "--draft-weights", "bf16"], "loads no draft model"),
        (["serve", "--policy", "heuristic", "--adaptive"], "not allowed with argument --policy: give one"),
        (["serve", "--adaptive", "--no-adaptive"], "not allowed with argument --adaptive"),
        (["bench", "--quick", "--smoke"], "not allowed with argument --quick"),
        (["bench", "--smoke", "--dtype", "bfloat16", "--weights", "int8"], "drop --dtype"),
        (["generate", "--dtype", "bfloat16", "--weights", "int8"], "--weights int8 quantizes float32 weights"),
        (["generate", "--dtype", "bfloat16", "--weights", "fp32"], "or use --weights bf16"),
        (["serve", "--dtype", "float16", "--weights", "bf16"], "drop --dtype"),
        (["serve", "--draft", "m", "--dtype", "bfloat16", "--weights", "bf16", "--draft-weights", "int8"],
         "--draft-weights int8"),
        (["bench", "--smoke", "--dtype", "bfloat16", "--draft-weights", "fp32"], "or use --draft-weights bf16"),
    ],
)
def test_contradictory_flags_are_refused_in_one_line(capsys, monkeypatch, argv, needle):
    from specdecode.bench import runner

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    code, out, err = _run(capsys, *argv, "--target", "/nonexistent/model/dir")
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err


def test_consistent_flags_pass_the_checks():
    from specdecode.cliargs import check_drafter_flags, check_precision_flags

    parser = cli.build_parser()
    for argv in (["--dtype", "bfloat16"], ["--dtype", "bfloat16", "--weights", "bf16"], ["--dtype", "float16"],
                 ["--draft", "layer-skip", "--skip-layers", "1,2"],
                 ["--draft", "suffix:layer-skip", "--skip-layers", "1"],
                 ["--draft", "some/model", "--draft-weights", "int8"],
                 ["--draft", "suffix:m", "--draft-weights", "bf16"]):
        for command in ("generate", "serve"):
            check_drafter_flags(parser.parse_args([command, *argv]))
    for dtype, weights in (("float32", "int8"), ("bfloat16", "bf16"), ("bfloat16", None), ("float16", "auto"),
                           (None, "fp32")):
        check_precision_flags(dtype, weights, None)


def test_draft_kinds_agree_with_the_library():
    """cliargs reads --draft without importing the drafters; it must read it as the drafter spec does (the words
    and the compact form alike): "model" when a draft model loads, else the kind that runs."""
    from specdecode.cliargs import _draft_kind
    from specdecode.spec import MODEL_KINDS, DrafterSpec

    for text in ("ngram", "NGRAM", " none ", "", "layer-skip", "suffix", "suffix:ngram", "suffix:layer-skip",
                 "suffix:Some/Model", "qwen2.5-coder-0.5b", "/models/draft.gguf", "ngram:k=3", "layer-skip:k=2",
                 "draft-model:model=m,k=3", "suffix:fallback=(ngram)", "eagle"):
        spec = DrafterSpec.parse(text)
        runs = spec.fallback if spec.kind == "suffix" and spec.fallback is not None else spec
        expected = "model" if spec.model_spec is not None or runs.kind in MODEL_KINDS else runs.kind
        assert _draft_kind(text) == expected, text
    assert _draft_kind("layer-skip:k=3") == "layer-skip" and _draft_kind("suffix:m") == "model"


def test_an_empty_prompt_file_is_refused_like_an_empty_prompt(tmp_path):
    from specdecode.cli import read_prompt_file
    from specdecode.errors import SpecDecodeError

    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(SpecDecodeError, match="is empty"):
        read_prompt_file(str(empty))
    (tmp_path / "p.txt").write_text("def f(x):")
    assert read_prompt_file(str(tmp_path / "p.txt")) == "def f(x):"


def test_sampling_flags_reach_the_library(capsys, tiny_model_dir, tiny_loaded):
    """Each sampling flag gives what the library gives with the same setting: both plain decoding of the same
    float32 weights (``--weights auto`` may pick another precision on a fresh machine, and a float32
    near-tie can flip between a verification and a decoding step: equality of speculative and plain
    decoding is tested elsewhere)."""
    from specdecode.generator import SpecDecoder

    plain = SpecDecoder.from_pretrained(str(tiny_model_dir), draft="none", weights="fp32", progress=False)
    prompt = "the cat and the dog and the"
    z = tiny_loaded.tokenizer.convert_tokens_to_ids("z")
    eos = tiny_loaded.eos_token_ids[0]
    cases = [
        (["--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty", "1.3"],
         dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True)),
        (["--logit-bias", f"{z}=100", "--logit-bias", "5=-100"], dict(logit_bias={z: 100.0, 5: -100.0},
                                                                       ignore_eos=True)),
        (["--logit-bias", f"{eos}=100", "--min-tokens", "3"], dict(logit_bias={eos: 100.0}, min_tokens=3)),
        (["--temperature", "0.9", "--seed", "4", "--min-p", "0.1", "--sampling-mode", "coupled", "--verification",
          "block"], dict(temperature=0.9, seed=4, min_p=0.1, coupled=True, ignore_eos=True)),
    ]
    for flags, kw in cases:
        argv = ["generate", "--target", str(tiny_model_dir), "--draft", "none", "--weights", "fp32", "--prompt", prompt,
                "--max-new-tokens", "12", "--json", "--no-warmup", *flags]
        if kw.get("ignore_eos"):
            argv.append("--ignore-eos")
        code, out, err = _run(capsys, *argv)
        assert code == 0, err
        (rec,) = _json_lines(out)
        want = plain.generate(plain.encode(prompt), max_new_tokens=12, **kw)
        assert rec["token_ids"] == want.token_ids, flags
    assert len(rec["token_ids"]) == 12
    greedy = plain.generate(plain.encode(prompt), max_new_tokens=20, ignore_eos=True).token_ids
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--draft", "none", "--weights", "fp32",
                          "--prompt", prompt, "--json", "--max-new-tokens", "20", "--ignore-eos", "--stop-token-id",
                          str(greedy[3]))
    (rec,) = _json_lines(out)
    assert rec["finish_reason"] == "stop" and rec["token_ids"] == greedy[: greedy.index(greedy[3]) + 1]


def test_a_policy_with_no_drafter_is_said_to_do_nothing_and_policy_names_take_any_case(capsys, tiny_model_dir):
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--draft", "none", "--weights", "fp32",
                          "--prompt", "hi", "--max-new-tokens", "2", "--policy", "FIXED")
    assert code == 0 and "--policy fixed has no effect with --draft none" in err


def test_token_ids_outside_the_vocabulary_are_refused_before_any_output(capsys, tiny_model_dir):
    for flag, value in (("--logit-bias", "99999=1"), ("--stop-token-id", "99999")):
        code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "hi", flag, value)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and out == "" and len(errors) == 1 and flag in errors[0] and "vocabulary" in errors[0], err


def _cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode", *argv], capture_output=True, text=True, timeout=300,
                          **kw)


def test_empty_standard_input_is_refused_as_an_empty_prompt(tiny_model_dir):
    result = _cli("generate", "--target", str(tiny_model_dir), "--prompt-file", "-", input="  \n")
    assert result.returncode == 2 and "standard input was empty" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.slow  # a subprocess
def test_a_full_disk_on_standard_output_is_one_line(tiny_model_dir):
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "specdecode", "generate", "--target", str(tiny_model_dir),
                                 "--prompt", "hi", "--max-new-tokens", "4", "--json", "--no-warmup"], stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "cannot write" in result.stderr and "No space left" in result.stderr


class _LeftPipe:
    """A standard output whose reader left after ``allowed`` writes (``| head -c N``)."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed

    def write(self, text: str) -> int:
        if self.allowed <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.allowed -= 1
        return len(text)

    def flush(self) -> None:
        if self.allowed <= 0:
            raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


def test_a_reader_leaving_the_pipe_ends_generate_quietly(tiny_model_dir, monkeypatch, capsys):
    """``specdecode generate ... | head -c 20``: the reader leaves mid-stream; exit 0, nothing on stderr."""
    monkeypatch.setattr(sys, "stdout", _LeftPipe(3))
    code = cli.main(["generate", "--target", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "30",
                     "--ignore-eos", "--no-warmup"])
    assert code == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("chat, tokens, hint", [(False, 1, True), (True, 1, False), (False, 5, False)])
def test_a_raw_prompt_that_ends_at_once_gets_a_hint_to_use_the_chat_template(capsys, chat, tokens, hint):
    from specdecode import cli_generate

    rec = {"num_generated_tokens": tokens, "finish_reason": "stop", "chat": chat, "num_drafted_tokens": 0,
           "num_accepted_tokens": 0, "acceptance_rate": 0.0, "mean_accepted_length": 0.0, "acceptance_by_position": [],
           "mean_draft_length": 0.0, "draft_length_histogram": {}, "num_target_forwards": 1, "prefill_time_s": 0.01,
           "draft_time_s": 0.0, "verify_time_s": 0.0, "other_time_s": 0.0, "wall_time_s": 0.01, "tokens_per_s": 100.0}
    cli_generate._print_summary(rec)
    assert ("try --chat" in capsys.readouterr().out) == hint


def test_a_draft_length_of_zero_points_at_plain_decoding(capsys):
    code, _, err = _run(capsys, "generate", "-k", "0", "--prompt", "x")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "got 0 (plain decoding is no drafter: --draft none" in err
    code, _, err = _run(capsys, "generate", "-k", "65", "--prompt", "x")
    assert code == 2 and "--draft none" not in err  # too long a draft: no such hint
