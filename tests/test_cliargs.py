"""The drafter flags shared by generate and serve: one copy, the same names and defaults in both."""

from __future__ import annotations

import argparse

import dataclasses

from specdecode import options
from specdecode.cliargs import POLICY_NAMES, add_drafter_arguments
from specdecode.policy import POLICIES
from specdecode.server.launch import ServeOptions, add_serve_arguments


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
    from specdecode.server import app

    assert kernels.WEIGHT_PRECISIONS is options.WEIGHT_PRECISIONS
    assert options.FORWARD_BACKENDS == kv.FORWARD_BACKENDS
    assert options.DEFAULT_MAX_REQUEST_BYTES == app.DEFAULT_MAX_REQUEST_BYTES
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


def test_verification_reaches_the_serve_options_and_the_engine():
    from specdecode.server.launch import check_options, options_from_args
    from specdecode.validate import VERIFICATION_METHODS
    from specdecode.cliargs import VERIFICATION_CHOICES

    assert VERIFICATION_CHOICES == VERIFICATION_METHODS
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
    from specdecode.cliargs import SAMPLING_MODES, add_sampling_arguments

    args = _parse(lambda p: add_sampling_arguments(p.add_argument_group("s")),
                  ["--logit-bias", "5=-100", "--logit-bias", "7=2.5", "--stop-token-id", "3", "--stop-token-id", "9"])
    assert args.logit_bias == [(5, -100.0), (7, 2.5)] and args.stop_token_ids == [3, 9]
    assert SAMPLING_MODES == {"auto": None, "standard": False, "coupled": True}
    defaults = _parse(lambda p: add_sampling_arguments(p.add_argument_group("s")), [])
    assert (defaults.min_p, defaults.repetition_penalty, defaults.presence_penalty, defaults.frequency_penalty,
            defaults.logit_bias, defaults.min_tokens, defaults.stop_token_ids, defaults.sampling_mode) == (
        0.0, 1.0, 0.0, 0.0, None, 0, None, "auto")
