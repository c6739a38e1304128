"""Counters of one run; rates are derived when reported, never stored."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunMetrics:
    """What one request did. Times in seconds.

    Counters:
        num_prompt_tokens, num_generated_tokens: prompt length and committed output length.
        num_drafted_tokens, num_accepted_tokens: draft tokens verified / kept by verification.
        num_target_forwards: every target forward pass, the prefill included.
        num_verify_steps: target forwards after the prefill (one per loop step).
        num_step_tokens: tokens committed by those steps (bonus / recovered included).
        drafted_by_position[i], accepted_by_position[i]: steps whose draft reached
            position i, and steps that kept the draft token at position i.
        draft_lengths: gamma chosen at each step (what the draft-length policy did).
        prefill_time_s, draft_time_s, verify_time_s, wall_time_s, time_to_first_token_s.
        num_tree_steps, num_tree_nodes, tree_depth_sum, tree_accepted_depth_sum: token-tree
            steps, their nodes (tree size), deepest levels and accepted depths. For a tree,
            "drafted" counts nodes and "position" i means depth i + 1.
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

    def record_step(self, num_drafted: int, num_accepted: int, num_committed: int, depth: int | None = None) -> None:
        """Count one verification step: gamma drafted, tokens kept, tokens committed (after stopping).

        ``depth``: for a token tree, its deepest level (``num_drafted`` = nodes, ``num_accepted``
        = accepted depth); positions then count depths.
        """
        if depth is not None:
            self.num_tree_steps += 1
            self.num_tree_nodes += num_drafted
            self.tree_depth_sum += depth
            self.tree_accepted_depth_sum += num_accepted
        self.num_verify_steps += 1
        self.num_target_forwards += 1
        self.num_drafted_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_step_tokens += num_committed
        self.draft_lengths.append(num_drafted)
        positions = num_drafted if depth is None else depth
        grow = positions - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(positions):
            self.drafted_by_position[i] += 1
        for i in range(num_accepted):
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
        d = asdict(self)
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
