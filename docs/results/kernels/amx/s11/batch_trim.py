"""Batches of B Spec-Bench prompts decoded together (SmolLM2 int4, n-gram gamma 5, greedy): plain decoding, the
cost-model policy cutting each row alone (the previous trim) and cutting the batch together (rows ride the padding),
interleaved batch by batch, R rounds, fastest kept; one engine (and one policy) per variant for the whole run.
usage: batch_trim.py B PER R [categories]"""
import sys, time, statistics, math, torch
from specdecode.data import load_prompts
from specdecode.lowbit import load_in_precision
from specdecode.config import EngineConfig
from specdecode.engine import SpeculativeEngine
from specdecode.policy import CostModelPolicy
from specdecode.proposers import NgramProposer
from specdecode.request import SamplingParams

B, PER, R = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)


class RowByRow(CostModelPolicy):
    """The previous trim: each row's prefix maximising E_m(g) / T(B, g) alone, the batch's padding ignored."""

    def trim(self, lengths, match_lengths, batch_size):
        self._lookup = True
        costs = self.step_costs(batch_size)
        if costs is None:
            return [min(int(n), self.initial) for n in lengths]
        out = []
        for n, m in zip(lengths, match_lengths):
            n = min(int(n), self.initial)
            est = self._estimate(m)
            key = self._bucket(m)
            best, best_rate, e, survive = 0, 1.0 / max(costs[0], 1e-12), 1.0, 1.0
            for g, rate in enumerate(est.rates()[:n], start=1):
                survive *= rate
                e += survive
                if e / max(costs[g], 1e-12) > best_rate:
                    best, best_rate = g, e / max(costs[g], 1e-12)
            self._decisions[key] = seen = self._decisions.get(key, 0) + 1
            if self.explore_every and seen % self.explore_every == 0:
                best = min(n, best + 1)
            out.append(best)
        return out


loaded = load_in_precision("smollm2-135m", "int4", progress=False)
tok = loaded.tokenizer
spec = "spec-bench" if len(sys.argv) < 5 else sys.argv[4]
by_cat = {}
for p in load_prompts(spec):
    by_cat.setdefault(p.category, []).append(p)
prompts = [ps[i] for i in range(PER) for ps in by_cat.values() if i < len(ps)]  # categories mixed in every batch
ids = [tok(tok.apply_chat_template([{"role": "user", "content": p.turns[0]}], add_generation_prompt=True, tokenize=False),
           add_special_tokens=False)["input_ids"] for p in prompts]
batches = [ids[i:i + B] for i in range(0, len(ids) - B + 1, B)]
cfg = EngineConfig(num_speculative_tokens=5, max_batch_size=B, max_context=loaded.max_context)
engines = {"plain": SpeculativeEngine(loaded.model, None, cfg),
           "row-by-row": SpeculativeEngine(loaded.model, NgramProposer(), cfg, policy=RowByRow(5)),
           "together": SpeculativeEngine(loaded.model, NgramProposer(), cfg, policy=CostModelPolicy(5))}
params = SamplingParams(max_new_tokens=96)


def run(eng, batch):
    reqs = [eng.add(p, params)[0] for p in batch]
    t = time.perf_counter()
    while any(r.finish_reason is None for r in reqs):
        eng.step()
    return time.perf_counter() - t, [list(r.ctx.token_ids[len(p):]) for r, p in zip(reqs, batch)]


best = {k: [math.inf] * len(batches) for k in engines}
outs = {}
names = list(engines)
for r in range(R):
    for bi, batch in enumerate(batches):
        order = names[(bi + r) % 3:] + names[:(bi + r) % 3]
        for name in order:
            t, o = run(engines[name], batch)
            best[name][bi] = min(best[name][bi], t)
            outs.setdefault((name, bi), o)
equal = {n: sum(outs[(n, bi)] == outs[("plain", bi)] for bi in range(len(batches))) for n in names}
print(f"B={B}, {len(batches)} batches of Spec-Bench ({spec}, {PER} per category), 96 tokens, gamma 5, {R} rounds")
for n in names[1:]:
    sp = [best["plain"][i] / best[n][i] for i in range(len(batches))]
    print(f"{n:11s}: speedup over plain per batch median {statistics.median(sp):.3f}, geometric mean "
          f"{math.exp(sum(map(math.log, sp)) / len(sp)):.3f}, worst {min(sp):.3f}, best {max(sp):.3f}; "
          f"outputs equal {equal[n]}/{len(batches)}")
print("tokens/s (sum over batches): " + ", ".join(
    f"{n} {sum(len(x) for bi in range(len(batches)) for x in outs[(n, bi)]) / sum(best[n]):.1f}" for n in names))
