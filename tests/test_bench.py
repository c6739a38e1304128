"""``specdecode bench`` flags (``specdecode.bench``): presets, every flag overriding its preset value, list
parsing, and ``--report-only`` on a directory without a run."""

from __future__ import annotations

import argparse

import pytest

from specdecode.bench import PRESETS, add_arguments, config_from_args, run_command
from specdecode.bench.runner import DEFAULT_DATASETS, quick_config, smoke_config
from specdecode.types import SpecDecodeError


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_presets_without_flags():
    assert PRESETS == ("full", "quick", "smoke")
    full = config_from_args(_parse())
    assert full.preset == "full" and full.output == "bench-out/full" and full.datasets == DEFAULT_DATASETS
    assert config_from_args(_parse("--quick")) == quick_config()
    assert config_from_args(_parse("--smoke")) == smoke_config()


def test_flags_override_the_preset_and_unset_ones_keep_it():
    args = _parse("--smoke", "--limit", "1", "--max-new-tokens", "9", "--temperature", "0.5", "--seed", "3",
                  "--gamma", "2", "--no-peer", "--no-chat", "--no-probe", "--no-warmup", "--repeats", "2",
                  "--kernel", "small-row", "--weights", "int8", "--draft-weights", "bf16", "--threads", "2",
                  "--output", "out-dir", "--verification", "block")
    c = config_from_args(args)
    assert c.verification == "block" and config_from_args(_parse("--smoke")).verification == "auto"
    assert (c.limit, c.max_new_tokens, c.temperature, c.seed, c.gamma) == (1, 9, 0.5, 3, 2)
    assert (c.peer, c.chat, c.probe, c.warmup, c.repeats) == (False, False, False, False, 2)
    assert (c.kernel, c.weights, c.draft_weights, c.threads, c.output) == ("small-row", "int8", "bf16", 2, "out-dir")
    smoke = smoke_config()
    assert (c.target, c.draft, c.datasets, c.methods, c.gammas, c.dtype) == (
        smoke.target, smoke.draft, smoke.datasets, smoke.methods, smoke.gammas, smoke.dtype)


def test_threads_auto_is_fixed_once_for_the_run(capsys):
    from specdecode.bench import resolve_auto_threads

    args = _parse("--smoke", "--threads", "AUTO")
    assert args.threads == "auto"
    resolve_auto_threads(args, auto=lambda: (1, "1 torch thread of 2 cores: other processes keep 1.0 cores busy"))
    assert args.threads == 1 and config_from_args(args).threads == 1
    assert "--threads auto: 1 (1 torch thread of 2 cores" in capsys.readouterr().err
    fixed = _parse("--smoke", "--threads", "2")
    resolve_auto_threads(fixed, auto=lambda: pytest.fail("a number is not resolved"))
    assert fixed.threads == 2
    with pytest.raises(SystemExit):
        _parse("--threads", "some")


def test_method_dataset_and_gamma_lists():
    args = _parse("--methods", "ngram:k=5,max_ngram=4; draft-model:k=2 ;", "--method", "suffix",
                  "--dataset", "spec-bench:coding, gsm8k", "--dataset", "humaneval", "--gammas", "1, 3,8")
    c = config_from_args(args)
    assert c.methods == ("ngram:k=5,max_ngram=4", "draft-model:k=2", "suffix")
    assert c.datasets == ("spec-bench:coding", "gsm8k", "humaneval")
    assert c.gammas == (1, 3, 8)
    with pytest.raises(SpecDecodeError, match="--gammas must be integers"):
        config_from_args(_parse("--gammas", "1,two"))
    with pytest.raises(SpecDecodeError, match="--limit"):
        config_from_args(_parse("--limit", "0"))


def test_report_only_needs_a_run_in_the_directory(tmp_path):
    with pytest.raises(SpecDecodeError, match="holds no benchmark run"):
        run_command(_parse("--report-only", "--output", str(tmp_path)))
