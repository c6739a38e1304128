"""What a user asks of a drafter, as one value: :class:`DrafterSpec`, its three spellings and its one ``str()``.

The three forms, one parser each, all landing on the same spec:

- the compact form, ``KIND[:KEY=VALUE,...]`` (:meth:`DrafterSpec.parse`): ``ngram:k=4,max_ngram=4``,
  ``draft-model:k=3,model=qwen2.5-coder-0.5b``, ``eagle:tree=dynamic``, ``layer-skip:skip_layers=3/5/7``,
  ``suffix:fallback=(ngram)``. KIND is a registered proposer (``specdecode.proposers.PROPOSERS``); ``k``
  is γ (``num_speculative_tokens``), ``model`` the draft model, ``fallback`` suffix decoding's inner drafter
  (itself a compact spec in parentheses), and every other key a field of the proposer's config dataclass
  (tuples written ``4/2/2``). ``specdecode bench --methods`` takes a ``;``-separated list of these, and
  ``--draft`` takes them too;
- the command-line flags (``--draft``, ``-k``, ``--ngram-min/max``, ``--skip-layers``, ``--tree``,
  ``--tree-nodes``) and
- the TOML settings file (``--config``: the same keys), both through :meth:`DrafterSpec.from_settings`.

``--draft`` keeps its short words: ``ngram``, ``none``, ``layer-skip``, ``suffix``, ``suffix:INNER``, ``eagle``,
``eagle:DIR`` and a bare draft-model spec (``--draft qwen2.5-coder-0.5b`` is ``draft-model:model=...``; with
``--tree`` it is ``tree-draft:model=...,kind=...``).

``str(spec)`` is the canonical compact form (keys sorted, values equal to the proposer's defaults left
out), so ``DrafterSpec.parse(str(spec)) == spec`` and two spellings of one drafter compare equal.
The spec is checked when it is read (γ, n-gram sizes, tree kinds and node budgets, skip sets, the option
names of a built-in kind: :data:`OPTIONS`), and by :meth:`DrafterSpec.check` before any model loads (a model
kind names its model, a head path is a checkpoint); a field of a proposer registered outside this module is
checked against its config type when the engine is built (:mod:`specdecode.build`). No torch here: the command line reads specs before importing anything heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.options import (
    CATALOG_MODELS,
    DEFAULT_GAMMA,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    DEFAULT_TREE_NODES,
    TREE_KINDS,
)
from specdecode.validate import (
    MAX_SPECULATIVE_TOKENS,
    MAX_TREE_NODES,
    check_gamma,
    parse_skip_layers,
)

#: Kinds that need no proposer: plain decoding.
NONE = "none"
#: Drafter kinds built into the package (the registry may hold more: their options are checked at build time).
BUILTIN_KINDS = ("none", "ngram", "suffix", "layer-skip", "eagle", "draft-model", "tree-draft", "cross-vocab")
#: Kinds that draft with a second model (``model=``).
MODEL_KINDS = ("draft-model", "tree-draft", "cross-vocab")
#: Keys that mean γ in the compact form.
GAMMA_KEYS = ("k", "gamma", "num_speculative_tokens")

#: The defaults of the config fields a flag sets, per kind (torch-free copies of the proposers' config
#: dataclasses; tests/test_spec.py keeps them equal). A value equal to its default is left out of a spec.
DEFAULTS: dict[str, dict[str, str]] = {
    "ngram": {"min_ngram": str(DEFAULT_NGRAM_MIN), "max_ngram": str(DEFAULT_NGRAM_MAX)},
    "suffix": {"max_spec_nodes": "16"},
    "eagle": {"tree": "none", "num_nodes": str(DEFAULT_TREE_NODES)},
    "tree-draft": {"kind": "dynamic", "num_nodes": str(DEFAULT_TREE_NODES)},
}
#: The options (config fields) of each built-in kind: torch-free copies of the proposers' config dataclasses
#: (tests/test_spec.py keeps them equal). Any other key is refused when a spec is read.
OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "ngram": ("min_ngram", "max_ngram"),
    "suffix": ("max_depth", "max_match", "max_spec_nodes", "spec_factor", "min_token_prob", "min_score",
               "max_request_tokens", "use_global", "global_max_nodes"),
    "layer-skip": ("skip_layers", "min_confidence", "search_budget_s", "cache_dir"),
    "eagle": ("tree", "num_nodes", "top_k", "max_depth", "min_confidence", "head", "cache_dir"),
    "draft-model": ("forward", "vocab"),
    "tree-draft": ("kind", "num_nodes", "branching", "top_k", "max_depth", "sampled_candidates", "forward"),
    "cross-vocab": ("forward",),
}
#: Integer fields checked (and written without leading zeros) when a spec is read.
_INT_FIELDS = {"min_ngram", "max_ngram", "max_spec_nodes", "num_nodes", "top_k", "max_depth", "vocab"}
#: Node-budget fields: integers in 1..MAX_TREE_NODES.
_NODE_FIELDS = {"max_spec_nodes", "num_nodes"}
#: The flag defaults of ``specdecode generate`` / ``serve`` (cliargs.add_drafter_arguments reads them from here).
FLAG_DEFAULTS = {"draft": "ngram", "num_speculative_tokens": DEFAULT_GAMMA, "ngram_min": DEFAULT_NGRAM_MIN,
                 "ngram_max": DEFAULT_NGRAM_MAX, "skip_layers": None, "tree": "none", "tree_nodes": DEFAULT_TREE_NODES}


def _check_not_a_misspelt_kind(word: str) -> None:
    """A bare ``--draft`` word that is no path, hub id or catalog model but a drafter kind's near miss
    (``ngam``) is refused with the kind named, before any model loads."""
    import difflib  # lazy: start-up time (only for bare words)

    if "/" in word or "." in word or ":" in word or word in CATALOG_MODELS or Path(word).exists():
        return
    near = difflib.get_close_matches(word.lower(), BUILTIN_KINDS, n=1, cutoff=0.75)
    if near:
        raise _refuse("draft", f"no drafter or model {word!r}: did you mean the drafter {near[0]!r}? (drafters: "
                               f"{', '.join(BUILTIN_KINDS)}; a draft model is a catalog name, a path or a hub id)")


def _refuse(field: str | None, message: str) -> SpecDecodeError:
    err = SpecDecodeError(message)
    err.field = field
    return err


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter, as the user asked for it: kind, γ, draft model and the kind's own options.

    Attributes:
        kind: a proposer's registry name (:data:`BUILTIN_KINDS` or one registered elsewhere); "none" = plain
            decoding.
        num_speculative_tokens: γ, draft tokens per step (1..64); None = the front end's default.
        model: the draft-model spec of :data:`MODEL_KINDS` (None: the front end's default draft, if any).
        options: (key, value text) pairs of the proposer's config fields, sorted, defaults left out
            (``("max_ngram", "4")``, ``("skip_layers", "3/5/7")``).
        fallback: with kind "suffix", the drafter used when the suffix match scores low (None: none).
    """

    kind: str = NONE
    num_speculative_tokens: int | None = None
    model: str | None = None
    options: tuple[tuple[str, str], ...] = ()
    fallback: DrafterSpec | None = None

    # ------------------------------------------------------------------ reading

    @classmethod
    def parse(cls, text: str, *, bare_model: bool = True) -> DrafterSpec:
        """Read the compact form (or a ``--draft`` word).

        Args:
            text: ``KIND[:KEY=VALUE,...]``, or ``--draft``'s words (``eagle:DIR``, ``suffix:INNER``, a model spec).
            bare_model: read a word that is no built-in kind as a draft-model spec (``--draft``); False reads
                it as a kind (``bench --methods``, where proposers registered elsewhere are named).

        Raises:
            SpecDecodeError: an empty kind, an option without ``=``, a repeated key, γ outside 1..64, or a
                value the kind refuses (n-gram sizes, tree kind, node budget, skip set), naming the key.
        """
        text = (text or "").strip()
        name, colon, rest = text.partition(":")
        kind = name.strip().lower()
        if kind in ("", NONE) and not rest.strip():
            return cls(NONE)
        if not kind:
            raise _refuse("draft", f"empty drafter kind in {text!r}; write e.g. 'ngram:k=5' or 'draft-model:k=4'")
        if kind == "model":
            kind = "draft-model"
        if colon and "=" not in rest and kind in ("eagle", "suffix"):  # --draft eagle:DIR / suffix:INNER
            if kind == "eagle":
                return cls("eagle", options=_normal("eagle", {"head": rest.strip()}, text))
            return cls("suffix", fallback=_fallback(cls.parse(rest), text))
        if kind not in BUILTIN_KINDS and bare_model and "=" not in rest:
            _check_not_a_misspelt_kind(text)
            return cls("draft-model", model=text)  # a model spec (it may hold ':' of its own: smoke:tiny)
        gamma, model, fallback, options, seen = None, None, None, {}, set()
        for item in _split(rest, text):
            key, eq, value = item.partition("=")
            key, value = key.strip().replace("-", "_"), value.strip()
            if not eq or not key:
                raise _refuse("draft", f"option {item!r} in {text!r} is not KEY=VALUE")
            if ("k" if key in GAMMA_KEYS else key) in seen:
                raise _refuse(key, f"option {key!r} given twice in {text!r}")
            seen.add("k" if key in GAMMA_KEYS else key)
            if key in GAMMA_KEYS:
                if not value.isdigit() or not 1 <= int(value) <= MAX_SPECULATIVE_TOKENS:
                    raise _refuse("draft", f"k (γ): num_speculative_tokens must be an integer in "
                                           f"[1, {MAX_SPECULATIVE_TOKENS}], got {value} in {text!r}")
                gamma = int(value)
            elif key == "model":
                model = value or None
            elif key == "fallback" and kind == "suffix":
                inner = value[1:-1] if value.startswith("(") and value.endswith(")") else value
                fallback = _fallback(cls.parse(inner), text)
            else:
                options[key] = value
        return cls(kind, gamma, model, _normal(kind, options, text), fallback)

    @classmethod
    def from_settings(cls, settings: Mapping) -> DrafterSpec:
        """Read the drafter flags of ``generate`` / ``serve`` (``vars(args)``) or a ``--config`` file's keys.

        Args:
            settings: any of ``draft``, ``num_speculative_tokens``, ``ngram_min``, ``ngram_max``, ``skip_layers``,
                ``tree``, ``tree_nodes`` (missing ones take the flags' defaults, :data:`FLAG_DEFAULTS`; ``draft``
                None is plain decoding; other keys are ignored). ``draft`` may be a compact spec, whose own options
                win over the flags.

        Raises:
            SpecDecodeError: as :meth:`parse`; a tree asked of a drafter that builds none; a draft head as
                suffix decoding's fallback.
        """
        s = {**FLAG_DEFAULTS, **{k: v for k, v in settings.items() if v is not None or k in ("skip_layers", "draft")}}
        base = cls.parse(str(s["draft"] or NONE))
        tree = (s["tree"] or "none").strip().lower()
        if tree not in TREE_KINDS:
            raise _refuse("tree", f"tree must be one of {', '.join(TREE_KINDS)}; got {s['tree']!r}")
        _check_nodes("tree_nodes", s["tree_nodes"])
        gamma = base.num_speculative_tokens
        if gamma is None and base.kind != NONE:
            gamma = check_gamma("num_speculative_tokens", s["num_speculative_tokens"])
        return replace(_with_flags(base, s, tree, str(s["draft"]), _written_keys(str(s["draft"]))),
                       num_speculative_tokens=gamma)

    # ------------------------------------------------------------------ writing

    def __str__(self) -> str:
        """The canonical compact form: ``kind:k=G,model=M,fallback=(...),key=value,...`` (keys sorted)."""
        parts = [f"k={self.num_speculative_tokens}"] if self.num_speculative_tokens is not None else []
        if self.model is not None:
            parts.append(f"model={self.model}")
        if self.fallback is not None:
            parts.append(f"fallback=({self.fallback})")
        parts += [f"{k}={v}" for k, v in self.options]
        return self.kind + (":" + ",".join(parts) if parts else "")

    def settings(self) -> dict:
        """The ``generate`` / ``serve`` settings (flag names, as a ``--config`` file holds them) that read back
        as this spec with :meth:`from_settings`: the short ``--draft`` words where they say it all, the compact
        form in ``draft`` otherwise."""
        out: dict = {}
        if self.num_speculative_tokens is not None:
            out["num_speculative_tokens"] = self.num_speculative_tokens
        opts = dict(self.options)
        if self.kind == "ngram" and set(opts) <= {"min_ngram", "max_ngram"}:
            return {"draft": "ngram", **out, "ngram_min": int(opts.get("min_ngram", DEFAULT_NGRAM_MIN)),
                    "ngram_max": int(opts.get("max_ngram", DEFAULT_NGRAM_MAX))}
        if self.kind == "layer-skip" and set(opts) <= {"skip_layers"}:
            skip = opts.get("skip_layers")
            return {"draft": "layer-skip", **out, **({"skip_layers": skip.replace("/", ",")} if skip else {})}
        if self.kind == "tree-draft" and self.model and set(opts) <= {"kind", "num_nodes"}:
            return {"draft": self.model, **out, "tree": opts.get("kind", "dynamic"),
                    "tree_nodes": int(opts.get("num_nodes", DEFAULT_TREE_NODES))}
        if self.kind == "suffix":  # --tree-nodes is its node budget
            rest = tuple(o for o in self.options if o[0] != "max_spec_nodes")
            return {"draft": str(replace(self, num_speculative_tokens=None, options=rest)), **out,
                    "tree_nodes": int(self.option("max_spec_nodes"))}
        if self.kind == "draft-model" and self.model and not opts:
            return {"draft": self.model, **out}
        return {"draft": str(replace(self, num_speculative_tokens=None)), **out}

    # ------------------------------------------------------------------ reading back

    def option(self, key: str, default: str | None = None) -> str | None:
        """An option's value text (its default from :data:`DEFAULTS` when left out, else ``default``)."""
        return dict(self.options).get(key, DEFAULTS.get(self.kind, {}).get(key, default))

    def with_gamma(self, gamma: int | None) -> DrafterSpec:
        """This spec at γ = ``gamma``."""
        return replace(self, num_speculative_tokens=gamma)

    @property
    def family(self) -> str:
        """The spec without γ: specs of one family differ only in γ (a sweep)."""
        return str(self.with_gamma(None))

    @property
    def model_spec(self) -> str | None:
        """The draft model this spec loads (its own or its fallback's); None for model-free drafters."""
        if self.kind in MODEL_KINDS or self.kind not in BUILTIN_KINDS:  # a kind registered elsewhere: its model=
            return self.model
        return self.fallback.model_spec if self.fallback is not None else None

    @property
    def head_path(self) -> str | None:
        """With kind "eagle": the head checkpoint (None: the head cached or shipped for the target)."""
        return self.option("head") if self.kind == "eagle" else None

    @property
    def tree(self) -> str:
        """The token-tree kind this drafter builds ("none" = chains; suffix decoding's trees are its own)."""
        if self.kind == "eagle":
            return self.option("tree", "none")
        if self.kind == "tree-draft":
            return self.option("kind", "dynamic")
        return self.fallback.tree if self.fallback is not None else "none"

    @property
    def skip_layers(self) -> tuple[int, ...] | None:
        """With kind "layer-skip": the decoder layers skipped (None: the cached set, else a search)."""
        raw = self.option("skip_layers") if self.kind == "layer-skip" else None
        return parse_skip_layers(raw.replace("/", ",")) if raw else None

    def describe(self) -> str:
        """The spec in words, for logs and ``/v1/models`` (``str(spec)`` with γ left out)."""
        return self.family

    def check(self) -> DrafterSpec:
        """The checks a front end runs before it loads any model: a kind of :data:`MODEL_KINDS` names its draft
        model (``model=``), and an eagle head path names a checkpoint (this reads the disk). Returns self.

        Raises:
            SpecDecodeError: a model kind without ``model=``; ``eagle:DIR`` where DIR lacks ``config.json`` /
                ``model.safetensors``.
        """
        if self.kind in MODEL_KINDS and not self.model:
            raise _refuse("draft", f"{self.kind} drafts with a second model, but the spec names none: add model=MODEL "
                                   f"(e.g. '{self.kind}:model=qwen2.5-coder-0.5b')")
        head = self.head_path
        if head is not None:
            path = Path(head).expanduser()
            if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
                raise _refuse("draft", f"eagle:{head}: {path} is not a draft-head checkpoint (it needs "
                                       f"config.json and model.safetensors); make one with specdecode train-drafter "
                                       f"--target MODEL, or use --draft eagle for the head of the package / the cache")
        if self.fallback is not None:
            self.fallback.check()
        return self


