"""Building and launching the server (``specdecode.server.launch``): every drafter and precision built through
the factory path of ``specdecode generate``, the flags, checks before any load, the state over loaded
models, and ``specdecode serve`` / ``python -m specdecode.server`` as processes."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from serving import serve_announcing
from specdecode.models import load_model
from specdecode.server import ServeOptions, build_state, create_app, load_state
from specdecode.server.launch import check_options
from specdecode.types import SpecDecodeError

MODEL = "tiny"
PROMPT = "the cat and the dog and the cat and the"


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    loaded.model.to(torch.float64)
    return loaded


@pytest.fixture(scope="module")
def tiny_head_dir(tiny_model_dir, tmp_path_factory):
    """A randomly initialised draft head (EAGLE-3 style) for the tiny model, as a checkpoint directory."""
    from specdecode.eagle.head import EagleConfig, EagleHead, save_head

    model = load_model(str(tiny_model_dir), progress=False).model
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model, list(range(model.config.vocab_size)))).attach(model, init=True)
    return save_head(head, tmp_path_factory.mktemp("head") / "head")


# --------------------------------------------------------------------------- building the server


@pytest.mark.parametrize("draft,extra", [
    ("suffix:ngram", {}),
    ("suffix:TARGET", {"tree_nodes": 8}),
    ("TARGET", {"tree": "dynamic", "tree_nodes": 8, "draft_weights": "int8"}),
    ("layer-skip", {"skip_layers": "1", "policy": "heuristic"}),
    ("ngram", {"weights": "int8", "policy": "confidence"}),
    ("none", {"forward": "hf"}),
    ("eagle:HEAD", {}),
    ("eagle:HEAD", {"tree": "dynamic", "tree_nodes": 8}),
])
def test_load_state_builds_every_drafter(tiny_model_dir, tiny_head_dir, draft, extra):
    """``load_state`` (what ``specdecode serve`` runs) builds each drafter and precision through the factory
    path of ``specdecode generate``, and the app serves it."""
    from fastapi.testclient import TestClient

    spec = str(tiny_model_dir)
    draft = draft.replace("TARGET", spec).replace("HEAD", str(tiny_head_dir))
    opts = ServeOptions(target=spec, draft=draft, served_model_name=MODEL,
                        max_batch_size=2, **extra)
    state = load_state(opts, progress=False)
    engine = state.engine
    assert (engine.proposer is None) == (draft == "none")
    assert engine.trees == (draft.startswith("suffix") or "tree" in extra)
    assert engine.max_batch_size == 2
    if "forward" in extra:
        assert type(engine.runner).__name__ == "HFRunner"
    with TestClient(create_app(state)) as client:
        out = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                   "temperature": 0})
        assert out.status_code == 200, out.text
        assert len(out.json()["choices"][0]["token_ids"]) <= 12
        assert client.get("/health").json()["policy"] == ("none" if draft == "none" else opts.policy)


def test_adaptive_flags_map_to_policies():
    import argparse

    from specdecode.cliargs import add_serve_arguments
    from specdecode.server.launch import options_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert options_from_args(parser.parse_args([])).policy == "cost-model"
    assert options_from_args(parser.parse_args(["--no-adaptive"])).policy == "fixed"
    assert options_from_args(parser.parse_args(["--policy", "heuristic"])).policy == "heuristic"
    with pytest.raises(SystemExit):  # two policies at once: refused (cliargs.add_serve_arguments)
        parser.parse_args(["--policy", "fixed", "--adaptive"])
    args = parser.parse_args(["--draft", "suffix:ngram", "--tree-nodes", "12", "--weights", "int8",
                              "--forward", "owned", "--max-request-bytes", "4096"])
    opts = options_from_args(args)
    assert (opts.draft, opts.tree_nodes, opts.weights, opts.forward, opts.max_request_bytes) == \
        ("suffix:ngram", 12, "int8", "owned", 4096)


# --------------------------------------------------------------------------- command line


@pytest.mark.slow  # a server subprocess
def test_specdecode_serve_command_serves(tiny_model_dir):
    """`specdecode serve` end to end in its own process: load, calibrate, bind loopback, answer, stop."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--target", str(tiny_model_dir), "--port", str(port),
           "--served-model-name", MODEL, "--max-batch-size", "2", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
        assert len(out.choices[0].token_ids) <= 4
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.slow  # a server subprocess
def test_port_0_announces_the_port_it_bound(tiny_model_dir):
    """--port 0 lets the system choose: the announced address is the bound one, and it answers."""
    proc, port, line = serve_announcing(["--target", str(tiny_model_dir), "--port", "0", "--log-level", "warning"])
    try:
        assert port != 0, line
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.parametrize("flags", [
    ["--num-speculative-tokens", "0"],
    ["--ngram-min", "3", "--ngram-max", "1"],
    ["--draft", "ngram", "--tree", "dynamic"],  # trees need a draft model
    ["--tree-nodes", "0", "--draft", "suffix"],
    ["--draft", "layer-skip", "--skip-layers", "x,y"],
    ["--draft", "layer-skip", "--forward", "hf"],
    ["--max-batch-size", "0"],
    ["--max-request-bytes", "10"],
    ["--policy", "nope"],
    ["--weights", "int3"],
])
def test_serve_rejects_bad_flags_before_loading(flags, monkeypatch):
    from specdecode.cli import main

    monkeypatch.setattr("specdecode.models.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["serve", "--target", "no-such-model-dir", *flags]) == 2


@pytest.mark.parametrize("opts, needle", [
    (dict(num_speculative_tokens=65), "num_speculative_tokens"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(forward="fast"), "forward"),
    (dict(policy="always"), "policy"),
    (dict(draft="ngram", ngram_min=2, ngram_max=1), "min_ngram"),
    (dict(draft="suffix", tree_nodes=99), "tree nodes"),
    (dict(draft="ngram", tree="static"), "needs a draft model"),
    (dict(draft="layer-skip", skip_layers="1;2"), "comma-separated"),
    (dict(draft="layer-skip", forward="hf"), "--forward auto or owned"),
    (dict(weights="int3"), "--weights"),
    (dict(draft_weights="fp8"), "--draft-weights"),
    (dict(max_queue=-1), "--max-queue"),
    (dict(max_request_bytes=100), "--max-request-bytes"),
    (dict(default_max_tokens=0), "--default-max-tokens"),
])
def test_check_options_refuses_bad_values_without_loading(opts, needle):
    with pytest.raises(SpecDecodeError, match=needle):
        check_options(ServeOptions(target="no-such-model", **opts))


def test_check_options_returns_the_parsed_drafter():
    assert check_options(ServeOptions(draft="suffix:ngram")).kind == "suffix"
    assert check_options(ServeOptions(draft="Some/Draft", tree="dynamic")).model_spec == "Some/Draft"


def test_build_state_over_loaded_models(tiny64):
    state = build_state(tiny64, "ngram", model_name="m", num_speculative_tokens=3, max_batch_size=2,
                        policy="heuristic", ngram_min=2, ngram_max=4)
    engine = state.engine
    assert engine.proposer.config.min_ngram == 2 and engine.max_batch_size == 2
    assert (state.config.model_name, state.config.draft, state.config.policy) == ("m", "ngram", "heuristic")
    plain = build_state(tiny64, "none", policy="cost-model")
    assert plain.engine.proposer is None and plain.config.policy == "none"  # no proposer: no policy
    as_model = build_state(tiny64, tiny64, tree="static", tree_nodes=5)  # a LoadedModel as the draft
    assert as_model.engine.trees and "(static trees of 5 nodes)" in as_model.config.draft
    skip = build_state(tiny64, "layer-skip", skip_layers="1")
    assert skip.config.draft == "layer-skip (skip 1)"
    with pytest.raises(SpecDecodeError, match="load it first"):
        build_state(tiny64, "some/draft-model")
    with pytest.raises(SpecDecodeError, match="--max-queue"):
        build_state(tiny64, "ngram", max_queue=-2)
    for s in (state, plain, as_model, skip):
        s.scheduler.close()


@pytest.mark.slow  # a subprocess
def test_python_m_specdecode_server_takes_the_serve_flags(capsys):
    from specdecode.server.entry import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m specdecode.server")
    for flag in ("--target", "--draft", "--num-speculative-tokens", "--policy", "--max-request-bytes", "--api-key"):
        assert flag in out
    # ``python -m specdecode.server`` (the package's __main__) runs the same, as a process
    bad = subprocess.run([sys.executable, "-m", "specdecode.server", "--target", "no-such-dir", "--max-batch-size",
                          "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: max_batch_size")


def test_a_bad_or_busy_address_is_refused_before_any_model_loads():
    import socket

    from specdecode.server.launch import check_address
    from specdecode.types import SpecDecodeError

    with pytest.raises(SpecDecodeError, match="0..65535"):
        check_address("127.0.0.1", 99999)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SpecDecodeError, match="cannot listen"):
            check_address("127.0.0.1", busy.getsockname()[1])
    check_address("127.0.0.1", 0)  # any free port is fine
