"""The external peers of ``specdecode bench`` without the peers installed: OpenVINO's JSON-lines worker protocol
(against fake workers, and the real worker script against a stand-in ``openvino_genai``), the llama-server
client (against a stdlib HTTP server), the errors that name the setup command, the cmake flags chosen from
CPU flags, the variant keys / peer_of wiring, and the report's rows for other engines."""

from __future__ import annotations

import http.server
import io
import json
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

from specdecode.bench import llamaserver as ls
from specdecode.bench import openvino as ov
from specdecode.bench import summary as S
from specdecode.types import SpecDecodeError

FAKE_WORKER = textwrap.dedent("""
    import json, sys
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "load":
            reply = {"ok": True, "load_s": 0.5, "openvino_genai": "fake", "seen": req}
        elif req["op"] == "generate" and req["ids"] == [666]:
            reply = {"ok": False, "error": "RuntimeError: bad prompt"}
        elif req["op"] == "generate" and req["ids"] == [999]:
            sys.exit(3)
        else:
            reply = {"ok": True, "token_ids": [7, 8, 9][:req["max_new_tokens"]], "wall_s": 0.25,
                     "finish_reason": "length", "seen": req}
        sys.stdout.write(json.dumps(reply) + "\\n")
        sys.stdout.flush()
""")


@pytest.fixture()
def fake_worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(FAKE_WORKER)
    return path


# --------------------------------------------------------------------------- OpenVINO


def test_openvino_runner_speaks_json_lines(fake_worker):
    run = ov.OpenVinoRunner("/m/target", "assisted", draft="/m/draft", gamma=3, threads=2, python=sys.executable,
                            worker=fake_worker)
    try:
        assert (run.load_s, run.version) == (0.5, "fake")
        res = run.generate([1, 2, 3], 2, (5,))
        assert (res.token_ids, res.wall_s, res.finish_reason) == ([7, 8], 0.25, "length")
        seen = run.client.request("generate", ids=[4], max_new_tokens=3, gamma=3, max_ngram=3, eos=[])["seen"]
        assert seen["ids"] == [4]
        with pytest.raises(SpecDecodeError, match="bad prompt"):
            run.generate([666], 2, ())
        assert run.generate([1], 1, ()).token_ids == [7]  # the worker is still there after an error reply
        with pytest.raises(SpecDecodeError, match="exited with status 3"):
            run.generate([999], 2, ())
    finally:
        run.close()


def test_openvino_load_request_names_the_mode(fake_worker):
    run = ov.OpenVinoRunner("/m/t", "prompt-lookup", gamma=5, max_ngram=2, threads=4, python=sys.executable,
                            worker=fake_worker)
    try:
        seen = run.client.request("load", model="/m/t", draft=None, prompt_lookup=True, threads=4)["seen"]
        assert seen == {"op": "load", "model": "/m/t", "draft": None, "prompt_lookup": True, "threads": 4}
    finally:
        run.close()
    with pytest.raises(ValueError):
        ov.OpenVinoRunner("/m/t", "assisted", python=sys.executable, worker=fake_worker)  # no draft
    with pytest.raises(ValueError):
        ov.OpenVinoRunner("/m/t", "beam", python=sys.executable, worker=fake_worker)


class FakeGenAI(types.ModuleType):
    """Stand-in ``openvino_genai``: records pipelines and generation configs."""

    def __init__(self):
        super().__init__("openvino_genai")
        self.__version__ = "0.fake"
        self.pipes, mod = [], self

        class GenerationConfig:
            pass

        class TokenizedInputs:
            def __init__(self, input_ids, attention_mask):
                self.input_ids, self.attention_mask = input_ids, attention_mask

        class LLMPipeline:
            def __init__(self, path, device, **kw):
                self.path, self.device, self.kw, self.calls = path, device, kw, []
                mod.pipes.append(self)

            def generate(self, inputs, cfg):
                self.calls.append((inputs, cfg))
                return types.SimpleNamespace(tokens=[[11, 12, 2]])

        self.GenerationConfig, self.TokenizedInputs, self.LLMPipeline = GenerationConfig, TokenizedInputs, LLMPipeline
        self.draft_model = lambda path, device, **kw: ("draft", path, device, kw)


