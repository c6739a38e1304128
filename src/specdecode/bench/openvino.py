"""OpenVINO GenAI as a peer in ``specdecode bench --openvino`` (optional: set up with ``--setup-peers``).

``openvino-genai`` and ``optimum-intel[openvino]`` live in their own virtual environment under
``$SPECDECODE_CACHE/peers/openvino/venv`` (optimum-intel would otherwise move torch past our pin; the venv
gets the same CPU torch as ours first, pinned by a constraint). The bench talks to a worker process
(``bench/openvino_worker.py``, run by that venv's python) in JSON lines over stdin / stdout.

Models are our converted Hugging Face copies (the directories :mod:`specdecode.models` writes under
``$SPECDECODE_CACHE/converted/``) exported with ``optimum-cli export openvino --weight-format int8`` (or int4)
into ``$SPECDECODE_CACHE/peers/openvino/<name>-<format>``. Variants, all greedy, batch size 1:

- ``openvino/plain``: ``LLMPipeline(target, "CPU")``;
- ``openvino/assisted:k=G,model=DRAFT``: ``LLMPipeline(..., draft_model=draft_model(draft, "CPU"))``,
  ``num_assistant_tokens`` = G, the peer of our draft-model variant;
- ``openvino/prompt-lookup:k=G,max_ngram=M``: ``LLMPipeline(..., prompt_lookup=True)``,
  ``num_assistant_tokens`` = G and ``max_ngram_size`` = M, the peer of our n-gram variant.

Input is our token ids (``openvino_genai.TokenizedInputs``), chat template already applied by our
tokenizer, so every engine sees the same prompt. Threads: ``INFERENCE_NUM_THREADS`` = the bench's thread
count. Timing: wall seconds measured inside the worker around ``generate`` (prefill included), so pipe
overhead is not counted. Outputs are compared with OpenVINO's own plain decoding and with ours (int8
weights against ours give other near-ties, so "equal to ours" is information, not a test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.types import SpecDecodeError

ENGINE = "openvino"
GENAI_VERSION = "2026.4.1.0"
WEIGHT_FORMATS = ("int8", "int4", "fp16")
DEFAULT_FORMAT = "int8"
WORKER = Path(__file__).with_name("openvino_worker.py")


def peer_dir(cache: str | Path | None = None) -> Path:
    """``$SPECDECODE_CACHE/peers/openvino`` (the venv and the exported models)."""
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import default_cache_dir

    return Path(cache) if cache is not None else default_cache_dir() / "peers" / "openvino"


def venv_python(root: Path | None = None) -> Path:
    return (root or peer_dir()) / "venv" / "bin" / "python"


def model_dir(name: str, weight_format: str = DEFAULT_FORMAT, root: Path | None = None) -> Path:
    """Where the OpenVINO export of model ``name`` (a catalog name or a directory's name) lives."""
    return (root or peer_dir()) / f"{Path(name).name}-{weight_format}"


def setup_hint(what: str) -> str:
    return (f"{what}; set it up first with: specdecode bench --setup-peers openvino --target TARGET "
            f"[--draft DRAFT] (creates the venv and exports the models under {peer_dir()})")


def require_model(name: str, weight_format: str = DEFAULT_FORMAT, root: Path | None = None) -> Path:
    """The exported model directory of ``name``, checked.

    Raises:
        SpecDecodeError: the venv or the export is missing (the message names the setup command).
    """
    if not venv_python(root).exists():
        raise SpecDecodeError(setup_hint(f"--openvino: the OpenVINO peer is not set up ({venv_python(root)} is missing)"))
    out = model_dir(name, weight_format, root)
    if not (out / "openvino_model.xml").exists():
        raise SpecDecodeError(setup_hint(f"--openvino: no OpenVINO export of {name!r} ({out} is missing)"))
    return out


# --------------------------------------------------------------------------- the worker client


@dataclass
class OpenVinoResult:
    """One generation: new token ids, wall seconds inside the worker around ``generate``, finish reason."""

    token_ids: list[int]
    wall_s: float
    finish_reason: str


class WorkerClient:
    """A JSON-lines worker process: one request line, one reply line.

    Args:
        command: the worker's argv (the venv's python and ``openvino_worker.py``).
        env: extra environment variables.

    Raises:
        SpecDecodeError: the worker died, or answered ``{"ok": false}`` (its message is passed on).
    """

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, text=True, bufsize=1, env={**os.environ, **(env or {})})

    def request(self, op: str, **fields) -> dict:
        if self.proc.poll() is not None:
            raise SpecDecodeError(f"OpenVINO worker exited with status {self.proc.returncode}")
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            raise SpecDecodeError(f"OpenVINO worker exited with status {self.proc.returncode} during {op!r}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise SpecDecodeError(f"OpenVINO worker, {op}: not a JSON reply: {line[:200]!r}") from None
        if not reply.get("ok"):
            raise SpecDecodeError(f"OpenVINO worker, {op}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class OpenVinoRunner:
    """One OpenVINO GenAI pipeline in a worker process.

    Args:
        model: exported target directory. draft: exported draft directory (assisted) or None.
        method: "plain", "assisted" or "prompt-lookup". gamma: ``num_assistant_tokens``.
        max_ngram: ``max_ngram_size`` of prompt lookup. threads: ``INFERENCE_NUM_THREADS`` (None: OpenVINO's).
        python: interpreter of the worker (default: the peer venv's).

    Raises:
        ValueError: unknown method, or assisted without a draft. SpecDecodeError: the worker failed to load.
    """

    def __init__(self, model: str | Path, method: str = "plain", *, draft: str | Path | None = None, gamma: int = 4,
                 max_ngram: int = 3, threads: int | None = None, python: str | Path | None = None,
                 worker: str | Path = WORKER) -> None:
        if method not in ("plain", "assisted", "prompt-lookup"):
            raise ValueError(f"unknown OpenVINO method {method!r}; use plain, assisted or prompt-lookup")
        if (method == "assisted") != (draft is not None):
            raise ValueError("OpenVINO assisted generation takes a draft model, and only it does")
        self.method, self.gamma, self.max_ngram = method, gamma, max_ngram
        self.client = WorkerClient([str(python or venv_python()), str(worker)])
        try:
            reply = self.client.request("load", model=str(model), draft=str(draft) if draft else None,
                                        prompt_lookup=method == "prompt-lookup", threads=threads)
        except BaseException:  # a failed load (or Ctrl-C) leaves no worker behind
            self.client.close()
            raise
        self.load_s, self.version = reply.get("load_s"), reply.get("openvino_genai")

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int]) -> OpenVinoResult:
        """Greedy decoding of ``max_new_tokens`` at most, stopping at any of ``eos_token_ids``."""
        r = self.client.request("generate", ids=[int(t) for t in prompt_ids], max_new_tokens=int(max_new_tokens),
                                gamma=self.gamma, max_ngram=self.max_ngram, eos=[int(t) for t in eos_token_ids])
        return OpenVinoResult([int(t) for t in r["token_ids"]], float(r["wall_s"]), r.get("finish_reason", "length"))

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- set-up


