"""The peer: Hugging Face transformers' own generation on the same target, prompts and budget.

- ``plain``: ``model.generate`` with no assistant (HF speedups are measured against it);
- ``assisted``: ``generate(assistant_model=draft)``, the draft-model method's peer;
- ``prompt-lookup``: ``generate(prompt_lookup_num_tokens=gamma)``, the n-gram method's peer.

Every call gets an explicit GenerationConfig (greedy or plain temperature sampling, no
top-k / top-p / repetition penalty), so a model's own generation defaults cannot make the
peer decode something else than we do. The assistant drafts exactly gamma tokens per step
(``num_assistant_tokens_schedule="constant"``, confidence threshold off): the comparison is
of implementations at the same gamma, not of draft-length heuristics.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

#: Our proposer name -> the peer method that does the same thing in transformers.
PEER_OF: dict[str, str] = {"draft-model": "assisted", "cross-vocab": "assisted", "ngram": "prompt-lookup"}


@dataclass
class PeerResult:
    """One Hugging Face generation: new token ids (prompt excluded) and the wall time around ``generate``."""

    token_ids: list[int]
    wall_s: float
    finish_reason: str


def generation_config(max_new_tokens: int, temperature: float, eos_token_ids: Sequence[int]):
    """An explicit GenerationConfig matching our SamplingParams (top-k / top-p off, batch size 1)."""
    # lazy: transformers (start-up time)
    from transformers import GenerationConfig

    eos = list(eos_token_ids)
    sampling = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else 1.0,
        top_k=0,
        top_p=1.0,
        repetition_penalty=1.0,
        num_beams=1,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )


@contextlib.contextmanager
def constant_assistant(draft: torch.nn.Module, gamma: int) -> Iterator[None]:
    """Make the assistant draft exactly ``gamma`` tokens per step; restore its generation config after."""
    cfg = draft.generation_config
    saved = {k: getattr(cfg, k, None) for k in
             ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    cfg.num_assistant_tokens = gamma
    cfg.num_assistant_tokens_schedule = "constant"
    cfg.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)


@torch.inference_mode()
def hf_generate(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_ids: Sequence[int] = (),
    method: str = "plain",
    gamma: int = 4,
    draft: torch.nn.Module | None = None,
    max_ngram: int = 3,
    tokenizer=None,
    assistant_tokenizer=None,
) -> PeerResult:
    """Run transformers' ``generate`` for one prompt (batch size 1) and time it.

    Args:
        model: the target (the same object our engine runs).
        prompt_ids: [L] int64 token ids.
        max_new_tokens, temperature, seed, eos_token_ids: as in our SamplingParams.
        method: "plain", "assisted" (needs ``draft``) or "prompt-lookup".
        gamma: draft tokens per step (``num_assistant_tokens`` / ``prompt_lookup_num_tokens``).
        draft: the assistant model for "assisted".
        max_ngram: ``max_matching_ngram_size`` for "prompt-lookup".
        tokenizer, assistant_tokenizer: the target's and the draft's tokenizers when they differ:
            "assisted" then runs transformers' universal assisted generation (the draft's text
            re-tokenized for the target), the peer of our cross-vocabulary drafting.

    Returns:
        PeerResult; ``wall_s`` covers the whole ``generate`` call, prefill included, as ours does.

    Raises:
        ValueError: unknown method, or "assisted" without a draft.
    """
    kwargs: dict = {}
    guard: contextlib.AbstractContextManager = contextlib.nullcontext()
    if method == "assisted":
        if draft is None:
            raise ValueError("the assisted peer needs a draft model")
        kwargs["assistant_model"] = draft
        guard = constant_assistant(draft, gamma)
    elif method == "prompt-lookup":
        kwargs.update(prompt_lookup_num_tokens=gamma, max_matching_ngram_size=max_ngram)
    elif method != "plain":
        raise ValueError(f"unknown peer method {method!r}; use plain, assisted or prompt-lookup")
    gen_cfg = generation_config(max_new_tokens, temperature, eos_token_ids)
    for k, v in kwargs.items():  # generation options go on the config, models on the call
        if k != "assistant_model":
            setattr(gen_cfg, k, v)
    call = {"assistant_model": kwargs["assistant_model"]} if "assistant_model" in kwargs else {}
    if call and tokenizer is not None and assistant_tokenizer is not None:
        call.update(tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64)
    torch.manual_seed(seed)
    with guard:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg, **call)
        wall = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    stopped = bool(new) and new[-1] in set(eos_token_ids)
    return PeerResult(token_ids=new, wall_s=wall, finish_reason="stop" if stopped else "length")
