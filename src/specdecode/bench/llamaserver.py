"""llama.cpp's C++ ``llama-server`` as a peer in ``specdecode bench --llama-server`` (set up with ``--setup-peers``).

The server is built from the llama.cpp source vendored in the registry's ``llama-cpp-python`` sdist
(:data:`SDIST`, its ``vendor/llama.cpp``) with cmake, target ``llama-server`` only, ``GGML_NATIVE=OFF`` and
the x86 instruction-set options named from ``/proc/cpuinfo`` (:func:`cmake_flags`; ``GGML_NATIVE=ON``, which
also enables the AMX backend, died with an invalid opcode on an AMX machine, so AMX stays off), into
``$SPECDECODE_CACHE/peers/llama.cpp/``.

Speculative options of that build (llama.cpp as vendored in llama-cpp-python 0.3.36; ``--draft-max`` /
``--draft-min`` were removed there): ``-md FILE`` (``--spec-draft-model``), ``--spec-draft-n-max N``,
``--spec-draft-n-min N``, ``--spec-draft-p-min P``, ``--spec-type`` one of none, draft-simple, draft-eagle3,
draft-mtp, draft-dflash, draft-dspark, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache;
``ngram-simple`` takes ``--spec-ngram-simple-size-n`` (lookup n-gram length) and ``--spec-ngram-simple-size-m``
(draft length). Variants, greedy, batch size 1, one server process per variant:

- ``llama-server/plain``: no drafting;
- ``llama-server/draft:k=G,model=DRAFT``: ``-md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max G
  --spec-draft-n-min 0 --spec-draft-p-min 0`` (a fixed draft length, as ours), the peer of our draft-model
  variant. ``--spec-type draft-simple`` is needed: with ``-md`` alone that build loads the draft model and
  drafts nothing (``timings`` without ``draft_n``);
- ``llama-server/ngram:k=G,max_ngram=M``: ``--spec-type ngram-simple --spec-ngram-simple-size-n M
  --spec-ngram-simple-size-m G``, the peer of our n-gram variant.

Each request is ``POST /completion`` with our prompt as token ids, ``n_predict``, ``temperature`` 0, ``top_k``
1, ``cache_prompt`` false, ``return_tokens`` true; the new token ids come from the reply's ``tokens``, which
keep the end-of-generation token that stopped it (``stop_type`` "eos"), as our engine does.
Timing is wall time around the HTTP request on our side (prefill included); the server's own ``timings``
(with ``draft_n`` / ``draft_n_accepted`` when it drafted) go into each record as ``engine_stats``. The GGUF files are the catalog's (:func:`specdecode.models.gguf_file`), 4-bit: outputs
are compared with llama-server's own plain decoding, and with ours for information.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.types import SpecDecodeError

ENGINE = "llama-server"
SDIST = "llama-cpp-python==0.3.36"
# lscpu / cpuinfo flag -> ggml cmake option (GGML_NATIVE=OFF: every one named explicitly, ON or OFF)
CPU_OPTIONS = (
    ("sse4_2", "GGML_SSE42"), ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"), ("bmi2", "GGML_BMI2"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
)
# never enabled: the AMX backend (GGML_NATIVE=ON turns it on) crashed with an invalid opcode on an AMX machine
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def peer_dir(cache: str | Path | None = None) -> Path:
    """``$SPECDECODE_CACHE/peers/llama.cpp`` (source, build, binary)."""
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import default_cache_dir

    return Path(cache) if cache is not None else default_cache_dir() / "peers" / "llama.cpp"


def binary(root: Path | None = None, name: str = "llama-server") -> Path:
    """The built ``llama-server`` (or ``llama-bench``, built beside it)."""
    return (root or peer_dir()) / "build" / "bin" / name


def require_binary(root: Path | None = None) -> Path:
    """The built ``llama-server``.

    Raises:
        SpecDecodeError: not built (the message names the setup command).
    """
    path = binary(root)
    if not path.exists():
        raise SpecDecodeError(f"--llama-server: llama-server is not built ({path} is missing); build it first with: "
                              f"specdecode bench --setup-peers llama-server (cmake, a few minutes on 2 cores)")
    if not built_for_this_cpu(root):
        raise SpecDecodeError(f"--llama-server: {path} was built for another CPU's instruction sets (see "
                              f"{(root or peer_dir()) / 'build-flags.json'}); rebuild it with: specdecode bench "
                              f"--setup-peers llama-server")
    return path


def built_for_this_cpu(root: Path | None = None) -> bool:
    """True unless the recorded cmake flags of the build differ from this CPU's (no record: assumed fine)."""
    record = (root or peer_dir()) / "build-flags.json"
    try:
        flags = json.loads(record.read_text(encoding="utf-8"))["cmake"]
    except (OSError, ValueError, KeyError):
        return True
    return flags == cmake_flags(cpu_flags())


