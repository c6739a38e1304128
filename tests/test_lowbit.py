"""Low-bit weights (``--weights int4`` / ``int8``): GGUF blocks run as stored, every instruction-set
variant of the kernel against a float64 reference, row invariance with a loud neighbour, the fused
C++ layer loop against the Hugging Face forward, the cache, and speculative == plain decoding of a
low-bit target. Every variant this CPU executes is tested (AVX2 on every x86-64 machine)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from specdecode import lowbit, lowbit_kernels, quant_linear
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.lowbit import set_weight_precision
from specdecode.proposers import DraftModelProposer, NgramProposer, TreeDraftConfig, TreeDraftProposer
from specdecode.types import SamplingParams
from tiny import chi2_pvalue, exact_joint, tiny_gguf_llama, tiny_llama, tiny_qwen2

gguf = pytest.importorskip("gguf")
VARIANTS = lowbit.supported_variants()
KINDS = sorted(lowbit.GGUF_BLOCKS)


def _raw(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return lowbit_kernels._random_raw(kind, rows, cols, np.random.default_rng(seed))


def _cols(kind: str) -> int:
    return 512 if lowbit.GGUF_BLOCKS[kind][1] == 256 else 576  # 576: 18 blocks, a group of 8 plus a tail


@pytest.fixture(params=VARIANTS or ["none"])
def variant(request, monkeypatch):
    """Each kernel variant this CPU executes, forced through SPECDECODE_KERNEL_ISA."""
    if request.param == "none":
        pytest.skip("this CPU runs no kernel variant (no AVX2 + FMA + F16C): the torch reference runs")
    if lowbit.load_kernel() is None:
        pytest.fail(f"the kernel extension did not build: {lowbit.kernel_status()}")
    monkeypatch.setenv(lowbit.ISA_ENV, request.param)
    return request.param


def test_avx2_runs_on_every_x86_cpu():
    """The floor: every x86-64 CPU with AVX2 executes the avx2 variant, so CI covers it anywhere."""
    flags = lowbit.cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("not an AVX2 CPU")
    assert "avx2" in VARIANTS
    assert lowbit.load_kernel() is not None, lowbit.kernel_status()
    assert hasattr(lowbit.load_kernel(), "LayerStack")


@pytest.mark.parametrize("flags, supported, candidates", [
    ({"avx2", "fma", "f16c"}, ["avx2"], ["avx2"]),  # Zen 3, Haswell .. Comet Lake
    ({"avx2", "fma", "f16c", "avx_vnni"}, ["avxvnni", "avx2"], ["avxvnni", "avx2"]),  # Intel Core 12th gen and later
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
     ["avx512vnni", "avx512", "avx2"], ["avx512vnni", "avx512"]),  # Zen 4, Ice Lake
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8"},
     ["amx", "avx512vnni", "avx512", "avxvnni", "avx2"], ["amx", "avx512"]),  # Sapphire Rapids and later
    ({"sse4_2", "avx"}, [], []),  # no AVX2: the torch reference
])
def test_variants_follow_the_cpu_flags(monkeypatch, flags, supported, candidates):
    """Which variants a CPU runs and which two are timed at start, from its /proc/cpuinfo flags: a CPU without
    AVX-512 but with AVX-VNNI (Intel's client cores since Alder Lake) gets the avxvnni variant, measured against
    avx2; a gcc that lacks -mavxvnni (or -mamx-tile) leaves that variant out."""
    monkeypatch.setattr(lowbit_kernels, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(lowbit_kernels, "_compiler_takes", lambda flags: True)
    assert lowbit_kernels.supported_variants() == supported
    assert lowbit_kernels.candidate_variants() == candidates
    monkeypatch.setattr(lowbit_kernels, "_compiler_takes", lambda flags: "-mavxvnni" not in flags)
    assert lowbit_kernels.supported_variants() == [v for v in supported if v != "avxvnni"]


def test_each_variant_is_the_code_it_names():
    """A variant's table names the variant (the macros picked its code), and the avxvnni build runs AVX-VNNI's VEX
    dot products where the avx2 build has none: identical bits alone could not tell the two builds apart."""
    import ctypes
    import shutil
    import subprocess

    class Head(ctypes.Structure):
        _fields_ = [("version", ctypes.c_int32), ("name", ctypes.c_char_p)]

    for name in VARIANTS:
        assert Head.from_address(lowbit.load_variant(name)).name.decode() == name
    if "avxvnni" not in VARIANTS or not shutil.which("objdump"):
        pytest.skip("no avxvnni variant on this CPU, or no objdump")

    def vex_dots(name):
        text = subprocess.run(["objdump", "-d", str(lowbit_kernels._variant_path(name))], capture_output=True,
                              text=True, check=True).stdout
        return sum("{vex} vpdpbusd" in line or "{vex} vpdpwssd" in line for line in text.splitlines())

    assert vex_dots("avxvnni") > 100 and vex_dots("avx2") == 0


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_are_kept_as_stored(kind):
    """The kernel's layout holds the file's bytes (repack / unpack are inverse), bits per weight as stored."""
    raw = _raw(kind, 6, _cols(kind))
    module = lowbit.QuantLinear(torch.from_numpy(raw), kind, _cols(kind))
    assert module.packed.numel() == raw.size
    assert np.array_equal(module.gguf_raw(), raw)
    expected = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, -1)
    np.testing.assert_array_equal(module.dequantize().numpy(), expected)
    assert module.bits == {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q8_0": 8.5, "Q4_K": 4.5, "Q6_K": 6.5625}[kind]


def test_unknown_types_and_sizes_are_refused():
    with pytest.raises(lowbit.SpecDecodeError, match="no low-bit kernel"):
        lowbit.QuantLinear(torch.zeros(1, 10, dtype=torch.uint8), "IQ2_XS", 256)
    with pytest.raises(lowbit.SpecDecodeError, match="bytes"):
        lowbit.QuantLinear(torch.zeros(1, 10, dtype=torch.uint8), "Q4_0", 32)


def _kernel_activations(kernel, table, x: torch.Tensor, kind: str) -> torch.Tensor:
    """The 8-bit activations the kernel multiplies for ``x``, dequantized (float64)."""
    q, d, _ = kernel.q_quantize(x.contiguous(), lowbit.GGUF_BLOCKS[kind][0], table)
    block = x.shape[1] // d.shape[1]
    return (q.double().reshape(x.shape[0], -1, block) * d.double()[..., None]).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_equals_a_float64_reference(variant, kind):
    """(dequantized weights) x (the kernel's 8-bit activations) in float64, within float32 accumulation
    error; the kernel's own dequantization equals gguf's exactly, and its activations are the torch
    reference's (:func:`lowbit.quantize_activations`) to within one step of the 8-bit grid."""
    kernel, table = lowbit.load_kernel(), lowbit.variant_table()
    assert kernel.q_variant(table) == variant
    cols = _cols(kind)
    module = lowbit.QuantLinear(torch.from_numpy(_raw(kind, 43, cols, seed=1)), kind, cols)  # 5 tiles and 3 columns
    weight = module.dequantize().double()
    assert torch.equal(kernel.q_dequantize(module.packed, module.fmt, cols, table), weight.float())
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 5, 8, 16, 19, 53):
        x = torch.randn(rows, cols, generator=gen)
        xq = _kernel_activations(kernel, table, x, kind)
        step = x.abs().max() / 127
        assert (xq - lowbit.quantize_activations(x, kind).double()).abs().max() <= step * 1.001
        want = xq @ weight.T
        got = module(x).double()
        scale = (xq.abs() @ weight.abs().T).clamp_min(1e-30)
        bound = 1e-6 if kind in ("Q8_0", "Q6_K") else 1e-5  # zero-point formats: two terms, each > |w| |x|
        assert ((got - want).abs() / scale).max() < bound, (rows, ((got - want).abs() / scale).max())


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_the_rows_beside_it(variant, kind):
    """What keeps speculative output equal to plain decoding: a row is bit-equal alone and among 1..16
    rows, next to a row 1000x louder."""
    cols = _cols(kind)
    module = lowbit.QuantLinear(torch.from_numpy(_raw(kind, 33, cols, seed=2)), kind, cols, torch.randn(33))
    x = torch.randn(16, cols)
    x[3] *= 1000.0
    together = module(x)
    for i in range(16):
        assert torch.equal(module(x[i : i + 1])[0], together[i])
        assert torch.equal(module(x[: i + 1]), together[: i + 1])


def test_a_forced_variant_is_used_and_a_wrong_one_refused(monkeypatch):
    if not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    monkeypatch.setenv(lowbit.ISA_ENV, "avx2")
    assert lowbit.active_variant() == "avx2"
    monkeypatch.setenv(lowbit.ISA_ENV, "sse9")
    with pytest.raises(lowbit.SpecDecodeError, match="unknown kernel variant"):
        lowbit.active_variant()


def test_a_wrong_forced_variant_is_refused_before_anything_compiles(monkeypatch):
    """check_forced_variant runs before a model loads: no compiler, one line naming what this CPU runs."""
    monkeypatch.setattr(lowbit_kernels, "supported_variants", lambda: ["avx2"])
    monkeypatch.setattr(lowbit_kernels.subprocess, "run", lambda *a, **k: pytest.fail("a compiler ran"))
    for forced, message in (("sse9", "unknown kernel variant 'sse9'"),
                            ("amx", r"this CPU cannot run the amx kernel \(it runs: avx2\)")):
        monkeypatch.setenv(lowbit.ISA_ENV, forced)
        with pytest.raises(lowbit.SpecDecodeError, match=f"{lowbit.ISA_ENV}={forced}: {message}"):
            lowbit_kernels.check_forced_variant()
    for fine in ("avx2", "reference", ""):
        monkeypatch.setenv(lowbit.ISA_ENV, fine)
        lowbit_kernels.check_forced_variant()


def test_the_kernel_builds_on_another_thread_while_the_model_loads(monkeypatch):
    """build_in_background: load_kernel on a daemon thread when nothing is built yet; nothing when the reference
    is forced, when this CPU has no variant, or once the extension is loaded."""
    ran = []
    monkeypatch.setattr(lowbit_kernels, "load_kernel", lambda cache_dir=None: ran.append(threading.current_thread()))
    monkeypatch.setattr(lowbit_kernels, "_kernel", None)
    monkeypatch.setattr(lowbit_kernels, "supported_variants", lambda: ["avx2"])
    monkeypatch.delenv(lowbit.ISA_ENV, raising=False)
    thread = lowbit_kernels.build_in_background()
    thread.join()
    assert thread.daemon and ran == [thread] and thread is not threading.main_thread()
    monkeypatch.setenv(lowbit.ISA_ENV, "reference")
    assert lowbit_kernels.build_in_background() is None
    monkeypatch.delenv(lowbit.ISA_ENV)
    monkeypatch.setattr(lowbit_kernels, "supported_variants", lambda: [])
    assert lowbit_kernels.build_in_background() is None
    monkeypatch.setattr(lowbit_kernels, "supported_variants", lambda: ["avx2"])
    monkeypatch.setattr(lowbit_kernels, "_kernel", False)  # built (or failed) already
    assert lowbit_kernels.build_in_background() is None
    assert len(ran) == 1


def test_a_variant_that_fails_to_compile_in_the_background_fails_once_in_one_line(monkeypatch, tmp_path):
    """The variants compile on threads beside the torch extension: a failing gcc is run once per variant, its
    error kept and raised as one line where the variant is loaded; a forced variant compiles alone."""
    if not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    import subprocess

    runs = []
    real_run = subprocess.run

    def counting_run(cmd, *args, **kwargs):
        runs.append(cmd[0])
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(lowbit_kernels.subprocess, "run", counting_run)
    monkeypatch.setattr(lowbit_kernels, "_variants", {})
    monkeypatch.setattr(lowbit_kernels, "_variant_errors", {})
    monkeypatch.setenv("CC", "false")
    monkeypatch.delenv(lowbit.ISA_ENV, raising=False)
    threads = lowbit_kernels._compile_variants_in_background(tmp_path)
    candidates = lowbit_kernels.candidate_variants()  # the richest and the next with other few-row code
    want = [VARIANTS[0]] + [v for v in VARIANTS[1:] if not (VARIANTS[0] == "amx" and v == "avx512vnni")][:1]
    assert sorted(threads) == sorted(candidates) and candidates == want
    for thread in threads.values():
        thread.join()
    for _ in range(2):
        with pytest.raises(lowbit.SpecDecodeError, match=f"could not compile the {candidates[-1]} kernel"):
            lowbit_kernels.load_variant(candidates[-1], tmp_path)
    assert len(runs) == len(candidates)  # once each, not again on load
    for forced, wanted in (("avx2", ["avx2"]), ("sse9", []), ("reference", [])):
        monkeypatch.setenv(lowbit.ISA_ENV, forced)
        assert lowbit_kernels._wanted_variants() == wanted


def test_reference_fallback_gives_the_same_products(monkeypatch):
    module = lowbit.QuantLinear(torch.from_numpy(_raw("Q4_K", 24, 256, seed=3)), "Q4_K", 256)
    x = torch.randn(5, 256)
    fast = module(x)
    monkeypatch.setenv(lowbit.ISA_ENV, "reference")
    assert lowbit.load_kernel() is None and "reference" in lowbit.kernel_status()
    slow = module(x)
    torch.testing.assert_close(slow, fast, rtol=1e-4, atol=1e-4)
    assert torch.equal(module(x[2:3])[0], slow[2])  # the fallback is row-invariant too


def test_a_prompt_sized_call_may_run_a_float_product():
    torch.manual_seed(0)  # bfloat16 products where the CPU has them: a fixed draw keeps the tolerance honest
    module = lowbit.QuantLinear.from_float(torch.randn(48, 64) * 0.1, None, "Q8_0")
    big = torch.randn(lowbit.PREFILL_ROWS + 3, 64)
    torch.testing.assert_close(module(big, exact=False), module(big), rtol=0.02, atol=0.02)


def test_fused_modules_equal_their_parts():
    torch.manual_seed(0)
    for kind in ("Q8_0", "Q4_1"):
        parts = [lowbit.QuantLinear.from_float(torch.randn(n, 64), torch.randn(n), kind) for n in (16, 8, 8)]
        fused = lowbit.concat(parts)
        x = torch.randn(5, 64)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    mixed = [lowbit.QuantLinear.from_float(torch.randn(8, 64), None, k) for k in ("Q8_0", "Q4_1")]
    assert lowbit.concat(mixed) is None  # different kinds run one after another


@pytest.mark.parametrize("kind", sorted(lowbit.TILED))
def test_tiled_parts_concatenate_as_packed_when_their_tiles_are_whole(kind, monkeypatch):
    """concat of tiled parts holding whole tiles of 8 columns (the last part may end in a partial tile) keeps their
    packed bytes: exactly what repacking the concatenated file rows gives; a part cut mid-tile is repacked."""
    cols = 256
    for sizes, whole in (((16, 8, 24), True), ((8, 16, 13), True), ((12, 8), False), ((5, 8, 3), False)):
        raws = [_raw(kind, n, cols, seed=i) for i, n in enumerate(sizes)]
        parts = [lowbit.QuantLinear(torch.from_numpy(r), kind, cols) for r in raws]
        repacked = []
        monkeypatch.setattr(quant_linear, "repack", lambda raw, k: repacked.append(k) or lowbit_kernels.repack(raw, k))
        fused = lowbit.concat(parts)
        monkeypatch.undo()
        assert len(repacked) == (0 if whole else 1)
        want = lowbit_kernels.repack(np.concatenate(raws), kind)
        assert np.array_equal(fused.packed.numpy(), want), (sizes, whole)
        assert (fused.packed.data_ptr() != parts[0].packed.data_ptr()) and fused.out_features == sum(sizes)


def test_cache_round_trip_and_stale_cache(tmp_path):
    torch.manual_seed(0)
    modules = {"a": lowbit.QuantLinear.from_float(torch.randn(8, 96), torch.randn(8), "Q4_1", "int4"),
               "b": lowbit.QuantLinear(torch.from_numpy(_raw("Q6_K", 4, 256)), "Q6_K", 256)}
    path = tmp_path / "w.safetensors"
    source = {"sha256": "abc", "precision": "int4", "from": "gguf"}
    lowbit.save_modules(path, modules, source)
    back = lowbit.load_modules(path, source)
    for name, m in modules.items():
        x = torch.randn(3, m.in_features)
        assert back[name].kind == m.kind and torch.equal(back[name](x), m(x))
    assert lowbit.load_modules(path, {**source, "sha256": "other"}) is None  # another model: rebuilt
    path.write_bytes(b"garbage")
    assert lowbit.load_modules(path, source) is None


def test_layers_whose_width_is_not_a_multiple_of_32_stay_float():
    model = tiny_llama(seed=0, hidden=48, dtype=torch.float32)  # q/k/v read 48 features: not groups of 32
    set_weight_precision(model, "int4")
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, lowbit.QuantLinear)  # reads 96


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_the_fused_layer_loop_matches_the_hugging_face_forward(variant, make):
    """The C++ layer loop (RMSNorm, RoPE, float16-cache attention, SiLU, the products) computes the model:
    its logits match the Hugging Face forward of the same (dequantized) weights up to 8-bit activations."""
    from specdecode.kv import make_runner

    model = set_weight_precision(make(seed=0, dtype=torch.float32), "int8")
    reference = make(seed=0, dtype=torch.float32)
    with torch.no_grad():  # the reference holds the Q8_0 weights the low-bit model runs
        for name, module in model.named_modules():
            if isinstance(module, lowbit.QuantLinear):
                reference.get_submodule(name).weight.copy_(module.dequantize())
    runner = make_runner(model, "owned").row(0)
    assert runner.runner._native_stack() is not None
    ids = [3, 7, 1, 9, 4, 4, 2, 8, 5, 6]
    runner.forward(ids[:4], last_only=True)
    got = torch.cat([runner.forward(ids[4:7]), runner.forward(ids[7:])]).reshape(6, -1)
    want = reference(torch.tensor([ids])).logits[0, 4:].float()
    assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_whole_forward_is_batch_invariant(variant):
    from specdecode.precision import check_batch_invariance

    model = set_weight_precision(tiny_qwen2(seed=1, dtype=torch.float32), "int4")
    report = check_batch_invariance(model, counts=(2, 5, 9, 17), context=40)
    assert report.exact, report


PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30))]


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_lowbit_target_and_draft_speculative_greedy_equals_plain(variant, precision):
    """A low-bit target verified in blocks and trees, drafted for by a low-bit draft, in a batch."""
    target = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), precision)
    draft = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), precision)
    params = SamplingParams(max_new_tokens=24)
    plain = SpeculativeEngine(target, None)
    want = [plain.generate(p, params).token_ids for p in PROMPTS]
    proposers = [lambda: DraftModelProposer(draft), lambda: NgramProposer(),
                 lambda: TreeDraftProposer(draft, TreeDraftConfig(kind="dynamic", num_nodes=8, top_k=3))]
    for make in proposers:
        for gamma in (1, 4):
            engine = SpeculativeEngine(target, make(), EngineConfig(num_speculative_tokens=gamma, max_batch_size=4))
            outs = engine.generate_batch(PROMPTS, params)
            assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_a_batch_of_more_rows_than_a_prompt_gives_each_row_what_it_gets_alone(variant):
    """4 rows x 9 tokens (36 rows, more than lowbit.PREFILL_ROWS): a verification forward of a batch is
    still the kernel's row-invariant path, not the prompt's float product."""
    from specdecode.kv import make_runner

    model = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), "int8")
    runner = make_runner(model, "owned", num_slots=4)
    lengths = [9 + 3 * i for i in range(4)]
    for i, n in enumerate(lengths):
        runner.forward(slice(i, i + 1), [list(range(1, n + 1))], last_only=True)
    feeds = [[(7 * i + j) % 60 for j in range(9)] for i in range(4)]
    together = runner.forward(slice(0, 4), feeds)
    for i, n in enumerate(lengths):
        runner.rollback(i, n)
        assert torch.equal(runner.forward(slice(i, i + 1), [feeds[i]])[0], together[i])


