"""The target's forward with a subset of its decoder layers (:class:`SkipForward`), and the proxy that scores a
skip set on it: teacher-forced agreement with the full model, and a timing model of draft and verify steps."""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Iterable, Sequence

import torch

from transformers import DynamicCache

from specdecode.costmodel import expected_tokens_iid
from specdecode.kv import make_runner
from specdecode.proposers.layer_skip import KNOWN_FAMILIES, LayerSkipError, decoder_layers


class SkipForward:
    """The target's forward with a subset of decoder layers, on a Hugging Face cache or none.

    Calls the model's own modules (embedding, decoder layers, final norm, LM head),
    so weights are shared and the result with nothing skipped equals the model's
    forward (tested).

    Args:
        model: a Llama / Qwen2 ``*ForCausalLM`` in eval mode.

    Raises:
        LayerSkipError: the layout is not found, or (for an unknown family) the
            forward with nothing skipped does not reproduce the model's logits.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        self.inner = model.model
        self.lm_head = model.get_output_embeddings()
        params = inspect.signature(self.layers[0].forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.num_layers = len(self.layers)
        if getattr(model.config, "model_type", None) not in KNOWN_FAMILIES:
            self._self_check()

    def forward(self, ids: torch.Tensor, start: int, kept: Sequence[int], cache=None,
                last_only: bool = False, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``ids`` through the kept layers.

        Args:
            ids: [n] int64 tokens at positions start..start+n-1.
            start: position of the first token (= tokens already in ``cache``'s kept layers).
            kept: indices of the layers to run, ascending.
            cache: a Hugging Face ``Cache`` whose kept layers hold ``start`` tokens (they gain n),
                or None (no cache: ``start`` must be 0).
            last_only: LM head for the last position only.
            positions, mask: override the positions ([n] int64) and the causal mask
                ([1, 1, n, start + n] additive, model dtype) for queries that are not a plain
                continuation (the search scores many one-token drafts in one pass).

        Returns:
            [n, V] float32 logits ([1, V] with ``last_only``).
        """
        n = ids.numel()
        hidden = self.inner.embed_tokens(ids.reshape(1, n))
        positions = (torch.arange(start, start + n) if positions is None else positions).reshape(1, n)
        rope = self.inner.rotary_emb(hidden, positions)
        if mask is None and n > 1:
            mask = _causal_mask(n, start, hidden.dtype)
        extra = {self._cache_kwarg: cache, "use_cache": cache is not None}
        for i in kept:
            hidden = self.layers[i](hidden, attention_mask=mask, position_embeddings=rope,
                                    position_ids=positions, **extra)
            if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                hidden = hidden[0]
        if last_only:
            hidden = hidden[:, -1:]
        return self.lm_head(self.inner.norm(hidden))[0].float()

    def _self_check(self) -> None:
        ids = torch.tensor([1, 2, 3, 4]) % max(2, self.lm_head.weight.shape[0])
        with torch.inference_mode():
            ours = self.forward(ids, 0, range(self.num_layers))
            theirs = self.model(input_ids=ids.reshape(1, -1), use_cache=False).logits[0].float()
        if not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3):
            kind = getattr(self.model.config, "model_type", type(self.model).__name__)
            raise LayerSkipError(
                f"layer-skip drafting supports {KNOWN_FAMILIES}; the {kind!r} forward is not embed -> layers -> norm "
                f"-> head (a layer-by-layer run does not reproduce its logits). Use another proposer"
            )


