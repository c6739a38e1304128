"""The drafter flags shared by generate and serve: one copy, the same names and defaults in both."""

from __future__ import annotations

import argparse

import dataclasses

from specdecode import options
from specdecode.cliargs import POLICY_NAMES, add_drafter_arguments, add_serve_arguments
from specdecode.policy import POLICIES
from specdecode.server.launch import ServeOptions


def _parse(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_policy_names_are_the_registered_policies():
    assert POLICY_NAMES == tuple(POLICIES)


def test_generate_and_serve_take_the_same_drafter_flags():
    argv = ["--draft", "suffix:ngram", "-k", "3", "--ngram-min", "2", "--ngram-max", "4", "--skip-layers", "1,2",
            "--policy", "heuristic", "--tree", "dynamic", "--tree-nodes", "8", "--verification", "block",
            "--dtype", "bfloat16",
            "--weights", "int8", "--draft-weights", "bf16", "--cache-dir", "/tmp/x"]
    gen = _parse(lambda p: add_drafter_arguments(p.add_argument_group("m")), argv)
    srv = _parse(add_serve_arguments, argv)
    for key, value in vars(gen).items():
        assert getattr(srv, key) == value, key


def test_light_copies_equal_the_library_names():
    """options.py holds, without torch, the names the parsers offer; the library's copies agree."""
    from specdecode import kernels, kv
    from specdecode.server.state import ServerConfig

    assert kernels.WEIGHT_PRECISIONS is options.WEIGHT_PRECISIONS
    assert options.FORWARD_BACKENDS == kv.FORWARD_BACKENDS
    assert options.DEFAULT_MAX_REQUEST_BYTES == ServerConfig.__dataclass_fields__["max_request_bytes"].default
    assert options.WEIGHT_CHOICES == ("auto", *options.WEIGHT_PRECISIONS)


def test_serve_defaults_match_its_options():
    args = _parse(add_serve_arguments, [])
    d = ServeOptions()
    for field in dataclasses.fields(ServeOptions):
        assert getattr(args, field.name) == getattr(d, field.name), field.name
    assert _parse(add_serve_arguments, ["--no-adaptive"]).policy == "fixed"


def test_weights_default_to_auto_and_pass_through():
    """--weights auto (the default) reaches the library as the string "auto"; --draft-weights stays None."""
    for add in (lambda p: add_drafter_arguments(p.add_argument_group("m")), add_serve_arguments):
        args = _parse(add, [])
        assert (args.weights, args.draft_weights, args.dtype) == ("auto", None, "float32")
        assert _parse(add, ["--weights", "int8"]).weights == "int8"
    from specdecode.server.launch import check_options, options_from_args

    check_options(options_from_args(_parse(add_serve_arguments, [])))  # "auto" is not refused before the library


def test_auto_threads_leaves_the_cores_other_processes_keep_busy():
    from specdecode.cliargs import auto_threads, busy_cores

    assert auto_threads(cores=2, busy=0.2) == (2, None)  # quiet: every core
    assert auto_threads(cores=2, busy=0.4) == (2, None)
    threads, note = auto_threads(cores=2, busy=1.1)  # one other busy process
    assert threads == 1 and "keep 1.1 cores busy" in note and "--threads 2" in note
    assert auto_threads(cores=2, busy=7.0)[0] == 1  # never fewer than one
    assert auto_threads(cores=16, busy=3.2)[0] == 13
    busy = busy_cores(0.05)
    assert busy is None or 0.0 <= busy <= 1024


def test_auto_threads_looks_twice_before_giving_up_a_core(monkeypatch):
    """A busy first look (a process just ending) is looked at again: only what both find counts."""
    from specdecode import threads as T

    looks = []

    def sample(seq):
        def busy_cores(seconds=0.2):
            looks.append(seconds)
            return seq.pop(0)
        return busy_cores

    monkeypatch.setattr(T, "busy_cores", sample([1.9, 0.1]))
    assert T.auto_threads(cores=2) == (2, None) and len(looks) == 2  # a spike: every core
    monkeypatch.setattr(T, "busy_cores", sample([1.2, 1.0]))
    assert T.auto_threads(cores=2)[0] == 1  # a neighbour that stays
    looks.clear()
    monkeypatch.setattr(T, "busy_cores", sample([0.2]))
    assert T.auto_threads(cores=2) == (2, None) and len(looks) == 1  # quiet: one look


def test_verification_methods_and_sampling_modes_have_one_copy():
    """options.py holds them; validate, the parsers (generate, serve, bench) and the server's schema use it."""
    from typing import get_args

    from specdecode import bench, cliargs, validate
    from specdecode.server.schemas import SpeculativeOptions

    assert validate.VERIFICATION_METHODS is options.VERIFICATION_METHODS
    assert cliargs.SAMPLING_MODES is options.SAMPLING_MODES
    for add in (lambda p: add_drafter_arguments(p.add_argument_group("m")), bench.add_arguments):
        p = argparse.ArgumentParser()
        add(p)
        (action,) = [a for a in p._actions if a.dest == "verification"]
        assert tuple(action.choices) == options.VERIFICATION_METHODS
    fields = SpeculativeOptions.model_fields
    assert get_args(get_args(fields["verification"].annotation)[0]) == options.VERIFICATION_METHODS
    assert get_args(fields["sampling_mode"].annotation) == tuple(options.SAMPLING_MODES)


def test_check_token_ids_is_the_samplers_rule():
    """validate.check_token_ids (torch-free, for the CLI and the server) refuses what RequestSampler refuses,
    with the same field."""
    import pytest

    from specdecode.errors import InvalidSamplingParams, SpecDecodeError
    from specdecode.sampling import RequestSampler
    from specdecode.types import SamplingParams
    from specdecode.validate import check_token_ids

    cases = [
        ({}, None), ({"logit_bias": {9: 1.0}}, None), ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": (3, 10)}, "allowed_token_ids"), ({"banned_token_ids": (12,)}, "banned_token_ids"),
        ({"stop_token_ids": (0, 99)}, "stop_token_ids"), ({"allowed_token_ids": (5,), "logit_bias": {5: -100.0}},
                                                           "allowed_token_ids"),
        ({"allowed_token_ids": (5, 6), "banned_token_ids": (5,)}, None),
        ({"allowed_token_ids": (5, 6), "banned_token_ids": (5,), "logit_bias": {6: -100.0}}, "allowed_token_ids"),
        ({"banned_token_ids": tuple(range(9)), "logit_bias": {9: -100.0}}, "allowed_token_ids"),
        ({"banned_token_ids": tuple(range(9)), "logit_bias": {9: -99.0}}, None),
    ]
    for kw, field in cases:
        params = SamplingParams(max_new_tokens=4, **kw)
        values = dict(logit_bias=params.logit_bias, allowed_token_ids=params.allowed_token_ids,
                      banned_token_ids=params.banned_token_ids, stop_token_ids=params.stop_token_ids)
        if field is None:
            check_token_ids(10, **values)
            RequestSampler(params, (), 10)
            continue
        with pytest.raises(InvalidSamplingParams) as info:
            check_token_ids(10, **values)
        assert info.value.field == field, kw
        with pytest.raises(SpecDecodeError) as info:
            RequestSampler(params, (), 10)
        assert info.value.field == field, kw


def test_verification_reaches_the_serve_options_and_the_engine():
    from specdecode.server.launch import check_options, options_from_args

    opts = options_from_args(_parse(add_serve_arguments, ["--verification", "token"]))
    assert opts.verification == "token"
    check_options(opts)
    import pytest
    from specdecode.errors import SpecDecodeError

    with pytest.raises(SpecDecodeError, match="verification"):
        check_options(dataclasses.replace(opts, verification="tree"))


def test_build_state_passes_verification_to_the_engine(tiny_loaded):
    from specdecode.server import build_state

    state = build_state(tiny_loaded, "ngram", verification="block", max_batch_size=1)
    assert state.engine.config.verification == "block"


def test_logit_bias_entries_parse_and_sampling_modes_map():
    from specdecode.cliargs import add_sampling_arguments
    from specdecode.options import SAMPLING_MODES

    args = _parse(lambda p: add_sampling_arguments(p.add_argument_group("s")),
                  ["--logit-bias", "5=-100", "--logit-bias", "7=2.5", "--stop-token-id", "3", "--stop-token-id", "9"])
    assert args.logit_bias == [(5, -100.0), (7, 2.5)] and args.stop_token_ids == [3, 9]
    assert SAMPLING_MODES == {"auto": None, "standard": False, "coupled": True}
    defaults = _parse(lambda p: add_sampling_arguments(p.add_argument_group("s")), [])
    assert (defaults.min_p, defaults.repetition_penalty, defaults.presence_penalty, defaults.frequency_penalty,
            defaults.logit_bias, defaults.min_tokens, defaults.stop_token_ids, defaults.sampling_mode) == (
        0.0, 1.0, 0.0, 0.0, None, 0, None, "auto")


def test_generate_help_names_every_catalog_model(capsys):
    """The offline names in 'generate --help' are the catalog's, every one of them (gemma-3-270m was missing)."""
    from specdecode.cli import main
    from specdecode.models import OFFLINE_MODELS

    assert options.CATALOG_MODELS == tuple(OFFLINE_MODELS)
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in OFFLINE_MODELS:
        assert name in text, name


def test_tree_nodes_default_to_one_verification_block_everywhere():
    """15 nodes + the root fill one 16-row block of the batch-invariant verification (16 cost two): the flag of
    generate / serve / audit / tune, and the library's defaults, say 15 as EagleDraftConfig and the README do."""
    import inspect

    from specdecode.audit.config import AuditSetup
    from specdecode.cli import build_parser
    from specdecode.generator import SpecDecoder
    from specdecode.proposers.eagle import EagleDraftConfig
    from specdecode.proposers.tree_draft import TreeDraftConfig
    from specdecode.server.launch import build_state
    from specdecode.tune import TuneConfig
    from specdecode.spec import FLAG_DEFAULTS

    assert options.DEFAULT_TREE_NODES == 15 == EagleDraftConfig().num_nodes == TreeDraftConfig().num_nodes
    parser = build_parser()
    assert parser.parse_args(["generate"]).tree_nodes == 15
    assert parser.parse_args(["serve"]).tree_nodes == 15 == ServeOptions().tree_nodes
    assert parser.parse_args(["audit", "--local"]).tree_nodes == 15
    assert parser.parse_args(["tune", "--dataset", "x"]).tree_nodes == 15
    assert TuneConfig(target="x", datasets=("x",)).tree_nodes == 15 == FLAG_DEFAULTS["tree_nodes"]
    assert inspect.signature(SpecDecoder.from_pretrained).parameters["tree_nodes"].default == 15
    assert inspect.signature(build_state).parameters["tree_nodes"].default == 15
    assert AuditSetup.__dataclass_fields__["tree_nodes"].default == 15


def test_the_drafter_defaults_have_one_source():
    """γ 5 and n-gram sizes 1..3: options.DEFAULT_* everywhere (flags, spec, engine, server, audit, library)."""
    import inspect

    from specdecode.audit.config import AuditSetup
    from specdecode.cli import build_parser
    from specdecode.config import EngineConfig
    from specdecode.generator import SpecDecoder
    from specdecode.proposers.ngram import NgramConfig
    from specdecode.server.launch import build_state
    from specdecode.spec import FLAG_DEFAULTS

    gamma, low, high = options.DEFAULT_GAMMA, options.DEFAULT_NGRAM_MIN, options.DEFAULT_NGRAM_MAX
    assert FLAG_DEFAULTS["num_speculative_tokens"] == gamma and (FLAG_DEFAULTS["ngram_min"], FLAG_DEFAULTS["ngram_max"]) == (low, high)
    for command in (["generate"], ["serve"], ["audit", "--local"]):
        args = build_parser().parse_args(command)
        assert {k: getattr(args, k) for k in FLAG_DEFAULTS} == FLAG_DEFAULTS, command
    assert (ServeOptions().num_speculative_tokens, ServeOptions().ngram_min, ServeOptions().ngram_max) == (gamma, low, high)
    assert EngineConfig().num_speculative_tokens == gamma and NgramConfig() == NgramConfig(low, high)
    assert AuditSetup.__dataclass_fields__["num_speculative_tokens"].default == gamma
    for fn in (SpecDecoder.from_pretrained, build_state):
        assert inspect.signature(fn).parameters["num_speculative_tokens"].default == gamma
