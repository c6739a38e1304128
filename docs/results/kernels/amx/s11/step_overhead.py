import time, collections
from specdecode.generator import SpecDecoder, TextTracker
from specdecode import engine as E
dec = SpecDecoder.from_pretrained("smollm2-135m", draft=None, threads=2, progress=False)
ids = dec.encode("Write a long story about a robot.", chat=True)
dec.generate(ids, max_new_tokens=32, ignore_eos=True)
eng = dec.engine; runner = eng.runner
acc = collections.Counter()
def wrap(obj, name, key):
    orig = getattr(obj, name)
    def f(*a, **k):
        t = time.perf_counter(); out = orig(*a, **k); acc[key] += time.perf_counter() - t; return out
    setattr(obj, name, f)
wrap(runner, "forward", "runner.forward"); wrap(type(runner), "_run", "_run")
wrap(eng, "_verify", "_verify"); wrap(eng, "_verify_chains", "_verify_chains"); wrap(eng, "_commit", "_commit")
wrap(eng, "_adapt", "_adapt"); wrap(eng, "step", "step"); wrap(TextTracker, "add", "tracker.add")
import specdecode.kv.owned as O
for r in range(3):
    acc.clear(); t = time.perf_counter(); out = dec.generate(ids, max_new_tokens=256, ignore_eos=True); wall = time.perf_counter() - t
    n = len(out.token_ids)
    print(f"wall {wall/n*1e3:.3f} ms/token | " + " ".join(f"{k} {v/n*1e3:.3f}" for k, v in sorted(acc.items(), key=lambda kv: -kv[1])))
