"""The replica settings of ``specdecode serve --replicas N`` (Ray Serve), checked with no Ray, torch or server
stack imported, so a refused flag answers at once (``specdecode.server.replicas`` runs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError

RAY_INSTALL = 'pip install -e ".[ray]"  (in a checkout; elsewhere: pip install "ray[serve]>=2.58,<3")'
#: ``--router``: Ray Serve's power of two choices, or prefix / conversation affinity.
ROUTERS = ("power-of-two", "prefix")


def require_ray() -> None:
    """Raise a clear error when Ray Serve is not installed.

    Raises:
        SpecDecodeError: names what to install.
    """
    try:
        # optional: Ray Serve (pip install -e ".[ray]"); a missing one is reported below
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise SpecDecodeError(f"--replicas runs the engine's replicas on Ray Serve, which is not installed "
                              f"({exc.name or exc}): {RAY_INSTALL}; or serve from one process without --replicas") from None


@dataclass(frozen=True)
class ReplicaOptions:
    """How the engine is replicated (the ``--replicas`` flags of ``specdecode serve``).

    Attributes:
        replicas: engine replicas (the initial count when autoscaling).
        min_replicas, max_replicas: autoscaling bounds; autoscaling is on when either is given.
        target_ongoing_requests: the autoscaler's target of requests per replica (running + queued);
            default the engine's batch size.
        router: "power-of-two" (Ray Serve's default) or "prefix" (prefix / conversation affinity).
        prefix_chars: characters of the prompt (or of the conversation's first messages) that make the
            prefix-affinity key.
        imbalance: the prefix router leaves the preferred replica when its queue is this many requests
            longer than the shortest.
        retries: attempts on another replica for a request whose replica failed before it sent output.
        ray_address: an existing cluster ("auto", "ray://host:10001", "host:6379"); None starts a local one.
        ray_config: a Ray Serve config file (YAML) whose deployment settings and http_options apply.
        cpus_per_replica: Ray CPUs each engine replica reserves (default its torch threads).
    """

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    router: str = "power-of-two"
    prefix_chars: int = 256
    imbalance: int = 8
    retries: int = 2
    ray_address: str | None = None
    ray_config: str | None = None
    cpus_per_replica: float | None = None

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None


def replica_options_from_args(args) -> "ReplicaOptions | None":
    """The ``--replicas`` flags of ``specdecode serve`` (an ``argparse.Namespace``) as :class:`ReplicaOptions`,
    or None when none is given (one process, no Ray)."""
    given = any(getattr(args, name, None) is not None for name in
                ("replicas", "min_replicas", "max_replicas", "ray_address", "ray_config"))
    if not given:
        tuned = [flag for flag, name, default in (("--router", "router", "power-of-two"), ("--prefix-chars", "prefix_chars", 256),
                                                  ("--route-imbalance", "route_imbalance", 8),
                                                  ("--replica-retries", "replica_retries", 2),
                                                  ("--target-ongoing-requests", "target_ongoing_requests", None),
                                                  ("--cpus-per-replica", "cpus_per_replica", None))
                 if getattr(args, name, default) != default]
        if tuned:
            which = "this flag applies" if len(tuned) == 1 else "these flags apply"
            raise SpecDecodeError(f"{', '.join(tuned)}: {which} only to replicas; give --replicas N (or --min-replicas "
                                  f"/ --max-replicas) too, or drop it: without them one process serves")
        return None
    return ReplicaOptions(
        replicas=args.replicas if args.replicas is not None else max(1, args.min_replicas or 1),
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, router=args.router, prefix_chars=args.prefix_chars,
        imbalance=args.route_imbalance, retries=args.replica_retries, ray_address=args.ray_address,
        ray_config=args.ray_config, cpus_per_replica=args.cpus_per_replica)


def check_replica_options(r: ReplicaOptions) -> None:
    """Refuse replica settings that cannot work, before Ray or any model is touched.

    Raises:
        SpecDecodeError: the message names the flag and what to give.
    """
    def positive_int(flag: str, value, low: int = 1) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise SpecDecodeError(f"{flag} must be an integer >= {low}, got {value!r}")

    positive_int("--replicas", r.replicas)
    positive_int("--min-replicas", r.min_replicas, 0)
    positive_int("--max-replicas", r.max_replicas)
    positive_int("--prefix-chars", r.prefix_chars)
    positive_int("--route-imbalance", r.imbalance)
    positive_int("--replica-retries", r.retries, 0)
    if r.replicas > 1024:
        raise SpecDecodeError(f"--replicas {r.replicas} is absurd; give at most 1024")
    lo = r.min_replicas if r.min_replicas is not None else 1
    hi = r.max_replicas if r.max_replicas is not None else max(r.replicas, lo)
    if lo > hi:
        raise SpecDecodeError(f"--min-replicas {lo} is above --max-replicas {hi}")
    if r.autoscaling and not lo <= r.replicas <= hi:
        bounds = " and ".join(b for b in (f"--min-replicas {r.min_replicas}" if r.min_replicas is not None else "",
                                          f"--max-replicas {r.max_replicas}" if r.max_replicas is not None else "")
                              if b)
        raise SpecDecodeError(f"--replicas {r.replicas} (the initial count) must lie within the autoscaling bounds "
                              f"({bounds}; the missing bound defaults to --replicas)")
    if r.target_ongoing_requests is not None and not r.autoscaling:
        raise SpecDecodeError("--target-ongoing-requests steers the autoscaler: give --min-replicas and/or "
                              "--max-replicas with it")
    if r.target_ongoing_requests is not None and not (0 < r.target_ongoing_requests <= 10_000):
        raise SpecDecodeError(f"--target-ongoing-requests must be in (0, 10000], got {r.target_ongoing_requests}")
    if r.cpus_per_replica is not None and not (0 <= r.cpus_per_replica <= 1024):
        raise SpecDecodeError(f"--cpus-per-replica must be in [0, 1024], got {r.cpus_per_replica}")
    if r.router not in ROUTERS:
        raise SpecDecodeError(f"--router {r.router!r}: choose one of {', '.join(ROUTERS)}")
    if r.router != "prefix" and (r.prefix_chars != 256 or r.imbalance != 8):
        raise SpecDecodeError("--prefix-chars and --route-imbalance tune the prefix-affinity router: give --router "
                              "prefix with them")
    if r.ray_config is not None:
        path = Path(r.ray_config).expanduser()
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "no such file"
            raise SpecDecodeError(f"--ray-config {r.ray_config}: {what}; give a Ray Serve config file (YAML), e.g. "
                                  f"docs/ray/serve_config.yaml")


