"""Counters of one run; rates are derived when reported, never stored."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    """One verification step of one request, as verified (before any cut of the request's output).

    Attributes:
        start: tokens the request had generated before this step (the prefill's first token included).
        nodes: draft nodes verified (a chain: its length; 0 = a plain decoding step).
        accepted: draft tokens verification kept (a tree: the accepted depth).
        committed: tokens the step committed after the stopping rules (EOS, the token cap): 1..accepted + 1.
        depth: a token tree's deepest level; None for a chain.
    """

    start: int
    nodes: int
    accepted: int
    committed: int
    depth: int | None = None

    def counted(self, end: int) -> "StepRecord | None":
        """This step as counted when the request's output ends at ``end`` generated tokens (the one rule
        every counter follows, whatever ended the request: EOS, the token cap, a stop string, the caller).

        Returns None when none of the step's tokens is kept (it is not counted at all: not a forward, not
        a draft). When the end falls inside the accepted block, the draft tokens past it could never be
        committed: the step counts ``kept`` drafted, ``kept`` accepted (a tree: nodes and depth too) and
        ``kept`` committed. Otherwise (every committed token kept) the step counts as verified.
        """
        kept = min(self.committed, end - self.start)
        if kept <= 0:
            return None
        if kept <= self.accepted:
            return StepRecord(self.start, kept, kept, kept, None if self.depth is None else kept)
        return self


#: The counters a step moves (what :meth:`RunMetrics.cut` recounts from the step records).
_STEP_COUNTERS = ("num_drafted_tokens", "num_accepted_tokens", "num_verify_steps", "num_step_tokens",
                  "num_tree_steps", "num_tree_nodes", "tree_depth_sum", "tree_accepted_depth_sum")


@dataclass
class RunMetrics:
    """What one request did. Times in seconds.

    Every step counter is counted from the step records (``steps``) up to the request's committed end:
    the tokens it delivered, whatever ended it (:meth:`StepRecord.counted`). A front end that ends the
    output before the engine's last token (a stop string found in the text) calls :meth:`cut`.

    Counters:
        num_prompt_tokens, num_generated_tokens: prompt length and committed output length.
        num_drafted_tokens, num_accepted_tokens: draft tokens verified that could be committed / kept by
            verification and committed.
        num_target_forwards: every target forward pass that committed a delivered token, the prefill included.
        num_verify_steps: those forwards after the prefill (one per loop step).
        num_step_tokens: tokens committed by those steps (bonus / recovered included).
        drafted_by_position[i], accepted_by_position[i]: steps whose draft reached
            position i, and steps that kept the draft token at position i.
        draft_lengths: draft nodes verified at each step (a chain: the gamma the draft-length policy chose;
            a tree: its node count), cut as drafted is.
        prefill_time_s, draft_time_s, verify_time_s, wall_time_s, time_to_first_token_s.
        num_tree_steps, num_tree_nodes, tree_depth_sum, tree_accepted_depth_sum: token-tree
            steps, their nodes (tree size), deepest levels and accepted depths. For a tree,
            "drafted" counts nodes and "position" i means depth i + 1.
        steps: the [StepRecord] of every verification step, as verified (not in :meth:`to_dict`).
    """

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_forwards: int = 0
    num_verify_steps: int = 0
    num_step_tokens: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    num_tree_steps: int = 0
    num_tree_nodes: int = 0
    tree_depth_sum: int = 0
    tree_accepted_depth_sum: int = 0
    steps: list[StepRecord] = field(default_factory=list, repr=False)

    def record_step(self, num_drafted: int, num_accepted: int, num_committed: int, depth: int | None = None,
                    start: int | None = None) -> None:
        """Count one verification step: draft nodes verified, draft tokens kept by verification, tokens
        committed (after the stopping rules), as :meth:`StepRecord.counted` counts them (an EOS or the token
        cap inside the accepted block: only the draft tokens up to it).

        ``depth``: for a token tree, its deepest level (``num_drafted`` = nodes, ``num_accepted``
        = accepted depth); positions then count depths. ``start``: tokens generated before the step
        (default: right after the previous step, or after the prefill's one token).
        """
        if start is None:
            start = self.steps[-1].start + self.steps[-1].committed if self.steps else 1
        step = StepRecord(start, num_drafted, num_accepted, num_committed, depth)
        self.steps.append(step)
        self._count(step.counted(start + num_committed))

    def cut(self, end: int) -> None:
        """The request's output ends at ``end`` generated tokens (a front end found a stop string there, or
        kept only that many): every step counter is recounted from ``steps`` up to there, the forwards of
        steps past it dropped, the prefill's kept.

        Raises:
            ValueError: ``end`` < 0.
        """
        if end < 0:
            raise ValueError(f"a request's output cannot end at {end} tokens")
        prefill_forwards = self.num_target_forwards - self.num_verify_steps
        for name in _STEP_COUNTERS:
            setattr(self, name, 0)
        self.drafted_by_position, self.accepted_by_position, self.draft_lengths = [], [], []
        for step in self.steps:
            self._count(step.counted(end))
        self.num_target_forwards = prefill_forwards + self.num_verify_steps
        self.num_generated_tokens = min(self.num_generated_tokens, end)

    def copy(self) -> "RunMetrics":
        """An independent copy (its lists too): a snapshot another thread may cut."""
        return dataclasses.replace(self, **{f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), list)})

    def _count(self, step: StepRecord | None) -> None:
        """Add one counted step (None: a step past the end, not counted) to the counters: the one place they move."""
        if step is None:
            return
        if step.depth is not None:
            self.num_tree_steps += 1
            self.num_tree_nodes += step.nodes
            self.tree_depth_sum += step.depth
            self.tree_accepted_depth_sum += step.accepted
        self.num_verify_steps += 1
        self.num_target_forwards += 1
        self.num_drafted_tokens += step.nodes
        self.num_accepted_tokens += step.accepted
        self.num_step_tokens += step.committed
        self.draft_lengths.append(step.nodes)
        positions = step.nodes if step.depth is None else step.depth
        grow = positions - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(positions):
            self.drafted_by_position[i] += 1
        for i in range(step.accepted):
            self.accepted_by_position[i] += 1

    # Derived figures -------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens committed per verification forward, bonus / recovered included (1.0 = plain decoding)."""
        return self.num_step_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft token i kept | the draft reached position i), per position."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def mean_draft_length(self) -> float:
        """Mean gamma per verification step (0 = plain steps included; what the draft-length policy did)."""
        return sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else 0.0

    @property
    def draft_length_histogram(self) -> dict[int, int]:
        """{gamma: steps} over the verification steps, gamma ascending (0 = a plain decoding step)."""
        counts: dict[int, int] = {}
        for g in self.draft_lengths:
            counts[g] = counts.get(g, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def mean_tree_size(self) -> float:
        """Nodes per token-tree step (0.0 without tree steps)."""
        return self.num_tree_nodes / self.num_tree_steps if self.num_tree_steps else 0.0

    @property
    def mean_tree_depth(self) -> float:
        """Deepest level per token-tree step (0.0 without tree steps)."""
        return self.tree_depth_sum / self.num_tree_steps if self.num_tree_steps else 0.0

    @property
    def mean_accepted_depth(self) -> float:
        """Accepted path length per token-tree step, bonus excluded (0.0 without tree steps)."""
        return self.tree_accepted_depth_sum / self.num_tree_steps if self.num_tree_steps else 0.0

    @property
    def other_time_s(self) -> float:
        """Wall time outside prefill, drafting and verification (commit, rollback, stopping, Python)."""
        return max(0.0, self.wall_time_s - self.prefill_time_s - self.draft_time_s - self.verify_time_s)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time (prefill included)."""
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {f.name: (list(v) if isinstance(v := getattr(self, f.name), list) else v)  # the step log left out:
             for f in dataclasses.fields(self) if f.name != "steps"}  # the counters are what it adds up to
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            mean_draft_length=self.mean_draft_length,
            draft_length_histogram=self.draft_length_histogram,
            mean_tree_size=self.mean_tree_size,
            mean_tree_depth=self.mean_tree_depth,
            mean_accepted_depth=self.mean_accepted_depth,
            other_time_s=self.other_time_s,
            tokens_per_s=self.tokens_per_s,
        )
        return d
