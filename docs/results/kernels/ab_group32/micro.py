import sys, time, numpy as np, torch
from specdecode import lowbit
torch.set_num_threads(1)
kernel = lowbit.load_kernel()
rng = np.random.default_rng(0)
n, k = 1024, 1536
kinds = sys.argv[1].split(","); variants = sys.argv[2].split(","); Ms = [int(m) for m in sys.argv[3].split(",")]
for kind in kinds:
    raw = lowbit._random_raw(kind, n, k, rng)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        raw = lowbit.repack(raw, kind)
    raw = torch.from_numpy(raw)
    fmt = lowbit.GGUF_BLOCKS[kind][0]
    for v in variants:
        addr = lowbit.load_variant(v)
        line = []
        base = None
        for M in Ms:
            x = torch.from_numpy(rng.standard_normal((M, k), dtype=np.float32))
            best = 1e9
            reps = max(10, 256 // M)
            for _ in range(reps):
                t = time.process_time(); kernel.q_linear(x, raw, fmt, addr); dt = time.process_time() - t
                best = min(best, dt)
            if base is None: base = best
            line.append(f"M{M}:{best*1e3:.2f}ms({best/base:.2f}) {best*1e9/(M*n*k)*1000:.0f}ps/mac")
        print(kind, v, " ".join(line), flush=True)
