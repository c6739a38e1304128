"""The one copy of every range check that needs no model, in a module without torch.

The library's own types call these (``SamplingParams``, ``EngineConfig``, ``NgramConfig``,
``TreeDraftConfig``, ``spec.DrafterSpec``, ``policy.build_policy``,
``server.launch.check_options``), and so does the command line before it imports anything heavy,
so ``specdecode generate -k 0`` is refused at once with the library's own words. Only
:mod:`specdecode.errors` and :mod:`specdecode.options` are imported here.

An error about one setting carries its name in ``SpecDecodeError.field`` (``"top_p"``), so a
front end can name its own flag for it (``--top-p: top_p must be in (0, 1] ...``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

from specdecode.errors import InvalidSamplingParams, LayerSkipError, SpecDecodeError
from specdecode.options import (  # noqa: F401 - VERIFICATION_METHODS re-exported
    FORWARD_BACKENDS,
    POLICY_NAMES,
    VERIFICATION_METHODS,
    WEIGHT_CHOICES,
)

#: Upper bound on ``max_new_tokens`` accepted anywhere; anything larger is a typo.
MAX_NEW_TOKENS_LIMIT = 1_000_000
#: Largest gamma (``num_speculative_tokens``, a policy's ``max_tokens``) anything may choose.
MAX_SPECULATIVE_TOKENS = 64
#: Most rows one engine decodes together (KV cache slots).
MAX_BATCH_SIZE = 256
#: Largest node budget of a token tree (``--tree-nodes``) and of suffix decoding.
MAX_TREE_NODES = 64
#: Smallest request body limit a server takes, bytes.
MIN_REQUEST_BYTES = 1024


def _refuse(cls: type[SpecDecodeError], field: str | None, message: str) -> SpecDecodeError:
    """An error of ``cls`` about the setting ``field`` (None: about no single setting)."""
    err = cls(message)
    err.field = field
    return err


# --------------------------------------------------------------------------- sampling


def check_sampling(temperature, top_k, top_p, max_new_tokens, seed, *, min_p=0.0, repetition_penalty=1.0,
                   presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, allowed_token_ids=None,
                   banned_token_ids=(), min_tokens=0, stop_token_ids=(), coupled=None) -> None:
    """Range-check one request's sampling values (the rules of :class:`specdecode.types.SamplingParams`).

    Token ids (``logit_bias`` keys, allowed / banned / stop ids) are checked against the vocabulary
    by :func:`check_token_ids`, once it is known.

    Raises:
        InvalidSamplingParams: temperature outside [0, 100] (or NaN), top_k < 0, top_p outside (0, 1],
            min_p outside [0, 1], repetition_penalty outside (0, 100], presence / frequency penalty
            outside [-2, 2], a logit_bias value outside [-100, 100] or a key that is not a token id,
            an empty allowed_token_ids, min_tokens outside [0, max_new_tokens], max_new_tokens outside
            [1, MAX_NEW_TOKENS_LIMIT], a negative or non-integer seed, coupled not None / bool.
    """
    t = temperature
    if not _is_number(t) or t < 0 or t > 100:
        raise _refuse(InvalidSamplingParams, "temperature",
                      f"temperature must be a number in [0, 100] (0 = greedy), got {t!r}")
    if not _is_int(top_k) or top_k < 0:
        raise _refuse(InvalidSamplingParams, "top_k", f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    p = top_p
    if not _is_number(p) or not (0.0 < p <= 1.0):
        raise _refuse(InvalidSamplingParams, "top_p", f"top_p must be in (0, 1] (1 disables it), got {p!r}")
    if not _is_number(min_p) or not 0.0 <= min_p <= 1.0:
        raise _refuse(InvalidSamplingParams, "min_p", f"min_p must be in [0, 1] (0 disables it), got {min_p!r}")
    r = repetition_penalty
    if not _is_number(r) or not 0.0 < r <= 100.0:
        raise _refuse(InvalidSamplingParams, "repetition_penalty",
                      f"repetition_penalty must be in (0, 100] (1 disables it; > 1 discourages repeats), got {r!r}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _is_number(value) or not -2.0 <= value <= 2.0:
            raise _refuse(InvalidSamplingParams, name, f"{name} must be in [-2, 2] (0 disables it), got {value!r}")
    if logit_bias is not None:
        if not hasattr(logit_bias, "items"):
            raise _refuse(InvalidSamplingParams, "logit_bias",
                          f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
        for tok, bias in logit_bias.items():
            if not _is_int(tok) or tok < 0:
                raise _refuse(InvalidSamplingParams, "logit_bias", f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise _refuse(InvalidSamplingParams, "logit_bias",
                              f"logit_bias values must be in [-100, 100] (-100 bans the token), got {bias!r} "
                              f"for token {tok}")
    for name, ids in (("allowed_token_ids", allowed_token_ids), ("banned_token_ids", banned_token_ids),
                      ("stop_token_ids", stop_token_ids)):
        if ids is None:
            continue
        ids = list(ids)
        if any(not _is_int(i) or i < 0 for i in ids):
            raise _refuse(InvalidSamplingParams, name, f"{name} must be token ids >= 0, got {ids[:8]!r}")
        if name == "allowed_token_ids" and not ids:
            raise _refuse(InvalidSamplingParams, name, "allowed_token_ids must name at least one token (None allows all)")
    n = max_new_tokens
    if not _is_int(n) or n < 1 or n > MAX_NEW_TOKENS_LIMIT:
        raise _refuse(InvalidSamplingParams, "max_new_tokens",
                      f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS_LIMIT}], got {n!r}")
    if not _is_int(min_tokens) or not 0 <= min_tokens <= n:
        raise _refuse(InvalidSamplingParams, "min_tokens",
                      f"min_tokens must be an integer in [0, max_new_tokens = {n}], got {min_tokens!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise _refuse(InvalidSamplingParams, "seed", f"seed must be an integer in [0, 2**63) or None, got {seed!r}")
    if coupled is not None and not isinstance(coupled, bool):
        raise _refuse(InvalidSamplingParams, "coupled", f"coupled must be None (auto), True or False, got {coupled!r}")


def check_token_ids(vocab_size: int, *, logit_bias=None, allowed_token_ids=None, banned_token_ids=(),
                    stop_token_ids=()) -> None:
    """The token ids of one request's sampling values against a vocabulary of ``vocab_size`` ids (the
    rules ``sampling.RequestSampler`` applies; call :func:`check_sampling` first for the rest).

    Args:
        vocab_size: V, the width of the target's logits.
        logit_bias: token id -> bias (a bias of -100 or less bans the token), or None.
        allowed_token_ids: only these may be generated (None: all); banned_token_ids, stop_token_ids: ids.

    Raises:
        InvalidSamplingParams: an id outside [0, V) (``field``: the setting that names it), or allowed /
            banned ids and -100 biases that leave no token to generate (``field = "allowed_token_ids"``).
    """
    bias = dict(logit_bias or {})
    for name, ids in (("logit_bias", list(bias)), ("allowed_token_ids", list(allowed_token_ids or ())),
                      ("banned_token_ids", list(banned_token_ids)), ("stop_token_ids", list(stop_token_ids))):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise _refuse(InvalidSamplingParams, name,
                          f"{name} names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    gone = set(banned_token_ids) | {t for t, b in bias.items() if b <= -100.0}
    left = (vocab_size > len(gone)) if allowed_token_ids is None else any(t not in gone for t in allowed_token_ids)
    if not left:
        raise _refuse(InvalidSamplingParams, "allowed_token_ids",
                      "allowed_token_ids, banned_token_ids and logit_bias leave no token that can be generated: "
                      "allow at least one")


def _is_number(x) -> bool:
    """A real, finite-or-infinite, non-NaN number (bool excluded)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_stops(stop: str | Sequence[str] | None) -> list[str]:
    """Stop strings as a list (one string, a sequence, or None = none).

    Raises:
        InvalidSamplingParams: an empty or non-string stop.
    """
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    stops = list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise _refuse(InvalidSamplingParams, "stop", f"stop strings must be non-empty strings, got {s!r}")
    return stops