def test_real_worker_script_against_a_stand_in_genai(monkeypatch):
    np = pytest.importorskip("numpy")
    from specdecode.bench import openvino_worker

    genai = FakeGenAI()
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setitem(sys.modules, "openvino", types.SimpleNamespace(Tensor=lambda a: a))
    reqs = [{"op": "load", "model": "/t", "draft": "/d", "prompt_lookup": False, "threads": 2},
            {"op": "generate", "ids": [1, 2, 3], "max_new_tokens": 16, "gamma": 4, "max_ngram": 3, "eos": [2]},
            {"op": "nonsense"}, {"op": "quit"}]
    out = io.StringIO()
    openvino_worker.serve(io.StringIO("".join(json.dumps(r) + "\n" for r in reqs)), out)
    load, gen, bad = (json.loads(line) for line in out.getvalue().splitlines())
    assert load["ok"] and load["openvino_genai"] == "0.fake"
    assert gen == {"ok": True, "token_ids": [11, 12, 2], "wall_s": gen["wall_s"], "finish_reason": "stop"}
    assert not bad["ok"] and "KeyError" in bad["error"]
    pipe = genai.pipes[0]
    assert pipe.kw == {"draft_model": ("draft", "/d", "CPU", {"INFERENCE_NUM_THREADS": 2}), "INFERENCE_NUM_THREADS": 2}
    inputs, cfg = pipe.calls[0]
    assert np.asarray(inputs.input_ids).tolist() == [[1, 2, 3]] and inputs.input_ids.dtype == np.int64
    assert (cfg.max_new_tokens, cfg.do_sample, cfg.num_assistant_tokens, cfg.stop_token_ids) == (16, False, 4, {2})
    assert not hasattr(cfg, "max_ngram_size")  # prompt lookup only


def test_openvino_not_set_up_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    with pytest.raises(SpecDecodeError, match="--setup-peers openvino") as err:
        ov.require_model("smollm2-135m")
    assert "venv" in str(err.value)
    py = ov.venv_python()
    py.parent.mkdir(parents=True)
    py.write_text("")
    with pytest.raises(SpecDecodeError, match="no OpenVINO export of 'smollm2-135m'"):
        ov.require_model("smollm2-135m")
    assert ov.model_dir("smollm2-135m", "int4") == tmp_path / "peers" / "openvino" / "smollm2-135m-int4"


# --------------------------------------------------------------------------- llama-server


