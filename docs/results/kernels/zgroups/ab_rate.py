# A/B of two builds of csrc/qgemm.c's VNNI variant on matrices of real shapes (cached: 2048 rows, streamed from
# memory: 65536 rows), builds interleaved, fastest of 7, outputs compared bit for bit:
#   python ab_rate.py THREADS old.so new.so [FORMATS]     (speed of new over old; > 1: new faster)
import ctypes, time, sys, numpy as np, torch
from specdecode import lowbit_kernels as lk
kern = lk.load_kernel()
tabs = []
for path in sys.argv[2:4]:
    lib = ctypes.CDLL(path); lib.sd_table.restype = ctypes.c_void_p; tabs.append(int(lib.sd_table()))
torch.set_num_threads(int(sys.argv[1]))
rng = np.random.default_rng(0)
ks = {"Q4_1": 576, "Q5_0": 896, "Q8_0": 896, "Q4_0": 576, "Q4_K": 1536, "Q6_K": 1536}
for kind in sys.argv[4].split(",") if len(sys.argv) > 4 else ("Q4_1", "Q5_0", "Q8_0"):
    for n in (2048, 65536):
        k = ks[kind]
        raw = lk._random_raw(kind, n, k, rng); w = torch.from_numpy(lk.repack(raw, kind)); fmt = lk.GGUF_BLOCKS[kind][0]
        res = []
        for rows in ([int(r) for r in sys.argv[5].split(",")] if len(sys.argv) > 5 else (1, 2, 3, 4, 5, 6, 8)):
            x = torch.randn(rows, k); reps = max(2, int(1e8 / w.numel())); best = [1e9, 1e9]; outs = [None, None]
            for _ in range(7):
                for i, tab in enumerate(tabs):
                    t = time.perf_counter()
                    for _ in range(reps): outs[i] = kern.q_linear(x, w, fmt, tab)
                    best[i] = min(best[i], (time.perf_counter() - t) / reps)
            assert torch.equal(outs[0], outs[1]), (kind, n, rows)
            res.append(f"{rows}r {best[0] / best[1]:.2f}x")
        print(f"{kind} {n}x{k} new/old speed:", " | ".join(res), flush=True)
