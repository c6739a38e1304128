"""Replicas of the one engine on Ray Serve, behind one OpenAI-compatible endpoint (``specdecode serve --replicas N``).

Three deployments make one Ray Serve application (:func:`build_app`):

- ``SpecdecodeEngine`` (N replicas, autoscaled when asked): each replica loads the target (and draft) as
  ``specdecode serve`` does (:func:`specdecode.server.launch.load_state`) and runs the very same FastAPI app
  (:func:`specdecode.server.app.create_app`) in-process. Requests reach that app as raw HTTP (method, path,
  headers, body) through :func:`asgi_request`, so every endpoint, streaming, error body and the API key
  behave exactly as in one process: there is no second code path.
- ``SpecdecodeIngress`` (the HTTP entry, on Ray Serve's proxy): reads the body, picks a routing key
  (:func:`routing_key`, for the prefix-affinity router), forwards the request to an engine replica through
  a Ray Serve deployment handle and streams the replica's bytes back. It holds the client's response until
  the first generated output arrives, so a request whose replica dies before that is retried on another
  replica; a stream that had already sent output ends with a retryable ``replica_failed`` error event.
  Its ``/metrics`` is every replica's Prometheus figures with a ``replica`` label
  (:func:`merge_metrics`), its ``/health`` lists the replicas.
- ``SpecdecodeMetrics``: one small actor the engine replicas push their ``/metrics`` text and stats to
  every second.

Routing: Ray Serve's default (power of two choices on queue length), or with ``--router prefix``
:class:`specdecode.server.ray_router.PrefixAffinityRouter`: rendezvous hashing of the routing key over
the replicas (:func:`rank_replicas`), so the turns of one conversation, and prompts sharing a prefix, go to
the same replica (its suffix tree and caches stay warm), unless that replica's queue is far longer than
the shortest.

The entry point for a Ray cluster a user already runs is :func:`app_builder`
(``serve run specdecode.server.replicas:app_builder target=smollm2-135m replicas=2``, or the
``import_path`` of a Ray Serve config file). Ray is optional: ``pip install -e ".[ray]"``; this module
imports without it, and :func:`require_ray` says what to install.
"""

# no "from __future__ import annotations": the ingress routes are pickled to Ray and FastAPI reads their real annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from specdecode.scaleout import (  # noqa: F401 - the settings, checked without Ray; re-exported here
    RAY_INSTALL,
    ROUTERS,
    ReplicaOptions,
    check_replica_options,
    replica_options_from_args,
    require_ray,
)

__all__ = ["RAY_INSTALL", "ROUTERS", "ReplicaOptions", "app_builder", "build_app", "check_replica_options",
           "replica_options_from_args", "require_ray", "run"]
from specdecode.server.deployments import (  # noqa: F401 - the names re-exported
    APP_NAME,
    DRAIN_SECONDS,
    ENGINE,
    HUB,
    INGRESS,
    PUSH_PERIOD,
    STALE_AFTER,
    EngineReplica,
    MetricsHub,
    first_line,
    ingress_deployment_class,
)
from specdecode.server.launch import ServeOptions, check_address, check_options
from specdecode.server.routing import rank_replicas, routing_key  # noqa: F401 - Ray-free, re-exported
from specdecode.types import SpecDecodeError

_ENV_PASSED = ("SPECDECODE_CACHE", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE", "SPECDECODE_KERNEL_ISA",
               "SPECDECODE_NATIVE_STEP", "TOKENIZERS_PARALLELISM")


