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

The measures themselves (quality, exactness, step cost) are :mod:`specdecode.precision_measures`; this module
decides, caches and loads.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specdecode.bench.env import cpu_flags, cpu_model
from specdecode.errors import SpecDecodeError
from specdecode.kernels import WEIGHT_PRECISIONS
from specdecode.lowbit import (ISA_ENV, active_variant, build_in_background, check_forced_variant, kernel_status,
                               load_in_precision, quantize_loaded, set_weight_precision, supported_variants)
from specdecode.precision_measures import (  # noqa: F401 - the measures' names, re-exported here
    CATALOG_QUALITY,
    MAX_PERPLEXITY_CHANGE,
    MIN_ARGMAX_AGREEMENT,
    ExactnessReport,
    QualityReport,
    check_batch_invariance,
    measure_quality,
    measure_step,
    quality_gate,
    quality_texts,
    teacher_forced,
)


#: Candidates, in the order they are tried (ties in speed go to the earlier one).
CANDIDATES = ("int4", "int8", "bf16", "fp32")
#: Bump when what is measured or how changes: older cache files are then measured again.
CACHE_VERSION = 4
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
        # lazy: these pull in transformers (start-up time)
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
    # lazy: specdecode.models pulls in transformers (start-up time)
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
        loaded = load_in_precision(spec, weights, dtype=dtype, cache_dir=cache_dir, progress=progress, say=status)
        return loaded, _explicit(loaded, weights, cache, forward)
    fast = _gguf_blocks_choice(spec, cache_dir, progress, status, forward)
    if fast is not None:
        return fast
    loaded = load_model(spec, dtype=torch.float32, cache_dir=cache_dir, progress=progress)
    choice = choose_precision(loaded, cache, status=status, forward=forward)
    if choice.precision in ("int4", "int8"):
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
    # lazy: these pull in transformers (start-up time)
    from specdecode.kv.owned import supports
    from specdecode.models import ModelLoadError, resolve_spec

    if forward == "hf":
        return None
    try:
        source = resolve_spec(spec)
    except SpecDecodeError:
        return None
    if source.kind not in ("catalog", "gguf"):
        return None
    check_forced_variant()  # a wrong SPECDECODE_KERNEL_ISA says so here, before anything loads
    if not supported_variants() or os.environ.get(ISA_ENV, "").strip().lower() == "reference":
        return None
    build = build_in_background()  # a first run compiles the kernels while the model is read and converted
    try:  # a tensor type or architecture without a low-bit layout here: the measured choice instead
        loaded = load_in_precision(spec, "int4", cache_dir=cache_dir, progress=progress, say=status)
    except ModelLoadError:  # a file that cannot be read (or fetched) fails the measured choice too: said once
        raise
    except SpecDecodeError:
        return None
    finally:  # no compiler left running behind a failed load (the measured choice times steps next)
        if build is not None:
            build.join()
    variant = active_variant()  # times the variants on a CPU no longer compiling
    if variant is None:  # the kernel did not build: the measured choice instead
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
    forced = f" (forced by {ISA_ENV})" if os.environ.get(ISA_ENV, "").strip() else ""
    reason = (f"int4: the GGUF file's own blocks (the fewest bytes a step reads), {variant} kernel{forced} with 8-bit "
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
        # lazy: specdecode.kv.owned pulls in transformers (start-up time)
        from specdecode.kv.owned import supports

        if supports(loaded.model):  # row-independent low-bit products and attention: by construction
            exact = True
            active_variant()
            reason += (f"; {kernel_status()}; speculation stays exact (row-independent low-bit products in the "
                       "owned forward)")
    if exact is None:
        reason += "; batch invariance not measured on this CPU (--weights auto measures it; --compare-baseline checks the output)"
    elif not exact:
        reason += f"; not batch-invariant here ({m.get('detail', '')}): output may leave plain decoding's path"
    return PrecisionChoice(weights, exact, reason)
