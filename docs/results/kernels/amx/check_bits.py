# python check_bits.py [VARIANT_A VARIANT_B [ROWS]]: two variants' products, bit for bit (default: amx avx512vnni,
# rows 8,16,17,33,48,53,100; a row 1000x louder in each call), 6 formats x 4 shapes x 1-2 threads
import torch, numpy as np, time, sys
from specdecode import lowbit, lowbit_kernels
kernel = lowbit.load_kernel()
print(lowbit.supported_variants())
A, B = sys.argv[1:3] if len(sys.argv) > 2 else ("amx", "avx512vnni")
ROWS = [int(r) for r in sys.argv[3].split(",")] if len(sys.argv) > 3 else [8, 16, 17, 33, 48, 53, 100]
print(A, "against", B, "rows", ROWS)
ta, tv = lowbit.load_variant(A), lowbit.load_variant(B)
bad = 0
for kind in ["Q4_0","Q4_1","Q5_0","Q8_0","Q4_K","Q6_K"]:
    for cols, k in [(32, 512), (61, 768), (64, 1536), (48, 2304)]:
        if lowbit.GGUF_BLOCKS[kind][1] == 32: k = k // 256 * 256 + (32 if k == 768 else 0)
        module = lowbit.QuantLinear(torch.from_numpy(lowbit_kernels._random_raw(kind, cols, k, np.random.default_rng(cols))), kind, k)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)); x[min(3, rows - 1)] *= 1000
            for th in (1, 2):
                torch.set_num_threads(th)
                a = kernel.q_linear(x, module.packed, module.fmt, ta); v = kernel.q_linear(x, module.packed, module.fmt, tv)
                if not torch.equal(a, v):
                    bad += 1; print("DIFF", kind, cols, k, rows, th, (a-v).abs().max().item())
print("bad", bad)
