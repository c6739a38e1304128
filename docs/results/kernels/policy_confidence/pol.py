import time, torch
torch.set_num_threads(2)
from specdecode.generator import SpecDecoder
from specdecode.data import load_prompts
prompts = load_prompts("humaneval:2") + load_prompts("spec-bench:coding:2") + load_prompts("spec-bench:math_reasoning:2")
configs = {"fixed3": dict(num_speculative_tokens=3, policy="fixed"), "fixed4": dict(num_speculative_tokens=4, policy="fixed"),
           "conf5": dict(num_speculative_tokens=5, policy="confidence"), "conf4": dict(num_speculative_tokens=4, policy="confidence")}
decs = {name: SpecDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="draft-model:model=qwen2.5-coder-0.5b", weights="int4", draft_weights="int4", **kw) for name, kw in configs.items()}
tot = {n: [0, 0.0] for n in decs}
for p in prompts:
    for n, d in decs.items():
        out = d.generate(p.turns[0], chat=not p.is_completion, max_new_tokens=64)
        tot[n][0] += out.metrics.num_generated_tokens; tot[n][1] += out.metrics.wall_time_s
for n, (t, s) in tot.items(): print(n, f"{t/s:.1f} tok/s", t)
