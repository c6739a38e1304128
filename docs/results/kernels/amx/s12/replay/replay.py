"""Replay greedy outputs (s10/replay/outputs.py wrote them) through prompt lookup and a model of the step's cost, to
compare what the cost-model policy learns acceptance by: python replay.py SLOPE PREFILL FILE...

Greedy decoding commits the same tokens whatever the drafts, so each rule's steps follow from the output alone (as
s10/replay/replay.py). A step verifying g tokens costs 1 + SLOPE * g plain steps, a prompt PREFILL steps per token.
Rules: fixed gamma; an oracle that drafts exactly the tokens that will be accepted, at most gamma; the policy
(specdecode.policy.CostModelPolicy, one per file: its estimates carry over) keyed by a feature of each draft: the n
of the n-gram matched (1..3, the code's), the match extended backwards (how many tokens before the draft the context
and the earlier occurrence agree, <= 32), whether the previous draft was kept whole, whether the match is in the
prompt, and combinations."""
import json, math, statistics, sys
from specdecode.policy import CostModelPolicy
from specdecode.proposers.ngram import NgramIndex

STEP = 0.003  # seconds of a plain step (scripted: only ratios matter)


def extent(index, n):
    """tokens the context's end and the matched occurrence agree on (the n matched, extended backwards, <= 32)"""
    toks = index.tokens
    e = index.latest[n].get(tuple(toks[len(toks) - n:])) if n else None
    if e is None:
        return 0, None
    m = 0
    while m < 32 and e - m >= 0 and toks[len(toks) - 1 - m] == toks[e - m]:
        m += 1
    return m, e


def speedup(record, slope, prefill, choose, learn=None):
    """choose(draft, n, ext, in_prompt, prev, right) -> tokens to verify; learn(g, a, key) after each step"""
    prompt, out = record["prompt_ids"], record["token_ids"]
    seq, index = prompt + out, NgramIndex(prompt, 1, 3)
    pos, steps, prev = len(prompt), 0.0, (0, 0)
    while pos < len(seq):
        draft, n = index.continuation(16)
        draft = draft[: len(seq) - pos]
        ext, e = extent(index, n)
        right = next((j for j, t in enumerate(draft) if t != seq[pos + j]), len(draft))
        g, key = choose(draft, n, ext, e is not None and e < len(prompt), prev, right)
        kept = min(g, right)
        steps += 1 + slope * g
        if learn is not None:
            learn(g, kept, key, slope)
        prev = (g, kept)
        index.extend(seq[pos : pos + kept + 1])
        pos += kept + 1
    return (prefill * len(prompt) + len(out)) / (prefill * len(prompt) + steps)


def policy_rule(gamma, buckets, key):
    policy = CostModelPolicy(gamma, match_buckets=buckets)

    def choose(draft, n, ext, in_prompt, prev, right):
        m = key(n, ext, prev, in_prompt)
        g = policy.next_length()
        return (policy.trim([min(g, len(draft))], [m], 1)[0] if g and draft else 0), m

    def learn(g, kept, m, slope):
        policy.update(g, kept, draft_time_s=1e-6 * g, verify_time_s=STEP * (1 + slope * g),
                      match_lengths=[m if g else None])

    return choose, learn


KEYS = {  # name: (gamma, buckets, key(n, extended match, (previous g, kept), match in the prompt))
    "n matched (the code's)": (5, 4, lambda n, x, p, inp: n),
    "extended match, 6 buckets": (5, 6, lambda n, x, p, inp: x),
    "extended match, 12 buckets": (5, 12, lambda n, x, p, inp: x),
    "extended match, 12 buckets, gamma 8": (8, 12, lambda n, x, p, inp: x),
    "n, previous draft kept whole": (5, 6, lambda n, x, p, inp: n + 3 * (p[0] > 0 and p[1] == p[0])),
    "n, previous step kept any": (5, 6, lambda n, x, p, inp: n + 3 * (p[1] > 0)),
    "n, match in the prompt": (5, 6, lambda n, x, p, inp: n + 3 * inp),
    "extent 1,2,3,4-7,8+, previous whole": (5, 10, lambda n, x, p, inp: min(x, 4 if x < 8 else 5)
                                            + 5 * (p[0] > 0 and p[1] == p[0])),
}


def show(name, r):
    print(f"{name:44s} median {statistics.median(r):.3f}  geometric mean "
          f"{math.exp(sum(map(math.log, r)) / len(r)):.3f}  worst {min(r):.2f}")


if __name__ == "__main__":
    slope, prefill = float(sys.argv[1]), float(sys.argv[2])
    for f in sys.argv[3:]:
        data = json.load(open(f))
        print(f"# {f}: {len(data)} prompts, slope {slope}, prefill {prefill} steps / prompt token")
        for g in (2, 5):
            show(f"fixed gamma {g}", [speedup(r, slope, prefill, lambda d, *a, g=g: (min(g, len(d)), None)) for r in data])
        for name, (gamma, buckets, key) in KEYS.items():
            choose, learn = policy_rule(gamma, buckets, key)
            show(f"cost model: {name}", [speedup(r, slope, prefill, choose, learn) for r in data])
        for g in (5, 8, 16):
            show(f"oracle gamma {g}", [speedup(r, slope, prefill, lambda d, n, x, i, p, right, g=g: (min(g, right), None))
                                       for r in data])
