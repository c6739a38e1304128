# GMAC/s per thread of one .so on cached weights (2048 x k): python rate.py THREADS lib.so FORMATS ROWS
import ctypes, time, sys, numpy as np, torch
from specdecode import lowbit_kernels as lk
kern = lk.load_kernel()
libs = sys.argv[2].split(",")
tabs = []
for path in libs:
    lib = ctypes.CDLL(path); lib.sd_table.restype = ctypes.c_void_p; tabs.append(int(lib.sd_table()))
th = int(sys.argv[1]); torch.set_num_threads(th)
rng = np.random.default_rng(0)
import os; KK = int(os.environ.get("KK", 0)); ks = {"Q4_1": 576, "Q5_0": 896, "Q8_0": 896, "Q4_0": 576, "Q4_K": KK or 1536, "Q6_K": KK or 1536}
for kind in sys.argv[3].split(","):
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 2048; k = ks[kind]
    raw = lk._random_raw(kind, n, k, rng); w = torch.from_numpy(lk.repack(raw, kind)); fmt = lk.GGUF_BLOCKS[kind][0]
    for rows in [int(r) for r in sys.argv[4].split(",")]:
        x = torch.randn(rows, k); reps = max(2, int(3e7 / (w.numel() * rows))); best = [1e9] * len(tabs); outs = [None] * len(tabs)
        for _ in range(7):
            for i, tab in enumerate(tabs):
                t = time.perf_counter()
                for _ in range(reps): outs[i] = kern.q_linear(x, w, fmt, tab)
                best[i] = min(best[i], (time.perf_counter() - t) / reps)
        for o in outs[1:]: assert torch.equal(outs[0], o), (kind, rows)
        print(f"{kind} {n}x{k} rows {rows}: " + " | ".join(f"{n*k*rows/b/1e9/th:.1f}" for b in best) + " GMAC/s/thread", flush=True)
