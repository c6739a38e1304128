"""A/B of two qgemm.c builds in one process, calls alternated (fastest of >= 15 each): the time of one product
(q_linear) of N x K random GGUF blocks with R random rows, per row count. Session 9 (docs/results/kernels/amx/README.md
section 7). Usage: python kernel_ab.py FMT VARIANT ROWS "FLAGS_A" SRC_A "FLAGS_B" SRC_B [NxK]
e.g. python kernel_ab.py Q4_1 avx2 1,4,6,64 "" old_qgemm.c "-DSD_PASS=4" src/specdecode/csrc/qgemm.c"""
import sys, time, ctypes, subprocess, numpy as np, torch, hashlib
from specdecode import lowbit_kernels as lk
torch.set_num_threads(2)
kernel = lk.load_kernel()
fmt, var = sys.argv[1], sys.argv[2]; rowsl = [int(r) for r in sys.argv[3].split(',')]
builds = []
for extra, src in [(sys.argv[4], sys.argv[5]), (sys.argv[6], sys.argv[7])]:
    flags = lk._COMMON_CFLAGS + lk.VARIANTS[var][1] + [f"-D{lk.VARIANTS[var][2]}"] + (extra.split() if extra else [])
    out = f"/tmp/qg-{hashlib.sha1((' '.join(flags)+src).encode()+open(src,'rb').read()).hexdigest()[:10]}.so"
    subprocess.run(["gcc", *flags, f"-I{lk._CSRC}", src, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out); lib.sd_table.restype = ctypes.c_void_p; builds.append((lib, int(lib.sd_table())))
rng = np.random.default_rng(0)
n, k = (1536, 576) if len(sys.argv) < 9 else tuple(int(v) for v in sys.argv[8].split('x'))
raw = torch.from_numpy(lk._random_raw(fmt, n, k, rng))
for rows in rowsl:
    x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32))
    ts = [[], []]
    reps = max(15, int(3e8 / (n * k * rows)))
    for _ in range(reps):
        for j, (_, addr) in enumerate(builds):
            t = time.perf_counter(); kernel.q_linear(x, raw, lk.GGUF_BLOCKS[fmt][0], addr); ts[j].append(time.perf_counter() - t)
    a, b = min(ts[0]), min(ts[1])
    print(f"{var} {fmt} rows {rows}: A {a*1e6:.0f}us ({n*k*rows/a/1e9:.0f} GMAC/s)  B {b*1e6:.0f}us ({n*k*rows/b/1e9:.0f})  B/A {b/a:.3f}")
