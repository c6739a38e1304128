# One row of the owned forward on a GGUF model: n forwards of k tokens after 256 tokens of context (run it under
# `perf record -e cpu-clock -p PID` once it prints "ready"). Usage: T=2 python step_loop.py MODEL K N
import sys, time, os, torch
from specdecode.bench.verifytable import OurForward

f = OurForward(sys.argv[1], 256); torch.set_num_threads(int(os.environ.get("T", "2")))
k = int(sys.argv[2]); n = int(sys.argv[3])
print("ready", flush=True)
open("/tmp/step_ready", "w").write("1")
t = time.perf_counter()
for _ in range(n):
    f.runner.forward([(31 * i + 5) % 1000 for i in range(k)])
    f.runner.rollback(len(f.context))
print("per forward ms", (time.perf_counter() - t) / n * 1e3)
