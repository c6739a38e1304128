import sys, json, torch, collections
from specdecode.data import load_prompts
from specdecode.generator import SpecDecoder
per = int(sys.argv[1]); n = int(sys.argv[2]); out = sys.argv[3]; cats = sys.argv[4].split(",") if len(sys.argv) > 4 else None
torch.set_num_threads(2)
dec = SpecDecoder.from_pretrained("smollm2-135m", draft="ngram", num_speculative_tokens=5, weights="int4")
plain = dec.plain()
cnt = collections.Counter(); res = []
for p in load_prompts("spec-bench"):
    if cats and p.category not in cats: continue
    if cnt[p.category] >= per: continue
    cnt[p.category] += 1
    o = plain.generate(p.turns[0], chat=not p.is_completion, max_new_tokens=n)
    res.append(dict(id=p.id, category=p.category, prompt_ids=list(map(int, o.prompt_token_ids)), token_ids=list(map(int, o.token_ids))))
json.dump(res, open(out, "w"))
print(len(res))
