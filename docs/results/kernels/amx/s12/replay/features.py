"""Which feature predicts prompt lookup's acceptance best for the cost model (replay as replay.py): the key the policy
learns acceptance by, python features.py SLOPE PREFILL FILE..."""
import json, math, statistics, sys
from specdecode.policy import CostModelPolicy
from specdecode.proposers.ngram import NgramIndex
from replay import extent, show

SLOPE, PREFILL, files = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
STEP = 0.003


def run(record, policy, key):
    prompt, out = record["prompt_ids"], record["token_ids"]
    seq = prompt + out
    index = NgramIndex(prompt, 1, 3)
    i, cost, prev = len(prompt), 0.0, (0, 0)
    while i < len(seq):
        draft, n = index.continuation(16)
        e = index.latest[n].get(tuple(index.tokens[len(index.tokens) - n:])) if n else None
        m = key(n, extent(index, n), prev, e is not None and e < len(prompt))
        draft = draft[: len(seq) - i]
        acc = 0
        while acc < len(draft) and draft[acc] == seq[i + acc]:
            acc += 1
        g = policy.next_length()
        g = policy.trim([min(g, len(draft))], [m], 1)[0] if g and draft else 0
        a = min(g, acc)
        cost += 1 + SLOPE * g
        policy.update(g, a, draft_time_s=1e-6 * g, verify_time_s=STEP * (1 + SLOPE * g), match_lengths=[m if g else None])
        prev = (g, a)
        index.extend(seq[i : i + a + 1])
        i += a + 1
    return (PREFILL * len(prompt) + len(out)) / (PREFILL * len(prompt) + cost)


KEYS = {
    "n (current)": (4, lambda n, x, p, inp: n),
    "n, previous draft all accepted": (6, lambda n, x, p, inp: n + 3 * (p[0] > 0 and p[1] == p[0])),
    "n, previous step accepted any": (6, lambda n, x, p, inp: n + 3 * (p[1] > 0)),
    "n, match in the prompt": (6, lambda n, x, p, inp: n + 3 * inp),
    "extent 1,2,3,4-7,8+ , prev all": (10, lambda n, x, p, inp: min(5, (x if x < 4 else 4 if x < 8 else 5)) + 5 * (p[0] > 0 and p[1] == p[0])),
    "n, prev accepted 0 / some / all": (9, lambda n, x, p, inp: n + 3 * (0 if p[1] == 0 else 2 if p[1] == p[0] else 1)),
}
for f in files:
    data = json.load(open(f))
    print(f"# {f}: {len(data)} prompts, slope {SLOPE}, prefill {PREFILL} steps / prompt token")
    for name, (buckets, key) in KEYS.items():
        policy = CostModelPolicy(5, match_buckets=buckets)
        show(f"key: {name}", [run(rec, policy, key) for rec in data])