def _causal_mask(n: int, start: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, start + n] additive mask: query i sees keys 0..start+i."""
    mask = torch.full((n, start + n), float("-inf"), dtype=dtype).triu(start + 1)
    return mask.reshape(1, 1, n, start + n)


def remove_last(cache, layers: Iterable[int], count: int) -> None:
    """Drop the last ``count`` entries of the given layers of a Hugging Face ``DynamicCache``."""
    if count > 0:
        for i in layers:
            cache.layers[i].crop(-count)


class _HFPrefix:
    """A context prefilled once through the Hugging Face forward, on a ``DynamicCache`` (the search's
    proxy scoring adds many one-token drafts with a custom mask, then removes them)."""

    def __init__(self, model: torch.nn.Module, ids: list[int]) -> None:
        self.cache = DynamicCache(config=model.config)
        kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model(input_ids=torch.tensor([ids]), use_cache=True, **{kwarg: self.cache})
        self.logits = out.logits[0].float()
        self.num_cached = len(ids)


class ProxyScorer:
    """First-draft-token agreement of a skip set with the full model, and the predicted speedup.

    For every scored position j of a context, the skipped model drafts from token
    j on top of the full model's keys / values of tokens < j, exactly as
    :class:`~specdecode.proposers.layer_skip.LayerSkipProposer` drafts its first
    token in decoding. All positions are scored in one pass of the kept layers:
    query i (token x_j at position j) sees cache entries 0..j-1 and itself.
    """

    def __init__(self, skip: SkipForward, contexts: list[list[int]], prompt_lengths: list[int], max_gamma: int) -> None:
        self.skip = skip
        self.max_gamma = max_gamma
        self.items = []
        with torch.inference_mode():
            for ctx, n_prompt in zip(contexts, prompt_lengths):
                runner = _HFPrefix(skip.model, ctx)
                full_argmax = runner.logits.argmax(-1)  # [P]
                rows = torch.arange(max(1, n_prompt - 32), len(ctx) - 1)  # the generated text and a bit before
                p, n = len(ctx), len(rows)
                sees_prefix = torch.arange(p)[None, :] < rows[:, None]  # [n, P]: query i sees tokens < j_i
                prefix = torch.zeros(n, p, dtype=skip.model.dtype).masked_fill(~sees_prefix, float("-inf"))
                own = torch.full((n, n), float("-inf"), dtype=skip.model.dtype).fill_diagonal_(0.0)  # and itself
                mask = torch.cat([prefix, own], dim=1)
                self.items.append((runner, torch.tensor(ctx)[rows], rows, mask[None, None], full_argmax[rows]))
        self.t_draft, self.t_verify = _time_model(skip, contexts[0], max_gamma)

    def acceptance(self, kept: list[int]) -> float:
        hits = total = 0
        with torch.inference_mode():
            for runner, ids, rows, mask, target in self.items:
                p = runner.num_cached
                pred = self.skip.forward(ids, p, kept, runner.cache, positions=rows, mask=mask).argmax(-1)
                remove_last(runner.cache, kept, len(rows))
                hits += int((pred == target).sum())
                total += target.numel()
        return hits / max(1, total)

    def score(self, skip_layers: tuple[int, ...]) -> dict:
        kept = [i for i in range(self.skip.num_layers) if i not in set(skip_layers)]
        acc = min(self.acceptance(kept), 0.999)
        t_d = self.t_draft(len(kept))
        best_gamma, best = 1, 0.0
        for g in range(1, self.max_gamma + 1):
            expected = expected_tokens_iid(acc, g)
            speedup = expected / (g * t_d + self.t_verify[g]) * self.t_verify[0]
            if speedup > best:
                best_gamma, best = g, speedup
        return {"skip_layers": list(skip_layers), "acceptance": acc, "gamma": best_gamma,
                "predicted_speedup": best, "tokens_per_s": None}


def _time_model(skip: SkipForward, context: list[int], max_gamma: int, reps: int = 5):
    """Measure, on the forward the engine uses, T_draft(kept layers) = a + b * kept and T_verify(k), k = 0..max_gamma."""
    runner = make_runner(skip.model).row(0)
    with torch.inference_mode():
        runner.forward(context[:-1])
        n = runner.num_cached
        tok = context[-1:]

        def draft_time(kept: list[int]) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                if getattr(runner.runner, "skips_layers", False):
                    runner.forward_skipping(tok, n, kept)
                else:
                    skip.forward(torch.tensor(tok), 0, kept)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        def verify_time(k: int) -> float:
            times = []
            for _ in range(max(3, reps // 2)):
                t0 = time.perf_counter()
                runner.forward(context[-1:] * (k + 1))
                times.append(time.perf_counter() - t0)
                runner.rollback(n)
            return statistics.median(times)

        all_layers = list(range(skip.num_layers))
        few = all_layers[: max(1, skip.num_layers // 4)]
        t_all, t_few = draft_time(all_layers), draft_time(few)
        slope = max(0.0, (t_all - t_few) / max(1, len(all_layers) - len(few)))
        intercept = max(0.0, t_few - slope * len(few))
        probes = sorted({0, 1, 2, 4, max_gamma})
        measured = {k: verify_time(k) for k in probes}
    verify = []
    for k in range(max_gamma + 1):
        lo = max(p for p in probes if p <= k)
        hi = min(p for p in probes if p >= k)
        verify.append(measured[lo] if lo == hi else measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo))
    verify = [max(v, verify[0]) for v in verify]  # verifying more tokens never costs less than one
    return (lambda kept: intercept + slope * kept), verify