def test_a_draft_with_a_reduced_vocabulary_stays_lossless():
    """A draft scoring only its first 40 of 64 token ids: probability 0 elsewhere; greedy output equals plain
    decoding and sampled runs still accept drafts (the target verifies whatever is drafted)."""
    from specdecode.kv import make_runner
    from specdecode.proposers.draft_model import DraftModelConfig

    target = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), "int8")
    draft = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), "int8")
    runner = make_runner(draft, "owned").row(0)
    runner.runner.limit_vocabulary(40)
    logits = runner.forward([1, 2, 3])
    assert torch.isinf(logits[:, 40:]).all() and torch.isfinite(logits[:, :40]).all()
    plain = SpeculativeEngine(target, None)
    config = DraftModelConfig(vocab=40)
    for params in (SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)):
        want = [plain.generate(p, params).token_ids for p in PROMPTS]
        engine = SpeculativeEngine(target, DraftModelProposer(draft, config), EngineConfig(num_speculative_tokens=3))
        outs = [engine.generate(p, params) for p in PROMPTS]
        if params.temperature == 0:
            assert [o.token_ids for o in outs] == want
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    with pytest.raises(lowbit.SpecDecodeError, match="draft vocabulary"):
        runner.runner.limit_vocabulary(65)


@pytest.mark.parametrize(("precision", "vocab"), [("int8", 64), ("int4", 64), ("int4", 67), ("bf16", 67)])
def test_a_reduced_draft_vocabulary_scores_each_rows_own_context_tokens(precision, vocab):
    """Past the limit, a row scores the ids its own context holds (from their dequantized output rows: the
    full head's scores up to the 8-bit activations) and the end-of-sequence id; not the ids of the row
    beside it, nor an id its context lost in a rollback. Low-bit heads whose last columns are no whole
    tile (67), and a bfloat16 float draft."""
    from specdecode.kv import make_runner

    model = tiny_llama(vocab_size=vocab, seed=0, dtype=torch.float32, scale=3.0, hidden=256)
    draft = model.to(torch.bfloat16) if precision == "bf16" else set_weight_precision(model, precision)
    draft.config.eos_token_id = 63
    full, limited = (make_runner(draft, "owned", num_slots=2) for _ in range(2))
    limited.limit_vocabulary(40)
    feeds = [[1, 2, 50, 65 % vocab, 3], [1, 2, 3, 4, 5]]
    want = full.forward(slice(0, 2), feeds, last_only=True)[:, -1]
    got = limited.forward(slice(0, 2), feeds, last_only=True)[:, -1]
    tol = {"rtol": 0.05, "atol": 0.3} if precision == "bf16" else {"rtol": 0.02, "atol": 0.05}
    torch.testing.assert_close(got[:, :40], want[:, :40], **tol)
    mine = [50, 63] + ([65] if vocab > 65 else [])
    torch.testing.assert_close(got[0, mine], want[0, mine], **tol)
    torch.testing.assert_close(got[1, 63], want[1, 63], **tol)
    others = [t for t in range(40, vocab) if t not in mine]
    assert torch.isinf(got[1, 50]) and torch.isinf(got[:, others]).all()
    limited.rollback(0, 2)  # id 50 leaves row 0's context
    again = limited.forward(slice(0, 1), [[7]], last_only=True)[0, -1]
    assert torch.isinf(again[50]) and torch.isfinite(again[63])


