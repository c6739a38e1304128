"""Layer-skip proposer: self-speculative decoding, the target drafting with some decoder layers skipped.

The draft is the target itself run through a subset of its decoder layers
(Zhang et al. 2024, "Draft & Verify"; Xia et al. 2024, "SWIFT: On-the-Fly
Self-Speculative Decoding"; Elhoushi et al. 2024, "LayerSkip"). It shares the
target's weights: nothing is copied, no second model is loaded.

KV cache (the design choice, and why). The draft runs *on top of the target's
committed cache*: the engine binds the proposer to its target runner (an
``kv.OwnedRunner``), and per draft position ONE forward of the kept layers runs
over every row still drafting (``forward_skipping``): row i's token j is written
at column / position ``len(committed_i) - 1 + j`` of its own slot, past its
committed length, where the verification pass rewrites every layer before
attending to it. The kept layers attend to the full model's keys / values of the
committed tokens plus the draft's own entries of this chain; skipped layers
neither read nor write. ``tests/test_proposers_layer_skip.py`` checks the cache against a
fresh prefill. Versus a cache of the draft's own this needs no prefill of the
prompt by the draft, no catching up and no extra memory, and the draft sees the
full model's representation of the context, which raises acceptance. The Hugging
Face forward cannot skip layers: binding to it raises :class:`LayerSkipError`.

Modes: a fixed skip set (``LayerSkipConfig(skip_layers=(3, 5, 7))``), or
``skip_layers=None``: the set is looked up in the per-model JSON cache, or
searched for (``searcher``: :mod:`specdecode.layer_search`, SWIFT-style, which the
factory passes) and stored there, either when :meth:`LayerSkipProposer.calibrate`
is called with calibration prompts or on the first request whose prompt has at least
``MIN_CALIBRATION_TOKENS`` tokens (shorter ones run with a provisional set).

Chains stop early once the draft's top probability falls below
``min_confidence`` (the token just drafted is kept), and whenever the
draft-length policy's hook (``ctx.keep_drafting``) says so.

Supported families: Hugging Face Llama (SmolLM2) and Qwen2 on the project's own
forward (``kv/owned.py``); anything else raises :class:`LayerSkipError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# The error and the parsing of a skip set live without torch (the command line checks --skip-layers with them).
from specdecode.errors import LayerSkipError
from specdecode.proposers.base import ProposeContext, Proposer, register
from specdecode.types import Draft
from specdecode.validate import parse_skip_layers

#: Families whose decoder layer is (norm, attention with RoPE, residual, norm, MLP, residual)
#: and whose model forward is exactly embed -> layers -> norm -> LM head.
KNOWN_FAMILIES = ("llama", "qwen2")


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


#: Shortest prompt the automatic mode searches on; shorter ones run with the provisional set.
MIN_CALIBRATION_TOKENS = 32


def provisional_skip_layers(num_layers: int, ratio: float = 0.4) -> tuple[int, ...]:
    """A default skip set before any search: ``ratio`` of the layers, spread evenly, first and last kept."""
    inner = list(range(1, num_layers - 1))
    m = round(ratio * len(inner))
    return tuple(sorted({inner[int((i + 0.5) * len(inner) / m)] for i in range(m)})) if m else ()


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
class LayerSkipProposer(Proposer):
    """Drafts with the target itself, some decoder layers skipped, on the target's own cache, all rows at once.

    Per draft position ONE forward of the kept layers over every row still drafting
    (``OwnedRunner.forward_skipping``): row i's token j goes to column / position
    ``len(committed_i) - 1 + j``, past its committed length, where verification rewrites it.

    Args:
        model: the target (the same module the engine runs), Llama / Qwen2 family.
        config: LayerSkipConfig.
        searcher: chooses skip sets when ``config.skip_layers`` is None: an object with
            ``load_cached(model, cache_dir) -> result | None`` and
            ``choose_skip_layers(model, prompts, budget_s, cache_dir=, refresh=) -> result`` (results
            carry ``skip_layers``); :mod:`specdecode.layer_search` is the one the factory passes.
            None: the provisional set until :meth:`set_skip_layers`.

    Raises:
        LayerSkipError: unsupported model, or a skip index outside the model's layers.
    """

    def __init__(self, model: torch.nn.Module, config: LayerSkipConfig | None = None, searcher=None) -> None:
        self.config = config or LayerSkipConfig()
        self.model = model
        self.num_layers = len(decoder_layers(model))
        self.searcher = searcher
        self.skip_layers: tuple[int, ...] | None = None
        self.kept: tuple[int, ...] = ()
        self.search_result = None  # a layer_search.SearchResult when this proposer searched or looked up
        self.drafting = True  # False after a search whose best set measured slower than plain decoding
        self._provisional = False  # running a default set until a prompt long enough to search on
        self._target = None
        if self.config.skip_layers is not None:
            self.set_skip_layers(self.config.skip_layers)

    def set_skip_layers(self, layers: Iterable[int]) -> None:
        """Use this skip set from now on (validated against the model's layer count)."""
        self.skip_layers = parse_skip_layers(list(layers), self.num_layers)
        self.kept = tuple(i for i in range(self.num_layers) if i not in self.skip_layers)
        self.drafting = True

    def calibrate(self, prompts: Sequence[Sequence[int]], refresh: bool = False):
        """Choose the skip set now: the one cached for this model, else a search on ``prompts``.

        A result measured slower than plain decoding (``loses``) turns drafting off (every draft empty: plain
        decoding) until :meth:`set_skip_layers` gives a set explicitly.

        Returns:
            the search result (also kept as ``search_result``).

        Raises:
            LayerSkipError: no searcher was given.
        """
        if self.searcher is None:
            raise LayerSkipError("layer-skip: no skip-set searcher given; pass searcher=specdecode.layer_search")
        result = self.searcher.choose_skip_layers(self.model, prompts, self.config.search_budget_s,
                                                  cache_dir=self.config.cache_dir, refresh=refresh)
        self.search_result = result
        self.set_skip_layers(result.skip_layers)
        self.drafting = not getattr(result, "loses", False)  # slower than plain decoding: draft nothing
        self._provisional = False
        return result

    def bind(self, target, num_slots: int) -> None:
        """Check that the engine's target runner is this model on a forward that can skip layers.

        Raises:
            LayerSkipError: another model, or the Hugging Face forward (no layer skipping).
        """
        if getattr(target, "model", None) is not self.model:
            raise LayerSkipError("the layer-skip proposer was built for a different model than the engine's target")
        if not getattr(target, "skips_layers", False):
            raise LayerSkipError(
                "layer-skip drafts on the target's own cache through the project's Llama / Qwen2 forward; this "
                "target runs on the Hugging Face forward. Use --forward auto/owned, or another drafter")
        self._target = target

    def start(self, ctx: ProposeContext) -> None:
        """Choose the skip set: the cached one, or a search on this prompt when it is long enough
        (``MIN_CALIBRATION_TOKENS``); a shorter prompt runs with :func:`provisional_skip_layers`."""
        if self.skip_layers is not None and not self._provisional:
            return
        cached = self.searcher.load_cached(self.model, self.config.cache_dir) if self.searcher else None
        prompt = ctx.token_ids[: ctx.num_prompt_tokens]
        if cached is not None:
            self._provisional = False
            self.search_result = cached
            self.set_skip_layers(cached.skip_layers)
        elif self.searcher is not None and len(prompt) >= MIN_CALIBRATION_TOKENS:
            self.calibrate([prompt])
        elif self.skip_layers is None:
            self._provisional = True
            self.set_skip_layers(provisional_skip_layers(self.num_layers))

    @torch.inference_mode()
    def propose(self, batch: Sequence[ProposeContext], max_tokens: Sequence[int]) -> list[Draft]:
        """Draft up to ``max_tokens[i]`` tokens per row on the target's cache.

        Returns:
            per row a chain [1, k] int64 (k <= max_tokens[i]) and, when sampling, [1, k, V] float32 q.

        Raises:
            LayerSkipError: not bound, or a row's cache does not hold every committed token but the last.
        """
        runner = self._target
        if runner is None:
            raise LayerSkipError("layer-skip: the proposer is not bound to an engine (SpeculativeEngine binds it)")
        if not self.drafting:  # the search measured every set slower than plain decoding
            return [Draft.empty() for _ in batch]
        bases = [len(ctx.token_ids) - 1 for ctx in batch]
        for i, base in enumerate(bases):
            if max_tokens[i] > 0 and runner.length(i) != base:
                raise LayerSkipError(f"row {i}: the target cache holds {runner.length(i)} tokens; layer-skip "
                                     f"expects every committed token but the last ({base})")
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        live = [k > 0 for k in max_tokens]
        last = [ctx.token_ids[-1] for ctx in batch]
        rows = slice(0, len(batch))
        for pos in range(max(max_tokens, default=0)):
            if not any(live):
                break
            feeds = [[last[i]] if live[i] else [] for i in range(len(batch))]
            logits = runner.forward_skipping(rows, feeds, [b + pos for b in bases], self.kept, last_only=True)[:, -1]
            for i, ctx in enumerate(batch):
                if not live[i]:
                    continue
                q = ctx.draft_dist(logits[i, : ctx.vocab_size], tokens[i])  # processed along the draft path
                tok = ctx.draft_token(q, len(tokens[i]))
                tokens[i].append(tok)
                if not ctx.params.greedy:
                    probs[i].append(q)
                last[i] = tok
                live[i] = pos + 1 < max_tokens[i] and self._keep_going(ctx, q)
        return [Draft.chain(torch.tensor([t], dtype=torch.int64), torch.stack(p).unsqueeze(0) if p else None)
                if t else Draft.empty() for t, p in zip(tokens, probs)]

    def _keep_going(self, ctx: ProposeContext, dist: torch.Tensor) -> bool:
        """Confidence stop (own threshold) and the policy's hook, on the token just drafted ([V] q)."""
        if self.config.min_confidence <= 0.0 and ctx.should_continue is None:
            return True
        if self.config.min_confidence > 0.0 and float(dist.max()) < self.config.min_confidence:
            return False
        return ctx.keep_drafting(dist)
