"""OpenAI-compatible HTTP server with batched speculative decoding (``specdecode serve``).

- :mod:`specdecode.server.app`: the FastAPI app and its routes, streaming.
- :mod:`specdecode.server.errors`: OpenAI-style error bodies; reading and validating a body.
- :mod:`specdecode.server.state`: ``ServerConfig`` and ``ServingState`` (what the routes share).
- :mod:`specdecode.server.choices`: one request's choices (text offsets, stop strings, logprobs) and its job.
- :mod:`specdecode.server.jobs`: a request body into a job (prompts, sampling, speculation, grammar).
- :mod:`specdecode.server.responses`: response bodies in OpenAI's wire format.
- :mod:`specdecode.server.schemas`: pydantic wire schemas.
- :mod:`specdecode.server.metrics`: Prometheus metrics.
- :mod:`specdecode.server.launch`: load models, build the engine and its scheduler, run uvicorn.
- :mod:`specdecode.server.entry`: ``specdecode serve`` / ``python -m specdecode.server`` (one process, or
  replicas on Ray Serve through :mod:`specdecode.server.replicas`).

The engine is :mod:`specdecode.engine` (one, batched); the queue, admission and the
background thread are :mod:`specdecode.scheduler`.
"""

from specdecode.server.app import create_app
from specdecode.server.launch import ServeOptions, build_state, load_state, run
from specdecode.server.state import ServerConfig, ServingState

__all__ = ["ServeOptions", "ServerConfig", "ServingState", "build_state", "create_app", "load_state", "run"]
