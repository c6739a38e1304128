"""Drafts with another tokenizer (``proposers.cross_vocab``): greedy equality with plain decoding for tiny
models with deliberately different tokenizers, the intersection map, full acceptance for a draft that is the
target under permuted ids, the exact output distribution when sampling (with a negative control), and
rollback across the re-tokenization boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY_MERGES, TINY_SPECIALS, make_tiny_model, make_tiny_tokenizer
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import CrossVocabProposer, VocabMap
from specdecode.types import SamplingParams
from tiny import assert_cache_is_fresh_prefill, chi2_pvalue, exact_joint

PROMPTS = ["the cat and the dog", "in the end, there", "and then: the end!", "on and on and on"]


def _char_tokenizer(merges, extra_chars: str = "", drop: str = "", specials_last: bool = False):
    """A character-level BPE like the tiny target's, with other merges, other characters, and the special
    tokens at other ids."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.ascii_lowercase + string.digits + " .,!?:;'\n-()" + extra_chars if c not in drop]
    body = [*chars, *("".join(m) for m in merges)]
    tokens = [*body, *TINY_SPECIALS] if specials_last else [*TINY_SPECIALS, *body]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(merges), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def _byte_tokenizer(merges):
    """A byte-level BPE (GPT-2 alphabet) with the given merges (pairs of byte-level symbols)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = ["<pad>", "<eos>", *alphabet, *("".join(m) for m in merges)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def _model(tokenizer, seed: int):
    model = make_tiny_model(len(tokenizer), seed=seed)
    model.config.eos_token_id = tokenizer.eos_token_id
    return model.to(torch.float64)


class _Totals:
    def __init__(self, outputs) -> None:
        self.num_drafted_tokens = sum(o.metrics.num_drafted_tokens for o in outputs)
        self.num_accepted_tokens = sum(o.metrics.num_accepted_tokens for o in outputs)


def _greedy(model, proposer, prompts, tokenizer, gamma: int, max_new: int = 24, batch: int = 1):
    """Greedy outputs of every prompt, and the drafted / accepted totals."""
    engine = SpeculativeEngine(model, proposer, EngineConfig(num_speculative_tokens=gamma, max_batch_size=batch))
    params = SamplingParams(max_new_tokens=max_new, eos_token_ids=[tokenizer.eos_token_id])
    outputs = engine.generate_batch([tokenizer(p)["input_ids"] for p in prompts], params)
    return _Totals(outputs), [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def target_pair():
    tok = make_tiny_tokenizer()
    return _model(tok, seed=0), tok


DRAFT_TOKENIZERS = {
    "other merges": lambda: _char_tokenizer((("h", "e"), ("t", "he"), ("n", "d"), ("a", "nd"), (" ", "t"))),
    "a token only the draft has, specials at other ids": lambda: _char_tokenizer(
        (*TINY_MERGES, ("o", "g"), ("d", "og")), extra_chars="#", specials_last=True),
    "characters the draft lacks": lambda: _char_tokenizer((("t", "h"),), drop="xyzq"),
}


@pytest.mark.parametrize("kind", DRAFT_TOKENIZERS)
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_equals_plain_decoding_across_vocabularies(target_pair, kind, gamma):
    model, tok = target_pair
    draft_tok = DRAFT_TOKENIZERS[kind]()
    draft = _model(draft_tok, seed=3)
    _, plain = _greedy(model, None, PROMPTS, tok, gamma)
    proposer = CrossVocabProposer(draft, tok, draft_tok, model.config.vocab_size)
    totals, spec = _greedy(model, proposer, PROMPTS, tok, gamma)
    assert spec == plain
    assert totals.num_drafted_tokens > 0


def test_greedy_batched_rows_equal_plain(target_pair):
    model, tok = target_pair
    draft_tok = DRAFT_TOKENIZERS["other merges"]()
    proposer = CrossVocabProposer(_model(draft_tok, seed=3), tok, draft_tok, model.config.vocab_size)
    _, plain = _greedy(model, None, PROMPTS, tok, 3)
    _, spec = _greedy(model, proposer, PROMPTS, tok, 3, batch=4)
    assert spec == plain


def test_multibyte_characters_split_differently_and_a_special_token():
    """Byte-level vocabularies: the target merges 'é' (two bytes) into one token, the draft does not and
    merges other pairs; random models emit arbitrary bytes, so partial characters cross every boundary."""
    t_tok = _byte_tokenizer((("Ã", "©"), ("c", "a"), ("ca", "f"), ("Ġ", "t")))
    d_tok = _byte_tokenizer((("a", "f"), ("Ġ", "c"), ("Ã", "¨")))
    target, draft = _model(t_tok, seed=1), _model(d_tok, seed=2)
    prompts = ["café au lait", "è é ê", "the ca<eos>"]
    for gamma in (1, 3, 5):
        _, plain = _greedy(target, None, prompts, t_tok, gamma, max_new=20)
        _, spec = _greedy(target, CrossVocabProposer(draft, t_tok, d_tok, target.config.vocab_size), prompts,
                          t_tok, gamma, max_new=20)
        assert spec == plain


def test_vocab_map_pairs_tokens_of_equal_bytes():
    t_tok = make_tiny_tokenizer()
    d_tok = DRAFT_TOKENIZERS["a token only the draft has, specials at other ids"]()
    m = VocabMap(t_tok, d_tok, len(t_tok), len(d_tok))
    for j, i in m.to_draft.items():
        assert t_tok.convert_ids_to_tokens(j) == d_tok.convert_ids_to_tokens(i)
    assert m.to_draft[t_tok.eos_token_id] == d_tok.eos_token_id != t_tok.eos_token_id
    assert d_tok.convert_tokens_to_ids("#") not in m.draft_ids.tolist()  # only the draft has it
    shared = set(t_tok.get_vocab()) & set(d_tok.get_vocab())
    assert len(m) == len(shared) and "shared" in m.describe()


def _permuted(model, tok, seed: int = 5):
    """The target's own model and tokenizer with every id permuted: the same function under other ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = tok.get_vocab()
    perm = np.random.default_rng(seed).permutation(len(vocab))  # new id of old id
    spec = tok.backend_tokenizer.to_str()
    import json

    data = json.loads(spec)
    data["model"]["vocab"] = {t: int(perm[i]) for t, i in data["model"]["vocab"].items()}
    for added in data.get("added_tokens", []):
        added["id"] = int(perm[added["id"]])
    new_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<bos>",
                                      eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    draft = _model(tok, seed=0)
    draft.load_state_dict(model.state_dict())
    inverse = torch.as_tensor(np.argsort(perm))  # old id of new id
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[inverse])
        draft.lm_head.weight.copy_(model.lm_head.weight[inverse])
    draft.config.eos_token_id = new_tok.eos_token_id
    return draft, new_tok