@pytest.mark.parametrize("kind", KINDS)
def test_every_variant_and_thread_count_gives_the_same_bits(kind):
    """Integer dot products inside a block and one float order per (row, output) across blocks: the AVX2,
    AVX-512 and VNNI variants and any thread count give identical results (replicas on different x86 CPUs
    agree bit for bit)."""
    kernel = lowbit.load_kernel()
    if kernel is None or not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    cols = _cols(kind)
    module = lowbit.QuantLinear(torch.from_numpy(_raw(kind, 64, cols, seed=4)), kind, cols)
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        outs = []
        for name in VARIANTS:
            for n in (1, 2):
                torch.set_num_threads(n)
                outs.append(kernel.q_linear(x, module.packed, module.fmt, lowbit.load_variant(name)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("precision", ["int4", pytest.param("int8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", [v if v == "avx2" else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS] or
                         ["none"], indirect=True)  # the fast lane: avx2 (every x86 CI machine), int4
def test_sampled_output_of_a_low_bit_target_follows_its_exact_law(variant, precision):
    """First three sampled tokens, speculative (a low-bit draft model, gamma 2) against the exact joint of the
    low-bit target's own forward; negative control: the same samples against the draft's law fail."""
    vocab = 5
    tgt = set_weight_precision(tiny_llama(vocab_size=vocab, seed=3, layers=1, hidden=32, scale=4.0,
                                          dtype=torch.float32), precision)
    drf = set_weight_precision(tiny_llama(vocab_size=vocab, seed=4, layers=1, hidden=32, scale=4.0,
                                          dtype=torch.float32), precision)
    prompt = [1, 2]
    exact = exact_joint(tgt, prompt, 3, backend="owned")
    engine = SpeculativeEngine(tgt, DraftModelProposer(drf), EngineConfig(num_speculative_tokens=2))
    counts = np.zeros(vocab**3)
    for s in range(2000):
        out = engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s))
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 3)] += 1
    assert chi2_pvalue(counts, exact) > 1e-3
    assert chi2_pvalue(counts, exact_joint(drf, prompt, 3, backend="owned")) < 1e-6


