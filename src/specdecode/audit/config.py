"""The audit's settings and their range checks, in a module without torch (the command line refuses a bad
value before anything heavy is imported).

Units: ``num_samples`` are completions drawn per prompt; ``num_tokens`` generated tokens per completion
whose joint law is tested; probabilities and TV distances are plain fractions in [0, 1]; the greedy
``tie_margin`` is in logits (top-1 minus top-2 of the target's logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError
from specdecode.options import DEFAULT_GAMMA, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_TREE_NODES

#: Fewest / most samples per prompt: below, no test has power; above, a typo (the law has < 1e6 cells).
MIN_SAMPLES, MAX_SAMPLES = 50, 1_000_000
#: Longest continuation whose exact joint law is enumerated (each token multiplies the cells).
MAX_TOKENS = 3
#: Largest temperature an audit accepts: OpenAI's API range is [0, 2].
MAX_TEMPERATURE = 2.0
#: Most concurrent requests to an endpoint.
MAX_CONCURRENCY = 256


class AuditError(SpecDecodeError):
    """The audit cannot run as asked (an unreachable endpoint, a model it does not serve, another
    tokenizer, an answer that is not an OpenAI completion): the message says what to do."""


@dataclass(frozen=True)
class AuditConfig:
    """How an audit samples and decides.

    Attributes:
        num_samples: N, completions drawn per prompt (sampled mode), in [50, 1e6].
        num_tokens: n, generated tokens per completion whose exact joint law is tested, 1..3.
        alpha: family-wise significance level of the verdict (Holm over the prompts and the pooled test),
            in (0, 0.5].
        power: the detection probability the stated power refers to (the smallest TV distance detected
            with this probability), in (0.5, 1).
        min_cell_mass: the law is enumerated down to outcomes of this probability; the rest of each prefix's
            mass is one "other" cell (exact, just coarser). None: ``min(1e-3, max(1e-5, 0.5 / N))``.
        null_simulations: multinomial draws of N from the exact law for the TV null spread and the power.
        seed: the audit's seed: it sets every request's own seed (distinct for every sample of every prompt,
            and across audits of other seeds) and the simulations'.
        max_new_tokens: greedy mode: tokens compared with plain greedy decoding, >= 1.
        tie_margin: greedy mode: a divergence where the target's top-1 minus top-2 logit is below this is a
            near-tie (a float rounding flip), not a failure; logits, >= 0.

    Raises:
        SpecDecodeError: on construction, a value out of range (:func:`check_audit`).
    """

    num_samples: int = 2000
    num_tokens: int = 3
    alpha: float = 0.01
    power: float = 0.8
    min_cell_mass: float | None = None
    null_simulations: int = 2000
    seed: int = 0
    max_new_tokens: int = 64
    tie_margin: float = 0.05

    def __post_init__(self) -> None:
        check_audit(self)

    @property
    def cell_mass(self) -> float:
        """The enumeration threshold in use (``min_cell_mass`` or its default for N)."""
        if self.min_cell_mass is not None:
            return self.min_cell_mass
        return min(1e-3, max(1e-5, 0.5 / self.num_samples))


@dataclass(frozen=True)
class AuditSetup:
    """Everything ``specdecode audit`` was asked (plain values: the command line builds it, the runner runs it).

    Attributes:
        target: the local model whose exact law is the reference (a spec for ``models.load_model``).
        prompts: (id, text, chat) per prompt; chat None = the tokenizer's template when it has one and
            ``chat_default``; see ``chat_default``.
        sampling: SamplingParams keywords (temperature, top_k, top_p, min_p, penalties, logit_bias, min_tokens,
            stop_token_ids, ignore_eos); temperature 0 is greedy mode.
        config: the AuditConfig.
        endpoint, model, api_key, concurrency, timeout, prompt_format: the OpenAI-compatible source (None
            endpoint: this project's engine in-process).
        sampling_mode: "standard" / "coupled" / "auto": the engine's (in-process) or our server's sampling
            mode (sent as its ``speculative.sampling_mode`` extension; other servers get nothing).
        draft .. verification, batch_size: the in-process engine's drafter and rows (``specdecode generate``'s
            flags).
        weights, dtype, draft_weights, cache_dir, forward: how the target (and draft) load and run here.
        output: a folder for report.json / report.md / the plot, or None. command: the command line, for the
            report.
    """

    target: str
    prompts: tuple[tuple[str, str, bool | None], ...]
    sampling: dict
    config: AuditConfig
    endpoint: str | None = None
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 8
    timeout: float = 120.0
    prompt_format: str = "ids"
    sampling_mode: str = "standard"
    draft: str = "ngram"
    num_speculative_tokens: int = DEFAULT_GAMMA
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    skip_layers: str | None = None
    tree: str = "none"
    tree_nodes: int = DEFAULT_TREE_NODES
    policy: str = "fixed"
    verification: str = "auto"
    batch_size: int = 32
    weights: str = "auto"
    dtype: str = "float32"
    draft_weights: str | None = None
    cache_dir: str | None = None
    forward: str = "auto"
    output: str | None = None
    command: str | None = None


def _refuse(field: str, message: str) -> SpecDecodeError:
    err = SpecDecodeError(message)
    err.field = field
    return err


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_audit(cfg: AuditConfig) -> None:
    """Range-check an AuditConfig (each error names its field, so the CLI can name the flag).

    Raises:
        SpecDecodeError: N outside [50, 1e6], n outside 1..3, alpha outside (0, 0.5], power outside
            (0.5, 1), min_cell_mass outside (0, 0.1], null_simulations outside [100, 100000], a negative
            seed, max_new_tokens < 1, a negative tie_margin.
    """
    n = cfg.num_samples
    if not _integer(n) or not MIN_SAMPLES <= n <= MAX_SAMPLES:
        raise _refuse("num_samples", f"num_samples must be an integer in [{MIN_SAMPLES}, {MAX_SAMPLES:,}] (a few "
                                     f"thousand detect TV errors of a few percent), got {n!r}")
    if not _integer(cfg.num_tokens) or not 1 <= cfg.num_tokens <= MAX_TOKENS:
        raise _refuse("num_tokens", f"num_tokens must be 1..{MAX_TOKENS} (the joint law of the first tokens is "
                                    f"enumerated exactly), got {cfg.num_tokens!r}")
    if not _number(cfg.alpha) or not 0 < cfg.alpha <= 0.5:
        raise _refuse("alpha", f"alpha must be in (0, 0.5], e.g. 0.01, got {cfg.alpha!r}")
    if not _number(cfg.power) or not 0.5 < cfg.power < 1:
        raise _refuse("power", f"power must be in (0.5, 1), e.g. 0.8, got {cfg.power!r}")
    m = cfg.min_cell_mass
    if m is not None and (not _number(m) or not 0 < m <= 0.1):
        raise _refuse("min_cell_mass", f"min_cell_mass must be in (0, 0.1], e.g. 1e-4, got {m!r}")
    if not _integer(cfg.null_simulations) or not 100 <= cfg.null_simulations <= 100_000:
        raise _refuse("null_simulations", f"null_simulations must be an integer in [100, 100000], got "
                                          f"{cfg.null_simulations!r}")
    if not _integer(cfg.seed) or cfg.seed < 0:
        raise _refuse("seed", f"seed must be an integer >= 0, got {cfg.seed!r}")
    if not _integer(cfg.max_new_tokens) or not 1 <= cfg.max_new_tokens <= 100_000:
        raise _refuse("max_new_tokens", f"max_new_tokens must be an integer in [1, 100000], got "
                                        f"{cfg.max_new_tokens!r}")
    if not _number(cfg.tie_margin) or cfg.tie_margin < 0:
        raise _refuse("tie_margin", f"tie_margin must be a number of logits >= 0, got {cfg.tie_margin!r}")


def check_temperature(temperature) -> None:
    """An audit's temperature: 0 (greedy mode) or in (0, 2] (sampled mode).

    Raises:
        SpecDecodeError: anything else (field ``temperature``).
    """
    if not _number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise _refuse("temperature", f"temperature must be 0 (greedy mode: exact equality) or in (0, "
                                     f"{MAX_TEMPERATURE:g}] (sampled mode: the distribution), got {temperature!r}")


def check_concurrency(concurrency) -> None:
    """Concurrent requests to an endpoint, 1..256.

    Raises:
        SpecDecodeError: out of range (field ``concurrency``).
    """
    if not _integer(concurrency) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise _refuse("concurrency", f"concurrency must be an integer in [1, {MAX_CONCURRENCY}], got {concurrency!r}")


__all__ = ["AuditConfig", "AuditError", "AuditSetup", "MAX_SAMPLES", "MAX_TOKENS", "MIN_SAMPLES", "check_audit",
           "check_concurrency", "check_temperature"]
