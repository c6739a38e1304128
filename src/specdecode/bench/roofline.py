"""The roofline of a decoding step: the bytes of weights it reads, the machine's read bandwidth, the byte limit.

A step that reads W bytes of weights cannot take less than W / B seconds on a machine that reads
B bytes/s (DESIGN.md: "a step's floor is its bytes"; the memory-bound side of the roofline model,
Williams et al. 2009), so tokens/s <= B / W. The benchmark reports, per model and precision, the
fraction of that limit plain decoding, verification and drafting reach.

Measuring (torch) is imported where used: the report functions stay pure over JSON-ready dicts.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specdecode.bench.summary import OURS_PLAIN

MIB = 2**20
#: Bytes summed by the bandwidth measurement: far larger than any CPU cache.
READ_BYTES = 512 * MIB
#: Timed sums (after one untimed one); the fastest counts (noise only adds time).
READ_REPEATS = 5
#: The section of ``<cache>/machine/<machine key>.json`` holding the measurements.
CACHE_SECTION = "read_bandwidth"
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}


# --------------------------------------------------------------------------- bandwidth


def bandwidth_cache_file(cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir>/machine/<specdecode.precision.machine_key(include_threads=False)>.json``.

    One file per machine whatever the current thread count: its entries are keyed by tensor size and threads.
    """
    # lazy: these pull in torch (start-up time)
    from specdecode.models import default_cache_dir
    from specdecode.precision import machine_key

    return Path(cache_dir or default_cache_dir()) / "machine" / f"{machine_key(include_threads=False)}.json"


def measure_read_bandwidth(cache_dir: str | Path | None = None, *, size_bytes: int = READ_BYTES,
                           repeats: int = READ_REPEATS, threads: int | None = None, remeasure: bool = False,
                           status: Callable[[str], None] | None = None) -> float:
    """The machine's memory read bandwidth in bytes/s: the fastest of ``repeats`` sums of a float32 tensor.

    Measured once per machine (CPU model, SIMD flags, torch version: ``specdecode.precision.machine_key``),
    thread count and tensor size, then read back from
    :func:`bandwidth_cache_file`; ``remeasure`` measures again and overwrites the entry. A cache
    that cannot be written is skipped (the figure is still returned).

    Args:
        cache_dir: the specdecode cache directory (None: ``specdecode.models.default_cache_dir()``).
        size_bytes: bytes summed per pass (default 512 MiB; a tensor that fits in the caches reads faster).
        repeats: timed passes, after one untimed pass.
        threads: torch intra-op threads during the measurement (None: the current count).
        remeasure: ignore a cached figure.
        status: called with a line when a measurement starts.

    Raises:
        ValueError: ``size_bytes`` < 4 or ``repeats`` < 1.
    """
    # lazy: torch (start-up time)
    import torch

    if size_bytes < 4 or repeats < 1:
        raise ValueError(f"size_bytes must be >= 4 and repeats >= 1, got {size_bytes} and {repeats}")
    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    try:
        path = bandwidth_cache_file(cache_dir)
        entry = f"{size_bytes} bytes, {threads} threads"
        data = _read_json(path)
        cached = data.get(CACHE_SECTION, {}).get(entry)
        if not remeasure and isinstance(cached, dict) and _positive(cached.get("bytes_per_s")):
            return float(cached["bytes_per_s"])
        if status:
            status(f"measuring memory read bandwidth (sum of {size_bytes / MIB:g} MiB, {threads} threads; "
                   f"cached in {path})")
        x = torch.ones(size_bytes // 4)  # every page written once
        x.sum()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - start)
        bandwidth = x.numel() * 4 / min(times)
        del x
        data.setdefault(CACHE_SECTION, {})[entry] = {
            "bytes_per_s": bandwidth, "seconds": min(times), "repeats": repeats,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        _write_json(path, data)
        return bandwidth
    finally:
        torch.set_num_threads(before)


def _positive(x) -> bool:
    try:
        return float(x) > 0
    except (TypeError, ValueError):
        return False


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get(CACHE_SECTION, {}), dict) else {}