def test_a_batch_of_long_prompts_is_prefilled_row_by_row_as_each_alone():
    """A batched prefill longer than the model's prefill_rows runs each row alone with its own token count
    (the float products are not row-invariant): each row's logits and cache equal its lone prefill's."""
    from specdecode.kv import make_runner

    model = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), "int8")
    prompts = [list(range(1, 41)), [5, 6, 7], list(range(3, 60))]
    together = make_runner(model, "owned", num_slots=3)
    assert sum(map(len, prompts)) > together.prefill_rows
    both = together.forward(slice(0, 3), prompts, last_only=True)
    for i, p in enumerate(prompts):
        alone = make_runner(model, "owned", num_slots=1)
        assert torch.equal(alone.forward(slice(0, 1), [p], last_only=True)[0, -1], both[i, -1])
        assert torch.equal(alone.k_cache[:, 0, :, : len(p)], together.k_cache[:, i, :, : len(p)])


# Q4_K / Q6_K tiles of 8 output columns (csrc/qgemm.c passt, passt6) ------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 7, 8, 13, 24, 61])
def test_q4k_tiles_round_trip_and_dequantize_as_gguf(rows, kind):
    """Q4_K is repacked as tiles of 8 columns (the last rows % 8 in the column layout), the same bytes:
    unpack inverts repack (also on arbitrary bytes) and the kernel's dequantization of every column, tiled
    or not, equals gguf's."""
    raw = _raw(kind, rows, 512, seed=rows)
    packed = lowbit.repack(raw, kind)
    assert packed.shape == raw.shape and np.array_equal(lowbit.unpack(packed, kind), raw)
    noise = np.random.default_rng(rows).integers(0, 256, raw.shape, dtype=np.uint8)
    assert np.array_equal(lowbit.unpack(lowbit.repack(noise, kind), kind), noise)
    if rows >= 8 and kind in lowbit.TILED:  # the tile really moves bytes: column 1's first super-block does not start at row 1's bytes
        assert not np.array_equal(packed[1, :144], raw[1, :144])
    expected = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, -1)
    kernel = lowbit.load_kernel()
    for name in VARIANTS:
        got = kernel.q_dequantize(torch.from_numpy(packed), lowbit.GGUF_BLOCKS[kind][0], 512, lowbit.load_variant(name))
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [31, 32, 47, 48, 53])
def test_many_rows_give_each_row_its_own_bits_in_every_variant(kind, rows):
    """A prompt's pieces: the amx variant runs whole groups of 16 rows on AMX tiles (from 48 rows for the 32-weight
    formats, 32 for Q4_K, 16 for Q6_K: each side of those thresholds here) and the rest in VNNI passes. Every
    variant and thread count gives the same bits (48 columns: tile pairs, and an odd tile per thread on two; 33
    blocks of 32 per row, a short last round of tile products, or 9 super-blocks), and each row equals its own
    one-row product."""
    kernel = lowbit.load_kernel()
    if kernel is None or not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    if "amx" in VARIANTS:  # the tile products must really run where the variant is offered
        lowbit.load_variant("amx")
        assert lowbit_kernels.amx_tiles_active(), "Linux refused the AMX tile state"
    k = 2304 if lowbit.GGUF_BLOCKS[kind][1] == 256 else 1056
    module = lowbit.QuantLinear(torch.from_numpy(_raw(kind, 48, k, seed=5)), kind, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    x[3] *= 1000.0
    threads = torch.get_num_threads()
    try:
        outs = []
        for name in VARIANTS:
            table = lowbit.load_variant(name)
            for n in (1, 2):
                torch.set_num_threads(n)
                outs.append(kernel.q_linear(x, module.packed, module.fmt, table))
            for i in range(x.shape[0]):
                assert torch.equal(kernel.q_linear(x[i : i + 1].contiguous(), module.packed, module.fmt, table)[0],
                                   outs[-1][i]), (name, i)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_the_amx_variant_is_left_out_where_the_compiler_lacks_its_flags(monkeypatch):
    """An AMX CPU with gcc older than 11 (no -mamx-tile): the variant is not offered, instead of failing to
    compile at every start."""
    monkeypatch.setattr(lowbit_kernels, "cpu_flags", lambda: set(lowbit_kernels.VARIANTS["amx"][0]))
    monkeypatch.setenv("CC", "false")  # a "compiler" that refuses everything
    lowbit_kernels._compiler_takes.cache_clear()
    try:
        assert "amx" not in lowbit_kernels.supported_variants()
        assert "avx512vnni" in lowbit_kernels.supported_variants()
    finally:
        lowbit_kernels._compiler_takes.cache_clear()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("cols,k", [(8, 768), (13, 768), (32, 768), (61, 768), (32, 4352), (61, 8448)])
def test_q4k_tiles_are_bit_identical_across_variants_threads_and_rows(cols, k, kind):
    """Every variant and thread count gives the same bits for tiles and the tail columns, and a row's
    result is the same alone and among 1..16 rows next to a row 1000x louder (VNNI runs whole tiles two at a
    time on 512-bit vectors, the odd one and the other variants one at a time: 32 columns are 2 pairs on one
    thread, a pair per thread on two; 61 leaves an odd tile and 5 tail columns; from 8 rows on short rows, from
    3 rows at 17 super-blocks per row and from 2 at 33)."""
    kernel = lowbit.load_kernel()
    if kernel is None or not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    module = lowbit.QuantLinear(torch.from_numpy(_raw(kind, cols, k, seed=cols)), kind, k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(cols))
    x[3] *= 1000.0
    _assert_same_bits_everywhere(kernel, module, x)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_q4k_fused_parts_and_slices_keep_their_columns(kind):
    """Concatenated Q4_K / Q6_K parts (q / k / v, gate / up) whose widths are not multiples of 8 equal the
    parts: a column's bits do not depend on whether it sits in a tile."""
    parts = [lowbit.QuantLinear(torch.from_numpy(_raw(kind, n, 256, seed=n)), kind, 256, torch.randn(n))
             for n in (12, 8, 5, 16)]
    fused = lowbit.concat(parts)
    x = torch.randn(5, 256)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert np.array_equal(fused.gguf_raw(), np.concatenate([p.gguf_raw() for p in parts]))


def _q4k_llama(vocab: int = 61):
    """tiny_llama (hidden 256) whose linear layers are random Q4_K weights (the 61-row LM head: 7 tiles and 5
    columns after them), and the Hugging Face model of the same (dequantized) weights."""
    return tiny_gguf_llama(("Q4_K",), vocab)


def test_the_fused_layer_loop_runs_q4k_tiles(variant):
    """The C++ layer loop's products (threads split whole tiles) on Q4_K tiles and a tail: logits match the
    Hugging Face forward of the dequantized weights, and the forward is batch invariant."""
    from specdecode.kv import make_runner
    from specdecode.precision import check_batch_invariance

    model, reference = _q4k_llama()
    runner = make_runner(model, "owned").row(0)
    assert runner.runner._native_stack() is not None
    ids = [3, 7, 1, 9, 4, 4, 2, 8, 5, 6]
    runner.forward(ids[:4], last_only=True)
    got = torch.cat([runner.forward(ids[4:7]), runner.forward(ids[7:])]).reshape(6, -1)
    want = reference(torch.tensor([ids])).logits[0, 4:].float()
    assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
    report = check_batch_invariance(model, counts=(2, 5, 9, 17), context=40)
    assert report.exact, report


def _assert_same_bits_everywhere(kernel, module, x):
    """Every variant x 1-3 threads gives the same [rows, out] result, and each row of it alone and every prefix
    of rows give the same bits as all the rows together. Returns that result."""
    threads = torch.get_num_threads()
    try:
        outs = []
        for name in VARIANTS:
            table = lowbit.load_variant(name)
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                together = kernel.q_linear(x, module.packed, module.fmt, table)
                outs.append(together)
                for i in range(x.shape[0]):
                    assert torch.equal(kernel.q_linear(x[i : i + 1].contiguous(), module.packed, module.fmt, table)[0],
                                       together[i]), (name, n, i)
                    assert torch.equal(kernel.q_linear(x[: i + 1].contiguous(), module.packed, module.fmt, table),
                                       together[: i + 1]), (name, n, i)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)
    return outs[0]