def test_a_draft_equal_to_the_target_under_permuted_ids_is_always_accepted(target_pair):
    model, tok = target_pair
    draft, d_tok = _permuted(model, tok)
    assert d_tok.convert_tokens_to_ids("the") != tok.convert_tokens_to_ids("the")
    proposer = CrossVocabProposer(draft, tok, d_tok, model.config.vocab_size)
    m, spec = _greedy(model, proposer, PROMPTS, tok, 4, max_new=32)
    _, plain = _greedy(model, None, PROMPTS, tok, 4, max_new=32)
    assert spec == plain
    assert m.num_accepted_tokens / m.num_drafted_tokens > 0.9  # re-tokenization at word starts may cost a few


@pytest.mark.slow
def test_sampling_follows_the_targets_distribution_and_a_wrong_q_is_caught(target_pair):
    """Token-level intersection: 2 sampled tokens, 3,000 times, against the target's exact joint law (chi-square);
    the same proposer reporting a sharpened q (not the law it drew from) must fail the same test."""
    _, tok = target_pair
    model = _model(tok, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # a sharp law: few outcomes hold most of the mass
    draft_tok = DRAFT_TOKENIZERS["characters the draft lacks"]()  # some target tokens are outside the intersection
    draft = _model(draft_tok, seed=0)  # the target's weights on the tokens both have: q = p on the intersection
    state = {k: v for k, v in model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    draft.load_state_dict(state, strict=False)
    t_vocab = tok.get_vocab()
    with torch.no_grad():
        for token, i in draft_tok.get_vocab().items():
            if token in t_vocab:
                draft.model.embed_tokens.weight[i] = model.model.embed_tokens.weight[t_vocab[token]]
                draft.lm_head.weight[i] = model.lm_head.weight[t_vocab[token]]
    prompt = tok("the cat")["input_ids"]
    exact = exact_joint(model, prompt, 2)
    vocab = model.config.vocab_size

    class WrongQ(CrossVocabProposer):
        def propose(self, batch, max_tokens):
            import dataclasses

            out = []
            for d in super().propose(batch, max_tokens):
                if d.draft_probs is not None:
                    q = d.draft_probs.clone() ** 0.25  # not the law the tokens were drawn from (flatter)
                    d = dataclasses.replace(d, draft_probs=q / q.sum(-1, keepdim=True))
                out.append(d)
            return out

    def counts(proposer_cls, n: int = 3000) -> np.ndarray:
        engine = SpeculativeEngine(model, proposer_cls(draft, tok, draft_tok, vocab),
                                   EngineConfig(num_speculative_tokens=2, max_batch_size=64))  # rows independent
        out = np.zeros(vocab ** 2)
        # 4 tokens: the first comes from the prefill, the second from verifying the draft; the first two's
        # joint law is the target's 2-token law
        # coupled=False: standard rejection sampling with q (a seeded request would default to the coupled mode)
        outputs = engine.generate_batch([prompt] * n, [SamplingParams(max_new_tokens=4, temperature=1.0, seed=s,
                                                                      ignore_eos=True, coupled=False)
                                                       for s in range(n)])
        for o in outputs:
            out[np.ravel_multi_index(o.token_ids[:2], (vocab, vocab))] += 1
        return out, _Totals(outputs)

    good, metrics = counts(CrossVocabProposer)
    assert metrics.num_accepted_tokens > 0
    assert chi2_pvalue(good, exact) > 1e-3
    bad, _ = counts(WrongQ)
    assert chi2_pvalue(bad, exact) < 1e-6


def test_rollback_across_the_retokenization_boundary(target_pair):
    """A draft that disagrees often: after every step the draft's cache holds exactly the re-encoded committed
    text (a fresh prefill of it), whatever position the rejection came at."""
    model, tok = target_pair
    draft, draft_tok = _permuted(model, tok)
    with torch.no_grad():  # the target under other ids, with noise: agrees often, not always
        gen = torch.Generator().manual_seed(0)
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=gen, dtype=torch.float64) * 0.1)
    proposer = CrossVocabProposer(draft, tok, draft_tok, model.config.vocab_size)
    engine = SpeculativeEngine(model, proposer, EngineConfig(num_speculative_tokens=5))
    params = SamplingParams(max_new_tokens=40, eos_token_ids=[tok.eos_token_id], ignore_eos=True)
    request, _ = engine.add(tok("the cat and the")["input_ids"], params)
    accepted_at = set()
    while request.finish_reason is None:
        for req, out in engine.step():
            if req is request and out.num_drafted:
                accepted_at.add(out.num_accepted)
        if request.finish_reason is None:  # synced, the cache is a prefix of the committed text's draft ids
            ids = proposer.context_ids(request.ctx)
            runner = proposer.runner
            runner.sync(0, ids)
            assert runner.ids[0] == ids[: len(runner.ids[0])] and len(runner.ids[0]) > 0
            assert_cache_is_fresh_prefill(runner, 0)
    assert len(accepted_at) >= 2, accepted_at  # rejections at more than one position


