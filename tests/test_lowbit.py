"""Low-bit weights (``--weights int4`` / ``int8``): GGUF blocks read exactly, the kernel's products,
row invariance, the cache, and speculative == plain decoding of a low-bit target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecode import lowbit
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kernels import set_weight_precision
from specdecode.proposers import DraftModelProposer, NgramProposer, TreeDraftConfig, TreeDraftProposer
from specdecode.types import SamplingParams
from tiny import tiny_llama


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes shaped as ``kind`` blocks, with sane float16 scales (random bytes are valid blocks)."""
    rng = np.random.default_rng(seed)
    size, nbytes = lowbit.GGUF_BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows, cols // size, nbytes), dtype=np.uint8)
    scale = lambda n: rng.uniform(1e-3, 2e-2, size=(rows, cols // size, n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q6_K":
        raw[..., 208:210] = scale(1)
    elif kind in ("Q4_K", "Q4_1"):
        raw[..., 0:4] = scale(2)
    else:
        raw[..., 0:2] = scale(1)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(lowbit.GGUF_BLOCKS))
def test_gguf_blocks_decode_to_what_gguf_dequantizes(kind):
    """scale * q + offset is exactly the gguf package's dequantization (what the float copy holds)."""
    gguf = pytest.importorskip("gguf")
    rows, cols = 6, 512
    raw = _random_blocks(kind, rows, cols)
    expected = gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    decoded = lowbit.decode_blocks(kind, raw, rows, cols)
    q = decoded[1].astype(np.float32)
    if decoded[0] == "int4":
        assert decoded[1].max() <= 15
        w = q.reshape(rows, -1, 32) * decoded[2][..., None] + decoded[3][..., None]
    else:
        w = q.reshape(rows, -1, decoded[3]) * decoded[2][..., None]
    np.testing.assert_array_equal(w.reshape(rows, cols), expected)
    module = lowbit.module_from_blocks(kind, raw, rows, cols)
    torch.testing.assert_close(module.dequantize(), torch.from_numpy(expected), rtol=0, atol=1e-6)


def test_gguf_blocks_refuse_unknown_types_and_sizes():
    with pytest.raises(lowbit.SpecDecodeError, match="no low-bit layout"):
        lowbit.decode_blocks("IQ2_XS", np.zeros(10, np.uint8), 1, 256)
    with pytest.raises(lowbit.SpecDecodeError, match="bytes"):
        lowbit.decode_blocks("Q4_0", np.zeros(10, np.uint8), 1, 32)


def _modules(seed=0, n=48, k=96):
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.1
    bias = torch.randn(n)
    return [lowbit.GroupInt4Linear.from_float(w, bias), lowbit.GroupInt8Linear.from_float(w, bias, group=32),
            lowbit.GroupInt8Linear.from_float(w, None, group=16)]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_kernel_equals_the_dequantized_product(index):
    module = _modules()[index]
    x = torch.randn(7, module.in_features)
    want = x.double() @ module.dequantize().double().T + (0 if module.bias is None else module.bias.double())
    torch.testing.assert_close(module(x).double(), want, rtol=1e-5, atol=1e-5)
    kernel = lowbit.load_kernel()
    if kernel is not None:  # the kernel's dequantization (prefill) = the module's, to float32 rounding
        torch.testing.assert_close(module._kernel_dequantize(kernel), module.dequantize(), rtol=1e-6, atol=1e-7)
    # a prompt-sized call that need not be row-invariant runs one dequantized product: same values
    big = torch.randn(lowbit.PREFILL_ROWS + 3, module.in_features)
    torch.testing.assert_close(module(big, exact=False), module(big), rtol=1e-5, atol=1e-5)
    # a prompt's prefill may run that product in bfloat16 (AVX512-BF16 / AMX CPUs): bf16 rounding only
    torch.testing.assert_close(module(big, exact=False, prompt=True), module(big), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_row_does_not_depend_on_the_rows_beside_it(index):
    """What keeps speculative output equal to plain decoding: bit-equal rows for 1..9 rows, a loud neighbour."""
    module = _modules(1)[index]
    x = torch.randn(9, module.in_features)
    x[3] *= 1000.0
    together = module(x)
    for i in range(9):
        assert torch.equal(module(x[i : i + 1])[0], together[i])
        assert torch.equal(module(x[: i + 1]), together[: i + 1])


def test_reference_fallback_gives_the_same_products(monkeypatch):
    module = _modules(2)[0]
    x = torch.randn(5, module.in_features)
    fast = module(x)
    monkeypatch.setenv("SPECDECODE_LOWBIT_KERNEL", "reference")
    assert lowbit.load_kernel() is None and "reference" in lowbit.kernel_status()
    slow = module(x)
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)
    assert torch.equal(module(x[2:3])[0], slow[2])  # the fallback is row-invariant too


def test_fused_modules_equal_their_parts():
    torch.manual_seed(0)
    for make in (lowbit.GroupInt4Linear.from_float, lowbit.GroupInt8Linear.from_float):
        parts = [make(torch.randn(n, 64), torch.randn(n)) for n in (16, 8, 8)]
        fused = lowbit.concat(parts)
        x = torch.randn(5, 64)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    mixed = [lowbit.GroupInt4Linear.from_float(torch.randn(8, 64)), lowbit.GroupInt8Linear.from_float(torch.randn(8, 64))]
    assert lowbit.concat(mixed) is None  # different kinds run one after another


def test_cache_round_trip_and_stale_cache(tmp_path):
    modules = {f"layer{i}": m for i, m in enumerate(_modules(3))}
    path = tmp_path / "w.safetensors"
    source = {"sha256": "abc", "precision": "int4", "from": "gguf"}
    lowbit.save_modules(path, modules, source)
    back = lowbit.load_modules(path, source)
    x = torch.randn(3, 96)
    for name, m in modules.items():
        assert type(back[name]) is type(m) and torch.equal(back[name](x), m(x))
    assert lowbit.load_modules(path, {**source, "sha256": "other"}) is None  # another model: rebuilt
    path.write_bytes(b"garbage")
    assert lowbit.load_modules(path, source) is None


def test_layers_whose_width_is_not_a_multiple_of_32_stay_float():
    model = tiny_llama(seed=0, hidden=48, dtype=torch.float32)  # q/k/v read 48 features: not groups of 32
    set_weight_precision(model, "int4")
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, lowbit.GroupInt4Linear)  # reads 96


PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30))]


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_lowbit_target_and_draft_speculative_greedy_equals_plain(precision):
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


def test_the_kernel_builds_where_the_cpu_has_avx512():
    """The AVX-512 kernel (and the C++ layer loop) must build on such a CPU: the torch reference is a
    fallback for other CPUs, not a silent substitute that would hide a broken build."""
    if not lowbit._cpu_has_avx512():
        pytest.skip("no AVX-512 here: the torch reference runs")
    assert lowbit.load_kernel() is not None, lowbit.kernel_status()
    assert hasattr(lowbit.load_kernel(), "LayerStack")
