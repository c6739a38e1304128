"""The OpenVINO GenAI worker: JSON lines on stdin / stdout, run by the peer venv's python (``bench.openvino``).

This file is a stand-alone script: it imports neither specdecode nor torch, only ``openvino`` and
``openvino_genai`` (and numpy), because it runs in the peer's own virtual environment. Protocol, one JSON
object per line each way, one reply per request, in order:

    -> {"op": "load", "model": DIR, "draft": DIR | null, "prompt_lookup": bool, "threads": N}
    <- {"ok": true, "load_s": seconds, "openvino_genai": version}
    -> {"op": "generate", "ids": [int, ...], "max_new_tokens": N, "gamma": G, "max_ngram": M, "eos": [int, ...]}
    <- {"ok": true, "token_ids": [int, ...], "wall_s": seconds around generate(), "finish_reason": "stop"|"length"}
    -> {"op": "quit"}
    <- any failure: {"ok": false, "error": "Type: message"}

Input is token ids (``openvino_genai.TokenizedInputs`` of an int64 ``ov.Tensor`` [1, L]), never text, so
the prompt (chat template included) is exactly the one our engine sees. Decoding is greedy
(``do_sample=False``); ``num_assistant_tokens`` = gamma for draft-model speculation and prompt lookup,
``max_ngram_size`` for prompt lookup. The worker writes replies on a private copy of stdout and points file
descriptor 1 at stderr, so that anything the runtime prints cannot break the protocol.
"""

from __future__ import annotations

import json
import os
import sys
import time

# run as a script, its own folder comes first on sys.path, and that folder holds specdecode's bench/openvino.py,
# which would shadow the real ``openvino`` package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _open_channel():
    """A private text stream on the original stdout; fd 1 then goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1, encoding="utf-8")


class Worker:
    """One LLMPipeline, loaded on the first ``load`` request."""

    def __init__(self) -> None:
        self.pipe = None
        self.mode = "plain"

    def load(self, req: dict) -> dict:
        # optional: OpenVINO GenAI, a benchmark peer
        import openvino_genai as ov_genai

        props = {"INFERENCE_NUM_THREADS": int(req["threads"])} if req.get("threads") else {}
        start = time.perf_counter()
        if req.get("draft"):
            draft = ov_genai.draft_model(req["draft"], "CPU", **props)
            self.pipe, self.mode = ov_genai.LLMPipeline(req["model"], "CPU", draft_model=draft, **props), "assisted"
        elif req.get("prompt_lookup"):
            self.pipe, self.mode = ov_genai.LLMPipeline(req["model"], "CPU", prompt_lookup=True, **props), "lookup"
        else:
            self.pipe, self.mode = ov_genai.LLMPipeline(req["model"], "CPU", **props), "plain"
        return {"ok": True, "load_s": time.perf_counter() - start, "openvino_genai": ov_genai.__version__}

    def generate(self, req: dict) -> dict:
        # optional: OpenVINO and OpenVINO GenAI, a benchmark peer (numpy with them)
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        ids = np.asarray([req["ids"]], dtype=np.int64)  # [1, L] int64
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = int(req["max_new_tokens"])
        cfg.do_sample = False
        eos = [int(t) for t in req.get("eos") or []]
        if eos:
            cfg.stop_token_ids = set(eos)
        if self.mode in ("assisted", "lookup"):
            cfg.num_assistant_tokens = int(req.get("gamma") or 4)
        if self.mode == "lookup":
            cfg.max_ngram_size = int(req.get("max_ngram") or 3)
        start = time.perf_counter()
        res = self.pipe.generate(inputs, cfg)
        wall = time.perf_counter() - start
        out = [int(t) for t in res.tokens[0]]
        # the end-of-generation token that stopped it is kept in ``tokens`` (as our engine keeps it)
        finish = "stop" if (out and out[-1] in eos) or len(out) < cfg.max_new_tokens else "length"
        return {"ok": True, "token_ids": out, "wall_s": wall, "finish_reason": finish}


def serve(inp, out) -> None:
    """Answer requests from ``inp`` until ``quit`` or end of input."""
    worker = Worker()
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                break
            reply = {"load": worker.load, "generate": worker.generate}[op](req)
        except Exception as exc:  # every failure goes back to the bench as a reply
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin, _open_channel())
