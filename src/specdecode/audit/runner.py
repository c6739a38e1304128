"""The audit itself: sampled mode (the law of the first n tokens) and greedy mode (token equality).

:func:`audit_sampled` and :func:`audit_greedy` take a target module, prompts as ids, the request's
SamplingParams and a :class:`~specdecode.audit.sources.SampleSource`; they return an :class:`AuditReport`.
:func:`run_audit` is what ``specdecode audit`` runs: it loads the target (and, with ``local``, builds the
speculative engine with its drafter), encodes the prompts, picks the mode from the temperature, prints the
report and writes it.

Verdict (sampled): FAIL when any sample is an impossible output, or when any Holm-adjusted p-value (each
prompt's chi-square and the pooled one, one family) is below alpha; PASS otherwise. The power stated with
it: per prompt, the smallest TV error detected with probability ``power`` at level alpha / (prompts + 1)
(Bonferroni's level, which Holm's first step uses), see :func:`specdecode.audit.stats.detectable_tv`.
Verdict (greedy): FAIL when any prompt's output differs from plain greedy decoding at a position where the
target's top-1 minus top-2 logit is at least ``tie_margin`` (a smaller margin is a near-tie: a rounding flip
between two forwards, reported, not failed).

The modes are :mod:`~specdecode.audit.sampled_mode` and :mod:`~specdecode.audit.greedy_mode`, what they find
:mod:`~specdecode.audit.results`; this module is the command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from specdecode.audit.config import AuditError
from specdecode.audit.greedy_mode import audit_greedy
from specdecode.audit.report import print_report, write_report
from specdecode.audit.results import AuditReport, GreedyAudit, PromptAudit, machine_info  # noqa: F401 - re-exported
from specdecode.audit.sampled_mode import audit_sampled
from specdecode.audit.sources import AuditPrompt, EndpointSource, EngineSource
from specdecode.build import assemble
from specdecode.generator import SpecDecoder
from specdecode.options import SAMPLING_MODES
from specdecode.paths import check_output_dir
from specdecode.precision import load_target
from specdecode.proposers import LayerSkipProposer
from specdecode.types import SamplingParams


# --------------------------------------------------------------------------- the command


def _status(line: str) -> None:
    print(f"specdecode: {line}", file=sys.stderr, flush=True)


def run_audit(setup, say: Callable[[str], None] = _status, progress: bool = True) -> AuditReport:
    """What ``specdecode audit`` runs: check the endpoint (before any weights load), load the target here,
    build the source, encode the prompts, audit in the mode the temperature picks, print, write.

    Args:
        setup: a :class:`specdecode.audit.config.AuditSetup`.
        say: status lines (stderr). progress: tqdm bars while sampling.

    Returns:
        the AuditReport (``passed``: the verdict).

    Raises:
        AuditError: unreachable endpoint, model not served, another tokenizer, a refused request.
        SpecDecodeError / ModelLoadError: bad settings, a model that does not load.
    """
    cfg = setup.config
    if setup.output is not None:  # before any request or load: the report is what the run is for

        check_output_dir(setup.output, "--output", default=True)
    source = None
    if setup.endpoint is not None:
        source = EndpointSource(setup.endpoint, setup.model, api_key=setup.api_key, concurrency=setup.concurrency,
                                timeout=setup.timeout, prompt_format=setup.prompt_format)
        card = source.check()  # unreachable, or another model: said before any weight is read
        say(f"endpoint {source.base} serves {setup.model!r}" + (f" (specdecode, draft {card.get('draft')}, gamma "
                                                                 f"{card.get('num_speculative_tokens')})"
                                                                 if source.is_specdecode else ""))
        if source.is_specdecode and setup.sampling_mode != "auto":
            source.extra["speculative"] = {"sampling_mode": setup.sampling_mode}
    decoder, engine_source = _load(setup, say)
    if source is None:
        source = engine_source
    loaded = decoder.target
    prompts = _encode(decoder, setup.prompts)
    params = SamplingParams(**setup.sampling, eos_token_ids=loaded.eos_token_ids)
    if setup.endpoint is not None:
        _check_tokenizer(source, prompts[0], params, decoder, say)
    else:
        _choose_skip_layers(decoder, prompts, say)
    precision = decoder.precision.precision if decoder.precision is not None else "fp32"
    audit = audit_greedy if params.greedy else audit_sampled
    say(f"{audit.__name__.removeprefix('audit_')} mode: {len(prompts)} prompt(s)" +
        ("" if params.greedy else f", N = {cfg.num_samples} samples of {cfg.num_tokens} tokens each"))
    report = audit(loaded.model, prompts, params, source, cfg, tokenizer=loaded.tokenizer, forward=setup.forward,
                   progress=progress, say=say)
    report.target = f"{loaded.name} ({precision} weights)"
    if hasattr(source, "close"):
        source.close()
    print_report(report, tokenizer=loaded.tokenizer)
    if setup.output is not None:
        paths = write_report(report, setup.output, loaded.tokenizer, setup.command)
        say("wrote " + ", ".join(str(p) for p in paths))
    return report


def _load(setup, say):
    """(a SpecDecoder over the target, the in-process EngineSource or None): the target in ``setup.weights``;
    in-process, the engine with its drafter and ``batch_size`` rows."""
    say(f"loading target {setup.target!r} (the exact law is computed from it here)")
    if setup.endpoint is not None:
        loaded, choice = load_target(setup.target, setup.weights, dtype=setup.dtype, cache_dir=setup.cache_dir,
                                     status=say, forward=setup.forward)
        decoder = SpecDecoder(loaded, None)
        decoder.precision = choice
        say(f"weights {choice.reason}: give the server's precision with --weights if it runs another")
        return decoder, None
    decoder = SpecDecoder.from_pretrained(
        setup.target, setup.draft, num_speculative_tokens=setup.num_speculative_tokens, ngram_min=setup.ngram_min,
        ngram_max=setup.ngram_max, dtype=setup.dtype, cache_dir=setup.cache_dir, weights=setup.weights,
        draft_weights=setup.draft_weights, tree=setup.tree, tree_nodes=setup.tree_nodes, policy=setup.policy,
        skip_layers=setup.skip_layers, verification=setup.verification, status=say)
    engine = assemble(decoder.target, decoder.proposer, num_speculative_tokens=decoder.num_speculative_tokens,
                      policy=decoder.policy, max_batch_size=setup.batch_size, forward=setup.forward,
                      verification=setup.verification)
    name = (f"specdecode engine in-process (draft {setup.draft}, gamma {setup.num_speculative_tokens}, "
            f"{setup.sampling_mode} sampling, {setup.batch_size} rows)")
    return decoder, EngineSource(engine, name, coupled=SAMPLING_MODES[setup.sampling_mode])


def _encode(decoder, prompts) -> list[AuditPrompt]:
    out = []
    for pid, text, chat in prompts:
        chat = decoder.has_chat_template if chat is None else chat
        ids = decoder.encode(text, chat=chat)
        sent = text
        if chat:
            sent = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=False)
        out.append(AuditPrompt(pid, tuple(ids), sent))
    return out


def _check_tokenizer(source, prompt: AuditPrompt, params: SamplingParams, decoder, say) -> None:
    """One short greedy completion: the server's ids must be the local tokenizer's ids of its text.

    Raises:
        AuditError: ids outside the local vocabulary, or ids whose local text is not the server's text.
    """
    probe = source.greedy(prompt, params, 8)
    vocab = decoder.engine.vocab_size
    if probe.token_ids is None:
        say("the server returns text, not token ids: samples are mapped to the target's tokens by their text and, "
            "failing that, by re-tokenization (an outcome that maps to no known continuation counts as unmapped)")
        return
    if any(not 0 <= t < vocab for t in probe.token_ids):
        raise AuditError(f"the server returned token ids outside the vocabulary of {decoder.target.name!r} "
                         f"({vocab} tokens): it runs another tokenizer; give --target the model the server runs")
    text = decoder.decode(probe.token_ids)
    if probe.text is not None and text != probe.text:
        raise AuditError(f"the server's token ids decode here to {text!r}, but it returned {probe.text!r}: it runs "
                         f"another tokenizer than {decoder.target.name!r}; give --target the model the server runs")


def _choose_skip_layers(decoder, prompts: Sequence[AuditPrompt], say) -> None:
    """--draft layer-skip without --skip-layers: the set cached for the model, else a search on the prompts."""
    proposer = decoder.proposer
    if isinstance(proposer, LayerSkipProposer) and proposer.config.skip_layers is None:
        r = proposer.calibrate([list(p.token_ids) for p in prompts[:3]])
        if r.loses:  # slower than plain decoding here, but the audit tests the drafter's losslessness, not speed
            proposer.set_skip_layers(r.skip_layers)
            say(f"layer-skip: skipping layers {','.join(map(str, r.skip_layers))} of {r.num_layers} (measured "
                f"{r.speedup:.2f}x plain decoding: slower, used anyway, as the audit tests losslessness)")
        else:
            say(f"layer-skip: {r.line()}")
__all__ = ["AuditReport", "GreedyAudit", "PromptAudit", "audit_greedy", "audit_sampled", "machine_info", "run_audit"]
