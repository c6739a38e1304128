"""Build and run the server: load the target (and draft), calibrate the cost model, start uvicorn.

``specdecode serve`` (cli.py) and ``python -m specdecode.server`` both land in
:func:`run_from_args`; tests and scripts use :func:`build_state` with models
they already hold.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass

import torch

from specdecode.batch import BatchConfig, BatchEngine, BatchRunner, calibrate_forward_cost
from specdecode.models import LoadedModel, check_compatible, load_model
from specdecode.proposers import NgramConfig
from specdecode.proposers.factory import NO_DRAFT  # noqa: F401 - re-exported
from specdecode.proposers.factory import DraftChoice, DrafterOptions, load_draft_model, parse_draft
from specdecode.proposers.factory import proposer_factory as drafter_factory
from specdecode.server.app import ServerConfig, ServingState, create_app
from specdecode.types import SpecDecodeError

logger = logging.getLogger("specdecode.server")

#: Drafters of ``specdecode generate`` that draft token trees or draft on the target's own cache.
CHAIN_ONLY_REFUSED = ("suffix", "layer-skip", "layerskip")


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``specdecode serve`` takes (see :func:`add_serve_arguments` for the meaning)."""

    target: str = "smollm2-135m"
    draft: str = "ngram"
    num_speculative_tokens: int = 5
    ngram_min: int = 1
    ngram_max: int = 3
    dtype: str = "float32"
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8
    max_queue: int = 64
    adaptive: bool = True
    api_key: str | None = None
    served_model_name: str | None = None
    default_max_tokens: int = 256
    kernel: str = "small-row"
    log_level: str = "info"


def proposer_factory(draft: str | LoadedModel | None, target: LoadedModel, ngram_min: int = 1, ngram_max: int = 3):
    """A factory building one proposer per request: None (plain), n-gram, or a draft model (its own cache).

    Raises:
        SpecDecodeError (bad n-gram sizes), IncompatibleTokenizerError.
    """
    options = DrafterOptions(ngram_min=ngram_min, ngram_max=ngram_max)
    if isinstance(draft, LoadedModel):
        if draft is not target:
            check_compatible(target, draft)
        return drafter_factory(DraftChoice(draft.name, "model"), options, target=target.model, draft=draft.model)
    choice = parse_draft(draft)
    if choice.kind == "none":
        return None
    _refuse_tree_drafters(choice.text)
    if choice.kind == "ngram":
        return drafter_factory(choice, options)
    raise SpecDecodeError(f"unknown draft {draft!r}: use 'ngram', 'none' or a loaded draft model")


def _refuse_tree_drafters(kind: str) -> None:
    if kind.strip().lower().partition(":")[0] in CHAIN_ONLY_REFUSED:
        raise SpecDecodeError(f"--draft {kind!r} is not available in the server yet: its batched engine verifies "
                              f"chain drafts; use 'ngram', 'none' or a draft model")


def build_state(
    target: LoadedModel,
    draft: str | LoadedModel | None = "ngram",
    *,
    model_name: str | None = None,
    num_speculative_tokens: int = 5,
    max_batch_size: int = 8,
    max_queue: int = 64,
    adaptive: bool = True,
    calibrate: bool = True,
    api_key: str | None = None,
    default_max_tokens: int = 256,
    ngram_min: int = 1,
    ngram_max: int = 3,
) -> ServingState:
    """Engine + HTTP state over an already loaded target (and draft).

    Args:
        target: the LoadedModel served.
        draft: "ngram", "none" / None, or a draft LoadedModel sharing the target's tokenizer.
        adaptive, calibrate: cost-model draft length; calibration times target forwards of
            1 .. max_batch_size * (gamma + 1) tokens (a few seconds on a 135M model).
    """
    config = BatchConfig(max_batch_size=max_batch_size, max_queue=max_queue,
                         num_speculative_tokens=num_speculative_tokens, adaptive=adaptive,
                         max_context=target.max_context)
    draft_model = None
    if isinstance(draft, LoadedModel):  # drafts for the whole batch in batched forwards
        if draft is not target:
            check_compatible(target, draft)
        draft_model, factory = draft.model, None
    else:
        factory = proposer_factory(draft, target, ngram_min, ngram_max)
    forward_cost = draft_cost = None
    if adaptive and calibrate and (factory is not None or draft_model is not None):
        t0 = time.perf_counter()
        runner = BatchRunner(target.model, 1, target.max_context)
        forward_cost = calibrate_forward_cost(runner, max_batch_size * (num_speculative_tokens + 1))
        if draft_model is not None:
            draft_cost = calibrate_forward_cost(BatchRunner(draft_model, 1, draft.max_context), max_batch_size)
        logger.info("cost model calibrated in %.1f s: %s", time.perf_counter() - t0,
                    ", ".join(f"{n} tok {s * 1e3:.0f} ms" for n, s in forward_cost))
    engine = BatchEngine(target.model, factory, config, draft_model=draft_model, forward_cost=forward_cost,
                         draft_forward_cost=draft_cost)
    draft_name = draft.name if isinstance(draft, LoadedModel) else (draft or "none")
    server_config = ServerConfig(model_name=model_name or target.name, draft=draft_name,
                                 num_speculative_tokens=num_speculative_tokens, api_key=api_key,
                                 default_max_tokens=default_max_tokens)
    return ServingState(engine, target, server_config)


