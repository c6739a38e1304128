"""``--weights auto``: the fastest weight precision that keeps the model and keeps speculation exact.

Three questions per candidate precision (int4, int8, bf16, fp32), answered by measuring:

1. *Does it keep the model?* (:func:`measure_quality`, :func:`quality_gate`) Teacher-forced on real
   text (Spec-Bench prompts, chat template applied), its next-token argmax must equal float32's on
   at least :data:`MIN_ARGMAX_AGREEMENT` of the positions and its perplexity stay within
   :data:`MAX_PERPLEXITY_CHANGE` of float32's. float32 is the reference and always qualifies.
   A property of the model: cached per model.
2. *Does it keep speculation exact?* (:func:`check_batch_invariance`) The logits of a token must be
   bitwise equal whether it is verified alone or among k + 1 tokens, in one row or in a batch:
   then speculative output equals plain decoding token for token. A property of the kernels this
   CPU runs: cached per machine.
3. *How fast is a step?* (:func:`measure_step`) Median times of a decoding step and of a 6-token
   verification at a mid-length context; candidates are ranked by their mean. Cached per machine.

:func:`choose_precision` picks the fastest candidate that passes 1 and 2 (else the fastest that
passes 1, saying so) and says why in one line. Results are cached under
``<cache dir>/precision/`` as JSON: the first load on a machine measures (seconds for a 135M model,
one to three minutes for a 1.5B one on 2 cores), later loads read.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.lowbit import set_weight_precision

#: Next-token argmax agreement with float32 a precision needs to keep the model.
MIN_ARGMAX_AGREEMENT = 0.97
#: Largest relative perplexity change against float32 (0.01 = 1%).
MAX_PERPLEXITY_CHANGE = 0.01
#: Candidates, in the order they are tried (ties in speed go to the earlier one).
CANDIDATES = ("int4", "int8", "bf16", "fp32")
#: Bump when what is measured or how changes: older cache files are then measured again.
CACHE_VERSION = 4


@dataclass(frozen=True)
class QualityReport:
    """What a precision does to the model, teacher-forced against float32.

    Attributes:
        precision: "fp32", "bf16", "int8" or "int4".
        argmax_agreement: fraction of positions whose next-token argmax equals float32's, in [0, 1].
        nll: mean negative log-likelihood of the text's tokens, nats/token.
        perplexity_change: perplexity / float32's perplexity - 1 (+0.055 = 5.5% higher).
        positions: scored positions.
    """

    precision: str
    argmax_agreement: float
    nll: float
    perplexity_change: float
    positions: int


def quality_gate(report: QualityReport) -> tuple[bool, str]:
    """(passes, one line of figures): agreement >= MIN_ARGMAX_AGREEMENT and |perplexity change| <= MAX.

    Both figures are compared as they are reported, in percent to one decimal (96.97% is 97.0%, and
    passes): on a few thousand positions the measurement's own standard error is about 0.3%, so a
    finer comparison would decide on noise.
    """
    agreement = round(100 * report.argmax_agreement, 1)
    change = round(100 * report.perplexity_change, 1)
    ok = agreement >= round(100 * MIN_ARGMAX_AGREEMENT, 1) and abs(change) <= round(100 * MAX_PERPLEXITY_CHANGE, 1)
    line = (f"next-token agreement with float32 {100 * report.argmax_agreement:.1f}% (needs >= "
            f"{100 * MIN_ARGMAX_AGREEMENT:.0f}%), perplexity {100 * report.perplexity_change:+.1f}% "
            f"(needs within {100 * MAX_PERPLEXITY_CHANGE:.0f}%)")
    return ok, line


#: Quality figures of the offline catalog's models, measured with ``scripts/bench/precision_quality.py``
#: (26 Spec-Bench prompts, 2 per category, chat template, up to 512 tokens each, teacher-forced,
#: float32 reference; docs/results/precision/), so a first load measures only this machine.
CATALOG_QUALITY: dict[str, dict[str, QualityReport]] = {
    "smollm2-135m": {
        "bf16": QualityReport("bf16", 0.96975, 3.48981, -0.00448, 3768),
        # int8 / int4 with 8-bit activations per row (the kernels of issue 27): docs/results/kernels/quality_*
        "int8": QualityReport("int8", 0.95621, 3.48435, -0.00990, 3768),
        "int4": QualityReport("int4", 0.97505, 3.49498, 0.00068, 3768),
    },
    "qwen2.5-coder-0.5b": {
        "bf16": QualityReport("bf16", 0.98485, 4.20118, 0.00044, 3696),
        # int4 with 8-bit activations, 13 prompts (docs/results/kernels/); int8 not measured with them yet
        "int4": QualityReport("int4", 0.98390, 4.33706, 0.00267, 1801),
    },
    "qwen2.5-coder-1.5b": {
        "bf16": QualityReport("bf16", 0.98593, 3.49068, -0.00209, 3696),
        # int4 (the Q4_K_M file's blocks) with 8-bit activations per row, a scale per 256 for the K-quants
        # as llama.cpp runs the file (docs/results/kernels/quality_qwen2.5-coder-1.5b.md: a scale per 32
        # would give 98.7% / +0.6%); int8 not measured with them yet
        "int4": QualityReport("int4", 0.96104, 3.53341, 0.04147, 3696),
    },
}


def quality_texts(tokenizer, per_category: int = 2, max_tokens: int = 512) -> list[list[int]]:
    """Token ids of the Spec-Bench prompts (``per_category`` of each), chat template applied, at most
    ``max_tokens`` each; the first HumanEval problems when ../shared/data is missing."""
    from specdecode.data import SharedDataMissing, load_prompts

    try:
        prompts = load_prompts("spec-bench")
    except SharedDataMissing:
        prompts = load_prompts(f"humaneval:{13 * per_category}")
    texts, seen = [], {}
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 1 < limit < max_tokens:
        max_tokens = limit
    for p in prompts:
        if seen.get(p.category, 0) >= per_category:
            continue
        seen[p.category] = seen.get(p.category, 0) + 1
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = p.turns[0]
        texts.append(tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens])
    return texts


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, texts: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], float, int]:
    """Per text the next-token argmax [n - 1] int64, plus the summed NLL (nats) and the positions scored.

    Runs the owned forward where it applies, with its fast (prefill) numerics: the batch-invariant
    ones differ from them only in rounding, which moves agreement by near-ties, not the model.
    """
    from specdecode.kv import make_runner

    runner = make_runner(model, batch_invariant=False).row(0)
    argmaxes, nll, n = [], 0.0, 0
    for ids in texts:
        runner.reset()
        logits = runner.forward(list(ids)).float()[:-1]
        logp = torch.log_softmax(logits, -1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        n += len(ids) - 1
        argmaxes.append(logits.argmax(-1))
    runner.reset()
    return argmaxes, nll, n


def measure_quality(reference: torch.nn.Module, candidate: torch.nn.Module, precision: str,
                    texts: Sequence[Sequence[int]],
                    reference_scores: tuple[list[torch.Tensor], float, int] | None = None) -> QualityReport:
    """Teacher-force ``texts`` through a float32 ``reference`` and a ``candidate`` (the same model in
    ``precision``); compare next-token argmax and perplexity.

    Args:
        reference_scores: :func:`teacher_forced` of the reference, when already computed.
    """
    ref_argmax, ref_nll, n = reference_scores or teacher_forced(reference, texts)
    argmax, nll, _ = teacher_forced(candidate, texts)
    agree = sum(int((a == b).sum()) for a, b in zip(argmax, ref_argmax))
    return QualityReport(precision, agree / max(n, 1), nll / max(n, 1),
                         math.exp((nll - ref_nll) / max(n, 1)) - 1.0, n)


@dataclass(frozen=True)
class ExactnessReport:
    """Whether a token's logits are bitwise equal verified alone or among others (the contract).

    Attributes:
        exact: every comparison equal, bit for bit.
        detail: the first difference ("9 tokens in one forward: row 3 differs by 0.44") or what was checked.
        row_kernel: the product kernel the batch-invariant forward uses (``kernels.row_product``),
            None for int8 or the Hugging Face forward.
    """

    exact: bool
    detail: str
    row_kernel: str | None = None


@torch.inference_mode()
def check_batch_invariance(model: torch.nn.Module, counts: Sequence[int] = (2, 5, 9, 17),
                           context: int = 48, seed: int = 0, forward: str = "auto") -> ExactnessReport:
    """Verify the batch-invariance contract on ``model`` as loaded, on this machine.

    After a prefill of ``context`` random tokens, for each c in ``counts``: the logits of c tokens fed
    in one forward equal those of the same tokens fed one by one, bitwise; and two rows verified
    together equal each row verified alone (the batch case).
    """
    from specdecode.kv import make_runner

    runner = make_runner(model, forward, num_slots=2)
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(2)]
    feeds = [torch.randint(0, vocab, (max(counts),), generator=gen).tolist() for _ in range(2)]
    kernel = getattr(runner, "row_kernel", None)
    try:
        for slot in range(2):
            runner.forward(slice(slot, slot + 1), [prompts[slot]], last_only=True)
        base = [runner.length(0), runner.length(1)]

        def reset() -> None:
            for slot in range(2):
                runner.rollback(slot, base[slot])

        alone = []
        for t in feeds[0]:
            alone.append(runner.forward(slice(0, 1), [[t]])[0, 0])
        alone = torch.stack(alone)
        reset()
        for c in counts:
            together = runner.forward(slice(0, 1), [feeds[0][:c]])[0]
            reset()
            diff = (together - alone[:c]).abs().amax(-1)
            if bool((diff != 0).any()):
                row = int((diff != 0).nonzero()[0])
                return ExactnessReport(False, f"{c} tokens in one forward: token {row} differs from the same token "
                                              f"fed alone by {float(diff[row]):.3g} in a logit", kernel)
        c = counts[len(counts) // 2]
        both = runner.forward(slice(0, 2), [feeds[0][:c], feeds[1][:c]])
        reset()
        second = runner.forward(slice(1, 2), [feeds[1][:c]])[0]
        reset()
        for row, single in ((0, alone[:c]), (1, second)):
            d = float((both[row, :c] - single).abs().max())
            if d != 0:
                return ExactnessReport(False, f"two rows of {c} tokens in one forward: row {row} differs from "
                                              f"the row alone by {d:.3g} in a logit", kernel)
    finally:
        runner.release()
    return ExactnessReport(True, f"{', '.join(map(str, counts))} tokens and 2 rows x {c}: bitwise equal", kernel)


@torch.inference_mode()
def measure_step(model: torch.nn.Module, context: int = 256, repeats: int = 7, verify_rows: int = 6,
                 seed: int = 0, forward: str = "auto") -> tuple[float, float]:
    """(T_decode, T_verify) in seconds: the fastest of ``repeats`` timings of a one-token decoding step and
    of a ``verify_rows``-token verification forward, after ``context`` cached tokens."""
    from specdecode.kv import make_runner

    runner = make_runner(model, forward)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.vocab_size, (context + verify_rows,), generator=gen).tolist()
    row = runner.row(0)
    try:
        row.forward(ids[:context], last_only=True)
        times = {1: [], verify_rows: []}
        for _ in range(repeats + 1):  # the first round warms up
            for k in times:
                t0 = time.perf_counter()
                row.forward(ids[context : context + k])
                times[k].append(time.perf_counter() - t0)
                row.rollback(context)
        return min(times[1][1:]), min(times[verify_rows][1:])  # the fastest: a shared machine only adds time
    finally:
        row.reset()


@dataclass
class Candidate:
    """One precision's figures on this machine (``None``: not measured, e.g. it failed the gate)."""

    precision: str
    quality_ok: bool
    quality: str
    exact: bool | None = None
    exact_detail: str = ""
    decode_s: float | None = None
    verify_s: float | None = None


