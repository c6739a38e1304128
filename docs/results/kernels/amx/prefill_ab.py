import sys, time, torch, ctypes, glob, os
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import load_in_precision, kernel_status
torch.set_num_threads(2)
loaded = load_in_precision(sys.argv[1], "int4", progress=False)
lib = ctypes.CDLL("/root/.cache/specdecode/kernels/qgemm-amx-a5abbb4cae8b.so")
arr = (ctypes.c_int * 6).in_dll(lib, "sd_amx_min_rows")
runner = OwnedRunner(loaded.model, 1, 2100)
row = runner.row(0)
ids = [1 + (i * 7919) % (runner.vocab_size - 2) for i in range(2000)]
settings = {"amx32": [48, 48, 48, 48, 32, 16], "no32": [1 << 30] * 4 + [32, 16], "none": [1 << 30] * 6}
for rep in range(3):
    for name, vals in settings.items():
        for i, v in enumerate(vals): arr[i] = v
        for n in (200, 400):
            ts = []
            for _ in range(4):
                t = time.perf_counter(); row.forward(ids[:n], last_only=True); ts.append(time.perf_counter() - t); row.rollback(0)
            print(f"{kernel_status()[:4]} {name} prefill {n}: {min(ts)*1e3:.1f} ms", flush=True)
