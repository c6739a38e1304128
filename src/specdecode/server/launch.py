"""Build and run the server: load the target (and draft), build the one engine and its scheduler, start uvicorn.

``specdecode serve`` (cli.py) and ``python -m specdecode.server`` both land in
``server.entry.run_from_args``, which calls :func:`run` (or, with ``--replicas``,
``server.replicas.run``, which builds on this module); tests and scripts use
:func:`build_state` with models they already hold.

The drafter is built the way ``specdecode generate`` builds it: the flags read as one
:class:`~specdecode.spec.DrafterSpec`, built by the one builder (``specdecode.build``): every
drafter generate takes, the server takes. One proposer serves the whole batch (proposers are batched),
so the factory is called once. The draft length comes from a
``specdecode.policy`` policy; the cost model (the default) learns T_draft /
T_verify and acceptance online, so there is no start-up calibration.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
from dataclasses import dataclass


from specdecode.threads import set_threads
from specdecode.build import build_engine, choose_skip_layers, load_draft_for
from specdecode.data import load_prompts
from specdecode.models import LoadedModel, check_compatible
from specdecode.options import (
    DEFAULT_GAMMA,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    DEFAULT_TREE_NODES,
)
from specdecode.precision import load_target
from specdecode.preflight import check_models
from specdecode.proposers import LayerSkipProposer
from specdecode.proposers.factory import other_tokenizer
from specdecode.scheduler import Scheduler
from specdecode.server.app import create_app
from specdecode.server.state import ServerConfig, ServingState
from specdecode.spec import DrafterSpec
from specdecode.types import SpecDecodeError
from specdecode.validate import (  # the checks that need no model, shared with the command line
    check_port,
    check_serve_options,
    check_server_limits,
)

logger = logging.getLogger("specdecode.server")

#: Prompts a layer-skip server without --skip-layers searches its skip set on at start-up (when no set is
#: cached for the model): chat questions, like a server's traffic.
LAYER_SKIP_CALIBRATION = "mt-bench:3"


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``specdecode serve`` takes (see :func:`add_serve_arguments` for the meaning)."""

    target: str = "smollm2-135m"
    draft: str = "ngram"
    num_speculative_tokens: int = DEFAULT_GAMMA
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    skip_layers: str | None = None
    tree: str = "none"
    tree_nodes: int = DEFAULT_TREE_NODES
    verification: str = "auto"
    policy: str = "cost-model"
    dtype: str = "float32"
    weights: str = "auto"
    draft_weights: str | None = None
    forward: str = "auto"
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8
    max_queue: int = 64
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    api_key: str | None = None
    served_model_name: str | None = None
    default_max_tokens: int = 256
    log_level: str = "info"
    threads: int | None = None

    def drafter_spec(self) -> DrafterSpec:
        """The drafter these options name (``--draft`` and its flags, read as one spec)."""
        return DrafterSpec.from_settings(dataclasses.asdict(self))


def check_options(opts: ServeOptions) -> DrafterSpec:
    """Every check that needs no model, so a bad flag fails before a slow load (``validate.check_serve_options``,
    which ``specdecode serve`` runs before importing this module, so a refused command never imports torch).

    Returns:
        the drafter the options name.

    Raises:
        SpecDecodeError: a value out of range, an unknown policy / precision / forward, a drafter
            whose options do not fit it.
    """
    check_serve_options(opts)
    return opts.drafter_spec().check()