@dataclass
class PrecisionChoice:
    """What ``--weights auto`` picked, and why.

    Attributes:
        precision: the chosen precision ("int4", "int8", "bf16" or "fp32").
        exact: speculative output equals plain decoding token for token (the contract held here); None: not
            measured (an explicit ``--weights`` that ``auto`` never measured on this machine).
        reason: one line for the user.
        candidates: every candidate's figures, fastest first.
        cached: read from the cache (nothing measured this time).
    """

    precision: str
    exact: bool | None
    reason: str
    candidates: list[Candidate] = field(default_factory=list)
    cached: bool = False
    #: The cache file the figures were read from / written to (delete it to measure again).
    cache_file: str | None = None


def machine_key(*, include_threads: bool = True) -> str:
    """CPU model, the SIMD flags that pick kernels, torch version and (unless ``include_threads`` is
    False) the current torch thread count, hashed: one cache per machine."""
    from specdecode.bench.env import cpu_flags, cpu_model

    text = f"{cpu_model()}|{','.join(cpu_flags())}|torch {torch.__version__}"
    if include_threads:
        text += f"|threads {torch.get_num_threads()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_key(loaded) -> str:
    ident = f"{loaded.source}|{loaded.sha256 or ''}|{type(loaded.model).__name__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _cache_path(cache_dir: Path, loaded) -> Path:
    return Path(cache_dir) / "precision" / f"{_model_key(loaded)}.json"


