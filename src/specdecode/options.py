"""The names the command line offers, with no model code behind them (no torch, no transformers).

``specdecode --help``, every argument error and every check that needs no model answer at once,
because the parsers (``cliargs.py``, ``bench/__init__.py``, ``cli.py``) read their choices from
here. The modules that use these names re-export them (``kernels.WEIGHT_PRECISIONS``); the
copies that still live beside their code are kept equal to these by tests/test_cliargs.py
(``policy.POLICIES``, ``kv.FORWARD_BACKENDS``, ``server.state.ServerConfig.max_request_bytes``).
"""

from __future__ import annotations

#: The model ``specdecode generate`` / ``serve`` run when given no --target.
DEFAULT_TARGET = "smollm2-135m"
#: The offline catalog's model names, for help texts (``specdecode.models.OFFLINE_MODELS``' keys; a test keeps
#: the two equal).
CATALOG_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m")

#: Node budget of a token tree and of suffix decoding (``--tree-nodes``): 15 nodes and the root fill one 16-row
#: block of the batch-invariant verification forward; 16 would cost two.
DEFAULT_TREE_NODES = 15
#: γ (``num_speculative_tokens``, ``-k``) when neither a drafter spec nor the caller names one.
DEFAULT_GAMMA = 5
#: Shortest and longest n-gram the ngram drafter matches (``--ngram-min`` / ``--ngram-max``, ``NgramConfig``).
DEFAULT_NGRAM_MIN = 1
DEFAULT_NGRAM_MAX = 3
#: A draft model's vocabulary by default when its own holds more than twice as many ids and its forward can
#: limit it (``DraftModelConfig.vocab``): its first 32,768 ids plus each row's context ids.
AUTO_DRAFT_VOCAB = 32768

#: Precisions a model's weights can execute in (``specdecode.lowbit.set_weight_precision``).
WEIGHT_PRECISIONS = ("fp32", "bf16", "int8", "int4")
#: What ``--weights`` takes: ``auto`` (the library measures and picks one per machine) or a precision.
WEIGHT_CHOICES = ("auto", *WEIGHT_PRECISIONS)

#: Dtypes a model can be loaded in (``--dtype``).
DTYPES = ("float32", "bfloat16", "float16")

#: Draft-length policies (``specdecode.policy.POLICIES``).
POLICY_NAMES = ("auto", "fixed", "heuristic", "confidence", "cost-model")

#: Token-tree kinds of a draft model (``--tree``): chains, static top-k trees, EAGLE-2 dynamic trees.
TREE_KINDS = ("none", "static", "dynamic")

#: Target forward backends (``specdecode.kv.FORWARD_BACKENDS``).
FORWARD_BACKENDS = ("auto", "hf", "owned")

#: How sampled draft chains are verified (``--verification``, ``EngineConfig.verification``, the server's
#: ``speculative.verification``): "token" (token-wise rejection sampling, Leviathan et al. 2023), "block"
#: (block verification, Sun et al. 2024), "auto" (the engine's choice per drafter).
VERIFICATION_METHODS = ("auto", "token", "block")

#: Sampling modes (``--sampling-mode``, the server's ``speculative.sampling_mode``) and the
#: ``SamplingParams.coupled`` each means: auto (coupled when a seed is given), standard rejection
#: sampling, the coupled mode (``specdecode.coupled``).
SAMPLING_MODES = {"auto": None, "standard": False, "coupled": True}

#: Largest request body the server reads, bytes (the server's ``--max-request-bytes`` default).
DEFAULT_MAX_REQUEST_BYTES = 1 << 20

__all__ = ["AUTO_DRAFT_VOCAB", "CATALOG_MODELS", "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_TARGET", "DEFAULT_TREE_NODES", "DTYPES", "FORWARD_BACKENDS", "POLICY_NAMES",
           "SAMPLING_MODES", "TREE_KINDS", "VERIFICATION_METHODS", "WEIGHT_CHOICES", "WEIGHT_PRECISIONS"]
