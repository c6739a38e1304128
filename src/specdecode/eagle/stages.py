"""The stages of EAGLE head training, each resumable from its files in the work directory: the prompts, the
target's features on them, the head's training (with its loss, evaluation and plot), and the checks that a
work directory's settings and weights are the ones asked for."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.eagle import corpus
from specdecode.eagle.head import EagleConfig, EagleHead, autocast_dtype, default_feature_layers
from specdecode.eagle.train_config import MIXES, TrainConfig
from specdecode.errors import SpecDecodeError
from specdecode.lowbit import LOWBIT_TYPES


# --------------------------------------------------------------------------- the stages


def build_prompts(work: Path, cfg: TrainConfig, shared_dir: Path | None = None) -> list[corpus.TrainPrompt]:
    """Stage 1: the training prompts, recorded in ``work/prompts.jsonl`` (reused when present)."""
    path = work / "prompts.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        prompts = [corpus.TrainPrompt(**r) for r in rows]
        if len(prompts) >= cfg.num_prompts:
            return prompts[: cfg.num_prompts]
    mix = {k: v for k, v in MIXES[cfg.mix].items()}
    total = sum(mix.values())
    if cfg.num_prompts > total:
        mix = {k: math.ceil(v * cfg.num_prompts / total) for k, v in mix.items()}
    prompts = corpus.training_prompts(mix, seed=cfg.seed, shared_dir=shared_dir)[: cfg.num_prompts]
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps(asdict(p)) + "\n")
    return prompts


def split_sequences(n: int, held_out_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) sequence indices, a seeded split."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = int(round(n * held_out_fraction)) if n > 1 else 0
    k = min(max(k, 1 if held_out_fraction > 0 and n > 1 else 0), n - 1) if n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


def packed_batches(data: dict, seqs: list[int], max_length: int, batch_tokens: int, rng: random.Random):
    """Batches of whole sequences (shuffled), right-padded: yields (features [B, T, F], next_ids [B, T],
    labels [B, T], mask [B, T] bool) for positions t = 0..T-1 with x_{t+1} known and label at t + 1."""
    order = list(seqs)
    rng.shuffle(order)
    starts = data["starts"]
    batch: list[int] = []
    width = 0
    for s in order + [None]:
        if s is not None:
            n = int(starts[s + 1] - starts[s]) - 1
            if n < 1:
                continue
            if not batch or (len(batch) + 1) * max(width, n) <= batch_tokens:
                batch.append(s)
                width = max(width, n)
                continue
        if batch:
            yield _collate(data, batch, width)
        batch, width = ([s], int(starts[s + 1] - starts[s]) - 1) if s is not None else ([], 0)


def _collate(data: dict, batch: list[int], width: int):
    starts, loss_from = data["starts"], data["loss_from"]
    f = data["features"].shape[1]
    feats = torch.zeros(len(batch), width, f, dtype=data["features"].dtype)
    next_ids = torch.zeros(len(batch), width, dtype=torch.int64)
    labels = torch.full((len(batch), width), -1, dtype=torch.int64)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, s in enumerate(batch):
        a, b = int(starts[s]), int(starts[s + 1])
        n = b - a - 1
        feats[row, :n] = data["features"][a : b - 1]
        next_ids[row, :n] = data["tokens"][a + 1 : b]
        labels[row, :n] = data["labels"][a + 1 : b]  # the target's argmax after x_{t+1}: scores x_{t+2}
        # the loss covers the response, plus the prompt's last positions (the first drafts of an answer)
        first = max(0, int(loss_from[s]) - 2)
        mask[row, first:n] = True
    return feats, next_ids, labels, mask


def head_loss(head: EagleHead, batch, steps: int, t2d: torch.Tensor, autocast: torch.dtype | None,
              device: str = "cpu"):
    """The training-time-test loss of one batch and its per-step accuracy.

    Returns:
        (loss: a scalar tensor, [steps] accuracies: the argmax of the head, mapped to target ids,
        equal to the target's argmax, over the positions valid for that step; labels outside the
        draft vocabulary count as misses, as they would while drafting).
    """
    feats, next_ids, labels, mask = (x.to(device) for x in batch)
    ctx = torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=autocast) \
        if autocast is not None else contextlib.nullcontext()
    with ctx:
        outs = head.unrolled(feats, next_ids, steps)
    d_labels = torch.where(labels >= 0, t2d[labels.clamp_min(0)], -1)  # [B, T] index in the draft vocab, -1 outside
    total = torch.zeros((), device=device)
    weights = 0.0
    accs = []
    for j, out in enumerate(outs):
        valid = mask.clone()
        valid[:, :j] = False
        with ctx:
            logits = head.logits(out[valid])  # [n, Vd]
        target = d_labels[valid]
        inside = target >= 0
        w = 0.8 ** j
        if inside.any():
            total = total + w * torch.nn.functional.cross_entropy(logits[inside], target[inside])
            weights += w
        pred = head.d2t[logits.argmax(-1)]
        accs.append(float((pred == labels[valid]).float().mean()) if valid.any() else float("nan"))
    return total / max(weights, 1e-9), accs


@torch.no_grad()
def evaluate(head: EagleHead, data: dict, seqs: list[int], cfg: TrainConfig, t2d: torch.Tensor,
             autocast) -> list[float]:
    """Accuracy per unrolled step over the validation sequences (token-weighted)."""
    head.eval()
    hits = [0.0] * cfg.ttt_steps
    counts = [0] * cfg.ttt_steps
    for batch in packed_batches(data, seqs, cfg.max_length, cfg.batch_tokens, random.Random(0)):
        _, accs = head_loss(head, batch, cfg.ttt_steps, t2d, autocast, cfg.device)
        n = int(batch[3].sum())
        for j, a in enumerate(accs):
            if not math.isnan(a):
                hits[j] += a * n
                counts[j] += n
    head.train()
    return [h / c if c else float("nan") for h, c in zip(hits, counts)]


def train_head(loaded, data: dict, work: Path, cfg: TrainConfig, *, target_name: str, target_sha256: str | None,
               report: Callable[[dict], None] | None = None, max_seconds: float | None = None) -> tuple[EagleHead, dict]:
    """Stage 4: train a head on ``data`` (from :func:`corpus.extract_features`), resuming ``work/train_state.pt``.

    Returns:
        (the trained head, in float32 on the CPU; the training record: losses and accuracies per logged
        step, validation accuracy per unrolled step, wall seconds, tokens).
    """
    torch.manual_seed(cfg.seed)
    model = loaded.model
    eos = list(loaded.eos_token_ids) + list(getattr(loaded.tokenizer, "all_special_ids", []) or [])
    vocab = corpus.draft_vocabulary(data["labels"], data["tokens"], cfg.draft_vocab_size,
                                    int(model.get_input_embeddings().weight.shape[0]), eos)
    head_cfg = EagleConfig.for_target(model, vocab, feature_layers=data.get("feature_layers"),
                                      intermediate_size=cfg.intermediate_size, train_lm_head=cfg.train_lm_head,
                                      target_name=target_name, target_sha256=target_sha256)
    head = EagleHead(head_cfg).attach(model, init=True).float()
    head.embed = head.embed.float()
    head.lm_head_weight.data = head.lm_head_weight.data.float()
    head.to(cfg.device)
    t2d = torch.full((head_cfg.vocab_size,), -1, dtype=torch.int64)
    t2d[head.d2t.cpu()] = torch.arange(len(vocab))
    t2d = t2d.to(cfg.device)
    train_seqs, val_seqs = split_sequences(len(data["starts"]) - 1, cfg.held_out_fraction, cfg.seed)
    train_tokens = sum(int(data["starts"][s + 1] - data["starts"][s]) for s in train_seqs)
    steps_per_epoch = sum(1 for _ in packed_batches(data, train_seqs, cfg.max_length, cfg.batch_tokens,
                                                    random.Random(0)))
    if steps_per_epoch == 0:
        raise SpecDecodeError("no training batch: every training sequence is shorter than 2 tokens; answer more "
                              "prompts (--prompts) or longer (--max-new-tokens)")
    total_steps = max(1, int(round(cfg.epochs * steps_per_epoch)))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    state_path = work / "train_state.pt"
    step, history, elapsed, epoch, in_epoch = 0, [], 0.0, 0, 0
    # what must not change between a run and its resumption (device and threads may)
    identity = {**{k: v for k, v in asdict(cfg).items() if k not in ("device", "threads")},
                "head": {k: v for k, v in asdict(head_cfg).items() if k != "training"}}
    if state_path.is_file():
        state = torch.load(state_path, map_location=cfg.device, weights_only=False)
        if state.get("identity") != identity:
            raise SpecDecodeError(f"{state_path} was written by a run with other settings; run with those, or "
                                  f"delete it (or choose another --work-dir) to start the training over")
        head.load_state_dict(state["head"], strict=True)
        opt.load_state_dict(state["optimizer"])
        step, history, elapsed = state["step"], state["history"], state["elapsed_s"]
        epoch, in_epoch = state["epoch"], state["in_epoch"]
    autocast = autocast_dtype(cfg.device)
    head.train()

    def epoch_batches(e: int):  # epoch e's batch order depends on (seed, e) only: a resumed run replays it
        return packed_batches(data, train_seqs, cfg.max_length, cfg.batch_tokens, random.Random(cfg.seed * 1000 + e))

    batches = epoch_batches(epoch)
    for _ in range(in_epoch):
        next(batches, None)
    t_start = time.perf_counter() - elapsed
    while step < total_steps:
        batch = next(batches, None)
        if batch is None:
            epoch, in_epoch = epoch + 1, 0
            batches = epoch_batches(epoch)
            continue
        in_epoch += 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss, accs = head_loss(head, batch, cfg.ttt_steps, t2d, autocast, cfg.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        rec = {"step": step, "loss": float(loss.detach()), "acc": accs, "lr": lr_at(step - 1),
               "elapsed_s": time.perf_counter() - t_start}
        history.append(rec)
        if report is not None:
            report({**rec, "total_steps": total_steps})
        stop = max_seconds is not None and time.perf_counter() - t_start > max_seconds
        if step % cfg.save_every == 0 or step == total_steps or stop:
            _save_state(state_path, head, opt, step, history, time.perf_counter() - t_start, identity, epoch, in_epoch)
        if stop:
            break
    val = evaluate(head, data, val_seqs, cfg, t2d, autocast) if val_seqs else []
    record = {
        "steps": step, "total_steps": total_steps, "steps_per_epoch": steps_per_epoch,
        "train_sequences": len(train_seqs), "train_tokens": train_tokens, "validation_sequences": len(val_seqs),
        "validation_accuracy_per_step": val, "train_seconds": time.perf_counter() - t_start,
        "history": history, "autocast": str(autocast), "config": asdict(cfg),
    }
    head = head.cpu().float().eval()
    head.config.training = {k: v for k, v in record.items() if k != "history"}
    return head, record


def _save_state(path: Path, head, opt, step, history, elapsed, identity, epoch, in_epoch) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": dict(head.state_dict()), "optimizer": opt.state_dict(), "step": step, "history": history,
                "elapsed_s": elapsed, "identity": identity, "epoch": epoch, "in_epoch": in_epoch}, tmp)
    tmp.replace(path)


def plot_training(record: dict, path: Path) -> Path:
    """Loss and accuracy per unrolled step against the training step (a PNG)."""
    # lazy: matplotlib, its Agg backend chosen before pyplot (start-up time)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib, its Agg backend chosen before pyplot (start-up time)
    import matplotlib.pyplot as plt

    hist = record["history"]
    steps = [h["step"] for h in hist]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))

    def smooth(values, k=10):
        out, acc = [], []
        for v in values:
            acc.append(v)
            acc = acc[-k:]
            out.append(sum(acc) / len(acc))
        return out

    a.plot(steps, smooth([h["loss"] for h in hist]))
    a.set_xlabel("step")
    a.set_ylabel("loss (smoothed)")
    a.set_title("training-time-test loss")
    k = len(hist[0]["acc"]) if hist else 0
    for j in range(k):
        b.plot(steps, smooth([h["acc"][j] for h in hist]), label=f"draft position {j + 1}")
    for j, v in enumerate(record.get("validation_accuracy_per_step") or []):
        b.axhline(v, color=f"C{j}", linestyle=":", linewidth=1)
    b.set_xlabel("step")
    b.set_ylabel("top-1 = target argmax")
    b.set_title("accuracy per unrolled step (dotted: validation)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def feature_data(loaded, records: list[dict], work: Path, cfg: TrainConfig, feature_layers,
                 progress=None) -> dict:
    """Stage 3: features of every sequence, cached in ``work/features.safetensors`` (recomputed when the
    records, the layers or the length changed)."""
    path = work / "features.safetensors"
    key = {"n": len(records), "layers": list(feature_layers), "max_length": cfg.max_length,
           "target": getattr(loaded, "sha256", None), "weights": _weights_of(loaded.model),
           "ids": hashlib.sha1("".join(r["id"] for r in records).encode()).hexdigest()}
    meta_path = work / "features.json"
    if path.is_file() and meta_path.is_file() and json.loads(meta_path.read_text()) == key:
        data = load_file(str(path))
    else:
        data = corpus.extract_features(loaded.model, records, feature_layers, cfg.max_length, progress=progress)
        save_file({k: v.contiguous() for k, v in data.items()}, str(path))
        meta_path.write_text(json.dumps(key))
    data["feature_layers"] = tuple(feature_layers)
    return data


def _weights_of(model) -> str:
    """The precision a model runs in: "int8" / "int4" (low-bit linear modules) or its parameters' dtype."""
    kinds = {m.weight_precision for m in model.modules() if isinstance(m, LOWBIT_TYPES)}
    if kinds:
        return "int4" if "int4" in kinds else "int8"
    return str(next(p.dtype for p in model.parameters() if p.is_floating_point()))


def check_settings(work: Path, name: str, settings: dict) -> None:
    """Refuse to resume ``work/<name>`` made with other settings (answers of another temperature, precision ...):
    writes ``work/<name>.settings.json`` the first time.

    Raises:
        SpecDecodeError: the stored settings differ (the message says which, and what to do).
    """
    path = work / f"{name}.settings.json"
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise SpecDecodeError(f"{work / name} was made with other {', '.join(diff)} ({old}); use another "
                                  f"--work-dir, or delete {work / name} and {path} to redo it")
    else:
        path.write_text(json.dumps(settings, indent=1) + "\n")


def default_layers(model) -> tuple[int, ...]:
    return default_feature_layers(int(model.config.num_hidden_layers))
