"""The benchmark's settings and prompts: :class:`BenchConfig` (``specdecode bench``'s flags, checked once) and
the prompt selection and encoding every run shares (``specdecode.bench.runner`` runs the matrix)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.options import WEIGHT_CHOICES, WEIGHT_PRECISIONS
from specdecode.errors import SpecDecodeError
from specdecode.validate import check_policy_name, check_threads, check_verification
from specdecode.data import load_prompts

KERNELS = ("default", "small-row")
#: Spec-Bench's 13 categories come from ``spec-bench``; the issue's four prompt sources.
DEFAULT_DATASETS = ("spec-bench", "humaneval", "mt-bench", "gsm8k")


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. Defaults are the full matrix; see :func:`quick_config` and :func:`smoke_config`.

    Attributes:
        target: model spec of the target (``load_model``; ``smoke:target`` for the built-in tiny one).
        methods: method specs (``ngram:k=5``); empty = every registered proposer (those that need a
            draft model only when ``draft`` is set).
        draft: default draft-model spec for methods that take one.
        datasets: prompt sets (``spec-bench``, ``spec-bench:coding``, ``humaneval``, ``mt-bench``, ``gsm8k``).
        limit: prompts per category (None = all).
        max_new_tokens: per prompt.
        temperature: 0 = greedy (outputs compared across methods and with HF); > 0 samples.
        verification: how our engine verifies sampled drafts ("auto", "token", "block";
            ``EngineConfig.verification``); the HF peer has its own. Greedy runs are unaffected.
        policy: draft-length policy of our methods (``policy.build_policy``; ``auto``: cost-model for n-gram,
            fixed gamma for the others).
        seed: base seed; prompt i uses seed + i in every variant.
        gamma: draft length of methods whose spec has no ``k``.
        gammas: extra sweep: every method family also runs at each of these gammas.
        peer: also run transformers' plain / assisted / prompt-lookup generate.
        chat: apply the chat template to chat prompts (HumanEval is completion text, never templated).
        probe: time target forwards of k + 1 tokens (T_verify(k)) and draft forwards for the theory.
        warmup: one short unrecorded generation per variant before measuring.
        repeats: runs of every (prompt, variant), interleaved; figures use the fastest (on a shared
            machine noise only adds time). A rerun with more repeats adds runs to the old ones.
        dtype: model dtype name.
        kernel: "default" (the Hugging Face forward as shipped) or "small-row" (every linear layer of
            target and drafts computed as ``W @ x.T`` for few rows: ``specdecode.kernels``); the HF
            peer runs the same model objects, so both sides get the same kernels.
        llama_cpp: also run llama-cpp-python (``bench.llamacpp``).
        openvino: also run OpenVINO GenAI in its own venv (``bench.openvino``; ``--setup-peers`` first).
        openvino_weights: weight format of the OpenVINO exports ("int8", "int4", "fp16").
        llama_server: also run llama.cpp's C++ ``llama-server`` (``bench.llamaserver``; ``--setup-peers`` first).
        threads: torch intra-op threads (None = torch's default); the peers get the same count.
        remeasure_bandwidth: measure the memory read bandwidth of the roofline again (``bench.roofline``;
            otherwise it is measured once per machine and thread count, and cached).
        output: report directory (records.jsonl, report.md, report.json, PNGs).
        preset: name of the preset the config came from ("full", "quick", "smoke").
    """

    target: str = "smollm2-135m"
    methods: tuple[str, ...] = ()
    draft: str | None = None
    datasets: tuple[str, ...] = DEFAULT_DATASETS
    limit: int | None = 5
    max_new_tokens: int = 128
    temperature: float = 0.0
    verification: str = "auto"
    policy: str = "auto"
    seed: int = 0
    gamma: int = 4
    gammas: tuple[int, ...] = ()
    peer: bool = True
    chat: bool = True
    probe: bool = True
    warmup: bool = True
    repeats: int = 1
    dtype: str = "float32"
    kernel: str = "default"
    draft_weights: str | None = None
    weights: str = "auto"
    llama_cpp: bool = False
    openvino: bool = False
    openvino_weights: str = "int8"
    llama_server: bool = False
    threads: int | None = None
    remeasure_bandwidth: bool = False
    output: str = "bench-out/full"
    preset: str = "full"

    def __post_init__(self) -> None:
        from specdecode.types import SamplingParams  # lazy: torch (the CLI checks a BenchConfig without it)


        SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens)  # range checks
        check_verification(self.verification, "--verification")
        check_policy_name(self.policy)
        for g in (self.gamma, *self.gammas):
            if not isinstance(g, int) or not 1 <= g <= 64:
                raise SpecDecodeError(f"gamma values must be integers in [1, 64], got {g!r}")
        if self.limit is not None and self.limit < 1:
            raise SpecDecodeError(f"--limit must be >= 1, got {self.limit}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise SpecDecodeError(f"--repeats must be an integer >= 1, got {self.repeats!r}")
        check_threads(self.threads)  # 1..the cores this process may use
        if not self.datasets:
            raise SpecDecodeError("no dataset selected")
        if self.weights not in WEIGHT_CHOICES:
            raise SpecDecodeError(f"unknown weight precision {self.weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
        if self.draft_weights is not None and self.draft_weights not in WEIGHT_PRECISIONS:
            raise SpecDecodeError(f"unknown weight precision {self.draft_weights!r}; choose one of "
                                  f"{', '.join(WEIGHT_PRECISIONS)}")
        if (self.openvino or self.llama_server) and self.temperature > 0:
            raise SpecDecodeError("--openvino / --llama-server run greedy decoding only: drop them or use "
                                  "--temperature 0")
        if self.openvino_weights not in ("int8", "int4", "fp16"):  # bench.openvino.WEIGHT_FORMATS
            raise SpecDecodeError(f"unknown OpenVINO weight format {self.openvino_weights!r}; use int8, int4, fp16")
        if self.kernel not in KERNELS:
            raise SpecDecodeError(f"unknown kernel {self.kernel!r}; choose one of {', '.join(KERNELS)}")

    def settings(self) -> dict:
        """What makes records comparable: a rerun resumes only records with equal settings."""
        out = {"target": self.target, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
               "seed": self.seed, "dtype": self.dtype, "chat": self.chat, "batch_size": 1, "kernel": self.kernel}
        # Settings added later enter only when set to something else than their default, so that
        # output directories written before they existed keep resuming.
        if (self.draft_weights or self.weights) != "fp32":  # None: the target's (what ran, once it is resolved)
            out["draft_weights"] = self.draft_weights or self.weights
        if self.weights != "fp32":
            out["weights"] = self.weights
        if self.verification != "auto":
            out["verification"] = self.verification
        if self.policy != "fixed":  # (records from before the policy was a setting ran the fixed policy)
            out["policy"] = self.policy
        if self.openvino and self.openvino_weights != "int8":
            out["openvino_weights"] = self.openvino_weights
        if self.threads is not None:  # the runner always sets the count it runs at (so a resume at another count
            out["threads"] = self.threads  # redoes the runs; folders written before it was a setting do not resume)
        return out

    def settings_id(self) -> str:
        blob = json.dumps(self.settings(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def quick_config(**overrides) -> BenchConfig:
    """10-15 minutes on 2 cores, SmolLM2-135M: n-gram at gamma 2 / 4, 2 prompts of 3 Spec-Bench categories, 48 tokens,
    each run twice (the faster counts)."""
    base = dict(target="smollm2-135m", methods=("ngram",), datasets=("spec-bench:summarization",
                "spec-bench:coding", "spec-bench:math_reasoning"), limit=2, max_new_tokens=48, gamma=4,
                gammas=(2, 4), repeats=2, output="bench-out/quick", preset="quick")
    return BenchConfig(**{**base, **overrides})


def smoke_config(**overrides) -> BenchConfig:
    """Seconds on tiny random models built in code (CI): draft-model and n-gram, gamma 2 and 4, HF peer.

    One torch thread: tiny matrices gain nothing from two, and a loaded CI machine makes
    multi-threaded tiny ops wait on each other.
    """
    from specdecode.bench.smoke import SMOKE_DATASET, SMOKE_DRAFT, SMOKE_TARGET  # lazy: torch (smoke models are built in code)

    base = dict(target=SMOKE_TARGET, draft=SMOKE_DRAFT, methods=("ngram", "draft-model"), datasets=(SMOKE_DATASET,), limit=2,
                max_new_tokens=24, gamma=4, gammas=(2, 4), dtype="float64", weights="fp32", probe=True, threads=1,
                output="bench-out/smoke", preset="smoke")
    return BenchConfig(**{**base, **overrides})


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of the matrix: identity, category label for tables, text, and whether it is chat."""

    key: str  # unique: "spec-bench/81", "humaneval/HumanEval/0"
    dataset: str
    category: str  # the table column: Spec-Bench category, or the dataset name for HumanEval / GSM8K
    text: str
    is_completion: bool


def select_prompts(datasets: Sequence[str], limit: int | None) -> list[BenchPrompt]:
    """Prompts of the named sets, at most ``limit`` per category, ordered round-robin over categories.

    Round-robin order makes a partial (interrupted) run cover every category early.

    Raises:
        SpecDecodeError: unknown dataset or category (from ``load_prompts``), or nothing selected.
    """
    from specdecode.bench.smoke import SMOKE_DATASET, SMOKE_PROMPTS  # lazy: torch (smoke models are built in code)

    by_category: dict[str, list[BenchPrompt]] = {}
    seen: set[str] = set()
    for spec in datasets:
        if spec.strip().lower() == SMOKE_DATASET:
            items = [BenchPrompt(f"smoke/{i}", "smoke", cat, text, comp)
                     for i, (cat, text, comp) in enumerate(SMOKE_PROMPTS)]
        else:
            items = [_bench_prompt(p) for p in load_prompts(spec)]
        for item in items:
            if item.key in seen:
                continue
            bucket = by_category.setdefault(item.category, [])
            if limit is None or len(bucket) < limit:
                bucket.append(item)
                seen.add(item.key)
    prompts = [p for i in range(max(map(len, by_category.values()), default=0))
               for bucket in by_category.values() if i < len(bucket) for p in [bucket[i]]]
    if not prompts:
        raise SpecDecodeError(f"no prompts selected from {list(datasets)}")
    return prompts


def _bench_prompt(p) -> BenchPrompt:
    key = p.id if p.id.startswith(p.dataset) else f"{p.dataset}/{p.id}"
    category = p.category if p.dataset in ("spec-bench", "mt-bench") else p.dataset
    if p.dataset == "mt-bench":
        category = f"mt-bench/{p.category}"
    return BenchPrompt(key, p.dataset, category, p.turns[0], p.is_completion)


def encode_prompt(tokenizer, prompt: BenchPrompt, chat: bool) -> tuple[list[int], bool]:
    """Token ids of a prompt's first turn, through the chat template when the model has one.

    Completion prompts (HumanEval) are never templated. Returns (ids, templated).
    """
    use_chat = chat and not prompt.is_completion and bool(getattr(tokenizer, "chat_template", None))
    if use_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt.text)["input_ids"]
    return [int(t) for t in ids], use_chat