def _attention_fn(name: str):
    """Variant ``name``'s attention entry, read from its kernel table (csrc/qtable.h) through ctypes."""
    import ctypes

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = ctypes.CFUNCTYPE(None, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ctypes.c_float, ptr, i64, ptr, ptr,
                          i64)

    class Table(ctypes.Structure):
        _fields_ = [("version", ctypes.c_int32), ("name", ctypes.c_char_p)] + [
            (f, ctypes.c_void_p) for f in ("quantize32", "quantize256", "gemm32", "gemmk", "dequantize")] + [
            ("attention", fn)]

    return Table.from_address(lowbit.load_variant(name)).attention


def _attend_queries(name, q, k, v, visible, queries, kv_len=None):
    """q [rows, heads, d] float32, k / v [kv_heads, plane, d] float16, visible [rows, plane] bool (None: every
    row sees columns < kv_len, the C code's NULL mask); queries: the (row, head) pairs of one call -> out
    [rows, heads, d] (NaN where no query wrote)."""
    rows, heads, d = q.shape
    kvh, plane, _ = k.shape
    out = torch.full((rows, heads, d), float("nan"))
    vis = None if visible is None else visible.to(torch.uint8).contiguous()
    r = torch.tensor([a for a, _ in queries], dtype=torch.int32)
    h = torch.tensor([b for _, b in queries], dtype=torch.int32)
    q = q.contiguous()
    _attention_fn(name)(q.data_ptr(), heads * d, heads, kvh, d, k.data_ptr(), v.data_ptr(), plane,
                        None if vis is None else vis.data_ptr(), plane if visible is not None else kv_len, d ** -0.5,
                        out.data_ptr(), heads * d, r.data_ptr(), h.data_ptr(), len(queries))
    return out


def _attend(name, q, k, v, visible):
    """q [heads, d] float32, k / v [kv_heads, plane, d] float16, visible [plane] bool -> [heads, d], one call per head."""
    heads = q.shape[0]
    outs = [_attend_queries(name, q.unsqueeze(0), k, v, visible.unsqueeze(0), [(0, h)])[0, h] for h in range(heads)]
    return torch.stack(outs)


@pytest.mark.parametrize("d", [64, 128, 48, 40, 96, 256])  # 40: scores on 16 lanes, values on 8; 256: 16 vectors
def test_attention_is_exact_per_rank_and_the_same_on_every_variant(d):
    """The C attention (keys scored eight at a time): within float32 rounding of a float64 softmax; identical
    bits on every variant; a query whose visible keys sit in scattered columns (a token-tree node) gets the
    bits of the same keys packed side by side (a chain), for visible counts around multiples of 8."""
    if not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    g = torch.Generator().manual_seed(d)
    heads, kvh, plane = 6, 2, 45
    q = torch.randn(heads, d, generator=g) * 3
    k = torch.randn(kvh, plane, d, generator=g).half()
    v = torch.randn(kvh, plane, d, generator=g).half()
    for count in (1, 7, 8, 9, 16, 23):
        columns = torch.randperm(plane, generator=g)[:count].sort().values
        visible = torch.zeros(plane, dtype=torch.bool)
        visible[columns] = True
        outs = [_attend(name, q, k, v, visible) for name in VARIANTS]
        assert all(torch.equal(o, outs[0]) for o in outs)
        packed = torch.zeros(plane, dtype=torch.bool)
        packed[:count] = True
        kp, vp = k.clone(), v.clone()
        kp[:, :count], vp[:, :count] = k[:, columns], v[:, columns]
        assert torch.equal(_attend(VARIANTS[0], q, kp, vp, packed), outs[0])
        group = heads // kvh
        kk = k[:, columns].double().repeat_interleave(group, 0)
        vv = v[:, columns].double().repeat_interleave(group, 0)
        ref = torch.softmax((q.double().unsqueeze(1) * d ** -0.5 * kk).sum(-1), -1).unsqueeze(1).bmm(vv).squeeze(1)
        torch.testing.assert_close(outs[0].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 40, 256])
