# A/B of two builds of csrc/qgemm.c (e.g. -DSD_PAIR_TILES=0 and the default with every threshold at 1) on
# matrices of real shapes, one or two threads, interleaved, the outputs compared bit for bit:
#   python ab_cached.py THREADS single.so pairs.so
import ctypes, time, numpy as np, torch, sys
from specdecode import lowbit_kernels as lk
kern = lk.load_kernel()
tabs = {}
for path in sys.argv[2:]:
  lib = ctypes.CDLL(path); lib.sd_table.restype = ctypes.c_void_p; tabs[path] = int(lib.sd_table())
rng = np.random.default_rng(0)
torch.set_num_threads(int(sys.argv[1]))
shapes = {"Q8_0": ((32768, 896), (65536, 896)), "Q5_0": ((65536, 896),), "Q4_K": ((65536, 1536),)}

for kind, ss in shapes.items():
  for (n, k) in ss:
    raw = lk._random_raw(kind, n, k, rng); w = torch.from_numpy(lk.repack(raw, kind)); fmt = lk.GGUF_BLOCKS[kind][0]
    res = []
    for rows in (1, 2, 4, 8):
      x = torch.randn(rows, k); best = {p: 1e9 for p in tabs}; outs = {}
      reps = max(1, int(2e7 / (n * k * rows) * 10))
      for _ in range(5):
        for p, tab in tabs.items():
          t = time.perf_counter()
          for _ in range(reps): outs[p] = kern.q_linear(x, w, fmt, tab)
          best[p] = min(best[p], (time.perf_counter() - t) / reps)
      o = list(outs.values()); assert all(torch.equal(o[0], v) for v in o), (kind, rows)
      b = list(best.values())
      res.append(f"{rows}r {b[0]/b[1]:.2f}x")
    print(kind, n, k, "speedup pair/single:", " | ".join(res), flush=True)
