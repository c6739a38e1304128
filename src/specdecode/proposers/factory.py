"""From a drafter spec to a proposer: the one construction path of every front end.

A drafter is a :class:`specdecode.spec.DrafterSpec` (read from ``--draft`` and its flags, a ``--config``
file, or the compact form ``ngram:k=4,max_ngram=4``). Here:

- :func:`load_draft` loads the draft model a spec names (the target itself for the target's spec);
- :func:`factory_from_spec` turns the spec and the loaded modules into a zero-argument factory of
  proposers: the library builds one proposer per decoder, the server one per engine, the bench
  and tune one per run (``specdecode.build`` assembles the engine around it);
- :func:`config_from_options` reads a spec's option texts as the proposer's config dataclass.

Underneath, :func:`registered_factory` binds a registered proposer (``@register(name)``) to
the arguments its factory takes (``model``: the draft model, or the target for self-speculative
proposers; ``target``; ``config``): a new proposer needs no change here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Sequence

from specdecode import layer_search
from specdecode.lowbit import load_in_precision
from specdecode.models import check_compatible
from specdecode.models.compat import _tokenizer_difference, trees_across_vocabularies
from specdecode.proposers.base import PROPOSERS, Proposer
from specdecode.spec import DrafterSpec
from specdecode.types import SpecDecodeError

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


# --------------------------------------------------------------------------- from a spec


def config_from_options(kind: str, options: Sequence[tuple[str, str]], *, cache_dir: str | None = None):
    """The config dataclass of the proposer registered as ``kind``, its fields read from a spec's option texts.

    Each text is read as the field's type: bool (1 / 0 / true / false / yes / no), int, float, str, or a
    tuple written ``a/b/c``. A ``cache_dir`` field the options leave out gets ``cache_dir``.

    Returns:
        the config, or None when the factory takes none (and no option is given).

    Raises:
        SpecDecodeError: an option that is no field of the config (the message lists them), a value of
            the wrong type, or options given to a proposer that takes no config.
    """
    kind_type = config_type(kind)
    values = dict(options)
    if kind_type is None:
        if values:
            raise SpecDecodeError(f"drafter {kind!r} takes no options, got {sorted(values)}")
        return None
    fields = {f.name for f in dataclasses.fields(kind_type)}
    hints = typing.get_type_hints(kind_type)
    out = {}
    for key, raw in values.items():
        if key not in fields:
            raise SpecDecodeError(f"drafter {kind!r} has no option {key!r}; its options: k, "
                                  f"{', '.join(sorted(fields)) or '(none)'}")
        out[key] = _convert(raw, hints.get(key, str), key, kind)
    if "cache_dir" in fields and "cache_dir" not in out and cache_dir is not None:
        out["cache_dir"] = str(cache_dir)
    return kind_type(**out)


def _convert(raw: str, hint, key: str, kind: str):
    """An option text as the config field's type: bool, int, float, str, or a tuple written a/b/c."""
    for h in (hint, *typing.get_args(hint)):
        if typing.get_origin(h) is tuple:
            item = next((t for t in typing.get_args(h) if t is not Ellipsis), str)
            return tuple(_convert(part, item, key, kind) for part in raw.split("/") if part)
    kinds = [t for t in (hint, *typing.get_args(hint)) if t in (bool, int, float, str)]
    want = kinds[0] if kinds else str
    try:
        if want is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return want(raw)
    except ValueError:
        raise SpecDecodeError(f"option {key}={raw!r} of drafter {kind!r} must be {want.__name__}") from None


