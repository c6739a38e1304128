"""From a drafter choice to a proposer: the one construction path of the library, the server and the bench.

A *drafter choice* is what ``--draft`` (and ``SpecDecoder.from_pretrained(draft=...)``) takes:

- ``none`` (or empty): plain decoding, no proposer;
- ``ngram``: prompt lookup (:class:`~specdecode.proposers.ngram.NgramProposer`);
- ``layer-skip``: self-speculation, the target with some decoder layers skipped;
- ``eagle`` / ``eagle:PATH``: a trained feature-level head (EAGLE-3 style) on the target's hidden
  states, chains or token trees with ``tree``;
- ``suffix`` / ``suffix:INNER``: suffix decoding, falling back to the drafter INNER (any other
  choice) when the suffix match scores low;
- anything else: a draft-model spec, loaded like the target (chains, or token trees with ``tree``).

The pieces, used in this order:

- :func:`parse_draft` reads a choice once (a :class:`DraftChoice`);
- :func:`check_drafter` range-checks it with its :class:`DrafterOptions` before any slow load
  (these three live in :mod:`specdecode.validate`, without torch, and are re-exported here);
- :func:`load_draft_model` loads the draft model it names (the target itself for the target's spec);
- :func:`proposer_factory` turns it and the loaded modules into a zero-argument factory of
  proposers: the library builds one proposer per decoder, the server one per request.

Underneath, :func:`registered_factory` binds a registered proposer (``@register(name)``) to
the arguments its factory takes (``model``: the draft model, or the target for self-speculative
proposers; ``target``; ``config``). The bench's method specs (``ngram:k=5,max_ngram=4``) build
through it as well, with their own option parsing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable

from specdecode import layer_search
from specdecode.models import check_compatible
from specdecode.proposers.base import PROPOSERS, Proposer
from specdecode.proposers.eagle import EagleDraftConfig
from specdecode.proposers.layer_skip import LayerSkipConfig
from specdecode.proposers.ngram import NgramConfig
from specdecode.proposers.suffix import SuffixConfig
from specdecode.proposers.tree_draft import TreeDraftConfig
from specdecode.types import SpecDecodeError
# Reading a choice and checking it need no model: they live without torch (the command line uses them too).
from specdecode.validate import (  # noqa: F401 - re-exported: the drafter choices and their checks
    DRAFT_KINDS,
    EAGLE_DRAFT,
    LAYER_SKIP_DRAFT,
    NGRAM_DRAFT,
    NO_DRAFT,
    SUFFIX_DRAFT,
    DraftChoice,
    DrafterOptions,
    check_drafter,
    check_tree,
    parse_draft,
    parse_skip_layers,
)

#: Self-speculative proposers: the ``model`` argument of their factory is the target itself, not a draft.
SELF_SPECULATIVE: set[str] = {"layer-skip"}


# --------------------------------------------------------------------------- registered factories


def takes_draft_model(name: str) -> bool:
    """True when the factory registered as ``name`` takes a ``model`` argument that is a draft model.

    Raises:
        KeyError: ``name`` is not registered.
    """
    return "model" in inspect.signature(PROPOSERS[name]).parameters and name not in SELF_SPECULATIVE


def config_type(name: str) -> type | None:
    """The dataclass type of the ``config`` parameter of the factory registered as ``name``, if it has one.

    Raises:
        KeyError: ``name`` is not registered.
    """
    factory = PROPOSERS[name]
    if "config" not in inspect.signature(factory).parameters:
        return None
    hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    hint = hints.get("config")
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def registered_factory(name: str, *, target=None, draft=None, config=None, **kwargs) -> Callable[[], Proposer]:
    """A zero-argument factory of the proposer registered as ``name``, its arguments bound once.

    Args:
        name: a key of ``specdecode.proposers.PROPOSERS``.
        target: the target ``nn.Module``; passed as ``model`` to self-speculative proposers
            (:data:`SELF_SPECULATIVE`) and as ``target`` to factories that take one.
        draft: the draft ``nn.Module``, passed as ``model`` to the other factories that take one.
        config: the proposer's config dataclass, passed where the factory takes ``config``
            (None = the factory's default).
        kwargs: passed as they are (e.g. suffix decoding's ``fallback``).

    Raises:
        KeyError: ``name`` is not registered (the message lists the registered ones).
    """
    if name not in PROPOSERS:
        raise KeyError(f"unknown proposer {name!r}; choose one of {sorted(PROPOSERS)}")
    factory = PROPOSERS[name]
    params = inspect.signature(factory).parameters
    if "model" in params:
        kwargs["model"] = target if name in SELF_SPECULATIVE else draft
    if "target" in params:
        kwargs["target"] = target
    if "searcher" in params:  # layer-skip: the SWIFT-style search of its skip set
        kwargs.setdefault("searcher", layer_search)
    if config is not None:
        kwargs["config"] = config
    return functools.partial(factory, **kwargs)


# --------------------------------------------------------------------------- drafter choices


def tree_config(tree: str | None, tree_nodes: int) -> TreeDraftConfig | None:
    """The draft-model tree config of ``tree`` ("static" / "dynamic"; None / "none" = chains, returns None).

    Raises:
        SpecDecodeError: an unknown tree kind or a node budget outside 1..64.
    """
    kind = check_tree(tree, tree_nodes)
    return None if kind == "none" else TreeDraftConfig(kind=kind, num_nodes=tree_nodes)


def load_draft_model(choice: DraftChoice, target, target_spec: str, *, weights: str = "fp32",
                     draft_weights: str | None = None, **load_kwargs):
    """The draft LoadedModel a choice names (its own or its suffix fallback's), None for model-free choices.

    The draft is ``target`` itself (one module; each proposer keeps its own cache) when its spec
    is ``target_spec`` and it runs in the target's precision; otherwise it is loaded with
    :func:`specdecode.models.load_model` (``load_kwargs``: dtype, cache_dir, progress), checked
    for a tokenizer shared with the target, in ``draft_weights`` (``lowbit.load_in_precision``: int4 /
    int8 weights come from their cache when one exists).

    Args:
        choice: the parsed ``--draft``.
        target: the target's LoadedModel; target_spec: the spec it was loaded from.
        weights: the precision the target runs in; draft_weights: the draft's (None = ``weights``).

    Raises:
        ModelLoadError, IncompatibleTokenizerError.
    """
    spec = choice.model_spec
    if spec is None:
        return None
    draft_weights = draft_weights or weights
    if spec == target_spec and draft_weights == weights:
        return target
    from specdecode.lowbit import load_in_precision

    draft = load_in_precision(spec, draft_weights, **load_kwargs)
    if not other_tokenizer(target, draft):  # another tokenizer: the cross-vocabulary proposer (proposer_factory)
        check_compatible(target, draft)
    return draft


def other_tokenizer(target, draft) -> str | None:
    """How the draft's tokenizer differs from the target's (LoadedModels), or None when they are the same
    (then ids mean the same tokens and the ordinary draft path runs)."""
    from specdecode.models import _tokenizer_difference

    if target is None or draft is None or draft is target:
        return None
    return _tokenizer_difference(target.tokenizer, draft.tokenizer)


def proposer_factory(choice: DraftChoice, options: DrafterOptions, *, target=None,
                     draft=None, target_tokenizer=None, draft_tokenizer=None) -> Callable[[], Proposer] | None:
    """A zero-argument factory of fresh proposers for a choice; None for plain decoding.

    Args:
        choice: the parsed ``--draft``.
        options: its settings (checked here as by :func:`check_drafter`).
        target: the target ``nn.Module`` (``layer-skip`` drafts with it).
        draft: the draft ``nn.Module`` of a draft-model choice (or of its suffix fallback),
            e.g. ``load_draft_model(...).model``.
        target_tokenizer, draft_tokenizer: both tokenizers; when they differ the draft drafts across
            vocabularies (``proposers.cross_vocab``; chains only).

    Raises:
        SpecDecodeError: as :func:`check_drafter`; a draft-model choice without ``draft``.
    """
    check_drafter(choice, options)
    if choice.kind == "none":
        return None
    if choice.kind == SUFFIX_DRAFT:
        inner = proposer_factory(choice.fallback, options, target=target, draft=draft,
                                 target_tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
        suffix = registered_factory(SUFFIX_DRAFT, config=SuffixConfig(max_spec_nodes=options.tree_nodes))
        return lambda: suffix(fallback=inner() if inner is not None else None)
    if choice.kind == NGRAM_DRAFT:
        return registered_factory("ngram", config=NgramConfig(min_ngram=options.ngram_min,
                                                              max_ngram=options.ngram_max))
    if choice.kind == LAYER_SKIP_DRAFT:
        config = LayerSkipConfig(skip_layers=parse_skip_layers(options.skip_layers), cache_dir=options.cache_dir)
        return registered_factory("layer-skip", target=target, config=config)
    if choice.kind == EAGLE_DRAFT:
        config = EagleDraftConfig(tree=options.tree or "none", num_nodes=options.tree_nodes, head=choice.head_path,
                                  cache_dir=options.cache_dir)
        return registered_factory(EAGLE_DRAFT, target=target, config=config)
    if draft is None:
        raise SpecDecodeError(f"--draft {choice.text!r} names a draft model, but none was loaded")
    tree = tree_config(options.tree, options.tree_nodes)
    if target_tokenizer is not None and draft_tokenizer is not None and draft is not target:
        from specdecode.models import _tokenizer_difference, trees_across_vocabularies

        difference = _tokenizer_difference(target_tokenizer, draft_tokenizer)
        if difference:
            if tree is not None:  # the real reason (the pair drafts chains across vocabularies)
                raise trees_across_vocabularies(None, choice.text, options.tree, difference)
            vocab = int(getattr(getattr(target, "config", None), "vocab_size", 0) or len(target_tokenizer))
            return registered_factory("cross-vocab", draft=draft, target_tokenizer=target_tokenizer,
                                      draft_tokenizer=draft_tokenizer, target_vocab=vocab)
    if tree is not None:
        return registered_factory("tree-draft", draft=draft, config=tree)
    return registered_factory("draft-model", draft=draft)
