"""Replay greedy outputs (outputs.py writes them) through prompt lookup and a model of the step's cost, to compare
draft-length rules without the machine's noise: python replay.py SLOPE PREFILL FILE...

Greedy decoding commits the same tokens whatever the drafts, so each rule's steps follow from the output alone: at
each position the n-gram drafter (the project's NgramIndex, n = 3..1) proposes from the text so far, the rule keeps a
prefix, the accepted part is the longest prefix equal to the output. A step verifying g tokens costs 1 + SLOPE * g
plain steps, a prompt PREFILL steps per token; speedup = (prefill + plain steps) / (prefill + steps). Rules: fixed
gamma; the cost-model policy's own trim() and update() (specdecode.policy, fed the scripted costs); an oracle that
drafts exactly the tokens that will be accepted (an upper bound for prompt lookup at that cost)."""
import json, math, statistics, sys
from specdecode.policy import CostModelPolicy
from specdecode.proposers.ngram import NgramIndex

SLOPE, PREFILL, files = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
STEP = 0.003  # seconds of a plain step (scripted: only ratios matter)


def replay(record, rule, policy=None):
    prompt, out = record["prompt_ids"], record["token_ids"]
    seq = prompt + out
    index = NgramIndex(prompt, 1, 3)
    i, cost = len(prompt), 0.0
    while i < len(seq):
        draft, n = index.continuation(16)
        draft = draft[: len(seq) - i]
        accepted_all = 0
        while accepted_all < len(draft) and draft[accepted_all] == seq[i + accepted_all]:
            accepted_all += 1
        if rule == "oracle":
            g = accepted_all
        elif rule == "policy":
            g = policy.next_length()
            g = policy.trim([min(g, len(draft))], [n], 1)[0] if g and draft else 0
        else:
            g = min(rule, len(draft))
        a = min(g, accepted_all)
        cost += 1 + SLOPE * g
        if policy is not None:
            policy.update(g, a, draft_time_s=1e-6 * g, verify_time_s=STEP * (1 + SLOPE * g),
                          match_lengths=[n if g else None])
        index.extend(seq[i : i + a + 1])
        i += a + 1
    steps = len(out)
    return (PREFILL * len(prompt) + steps) / (PREFILL * len(prompt) + cost)


for f in files:
    data = json.load(open(f))
    print(f"# {f}: {len(data)} prompts, slope {SLOPE}, prefill {PREFILL} steps / prompt token")
    for rule in (1, 2, 3, 5, 8, "policy", "oracle"):
        policy = CostModelPolicy(5) if rule == "policy" else None  # one engine: its estimates carry over
        r = [replay(rec, rule, policy) for rec in data]
        name = f"fixed gamma {rule}" if isinstance(rule, int) else ("cost-model gamma 5 (auto)" if rule == "policy" else "oracle")
        print(f"{name:28s} median {statistics.median(r):.3f}  geometric mean {math.exp(sum(map(math.log, r)) / len(r)):.3f}  worst {min(r):.2f}")
