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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdecode.eagle import corpus
from specdecode.eagle.head import EagleConfig, EagleHead, autocast_dtype, default_feature_layers, save_head
from specdecode.errors import SpecDecodeError
from specdecode.paths import check_output_dir

#: Prompt mixes per target kind (counts per source; see corpus.SOURCES).
MIXES = {
    "chat": {"sharegpt": 60, "gsm8k": 400, "templates": 600, "stdlib": 500},
    "code": {"sharegpt": 60, "gsm8k": 300, "templates": 200, "stdlib": 400, "stdlib-code": 700},
}


@dataclass
class TrainConfig:
    """Settings of one ``train-drafter`` run (defaults: SmolLM2-135M in under an hour on 2 cores).

    Attributes:
        num_prompts: prompts answered by the target (a prefix of the mix, interleaved sources).
        mix: "chat" or "code" (:data:`MIXES`); code adds raw code completions.
        max_new_tokens: response length per prompt; max_prompt_tokens: prompts are cut to this.
        max_length: tokens per training sequence (prompt + response).
        temperature: of the self-distilled responses (0: greedy).
        draft_vocab_size: Vd, the head's reduced vocabulary.
        ttt_steps: unrolled draft positions in the training-time test.
        epochs, batch_tokens, lr, weight_decay, warmup_steps: the optimisation (AdamW, cosine decay).
        held_out_fraction: sequences kept for validation (accuracy per unrolled step).
        train_lm_head: train (and store) the LM head rows instead of using the target's.
        intermediate_size: the head's MLP width (None: the target's).
        gen_batch_size: rows decoded together while answering.
        save_every: steps between resumable states; seed: prompt order, init, batches.
        device: "cpu" or "cuda"; threads: torch threads on the CPU (None: torch's default).
    """

    num_prompts: int = 1500
    mix: str = "chat"
    max_new_tokens: int = 128
    max_prompt_tokens: int = 384
    max_length: int = 512
    temperature: float = 0.0
    draft_vocab_size: int = 16384
    ttt_steps: int = 4
    epochs: float = 4.0
    batch_tokens: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    held_out_fraction: float = 0.05
    train_lm_head: bool = False
    intermediate_size: int | None = None
    gen_batch_size: int = 32
    save_every: int = 50
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise SpecDecodeError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.mix not in MIXES:
            raise SpecDecodeError(f"mix must be one of {sorted(MIXES)}, got {self.mix!r}")
        for name in ("num_prompts", "max_new_tokens", "max_length", "draft_vocab_size", "ttt_steps", "batch_tokens"):
            if int(getattr(self, name)) < 1:
                raise SpecDecodeError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.epochs <= 1000 or not 0 < self.lr < 1:
            raise SpecDecodeError(f"epochs must be in (0, 1000] and lr in (0, 1); got {self.epochs}, {self.lr}")
        if self.intermediate_size is not None and int(self.intermediate_size) < 1:
            raise SpecDecodeError(f"intermediate_size must be >= 1, got {self.intermediate_size!r}")
        from specdecode.validate import check_threads

        check_threads(self.threads)  # torch's CPU threads: 1..the cores this process may use
        if not 0 <= self.held_out_fraction < 0.5:
            raise SpecDecodeError(f"held_out_fraction must be in [0, 0.5), got {self.held_out_fraction}")


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
    import matplotlib

    matplotlib.use("Agg")
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
    from safetensors.torch import load_file, save_file

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
    from specdecode.lowbit import LOWBIT_TYPES

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
    from specdecode.data import load_prompts
    from specdecode.build import assemble, build_engine  # lazy: the builder imports the proposers (this module's)
    from specdecode.spec import DrafterSpec
    from specdecode.types import SamplingParams

    if ":" in prompts:
        rows = load_prompts(prompts, shared_dir=shared_dir)
    else:
        from specdecode.data import dataset_categories

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
    from tqdm import tqdm

    from specdecode.lowbit import load_in_precision  # lazy: the kernels and models packages (start-up time)
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