# --------------------------------------------------------------------------- engine and policy


def check_gamma(name: str, value: int, low: int = 1) -> int:
    """``value`` when it is an integer in [low, MAX_SPECULATIVE_TOKENS] (a draft length called ``name``).

    Raises:
        SpecDecodeError: otherwise (``field`` = ``name``).
    """
    if not _is_int(value) or not low <= value <= MAX_SPECULATIVE_TOKENS:
        plain = " (plain decoding is no drafter: --draft none on the command line)" if _is_int(value) and value < low == 1 else ""
        raise _refuse(SpecDecodeError, name,
                      f"{name} must be an integer in [{low}, {MAX_SPECULATIVE_TOKENS}], got {value!r}{plain}")
    return value


def check_verification(method, field: str = "verification") -> str:
    """``method`` when it is one of VERIFICATION_METHODS.

    Raises:
        SpecDecodeError: otherwise.
    """
    if method not in VERIFICATION_METHODS:
        raise _refuse(SpecDecodeError, field, f"{field} must be one of {VERIFICATION_METHODS}, got {method!r}")
    return method


def check_request_speculation(enabled, num_speculative_tokens, verification) -> None:
    """The rules of :class:`specdecode.engine.RequestSpeculation`.

    Raises:
        SpecDecodeError: enabled not a bool, gamma outside 1..64, an unknown verification method.
    """
    if not isinstance(enabled, bool):
        raise _refuse(SpecDecodeError, "enabled", f"speculative.enabled must be true or false, got {enabled!r}")
    if num_speculative_tokens is not None:
        check_gamma("num_speculative_tokens", num_speculative_tokens)
        if not enabled:
            raise _refuse(SpecDecodeError, "num_speculative_tokens",
                          "num_speculative_tokens with speculation disabled contradict each other: drop one")
    if verification is not None:
        check_verification(verification)


