"""Spec-Bench categories x PER, SmolLM2 int4: plain vs ngram fixed gamma vs ngram cost-model gamma, interleaved
prompt by prompt, R rounds, fastest kept; ratios vs plain per prompt; median and geometric mean."""
import sys, time, collections, os, statistics, math, torch
from specdecode.data import load_prompts
from specdecode.lowbit import load_in_precision
from specdecode.bench.variants import engine_runner
from specdecode.proposers import build_proposer
PER = int(sys.argv[1]); R = int(sys.argv[2]); N = int(sys.argv[3]); G = int(sys.argv[4]); cats = sys.argv[5].split(",") if len(sys.argv) > 5 else None
torch.set_num_threads(2)
t = load_in_precision("smollm2-135m", "int4", progress=False)
eos = tuple(t.eos_token_ids)
runs = {"plain": engine_runner(t, None, 1, N, 0.0, eos, 2048),
        f"fixed{G}": engine_runner(t, build_proposer("ngram"), G, N, 0.0, eos, 2048, policy="fixed"),
        f"cost{G}": engine_runner(t, build_proposer("ngram"), G, N, 0.0, eos, 2048, policy="cost-model")}
cnt = collections.Counter(); prompts = []
for p in load_prompts("spec-bench"):
    if cats and p.category not in cats: continue
    if cnt[p.category] < PER:
        cnt[p.category] += 1; prompts.append(p)
w = "Hello, world. Hello, world."
for r in runs.values(): r(t.tokenizer(w)["input_ids"], 0, 4)
print(f"# {time.strftime('%T')} load {os.getloadavg()} ISA={os.environ.get('SPECDECODE_KERNEL_ISA','auto')} {len(prompts)} prompts, {N} tokens, gamma {G}, rounds {R}")
ratios = collections.defaultdict(list)
for p in prompts:
    ids = t.tokenizer(t.tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    best = {}; toks = {}
    for _ in range(R):
        for k, run in runs.items():
            o = run(ids, 0); best[k] = min(best.get(k, 1e9), o.wall_s); toks.setdefault(k, o.token_ids)
            assert o.token_ids == toks["plain"], (p.id, k)
    line = f"{p.category:15s} {p.id:>4s} plen {len(ids):4d}"
    for k in runs:
        if k == "plain": continue
        ratios[k].append(best["plain"] / best[k]); line += f"  {k} {ratios[k][-1]:.2f}"
    print(line, flush=True)
for k, v in ratios.items():
    print(f"{k}: median {statistics.median(v):.3f} gmean {math.exp(sum(map(math.log, v))/len(v)):.3f} min {min(v):.2f} max {max(v):.2f}")
