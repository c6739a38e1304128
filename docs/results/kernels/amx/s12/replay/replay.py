"""Replay greedy outputs (s10/replay/outputs.py wrote them) through prompt lookup and a model of the step's cost (as
s10/replay/replay.py), comparing what the cost-model policy learns acceptance by: python replay.py SLOPE PREFILL FILE...

Rules: fixed gamma; the policy fed the n of the n-gram matched (1..3: the drafter's max_ngram, the code before this
session); the policy fed the extended match (how many tokens before the draft the context and the earlier occurrence
agree, at most 32: specdecode.proposers.ngram.NgramIndex.match_extent), with gamma 5 and 8; an oracle that drafts
exactly the tokens that will be accepted, at most 5 / 16 (an upper bound for prompt lookup at that cost)."""
import json, math, statistics, sys
from specdecode.policy import CostModelPolicy
from specdecode.proposers.ngram import NgramIndex

SLOPE, PREFILL, files = (float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]) if len(sys.argv) > 2 else (0.33, 0.27, [])
STEP = 0.003  # seconds of a plain step (scripted: only ratios matter)


def extent(index, n):
    """tokens the context's end and the matched occurrence agree on (the n matched, extended backwards, <= 32)"""
    toks = index.tokens
    e = index.latest[n].get(tuple(toks[len(toks) - n:])) if n else None
    if e is None:
        return 0
    m = 0
    while m < 32 and e - m >= 0 and toks[len(toks) - 1 - m] == toks[e - m]:
        m += 1
    return m


def replay(record, rule, policy=None, gamma=5, ext=False):
    prompt, out = record["prompt_ids"], record["token_ids"]
    seq = prompt + out
    index = NgramIndex(prompt, 1, 3)
    i, cost = len(prompt), 0.0
    while i < len(seq):
        draft, n = index.continuation(16)
        m = extent(index, n) if ext else n
        draft = draft[: len(seq) - i]
        accepted_all = 0
        while accepted_all < len(draft) and draft[accepted_all] == seq[i + accepted_all]:
            accepted_all += 1
        if rule == "oracle":
            g = min(accepted_all, gamma)
        elif rule == "policy":
            g = policy.next_length()
            g = policy.trim([min(g, len(draft))], [m], 1)[0] if g and draft else 0
        else:
            g = min(rule, len(draft))
        a = min(g, accepted_all)
        cost += 1 + SLOPE * g
        if policy is not None:
            policy.update(g, a, draft_time_s=1e-6 * g, verify_time_s=STEP * (1 + SLOPE * g),
                          match_lengths=[m if g else None])
        index.extend(seq[i : i + a + 1])
        i += a + 1
    steps = len(out)
    return (PREFILL * len(prompt) + steps) / (PREFILL * len(prompt) + cost)


def show(name, r):
    print(f"{name:40s} median {statistics.median(r):.3f}  geometric mean {math.exp(sum(map(math.log, r)) / len(r)):.3f}  worst {min(r):.2f}")


if __name__ == "__main__":
    for f in files:
        data = json.load(open(f))
        print(f"# {f}: {len(data)} prompts, slope {SLOPE}, prefill {PREFILL} steps / prompt token")
        for g in (2, 5):
            show(f"fixed gamma {g}", [replay(rec, g) for rec in data])
        for gamma, ext, buckets in ((5, False, 4), (5, True, 4), (5, True, 6), (5, True, 8), (5, True, 12),
                                    (8, True, 8), (8, True, 12)):
            policy = CostModelPolicy(gamma, match_buckets=buckets)  # one engine: its estimates carry over
            show(f"cost model gamma {gamma}, {'extended match' if ext else 'n matched'}, {buckets} buckets",
                 [replay(rec, "policy", policy, gamma, ext) for rec in data])
        for g in (5, 8, 16):
            show(f"oracle gamma {g}", [replay(rec, "oracle", gamma=g) for rec in data])
