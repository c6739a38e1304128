"""Microseconds per n-gram proposal (NgramProposer.propose_row, n = 3..1, 5 tokens) at 350 tokens of context: the
index of this session against the scan of the whole context per n it replaced (find_continuation, the old method)."""
import time, numpy as np, torch
from specdecode.proposers.ngram import NgramProposer, find_continuation
from specdecode.proposers.base import ProposeContext
from specdecode.types import SamplingParams
rng = np.random.default_rng(0)
toks = list(map(int, rng.integers(0, 2000, 350)))
ctx = ProposeContext(list(toks), 300, SamplingParams(), torch.Generator(), 49152)
p = NgramProposer(); p.start(ctx)
n = 2000
def old(tokens):  # what propose_row did before: three scans, then a tensor
    arr = np.asarray(tokens, dtype=np.int64)
    for k in (3, 2, 1):
        cont = find_continuation(arr, k, 5)
        if cont.size:
            return torch.from_numpy(cont.copy()).reshape(1, -1)
for label, fn in (("index, context unchanged", lambda: p.propose_row(ctx, 5)),
                  ("scan (old), context unchanged", lambda: old(ctx.token_ids))):
    t = time.perf_counter()
    for _ in range(n): fn()
    print(f"{label}: {(time.perf_counter() - t) / n * 1e6:.1f} us")
t = time.perf_counter()
for _ in range(n):
    ctx.token_ids.append(int(rng.integers(0, 2000))); p.propose_row(ctx, 5)
print(f"index, one new token each call: {(time.perf_counter() - t) / n * 1e6:.1f} us")