def _read_cache(path: Path) -> dict:
    """The cached measurements, {} when missing, unreadable, of another version or malformed."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    try:
        for q in data.get("quality", {}).values():
            QualityReport(**q)
        for machine in data.get("machines", {}).values():
            for m in machine.values():
                float(m.get("decode_s", 0.0)), float(m.get("verify_s", 0.0))
    except (TypeError, ValueError, AttributeError):
        return {}
    return data


def choose_precision(loaded, cache_dir: str | Path, *, status: Callable[[str], None] | None = None,
                     candidates: Sequence[str] = CANDIDATES, texts: Sequence[Sequence[int]] | None = None,
                     remeasure: bool = False, forward: str = "auto") -> PrecisionChoice:
    """Pick the precision ``loaded`` (a float32 :class:`~specdecode.models.LoadedModel`) should run in.

    Measures what the cache lacks: quality per precision (per model), batch invariance and step
    time per precision (per machine). Nothing here changes ``loaded``: candidates run on copies.

    Args:
        cache_dir: root of the cache (``<cache_dir>/precision/<model>.json``).
        status: called with a line before each measurement (progress for the user).
        texts: token ids to teacher-force for the quality gate (default :func:`quality_texts`).
        remeasure: ignore the cache.
        forward: the forward the engine will run ("auto", "owned", "hf": ``kv.make_runner``); exactness
            and speed are properties of the forward as much as of the precision.

    Raises:
        ValueError: ``loaded`` is not float32 (the quality reference), or an unknown candidate.
    """
    dtype = next(p.dtype for p in loaded.model.parameters() if p.is_floating_point())
    if dtype != torch.float32:
        raise ValueError(f"choose_precision needs the float32 model as the reference, got {dtype}")
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown:
        raise ValueError(f"unknown precision(s) {unknown}; choose from {', '.join(CANDIDATES)}")
    say = status or (lambda line: None)
    path = _cache_path(Path(cache_dir), loaded)
    data = {} if remeasure else _read_cache(path)
    data.setdefault("version", CACHE_VERSION)
    data.setdefault("model", loaded.name)
    quality = data.setdefault("quality", {})
    for precision, report in CATALOG_QUALITY.get(str(loaded.name).strip().lower(), {}).items():
        quality.setdefault(precision, asdict(report))
    machine = data.setdefault("machines", {}).setdefault(machine_key(), {})
    measured = False
    ref_scores = None
    no_text = None
    for precision in candidates:
        if precision != "fp32" and precision not in quality and no_text is None:
            if texts is None:  # a smaller sample than the catalog's: a first load stays short
                try:
                    texts = [t[: loaded.max_context] for t in quality_texts(loaded.tokenizer, 1, 256)]
                except SpecDecodeError as exc:  # no ../shared/data and no HumanEval package to install
                    no_text = f"its effect on the model could not be measured here ({exc}); --weights {precision} runs it"
                    continue
            say(f"measuring what {precision} weights do to the model (teacher-forced, {len(texts)} prompts; once per model)")
            if ref_scores is None:
                ref_scores = teacher_forced(loaded.model, texts)
            quality[precision] = asdict(measure_quality(loaded.model, _copy_in(loaded, precision), precision,
                                                        texts, ref_scores))
            measured = True
    result = []
    for precision in candidates:
        if precision == "fp32":
            ok, line = True, "the reference"
        elif precision not in quality:
            ok, line = False, no_text or "not measured"
        else:
            ok, line = quality_gate(QualityReport(**quality[precision]))
        result.append(Candidate(precision, ok, line))

    def key(c: Candidate) -> str:
        return c.precision if forward == "auto" else f"{c.precision}/{forward}"

    kept = [c for c in result if c.quality_ok]
    copies: dict[str, torch.nn.Module] = {}  # one copy per candidate, for both passes

    def model_in(precision: str) -> torch.nn.Module:
        if precision == "fp32":
            return loaded.model
        if precision not in copies:
            copies[precision] = _copy_in(loaded, precision)
        return copies[precision]

    for c in kept:  # 1. step time of every precision that keeps the model
        m = machine.setdefault(key(c), {})
        if "decode_s" not in m:
            say(f"measuring {c.precision} on this machine: step time (once per machine)")
            m["decode_s"], m["verify_s"] = measure_step(model_in(c.precision),
                                                        context=min(256, loaded.max_context // 2), forward=forward)
            measured = True
        c.decode_s, c.verify_s = m["decode_s"], m["verify_s"]
    for c in sorted(kept, key=_step_cost):  # 2. batch invariance, fastest first, until one holds
        m = machine[key(c)]
        if "exact" not in m:
            say(f"checking that {c.precision} keeps speculation exact on this machine (once per machine)")
            inv = check_batch_invariance(model_in(c.precision), context=min(48, loaded.max_context // 4),
                                         forward=forward)
            m.update(exact=inv.exact, detail=inv.detail, row_kernel=inv.row_kernel)
            measured = True
        c.exact, c.exact_detail = m["exact"], m["detail"]
        if c.exact:
            break  # slower ones need not be checked
    if measured:
        _write_cache(path, data, say)
    choice = _decide(result, cached=not measured)
    choice.cache_file = str(path)
    return choice


def _write_cache(path: Path, data: dict, say: Callable[[str], None]) -> None:
    """Atomically (a temporary file of its own, then ``os.replace``); a cache that cannot be written costs a
    measurement next time, never the load."""
    import os
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        say(f"could not cache the precision measurements in {path.parent} ({exc}); they will be measured again")


def _decide(candidates: list[Candidate], cached: bool = False) -> PrecisionChoice:
    kept = sorted((c for c in candidates if c.quality_ok), key=_step_cost)
    if not kept:
        raise SpecDecodeError("no candidate precision keeps the model ("
                              + "; ".join(f"{c.precision}: {c.quality}" for c in candidates)
                              + "); include fp32, the reference, or choose one with --weights")
    exact = [c for c in kept if c.exact]
    best = exact[0] if exact else kept[0]
    fp32 = next((c for c in candidates if c.precision == "fp32" and c.decode_s), None)
    speed = f", {_step_cost(fp32) / _step_cost(best):.1f}x float32's speed" if fp32 and best is not fp32 else ""
    others = []
    for c in candidates:
        if c is best:
            continue
        if not c.quality_ok:
            others.append(f"{c.precision} changes the model ({c.quality})")
        elif c.exact is False:
            others.append(f"{c.precision} is not batch-invariant here ({c.exact_detail})")
        else:
            others.append(f"{c.precision} is slower ({1000 * _step_cost(c):.0f} ms a step)")
    if best.exact:
        reason = f"{best.precision}: the fastest precision that keeps the model and keeps speculation exact{speed}"
    else:
        reason = (f"{best.precision}: no precision that keeps the model is batch-invariant on this machine, so "
                  f"speculative output may leave plain decoding's path at near-ties")
    if others:
        reason += "; " + "; ".join(others)
    ordered = sorted(candidates, key=lambda c: (c.decode_s is None, _step_cost(c) if c.decode_s else 0.0))
    return PrecisionChoice(best.precision, bool(best.exact), reason, ordered, cached)


def _step_cost(c: Candidate) -> float:
    """Seconds per step, the mean of a decoding step and a 6-token verification (plain decoding runs the
    first, speculation the second)."""
    return (c.decode_s + c.verify_s) / 2


def _copy_in(loaded, precision: str) -> torch.nn.Module:
    """A copy of ``loaded``'s float32 model executing in ``precision`` (the original is untouched).

    A model from a local directory (the catalog's converted copies included) is read again in the
    precision's load dtype, so a bf16 copy of a 1.5B model costs 3 GB, not a 6 GB float32 clone first;
    otherwise the model is deep-copied.
    """
    source = Path(str(loaded.source))
    if source.is_dir() and (source / "config.json").exists():
        from specdecode.models import quiet_hf_output
        from transformers import AutoModelForCausalLM

        with quiet_hf_output():
            clone = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
        clone.eval()
        clone.requires_grad_(False)
    else:
        clone = copy.deepcopy(loaded.model)
        clone.__dict__.pop("_specdecode_fused_layers", None)
    if precision in ("int4", "int8"):  # a GGUF model's own 4-bit blocks (cached), not a requantization
        from dataclasses import replace

        from specdecode.lowbit import quantize_loaded

        return quantize_loaded(replace(loaded, model=clone), precision)
    return set_weight_precision(clone, precision)


def load_target(spec: str, weights: str = "auto", *, dtype: torch.dtype | str = torch.float32, cache_dir=None,
                progress: bool = True, status: Callable[[str], None] | None = None, forward: str = "auto"):
    """Load a target with :func:`specdecode.models.load_model` and set its weight precision.

    ``weights="auto"``: :func:`choose_precision` on the float32 model (``dtype`` other than float32:
    that dtype's precision, nothing measured). An explicit precision is used as given; when it
    does not pass the quality gate and its figures are cached, the reason says so.

    Returns:
        (LoadedModel in its precision, PrecisionChoice: what runs and why).

    Raises:
        ModelLoadError (from load_model), SpecDecodeError (unknown precision).
    """
    from specdecode.kernels import WEIGHT_PRECISIONS
    from specdecode.models import _normalize_dtype, default_cache_dir, load_model

    if weights != "auto" and weights not in WEIGHT_PRECISIONS:
        raise SpecDecodeError(f"unknown weight precision {weights!r}; choose auto or one of {', '.join(WEIGHT_PRECISIONS)}")
    dtype = _normalize_dtype(dtype)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if weights == "auto" and dtype != torch.float32:
        if dtype != torch.bfloat16:
            raise SpecDecodeError(f"--weights auto chooses among {', '.join(CANDIDATES)} from the float32 model; "
                                  f"with --dtype {str(dtype).removeprefix('torch.')} give --weights fp32 (the weights "
                                  "stay in that dtype), or drop --dtype")
        loaded = load_model(spec, dtype=dtype, cache_dir=cache_dir, progress=progress)
        set_weight_precision(loaded.model, "bf16")
        return loaded, _explicit(loaded, "bf16", cache, forward, why="the weights were loaded in bfloat16 (--dtype)")
    if weights != "auto":
        from specdecode.lowbit import load_in_precision

        loaded = load_in_precision(spec, weights, dtype=dtype, cache_dir=cache_dir, progress=progress, say=status)
        return loaded, _explicit(loaded, weights, cache, forward)
    fast = _gguf_blocks_choice(spec, cache_dir, progress, status, forward)
    if fast is not None:
        return fast
    loaded = load_model(spec, dtype=torch.float32, cache_dir=cache_dir, progress=progress)
    choice = choose_precision(loaded, cache, status=status, forward=forward)
    if choice.precision in ("int4", "int8"):
        from specdecode.lowbit import quantize_loaded

        quantize_loaded(loaded, choice.precision, cache_dir=cache_dir, progress=progress, say=status)
    else:
        set_weight_precision(loaded.model, choice.precision)
    return loaded, choice


def _gguf_blocks_choice(spec: str, cache_dir, progress: bool, status, forward: str):
    """``--weights auto`` for a GGUF model on a CPU that runs the low-bit kernel: the file's own blocks
    (int4), chosen without measuring anything (under a second once its blocks are cached).

    Why no measurement is needed: those blocks *are* the model as published (the float copy is their
    dequantization), they are the fewest bytes a step can read, and with the kernel every product, and
    the whole owned forward, is row-invariant by construction, on every x86 CPU with AVX2. The one
    change against the float copy is 8-bit activations per row (as llama.cpp runs the same file);
    its effect on the catalog models is :data:`CATALOG_QUALITY`. Returns None (the measured choice
    runs) for other models, CPUs without a kernel, or an architecture the owned forward lacks.
    """
    from specdecode.kv.owned import supports
    from specdecode.lowbit import active_variant, load_in_precision
    from specdecode.models import resolve_spec

    if forward == "hf":
        return None
    try:
        source = resolve_spec(spec)
    except SpecDecodeError:
        return None
    if source.kind not in ("catalog", "gguf"):
        return None
    variant = active_variant()  # a wrong SPECDECODE_KERNEL_ISA says so here, before anything loads
    if variant is None:
        return None
    try:  # a tensor type or architecture without a low-bit layout here: the measured choice instead
        loaded = load_in_precision(spec, "int4", cache_dir=cache_dir, progress=progress, say=status)
    except SpecDecodeError:
        return None
    if not supports(loaded.model):
        return None
    q = CATALOG_QUALITY.get(str(loaded.name).strip().lower(), {}).get("int4")
    figures = ""
    if q is not None:
        figures = (f"; against the float copy: next-token agreement {100 * q.argmax_agreement:.1f}%, perplexity "
                   f"{100 * q.perplexity_change:+.1f}%")
        if not quality_gate(q)[0]:  # the file as llama.cpp runs it, below our gate for a precision we pick
            figures += (" (below the quality gate of a precision we choose ourselves: --weights bf16 or fp32 run "
                        "the float copy, slower)")
    reason = (f"int4: the GGUF file's own blocks (the fewest bytes a step reads), {variant} kernel with 8-bit "
              f"activations per row, as llama.cpp runs the file{figures}; speculation stays exact by construction "
              "(row-independent products and attention)")
    return loaded, PrecisionChoice("int4", True, reason)


def _explicit(loaded, weights: str, cache: Path, forward: str = "auto",
              why: str = "chosen with --weights") -> PrecisionChoice:
    """The choice the user made, with the quality / exactness figures known for it (catalog, cache); its
    exactness is None ("not measured") unless a first load with ``--weights auto`` measured it here."""
    data = _read_cache(_cache_path(cache, loaded))
    q = data.get("quality", {}).get(weights)
    if q is None and weights in CATALOG_QUALITY.get(str(loaded.name).strip().lower(), {}):
        q = asdict(CATALOG_QUALITY[str(loaded.name).strip().lower()][weights])
    key = weights if forward == "auto" else f"{weights}/{forward}"
    m = data.get("machines", {}).get(machine_key(), {}).get(key, {})
    reason = f"{weights}: {why}"
    if q is not None and weights != "fp32":
        try:
            ok, line = quality_gate(QualityReport(**q))
        except TypeError:
            ok, line = True, ""
        if not ok:
            reason += f"; it changes the model: {line}"
    exact = m.get("exact")
    if exact is None and weights in ("int4", "int8") and forward != "hf":
        from specdecode.kv.owned import supports

        if supports(loaded.model):  # row-independent low-bit products and attention: by construction
            from specdecode.lowbit import active_variant, kernel_status

            exact = True
            active_variant()
            reason += (f"; {kernel_status()}; speculation stays exact (row-independent low-bit products in the "
                       "owned forward)")
    if exact is None:
        reason += "; whether speculation stays exact with it here was not measured (--weights auto measures it)"
    elif not exact:
        reason += f"; not batch-invariant here ({m.get('detail', '')}): output may leave plain decoding's path"
    return PrecisionChoice(weights, exact, reason)
