"""``specdecode tune``: choose the drafter, gamma and draft-length policy for a workload by measuring it.

On the user's own prompts and machine, in this order (each stage stops at the time budget and says what
it skipped):

1. **costs of the target**: T_decode (one plain step) and T_verify(k) for k = 0..max_gamma, timed the
   way the benchmark times them (``bench.variants.probe_forward_times``), and plain decoding of the
   sample prompts (T_plain per token, the loop's overhead included);
2. **acceptance per drafter**: every candidate drafter (none, n-gram, suffix, layer-skip with its cached
   or searched skip set, each draft model given (same tokenizer or cross-vocabulary), its token trees,
   a trained EAGLE head when one exists for the target, and its trees) runs the sample prompts at a
   generous gamma (``max_gamma``, fixed policy); its run metrics give the per-position acceptance
   (survival), the draft lengths, T_draft per token and the per-step overhead (``bench.summary.pool_metrics``);
3. **prediction**: the cost model (``costmodel.overhead_aware_speedup_mixture`` through
   ``bench.summary.predicted_curve``) predicts the decode speedup of every drafter at every gamma
   1..max_gamma (token trees: at their own gamma, from their measured tau and per-step time);
   the ``cost-model`` policy (gamma chosen online, 0 = plain decoding) is predicted to reach the best
   fixed gamma, or plain decoding when every gamma loses;
4. **confirmation**: the best predicted candidates (``top``, distinct drafters, at their best gamma; the
   best chain drafter also with the ``cost-model`` policy) run against plain decoding on held-out
   prompts, interleaved prompt by prompt (the order rotates), ``repeats`` times, the fastest run of
   each counting (noise on a shared machine only adds time);
5. **decision**: the fastest measured candidate when it beats plain decoding by ``min_gain`` (default
   5%), else plain decoding; every step of the reasoning is a line made of measurements.

The chosen settings are written as a TOML file for ``--config`` (:mod:`specdecode.configfile`), with the
measurements in its ``[tune]`` table, and the full measurements as JSON beside it.

Speedup is decode speedup in the prediction (prefill is the same target pass either way) and wall-clock
tokens/s over plain decoding's in the confirmation (DESIGN.md's definition). Times are seconds.
"""

from specdecode.tune.config import (  # noqa: F401 - the package's interface, as specdecode.tune had it
    DRAFTER_KINDS,
    MEASURE_SHARE,
    PLAIN,
    REPETITIVE_ACCEPTANCE,
    TREE_KIND,
    TuneConfig,
    read_prompts_file,
    select_tune_prompts,
    split_prompts,
)
from specdecode.tune.decide import (  # noqa: F401
    Candidate,
    Choice,
    Confirmation,
    Prediction,
    Skipped,
    TuneResult,
    best_per_drafter,
    busy_line,
    check_output,
    choose,
    confirmation_plan,
    decision_lines,
    drafter_spec,
    predict,
    tree_speedup,
)
from specdecode.tune.report import print_report, report_rows, write_settings  # noqa: F401


def __getattr__(name: str):
    """``run_tune``, from :mod:`specdecode.tune.measure` on first use (PEP 562)."""
    if name == "run_tune":
        from specdecode.tune.measure import run_tune  # lazy: torch and the model stack, only to run a tune

        return run_tune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Candidate", "Choice", "Confirmation", "DRAFTER_KINDS", "Prediction", "Skipped", "TuneConfig",
           "TuneResult", "best_per_drafter", "choose", "confirmation_plan", "decision_lines", "predict",
           "print_report", "read_prompts_file", "report_rows", "run_tune", "split_prompts", "tree_speedup",
           "write_settings"]
