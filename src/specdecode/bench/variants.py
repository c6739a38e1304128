"""The columns of the benchmark matrix: the drafter specs to run (``--methods``, expanded over γ), our engine's
and the Hugging Face peer's timed runners, and the probe of target forward times T_verify(k)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.bench.config import BenchConfig
from specdecode.build import assemble
from specdecode.proposers import PROPOSERS
from specdecode.proposers.factory import other_tokenizer, takes_draft_model
from specdecode.spec import MODEL_KINDS, DrafterSpec
from specdecode.types import SamplingParams, SpecDecodeError
from specdecode.kv import make_runner

#: Timed forwards per k in the cost probe (the least counts).
PROBE_REPS = 5


# --------------------------------------------------------------------------- methods (drafter specs)


def registered_methods() -> list[str]:
    """Every proposer the project registers (``specdecode.proposers.PROPOSERS``), in registration order."""
    return list(PROPOSERS)


def needs_draft_model(name: str) -> bool:
    """True when the proposer registered as ``name`` drafts with a draft model (its factory takes ``model``)."""
    return takes_draft_model(name)

# --------------------------------------------------------------------------- variants


@dataclass
class RunOutput:
    """One timed generation: new token ids, wall seconds around the call, and our RunMetrics (None for HF)."""

    token_ids: list[int]
    wall_s: float
    finish_reason: str
    metrics: dict | None = None
    engine_stats: dict | None = None  # an external engine's own figures (llama-server's "timings"), recorded as is


@dataclass
class Variant:
    """One column of the matrix: how to run a prompt, and how to label it.

    Attributes:
        key: unique id, ``specdecode/plain``, ``specdecode/ngram:k=4``, ``hf/assisted:k=4,model=...``.
        engine: "specdecode" or "hf".
        method: "plain", a proposer name, or the HF peer's method ("assisted", "prompt-lookup").
        gamma: draft length (0 for plain).
        family: method spec without gamma (groups a gamma sweep), "plain" for baselines.
        peer_of: for HF variants, the key of our variant they mirror.
        draft: draft model spec, when the method uses one.
        run: (prompt ids, seed, max_new_tokens override or None) -> RunOutput.
    """

    key: str
    engine: str
    method: str
    gamma: int
    family: str
    run: Callable[..., RunOutput] = field(repr=False)
    peer_of: str | None = None
    draft: str | None = None

    def info(self) -> dict:
        return {"key": self.key, "engine": self.engine, "method": self.method, "gamma": self.gamma,
                "family": self.family, "peer_of": self.peer_of, "draft": self.draft}


def engine_runner(target, proposer, gamma: int, max_new_tokens: int, temperature: float, eos: tuple[int, ...],
                  max_context: int, verification: str = "auto", *, policy: str = "auto",
                  new_proposer: Callable[[], object] | None = None):
    """A timed run of our engine on one target: ``run(prompt ids, seed, max_new_tokens or None) -> RunOutput``.

    Args:
        target: the target's LoadedModel. proposer: a proposer, or None for plain decoding.
        gamma: draft length (``num_speculative_tokens``; the starting gamma of an adaptive ``policy``).
        max_new_tokens, temperature, eos: the sampling of every run (greedy at temperature 0).
        max_context: positions per row of the engine's cache.
        verification: ``EngineConfig.verification``.
        policy: the draft-length policy by name (``policy.build_policy``), kept across runs as in ``generate``.
        new_proposer: a zero-argument factory of proposers: each run then drafts with a fresh one (bound
            before the timing starts), so no run sees what an earlier one left in a proposer's memory (the
            suffix tree of earlier outputs: a repeat of the same prompt would find its own answer there).

    Wall seconds are those of ``engine.generate`` alone. The engine is ``run.engine``.
    """
    if new_proposer is not None:
        proposer = new_proposer()
    engine = assemble(target, proposer, num_speculative_tokens=max(1, gamma), policy=policy,
                      verification=verification, max_context=max_context)

    def run(ids: list[int], seed: int, limit: int | None = None) -> RunOutput:
        if new_proposer is not None and engine.rows == []:
            engine.proposer.release()
            engine.proposer = new_proposer()
            engine.proposer.bind(engine.runner, engine.runner.num_slots)
        params = SamplingParams(temperature=temperature, max_new_tokens=limit or max_new_tokens, seed=seed,
                                eos_token_ids=eos)
        start = time.perf_counter()
        out = engine.generate(ids, params)
        wall = time.perf_counter() - start
        return RunOutput(list(out.token_ids), wall, out.finish_reason, out.metrics.to_dict())

    run.engine = engine
    return run


def peer_runner(target, method: str, gamma: int, draft, max_ngram: int, max_new_tokens: int,
                 temperature: float, eos: tuple[int, ...]):
    from specdecode.bench.peer import hf_generate  # lazy: transformers' generation stack

    uag = draft is not None and other_tokenizer(target, draft)  # universal assisted generation
    toks = {"tokenizer": target.tokenizer, "assistant_tokenizer": draft.tokenizer} if uag else {}

    def run(ids: list[int], seed: int, limit: int | None = None) -> RunOutput:
        res = hf_generate(target.model, ids, max_new_tokens=limit or max_new_tokens, temperature=temperature,
                          seed=seed, eos_token_ids=eos, method=method, gamma=gamma,
                          draft=draft.model if draft is not None else None, max_ngram=max_ngram, **toks)
        return RunOutput(res.token_ids, res.wall_s, res.finish_reason, None)

    return run


def expand_methods(config: BenchConfig) -> list[DrafterSpec]:
    """Drafter specs to run: given or all registered, each at its gamma and at every sweep gamma.

    Methods that take a draft model get ``model=--draft`` in their spec unless they name one.

    Raises:
        SpecDecodeError: naming ``--methods``: a malformed spec, an unknown proposer name or option, a model kind
            with no draft model (``model=`` or ``--draft``), an eagle head path without a checkpoint.
    """
    names = config.methods or tuple(m for m in registered_methods()  # cross-vocab: what draft-model becomes
                                    if (not needs_draft_model(m) or config.draft) and m != "cross-vocab")
    try:
        specs = [DrafterSpec.parse(m, bare_model=False) for m in names]
    except SpecDecodeError as exc:
        raise SpecDecodeError(f"--methods: {exc}") from None
    known = registered_methods()
    out: list[DrafterSpec] = []
    for spec in specs:
        if spec.kind not in known:
            raise SpecDecodeError(f"--methods: unknown method {spec.kind!r}; registered proposers: {', '.join(known)}")
        base = spec.with_gamma(spec.num_speculative_tokens or config.gamma)
        if needs_draft_model(spec.kind) and spec.model is None and config.draft:
            # name the draft in the spec: records of another --draft must never be resumed as this one's
            base = dataclasses.replace(base, model=config.draft)
        try:
            base.check()  # before any load: a model kind names its draft (here or with --draft), a head exists
        except SpecDecodeError as exc:
            raise SpecDecodeError(f"--methods: {exc}" + (" (or give --draft MODEL)" if spec.kind in MODEL_KINDS
                                                          else "")) from None
        for g in (base.num_speculative_tokens, *config.gammas):
            s = base.with_gamma(g)
            if s not in out:
                out.append(s)
    return out


def main_gamma_of(specs: Sequence[DrafterSpec]) -> dict[str, int]:
    """Per method family, the gamma of its leaderboard row: the first of the family in ``expand_methods``
    order, i.e. the spec's own k, else ``--gamma`` (sweep gammas come after it)."""
    out: dict[str, int] = {}
    for spec in specs:
        out.setdefault(spec.family, spec.num_speculative_tokens)
    return out