def test_attention_of_many_queries_in_one_call_gives_each_query_its_bits_alone(d):
    """A verification's rows and a GQA group's heads in one call share the float16 conversion of the keys and
    values all of them see; each query keeps the bits it gets alone: chains of 1-9 rows over 0-70 cached
    columns (shared prefixes around multiples of 8 and of the 32-key chunk), token-tree masks (rows that see
    scattered columns), queries of two kv heads and in any order, on every variant."""
    if not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    g = torch.Generator().manual_seed(d + 1)
    heads, kvh, plane = 6, 2, 80
    k = torch.randn(kvh, plane, d, generator=g).half()
    v = torch.randn(kvh, plane, d, generator=g).half()
    cases = []
    for cached in (0, 5, 8, 31, 32, 33, 70):
        for rows in (1, 4, 9):
            if cached + rows > plane:
                continue
            chain = torch.zeros(rows, plane, dtype=torch.bool)
            for r in range(rows):
                chain[r, : cached + r + 1] = True
            cases.append(chain)
    tree = torch.zeros(5, plane, dtype=torch.bool)  # root, two children of the root, a child of each
    tree[:, :40] = True
    for r, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]):
        tree[r, [40 + a for a in ancestors]] = True
    cases.append(tree)
    hole = torch.ones(3, plane, dtype=torch.bool)  # a column no row sees in the middle of the cache
    hole[:, 17] = False
    cases.append(hole)
    for visible in cases:
        rows = visible.shape[0]
        q = torch.randn(rows, heads, d, generator=g) * 3
        alone = torch.stack([torch.stack([_attend_queries(VARIANTS[0], q, k, v, visible, [(r, h)])[r, h]
                                          for h in range(heads)]) for r in range(rows)])
        every = [(r, h) for h in range(heads) for r in range(rows)]
        perm = torch.randperm(len(every), generator=g).tolist()
        for name in VARIANTS:
            together = _attend_queries(name, q, k, v, visible, every)  # runs by kv head, rows and heads inside
            assert torch.equal(together, alone), (name, rows)
            shuffled = _attend_queries(name, q, k, v, visible, [every[i] for i in perm])
            assert torch.equal(shuffled, alone), (name, rows)
        some = every[1::3]
        part = _attend_queries(VARIANTS[-1], q, k, v, visible, some)
        for r, h in some:
            assert torch.equal(part[r, h], alone[r, h])


def test_attention_reads_the_cache_directly_for_few_queries_and_a_shared_copy_for_more_with_the_same_bits():
    """Calls of 1-3 queries of a kv head read their keys and values straight from the float16 cache, calls of 4 or
    more through one float32 copy (SD_ATT_SHARE_MIN): every query's bits are the same either way, over cached
    contexts around the 32-key chunk, on every variant."""
    if not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    g = torch.Generator().manual_seed(11)
    heads, kvh, plane = 8, 1, 140
    for d in (64, 128, 40):
        k = torch.randn(kvh, plane, d, generator=g).half()
        v = torch.randn(kvh, plane, d, generator=g).half()
        for cached in (7, 32, 33, 131):
            rows = 2
            visible = torch.zeros(rows, plane, dtype=torch.bool)
            for r in range(rows):
                visible[r, : cached + r + 1] = True
            q = torch.randn(rows, heads, d, generator=g) * 3
            every = [(r, h) for r in range(rows) for h in range(heads)]
            for mask, kv_len in ((visible, None), (None, cached + 1)):  # None: the one-token step's NULL mask
                alone = {rh: _attend_queries(VARIANTS[0], q, k, v, mask, [rh], kv_len)[rh] for rh in every}
                for name in VARIANTS:
                    for count in (2, 3, 4, 5, 16):
                        part = every[:count]
                        out = _attend_queries(name, q, k, v, mask, part, kv_len)
                        for rh in part:
                            assert torch.equal(out[rh], alone[rh]), (name, d, cached, count, rh, mask is None)


def test_attention_in_batches_of_queries_over_a_long_cache_and_a_prompt():
    """A call splits its queries into batches (16 rows' worth, fewer when the context is long: 63 queries at
    6,000 columns: 42 queries): a prompt's 20 causal rows and a long cache's 16 rows keep every query's bits
    alone."""
    if not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    g = torch.Generator().manual_seed(7)
    heads, kvh, d = 6, 2, 64
    for plane, cached, rows in ((6000, 5984, 16), (40, 0, 20)):
        k = torch.randn(kvh, plane, d, generator=g).half()
        v = torch.randn(kvh, plane, d, generator=g).half()
        visible = torch.zeros(rows, plane, dtype=torch.bool)
        for r in range(rows):
            visible[r, : cached + r + 1] = True
        q = torch.randn(rows, heads, d, generator=g)
        every = [(r, h) for h in range(heads) for r in range(rows)]
        together = _attend_queries(VARIANTS[0], q, k, v, visible, every)
        for r, h in every[:: 7]:
            assert torch.equal(together[r, h], _attend_queries(VARIANTS[0], q, k, v, visible, [(r, h)])[r, h])


# Q4_0 / Q4_1 / Q5_0 / Q8_0 tiles of 8 output columns (csrc/qgemm.c passt32, lowbit_tiles32) --------------------------

TILED32 = list(lowbit_kernels.TILED32)


@pytest.mark.parametrize("kind", TILED32)
@pytest.mark.parametrize("rows", [1, 7, 8, 13, 24, 61])
def test_tiles32_round_trip_and_dequantize_as_gguf(rows, kind):
    """32-weight formats as tiles of 8 columns (the last rows % 8 in the column layout), the same bytes: unpack
    inverts repack (also on arbitrary bytes), and the kernel's dequantization of every column, tiled or not,
    equals gguf's, at row lengths that are and are not multiples of 256."""
    kernel = lowbit.load_kernel()
    for k in (32, 96, 576, 896):
        raw = _raw(kind, rows, k, seed=rows + k)
        packed = lowbit.repack(raw, kind)
        assert packed.shape == raw.shape and np.array_equal(lowbit.unpack(packed, kind), raw)
        noise = np.random.default_rng(rows).integers(0, 256, raw.shape, dtype=np.uint8)
        assert np.array_equal(lowbit.unpack(lowbit.repack(noise, kind), kind), noise)
        if rows >= 8:  # the tile really moves bytes
            assert not np.array_equal(packed[1], lowbit_kernels._columns(raw[1:2], kind)[0])
        expected = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, -1)
        for name in VARIANTS:
            got = kernel.q_dequantize(torch.from_numpy(packed), lowbit.GGUF_BLOCKS[kind][0], k, lowbit.load_variant(name))
            np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("kind", TILED32)
