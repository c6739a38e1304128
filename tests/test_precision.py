"""``--weights auto`` (``specdecode.precision``): the quality gate, teacher-forced quality, the batch-invariance
check, the cached choice and the decision between candidates."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import specdecode.precision as precision
from specdecode.lowbit import set_weight_precision
from specdecode.precision import (
    CACHE_VERSION,
    Candidate,
    QualityReport,
    _decide,
    check_batch_invariance,
    choose_precision,
    machine_key,
    measure_quality,
    quality_gate,
)
from tiny import tiny_llama


def _texts(n: int = 3, length: int = 40, vocab: int = 60, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _report(agreement: float, change: float) -> QualityReport:
    return QualityReport("bf16", agreement, 3.0, change, 500)


# ----------------------------------------------------------------------------- the quality gate


@pytest.mark.parametrize("agreement, change, ok", [
    (1.0, 0.0, True),
    (0.97, 0.0, True),  # the boundaries pass
    (0.96975, 0.0, True),  # compared as reported, to 0.1%: 97.0% (SmolLM2 bf16)
    (0.9694, 0.0, False),  # 96.9%
    (0.99, 0.01, True),
    (0.99, 0.0104, True),  # +1.0%
    (0.99, 0.0106, False),  # +1.1%
    (0.99, -0.01, True),  # a lower perplexity counts as a change too
    (0.99, -0.0106, False),
    (0.9694, 0.0106, False),
])
def test_quality_gate_boundaries(agreement, change, ok):
    passed, line = quality_gate(_report(agreement, change))
    assert passed is ok
    assert f"{100 * agreement:.1f}%" in line and f"{100 * change:+.1f}%" in line  # the figures, in one line
    assert "needs >= 97%" in line and "within 1%" in line and "\n" not in line


# ----------------------------------------------------------------------------- teacher-forced quality


def test_measure_quality_of_a_model_against_itself_and_against_a_noised_copy():
    model = tiny_llama(seed=0, dtype=torch.float32)
    noised = copy.deepcopy(model)  # before any runner fuses the weights
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noised.parameters():
            if p.ndim == 2:
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
    texts = _texts(vocab=64)
    same = measure_quality(model, model, "fp32", texts)
    assert same.positions == sum(len(t) - 1 for t in texts)
    assert same.argmax_agreement == 1.0 and same.perplexity_change == 0.0
    assert same.nll > 0
    assert quality_gate(same)[0]
    other = measure_quality(model, noised, "int8", texts)
    assert other.precision == "int8" and other.positions == same.positions
    assert other.argmax_agreement < 1.0 and other.perplexity_change != 0.0
    assert not quality_gate(other)[0]


# ----------------------------------------------------------------------------- the batch-invariance check


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_check_batch_invariance_holds_for_the_invariant_forward(weights):
    model = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32), weights)
    report = check_batch_invariance(model)
    assert report.exact, report.detail
    assert "bitwise equal" in report.detail and "17" in report.detail
    if weights == "int8":
        assert report.row_kernel is None
    else:
        assert report.row_kernel == "padded"


def _noisy_mm(rows_affected):
    """An ``owned._mm`` that adds noise to products of some row counts (a forward that is not batch-invariant)."""
    from specdecode.kv import owned

    real = owned._mm

    def mm(weight, x, kernel=None, exact=True, prompt=False):
        out = real(weight, x, kernel, exact, prompt)
        return out + 0.05 * out.abs().amax() if rows_affected(x.shape[0]) else out

    return mm


def test_check_batch_invariance_reports_a_forward_whose_rows_depend_on_the_row_count(monkeypatch):
    from specdecode.kv import owned

    monkeypatch.setenv("SPECDECODE_NATIVE_STEP", "0")  # the noise goes into the Python loop's products
    model = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32), "bf16")
    real_mm = owned._mm
    assert check_batch_invariance(model).exact
    monkeypatch.setattr(owned, "_mm", _noisy_mm(lambda rows: 1 < rows <= 17))  # chains of several tokens
    report = check_batch_invariance(model)
    assert not report.exact
    assert report.detail.startswith("2 tokens in one forward: token ") and "differs" in report.detail
    # only the batch (2 rows x 9 tokens = 18 rows a product) is affected: the two-row check catches it
    monkeypatch.setattr(owned, "_mm", real_mm)
    monkeypatch.setattr(owned, "_mm", _noisy_mm(lambda rows: rows == 18))
    report = check_batch_invariance(model)
    assert not report.exact
    assert report.detail.startswith("two rows of 9 tokens in one forward: row 0 differs"), report.detail


# ----------------------------------------------------------------------------- choose_precision


@pytest.fixture
def tiny_fp32(tiny_model_dir):
    from specdecode.models import load_model

    return load_model(str(tiny_model_dir), progress=False)


def _forbid(monkeypatch, *names):
    def fail(*args, **kwargs):
        raise AssertionError("measured although the cache holds the figures")

    for name in names:
        monkeypatch.setattr(precision, name, fail)


def test_choose_precision_measures_picks_an_exact_precision_and_caches(tiny_fp32, tmp_path, monkeypatch):
    model = tiny_fp32.model
    ids = torch.tensor([_texts(1)[0]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    lines = []
    choice = choose_precision(tiny_fp32, tmp_path, texts=_texts(), status=lines.append)
    assert not choice.cached and lines  # it said what it measured
    assert choice.exact and choice.precision in ("int4", "int8", "bf16")  # float32's few-row products: not invariant
    chosen = next(c for c in choice.candidates if c.precision == choice.precision)
    assert chosen.quality_ok and chosen.exact
    exact_ok = [c for c in choice.candidates if c.quality_ok and c.exact]
    assert chosen is min(exact_ok, key=lambda c: c.decode_s + c.verify_s)  # the fastest that qualifies
    assert {c.precision for c in choice.candidates} == {"int4", "int8", "bf16", "fp32"}
    assert choice.reason.startswith(f"{choice.precision}: ") and "\n" not in choice.reason
    # the loaded model is untouched (candidates run on copies)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)
    # the cache file: quality per model, exactness and speed per machine
    files = list((tmp_path / "precision").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["version"] == CACHE_VERSION
    assert set(data["quality"]) == {"int4", "int8", "bf16"}
    machine = data["machines"][machine_key()]
    for c in choice.candidates:
        if c.quality_ok:
            assert machine[c.precision].get("exact") == c.exact and machine[c.precision]["decode_s"] == c.decode_s
    # a second call reads it: nothing is measured
    _forbid(monkeypatch, "check_batch_invariance", "measure_step", "teacher_forced", "measure_quality")
    again = choose_precision(tiny_fp32, tmp_path, texts=_texts(), status=lines.append)
    assert again.cached and (again.precision, again.exact, again.reason) == (choice.precision, choice.exact,
                                                                             choice.reason)
    assert files[0].read_text() == json.dumps(data, indent=1)
    # remeasure ignores the cache
    with pytest.raises(AssertionError, match="measured although"):
        choose_precision(tiny_fp32, tmp_path, texts=_texts(), remeasure=True)


def test_choose_precision_checks_invariance_fastest_first_and_stops_at_the_first_exact(tiny_fp32, tmp_path,
                                                                                        monkeypatch):
    import specdecode.precision as precision

    speed = {torch.bfloat16: 0.01, torch.float32: 0.03}  # bf16 faster than fp32; int8 fails the gate (below)
    checked = []

    def fake_step(model, **kw):
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        return speed[dtype], speed[dtype]

    def fake_check(model, **kw):
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        checked.append(dtype)
        return precision.ExactnessReport(dtype == torch.bfloat16, "checked", None)

    monkeypatch.setattr(precision, "measure_step", fake_step)
    monkeypatch.setattr(precision, "check_batch_invariance", fake_check)
    choice = choose_precision(tiny_fp32, tmp_path, texts=_texts(), candidates=("bf16", "fp32"))
    assert choice.precision == "bf16" and choice.exact
    assert checked == [torch.bfloat16]  # fp32 is slower: its invariance is never measured
    fp32 = next(c for c in choice.candidates if c.precision == "fp32")
    assert fp32.exact is None and "fp32 is slower" in choice.reason
    # when the fastest is not exact, the next one is checked
    speed[torch.float32] = 0.005
    checked.clear()
    again = choose_precision(tiny_fp32, tmp_path / "other", texts=_texts(), candidates=("bf16", "fp32"))
    assert checked == [torch.float32, torch.bfloat16] and again.precision == "bf16"


def test_choose_precision_refuses_a_non_float32_reference_and_unknown_candidates(tiny_fp32, tmp_path):
    with pytest.raises(ValueError, match="unknown precision"):
        choose_precision(tiny_fp32, tmp_path, candidates=("int3",), texts=_texts())
    bf16 = copy.copy(tiny_fp32)
    bf16.model = copy.deepcopy(tiny_fp32.model).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        choose_precision(bf16, tmp_path, texts=_texts())


# ----------------------------------------------------------------------------- the decision


def _cand(name, ok=True, exact=True, ms=None, quality="agreement 99%"):
    s = None if ms is None else ms / 1000
    return Candidate(name, ok, quality, exact if ok else None, "" if exact else "9 tokens: token 3 differs", s, s)


def test_decide_takes_the_fastest_exact_precision_that_keeps_the_model():
    choice = _decide([_cand("int8", ms=10), _cand("bf16", ms=5), _cand("fp32", exact=False, ms=2.5)])
    assert (choice.precision, choice.exact, choice.cached) == ("bf16", True, False)
    assert choice.reason.startswith("bf16: the fastest precision that keeps the model and keeps speculation exact")
    assert "0.5x float32's speed" in choice.reason  # fp32 is faster here, but not exact
    assert "int8 is slower (10 ms a step)" in choice.reason
    assert "fp32 is not batch-invariant here (9 tokens: token 3 differs)" in choice.reason
    assert [c.precision for c in choice.candidates] == ["fp32", "bf16", "int8"]  # fastest first
    assert _decide([_cand("int8", ms=3), _cand("bf16", ms=5), _cand("fp32", exact=False, ms=8)],
                   cached=True).precision == "int8"


def test_decide_without_an_exact_precision_takes_the_fastest_that_keeps_the_model_and_says_so():
    choice = _decide([_cand("int8", exact=False, ms=4), _cand("bf16", exact=False, ms=6),
                      _cand("fp32", exact=False, ms=8)])
    assert (choice.precision, choice.exact) == ("int8", False)
    assert "no precision that keeps the model is batch-invariant" in choice.reason
    assert "bf16 is not batch-invariant here" in choice.reason and "fp32 is not batch-invariant here" in choice.reason


def test_decide_skips_a_fast_precision_that_fails_the_quality_gate_and_names_it():
    line = quality_gate(_report(0.9, 0.05))[1]
    choice = _decide([_cand("int8", ok=False, quality=line), _cand("bf16", ms=5), _cand("fp32", exact=False, ms=8)])
    assert (choice.precision, choice.exact) == ("bf16", True)
    assert f"int8 changes the model ({line})" in choice.reason
    assert [c.precision for c in choice.candidates] == ["bf16", "fp32", "int8"]  # unmeasured last
    # every fast one fails: float32, the reference, whatever its exactness
    choice = _decide([_cand("int8", ok=False, quality=line), _cand("bf16", ok=False, quality=line),
                      _cand("fp32", exact=False, ms=8)])
    assert (choice.precision, choice.exact) == ("fp32", False)
    assert "int8 changes the model" in choice.reason and "bf16 changes the model" in choice.reason


# ----------------------------------------------------------------------------- load_target and the cache


def test_load_target_with_an_explicit_precision_says_what_is_not_measured(tiny_model_dir, tmp_path):
    loaded, choice = precision.load_target(str(tiny_model_dir), "bf16", cache_dir=tmp_path, progress=False)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert choice.precision == "bf16" and choice.exact is None and "not measured" in choice.reason
    # after auto measured this machine, an explicit choice reports what was measured (for its forward)
    _, auto = precision.load_target(str(tiny_model_dir), "auto", cache_dir=tmp_path, progress=False)
    # auto measures exactness only as far as its choice needs it (on a busy machine the timings can end the
    # search before bf16's check): the explicit choice reports whatever was measured
    measured = next((c.exact for c in auto.candidates if c.precision == "bf16"), None)
    _, again = precision.load_target(str(tiny_model_dir), "bf16", cache_dir=tmp_path, progress=False)
    _, hf = precision.load_target(str(tiny_model_dir), "bf16", cache_dir=tmp_path, progress=False, forward="hf")
    assert again.exact == measured and hf.exact is None  # the HF forward was never measured


def test_load_target_refuses_auto_with_float16(tiny_model_dir, tmp_path):
    from specdecode.errors import SpecDecodeError

    with pytest.raises(SpecDecodeError, match="--weights fp32"):
        precision.load_target(str(tiny_model_dir), "auto", dtype="float16", cache_dir=tmp_path, progress=False)
    _, choice = precision.load_target(str(tiny_model_dir), "auto", dtype="bfloat16", cache_dir=tmp_path,
                                      progress=False)
    assert choice.precision == "bf16" and "--dtype" in choice.reason


def test_a_malformed_or_unwritable_cache_costs_a_measurement_not_the_load(tiny_fp32, tmp_path, monkeypatch):
    first = choose_precision(tiny_fp32, tmp_path, texts=_texts())
    path = next((tmp_path / "precision").glob("*.json"))
    data = json.loads(path.read_text())
    data["quality"]["bf16"] = {"precision": "bf16"}  # fields missing
    path.write_text(json.dumps(data))
    again = choose_precision(tiny_fp32, tmp_path, texts=_texts())
    assert not again.cached and again.precision == first.precision  # measured anew
    lines = []
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    choice = choose_precision(tiny_fp32, blocked, texts=_texts(), status=lines.append)
    assert choice.precision == first.precision and any("could not cache" in line for line in lines)


@pytest.mark.integration
def test_auto_on_a_gguf_file_says_when_its_catalog_quality_is_below_the_gate(monkeypatch):
    """``--weights auto`` runs a GGUF model's own blocks (as llama.cpp runs the file); where the catalog's
    measured quality of that is below the gate, the status line says so and names the float choices."""
    from specdecode.lowbit import active_variant

    if active_variant() is None:
        pytest.skip("no low-bit kernel on this CPU")
    spec = "smollm2-135m"
    good = precision.CATALOG_QUALITY[spec]["int4"]
    _, choice = precision._gguf_blocks_choice(spec, None, False, None, "auto")
    assert "below the quality gate" not in choice.reason and "agreement 97.5%" in choice.reason
    bad = precision.QualityReport("int4", 0.961, good.nll, 0.041, good.positions)
    monkeypatch.setitem(precision.CATALOG_QUALITY[spec], "int4", bad)
    _, choice = precision._gguf_blocks_choice(spec, None, False, None, "auto")
    assert choice.precision == "int4" and "below the quality gate" in choice.reason and "--weights bf16" in choice.reason


@pytest.mark.integration
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_every_front_end_loads_a_spec_as_the_same_weights(weights):
    """One loader: the library (``SpecDecoder.from_pretrained``, which ``generate`` runs), ``serve``
    (``launch.load_state``) and ``bench`` (``bench.runner.load_any``) load the same spec in the same precision
    as bit-identical weights, the draft too; for a GGUF model int4 is the file's own blocks in every one (bench
    used to quantize the float copy to Q4_1: another model than the product runs)."""
    from specdecode.bench.runner import load_any
    from specdecode.generator import SpecDecoder
    from specdecode.lowbit import QuantLinear, active_variant, weight_digest
    from specdecode.build import load_draft_for
    from specdecode.server.launch import ServeOptions, load_state
    from specdecode.spec import DrafterSpec

    if weights == "int4" and active_variant() is None:
        pytest.skip("no low-bit kernel on this CPU")
    spec = "smollm2-135m"
    library = SpecDecoder.from_pretrained(spec, draft="none", weights=weights, progress=False)
    served = load_state(ServeOptions(target=spec, draft="none", weights=weights), progress=False)
    benched, ran = load_any(spec, "float32", weights=weights, target=True)
    assert ran == weights
    served.scheduler.close()
    digests = {weight_digest(m) for m in (library.target.model, served.target.model, benched.model)}
    assert len(digests) == 1
    kinds = {m.kind for m in benched.model.modules() if isinstance(m, QuantLinear)}
    if weights == "int4":  # the file's own block types, whatever they are
        import gguf

        from specdecode.models import gguf_file

        stored = {t.tensor_type.name for t in gguf.GGUFReader(str(gguf_file(spec, progress=False))).tensors}
        assert kinds and kinds <= stored
    else:
        assert kinds == {"Q8_0"}
    # a draft in another precision than the target's: bench's draft load is generate's
    other = "int8" if weights == "int4" else "int4"
    draft_generate = load_draft_for(DrafterSpec.parse(spec), library.target, "another-spec", weights=weights,
                                    draft_weights=other, progress=False)
    draft_bench, _ = load_any(spec, "float32", weights=other)
    assert weight_digest(draft_generate.model) == weight_digest(draft_bench.model)


def test_gguf_blocks_choice_compiles_while_loading_and_waits_for_the_build(monkeypatch):
    """--weights auto on a GGUF model: the kernel build starts before the load and is joined after it, also when
    the load fails (no compiler left running while the measured choice times steps); the variant is chosen after
    the load, on a CPU no longer compiling."""
    from specdecode import precision as prec

    events = []

    class Build:
        def join(self):
            events.append("join")

    monkeypatch.delenv(prec.ISA_ENV, raising=False)
    monkeypatch.setattr(prec, "check_forced_variant", lambda: events.append("check"))
    monkeypatch.setattr(prec, "supported_variants", lambda: ["avx2"])
    monkeypatch.setattr(prec, "build_in_background", lambda: events.append("build") or Build())
    monkeypatch.setattr(prec, "active_variant", lambda: events.append("variant"))  # None: the kernel did not build

    def load(*args, **kwargs):
        events.append("load")
        return object()

    monkeypatch.setattr(prec, "load_in_precision", load)
    assert prec._gguf_blocks_choice("smollm2-135m", None, False, None, "auto") is None
    assert events == ["check", "build", "load", "join", "variant"]

    def failing(*args, **kwargs):
        events.append("load")
        raise prec.SpecDecodeError("a tensor type without a low-bit layout")

    events.clear()
    monkeypatch.setattr(prec, "load_in_precision", failing)
    assert prec._gguf_blocks_choice("smollm2-135m", None, False, None, "auto") is None
    assert events == ["check", "build", "load", "join"]