def build_state(
    target: LoadedModel,
    draft: str | DrafterSpec | LoadedModel | None = "ngram",
    *,
    draft_model: LoadedModel | None = None,
    model_name: str | None = None,
    num_speculative_tokens: int = DEFAULT_GAMMA,
    max_batch_size: int = 8,
    max_queue: int = 64,
    policy: str = "cost-model",
    forward: str = "auto",
    ngram_min: int = DEFAULT_NGRAM_MIN,
    ngram_max: int = DEFAULT_NGRAM_MAX,
    skip_layers: str | list[int] | None = None,
    tree: str | None = None,
    tree_nodes: int = DEFAULT_TREE_NODES,
    verification: str = "auto",
    cache_dir: str | None = None,
    api_key: str | None = None,
    default_max_tokens: int = 256,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> ServingState:
    """The engine, its scheduler and the HTTP state over an already loaded target (and draft).

    Args:
        target: the LoadedModel served (its weights already in the precision they run in).
        draft: a :class:`~specdecode.spec.DrafterSpec` (taken as it is: the drafter keywords below are
            ignored), a drafter choice as ``--draft`` takes it ("ngram", "suffix", "suffix:ngram", "suffix:MODEL",
            "layer-skip", "none" / None, a draft-model spec, a compact spec), or a draft LoadedModel.
        draft_model: the loaded model a draft-model (or ``suffix:MODEL``) choice names, e.g. from
            ``build.load_draft_for``; with another tokenizer it drafts across vocabularies.
        num_speculative_tokens: gamma of the fixed policy, the starting gamma of the others.
        max_batch_size: rows decoded together (KV cache slots); max_queue: requests waiting for one.
        policy: draft-length policy name (``specdecode.policy.build_policy``).
        forward: target forward backend ("auto", "hf", "owned").
        verification: how sampled drafts are verified ("auto", "token", "block"; ``EngineConfig.verification``);
            a request's ``"speculative": {"verification": ...}`` overrides it.
        ngram_min, ngram_max, skip_layers, tree, tree_nodes, cache_dir: the drafter's settings
            (read into the drafter spec, :meth:`specdecode.spec.DrafterSpec.from_settings`).
        api_key, default_max_tokens, max_request_bytes: see :class:`~specdecode.server.state.ServerConfig`.

    Raises:
        SpecDecodeError: bad settings, a draft-model choice without its loaded model;
        IncompatibleTokenizerError: a draft whose tokenizer differs from the target's.
    """
    check_server_limits(max_queue, max_request_bytes, default_max_tokens)
    if isinstance(draft, LoadedModel):
        draft_model, draft = draft, draft.name
    spec = draft if isinstance(draft, DrafterSpec) else DrafterSpec.from_settings({
        "draft": draft, "num_speculative_tokens": num_speculative_tokens, "ngram_min": ngram_min,
        "ngram_max": ngram_max, "tree": tree, "tree_nodes": tree_nodes,
        "skip_layers": skip_layers if skip_layers is None or isinstance(skip_layers, str)
        else ",".join(map(str, skip_layers))})
    if spec.model_spec is not None and draft_model is None:
        raise SpecDecodeError(f"--draft {draft!r} names a draft model: load it first (build.load_draft_for) and "
                              f"pass it as draft_model")
    if draft_model is not None and draft_model is not target and not other_tokenizer(target, draft_model):
        check_compatible(target, draft_model)  # the same tokenizer: the embedding must cover it
    engine = build_engine(target, spec, draft=draft_model, num_speculative_tokens=num_speculative_tokens,
                          policy=policy, max_batch_size=max_batch_size, forward=forward, verification=verification,
                          cache_dir=cache_dir).engine  # batched: one proposer for the whole engine
    proposer = engine.proposer
    num_speculative_tokens = spec.num_speculative_tokens or num_speculative_tokens
    scheduler = Scheduler(engine, max_queue=max_queue)
    server_config = ServerConfig(model_name=model_name or target.name, draft=_describe(
        spec, draft if isinstance(draft, str) else spec.describe()),
                                 num_speculative_tokens=num_speculative_tokens,
                                 policy=policy if proposer is not None else "none", api_key=api_key,
                                 default_max_tokens=default_max_tokens, max_request_bytes=max_request_bytes)
    return ServingState(scheduler, target, server_config)


def _describe(spec: DrafterSpec, text: str | None) -> str:
    """The drafter as /v1/models shows it: the --draft value (``text``), plus its tree / skip settings."""
    out = (text or "").strip() or "none"
    if spec.tree != "none" and spec.model_spec is not None:
        inner = spec.fallback if spec.fallback is not None else spec
        out += f" ({spec.tree} trees of {inner.option('num_nodes')} nodes)"
    if spec.skip_layers is not None:
        out += f" (skip {','.join(map(str, spec.skip_layers))})"
    return out


def load_state(opts: ServeOptions, progress: bool = True) -> ServingState:
    """Load the models named in ``opts`` (as ``specdecode generate`` does) and build the serving state."""
    spec = check_options(opts)
    say = (lambda line: print(f"specdecode: {line}", file=sys.stderr, flush=True)) if progress else None
    check_models(opts.target, spec.model_spec, cache_dir=opts.cache_dir,  # tokenizer files and config, before weights
                 cross_vocab=True, tree=spec.tree, say=say)
    target, precision = load_target(opts.target, opts.weights, dtype=opts.dtype, cache_dir=opts.cache_dir,
                                    progress=progress, status=say, forward=opts.forward)
    if say is not None:
        say(f"weights {precision.reason}")
    weights = precision.precision
    draft_weights = weights if opts.draft_weights in (None, "auto") else opts.draft_weights
    draft_model = load_draft_for(spec, target, opts.target, weights=weights, draft_weights=draft_weights,
                                 dtype=opts.dtype, cache_dir=opts.cache_dir, progress=progress)
    state = build_state(
        target, opts.draft, draft_model=draft_model, model_name=opts.served_model_name or opts.target,
        num_speculative_tokens=opts.num_speculative_tokens, max_batch_size=opts.max_batch_size,
        max_queue=opts.max_queue, policy=opts.policy, forward=opts.forward, ngram_min=opts.ngram_min,
        ngram_max=opts.ngram_max, skip_layers=opts.skip_layers, tree=opts.tree, tree_nodes=opts.tree_nodes,
        verification=opts.verification, cache_dir=opts.cache_dir, api_key=opts.api_key, default_max_tokens=opts.default_max_tokens,
        max_request_bytes=opts.max_request_bytes,
    )
    state.precision = precision  # what the weights run in, and why
    _choose_skip_layers(state)
    return state


def _choose_skip_layers(state: ServingState) -> None:
    """``--draft layer-skip`` without ``--skip-layers``: the set cached for the model, else a search now, on
    :data:`LAYER_SKIP_CALIBRATION` (otherwise the first long prompt would search while every request waits)."""
    proposer = state.engine.proposer
    if not isinstance(proposer, LayerSkipProposer) or proposer.config.skip_layers is not None:
        return
    try:
        texts = [p.turns[0] for p in load_prompts(LAYER_SKIP_CALIBRATION)]
        chat = state.text.has_chat_template
        prompts = [state.text.encode(t, chat=chat) for t in texts]
    except Exception as exc:  # noqa: BLE001 - no prompts: the proposer searches on the first long request
        logger.warning("layer-skip: no calibration prompts (%s); the first request of %d+ tokens chooses the "
                       "skip set", exc, 32)
        return
    choose_skip_layers(proposer, prompts, say=logger.warning)


def check_address(host: str, port: int) -> None:
    """Refuse, before any model loads, a port outside 0..65535 or an address that cannot be bound.

    Raises:
        SpecDecodeError: the message names the address and what to do.
    """
    bind_address(host, port).close()


def bind_address(host: str, port: int):
    """A socket bound to (host, port) for the server to listen on; port 0 lets the system choose (the socket's
    ``getsockname()`` says which). Bound before the slow load and kept, so the port announced is the port served.

    Raises:
        SpecDecodeError: a port outside 0..65535, an address that cannot be bound (the message says what to do).
    """
    check_port(port)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SpecDecodeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
                              "(or stop what uses it) or another --host") from None
    return sock


