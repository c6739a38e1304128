"""Tiny random models, a tiny tokenizer and a few prompts for the ``--smoke`` preset (no downloads).

The target is a seeded 2-layer Llama in float64 (so greedy ties cannot flip between a
batched verification pass and one-token decoding, and greedy outputs of every method,
ours and Hugging Face's, must agree exactly). The draft is the same network with
seeded noise added to every weight: close enough to be accepted often, not always.
"""

from __future__ import annotations

import copy
import hashlib
import string

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from specdecode.types import SpecDecodeError

#: Model specs the bench runner resolves here instead of through ``load_model``.
SMOKE_TARGET = "smoke:target"
SMOKE_DRAFT = "smoke:draft"
SMOKE_DATASET = "smoke"

_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
_CHARS = string.ascii_lowercase + string.digits + " .,:;!?'()-=+*/_\n"
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

#: (category, text, is_completion): two chat categories and one completion category.
SMOKE_PROMPTS: tuple[tuple[str, str, bool], ...] = (
    ("summarization", "summarize: the cat sat on the mat. the cat sat on the mat again. then the cat slept.", False),
    ("summarization", "summarize: rain fell all day. the river rose. the river rose more. people left.", False),
    ("qa", "what is two plus two? answer with one number.", False),
    ("qa", "name a colour of the sky on a clear day.", False),
    ("coding", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", True),
    ("coding", "for i in range(10):\n    print(i)\nfor j in range(", True),
)


def make_tokenizer():
    """A character-level tokenizer (lowercased) with BOS / EOS / PAD and a chat template.

    Ids: 0 <pad>, 1 <s> (BOS), 2 </s> (EOS), 3 <unk>, then one id per character.
    """
    # lazy: transformers (start-up time)
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*_SPECIALS, *_CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def _tiny_llama(vocab_size: int, seed: int):
    # lazy: transformers (start-up time)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper distributions: decisive argmax, repetitive text
        model.lm_head.weight[2].zero_()  # EOS logit 0: random models should not stop at once
    model.requires_grad_(False)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model


def _noisy_copy(model, seed: int, scale: float):
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale * p.std().clamp_min(1e-6))
        draft.lm_head.weight[2].zero_()
    return draft


def state_sha256(model: torch.nn.Module) -> str:
    """Hex sha256 over the model's state dict (names and raw bytes, in key order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def load_smoke_model(spec: str):
    """``smoke:target`` or ``smoke:draft`` -> a LoadedModel (built in code, seeded, float64).

    Raises:
        SpecDecodeError: any other ``smoke:`` name.
    """
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import LoadedModel

    tokenizer = make_tokenizer()
    target = _tiny_llama(len(tokenizer), seed=0)
    if spec == SMOKE_TARGET:
        model = target
    elif spec == SMOKE_DRAFT:
        model = _noisy_copy(target, seed=1, scale=0.1)
    else:
        raise SpecDecodeError(f"unknown smoke model {spec!r}; use {SMOKE_TARGET!r} or {SMOKE_DRAFT!r}")
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, source="built in code (random, seeded)",
                       sha256=state_sha256(model))
