# A/B of the pair thresholds (csrc/qgemm.c sd_pair_min_rows) on a real model's forward, 2 threads, 256 tokens of
# context, interleaved, fastest of 4 rounds x 2: python ab_model.py MODEL [K,K,...]
import sys, time, ctypes, torch
from specdecode import lowbit_kernels as lk
from specdecode.bench.verifytable import OurForward
for _, flags, _ in lk.VARIANTS.values():  # sd_pair_min_rows as a variable (csrc/qgemm.c SD_PAIR_AB; its own cache file)
    flags.append("-DSD_PAIR_AB")
torch.set_num_threads(2)
f = OurForward(sys.argv[1], 256)
lib = lk._variants[lk.active_variant()][0]
arr = (ctypes.c_int * 6).in_dll(lib, "sd_pair_min_rows")
settings = {"single": [99]*6, "pairs>=1": [1]*6, "pairs>=4": [4]*6, "pairs>=8": [8]*6, "default": list(arr)}
ks = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 5, 8, 16]
best = {(s, k): 1e9 for s in settings for k in ks}
for rnd in range(4):
  for k in ks:
    for name, v in settings.items():
      for i in range(6): arr[i] = v[i]
      best[(name, k)] = min(best[(name, k)], f.time(k, 2))
for k in ks:
  print(f"k={k}: " + " | ".join(f"{n} {1e3*best[(n,k)]:.1f}" for n in settings), flush=True)
