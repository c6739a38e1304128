# A/B of the 32-weight formats' column kernel (OLD.c: main's qgemm.c at 0e6a9b8, compiled against this qtable.h: its
# gemm32 ignores the extra n_out argument) and the tiles of 8 columns (NEW.c), interleaved call by call, one thread:
#   python kernel_ab_tiled32.py OLD.c NEW.c KINDS VARIANTS ROWS SHAPES   (SHAPES: n,k;n,k;...)
# OLD gets the column layout (lowbit_kernels._columns), NEW lowbit.repack's tiles. Env: REPS (calls per cell, default
# max(30, 600 / rows), at most 30 for a weight over 64 MB), CFLAGS_OLD / CFLAGS_NEW (extra gcc flags, e.g.
# -DSD_PASS=4; then OLD.c may be NEW.c). Prints ps per multiply-add (fastest call of each) and "DIFF" where the
# outputs are not bit-identical (expected: the tiles sum in another float order).
import ctypes, os, subprocess, sys, time
import numpy as np
import torch
from specdecode import lowbit, lowbit_kernels
torch.set_num_threads(1)
kernel = lowbit.load_kernel()
def build(src, variant, tag, extra):
    _, flags, macro = lowbit.VARIANTS[variant]
    out = f"/tmp/kernel_ab32-{tag}-{variant}.so"
    subprocess.run(["gcc", "-O3", "-std=gnu11", "-shared", "-fPIC", *flags, *extra.split(), f"-D{macro}",
                    f"-I{lowbit_kernels._CSRC}", src, "-o", out, "-lm", "-w"], check=True)
    lib = ctypes.CDLL(out); lib.sd_table.restype = ctypes.c_void_p
    return lib, int(lib.sd_table())
old, new, kinds, variants, rows, shapes = sys.argv[1:7]
rng = np.random.default_rng(0)
libs = []
for v in variants.split(","):
    la, aa = build(old, v, "old", os.environ.get("CFLAGS_OLD", "")); lb, ab = build(new, v, "new", os.environ.get("CFLAGS_NEW", ""))
    libs += [la, lb]
    for shape in shapes.split(";"):
        n, k = (int(s) for s in shape.split(","))
        for kind in kinds.split(","):
            raw = lowbit_kernels._random_raw(kind, n, k, rng)
            w_new = torch.from_numpy(lowbit.repack(raw, kind))
            w_old = w_new if os.environ.get("CFLAGS_OLD") is not None else torch.from_numpy(lowbit_kernels._columns(raw, kind))
            fmt = lowbit.GGUF_BLOCKS[kind][0]
            cells = []
            for m in (int(r) for r in rows.split(",")):
                x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
                same = torch.equal(kernel.q_linear(x, w_old, fmt, aa), kernel.q_linear(x, w_new, fmt, ab))
                best = {aa: 1e9, ab: 1e9}
                reps = int(os.environ.get("REPS", 0)) or (30 if raw.nbytes > 64 << 20 else max(30, 600 // m))
                for _ in range(reps):
                    for addr, w in ((aa, w_old), (ab, w_new)):
                        t = time.perf_counter(); kernel.q_linear(x, w, fmt, addr); best[addr] = min(best[addr], time.perf_counter() - t)
                cells.append(f"M{m} {best[aa] * 1e12 / (m * n * k):.1f}->{best[ab] * 1e12 / (m * n * k):.1f}ps "
                             f"({best[aa] / best[ab]:.2f}x{'' if same else ' DIFF'})")
            print(f"{v} {kind} n={n} k={k}", " | ".join(cells), flush=True)
