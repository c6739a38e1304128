"""``specdecode audit``: is an endpoint (or this engine) lossless? The losslessness test as a product.

Sampled mode (temperature > 0): for each prompt the target's exact law over its first n generated tokens
(n = 1..3) is enumerated from the same weights loaded here, with the request's whole processing
(``specdecode.sampling``: temperature, top-k, top-p, min-p, penalties, biases), then N completions are drawn
from the source (an OpenAI-compatible ``/v1/completions`` endpoint, or this project's own speculative engine
in-process with any drafter) and compared with it: chi-square, total variation against its null spread,
impossible outputs, and a verdict with its power. Greedy mode (temperature 0): the source's tokens must
equal plain greedy decoding's, with the logit margin at any divergence.

Modules (one noun each): :mod:`.config` (settings and checks, no torch), :mod:`.law` (the exact law),
:mod:`.stats` (tests, null spread, power, Holm), :mod:`.sources` (where samples come from: endpoint,
engine), :mod:`.runner` (the audit itself), :mod:`.report` (terminal tables, report.json / report.md, plot).
This package imports only :mod:`.config`, so the command line's checks stay light.
"""

from specdecode.audit.config import AuditConfig, AuditError, check_audit

__all__ = ["AuditConfig", "AuditError", "check_audit"]