def test_generate_and_serve_take_a_draft_with_another_tokenizer(tmp_path):
    """The front ends build the cross-vocabulary proposer from a --draft with another tokenizer: the server's
    greedy completion equals plain decoding's."""
    from fastapi.testclient import TestClient

    from conftest import save_tiny_model_dir
    from specdecode.server import ServeOptions, create_app, load_state

    target_dir = save_tiny_model_dir(tmp_path / "target", seed=0)
    draft_dir = tmp_path / "draft"
    draft_tok = DRAFT_TOKENIZERS["other merges"]()
    make_tiny_model(len(draft_tok), seed=2).save_pretrained(draft_dir)
    draft_tok.save_pretrained(draft_dir)
    texts = {}
    for draft in ("none", str(draft_dir)):
        state = load_state(ServeOptions(target=str(target_dir), draft=draft, weights="fp32", policy="fixed",
                                        num_speculative_tokens=3), progress=False)
        if draft != "none":
            assert isinstance(state.engine.proposer, CrossVocabProposer)
        with TestClient(create_app(state)) as client:
            r = client.post("/v1/completions", json={"model": str(target_dir), "prompt": "the cat and the",
                                                     "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            texts[draft] = r.json()["choices"][0]["token_ids"]
    assert texts[str(draft_dir)] == texts["none"]
