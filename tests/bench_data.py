"""Hand-made benchmark records for the report tests (``test_bench_summary.py``, ``test_bench_report.py``).

Four prompts in two categories; our plain decoding, n-gram at gamma 4 and 2, HF plain and HF prompt lookup
(whose output differs from ours at position 3 of prompt b/2); a probe of the target's T_verify(k).
"""

from __future__ import annotations

from specdecode.metrics import RunMetrics

PROMPTS = [
    {"key": "a/1", "dataset": "a", "category": "cat-a", "prompt_tokens": 10, "chat_template": True},
    {"key": "b/1", "dataset": "b", "category": "cat-b", "prompt_tokens": 10, "chat_template": True},
    {"key": "a/2", "dataset": "a", "category": "cat-a", "prompt_tokens": 10, "chat_template": True},
    {"key": "b/2", "dataset": "b", "category": "cat-b", "prompt_tokens": 10, "chat_template": True},
]
VARIANTS = [
    {"key": "specdecode/plain", "engine": "specdecode", "method": "plain", "gamma": 0, "family": "plain",
     "peer_of": None, "draft": None},
    {"key": "specdecode/ngram:k=4", "engine": "specdecode", "method": "ngram", "gamma": 4, "family": "ngram",
     "peer_of": None, "draft": None},
    {"key": "specdecode/ngram:k=2", "engine": "specdecode", "method": "ngram", "gamma": 2, "family": "ngram",
     "peer_of": None, "draft": None},
    {"key": "hf/plain", "engine": "hf", "method": "plain", "gamma": 0, "family": "hf/plain", "peer_of": None,
     "draft": None},
    {"key": "hf/prompt-lookup:k=4,max_ngram=3", "engine": "hf", "method": "prompt-lookup", "gamma": 4,
     "family": "hf/prompt-lookup", "peer_of": "specdecode/ngram:k=4", "draft": None},
]
TOKENS = list(range(100, 120))  # 20 generated tokens, the same for every variant


def metrics(steps: list[tuple[int, int]], verify_s: float, draft_s: float = 0.0, prefill_s: float = 0.1) -> dict:
    """RunMetrics of a run whose steps drafted / accepted as given (each step commits accepted + 1)."""
    m = RunMetrics(num_prompt_tokens=10)
    for drafted, accepted in steps:
        m.record_step(drafted, accepted, accepted + 1)
    m.num_generated_tokens = 1 + sum(a + 1 for _, a in steps)
    m.prefill_time_s, m.verify_time_s, m.draft_time_s = prefill_s, verify_s, draft_s
    m.wall_time_s = prefill_s + verify_s + draft_s
    return m.to_dict()


def record(variant: str, prompt: str, wall: float, met: dict | None, tokens=TOKENS) -> dict:
    info = next(v for v in VARIANTS if v["key"] == variant)
    cat = next(p["category"] for p in PROMPTS if p["key"] == prompt)
    return {"kind": "run", "variant": variant, "prompt": prompt, **info, "category": cat, "token_ids": list(tokens),
            "new_tokens": len(tokens), "wall_s": wall, "finish_reason": "length", "metrics": met}


def make_records() -> list[dict]:
    recs = []
    plain_steps = [(0, 0)] * 19
    # ngram k=4: 5 steps of 4 drafted / 3 accepted = 20 tokens with the prefill's first
    ng4 = [(4, 3)] * 4 + [(2, 2)]
    ng2 = [(2, 2)] * 6 + [(1, 0)]
    walls = {"a/1": (2.0, 1.0, 1.6, 2.2, 1.1), "a/2": (2.0, 0.8, 1.5, 2.2, 1.0),
             "b/1": (2.0, 1.6, 1.8, 2.2, 2.0), "b/2": (2.0, 2.0, 1.9, 2.2, 2.4)}
    for p, (w_plain, w4, w2, w_hf, w_hf4) in walls.items():
        recs.append(record("specdecode/plain", p, w_plain, metrics(plain_steps, w_plain - 0.15)))
        recs.append(record("specdecode/ngram:k=4", p, w4, metrics(ng4, w4 - 0.2, 0.01)))
        recs.append(record("specdecode/ngram:k=2", p, w2, metrics(ng2, w2 - 0.2, 0.01)))
        recs.append(record("hf/plain", p, w_hf, None))
        tokens = TOKENS if p != "b/2" else TOKENS[:3] + [7] + TOKENS[4:]
        recs.append(record("hf/prompt-lookup:k=4,max_ngram=3", p, w_hf4, None, tokens))
    return recs


PROBES = [{"kind": "probe", "model": "tiny", "role": "target", "context_tokens": 50,
           "forward_s": {"0": 0.1, "1": 0.11, "2": 0.12, "4": 0.14, "8": 0.2}}]


def probes_with(config) -> list[dict]:
    """PROBES tagged with the settings id of ``config`` (as records.jsonl holds them)."""
    return [{"settings_id": config.settings_id(), **p} for p in PROBES]


def fake_env() -> dict:
    return {"date": "2026-01-01T00:00:00+00:00", "cpu_model": "test cpu", "cpu_flags": ["avx2"], "cpu_count": 2,
            "usable_cores": 2, "memory_gib": 8.0, "torch_threads": 2, "torch_interop_threads": 2,
            "platform": "linux", "python": "3.11", "torch": "2", "transformers": "5", "specdecode": "0.1",
            "git_commit": None}


def fake_models() -> dict:
    t = {"name": "tiny", "source": "test", "sha256": "0" * 64, "parameters": 1000, "architecture": "Llama",
         "layers": 2, "vocab_size": 64, "dtype": "torch.float32", "load_seconds": 0.0}
    return {"target": t, "drafts": {}}