@pytest.mark.parametrize("cols", [1, 8, 13, 61])
def test_tiles32_are_bit_identical_across_variants_threads_and_rows(cols, kind):
    """Every variant and 1-3 threads give the same bits for tiles and the tail columns, a row's result is the
    same alone and among 1..16 rows next to a row 1000x louder, and it is the float64 product of the
    dequantized weights and the quantized activations within float32 accumulation error."""
    kernel = lowbit.load_kernel()
    if kernel is None or not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    k = 896 if cols == 13 else 576
    module = lowbit.QuantLinear(torch.from_numpy(_raw(kind, cols, k, seed=cols)), kind, k)
    # 24 rows at 61 columns: VNNI runs these formats' tiles in pairs (from 4 rows, qgemm.c sd_pair_min_rows) in passes of 8: prefixes end in short passes
    x = torch.randn(24 if cols == 61 else 16, k, generator=torch.Generator().manual_seed(cols))
    x[3] *= 1000.0
    out = _assert_same_bits_everywhere(kernel, module, x)
    table = lowbit.load_variant(VARIANTS[0])
    xq, weight = _kernel_activations(kernel, table, x, kind), module.dequantize().double()
    scale = (xq.abs() @ weight.abs().T).clamp_min(1e-30)
    assert (((out.double() - xq @ weight.T).abs() / scale).max() < (1e-6 if kind == "Q8_0" else 1e-5))


@pytest.mark.parametrize("kind", TILED32)
def test_tiles32_fused_parts_and_slices_keep_their_columns(kind):
    """Concatenated parts (q / k / v) whose widths are not multiples of 8 equal the parts bit for bit."""
    parts = [lowbit.QuantLinear(torch.from_numpy(_raw(kind, n, 96, seed=n)), kind, 96, torch.randn(n))
             for n in (12, 8, 5, 16, 3)]
    fused = lowbit.concat(parts)
    x = torch.randn(5, 96)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert np.array_equal(fused.gguf_raw(), np.concatenate([p.gguf_raw() for p in parts]))


def test_the_richest_variant_is_kept_unless_another_is_clearly_faster():
    """Chosen by measuring, with a margin: a noisy measurement does not flip the choice run to run."""
    pick = lowbit_kernels._pick_variant
    assert pick({"avx512vnni": 1.05, "avx512": 1.0, "avx2": 0.97}) == "avx512vnni"
    assert pick({"avx512vnni": 1.3, "avx512": 1.0, "avx2": 1.1}) == "avx512"
    assert pick({"avx2": 1.0}) == "avx2"
    assert pick({"amx": 1.02, "avx512vnni": 1.0, "avx512": 1.1, "avx2": 1.3}) == "amx"  # the same few-row code


def test_sampled_output_with_a_reduced_draft_vocabulary_follows_the_targets_exact_law():
    """A draft scoring only ids 0-2 of 5 (plus its row's context ids, which grow as tokens are sampled): q = 0
    elsewhere, and the first three sampled tokens still follow the target's exact joint; negative control:
    the same samples against the draft's law fail."""
    from specdecode.proposers.draft_model import DraftModelConfig

    vocab = 5
    tgt = set_weight_precision(tiny_llama(vocab_size=vocab, seed=3, layers=1, hidden=32, scale=4.0,
                                          dtype=torch.float32), "int8")
    drf = set_weight_precision(tiny_llama(vocab_size=vocab, seed=4, layers=1, hidden=32, scale=4.0,
                                          dtype=torch.float32), "int8")
    prompt = [1, 2]
    engine = SpeculativeEngine(tgt, DraftModelProposer(drf, DraftModelConfig(vocab=3)),
                               EngineConfig(num_speculative_tokens=2))
    counts = np.zeros(vocab**3)
    for s in range(2000):
        out = engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s))
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 3)] += 1
    assert engine.proposer.runner._vocab_rows == 3
    assert chi2_pvalue(counts, exact_joint(tgt, prompt, 3, backend="owned")) > 1e-3
    assert chi2_pvalue(counts, exact_joint(drf, prompt, 3, backend="owned")) < 1e-6


@pytest.mark.parametrize("family", ["32", "k"])
def test_a_fused_product_gives_each_weight_its_own_bits(family):
    """q / k / v (gate / up) run as one fused product (lowbit.cpp q_product_parts: the activations quantized once
    per block size, one thread split over the tiles of every part, a thread's range crossing parts): each part's
    columns are bit for bit q_linear's of that weight alone, on every variant, at 1-3 threads, 1-9 rows, for
    widths that are not multiples of 8 and mixed formats (a Q4_K_M file's Q4_K q beside a Q6_K v)."""
    kernel = lowbit.load_kernel()
    if kernel is None or not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    kinds = ["Q4_0", "Q8_0", "Q4_1", "Q5_0", "Q8_0"] if family == "32" else ["Q4_K", "Q6_K", "Q4_K", "Q6_K", "Q4_K"]
    k = 576 if family == "32" else 512
    widths = [12, 8, 5, 16, 3]
    modules = [lowbit.QuantLinear(torch.from_numpy(_raw(kind, w, k, seed=i)), kind, k)
               for i, (kind, w) in enumerate(zip(kinds, widths))]
    threads = torch.get_num_threads()
    try:
        for name in VARIANTS:
            table = lowbit.load_variant(name)
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                for rows in (1, 4, 9):
                    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                    fused = kernel.q_linear_parts(x, [m.packed for m in modules], [m.fmt for m in modules], table)
                    alone = torch.cat([kernel.q_linear(x, m.packed, m.fmt, table) for m in modules], dim=1)
                    assert torch.equal(fused, alone), (name, n, rows)
    finally:
        torch.set_num_threads(threads)


def test_a_compile_left_half_done_is_cleaned_up_by_the_next(monkeypatch, tmp_path):
    """A variant's temporary output older than STALE_TMP_S (a compile that was interrupted) is removed when the
    variant compiles again; a fresh one (a compile running in another process) is left alone."""
    import os
    import time

    if not VARIANTS:
        pytest.skip("no kernel variant on this CPU")
    name = VARIANTS[-1]
    out = lowbit_kernels._variant_path(name, tmp_path)
    out.parent.mkdir(parents=True)
    old, fresh = out.parent / f".{out.name}.abc.tmp", out.parent / f".{out.name}.def.tmp"
    for f in (old, fresh):
        f.write_bytes(b"half")
    past = time.time() - lowbit_kernels.STALE_TMP_S - 5
    os.utime(old, (past, past))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(lowbit.SpecDecodeError, match=f"could not compile the {name} kernel"):
        lowbit_kernels._compile_variant(name, tmp_path, quiet=True)
    assert not old.exists() and fresh.exists()
    assert not [p for p in out.parent.glob("*.tmp") if p not in (fresh,)]  # the failed compile left none either
