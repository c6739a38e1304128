"""``specdecode train-drafter``: build the self-distilled training set and train a draft head, on a CPU.

Stages, each resumable from its files in the work directory (``<cache>/eagle/<target>/`` by default):

1. ``prompts.jsonl``: the training prompts (:func:`specdecode.eagle.corpus.training_prompts`), with
   the held-out overlap checked empty;
2. ``responses.jsonl``: the target's own answers (batched plain decoding), appended as they finish;
3. ``features.safetensors``: the target's features at the head's layers and its argmax at every
   position of every sequence, plus a held-out tail of sequences for validation;
4. ``train_state.pt``: the head, the optimizer and the step (written every ``save_every`` steps);
   training runs the training-time test (the head unrolled on its own outputs for ``ttt_steps``
   draft positions) with the cross-entropy against the target's argmax, step j weighted 0.8^j;
5. the checkpoint (``--out``, default ``<work>/head``): safetensors + config.json, the loss /
   accuracy plot ``training.png`` and ``training.json`` beside it.

Everything runs on the CPU (bfloat16 autocast where the CPU has AMX / AVX512-BF16) or on CUDA when
``device="cuda"`` is available.

The stages are :mod:`specdecode.eagle.stages`, the settings :mod:`specdecode.eagle.train_config`; this module
is the whole command.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.data import dataset_categories, load_prompts
from specdecode.eagle import corpus
from specdecode.eagle.head import autocast_dtype, save_head  # noqa: F401 - autocast_dtype re-exported
from specdecode.eagle.stages import (  # noqa: F401 - the stages, re-exported here
    build_prompts,
    check_settings,
    default_layers,
    feature_data,
    head_loss,
    packed_batches,
    plot_training,
    split_sequences,
    train_head,
)
from specdecode.eagle.train_config import MIXES, TrainConfig  # noqa: F401 - MIXES re-exported
from specdecode.errors import SpecDecodeError
from specdecode.paths import check_output_dir
from specdecode.types import SamplingParams


# --------------------------------------------------------------------------- the whole command


def held_out_estimate(loaded, head_dir: Path, *, prompts: str = "spec-bench", max_new_tokens: int = 64,
                      gamma: int = 4, shared_dir: Path | None = None) -> dict:
    """Acceptance of the trained head on held-out prompts (greedy, chains, batch 1): speculative vs plain
    decoding of the target as loaded, interleaved prompt by prompt. ``prompts``: a prompt-set spec, or a
    dataset name alone ("spec-bench"): its first prompt of every category.

    Returns:
        {"prompts", "tau" (mean accepted length per target forward, bonus included), "acceptance_rate",
        "accepted_by_position" (rate per draft position), "speedup" (median plain / speculative time)}.
    """
    # lazy: the builder imports the proposers, which import this package (a cycle at import time)
    from specdecode.build import assemble, build_engine
    from specdecode.spec import DrafterSpec

    if ":" in prompts:
        rows = load_prompts(prompts, shared_dir=shared_dir)
    else:
        rows = [p for c in dataset_categories(prompts, shared_dir=shared_dir)
                for p in load_prompts(f"{prompts}:{c}:1", shared_dir=shared_dir)]
    plain = assemble(loaded, None)
    spec = build_engine(loaded, DrafterSpec("eagle", gamma, options=(("head", str(head_dir)),))).engine
    ratios, steps, step_tokens, drafted, accepted = [], 0, 0, 0, 0
    by_pos_d, by_pos_a = [0] * gamma, [0] * gamma
    for p in rows:
        ids = corpus.encode(loaded.tokenizer, corpus.TrainPrompt(p.id, "held-out", p.turns[0], p.is_completion), 1024)
        params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=loaded.eos_token_ids)
        times = []
        for engine in (plain, spec):
            t0 = time.perf_counter()
            with engine.running(ids, params) as (req, _):
                while req.finish_reason is None:
                    engine.step()
            times.append(time.perf_counter() - t0)
            m = req.metrics
        ratios.append(times[0] / times[1])
        steps += m.num_verify_steps
        step_tokens += m.num_step_tokens
        drafted += m.num_drafted_tokens
        accepted += m.num_accepted_tokens
        for j in range(min(gamma, len(m.drafted_by_position))):
            by_pos_d[j] += m.drafted_by_position[j]
            by_pos_a[j] += m.accepted_by_position[j]
    ratios.sort()
    return {"prompts": prompts, "max_new_tokens": max_new_tokens, "gamma": gamma,
            "tau": step_tokens / max(1, steps), "acceptance_rate": accepted / max(1, drafted),
            "accepted_by_position": [a / d if d else None for a, d in zip(by_pos_a, by_pos_d)],
            "speedup": ratios[len(ratios) // 2] if ratios else None}


def run(target: str, cfg: TrainConfig, *, out: str | Path | None = None, work_dir: str | Path | None = None,
        weights: str = "bf16", cache_dir: str | Path | None = None, estimate_prompts: str | None = "spec-bench",
        max_train_seconds: float | None = None, say: Callable[[str], None] = print) -> dict:
    """``specdecode train-drafter``: every stage for ``target``, resuming what ``work_dir`` holds.

    Args:
        target: the target's spec (as ``--target``); weights: the precision it runs in while answering and
            while the features are read ("fp32", "bf16", "int8"): train with the precision you decode with.
        out: the checkpoint directory (default ``<work>/head``, which ``--draft eagle`` finds).
        work_dir: default ``<cache>/eagle/<target>``.
        estimate_prompts: held-out prompts for the final acceptance estimate (None: skip it).
        max_train_seconds: stop training after this long (the state stays resumable).

    Returns:
        the summary written to ``<out>/training.json``.

    Raises:
        SpecDecodeError (ModelLoadError, ...): a target that cannot be loaded; a bad config.
    """
    from specdecode.lowbit import load_in_precision  # lazy: the kernels and models packages (start-up time)
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import default_cache_dir

    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in target.strip("/").replace("/", "__"))
    work = Path(work_dir).expanduser() if work_dir else cache / "eagle" / safe
    out_dir = Path(out).expanduser() if out else work / "head"

    check_output_dir(work, "--work-dir", default=True)  # before the load and about 50 minutes of work
    check_output_dir(out_dir, "--out", default=True)
    say(f"train-drafter: target {target} ({weights}), work directory {work}")
    # the product's loader: int4 of a GGUF model is the file's own blocks, as generate / serve run it
    loaded = load_in_precision(target, weights, cache_dir=cache, progress=True)
    work.mkdir(parents=True, exist_ok=True)  # after the load: a wrong --target leaves nothing behind
    stages = {}

    check_settings(work, "prompts.jsonl", {"mix": cfg.mix, "seed": cfg.seed})
    prompts = build_prompts(work, cfg)
    check_settings(work, "responses.jsonl", {"target": target, "target_sha256": loaded.sha256, "weights": weights,
                                             "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                                             "max_prompt_tokens": cfg.max_prompt_tokens})
    hits = corpus.held_out_overlap(prompts)
    if hits:
        raise SpecDecodeError(f"{len(hits)} training prompts overlap the held-out prompts, e.g. {hits[:2]}")
    say(f"1/5 prompts: {len(prompts)} ({', '.join(f'{k} {v}' for k, v in _count(prompts).items())}); "
        f"held-out overlap (Spec-Bench, HumanEval): none")

    t = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="2/5 answering (self-distillation)", unit="prompt")

    def gen_progress(done, total):
        bar.n = done
        bar.refresh()

    records = corpus.generate_responses(loaded, prompts, work / "responses.jsonl", max_new_tokens=cfg.max_new_tokens,
                                        max_prompt_tokens=cfg.max_prompt_tokens, batch_size=cfg.gen_batch_size,
                                        temperature=cfg.temperature, seed=cfg.seed, progress=gen_progress)
    bar.close()
    ids = {p.id for p in prompts}
    records = [r for r in records if r["id"] in ids]
    stages["answer_s"] = time.perf_counter() - t
    response_tokens = sum(len(r["response_ids"]) for r in records)

    t = time.perf_counter()
    layers = default_layers(loaded.model)
    bar = tqdm(total=len(records), desc="3/5 reading the target's features", unit="seq")
    data = feature_data(loaded, records, work, cfg, layers,
                        progress=lambda d, n: (setattr(bar, "n", d), bar.refresh()))
    bar.close()
    stages["features_s"] = time.perf_counter() - t
    say(f"   corpus: {len(records)} sequences, {int(data['tokens'].numel())} tokens "
        f"({response_tokens} self-distilled response tokens), features of layers {list(layers)}")

    t = time.perf_counter()
    sha = loaded.sha256
    bar = tqdm(desc="4/5 training (training-time test)", unit="step")

    def train_progress(rec):
        bar.total = rec["total_steps"]
        bar.n = rec["step"]
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in rec["acc"]))
        bar.refresh()

    head, record = train_head(loaded, data, work, cfg, target_name=target, target_sha256=sha,
                              report=train_progress, max_seconds=max_train_seconds)
    bar.close()
    stages["train_s"] = time.perf_counter() - t
    head.config.training.update({"weights": weights, "response_tokens": response_tokens,
                                 "corpus_tokens": int(data["tokens"].numel()), "sequences": len(records),
                                 "prompt_sources": _count(prompts)})
    save_head(head, out_dir)
    plot_training(record, out_dir / "training.png")
    val = record["validation_accuracy_per_step"]
    say(f"5/5 saved {out_dir} ({sum(f.stat().st_size for f in out_dir.iterdir()) / 1e6:.1f} MB); validation "
        f"accuracy per draft position: {', '.join(f'{v:.3f}' for v in val)}")
    estimate = None
    if estimate_prompts and record["steps"] >= record["total_steps"]:
        t = time.perf_counter()
        estimate = held_out_estimate(loaded, out_dir, prompts=estimate_prompts)
        stages["estimate_s"] = time.perf_counter() - t
        say(f"   held-out estimate ({estimate_prompts}, greedy, gamma {estimate['gamma']}): tau "
            f"{estimate['tau']:.2f}, acceptance {estimate['acceptance_rate']:.2f}, speedup x{estimate['speedup']:.2f}")
    summary = {"target": target, "weights": weights, "work_dir": str(work), "out": str(out_dir),
               "wall_s": time.perf_counter() - t0, "stages_s": stages, "estimate": estimate,
               **{k: v for k, v in record.items() if k != "history"}, "corpus_tokens": int(data["tokens"].numel()),
               "response_tokens": response_tokens, "sequences": len(records), "prompt_sources": _count(prompts)}
    (out_dir / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    with (out_dir / "history.jsonl").open("w") as f:
        for rec in record["history"]:
            f.write(json.dumps(rec) + "\n")
    return summary


def _count(prompts) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in prompts:
        out[p.source] = out.get(p.source, 0) + 1
    return out


__all__ = ["MIXES", "TrainConfig", "autocast_dtype", "build_prompts", "check_settings", "feature_data",
           "head_loss", "held_out_estimate", "packed_batches", "plot_training", "run", "save_head",
           "split_sequences", "train_head"]