# --------------------------------------------------------------------------- build


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags (first ``flags`` line of /proc/cpuinfo), empty when unreadable."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_flags(flags: set[str] | Sequence[str]) -> list[str]:
    """cmake ``-D`` options for a CPU with these feature flags: native off, each ISA option named.

    Example: ``cmake_flags({"avx", "avx2", "fma", "f16c"})`` has ``-DGGML_AVX2=ON`` and ``-DGGML_AVX512=OFF``.
    """
    have = set(flags)
    out = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_OPENMP=ON",
           "-DBUILD_SHARED_LIBS=OFF"]
    out += [f"-D{opt}={'ON' if flag in have else 'OFF'}" for flag, opt in CPU_OPTIONS]
    out += [f"-D{opt}=OFF" for opt in ALWAYS_OFF]
    return out


def setup(*, root: Path | None = None, jobs: int = 2, status=print) -> Path:
    """Fetch the sdist (pip download), unpack its vendored llama.cpp, and build ``llama-server`` and
    ``llama-bench`` (its verification-cost table, ``specdecode bench --verify-table``) once (again
    when the machine's instruction sets differ from the recorded build's: machines of this project change).

    Raises:
        SpecDecodeError: a step failed (its command is in the message).
    """
    root = root or peer_dir()
    if binary(root).exists() and binary(root, "llama-bench").exists() and built_for_this_cpu(root):
        return binary(root)
    src = vendored_source(root, status)
    build = root / "build"
    if build.exists() and not built_for_this_cpu(root):
        status(f"{build} was built for other instruction sets: building again")
        shutil.rmtree(build)
    flags = cmake_flags(cpu_flags())
    status(f"configuring llama.cpp ({src}) with {' '.join(flags)}")
    _run(["cmake", "-S", str(src), "-B", str(build), *flags])
    status(f"building llama-server and llama-bench with {jobs} jobs (several minutes)")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "llama-bench", "-j", str(jobs)])
    (root / "build-flags.json").write_text(json.dumps({"sdist": SDIST, "cmake": flags}, indent=1), encoding="utf-8")
    return require_binary(root)


def vendored_source(root: Path, status=print, _unpacked: bool = False) -> Path:
    """``root/src/<sdist>/vendor/llama.cpp``, downloaded with pip and unpacked when missing."""
    src_root = root / "src"
    folder = "llama_cpp_python-" + SDIST.split("==")[-1]  # this version's unpacked sdist, not an older one
    found = glob.glob(str(src_root / folder / "vendor" / "llama.cpp" / "CMakeLists.txt"))
    if found:
        return Path(found[0]).parent
    if _unpacked:
        raise SpecDecodeError(f"the {SDIST} sdist unpacked into {src_root} holds no vendor/llama.cpp/CMakeLists.txt")
    src_root.mkdir(parents=True, exist_ok=True)
    status(f"downloading the {SDIST} sdist (its vendored llama.cpp)")
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", SDIST,
          "-d", str(src_root)])
    tars = sorted(src_root.glob("llama_cpp_python-*.tar.gz"))
    if not tars:
        raise SpecDecodeError(f"pip download {SDIST} left no sdist in {src_root}")
    with tarfile.open(tars[-1]) as tar:
        tar.extractall(src_root, filter="data")
    return vendored_source(root, status, _unpacked=True)


def _run(cmd: list[str]) -> None:
    full = ["nice", "-n", "19", *cmd] if shutil.which("nice") else cmd
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).exists():
        raise SpecDecodeError(f"llama-server set-up needs {cmd[0]}, which is not installed "
                              f"(e.g. pip install {cmd[0]} or apt install {cmd[0]})")
    done = subprocess.run(full)
    if done.returncode != 0:
        raise SpecDecodeError(f"llama-server set-up failed (status {done.returncode}): {' '.join(cmd)}")


# --------------------------------------------------------------------------- the server and its client