# ---------------------------------------------------------------------- helpers


def _split(rest: str, text: str) -> list[str]:
    """``a=1,b=(x:c=2,d=3)`` -> ["a=1", "b=(x:c=2,d=3)"]: commas at parenthesis depth 0."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            raise _refuse("draft", f"unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            items.append(rest[start:i])
            start = i + 1
    if depth:
        raise _refuse("draft", f"unbalanced '(' in {text!r}")
    items.append(rest[start:])
    return [item.strip() for item in items if item.strip()]


def _check_nodes(key: str, value) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TREE_NODES:
        raise _refuse(key, f"{key.replace('_', ' ')} ({key}, a node budget) must be an integer in [1, {MAX_TREE_NODES}], "
                            f"got {value!r}")
    return value


def _normal(kind: str, options: Mapping[str, object], text: str) -> tuple[tuple[str, str], ...]:
    """Options checked, written one way, defaults left out, sorted by key."""
    out = {}
    for key, raw in options.items():
        _check_known(kind, key, text)
        value = str(raw).strip()
        if key in _NODE_FIELDS:
            value = str(_check_nodes(key, value))
        elif key in _INT_FIELDS:
            if not value.isdigit():
                raise _refuse(key, f"{key} must be a non-negative integer, got {value!r} in {text!r}")
            value = str(int(value))
        elif key == "skip_layers":
            layers = parse_skip_layers(value.replace("/", ","))
            value = "/".join(map(str, layers)) if layers else ""
        elif (kind, key) in (("eagle", "tree"), ("tree-draft", "kind")):
            value = value.lower()
            if value not in TREE_KINDS or (kind == "tree-draft" and value == "none"):
                allowed = [t for t in TREE_KINDS if kind == "eagle" or t != "none"]
                raise _refuse("tree", f"{key} must be one of {', '.join(allowed)}; got {raw!r} in {text!r}")
        if value and value != DEFAULTS.get(kind, {}).get(key):
            out[key] = value
    if kind == "ngram":
        low, high = int(out.get("min_ngram", DEFAULT_NGRAM_MIN)), int(out.get("max_ngram", DEFAULT_NGRAM_MAX))
        if not 1 <= low <= high:
            raise _refuse("ngram", f"ngram sizes need 1 <= min_ngram <= max_ngram, got {low}, {high} in {text!r}")
    return tuple(sorted(out.items()))


def _check_known(kind: str, key: str, text: str) -> None:
    """Refuse a key that is no option of a built-in ``kind`` (kinds registered elsewhere: at build time)."""
    if kind in OPTIONS and key not in OPTIONS[kind]:
        extra = ("model", "fallback") if kind == "suffix" else ("model",) if kind in MODEL_KINDS else ()
        valid = ", ".join(("k", *extra, *sorted(OPTIONS[kind])))
        raise _refuse("draft", f"{kind} has no option {key!r} (in {text!r}); its options: {valid}")


def _fallback(inner: DrafterSpec, text: str) -> DrafterSpec | None:
    if inner.kind == "eagle":
        raise _refuse("draft", f"{text!r}: a draft head cannot be suffix decoding's fallback (it needs the target's "
                               f"features of every step); use eagle or suffix")
    if inner.kind == "suffix":
        raise _refuse("draft", f"{text!r}: suffix decoding cannot fall back to suffix decoding")
    return None if inner.kind == NONE else inner


def _written_keys(text: str) -> set[str]:
    """The option keys a compact spec writes out (defaults included: they win over the flags too)."""
    rest = text.partition(":")[2]
    if "=" not in rest:
        return set()
    return {item.partition("=")[0].strip().replace("-", "_") for item in _split(rest, text)}


def _with_flags(base: DrafterSpec, s: Mapping, tree: str, text: str, written: set[str] = frozenset()) -> DrafterSpec:
    """``base`` (what ``--draft`` said) with the drafter flags that apply to its kind; its own options win (those
    ``written`` in the compact form too, where they equal the default and ``base`` no longer holds them)."""
    own = dict(base.options)
    if base.kind == "ngram":
        flags = {"min_ngram": s["ngram_min"], "max_ngram": s["ngram_max"]}
    elif base.kind == "layer-skip":
        skip = parse_skip_layers(s["skip_layers"])
        flags = {"skip_layers": "/".join(map(str, skip))} if skip else {}
    elif base.kind == "suffix":
        if base.fallback is None and tree != "none":
            raise _refuse("tree", f"--tree {tree} needs a draft model or head (--draft MODEL, suffix:MODEL or eagle), "
                                  f"not {text!r}")
        fallback = _with_flags(base.fallback, s, tree, text) if base.fallback is not None else None
        return replace(base, fallback=fallback, options=_normal("suffix", {"max_spec_nodes": s["tree_nodes"],
                                                                           **own}, text))
    elif base.kind == "eagle":
        flags = {"tree": tree, "num_nodes": s["tree_nodes"]} if tree != "none" else {}
    elif base.kind == "draft-model" and tree != "none":
        return replace(base, kind="tree-draft", options=_normal("tree-draft", {"kind": tree,
                                                                               "num_nodes": s["tree_nodes"]}, text))
    else:
        flags = {}
    if tree != "none" and base.kind not in ("eagle", "tree-draft", "draft-model"):
        raise _refuse("tree", f"--tree {tree} needs a draft model or head (--draft MODEL, suffix:MODEL or eagle), "
                              f"not {text!r}")
    flags = {k: v for k, v in flags.items() if k not in written}
    return replace(base, options=_normal(base.kind, {**flags, **own}, text))


__all__ = ["BUILTIN_KINDS", "DEFAULTS", "FLAG_DEFAULTS", "GAMMA_KEYS", "MODEL_KINDS", "NONE", "OPTIONS", "DrafterSpec"]
