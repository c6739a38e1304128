"""The entry of ``specdecode serve`` and ``python -m specdecode.server``: one process (:func:`launch.run`) or
replicas on Ray Serve (:func:`replicas.run`, which builds on ``launch``; imported only with ``--replicas``,
since it needs Ray and Ray's import takes seconds)."""

from __future__ import annotations

import argparse
import sys

import torch

from specdecode.cliargs import add_serve_arguments
from specdecode.errors import SpecDecodeError
from specdecode.scaleout import replica_options_from_args
from specdecode.server.launch import options_from_args, run


def run_from_args(args: argparse.Namespace) -> int:
    """Run the server the parsed ``specdecode serve`` flags describe (with ``--replicas``: on Ray Serve)."""
    torch.set_grad_enabled(False)
    replicas = replica_options_from_args(args)
    if replicas is not None:
        from specdecode.server.replicas import run as run_replicas  # lazy: Ray (start-up time, optional)

        return run_replicas(options_from_args(args), replicas)
    return run(options_from_args(args))


def main(argv: list[str] | None = None) -> int:
    """``python -m specdecode.server``: the flags of ``specdecode serve``; exit status 2 on a refused setting."""
    parser = argparse.ArgumentParser(prog="python -m specdecode.server",
                                     description="OpenAI-compatible server with lossless speculative decoding")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except SpecDecodeError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


__all__ = ["main", "run_from_args"]
