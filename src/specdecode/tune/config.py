"""``specdecode tune``'s settings (:class:`TuneConfig`), its constants, and the prompts it measures on."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdecode.data import read_prompt_text
from specdecode.errors import SpecDecodeError, json_problem
from specdecode.options import DEFAULT_TREE_NODES
from specdecode.options import WEIGHT_CHOICES, WEIGHT_PRECISIONS
from specdecode.validate import check_sampling, check_threads


#: Drafter kinds ``--drafters`` may name (``draft-model``: every ``--draft`` model given).
DRAFTER_KINDS = ("ngram", "suffix", "layer-skip", "eagle", "draft-model")
#: Token trees of the drafters that make them on request (draft models, EAGLE heads).
TREE_KIND = "dynamic"
PLAIN = "plain"
#: Share of the budget the measurement stages may use; the rest is kept for the confirmation.
MEASURE_SHARE = 0.6
#: n-gram acceptance at which a workload counts as repetitive (for the decision's wording only).
REPETITIVE_ACCEPTANCE = 0.3


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TuneConfig:
    """One ``specdecode tune`` run.

    Attributes:
        target: the target's model spec (``models.load_model``).
        drafts: draft-model specs to try (same tokenizer, or another: cross-vocabulary drafting).
        datasets: prompt sets (``spec-bench:coding:2``, ``humaneval:5``, ...); or ``prompts_file``.
        prompts_file: a file of the user's own prompts (:func:`read_prompts_file`).
        budget_s: wall-clock seconds for the whole run, loading included (> 0).
        max_new_tokens: tokens per prompt in every run.
        temperature: 0 = greedy; > 0 samples (the same seed per prompt in every method).
        threads: torch threads (None: one per idle core, as ``generate``).
        weights, draft_weights, dtype: precisions, as ``generate``'s flags (``auto`` measures once per machine).
        max_gamma: the generous gamma the acceptance runs draft at, and the largest gamma predicted.
        drafters: which kinds of :data:`DRAFTER_KINDS` to try.
        top: candidates confirmed by running them (besides plain decoding).
        repeats: runs of each (prompt, method) in the confirmation; the fastest counts.
        sample_prompts, confirm_prompts: most prompts for the acceptance runs / the confirmation.
        min_gain: speculation is chosen only when measured at least ``1 + min_gain`` times plain decoding.
        tree_nodes: node budget of token trees (and of suffix decoding).
        layer_search_s: most seconds a layer-skip search may take when no skip set is cached.
        chat: chat template on chat prompts (None: on for prompt sets, off for a prompts file).
        seed: prompt i samples with seed + i.
        cache_dir: model cache (None: ``$SPECDECODE_CACHE`` or ~/.cache/specdecode).
        output: the TOML settings file to write (the JSON report goes beside it, ``.json``).

    Raises:
        SpecDecodeError: a value out of range, no prompt source or two, an unknown drafter kind.
    """

    target: str
    drafts: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    prompts_file: str | None = None
    budget_s: float = 600.0
    max_new_tokens: int = 128
    temperature: float = 0.0
    threads: int | None = None
    weights: str = "auto"
    draft_weights: str | None = None
    dtype: str = "float32"
    max_gamma: int = 8
    drafters: tuple[str, ...] = DRAFTER_KINDS
    top: int = 3
    repeats: int = 2
    sample_prompts: int = 4
    confirm_prompts: int = 6
    min_gain: float = 0.05
    tree_nodes: int = DEFAULT_TREE_NODES
    layer_search_s: float = 120.0
    chat: bool | None = None
    seed: int = 0
    cache_dir: str | None = None
    output: str = "specdecode-tune.toml"

    def __post_init__(self) -> None:

        if bool(self.datasets) == bool(self.prompts_file):
            raise SpecDecodeError("give the prompts with one of --prompts FILE or --dataset SPEC")
        if not (isinstance(self.budget_s, (int, float)) and math.isfinite(self.budget_s) and self.budget_s > 0):
            raise SpecDecodeError(f"--budget must be a number of seconds > 0, got {self.budget_s!r}")
        check_sampling(self.temperature, 0, 1.0, self.max_new_tokens, None)
        for name, value, low, high in (("--max-gamma", self.max_gamma, 1, 16), ("--top", self.top, 1, 8),
                                       ("--repeats", self.repeats, 1, 10), ("--tree-nodes", self.tree_nodes, 1, 64),
                                       ("--sample-prompts", self.sample_prompts, 1, 100),
                                       ("--confirm-prompts", self.confirm_prompts, 1, 100)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise SpecDecodeError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        check_threads(self.threads)  # 1..the cores this process may use
        if not 0.0 <= self.min_gain < 1.0:
            raise SpecDecodeError(f"--min-gain must be in [0, 1), got {self.min_gain!r}")
        if self.weights not in WEIGHT_CHOICES:
            raise SpecDecodeError(f"unknown weight precision {self.weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
        if self.draft_weights is not None and self.draft_weights not in WEIGHT_PRECISIONS:
            raise SpecDecodeError(f"unknown draft weight precision {self.draft_weights!r}; choose one of "
                                  f"{', '.join(WEIGHT_PRECISIONS)}")
        unknown = [d for d in self.drafters if d not in DRAFTER_KINDS]
        if unknown or not self.drafters:
            raise SpecDecodeError(f"unknown drafter {unknown[0]!r}; --drafters takes {', '.join(DRAFTER_KINDS)}"
                                  if unknown else "--drafters is empty; name at least one of "
                                  f"{', '.join(DRAFTER_KINDS)}")
        if "draft-model" in self.drafters and not self.drafts and self.drafters != DRAFTER_KINDS:
            raise SpecDecodeError("--drafters draft-model needs --draft MODEL")
        if not self.layer_search_s >= 0:
            raise SpecDecodeError(f"--layer-search must be >= 0 seconds, got {self.layer_search_s!r}")


# --------------------------------------------------------------------------- prompts


def read_prompts_file(path: str | Path):
    """The user's prompts as ``bench.runner.BenchPrompt`` s, in file order.

    Formats, by extension: ``.jsonl``: one JSON string, or object with ``prompt`` (or ``text``, or
    ``turns`` whose first is used) and optional ``category`` / ``id``, per line; ``.json``: a list of the
    same; anything else: plain text, prompts separated by lines holding only ``---`` (without such a
    line, one prompt per non-empty line).

    Raises:
        SpecDecodeError: no such file, unreadable, malformed (the line named), or no prompt in it.
    """
    from specdecode.bench.runner import BenchPrompt  # lazy: torch (the CLI checks a TuneConfig without it)

    file = Path(path).expanduser()
    text = read_prompt_text(file, "--prompts")
    items: list[tuple[str, str, str | None]] = []  # (text, category, id)
    if file.suffix.lower() in (".jsonl", ".json"):
        if file.suffix.lower() == ".json":
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SpecDecodeError(f"--prompts {path}: not valid JSON ({json_problem(exc)})") from None
            if not isinstance(rows, list):
                raise SpecDecodeError(f"--prompts {path}: a .json prompts file holds a list of prompts")
            numbered = [(i + 1, r) for i, r in enumerate(rows)]
        else:
            numbered = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        numbered.append((n, json.loads(line)))
                    except json.JSONDecodeError as exc:
                        raise SpecDecodeError(f"--prompts {path}: line {n} is not JSON ({json_problem(exc)})") from None
        for n, row in numbered:
            items.append(_prompt_of(row, n, path))
    else:
        lines = text.splitlines()
        if any(line.strip() == "---" for line in lines):
            chunks, cur = [], []
            for line in lines:
                if line.strip() == "---":
                    chunks.append("\n".join(cur))
                    cur = []
                else:
                    cur.append(line)
            chunks.append("\n".join(cur))
        else:
            chunks = lines
        items = [(c.strip("\n"), "prompts", None) for c in chunks if c.strip()]
    if not items:
        raise SpecDecodeError(f"--prompts {path}: no prompt in the file")
    return [BenchPrompt(f"prompts/{pid or i}", "prompts", cat, t, False) for i, (t, cat, pid) in enumerate(items)]


def _prompt_of(row, n: int, path) -> tuple[str, str, str | None]:
    if isinstance(row, str):
        text, cat, pid = row, "prompts", None
    elif isinstance(row, dict):
        text = row.get("prompt", row.get("text"))
        if text is None and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        cat, pid = str(row.get("category", "prompts")), row.get("id")
    else:
        text = None
    if not isinstance(text, str) or not text.strip():
        raise SpecDecodeError(f"--prompts {path}: entry {n} has no prompt text (a string, or an object with "
                              f"'prompt', 'text' or 'turns')")
    return text, cat, None if pid is None else str(pid)


def select_tune_prompts(config: TuneConfig):
    """All prompts of the run: the file's, or the prompt sets' (round-robin over categories)."""
    from specdecode.bench.runner import select_prompts  # lazy: torch (the CLI checks a TuneConfig without it)

    if config.prompts_file:
        return read_prompts_file(config.prompts_file)
    return select_prompts(config.datasets, None)


def split_prompts(keys: Sequence[str], sample: int, confirm: int) -> tuple[list[str], list[str]]:
    """(sample keys, held-out keys): the first half (at most ``sample``) measures acceptance, the rest (at most
    ``confirm``) confirms; a single prompt serves both. Prompt sets come round-robin over categories, so both
    halves cover the categories."""
    keys = list(keys)
    if len(keys) <= 1:
        return keys, keys
    half = min(sample, (len(keys) + 1) // 2)
    return keys[:half], keys[half:][:confirm]