# --------------------------------------------------------------------------- cost probe


@torch.inference_mode()
def probe_forward_times(model: torch.nn.Module, context: list[int], ks: Iterable[int], reps: int = 3) -> dict[int, float]:
    """Least seconds (over ``reps``) of one cached forward over k + 1 new tokens after ``context``, for each k.

    The minimum, not the median: on a shared machine noise only ever adds time.

    This is T_verify(k) of the target (k = 0: one decoding step, T_decode(1)) or the cost of
    one draft-model step; the cache is cut back to ``context`` after every timed forward.

    Args:
        model: a causal LM.
        context: [L] token ids already in the cache when timing starts.
        ks: draft lengths to time.
        reps: timed repetitions per k (after one untimed warm-up pass).
    """

    runner = make_runner(model).row(0)
    runner.forward(context, last_only=True)
    base = len(context)
    ks = sorted(set(ks))
    samples: dict[int, list[float]] = {k: [] for k in ks}
    filler = context[-1]
    for rep in range(reps + 1):
        for k in ks:
            start = time.perf_counter()
            runner.forward([filler] * (k + 1))
            elapsed = time.perf_counter() - start
            runner.rollback(base)
            if rep:  # rep 0 warms up
                samples[k].append(elapsed)
    return {k: min(v) for k, v in samples.items()}
