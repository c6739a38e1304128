"""Layer-skip proposer: self-speculative decoding, the target drafting with some decoder layers skipped.

The draft is the target itself run through a subset of its decoder layers
(Zhang et al. 2024, "Draft & Verify"; Xia et al. 2024, "SWIFT: On-the-Fly
Self-Speculative Decoding"; Elhoushi et al. 2024, "LayerSkip"). It shares the
target's weights: nothing is copied, no second model is loaded.

KV cache (the design choice, and why). The draft runs *on top of the target's
committed cache*: the engine hands its target runner to proposers as
``ctx.target``; for each draft token the kept layers attend to the full model's
keys / values of every committed token plus the draft's own entries for the
earlier tokens of this chain, and skipped layers neither read nor write. No
draft entry survives into verification: on the project's own forward
(``OwnedCachedModel``, a static position-indexed cache) the draft writes only
slots past the committed length, which the verification pass rewrites, for
every layer, before attending to them; on a Hugging Face ``DynamicCache`` the
draft's entries are cropped from the kept layers when the chain is done (also
when drafting fails). ``tests/test_layer_skip.py`` checks both against a fresh
prefill. Versus a cache of the draft's own this needs no prefill of the prompt
by the draft, no catching up after each step and no extra memory, and the draft
sees the full model's representation of the context, which raises acceptance.

Modes: a fixed skip set (``LayerSkipConfig(skip_layers=(3, 5, 7))``), or
``skip_layers=None``: the set is looked up in the per-model JSON cache, or
searched for (:mod:`specdecode.layer_search`, SWIFT-style) and stored there,
either when :meth:`LayerSkipProposer.calibrate` is called with calibration
prompts or on the first request whose prompt has at least
``MIN_CALIBRATION_TOKENS`` tokens (shorter ones run with a provisional set).

Chains stop early once the draft's top probability falls below
``min_confidence`` (the token just drafted is kept), and whenever the
draft-length policy's hook (``ctx.keep_drafting``) says so.

Supported families: Hugging Face Llama (SmolLM2) and Qwen2, whose decoder
layers live in ``model.model.layers``. Another family with that layout is
accepted if a forward with no layer skipped reproduces the model's own logits
(checked once); anything else raises :class:`LayerSkipError`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specdecode.proposers.base import ProposeContext, register
from specdecode.sampling import logits_to_probs, sample
from specdecode.types import Draft, SpecDecodeError, VerifyResult

#: Families whose decoder layer is (norm, attention with RoPE, residual, norm, MLP, residual)
#: and whose model forward is exactly embed -> layers -> norm -> LM head.
KNOWN_FAMILIES = ("llama", "qwen2")


class LayerSkipError(SpecDecodeError):
    """Layer skipping is impossible for this model, or a skip set is invalid."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Llama / Qwen2-style causal LM (``model.model.layers``).

    Raises:
        LayerSkipError: the model has no ``model.layers`` list with an embedding, final norm and rotary embedding.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    parts = ("embed_tokens", "norm", "rotary_emb")
    if not isinstance(layers, torch.nn.ModuleList) or not all(hasattr(inner, p) for p in parts):
        kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise LayerSkipError(
            f"layer-skip drafting needs a decoder whose layers are model.model.layers with embed_tokens, norm and "
            f"rotary_emb beside them (the Hugging Face Llama / Qwen2 layout); {kind!r} does not have it. Use "
            f"another proposer (--draft ngram, or a draft model)"
        )
    return layers


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


#: Shortest prompt the automatic mode searches on; shorter ones run with the provisional set.
MIN_CALIBRATION_TOKENS = 32


def provisional_skip_layers(num_layers: int, ratio: float = 0.4) -> tuple[int, ...]:
    """A default skip set before any search: ``ratio`` of the layers, spread evenly, first and last kept."""
    inner = list(range(1, num_layers - 1))
    m = round(ratio * len(inner))
    return tuple(sorted({inner[int((i + 0.5) * len(inner) / m)] for i in range(m)})) if m else ()


