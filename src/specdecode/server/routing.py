"""Prefix-affinity routing of the Ray Serve replicas, Ray-free: the routing key of a request and the ranking of
replicas for it (the router, ``specdecode.server.ray_router``, only adapts this to Ray Serve's API).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

#: Endpoints whose body names a prompt (the prefix-affinity router reads them).
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


def routing_key(path: str, body: bytes, prefix_chars: int = 256) -> str | None:
    """The prefix-affinity key of a request: a hash of its first ``prefix_chars`` characters of prompt.

    Chat: the messages up to and including the first user message (a conversation's later turns
    repeat them, so every turn gets the same key). Completions: the start of the (first) prompt;
    token-id prompts use their first ``prefix_chars // 4`` ids. None for other endpoints and for
    bodies that are not such JSON (the router then falls back to the power of two choices).

    Returns:
        a 16-hex-digit key, or None.
    """
    if path not in GENERATE_PATHS or not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        head = []
        for m in messages:
            head.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        text = json.dumps(head, sort_keys=True, ensure_ascii=False)
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, list):
            text = json.dumps(prompt[: max(1, prefix_chars // 4)])
        elif isinstance(prompt, str):
            text = prompt
        else:
            return None
    text = f"{data.get('model')}\x00{text[:prefix_chars]}"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _weight(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest(), "big")


def rank_replicas(key: str | None, replicas: Sequence[str], queue_lens: dict[str, int | None],
                  imbalance: int = 8) -> list[list[str]]:
    """Ranks of replicas for one request (the prefix-affinity router's decision, Ray-free).

    Rendezvous (highest-random-weight) hashing: the replica with the largest hash of (key, replica) is the
    key's home, so a key keeps its replica while replicas come and go (only the keys of a replica that
    left move). When the home's queue is ``imbalance`` or more requests longer than the shortest known
    queue, load wins and the replicas are ranked by queue length.

    Args:
        key: the request's :func:`routing_key` (None: no preference, every replica in one rank).
        replicas: the candidate replica ids.
        queue_lens: the last known queue length of each replica (missing / None: unknown, taken as 0).

    Returns:
        ranks, most preferred first (each a list of replica ids; Ray tries the first rank first, and a
        later one when every replica of the earlier ranks is full).
    """
    if not replicas:
        return []
    if key is None or len(replicas) == 1:
        return [list(replicas)]
    ranked = sorted(replicas, key=lambda r: _weight(key, r), reverse=True)
    q = {r: (queue_lens.get(r) or 0) for r in replicas}
    if q[ranked[0]] - min(q.values()) >= imbalance:
        return [sorted(replicas, key=lambda r: q[r])]
    return [[r] for r in ranked]  # the home, then the key's second choice, ...: one replica probed at a time
