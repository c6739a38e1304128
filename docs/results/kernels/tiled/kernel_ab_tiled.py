# A/B of the column kernel (OLD.c: a qgemm.c from before the Q4_K tiles, compiled against this qtable.h: its
# gemmk / dequantize ignore the extra n_out argument) and the tiled one (NEW.c), interleaved call by call, one thread:
#   python kernel_ab_tiled.py OLD.c NEW.c KINDS VARIANTS ROWS   (NK=n,k sets the weight shape)
# OLD gets the column layout (Q4_K: scale bytes re-ordered; Q6_K: the file's blocks), NEW lowbit.repack's tiles. Prints ps per
# multiply-add (fastest of >= 30 calls each) and "DIFF" where the outputs are not bit-identical (expected for
# the tiled kinds: another float order).
import ctypes, os, subprocess, sys, time
import numpy as np
import torch
from specdecode import lowbit
torch.set_num_threads(1)
kernel = lowbit.load_kernel()
def build(src, variant, tag):
    _, flags, macro = lowbit.VARIANTS[variant]
    out = f"/tmp/kernel_ab-{tag}-{variant}.so"
    subprocess.run(["gcc", "-O3", "-std=gnu11", "-shared", "-fPIC", *flags, f"-D{macro}", f"-I{lowbit._CSRC}", src,
                    "-o", out, "-lm", "-w"], check=True)
    lib = ctypes.CDLL(out); lib.sd_table.restype = ctypes.c_void_p
    return lib, int(lib.sd_table())
old, new, kinds, variants, rows = sys.argv[1:6]
n, k = (int(v) for v in os.environ.get("NK", "1024,1536").split(","))
rng = np.random.default_rng(0)
libs = []
for v in variants.split(","):
    la, aa = build(old, v, "old"); lb, ab = build(new, v, "new"); libs += [la, lb]
    for kind in kinds.split(","):
        raw = lowbit._random_raw(kind, n, k, rng)
        w_new = torch.from_numpy(lowbit.repack(raw, kind))
        old_q4k = lowbit._q4k_scales_mapped(raw, lowbit._q4k_to_kernel) if kind == "Q4_K" else None
        w_old = torch.from_numpy(old_q4k) if kind == "Q4_K" else torch.from_numpy(np.ascontiguousarray(raw)) if kind == "Q6_K" else w_new
        fmt = lowbit.GGUF_BLOCKS[kind][0]
        cells = []
        for m in (int(r) for r in rows.split(",")):
            x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
            same = torch.equal(kernel.q_linear(x, w_old, fmt, aa), kernel.q_linear(x, w_new, fmt, ab))
            best = {aa: 1e9, ab: 1e9}
            for _ in range(max(30, 600 // m)):
                for addr, w in ((aa, w_old), (ab, w_new)):
                    t = time.perf_counter(); kernel.q_linear(x, w, fmt, addr); best[addr] = min(best[addr], time.perf_counter() - t)
            cells.append(f"M{m} {best[aa] * 1e12 / (m * n * k):.1f}->{best[ab] * 1e12 / (m * n * k):.1f}ps "
                         f"({best[aa] / best[ab]:.2f}x{'' if same else ' DIFF'})")
        print(f"{v} {kind} n={n} k={k}", " | ".join(cells), flush=True)
