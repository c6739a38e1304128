"""The greedy mode of the audit: each prompt's output against plain greedy decoding, a difference at a near-tie
(top-1 minus top-2 logit below ``tie_margin``) reported, not failed."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from specdecode.audit.config import AuditConfig, AuditError
from specdecode.audit.law import STOP
from specdecode.audit.results import AuditReport, GreedyAudit, audit_settings, machine_info, source_counters
from specdecode.audit.sources import AuditPrompt, Outcome, SampleSource
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kv import make_runner
from specdecode.sampling import RequestSampler
from specdecode.types import SamplingParams


# --------------------------------------------------------------------------- greedy mode


def audit_greedy(model: torch.nn.Module, prompts: Sequence[AuditPrompt], params: SamplingParams,
                 source: SampleSource, cfg: AuditConfig, *, tokenizer=None, forward: str = "auto",
                 progress: bool = False, say: Callable[[str], None] | None = None) -> AuditReport:
    """Greedy mode: the source's greedy output of ``cfg.max_new_tokens`` tokens against plain greedy decoding
    of the target here (same engine code, no proposer), with the margin at the first divergence.

    Args: as :func:`audit_sampled` (``params``' temperature is ignored: greedy).

    Returns:
        AuditReport (mode "greedy").
    """
    t0 = time.perf_counter()
    greedy = dataclasses.replace(params, temperature=0.0, seed=None, coupled=None, max_new_tokens=cfg.max_new_tokens)
    plain = SpeculativeEngine(model, None, EngineConfig(forward=forward))
    results = []
    iterator = prompts
    if progress:
        iterator = tqdm(prompts, desc="greedy", unit="prompt", file=sys.stderr, leave=False)
    for prompt in iterator:
        want = plain.generate(list(prompt.token_ids), greedy)
        got = source.greedy(prompt, greedy, cfg.max_new_tokens)
        results.append(_compare(model, prompt, greedy, want, got, cfg, tokenizer, forward))
    report = AuditReport("greedy", source.name, "", audit_settings(greedy, cfg), results, machine=machine_info())
    bad = [r for r in results if r.status == "DIVERGES"]
    ties = [r for r in results if r.status == "near-tie"]
    report.verdict = "FAIL" if bad else "PASS"
    report.reasons = [f"{r.id}: differs at generated token {r.position} where the target's top-2 margin is "
                      f"{r.margin:.4f} logits (>= {cfg.tie_margin:g}): not a near-tie" for r in bad]
    report.reasons += [f"{r.id}: differs at generated token {r.position}, a near-tie (margin {r.margin:.2g} < "
                       f"{cfg.tie_margin:g}): a rounding flip between two forwards, not counted" for r in ties]
    if not bad and not ties:
        report.reasons.append(f"every output equals plain greedy decoding ({sum(r.num_compared for r in results)} "
                              "tokens)")
    report.extra = source_counters(source)
    report.seconds = time.perf_counter() - t0
    return report


def _with_stop(ids: Sequence[int], stopped: bool, stops: Sequence[int]) -> list[int]:
    """The ids with the stop token that ended them as STOP (whichever stop token it was; a source may also
    leave EOS out of its ids)."""
    out = [int(t) for t in ids]
    if out and out[-1] in stops:
        out[-1] = STOP
    elif stopped:
        out.append(STOP)
    return out


def _compare(model, prompt: AuditPrompt, params: SamplingParams, want, got: Outcome, cfg: AuditConfig, tokenizer,
             forward) -> GreedyAudit:
    stops = list(params.stop_ids)
    plain = _with_stop(want.token_ids, want.finish_reason == "stop", stops)
    if got.token_ids is not None:
        ids = list(got.token_ids)
    elif tokenizer is not None and got.text is not None:
        ids = tokenizer(got.text, add_special_tokens=False)["input_ids"]
    else:
        raise AuditError("the source returned neither token ids nor text")
    source = _with_stop(ids, got.stopped, stops)
    res = GreedyAudit(prompt.id, len(prompt.token_ids), len(plain))
    if tokenizer is not None:
        res.plain_text = tokenizer.decode(want.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        res.source_text = got.text if got.text is not None else tokenizer.decode(
            list(got.token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if got.token_ids is None and res.source_text == res.plain_text:
            return res  # a text-only source: the same text is the same output
    n = min(len(plain), len(source))
    i = next((j for j in range(n) if plain[j] != source[j]), None)
    if i is None:
        if len(plain) == len(source) or (len(source) > len(plain) and want.finish_reason == "length"):
            return res  # equal over the tokens compared
        i = n
    res.position = i

    def real(t):  # STOP: the first stop token stands for it
        return None if t is None else (int(stops[0]) if t == STOP and stops else t)

    res.plain_token = real(plain[i] if i < len(plain) else None)
    res.source_token = real(source[i] if i < len(source) else None)
    res.margin, res.gap = _margin(model, prompt, [real(t) for t in plain[:i]], params, res.plain_token,
                                  res.source_token, forward)
    res.status = "near-tie" if res.margin < cfg.tie_margin else "DIVERGES"
    return res


@torch.inference_mode()
def _margin(model, prompt: AuditPrompt, prefix: list[int], params: SamplingParams, a: int | None, b: int | None,
            forward: str) -> tuple[float, float | None]:
    """(top-1 minus top-2 of the target's processed logits after prompt + prefix, logit(a) - logit(b))."""
    runner = make_runner(model, forward, num_slots=1)
    logits = runner.forward(slice(0, 1), [list(prompt.token_ids) + prefix], last_only=True)[0, -1:].float()
    sampler = RequestSampler(params, prompt.token_ids, logits.shape[-1])
    sampler.commit(prefix)
    logits = sampler.process(logits, [[]])[0]
    top2 = logits.topk(2).values
    gap = None if a is None or b is None else float(logits[a] - logits[b])
    return float(top2[0] - top2[1]), gap