def load_state(opts: ServeOptions, progress: bool = True) -> ServingState:
    """Load the models named in ``opts`` and build the serving state."""
    if not 1 <= opts.num_speculative_tokens <= 64:
        raise SpecDecodeError(f"--num-speculative-tokens must be in [1, 64], got {opts.num_speculative_tokens}")
    NgramConfig(min_ngram=opts.ngram_min, max_ngram=opts.ngram_max)  # fail before slow loads
    choice = parse_draft(opts.draft)
    _refuse_tree_drafters(choice.text)
    target = load_model(opts.target, dtype=opts.dtype, cache_dir=opts.cache_dir, progress=progress)
    draft: str | LoadedModel = load_draft_model(choice, target, opts.target, dtype=opts.dtype,
                                                cache_dir=opts.cache_dir, progress=progress) or choice.text
    if opts.kernel == "small-row":
        from specdecode.kernels import use_small_row_matmul

        for loaded in {id(target): target, id(draft): draft}.values():
            if isinstance(loaded, LoadedModel):
                use_small_row_matmul(loaded.model)
    return build_state(
        target, draft, model_name=opts.served_model_name or opts.target,
        num_speculative_tokens=opts.num_speculative_tokens, max_batch_size=opts.max_batch_size,
        max_queue=opts.max_queue, adaptive=opts.adaptive, api_key=opts.api_key,
        default_max_tokens=opts.default_max_tokens, ngram_min=opts.ngram_min, ngram_max=opts.ngram_max,
    )


def run(opts: ServeOptions) -> int:
    """Load, then serve until interrupted (blocking)."""
    import uvicorn

    logging.basicConfig(level=getattr(logging, opts.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = load_state(opts)
    app = create_app(state)
    auth = "on" if opts.api_key else "off"
    print(f"specdecode: serving {state.config.model_name!r} (draft {state.config.draft}, gamma "
          f"{opts.num_speculative_tokens}, batch {opts.max_batch_size}, queue {opts.max_queue}, api key {auth}) "
          f"at http://{opts.host}:{opts.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=opts.host, port=opts.port, log_level=opts.log_level.lower())
    return 0


# --------------------------------------------------------------------------- command line


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``specdecode serve`` (also ``python -m specdecode.server``)."""
    models = p.add_argument_group("models")
    models.add_argument("--target", default=ServeOptions.target, metavar="SPEC",
                        help="the model served; its output distribution is preserved (default: %(default)s)")
    models.add_argument("--draft", default=ServeOptions.draft, metavar="SPEC",
                        help="'ngram' (prompt lookup), 'none' (plain decoding) or a draft model spec sharing the "
                             "target's tokenizer (default: %(default)s)")
    models.add_argument("-k", "--num-speculative-tokens", type=int, default=5, metavar="N",
                        help="gamma: most tokens drafted per request per step, 1..64 (default: %(default)s)")
    models.add_argument("--ngram-min", type=int, default=1, metavar="N", help="default: %(default)s")
    models.add_argument("--ngram-max", type=int, default=3, metavar="N", help="default: %(default)s")
    models.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weight dtype (default: %(default)s)")
    models.add_argument("--cache-dir", metavar="DIR", help="where converted GGUF models are cached")
    models.add_argument("--served-model-name", metavar="NAME",
                        help="the model id clients send (default: the --target spec)")
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: %(default)s, loopback only; 0.0.0.0 exposes it)")
    srv.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    srv.add_argument("--api-key", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    srv.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                     help="requests decoded together in one batched forward (default: %(default)s)")
    srv.add_argument("--max-queue", type=int, default=64, metavar="N",
                     help="requests waiting for a batch slot; more get HTTP 429 (default: %(default)s)")
    srv.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                     help="choose the draft length per step from a cost model measured at start-up, shortening "
                          "or switching off speculation when the batch is large (default: on)")
    srv.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                     help="max_tokens of a chat request that gives none (default: %(default)s)")
    srv.add_argument("--kernel", default="small-row", choices=("small-row", "default"),
                     help="linear layers with at most 16 rows as W @ x.T (small-row: a batch of few rows or a short "
                          "verification costs about one decoding step on CPUs where torch's few-row GEMM is slow), "
                          "or torch's own F.linear (default) (default: %(default)s)")
    srv.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        target=args.target, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, dtype=args.dtype, cache_dir=args.cache_dir,
        host=args.host, port=args.port, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
        adaptive=args.adaptive, api_key=args.api_key, served_model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens, kernel=args.kernel, log_level=args.log_level,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``specdecode serve``."""
    torch.set_grad_enabled(False)
    return run(options_from_args(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdecode.server",
                                     description="OpenAI-compatible server with lossless speculative decoding")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except SpecDecodeError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