def factory_from_spec(spec: DrafterSpec, *, target=None, draft=None, target_tokenizer=None, draft_tokenizer=None,
                      cache_dir: str | None = None) -> Callable[[], Proposer] | None:
    """A zero-argument factory of fresh proposers for a drafter spec; None for plain decoding.

    The one place a spec becomes a proposer (``build.build_engine`` and every front end land here). A
    draft-model spec whose draft has another tokenizer than the target drafts across vocabularies
    (``proposers.cross_vocab``, chains only); suffix decoding wraps its fallback's factory.

    Args:
        spec: the drafter (:class:`specdecode.spec.DrafterSpec`).
        target: the target ``nn.Module`` (self-speculative and head drafters draft with it).
        draft: the draft ``nn.Module`` of a draft-model spec (or of its suffix fallback).
        target_tokenizer, draft_tokenizer: both tokenizers, to tell a cross-vocabulary pair.
        cache_dir: where layer-skip sets and draft heads are cached (None: their default).

    Raises:
        SpecDecodeError: an unknown kind (the message lists the registered ones), an option the kind's
            config lacks or a value of the wrong type, a draft-model spec without ``draft``, token trees
            across vocabularies.
    """
    if spec.kind == "none":
        return None
    if spec.kind not in PROPOSERS:
        raise SpecDecodeError(f"unknown drafter {spec.kind!r}; registered proposers: {', '.join(PROPOSERS)}")
    config = config_from_options(spec.kind, spec.options, cache_dir=cache_dir)
    if spec.kind == "suffix":
        inner = None if spec.fallback is None else factory_from_spec(
            spec.fallback, target=target, draft=draft, target_tokenizer=target_tokenizer,
            draft_tokenizer=draft_tokenizer, cache_dir=cache_dir)
        suffix = registered_factory("suffix", config=config)
        return lambda: suffix(fallback=inner() if inner is not None else None)
    if not takes_draft_model(spec.kind):
        return registered_factory(spec.kind, target=target, config=config)
    if draft is None:
        raise SpecDecodeError(f"drafter {str(spec)!r} names a draft model, but none was loaded (name it with "
                              f"--draft MODEL or '{spec.kind}:model=MODEL')")
    difference = None
    if target_tokenizer is not None and draft_tokenizer is not None and draft is not target:
        difference = _tokenizer_difference(target_tokenizer, draft_tokenizer)
    if difference and spec.kind == "tree-draft":  # the real reason (the pair drafts chains across vocabularies)
        raise trees_across_vocabularies(None, spec.model or "the draft", spec.tree, difference)
    if difference or spec.kind == "cross-vocab":
        vocab = int(getattr(getattr(target, "config", None), "vocab_size", 0) or len(target_tokenizer))
        return registered_factory("cross-vocab", draft=draft, target_tokenizer=target_tokenizer,
                                  draft_tokenizer=draft_tokenizer, target_vocab=vocab)
    return registered_factory(spec.kind, target=target, draft=draft, config=config)


def load_draft(spec: DrafterSpec, target, target_spec: str, *, weights: str = "fp32",
               draft_weights: str | None = None, **load_kwargs):
    """The draft LoadedModel a spec names (its own or its suffix fallback's), None for model-free drafters.

    The draft is ``target`` itself (one module; each proposer keeps its own cache) when its spec
    is ``target_spec`` and it runs in the target's precision; otherwise it is loaded with
    ``lowbit.load_in_precision`` in ``draft_weights`` (``load_kwargs``: dtype, cache_dir, progress) and,
    when it shares the target's tokenizer, checked to cover it (another tokenizer drafts across vocabularies).

    Args:
        spec: the drafter. target: the target's LoadedModel; target_spec: the spec it was loaded from.
        weights: the precision the target runs in; draft_weights: the draft's (None = ``weights``).

    Raises:
        ModelLoadError, IncompatibleTokenizerError.
    """
    model = spec.model_spec
    if model is None:
        return None
    draft_weights = draft_weights or weights
    if model == target_spec and draft_weights == weights:
        return target
    draft = load_in_precision(model, draft_weights, **load_kwargs)
    if not other_tokenizer(target, draft):  # another tokenizer: the cross-vocabulary proposer
        check_compatible(target, draft)
    return draft


def other_tokenizer(target, draft) -> str | None:
    """How the draft's tokenizer differs from the target's (LoadedModels), or None when they are the same
    (then ids mean the same tokens and the ordinary draft path runs)."""
    if target is None or draft is None or draft is target:
        return None
    return _tokenizer_difference(target.tokenizer, draft.tokenizer)