def check_engine(num_speculative_tokens: int = 5, max_batch_size: int = 1, max_context: int | None = None,
                 forward: str = "auto", verification: str = "auto") -> None:
    """The rules of :class:`specdecode.engine.EngineConfig` (see it for the meaning of each value).

    Raises:
        SpecDecodeError: an unknown forward or verification, gamma outside 1..64, max_context < 2,
            batch outside 1..256.
    """
    check_verification(verification)
    if forward not in FORWARD_BACKENDS:
        raise _refuse(SpecDecodeError, "forward", f"forward must be one of {FORWARD_BACKENDS}, got {forward!r}")
    check_gamma("num_speculative_tokens", num_speculative_tokens)
    if max_context is not None and (not isinstance(max_context, int) or max_context < 2):
        raise _refuse(SpecDecodeError, "max_context",
                      f"max_context must be None (the model's) or an integer >= 2, got {max_context!r}")
    if not isinstance(max_batch_size, int) or not 1 <= max_batch_size <= MAX_BATCH_SIZE:
        raise _refuse(SpecDecodeError, "max_batch_size",
                      f"max_batch_size must be an integer in [1, {MAX_BATCH_SIZE}], got {max_batch_size!r}")


def check_policy_name(name: str | None) -> str:
    """The registry key of a draft-length policy name (case and spaces ignored).

    Raises:
        SpecDecodeError: an unknown name (the message lists :data:`~specdecode.options.POLICY_NAMES`).
    """
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in POLICY_NAMES:
        raise _refuse(SpecDecodeError, "policy",
                      f"unknown draft-length policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return key


# --------------------------------------------------------------------------- drafters


def check_ngram_sizes(min_ngram: int, max_ngram: int) -> None:
    """The rule of ``proposers.ngram.NgramConfig``: 1 <= min_ngram <= max_ngram.

    Raises:
        SpecDecodeError: otherwise (``field`` = "ngram").
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise _refuse(SpecDecodeError, "ngram",
                      f"ngram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def check_tree_nodes(num_nodes: int) -> None:
    """A tree's (or suffix decoding's) node budget: an integer in [1, MAX_TREE_NODES].

    Raises:
        SpecDecodeError: otherwise (``field`` = "tree_nodes").
    """
    if not isinstance(num_nodes, int) or not 1 <= num_nodes <= MAX_TREE_NODES:
        raise _refuse(SpecDecodeError, "tree_nodes",
                      f"tree nodes must be an integer in [1, {MAX_TREE_NODES}], got {num_nodes!r}")


def parse_skip_layers(spec: str | Iterable[int] | None, num_layers: int | None = None) -> tuple[int, ...] | None:
    """``"3,5,7"`` / ``[3, 5, 7]`` -> sorted unique tuple; None / ``""`` / ``"auto"`` -> None (search).

    Raises:
        LayerSkipError: not integers, an index outside [0, num_layers), or every layer skipped.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in ("", "auto"):
            return None
        try:
            spec = [int(part) for part in text.replace(" ", "").split(",") if part]
        except ValueError as exc:
            raise LayerSkipError(f"--skip-layers takes comma-separated layer indices like 3,5,7; got {spec!r}") from exc
    layers = tuple(sorted({int(i) for i in spec}))
    if num_layers is not None:
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise LayerSkipError(f"skip layers {bad} are outside 0..{num_layers - 1} (the model has {num_layers} layers)")
        if len(layers) >= num_layers:
            raise LayerSkipError(f"cannot skip all {num_layers} layers: keep at least one")
    return layers


