"""Tokenizer compatibility: whether a draft's token ids mean the same tokens as the target's."""

from __future__ import annotations

from specdecode.models.errors import IncompatibleTokenizerError
from specdecode.models.loaded import LoadedModel

def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids do not mean the same tokens as the target's.

    Compares ``len(tokenizer)``, the token -> id maps and the bos / eos / pad ids. The models'
    embedding rows (``config.vocab_size``) may differ by padding (Qwen pads to 151,936) as long
    as both cover the shared tokenizer; the engine should compare distributions over the
    first ``min(V_target, V_draft)`` logits.

    Raises:
        IncompatibleTokenizerError: naming both models, what differs and what to do.
    """
    problem = _tokenizer_difference(target.tokenizer, draft.tokenizer) or _embedding_problem(target, draft)
    if problem:
        raise incompatible_tokenizer(target.name, draft.name, problem)


def incompatible_tokenizer(target: str, draft: str, problem: str) -> IncompatibleTokenizerError:
    """The refusal of draft ``draft`` for target ``target`` (their specs): ``problem``, then what to do instead."""
    return IncompatibleTokenizerError(
        f"draft {draft!r} cannot be used with target {target!r}: {problem}. Use a draft trained with the same "
        f"tokenizer, or a model-free drafter such as --draft ngram."
    )


def trees_across_vocabularies(target: str | None, draft: str, tree: str,
                              difference: str) -> IncompatibleTokenizerError:
    """The refusal of ``--tree`` with a draft of another tokenizer (specs; target None: "the target"): the pair
    drafts chains across vocabularies (``proposers.cross_vocab``), but a token tree's nodes are the draft's own
    ids, which the target cannot verify."""
    than = "the target" if target is None else f"target {target!r}"
    return IncompatibleTokenizerError(
        f"--tree {tree}: token trees are not available across vocabularies: draft {draft!r} has another tokenizer "
        f"than {than} ({difference}). Drop --tree: the pair drafts chains across vocabularies; or use a draft "
        "with the target's tokenizer for trees."
    )


def _tokenizer_difference(t, d) -> str | None:
    """A sentence saying how two tokenizers differ, or None when they match."""
    vocab_t, vocab_d = t.get_vocab(), d.get_vocab()
    if len(t) != len(d) or vocab_t != vocab_d:
        return f"target vocab {len(t)} tokens, draft {len(d)}; {_first_difference(vocab_t, vocab_d)}"
    for kind in ("bos", "eos", "pad"):
        a, b = getattr(t, f"{kind}_token_id", None), getattr(d, f"{kind}_token_id", None)
        if a != b:
            return f"{kind} token id differs: target {a}, draft {b}"
    return None


def _first_difference(vocab_t: dict[str, int], vocab_d: dict[str, int]) -> str:
    """'first differing token: id 7 is ...' for the smallest id mapped differently."""
    by_id_t = {i: tok for tok, i in vocab_t.items()}
    by_id_d = {i: tok for tok, i in vocab_d.items()}
    for i in range(max(len(by_id_t), len(by_id_d), max(by_id_t, default=0) + 1, max(by_id_d, default=0) + 1)):
        a, b = by_id_t.get(i), by_id_d.get(i)
        if a != b:
            return f"first differing token: id {i} is {a!r} in the target, {b!r} in the draft"
    return "the token -> id maps differ"


def _embedding_problem(target: LoadedModel, draft: LoadedModel) -> str | None:
    """A sentence when either model's embedding has fewer rows than the shared tokenizer."""
    need = len(target.tokenizer)
    for role, m in (("target", target), ("draft", draft)):
        rows = m.model.get_input_embeddings().weight.shape[0]
        if rows < need:
            return f"the {role}'s embedding has {rows} rows, fewer than the tokenizer's {need} tokens"
    return None