def _causal_mask(n: int, start: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, start + n] additive mask: query i sees keys 0..start+i."""
    mask = torch.full((n, start + n), float("-inf"), dtype=dtype).triu(start + 1)
    return mask.reshape(1, 1, n, start + n)


def remove_last(cache, layers: Iterable[int], count: int) -> None:
    """Drop the last ``count`` entries of the given layers of a Hugging Face ``DynamicCache``."""
    if count > 0:
        for i in layers:
            cache.layers[i].crop(-count)


def draft_step(runner, skip: SkipForward, kept: Sequence[int]):
    """One-token layer-skip drafting on a target runner's cache.

    Returns ``(step, discard)``: ``step(token [1] int64, position) -> [1, V]`` float32 logits,
    writing the kept layers' cache entries at ``position``; ``discard(count)`` removes the
    entries of the last ``count`` steps (a no-op on the owned forward, whose slots past the
    committed length are rewritten by verification before they are read).

    Raises:
        LayerSkipError: the runner offers neither ``forward_skipping`` nor a Hugging Face cache.
    """
    if hasattr(runner, "forward_skipping"):
        return (lambda tok, pos: runner.forward_skipping(tok, pos, kept)), (lambda count: None)
    cache = getattr(runner, "cache", None)
    if cache is None or not hasattr(cache, "layers"):
        raise LayerSkipError(
            f"layer-skip cannot draft on a {type(runner).__name__}: it needs OwnedCachedModel.forward_skipping "
            "or a Hugging Face DynamicCache"
        )
    # runner.cache is read per call: a reset between requests replaces it
    return ((lambda tok, pos: skip.forward(tok, pos, kept, runner.cache)),
            (lambda count: remove_last(runner.cache, kept, count)))


@dataclass(frozen=True)
class LayerSkipConfig:
    """Config of the layer-skip proposer.

    Attributes:
        skip_layers: decoder layer indices to skip; None = look up / search (SWIFT-style).
        min_confidence: end the chain after a token whose draft top probability is below this
            (greedy: softmax of the raw draft logits; sampling: q), in [0, 1]; 0 disables.
        search_budget_s: time allowed to a search when no cached set exists (seconds).
        cache_dir: where the per-model JSON of chosen sets lives; None = ``models.default_cache_dir()``.
    """

    skip_layers: tuple[int, ...] | None = None
    min_confidence: float = 0.5
    search_budget_s: float = 120.0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_confidence <= 1.0:
            raise LayerSkipError(f"min_confidence must be in [0, 1], got {self.min_confidence!r}")
        if self.skip_layers is not None:
            object.__setattr__(self, "skip_layers", parse_skip_layers(self.skip_layers))


@register("layer-skip")
class LayerSkipProposer:
    """Drafts with the target itself, some decoder layers skipped, on the target's own cache.

    Args:
        model: the target (the same module the engine runs), Llama / Qwen2 family.
        config: LayerSkipConfig.

    Raises:
        LayerSkipError: unsupported model, or a skip index outside the model's layers.
    """

    def __init__(self, model: torch.nn.Module, config: LayerSkipConfig | None = None) -> None:
        self.config = config or LayerSkipConfig()
        self.model = model
        self.skip = SkipForward(model)
        self.skip_layers: tuple[int, ...] | None = None
        self.kept: tuple[int, ...] = ()
        self.search_result = None  # a layer_search.SearchResult when this proposer searched or looked up
        self._provisional = False  # running a default set until a prompt long enough to search on
        # The request's target runner and its one-token draft step, bound by start() (see _bind).
        self._target = None
        self._step = self._discard = None
        if self.config.skip_layers is not None:
            self.set_skip_layers(self.config.skip_layers)

    def set_skip_layers(self, layers: Iterable[int]) -> None:
        """Use this skip set from now on (validated against the model's layer count)."""
        self.skip_layers = parse_skip_layers(list(layers), self.skip.num_layers)
        self.kept = tuple(i for i in range(self.skip.num_layers) if i not in self.skip_layers)
        if self._target is not None:
            self._step, self._discard = draft_step(self._target, self.skip, self.kept)

    def calibrate(self, prompts: Sequence[Sequence[int]], refresh: bool = False):
        """Choose the skip set now: the one cached for this model, else a search on ``prompts``.

        Args:
            prompts: calibration prompts, token id lists.
            refresh: search even when a cached set exists.

        Returns:
            the :class:`specdecode.layer_search.SearchResult` (also kept as ``search_result``).
        """
        from specdecode.layer_search import SearchConfig, choose_skip_layers

        result = choose_skip_layers(self.model, prompts, SearchConfig(time_budget_s=self.config.search_budget_s),
                                    cache_dir=self.config.cache_dir, refresh=refresh)
        self.search_result = result
        self.set_skip_layers(result.skip_layers)
        self._provisional = False
        return result

    def start(self, ctx: ProposeContext) -> None:
        """Bind the request's target runner (``ctx.target``) and choose the skip set.

        With no skip set yet: use the cached one, or search on this prompt when it is long enough
        (``MIN_CALIBRATION_TOKENS``); a shorter prompt runs with :func:`provisional_skip_layers`.

        Raises:
            LayerSkipError: the engine gives no target runner, one of another model, or one whose
                cache the draft cannot run on.
        """
        self._choose_skip_layers(ctx)
        self._bind(ctx.target)

    def _choose_skip_layers(self, ctx: ProposeContext) -> None:
        if self.skip_layers is not None and not self._provisional:
            return
        from specdecode.layer_search import load_cached

        cached = load_cached(self.model, self.config.cache_dir)
        prompt = ctx.token_ids[: ctx.num_prompt_tokens]
        if cached is not None or len(prompt) >= MIN_CALIBRATION_TOKENS:
            self._provisional = False
            if cached is not None:
                self.search_result = cached
                self.set_skip_layers(cached.skip_layers)
            else:
                self.calibrate([prompt])
        elif self.skip_layers is None:
            self._provisional = True
            self.set_skip_layers(provisional_skip_layers(self.skip.num_layers))

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens on the target's cache, then remove the draft's entries.

        Returns:
            Draft chain: [1, k] int64 tokens (1 <= k <= max_tokens) and, when sampling,
            [1, k, V] float32 q.

        Raises:
            LayerSkipError: :meth:`start` was not called for this request, or the target cache
                does not hold every committed token but the last.
        """
        runner, base = self._target, len(ctx.token_ids) - 1
        if runner is None:
            raise LayerSkipError("layer-skip: call start(ctx) for the request before propose (it binds the target)")
        if runner.num_cached != base:
            raise LayerSkipError(
                f"the target cache holds {runner.num_cached} tokens; layer-skip expects every committed token but "
                f"the last ({base})"
            )
        step, discard = self._step, self._discard
        vocab = ctx.vocab_size
        greedy = ctx.params.greedy
        tok = torch.tensor([ctx.token_ids[-1]], dtype=torch.int64)
        tokens, probs, fed = [], [], 0
        try:
            for i in range(max_tokens):
                logits = step(tok, base + i)[-1, :vocab]  # [V]
                fed += 1
                q = logits_to_probs(logits, ctx.params) if not greedy else None
                tok = logits.argmax(-1, keepdim=True) if greedy else sample(q, ctx.generator).reshape(1)
                tokens.append(tok)
                if q is not None:
                    probs.append(q)
                if i + 1 < max_tokens and not self._keep_going(ctx, logits, q):
                    break
        finally:
            discard(fed)
        token_ids = torch.cat(tokens).reshape(1, -1)
        draft_probs = torch.stack(probs).unsqueeze(0) if probs else None
        return Draft.chain(token_ids, draft_probs)

    def _keep_going(self, ctx: ProposeContext, logits: torch.Tensor, q: torch.Tensor | None) -> bool:
        """Confidence stop (own threshold) and the policy's hook, on the token just drafted."""
        if self.config.min_confidence <= 0.0 and ctx.should_continue is None:
            return True
        dist = q if q is not None else torch.softmax(logits, -1)
        if self.config.min_confidence > 0.0 and float(dist.max()) < self.config.min_confidence:
            return False
        return ctx.keep_drafting(dist)

    def _bind(self, runner) -> None:
        """Check the target runner once per request and keep its one-token draft step
        ``(token [1], position) -> [1, V] logits`` and ``discard(count)`` (see :func:`draft_step`).

        The project's own forward (``OwnedCachedModel.forward_skipping``) writes cache slots past the
        committed length, which verification rewrites before reading: nothing to discard. On a
        Hugging Face cache the kept layers' last entries are cropped.
        """
        if runner is None:
            raise LayerSkipError(
                "layer-skip drafts on the target's own KV cache, and this engine does not offer it (ctx.target). "
                "Use SpeculativeEngine, or another proposer"
            )
        if getattr(runner, "model", None) is not self.model:
            raise LayerSkipError("the layer-skip proposer was built for a different model than the engine's target")
        self._step, self._discard = draft_step(runner, self.skip, self.kept)
        self._target = runner

    def observe(self, ctx: ProposeContext, result: VerifyResult) -> None:
        """Nothing to roll back: the draft left no state in the target cache."""
        return None