# --------------------------------------------------------------------------- threads


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask (``os.sched_getaffinity``: a container's or
    ``taskset``'s limit), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads, flag: str = "--threads", *, cores: int | None = None, bound: bool = True,
                  auto: str | None = None) -> None:
    """A thread count (``--threads``, a config file's ``threads``, a library config's ``threads``): None (choose
    automatically) or an integer in 1..cores. More threads than cores only wait on each other: ``--threads
    1000`` on 2 cores loaded a machine to 295 with no progress for minutes.

    Args:
        threads: the count, or None. flag: the name in the message. auto: how to ask for one thread per idle core
            (default: leave ``flag`` out).
        cores: the bound (default :func:`usable_cores`). bound: False where the threads run on another machine
            (a Ray cluster's replicas: each bounds its own count where it starts).

    Raises:
        SpecDecodeError: not a positive integer, or more than the cores (the message says how many there are).
    """
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise _refuse(SpecDecodeError, "threads", f"{flag} must be a positive integer, got {threads!r}")
    if not bound:
        return
    cores = cores or usable_cores()
    if threads > cores:
        total = os.cpu_count() or cores
        of = f" (of the machine's {total})" if total != cores else ""
        raise _refuse(SpecDecodeError, "threads",
                      f"{flag} {threads}: this process may use {cores} cores{of}, and more threads than cores "
                      f"only wait on each other; use 1..{cores}, or {auto or f'leave {flag} out'} (one thread per "
                      "idle core)")


# --------------------------------------------------------------------------- the server


def check_port(port: int) -> None:
    """Raises SpecDecodeError for a port outside 0..65535."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise SpecDecodeError(f"--port must be in 0..65535, got {port}")


def check_server_limits(max_queue: int, max_request_bytes: int, default_max_tokens: int) -> None:
    """The server's own limits (``server.launch.build_state``).

    Raises:
        SpecDecodeError: max_queue < 0, max_request_bytes < 1024, default_max_tokens < 1.
    """
    if not isinstance(max_queue, int) or max_queue < 0:
        raise SpecDecodeError(f"--max-queue must be an integer >= 0, got {max_queue!r}")
    if not isinstance(max_request_bytes, int) or max_request_bytes < MIN_REQUEST_BYTES:
        raise SpecDecodeError(f"--max-request-bytes must be an integer >= {MIN_REQUEST_BYTES}, "
                              f"got {max_request_bytes!r}")
    if not isinstance(default_max_tokens, int) or default_max_tokens < 1:
        raise SpecDecodeError(f"--default-max-tokens must be an integer >= 1, got {default_max_tokens!r}")


def check_serve_options(opts) -> None:
    """Every check of ``specdecode serve`` that needs no model but the drafter's (``server.launch.check_options``
    adds those: ``DrafterSpec.from_settings``).

    Args:
        opts: a ``server.launch.ServeOptions``, or the ``argparse.Namespace`` of ``specdecode serve``
            (the same attribute names).

    Raises:
        SpecDecodeError: a value out of range, an unknown policy / precision / forward.
    """
    check_engine(num_speculative_tokens=opts.num_speculative_tokens, max_batch_size=opts.max_batch_size,
                 forward=opts.forward, verification=getattr(opts, "verification", "auto"))
    check_policy_name(opts.policy)
    for flag, precision in (("--weights", opts.weights), ("--draft-weights", opts.draft_weights or opts.weights)):
        if precision not in WEIGHT_CHOICES:  # "auto": the library measures and picks one
            raise SpecDecodeError(f"{flag}: unknown precision {precision!r}; choose one of {WEIGHT_CHOICES}")
    if (opts.draft or "").strip().lower().partition(":")[0] == "layer-skip" and opts.forward == "hf":
        raise SpecDecodeError("--draft layer-skip drafts through the project's own Llama / Qwen2 forward; "
                              "use --forward auto or owned")
    check_server_limits(opts.max_queue, opts.max_request_bytes, opts.default_max_tokens)
    check_port(opts.port)
    api_key = getattr(opts, "api_key", None)
    if api_key is not None and not api_key.strip():  # e.g. --api-key "$UNSET": would serve with no auth at all
        raise SpecDecodeError("--api-key is empty; give the key clients must send, or leave --api-key out to "
                              "serve without authentication")
    name = getattr(opts, "served_model_name", None)
    if name is not None and not name.strip():
        raise SpecDecodeError("--served-model-name is empty; give the name clients send as 'model', or leave it "
                              "out to use the target spec")
    # the count only: replicas on a cluster run elsewhere; a local server bounds it by its cores at start
    check_threads(getattr(opts, "threads", None), bound=False)


__all__ = [
    "MAX_BATCH_SIZE", "MAX_NEW_TOKENS_LIMIT", "MAX_SPECULATIVE_TOKENS", "MAX_TREE_NODES", "MIN_REQUEST_BYTES",
    "check_engine", "check_gamma", "check_ngram_sizes", "check_policy_name", "check_port", "check_sampling",
    "check_serve_options", "check_server_limits", "check_stops", "check_token_ids", "check_tree_nodes",
    "parse_skip_layers",
]