class FakeServer(http.server.BaseHTTPRequestHandler):
    bodies: list[dict] = []
    reply: dict = {}

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.bodies.append(body)
        data = json.dumps(FakeServer.reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def fake_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    FakeServer.bodies = []
    yield ls.ServerClient(f"http://127.0.0.1:{srv.server_address[1]}")
    srv.shutdown()
    srv.server_close()


def test_llama_server_client_sends_ids_and_reads_tokens(fake_server):
    assert fake_server.healthy()
    FakeServer.reply = {"tokens": [5, 6, 7], "stop_type": "limit", "timings": {"predicted_per_second": 9.0}}
    res = fake_server.complete([1, 2, 3], 3, (2,))
    assert (res.token_ids, res.finish_reason, res.timings) == ([5, 6, 7], "length", {"predicted_per_second": 9.0})
    assert res.wall_s > 0
    body = FakeServer.bodies[-1]
    assert (body["prompt"], body["n_predict"], body["temperature"], body["top_k"]) == ([1, 2, 3], 3, 0.0, 1)
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["stream"] is False
    FakeServer.reply = {"tokens": [5, 2], "stop_type": "eos"}  # the server keeps the EOS that stopped it
    res = fake_server.complete([1], 8, (2,))
    assert (res.token_ids, res.finish_reason) == ([5, 2], "stop")
    FakeServer.reply = {"tokens": [5, 2, 9], "stop_type": "limit"}  # cut at our EOS
    assert fake_server.complete([1], 3, (2,)).token_ids == [5, 2]


def test_llama_server_runner_starts_waits_and_stops(tmp_path):
    """A fake binary: a python script that serves /health and /completion on the --port it is given."""
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import http.server, json, sys
        port = int(sys.argv[sys.argv.index("--port") + 1])
        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a): pass
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = json.dumps({"tokens": body["prompt"][::-1][:body["n_predict"]], "stop_type": "limit",
                                   "argv": sys.argv[1:]}).encode()
                self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
                self.wfile.write(data)
        http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """))
    exe.chmod(0o755)
    run = ls.LlamaServerRunner("/m/t.gguf", "ngram", gamma=6, max_ngram=2, threads=2, binary_path=exe,
                               start_timeout_s=30, log=tmp_path / "server.log")
    try:
        assert run.generate([1, 2, 3], 2, ()).token_ids == [3, 2]
        assert "--spec-type" in run.command and "ngram-simple" in run.command
    finally:
        run.close()
    assert run.proc.poll() is not None
    exe.write_text("#!/bin/sh\nexit 4\n")
    with pytest.raises(SpecDecodeError, match="exited before it got healthy"):
        ls.LlamaServerRunner("/m/t.gguf", binary_path=exe, start_timeout_s=30)


def test_llama_server_args_per_method():
    draft = ls.server_args("t.gguf", "draft", draft="d.gguf", gamma=4, threads=2, port=1234)
    i = draft.index("-md")
    assert draft[i + 1] == "d.gguf" and draft[draft.index("--spec-type") + 1] == "draft-simple"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "4" and draft[draft.index("--spec-draft-n-min") + 1] == "0"
    assert draft[draft.index("-t") + 1] == "2" and draft[draft.index("--port") + 1] == "1234"
    ngram = ls.server_args("t.gguf", "ngram", gamma=7, max_ngram=3)
    assert ngram[ngram.index("--spec-ngram-simple-size-m") + 1] == "7"
    assert ngram[ngram.index("--spec-ngram-simple-size-n") + 1] == "3"
    plain = ls.server_args("t.gguf")
    assert "-md" not in plain and "--spec-type" not in plain
    with pytest.raises(ValueError):
        ls.server_args("t.gguf", "draft")  # no draft file
    with pytest.raises(ValueError):
        ls.server_args("t.gguf", "lookahead")


def test_llama_server_not_built_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    with pytest.raises(SpecDecodeError, match="--setup-peers llama-server"):
        ls.require_binary()
    exe = ls.binary()
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert ls.require_binary() == exe  # no record of its flags: assumed built here
    record = ls.peer_dir() / "build-flags.json"
    record.write_text(json.dumps({"cmake": ls.cmake_flags(ls.cpu_flags())}))
    assert ls.require_binary() == exe
    record.write_text(json.dumps({"cmake": ls.cmake_flags({"an-imaginary-isa"})}))
    with pytest.raises(SpecDecodeError, match="another CPU"):
        ls.require_binary()


def test_cmake_flags_follow_the_cpu_flags(tmp_path):
    avx2 = ls.cmake_flags({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DLLAMA_CURL=OFF" in avx2
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_BF16=OFF"} <= set(avx2)
    amx = ls.cmake_flags("avx avx2 fma f16c avx512f avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8".split())
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"} <= set(amx)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"} <= set(amx)  # AMX stays off (invalid opcode seen)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert ls.cpu_flags(info) == {"fpu", "avx2", "avx512f"}
    assert ls.cpu_flags(tmp_path / "missing") == set()


# --------------------------------------------------------------------------- variants, CLI, report


class FakeEngine:
    made: list[tuple] = []

    def __init__(self, *args, **kw):
        FakeEngine.made.append((args, kw))

    def generate(self, ids, n, eos):
        return types.SimpleNamespace(token_ids=list(ids)[:n], wall_s=0.1, finish_reason="length")

    def close(self):
        pass


def _specs():
    from specdecode.bench.runner import main_gamma_of
    from specdecode.spec import DrafterSpec

    specs = [DrafterSpec.parse(s, bare_model=False) for s in ("draft-model:k=3,model=qwen2.5-coder-0.5b", "ngram:k=5,max_ngram=2",
                                           "ngram:k=8,max_ngram=2", "suffix:k=4")]
    return specs, main_gamma_of(specs)


def test_openvino_and_llama_server_variant_keys(monkeypatch, tmp_path):
    from specdecode.bench import runner

    monkeypatch.setattr(ov, "require_model", lambda name, fmt="int8": Path(f"/ov/{name}-{fmt}"))
    monkeypatch.setattr(ov, "OpenVinoRunner", FakeEngine)
    monkeypatch.setattr(ls, "require_binary", lambda: Path("/bin/llama-server"))
    monkeypatch.setattr(ls, "LlamaServerRunner", FakeEngine)
    monkeypatch.setattr("specdecode.models.gguf_file", lambda spec: Path(f"/gguf/{spec}.gguf"))
    config = runner.BenchConfig(target="qwen2.5-coder-1.5b", output=str(tmp_path), threads=2, max_new_tokens=4)
    specs, mains = _specs()
    FakeEngine.made = []
    ovs = runner._openvino_variants(config, specs, mains, (2,), lambda m: None)
    assert [(v.key, v.peer_of) for v in ovs] == [
        ("openvino/plain", None),
        ("openvino/assisted:k=3,model=qwen2.5-coder-0.5b", "specdecode/draft-model:k=3,model=qwen2.5-coder-0.5b"),
        ("openvino/prompt-lookup:k=5,max_ngram=2", "specdecode/ngram:k=5,max_ngram=2")]
    args, kw = FakeEngine.made[1]
    assert args == (Path("/ov/qwen2.5-coder-1.5b-int8"), "assisted") and kw["draft"] == Path("/ov/qwen2.5-coder-0.5b-int8")
    assert kw["gamma"] == 3 and kw["threads"] == 2
    assert ovs[0].run([1, 2, 3, 4, 5, 6], 0).token_ids == [1, 2, 3, 4]
    assert ovs[0].run([1], 0, 2).engine_stats is None
    srv = runner._llama_server_variants(config, specs, mains, (2,), lambda m: None)
    assert [(v.key, v.engine, v.peer_of) for v in srv] == [
        ("llama-server/plain", "llama-server", None),
        ("llama-server/draft:k=3,model=qwen2.5-coder-0.5b", "llama-server",
         "specdecode/draft-model:k=3,model=qwen2.5-coder-0.5b"),
        ("llama-server/ngram:k=5,max_ngram=2", "llama-server", "specdecode/ngram:k=5,max_ngram=2")]
    assert FakeEngine.made[4][1]["draft"] == Path("/gguf/qwen2.5-coder-0.5b.gguf")
    assert all(S.baseline_of(v.info()) == f"{v.engine}/plain" for v in ovs + srv)


def test_openvino_variants_refuse_without_setup(monkeypatch, tmp_path):
    from specdecode.bench import runner

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    config = runner.BenchConfig(target="smollm2-135m", output=str(tmp_path / "out"), openvino=True)
    with pytest.raises(SpecDecodeError, match="specdecode bench --setup-peers openvino"):
        runner._openvino_variants(config, *_specs(), (2,), lambda m: None)
    with pytest.raises(SpecDecodeError, match="--setup-peers llama-server"):
        runner._llama_server_variants(config, *_specs(), (2,), lambda m: None)


def test_cli_flags_reach_the_config():
    import argparse

    from specdecode.bench import add_arguments, config_from_args
    from specdecode.bench.peers import PEERS, parse_peers

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--openvino", "--llama-server", "--openvino-weights", "int4"]))
    assert (cfg.openvino, cfg.llama_server, cfg.openvino_weights) == (True, True, "int4")
    assert cfg.settings()["openvino_weights"] == "int4"
    assert p.parse_args(["--setup-peers"]).setup_peers == "all"
    assert parse_peers("all") == PEERS and parse_peers("openvino") == ("openvino",)
    with pytest.raises(SpecDecodeError, match="unknown peer"):
        parse_peers("vllm")


def test_report_rows_for_other_engines():
    from specdecode.bench import report

    variants = [{"key": "specdecode/plain", "engine": "specdecode", "method": "plain", "gamma": 0, "family": "plain"},
                {"key": "openvino/plain", "engine": "openvino", "method": "plain", "gamma": 0, "family": "openvino/plain"},
                {"key": "openvino/prompt-lookup:k=5,max_ngram=2", "engine": "openvino", "method": "prompt-lookup",
                 "gamma": 5, "family": "openvino/prompt-lookup"}]
    runs = {("specdecode/plain", "p"): {"token_ids": [1, 2]}, ("specdecode/plain", "q"): {"token_ids": [3]},
            ("openvino/plain", "p"): {"token_ids": [1, 2]}, ("openvino/plain", "q"): {"token_ids": [4]},
            ("openvino/prompt-lookup:k=5,max_ngram=2", "p"): {"token_ids": [1, 2]},
            ("openvino/prompt-lookup:k=5,max_ngram=2", "q"): {"token_ids": [4]}}
    ag = S.agreement(runs, variants, ["p", "q"])
    assert ag["mismatches"] == []  # ours differs on q: information only, never a mismatch
    assert ag["external"] == {"openvino/plain": {"ours": [1, 2]},
                              "openvino/prompt-lookup:k=5,max_ngram=2": {"own_plain": [2, 2], "ours": [1, 2]}}
    cell = {S.OVERALL: {"tokens_per_s": 10.0, "speedup": {"median": 1.5}}}
    summary = {"cells": {v["key"]: cell for v in variants}, "agreement": ag, "peers": [], "categories": []}
    table = report.external_table(summary, {v["key"]: v for v in variants})
    assert "| openvino prompt-lookup γ=5 | 10.00 | 1.50× | 2/2 | 1/2 |" in table
    assert "| openvino plain | 10.00 | 1.00× (baseline) | – | 1/2 |" in table
    assert "Other engines" in report.peer_section(summary, {v["key"]: v for v in variants})


def test_external_peers_are_greedy_only_and_never_run_twice(tmp_path):
    from specdecode.bench import runner
    from specdecode.types import SpecDecodeError

    with pytest.raises(SpecDecodeError, match="greedy decoding only"):
        runner.BenchConfig(target="smollm2-135m", output=str(tmp_path), openvino=True, temperature=0.7)
    from specdecode.spec import DrafterSpec

    spec = DrafterSpec.parse("ngram:k=4")
    other = DrafterSpec.parse("ngram:k=4,min_ngram=2")  # the same to the peer
    made = []
    out = runner._external_variants("peer", [("ngram", spec, None, 3), ("ngram", other, None, 3)], {},
                                    lambda *a: made.append(a) or (lambda *x: None),
                                    draft_method="draft", ngram_method="ngram")
    assert [v.key for v in out] == ["peer/plain", "peer/ngram:k=4,max_ngram=3"] and len(made) == 2
