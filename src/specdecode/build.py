"""The one builder: target + drafter spec -> draft, proposer factory, draft-length policy and engine.

Every front end lands here once its target is loaded: ``SpecDecoder.from_pretrained`` and ``SpecDecoder(...)``,
``serve`` (``server.launch.build_state``), ``bench`` (``bench.runner.engine_runner``), ``tune``, ``audit`` and
``train-drafter`` (through ``from_pretrained``). So one :class:`~specdecode.spec.DrafterSpec` is the same engine
in all of them: same proposer config, same policy, same engine config.

- :func:`load_draft_for` loads the draft model a spec names (``proposers.factory.load_draft``);
- :func:`build_factory` turns the spec into a factory of fresh proposers (``proposers.factory.factory_from_spec``);
- :func:`assemble` puts a proposer, its draft-length policy and the target into one engine;
- :func:`build_engine` does the last two in one call;
- :func:`choose_skip_layers` gives a layer-skip proposer without a skip set its set (cached, else searched):
  the one place the layer-skip choice is made for ``generate``, ``serve`` and the library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.models import LoadedModel
from specdecode.options import DEFAULT_GAMMA
from specdecode.policy import build_policy
from specdecode.proposers.base import Proposer
from specdecode.proposers.factory import factory_from_spec, load_draft
from specdecode.proposers.layer_skip import LayerSkipProposer
from specdecode.spec import DrafterSpec

def load_draft_for(spec: DrafterSpec, target: LoadedModel, target_spec: str, **kwargs) -> LoadedModel | None:
    """The draft LoadedModel ``spec`` names (None for model-free drafters); see ``proposers.factory.load_draft``.

    Raises:
        ModelLoadError, IncompatibleTokenizerError.
    """
    return load_draft(spec, target, target_spec, **kwargs)


def build_factory(spec: DrafterSpec, target: LoadedModel | None, draft: LoadedModel | None = None, *,
                  cache_dir: str | None = None) -> Callable[[], Proposer] | None:
    """A zero-argument factory of fresh proposers for ``spec`` over loaded models; None for plain decoding.

    Raises:
        SpecDecodeError: as ``proposers.factory.factory_from_spec``.
    """
    return factory_from_spec(spec, target=None if target is None else target.model,
                             draft=None if draft is None else draft.model,
                             target_tokenizer=None if target is None else target.tokenizer,
                             draft_tokenizer=None if draft is None else draft.tokenizer,
                             cache_dir=None if cache_dir is None else str(cache_dir))


def gamma_of(spec: DrafterSpec, default: int | None = None) -> int:
    """The spec's γ, else ``default``, else :data:`DEFAULT_GAMMA`."""
    return spec.num_speculative_tokens or default or DEFAULT_GAMMA


def assemble(target: LoadedModel, proposer: Proposer | None, *, num_speculative_tokens: int = DEFAULT_GAMMA,
             policy="auto", max_batch_size: int = 1, forward: str = "auto", verification: str = "auto",
             max_context: int | None = None) -> SpeculativeEngine:
    """The engine over ``target`` with ``proposer`` (None: plain decoding, no policy) and a draft-length policy.

    Args:
        num_speculative_tokens: γ of the fixed policy, the starting γ of the others (1..64).
        policy: a policy name (``policy.build_policy``) or a policy object.
        max_batch_size, forward, verification: ``EngineConfig``'s; max_context: positions per row (None: the
            target's).

    Raises:
        SpecDecodeError: γ, batch, forward or verification out of range; an unknown policy.
    """
    config = EngineConfig(num_speculative_tokens=num_speculative_tokens, max_batch_size=max_batch_size,
                          max_context=max_context or target.max_context, forward=forward, verification=verification)
    draft_policy = None
    if proposer is not None:
        draft_policy = (build_policy(policy, num_speculative_tokens, proposer=proposer) if isinstance(policy, str)
                        else policy)
    return SpeculativeEngine(target.model, proposer, config, policy=draft_policy)


@dataclass
class Built:
    """What :func:`build_engine` made: the engine, the factory behind its proposer, and the draft model."""

    engine: SpeculativeEngine
    factory: Callable[[], Proposer] | None
    draft: LoadedModel | None
    spec: DrafterSpec


def build_engine(target: LoadedModel, spec: DrafterSpec, *, draft: LoadedModel | None = None,
                 num_speculative_tokens: int | None = None, policy="auto", max_batch_size: int = 1,
                 forward: str = "auto", verification: str = "auto", cache_dir: str | None = None) -> Built:
    """The engine one drafter spec means over a loaded target (and its loaded draft model).

    Args:
        target: the target LoadedModel (weights in the precision they run in).
        spec: the drafter; its γ wins over ``num_speculative_tokens`` (the front end's default).
        draft: the draft LoadedModel of a draft-model spec (:func:`load_draft_for`).
        policy, max_batch_size, forward, verification: as :func:`assemble`. cache_dir: layer-skip sets, heads.

    Raises:
        SpecDecodeError: as :func:`build_factory` and :func:`assemble`.
    """
    factory = build_factory(spec, target, draft, cache_dir=cache_dir)
    engine = assemble(target, factory() if factory is not None else None,
                      num_speculative_tokens=gamma_of(spec, num_speculative_tokens), policy=policy,
                      max_batch_size=max_batch_size, forward=forward, verification=verification)
    return Built(engine, factory, draft, spec)


def choose_skip_layers(proposer: Proposer | None, prompts: Sequence[Sequence[int]],
                       say: Callable[[str], None] | None = None):
    """A layer-skip proposer without a skip set: the set cached for the model, else a search on ``prompts``
    (at most three). Other proposers, and one with its set, are left alone.

    Returns:
        the calibration's result (``.line()`` says what was chosen), or None when nothing was chosen.
    """
    if not isinstance(proposer, LayerSkipProposer) or proposer.config.skip_layers is not None:
        return None
    if say is not None:
        say("layer-skip: choosing the layers to skip (cached per model; the search shows its progress and an "
            "estimate of its time)")
    result = proposer.calibrate([list(p) for p in prompts[:3]])  # a set slower than plain: drafting off
    if say is not None:
        say(f"layer-skip: {result.line()}")
    return result


__all__ = ["Built", "assemble", "build_engine", "build_factory", "choose_skip_layers", "gamma_of",
           "load_draft_for"]