def _write_json(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass


# --------------------------------------------------------------------------- bytes per step


def weight_bytes_by_kind(model) -> dict[str, int]:
    """Bytes of weights one decoding step reads, by storage kind ("fp32", "bf16", "int8", ...).

    Every parameter in full (linear layers and the LM head, norms, biases), except: a module with
    a ``weight_nbytes()`` method reports its own bytes (kind: its ``weight_precision`` attribute,
    else its class name) and is not descended into (the low-bit modules of ``specdecode.lowbit``:
    their quantized values, scales, offsets and bias; a fused one counts once); an ``nn.Embedding`` reads one row per token, unless its table is also
    another module's weight (tied to the LM head, whose product reads it in full). A tensor shared
    by several modules counts once; buffers (rotary tables) are left out.

    Args:
        model: a ``torch.nn.Module``.
    """
    # lazy: torch (start-up time)
    import torch

    embeddings = {id(m) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    read_whole = {_storage(p) for m in model.modules() if id(m) not in embeddings
                  for p in m.parameters(recurse=False)}
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(kind: str, n: int) -> None:
        out[kind] = out.get(kind, 0) + int(n)

    def walk(m) -> None:
        if callable(getattr(m, "weight_nbytes", None)):
            if id(m) in seen:  # a fused module reached through each of its slices
                return None
            seen.add(id(m))
            return add(getattr(m, "weight_precision", None) or type(m).__name__, m.weight_nbytes())
        for p in m.parameters(recurse=False):
            if _storage(p) in seen:
                continue
            seen.add(_storage(p))
            one_row = id(m) in embeddings and _storage(p) not in read_whole and p.ndim == 2
            add(_DTYPE_NAMES.get(str(p.dtype), str(p.dtype).removeprefix("torch.")),
                (p.shape[1] if one_row else p.numel()) * p.element_size())
        for child in m.children():
            walk(child)

    walk(model)
    return out


def _storage(p) -> int:
    """The memory a tensor reads (shared by tied weights); its identity where it has none (empty, meta)."""
    return p.data_ptr() or id(p)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decoding step reads (:func:`weight_bytes_by_kind`, summed)."""
    return sum(weight_bytes_by_kind(model).values())


def kv_bytes_per_token(model, dtype) -> int:
    """Bytes of KV cache per token of context: layers x 2 x kv_heads x head_dim x the element size of ``dtype``.

    Args:
        model: a causal LM whose ``config`` has ``num_hidden_layers``, ``num_attention_heads``
            (``num_key_value_heads``, ``head_dim`` where it has them) and ``hidden_size``.
        dtype: the cache's ``torch.dtype`` (the owned runner keeps float64 for batch-invariant numerics).

    Raises:
        ValueError: the config lacks those fields.
    """
    # lazy: torch (start-up time)
    import torch

    cfg = getattr(model, "config", None)
    try:
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        layers = int(cfg.num_hidden_layers)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"no attention shape in the model's config: {exc}") from None
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def model_facts(name: str, role: str, model, kv_dtype=None) -> dict:
    """A model's roofline inputs, JSON-ready: precision (the kind of most bytes), weight bytes per step
    (total and by kind), KV bytes per token (None when the config has no attention shape).

    Args:
        name: the model spec; role: "target" or "draft".
        kv_dtype: the runner's cache ``torch.dtype`` (None: the model's first floating-point parameter's).
    """
    # lazy: torch (start-up time)
    import torch

    kinds = weight_bytes_by_kind(model)
    dtype = kv_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        kv = kv_bytes_per_token(model, dtype)
    except ValueError:
        kv = None
    return {"model": name, "role": role, "precision": max(kinds, key=kinds.get) if kinds else None,
            "weight_bytes": sum(kinds.values()), "weight_bytes_by_kind": kinds, "kv_bytes_per_token": kv,
            "kv_dtype": str(dtype).removeprefix("torch.")}


# --------------------------------------------------------------------------- fractions (pure)


def _pooled_time(pooled: dict, keys: Sequence[str], time_key: str, count_key: str) -> float | None:
    ps = [pooled[k] for k in keys if pooled.get(k) and not pooled[k]["is_tree"]]
    count = sum(p[count_key] for p in ps)
    return sum(p[time_key] for p in ps) / count if count else None


def step_times(summary: dict, variants: Sequence[dict], gamma: int) -> dict:
    """Measured seconds per step of a run, with their source: {"plain": (s, source), "verification": ...,
    "drafting": {draft spec: (s, source)}}; s is None where the run has no such timing.

    Plain decoding: ``specdecode/plain``'s wall time less prefill over its decoding steps (overhead
    included). Verification: the probe's target forward over gamma + 1 tokens, T_verify(gamma); without
    a probe, verification time per step of our chain methods at gamma. Drafting: draft time per drafted
    token of our chain methods drafting with the model; without runs, the probe's draft step.
    """
    pooled = summary.get("pooled") or {}
    probe = summary.get("probe") or {}
    plain = pooled.get(OURS_PLAIN)
    out = {"plain": (None, None), "verification": (None, None), "drafting": {}}
    if plain and plain["num_verify_steps"]:
        out["plain"] = ((plain["wall_s"] - plain["prefill_time_s"]) / plain["num_verify_steps"], "plain decoding runs")
    forwards = probe.get("target_forward_s") or {}
    t_verify = forwards.get(gamma, forwards.get(str(gamma)))
    if t_verify:
        out["verification"] = (t_verify, f"probe, {gamma + 1} tokens")
    else:
        keys = [v["key"] for v in variants if v["engine"] == "specdecode" and v["key"] != OURS_PLAIN
                and v["gamma"] == gamma]
        t = _pooled_time(pooled, keys, "verify_time_s", "num_verify_steps")
        out["verification"] = (t, f"runs at γ = {gamma}" if t else None)
    drafts = {v["draft"] for v in variants if v.get("draft")} | set(probe.get("draft_forward_s") or {})
    for name in sorted(drafts):
        keys = [v["key"] for v in variants if v["engine"] == "specdecode" and v.get("draft") == name]
        t = _pooled_time(pooled, keys, "draft_time_s", "num_drafted_tokens")
        if t:
            out["drafting"][name] = (t, "draft time per drafted token")
        elif (probe.get("draft_forward_s") or {}).get(name):
            out["drafting"][name] = (probe["draft_forward_s"][name], "probe, one draft step")
    return out


def roofline(facts: dict | None, summary: dict, variants: Sequence[dict], gamma: int) -> dict | None:
    """Per model of the run: byte limit and the fraction of it plain decoding, verification and drafting reach.

    fraction = byte-limit time (weight bytes / read bandwidth) / measured seconds per step
    (:func:`step_times`), i.e. measured tokens/s over the byte limit's. Plain decoding and
    verification are the target's, drafting each draft model's.

    Args:
        facts: the run's ``roofline`` metadata: {"bandwidth": {"bytes_per_s", ...}, "models": [model_facts]};
            None (a run recorded before the roofline existed) gives None.
        summary: :func:`specdecode.bench.summary.summarize`'s output; variants: the run's variant infos.
        gamma: the run's γ (``--gamma``): the verification width reported.

    Returns:
        {"bandwidth": facts' bandwidth, "gamma", "rows": [{model, role, precision, weight_bytes,
        kv_bytes_per_token, byte_limit_s, byte_limit_tokens_per_s, plain, verification, drafting}]},
        each of the last three {"step_s", "fraction", "source"} or None.
    """
    if not facts:
        return None
    bandwidth = float(facts["bandwidth"]["bytes_per_s"])
    times = step_times(summary, variants, gamma)
    rows = []
    for m in facts["models"]:
        limit = m["weight_bytes"] / bandwidth

        def reached(pair):
            step, source = pair
            return {"step_s": step, "fraction": limit / step, "source": source} if step else None

        target = m["role"] == "target"
        rows.append({**{k: m[k] for k in ("model", "role", "precision", "weight_bytes", "kv_bytes_per_token",
                                          "kv_dtype")},
                     "byte_limit_s": limit, "byte_limit_tokens_per_s": 1.0 / limit if limit else None,
                     "plain": reached(times["plain"]) if target else None,
                     "verification": reached(times["verification"]) if target else None,
                     "drafting": None if target else reached(times["drafting"].get(m["model"], (None, None)))})
    return {"bandwidth": facts["bandwidth"], "gamma": gamma, "rows": rows}


__all__ = ["CACHE_SECTION", "READ_BYTES", "bandwidth_cache_file", "kv_bytes_per_token", "measure_read_bandwidth",
           "model_facts", "roofline", "step_times", "weight_bytes_by_kind", "weight_bytes_per_step"]
