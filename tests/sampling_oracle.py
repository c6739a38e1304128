"""An independent oracle of the sampling surface: the exact law of plain decoding with a request's processing.

``processed_joint`` gives the exact probability of every ``n``-token continuation of a prompt under plain
decoding with the request's whole processing applied at each step. The processing is re-implemented here
from the rules alone, in float64 numpy, without ``specdecode.sampling`` (so a shared mistake cannot hide):

1. masks: tokens outside ``allowed_token_ids``, ``banned_token_ids``, and the stop tokens (EOS unless
   ``ignore_eos``, ``stop_token_ids``) while fewer than ``min_tokens`` tokens were generated, unless the
   other masks leave nothing else;
2. ``logit_bias`` added (a bias of -100 bans the token);
3. repetition penalty on every token of prompt + output so far (positive logits divided, negative
   multiplied), then frequency (per occurrence) and presence (once) penalties on output tokens only;
4. temperature (0: one-hot on the argmax);
5. min_p relative to the most likely token's probability, then top-k (ties at the k-th value kept),
   then top-p (a token stays while the mass of the strictly more likely tokens is below top_p).

Generation stops after a stop token: outcomes are the first ``n`` tokens, padded with the id V when the
request stopped earlier, indexed by :func:`outcome_index` in ``(V + 1) ** n``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch


def process(raw: np.ndarray, prompt: Sequence[int], output: Sequence[int], params) -> np.ndarray:
    """[V] raw logits -> [V] float64 probabilities of the next token after ``prompt + output``."""
    v = raw.shape[-1]
    x = raw.astype(np.float64).copy()
    if params.allowed_token_ids is not None:
        keep = np.zeros(v, dtype=bool)
        keep[list(params.allowed_token_ids)] = True
        x[~keep] = -np.inf
    x[list(params.banned_token_ids)] = -np.inf
    x[[t for t, b in (params.logit_bias or {}).items() if b <= -100]] = -np.inf  # a ban is a mask
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(params.eos_token_ids))
    if len(output) < params.min_tokens:
        masked = x.copy()
        masked[sorted(stops)] = -np.inf
        if np.isfinite(masked).any():  # min_tokens yields when the other masks leave only stop tokens
            x = masked
    for tok, b in (params.logit_bias or {}).items():
        if b > -100:
            x[tok] += b
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        for tok in set(prompt) | set(output):
            x[tok] = x[tok] / r if x[tok] > 0 else x[tok] * r
    counts = Counter(output)
    for tok, c in counts.items():
        x[tok] -= params.frequency_penalty * c + params.presence_penalty
    if params.temperature == 0.0:
        out = np.zeros(v)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.min_p > 0.0:
        p = np.where(p < params.min_p * p.max(), 0.0, p)
        p /= p.sum()
    if 0 < params.top_k < v:
        kth = np.sort(p)[::-1][params.top_k - 1]
        p = np.where(p < kth, 0.0, p)
        p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        drop = np.zeros(v, dtype=bool)
        drop[order[before >= params.top_p]] = True
        p = np.where(drop, 0.0, p)
        p /= p.sum()
    return p


@torch.inference_mode()
def _raw_logits(model, prompt: list[int], n: int) -> np.ndarray:
    """[V ** (n - 1), n, V] float64 raw logits of the model's own forward (no cache): row r is the head
    ``itertools.product(range(V), repeat=n - 1)[r]``, position j scores the token after prompt + head[:j]."""
    v = model.config.vocab_size
    heads = torch.tensor(list(itertools.product(range(v), repeat=n - 1)), dtype=torch.int64).reshape(-1, n - 1)
    ids = torch.cat([torch.tensor([prompt]).expand(len(heads), -1), heads], dim=1)
    out = [model(input_ids=chunk).logits.double()[:, len(prompt) - 1 :] for chunk in ids.split(2048)]
    return torch.cat(out).numpy()


def processed_law(model, prompt: Sequence[int], params, n: int, key=None) -> dict:
    """The exact law of ``key(first n tokens)`` under plain decoding of ``prompt`` with ``params``: every
    prefix is expanded with its processed next-token distribution until n tokens or a stop token.

    Args:
        key: sequence (tuple of ids, shorter when it stopped) -> hashable; default the tuple itself.

    Returns:
        {key: probability}.
    """
    prompt = [int(t) for t in prompt]
    v = model.config.vocab_size
    raw = _raw_logits(model, prompt, n)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(params.eos_token_ids))
    key = key or (lambda seq: seq)
    law: dict = {}
    stack = [((), 1.0)]
    while stack:
        prefix, pr = stack.pop()
        if len(prefix) == n or (prefix and prefix[-1] in stops):
            k = key(prefix)
            law[k] = law.get(k, 0.0) + pr
            continue
        row = int(np.ravel_multi_index(prefix + (0,) * (n - 1 - len(prefix)), (v,) * (n - 1))) if n > 1 else 0
        probs = process(raw[row, len(prefix)], prompt, prefix, params)
        stack.extend((prefix + (tok,), pr * float(probs[tok])) for tok in np.flatnonzero(probs))
    return law


def processed_joint(model, prompt: Sequence[int], params, n: int) -> np.ndarray:
    """The exact law of the first ``n`` tokens of plain decoding of ``prompt`` with ``params``.

    Returns:
        [(V + 1) ** n] float64, indexed by :func:`outcome_index` (id V pads a sequence that stopped).
    """
    v = model.config.vocab_size
    exact = np.zeros((v + 1) ** n)
    for seq, pr in processed_law(model, prompt, params, n).items():
        exact[outcome_index(seq, n, v)] += pr
    return exact


def outcome_index(tokens: Sequence[int], n: int, vocab: int, stops=()) -> int:
    """The outcome of a generated sequence: its first ``n`` tokens, cut after the first stop token and
    padded with ``vocab``, as an index into ``(vocab + 1) ** n``."""
    seq = []
    for tok in list(tokens)[:n]:
        seq.append(int(tok))
        if tok in stops:
            break
    seq += [vocab] * (n - len(seq))
    return int(np.ravel_multi_index(seq, (vocab + 1,) * n))
