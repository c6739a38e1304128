"""OpenAI-compatible HTTP server with batched speculative decoding (``specdecode serve``).

- :mod:`specdecode.server.app`: the FastAPI app, routes, streaming, errors.
- :mod:`specdecode.server.schemas`: pydantic wire schemas.
- :mod:`specdecode.server.metrics`: Prometheus metrics.
- :mod:`specdecode.server.launch`: load models, calibrate, run uvicorn; the CLI flags.

The batched engine itself is :mod:`specdecode.batch`.
"""

from specdecode.server.app import ServerConfig, ServingState, create_app
from specdecode.server.launch import ServeOptions, build_state, load_state, run

__all__ = ["ServeOptions", "ServerConfig", "ServingState", "build_state", "create_app", "load_state", "run"]