def read_ray_config(path: str | Path) -> dict:
    """A Ray Serve config file (the format of ``serve deploy``), validated by Ray's own schema.

    Returns:
        ``{"http_options": {...}, "deployments": {name: {option: value}}, "args": {...}}``: the HTTP options,
        the settings of this application's deployments (``SpecdecodeEngine``, ``SpecdecodeIngress``) and
        its builder args, from the application named ``specdecode`` or, failing that, the only one.

    Raises:
        SpecDecodeError: not YAML, not Ray Serve's schema, or a deployment that is not ours.
    """
    # optional: PyYAML and Ray Serve (pip install -e ".[ray]")
    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = Path(path).expanduser()
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecDecodeError(f"--ray-config {path}: cannot read it as YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise SpecDecodeError(f"--ray-config {path}: expected a mapping with 'applications' (Ray Serve's config format)")
    try:
        schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
            else ServeDeploySchema.parse_obj(raw)
    except (ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()
        raise SpecDecodeError(f"--ray-config {path}: not a Ray Serve config: {' '.join(first[:3])}") from None
    apps = [a for a in raw.get("applications") or [] if a.get("name") == APP_NAME] or raw.get("applications") or []
    if len(apps) > 1:
        raise SpecDecodeError(f"--ray-config {path}: {len(apps)} applications and none named {APP_NAME!r}; name ours "
                              f"{APP_NAME!r}")
    deployments: dict[str, dict] = {}
    for entry in (apps[0].get("deployments") or []) if apps else []:
        name = entry.get("name")
        if name not in (ENGINE, INGRESS):
            raise SpecDecodeError(f"--ray-config {path}: deployment {name!r} is not one of specdecode's ({ENGINE}, "
                                  f"{INGRESS})")
        deployments[name] = {k: v for k, v in entry.items() if k != "name"}
    http = raw.get("http_options") or {}
    del schema
    return {"http_options": http, "deployments": deployments, "args": dict((apps[0].get("args") or {}) if apps else {})}


def _serve_options_type():
    return ServeOptions


def default_threads(replicas: int) -> int:
    """Torch threads per replica on one machine: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // max(1, replicas))


def build_app(opts, r: ReplicaOptions, *, ray_config: dict | None = None):
    """The Ray Serve application: ``SpecdecodeIngress`` -> ``SpecdecodeEngine`` x N, and the metrics hub.

    Args:
        opts: ``ServeOptions`` of each replica (``threads`` None: :func:`default_threads`).
        r: the replica settings.
        ray_config: :func:`read_ray_config`'s result, whose deployment settings override ours.

    Returns:
        a ``ray.serve.Application`` for ``serve.run`` (or a Ray Serve config's ``import_path``).

    Raises:
        SpecDecodeError: Ray missing, bad options.
    """
    require_ray()
    # optional: Ray Serve (pip install -e ".[ray]")
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    check_options(opts)
    check_replica_options(r)
    if opts.threads is None:
        opts = dataclasses.replace(opts, threads=default_threads(r.max_replicas or r.replicas))
    cpus = float(opts.threads) if r.cpus_per_replica is None else r.cpus_per_replica
    env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ}
    engine_options: dict = {
        "name": ENGINE,
        "max_ongoing_requests": 2 * opts.max_batch_size,  # a batch running and the next one queued in the replica
        "max_queued_requests": opts.max_queue,  # beyond: 429 from the ingress
        "ray_actor_options": {"num_cpus": cpus, "runtime_env": {"env_vars": env}},
        # a replica leaving (autoscaling down, a redeploy) first drains: it takes no new request and its
        # running ones get DRAIN_SECONDS to finish (Ray's default, 20 s, would cut long CPU generations)
        "health_check_period_s": 5, "health_check_timeout_s": 30, "graceful_shutdown_timeout_s": DRAIN_SECONDS,
    }
    if r.autoscaling:
        engine_options["autoscaling_config"] = {
            "min_replicas": r.min_replicas if r.min_replicas is not None else 1,
            "initial_replicas": r.replicas,
            "max_replicas": r.max_replicas if r.max_replicas is not None else max(r.replicas, r.min_replicas or 1),
            "target_ongoing_requests": r.target_ongoing_requests or float(opts.max_batch_size),
        }
    else:
        engine_options["num_replicas"] = r.replicas
    if r.router == "prefix":
        # optional: Ray Serve (pip install -e ".[ray]")
        from specdecode.server.ray_router import PrefixAffinityRouter

        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"imbalance": r.imbalance})
    ingress_options: dict = {"name": INGRESS, "num_replicas": 1, "max_ongoing_requests": 10_000,
                             "ray_actor_options": {"num_cpus": 0}}
    for name, mine in ((ENGINE, engine_options), (INGRESS, ingress_options)):
        theirs = dict((ray_config or {}).get("deployments", {}).get(name, {}))
        if "num_replicas" in theirs or "autoscaling_config" in theirs:
            mine.pop("num_replicas", None)
            mine.pop("autoscaling_config", None)
        if "ray_actor_options" in theirs:
            theirs["ray_actor_options"] = {**mine["ray_actor_options"], **theirs["ray_actor_options"]}
        mine.update(theirs)

    engine_cls = serve.deployment(**engine_options)(EngineReplica)
    hub_cls = serve.deployment(name=HUB, num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0},
                               logging_config={"enable_access_log": False})(MetricsHub)
    ingress_cls = serve.deployment(**ingress_options)(ingress_deployment_class())
    hub = hub_cls.bind()
    return ingress_cls.bind(engine_cls.bind(opts, hub), hub, router=r.router, prefix_chars=r.prefix_chars,
                            retries=r.retries, max_request_bytes=opts.max_request_bytes, api_key=opts.api_key)


def split_args(args: dict) -> tuple[dict, dict]:
    """``serve run ... key=value`` arguments (or a config file's ``args``) as (ServeOptions fields,
    ReplicaOptions fields), typed like the dataclasses' defaults.

    Raises:
        SpecDecodeError: an unknown key or a value of the wrong type.
    """
    serve_cls = _serve_options_type()
    serve_fields = {f.name: f for f in dataclasses.fields(serve_cls)}
    replica_fields = {f.name: f for f in dataclasses.fields(ReplicaOptions)}
    s, r = {}, {}
    for key, value in (args or {}).items():
        name = str(key).replace("-", "_")
        if name in ("host", "port"):
            raise SpecDecodeError(f"argument {key!r}: on Ray Serve the address is Ray Serve's (http_options in the "
                                  f"config file, or serve start --http-host/--http-port)")
        field = serve_fields.get(name) or replica_fields.get(name)
        if field is None:
            known = sorted((set(serve_fields) - {"host", "port"}) | set(replica_fields))
            raise SpecDecodeError(f"unknown argument {key!r}; known: {', '.join(known)}")
        default = field.default
        if isinstance(value, str) and not isinstance(default, str) and value.lower() not in ("none", "null"):
            kind = type(default) if default is not None else (float if "float" in str(field.type) else
                                                              int if "int" in str(field.type) else str)
            try:
                value = kind(value)
            except ValueError:
                raise SpecDecodeError(f"argument {key}={value!r}: expected {kind.__name__}") from None
        elif isinstance(value, str) and value.lower() in ("none", "null") and default is None:
            value = None
        (s if name in serve_fields else r)[name] = value
    return s, r


def app_builder(args: dict):
    """Ray Serve's application builder for a cluster a user already runs::

        serve run specdecode.server.replicas:app_builder target=smollm2-135m draft=ngram replicas=2 router=prefix

    or a config file's ``import_path: specdecode.server.replicas:app_builder`` with ``args:`` (any
    ``specdecode serve`` setting by its ``ServeOptions`` name, and the :class:`ReplicaOptions` fields).

    Raises:
        SpecDecodeError: unknown or bad arguments, Ray missing.
    """
    s, r = split_args(args)
    return build_app(_serve_options_type()(**s), ReplicaOptions(**r))


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """A ``HOST:PORT`` Ray address must accept a TCP connection (``ray.init`` would retry it forever);
    "auto" and ``ray://`` addresses are left to Ray.

    Raises:
        SpecDecodeError: nothing answers there.
    """
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as exc:
        raise SpecDecodeError(f"--ray-address {address}: no Ray cluster answers there ({exc}); start one with 'ray "
                              f"start --head --port {port}' on that machine, or drop --ray-address for a local "
                              f"cluster") from None


def run(opts, r: ReplicaOptions) -> int:
    """``specdecode serve --replicas N``: start (or join) a Ray cluster, deploy, serve until interrupted
    (Ctrl-C or SIGTERM). On a cluster of the user's (``--ray-address``) only this application is deleted at
    the end; a local cluster started here is shut down.

    Raises:
        SpecDecodeError: Ray missing, bad options, more CPUs asked than a local cluster has, a Ray cluster
            that cannot be reached, replicas that fail to start.
    """
    require_ray()
    # optional: Ray Serve (pip install -e ".[ray]")
    import ray
    from ray import serve

    say = lambda line: print(f"specdecode: {line}", file=sys.stderr, flush=True)  # noqa: E731
    check_options(opts)
    check_replica_options(r)
    config = read_ray_config(r.ray_config) if r.ray_config else None
    if config is not None and config["args"]:
        say(f"--ray-config: its 'args' ({', '.join(sorted(config['args']))}) are for 'serve deploy'; here the flags "
            f"choose the model and the drafter")
    http = {"host": opts.host, "port": opts.port, **((config or {}).get("http_options") or {})}
    local = r.ray_address is None
    engine_cfg = (config or {}).get("deployments", {}).get(ENGINE, {})
    most = r.max_replicas or r.replicas  # the most engine replicas that can run, flags or config file
    if "num_replicas" in engine_cfg and isinstance(engine_cfg["num_replicas"], int):
        most = engine_cfg["num_replicas"]
    elif "autoscaling_config" in engine_cfg:
        most = int((engine_cfg["autoscaling_config"] or {}).get("max_replicas", most))
    threads = opts.threads or default_threads(most)
    cpus = r.cpus_per_replica if r.cpus_per_replica is not None else threads
    cpus = float((engine_cfg.get("ray_actor_options") or {}).get("num_cpus", cpus))
    if local:
        check_address(http["host"], int(http["port"]))
        cores = os.cpu_count() or 1
        if cpus * most > cores:
            raise SpecDecodeError(f"{most} replica{'s' if most > 1 else ''} x {cpus:g} CPUs need {cpus * most:g} CPUs and "
                                  f"this machine has {cores}: lower --replicas / --max-replicas (or the config file's "
                                  f"count) or --threads / --cpus-per-replica, or join a bigger cluster with --ray-address")
    else:
        _check_reachable(r.ray_address)
    try:
        ray.init(address=r.ray_address, include_dashboard=False, log_to_driver=True, logging_level="warning",
                 **({"num_cpus": os.cpu_count()} if local else {}))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"--ray-address {r.ray_address}: cannot connect to the Ray cluster" if not local else \
            "cannot start a local Ray cluster"
        raise SpecDecodeError(f"{where} ({first_line(exc)}); start one with 'ray start --head' and pass "
                              f"--ray-address auto, or check /tmp/ray/session_latest/logs") from None

    def _stop(signum, frame):  # SIGTERM (docker stop, a supervisor) stops the replicas as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        serve.start(http_options=http)
        lo = r.min_replicas if r.min_replicas is not None else 1
        if "num_replicas" in engine_cfg or "autoscaling_config" in engine_cfg:
            n = f"the config file's {engine_cfg.get('num_replicas') or 'autoscaled'}"
        elif r.autoscaling:
            n = f"{lo}..{r.max_replicas or r.replicas} (autoscaled, {r.replicas} at start)"
        else:
            n = str(r.replicas)
        plural = "replica" if n == "1" else "replicas"
        say(f"starting {n} {plural} of {opts.target!r} on Ray Serve (router {r.router}); each loads the model")
        t0 = time.perf_counter()
        try:
            serve.run(build_app(opts, r, ray_config=config), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise SpecDecodeError(f"the replicas did not start ({first_line(exc)}); their logs are above and in "
                                  f"/tmp/ray/session_latest/logs/serve/") from None
        say(f"serving {opts.served_model_name or opts.target!r} from {n} {plural} in {time.perf_counter() - t0:.0f} s "
            f"at http://{http['host']}:{http['port']}/v1 (api key {'on' if opts.api_key else 'off'}; Ctrl-C stops)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        say("stopping the replicas")
        return 0
    finally:
        with contextlib.suppress(Exception):
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)  # the user's cluster keeps its other applications
        if local:
            ray.shutdown()
