"""What is measured of each candidate precision: its quality against float32 (teacher-forced next-token
agreement and perplexity, and the gate on them), its exactness (batch invariance) and the cost of a decoding
and a verification step."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.data import SharedDataMissing, load_prompts


#: Next-token argmax agreement with float32 a precision needs to keep the model.
MIN_ARGMAX_AGREEMENT = 0.97
#: Largest relative perplexity change against float32 (0.01 = 1%).
MAX_PERPLEXITY_CHANGE = 0.01


@dataclass(frozen=True)
class QualityReport:
    """What a precision does to the model, teacher-forced against float32.

    Attributes:
        precision: "fp32", "bf16", "int8" or "int4".
        argmax_agreement: fraction of positions whose next-token argmax equals float32's, in [0, 1].
        nll: mean negative log-likelihood of the text's tokens, nats/token.
        perplexity_change: perplexity / float32's perplexity - 1 (+0.055 = 5.5% higher).
        positions: scored positions.
    """

    precision: str
    argmax_agreement: float
    nll: float
    perplexity_change: float
    positions: int


def quality_gate(report: QualityReport) -> tuple[bool, str]:
    """(passes, one line of figures): agreement >= MIN_ARGMAX_AGREEMENT and |perplexity change| <= MAX.

    Both figures are compared as they are reported, in percent to one decimal (96.97% is 97.0%, and
    passes): on a few thousand positions the measurement's own standard error is about 0.3%, so a
    finer comparison would decide on noise.
    """
    agreement = round(100 * report.argmax_agreement, 1)
    change = round(100 * report.perplexity_change, 1)
    ok = agreement >= round(100 * MIN_ARGMAX_AGREEMENT, 1) and abs(change) <= round(100 * MAX_PERPLEXITY_CHANGE, 1)
    line = (f"next-token agreement with float32 {100 * report.argmax_agreement:.1f}% (needs >= "
            f"{100 * MIN_ARGMAX_AGREEMENT:.0f}%), perplexity {100 * report.perplexity_change:+.1f}% "
            f"(needs within {100 * MAX_PERPLEXITY_CHANGE:.0f}%)")
    return ok, line


#: Quality figures of the offline catalog's models, measured with ``scripts/bench/precision_quality.py``
#: (26 Spec-Bench prompts, 2 per category, chat template, up to 512 tokens each, teacher-forced,
#: float32 reference; docs/results/precision/), so a first load measures only this machine.
CATALOG_QUALITY: dict[str, dict[str, QualityReport]] = {
    "smollm2-135m": {
        "bf16": QualityReport("bf16", 0.96975, 3.48981, -0.00448, 3768),
        # int8 / int4 with 8-bit activations per row (the kernels of issue 27): docs/results/kernels/quality_*
        "int8": QualityReport("int8", 0.95621, 3.48435, -0.00990, 3768),
        "int4": QualityReport("int4", 0.97505, 3.49498, 0.00068, 3768),
    },
    "qwen2.5-coder-0.5b": {
        "bf16": QualityReport("bf16", 0.98485, 4.20118, 0.00044, 3696),
        # int4 with 8-bit activations, 13 prompts (docs/results/kernels/); int8 not measured with them yet
        "int4": QualityReport("int4", 0.98390, 4.33706, 0.00267, 1801),
    },
    "qwen2.5-coder-1.5b": {
        "bf16": QualityReport("bf16", 0.98593, 3.49068, -0.00209, 3696),
        # int4 (the Q4_K_M file's blocks) with 8-bit activations per row, a scale per 256 for the K-quants
        # as llama.cpp runs the file (docs/results/kernels/quality_qwen2.5-coder-1.5b.md: a scale per 32
        # would give 98.7% / +0.6%); int8 not measured with them yet
        "int4": QualityReport("int4", 0.96104, 3.53341, 0.04147, 3696),
    },
}


def quality_texts(tokenizer, per_category: int = 2, max_tokens: int = 512) -> list[list[int]]:
    """Token ids of the Spec-Bench prompts (``per_category`` of each), chat template applied, at most
    ``max_tokens`` each; the first HumanEval problems when ../shared/data is missing."""
    try:
        prompts = load_prompts("spec-bench")
    except SharedDataMissing:
        prompts = load_prompts(f"humaneval:{13 * per_category}")
    texts, seen = [], {}
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 1 < limit < max_tokens:
        max_tokens = limit
    for p in prompts:
        if seen.get(p.category, 0) >= per_category:
            continue
        seen[p.category] = seen.get(p.category, 0) + 1
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = p.turns[0]
        texts.append(tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens])
    return texts


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, texts: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], float, int]:
    """Per text the next-token argmax [n - 1] int64, plus the summed NLL (nats) and the positions scored.

    Runs the owned forward where it applies, with its fast (prefill) numerics: the batch-invariant
    ones differ from them only in rounding, which moves agreement by near-ties, not the model.
    """
    # lazy: specdecode.kv pulls in transformers (start-up time)
    from specdecode.kv import make_runner

    runner = make_runner(model, batch_invariant=False).row(0)
    argmaxes, nll, n = [], 0.0, 0
    for ids in texts:
        runner.reset()
        logits = runner.forward(list(ids)).float()[:-1]
        logp = torch.log_softmax(logits, -1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        n += len(ids) - 1
        argmaxes.append(logits.argmax(-1))
    runner.reset()
    return argmaxes, nll, n


def measure_quality(reference: torch.nn.Module, candidate: torch.nn.Module, precision: str,
                    texts: Sequence[Sequence[int]],
                    reference_scores: tuple[list[torch.Tensor], float, int] | None = None) -> QualityReport:
    """Teacher-force ``texts`` through a float32 ``reference`` and a ``candidate`` (the same model in
    ``precision``); compare next-token argmax and perplexity.

    Args:
        reference_scores: :func:`teacher_forced` of the reference, when already computed.
    """
    ref_argmax, ref_nll, n = reference_scores or teacher_forced(reference, texts)
    argmax, nll, _ = teacher_forced(candidate, texts)
    agree = sum(int((a == b).sum()) for a, b in zip(argmax, ref_argmax))
    return QualityReport(precision, agree / max(n, 1), nll / max(n, 1),
                         math.exp((nll - ref_nll) / max(n, 1)) - 1.0, n)


@dataclass(frozen=True)
class ExactnessReport:
    """Whether a token's logits are bitwise equal verified alone or among others (the contract).

    Attributes:
        exact: every comparison equal, bit for bit.
        detail: the first difference ("9 tokens in one forward: row 3 differs by 0.44") or what was checked.
        row_kernel: the product kernel the batch-invariant forward uses (``kernels.row_product``),
            None for int8 or the Hugging Face forward.
    """

    exact: bool
    detail: str
    row_kernel: str | None = None


@torch.inference_mode()
def check_batch_invariance(model: torch.nn.Module, counts: Sequence[int] = (2, 5, 9, 17),
                           context: int = 48, seed: int = 0, forward: str = "auto") -> ExactnessReport:
    """Verify the batch-invariance contract on ``model`` as loaded, on this machine.

    After a prefill of ``context`` random tokens, for each c in ``counts``: the logits of c tokens fed
    in one forward equal those of the same tokens fed one by one, bitwise; and two rows verified
    together equal each row verified alone (the batch case).
    """
    # lazy: specdecode.kv pulls in transformers (start-up time)
    from specdecode.kv import make_runner

    runner = make_runner(model, forward, num_slots=2)
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(2)]
    feeds = [torch.randint(0, vocab, (max(counts),), generator=gen).tolist() for _ in range(2)]
    kernel = getattr(runner, "row_kernel", None)
    try:
        for slot in range(2):
            runner.forward(slice(slot, slot + 1), [prompts[slot]], last_only=True)
        base = [runner.length(0), runner.length(1)]

        def reset() -> None:
            for slot in range(2):
                runner.rollback(slot, base[slot])

        alone = []
        for t in feeds[0]:
            alone.append(runner.forward(slice(0, 1), [[t]])[0, 0])
        alone = torch.stack(alone)
        reset()
        for c in counts:
            together = runner.forward(slice(0, 1), [feeds[0][:c]])[0]
            reset()
            diff = (together - alone[:c]).abs().amax(-1)
            if bool((diff != 0).any()):
                row = int((diff != 0).nonzero()[0])
                return ExactnessReport(False, f"{c} tokens in one forward: token {row} differs from the same token "
                                              f"fed alone by {float(diff[row]):.3g} in a logit", kernel)
        c = counts[len(counts) // 2]
        both = runner.forward(slice(0, 2), [feeds[0][:c], feeds[1][:c]])
        reset()
        second = runner.forward(slice(1, 2), [feeds[1][:c]])[0]
        reset()
        for row, single in ((0, alone[:c]), (1, second)):
            d = float((both[row, :c] - single).abs().max())
            if d != 0:
                return ExactnessReport(False, f"two rows of {c} tokens in one forward: row {row} differs from "
                                              f"the row alone by {d:.3g} in a logit", kernel)
    finally:
        runner.release()
    return ExactnessReport(True, f"{', '.join(map(str, counts))} tokens and 2 rows x {c}: bitwise equal", kernel)


@torch.inference_mode()
def measure_step(model: torch.nn.Module, context: int = 256, repeats: int = 7, verify_rows: int = 6,
                 seed: int = 0, forward: str = "auto") -> tuple[float, float]:
    """(T_decode, T_verify) in seconds: the fastest of ``repeats`` timings of a one-token decoding step and
    of a ``verify_rows``-token verification forward, after ``context`` cached tokens."""
    # lazy: specdecode.kv pulls in transformers (start-up time)
    from specdecode.kv import make_runner

    runner = make_runner(model, forward)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.vocab_size, (context + verify_rows,), generator=gen).tolist()
    row = runner.row(0)
    try:
        row.forward(ids[:context], last_only=True)
        times = {1: [], verify_rows: []}
        for _ in range(repeats + 1):  # the first round warms up
            for k in times:
                t0 = time.perf_counter()
                row.forward(ids[context : context + k])
                times[k].append(time.perf_counter() - t0)
                row.rollback(context)
        return min(times[1][1:]), min(times[verify_rows][1:])  # the fastest: a shared machine only adds time
    finally:
        row.reset()
