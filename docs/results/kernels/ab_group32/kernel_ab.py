# A/B of two qgemm.c sources: python ab.py OLD.c NEW.c kinds variants Ms
import sys, time, ctypes, subprocess, numpy as np, torch, os
from specdecode import lowbit
torch.set_num_threads(1)
kernel = lowbit.load_kernel()
def build(src, variant, tag):
    _, flags, macro = lowbit.VARIANTS[variant]
    out = f"/tmp/k/{tag}-{variant}.so"
    subprocess.run(["gcc", "-O3", "-std=gnu11", "-shared", "-fPIC", *flags, f"-D{macro}", f"-I{lowbit._CSRC}", src, "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out); lib.sd_table.restype = ctypes.c_void_p
    return lib, int(lib.sd_table())
old, new = sys.argv[1], sys.argv[2]
kinds = sys.argv[3].split(","); variants = sys.argv[4].split(","); Ms = [int(m) for m in sys.argv[5].split(",")]
n, k = (int(v) for v in os.environ.get("NK", "1024,1536").split(","))
rng = np.random.default_rng(0)
keep = []
for v in variants:
    la, aa = build(old, v, "old"); lb, ab = build(new, v, "new"); keep += [la, lb]
    for kind in kinds:
        raw = lowbit._random_raw(kind, n, k, rng)
        if kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"): raw = lowbit.repack(raw, kind)
        raw = torch.from_numpy(raw); fmt = lowbit.GGUF_BLOCKS[kind][0]
        cells = []
        for M in Ms:
            x = torch.from_numpy(rng.standard_normal((M, k), dtype=np.float32))
            best = {aa: 1e9, ab: 1e9}
            for _ in range(max(30, 600 // M)):
                for addr in (aa, ab):
                    t = time.perf_counter(); kernel.q_linear(x, raw, fmt, addr); best[addr] = min(best[addr], time.perf_counter() - t)
            cells.append(f"M{M} {best[aa]*1e9/(M*n*k)*1e3:.0f}->{best[ab]*1e9/(M*n*k)*1e3:.0f}ps ({best[aa]/best[ab]:.2f}x)")
        print(v, kind, " | ".join(cells), flush=True)