def run(opts: ServeOptions) -> int:
    """Load, then serve until interrupted (blocking)."""
    # lazy: uvicorn (start-up time)
    import uvicorn

    logging.basicConfig(level=getattr(logging, opts.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_options(opts)  # every flag, before anything is printed or loaded
    sock = bind_address(opts.host, opts.port)  # before the slow load; held, so --port 0's choice is the one served
    try:
        set_threads(opts.threads, say=lambda line: print(f"specdecode: {line}", file=sys.stderr, flush=True))
        state = load_state(opts)
        app = create_app(state)
        auth = "on" if opts.api_key else "off"
        port = sock.getsockname()[1]  # the bound port (the system's choice for --port 0)
        sock.listen(2048)  # before the line below: a client that reads it and connects at once is queued, not refused
        host = f"[{opts.host}]" if ":" in opts.host else opts.host
        print(f"specdecode: serving {state.config.model_name!r} (draft {state.config.draft}, gamma "
              f"{opts.num_speculative_tokens}, policy {state.config.policy}, weights "
              f"{getattr(state.precision, 'precision', opts.weights)}, forward {type(state.engine.runner).__name__}, "
              f"batch {opts.max_batch_size}, queue {opts.max_queue}, api key {auth}) "
              f"at http://{host}:{port}/v1", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=opts.host, port=port, log_level=opts.log_level.lower()))
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


# --------------------------------------------------------------------------- command line

def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        target=args.target, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, skip_layers=args.skip_layers, tree=args.tree,
        tree_nodes=args.tree_nodes, verification=args.verification, policy=args.policy, dtype=args.dtype, weights=args.weights,
        draft_weights=args.draft_weights, forward=args.forward, cache_dir=args.cache_dir, host=args.host,
        port=args.port, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes, api_key=args.api_key, served_model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens, log_level=args.log_level, threads=args.threads,
    )