def setup(models: Sequence[str], weight_format: str = DEFAULT_FORMAT, *, root: Path | None = None,
          status=print) -> list[Path]:
    """Create the peer venv (once) and export each model (once); returns the exported directories.

    Args:
        models: catalog names or Hugging Face model directories.
        weight_format: ``optimum-cli export openvino --weight-format`` (int8, int4, fp16).

    Raises:
        SpecDecodeError: a pip install or an export failed (its command is in the message).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise SpecDecodeError(f"unknown OpenVINO weight format {weight_format!r}; use {', '.join(WEIGHT_FORMATS)}")
    root = root or peer_dir()
    root.mkdir(parents=True, exist_ok=True)
    make_venv(root, status)
    return [export_model(m, weight_format, root, status) for m in models]


def make_venv(root: Path, status=print) -> None:
    """``root/venv``: our CPU torch first, then openvino-genai and optimum-intel with torch pinned to it."""
    py = venv_python(root)
    marker = root / "venv" / "specdecode-peer.json"
    if marker.exists():
        return
    if not py.exists():
        status(f"creating the OpenVINO peer venv {root / 'venv'}")
        _run([sys.executable, "-m", "venv", str(root / "venv")])
    pin = root / "constraints.txt"
    pin.write_text(f"torch=={torch.__version__}\n", encoding="utf-8")  # e.g. 2.13.0+cpu: never a CUDA build
    pip = [str(py), "-m", "pip", "install"]
    status(f"installing torch=={torch.__version__} (CPU), openvino-genai=={GENAI_VERSION}, optimum-intel[openvino]")
    _run([*pip, f"torch=={torch.__version__}"])
    _run([*pip, "-c", str(pin), f"openvino-genai=={GENAI_VERSION}", "optimum-intel[openvino]"])
    # optimum-intel pulls torchvision, whose registry wheel does not load with the CPU torch ("operator
    # torchvision::nms does not exist") and breaks transformers' imports; text models do not need it
    _run([str(py), "-m", "pip", "uninstall", "-y", "torchvision"])
    versions = subprocess.run([str(py), "-c", "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) "
                               "for p in ('openvino', 'openvino-genai', 'openvino-tokenizers', 'optimum-intel', "
                               "'torch', 'transformers')}))"], capture_output=True, text=True, check=True).stdout
    marker.write_text(versions, encoding="utf-8")
    status(f"OpenVINO peer venv ready: {versions.strip()}")


def export_model(spec: str, weight_format: str, root: Path, status=print) -> Path:
    """``optimum-cli export openvino --model HF_DIR --weight-format F OUT`` unless OUT holds an export."""
    out = model_dir(spec, weight_format, root)
    if (out / "openvino_model.xml").exists():
        return out
    src = hf_dir_of(spec)
    status(f"exporting {src} to OpenVINO ({weight_format}) in {out}")
    cli = Path(venv_python(root)).with_name("optimum-cli")
    _run([str(cli), "export", "openvino", "--model", str(src), "--task", "text-generation-with-past",
          "--weight-format", weight_format, str(out)], env={"HF_HUB_OFFLINE": "1"})
    return out


def hf_dir_of(spec: str) -> Path:
    """The Hugging Face directory behind ``spec``: a catalog model's converted copy (converted now if needed)
    or the directory itself.

    Raises:
        SpecDecodeError: neither a catalog name nor a directory.
    """
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import OFFLINE_MODELS, default_cache_dir, load_model

    entry = OFFLINE_MODELS.get(spec.strip().lower())
    if entry is not None:
        out = default_cache_dir() / "converted" / entry.name
        if not (out / "specdecode_converted.json").exists():
            load_model(spec)  # fetches, verifies and converts the catalog model
        return out
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    raise SpecDecodeError(f"the OpenVINO peer needs a catalog model or a Hugging Face directory, got {spec!r}")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run a set-up step at low priority (``nice``), its output passed through."""
    full = ["nice", "-n", "19", *cmd] if os.name == "posix" else cmd
    try:
        done = subprocess.run(full, env={**os.environ, **(env or {})})
    except OSError as exc:  # the program itself is missing
        raise SpecDecodeError(f"OpenVINO peer set-up: cannot run {cmd[0]} ({exc.strerror or exc})") from None
    if done.returncode != 0:
        raise SpecDecodeError(f"OpenVINO peer set-up failed (status {done.returncode}): {' '.join(cmd)}")