def server_args(model: str | Path, method: str = "plain", *, draft: str | Path | None = None, gamma: int = 4,
                max_ngram: int = 3, threads: int = 2, port: int = 8080, n_ctx: int = 4096) -> list[str]:
    """``llama-server`` arguments for one variant (without the binary).

    Raises:
        ValueError: unknown method, or a draft given / missing where it must not / must.
    """
    if method not in ("plain", "draft", "ngram"):
        raise ValueError(f"unknown llama-server method {method!r}; use plain, draft or ngram")
    if (method == "draft") != (draft is not None):
        raise ValueError("llama-server's draft method takes a draft GGUF, and only it does")
    args = ["-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "--host", "127.0.0.1",
            "--port", str(port), "-np", "1", "--no-webui", "--seed", "0"]
    if method == "draft":
        args += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(gamma), "--spec-draft-n-min", "0",
                 "--spec-draft-p-min", "0", "-td", str(threads), "-tbd", str(threads)]
    elif method == "ngram":
        args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(max_ngram),
                 "--spec-ngram-simple-size-m", str(gamma)]
    return args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerResult:
    """One completion: new token ids, wall seconds around the HTTP request, finish reason, server timings."""

    token_ids: list[int]
    wall_s: float
    finish_reason: str
    timings: dict | None = field(default=None)


def completion_request(prompt_ids: Sequence[int], max_new_tokens: int) -> dict:
    """The ``POST /completion`` body: token ids in, greedy, no prompt cache, token ids back."""
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "temperature": 0.0,
            "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": False,
            "return_tokens": True, "stream": False, "seed": 0}


class ServerClient:
    """HTTP client of one running server (``base_url``): /health and /completion, stdlib only.

    Raises:
        SpecDecodeError: the server did not get healthy in time, or a request failed.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.log: str | None = None  # where the server's output goes, for error messages

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float, alive=lambda: True) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not alive():  # first: a server that died on its port must not pass for another one there
                raise SpecDecodeError(f"llama-server exited before it got healthy (see {self.log or 'its log'})")
            if self.healthy():
                return
            time.sleep(0.2)
        raise SpecDecodeError(f"llama-server at {self.base_url} not healthy after {timeout_s:.0f} s")

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()) -> ServerResult:
        """Greedy completion; token ids cut after the first of ``eos`` (the server keeps the end-of-generation
        token that stopped it in ``tokens``, as our engine does)."""
        body = json.dumps(completion_request(prompt_ids, max_new_tokens)).encode()
        req = urllib.request.Request(self.base_url + "/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise SpecDecodeError(f"llama-server /completion: HTTP {exc.code}: {exc.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise SpecDecodeError(f"llama-server /completion failed: {exc}") from None
        wall = time.perf_counter() - start
        try:
            reply = json.loads(raw)
            tokens = [int(t) for t in reply["tokens"]]
        except (ValueError, KeyError, TypeError):
            raise SpecDecodeError(f"llama-server /completion: no token ids in its reply ({raw[:200]!r}); "
                                  "is it a llama.cpp server that returns 'tokens'?") from None
        eos = set(int(t) for t in eos_token_ids)
        finish = "stop" if reply.get("stop_type") in ("eos", "word") else "length"
        cut = next((i for i, t in enumerate(tokens) if t in eos), None)
        if cut is not None:
            tokens, finish = tokens[:cut + 1], "stop"
        return ServerResult(tokens, wall, finish, reply.get("timings"))


class LlamaServerRunner:
    """A ``llama-server`` process for one variant, started on a free port and stopped by :meth:`close`.

    Args: as :func:`server_args`; ``binary`` defaults to the built one, ``start_timeout_s`` bounds loading.

    Raises:
        SpecDecodeError: not built; the server exited or did not get healthy.
    """

    def __init__(self, model: str | Path, method: str = "plain", *, draft: str | Path | None = None, gamma: int = 4,
                 max_ngram: int = 3, threads: int = 2, n_ctx: int = 4096, binary_path: str | Path | None = None,
                 start_timeout_s: float = 300.0, log: str | Path | None = None) -> None:
        exe = Path(binary_path) if binary_path else require_binary()
        port = free_port()
        args = server_args(model, method, draft=draft, gamma=gamma, max_ngram=max_ngram, threads=threads,
                           port=port, n_ctx=n_ctx)
        self.command = [str(exe), *args]
        self._log = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "LLAMA_ARG_NO_WEBUI": "1"})
        self.client = ServerClient(f"http://127.0.0.1:{port}")
        self.client.log = str(log) if log else None
        try:
            self.client.wait_healthy(start_timeout_s, alive=lambda: self.proc.poll() is None)
        except BaseException:  # not healthy, or Ctrl-C: no server left behind
            self.close()
            raise

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int]) -> ServerResult:
        return self.client.complete(prompt_ids, max_new_tokens, eos_token_ids)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
