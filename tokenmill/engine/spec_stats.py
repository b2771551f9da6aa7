"""Speculative decoding's counts, as the engine sees each step's results come back.

`SpecDecodeStats` is the engine's own, mutable tally (updated on the engine's thread);
`SpecDecodeCounts` is an immutable copy of it (`SpecDecodeStats.snapshot()`), which another thread
may read (the server's /metrics) and which a benchmark subtracts from a later one to get the counts
of one run (`later.since(earlier)`).

The figures, on both:

- `verify_steps`: request-steps that verified at least one draft token (a request with drafts in a
  step counts once);
- `drafts`: draft tokens verified; `accepted`: of which accepted;
- `drafted_at[i]` / `accepted_at[i]`: request-steps whose draft had a token at position i / whose
  first i + 1 draft tokens were all accepted (acceptance stops at the first rejection);
- `acceptance_rate` = accepted / drafts;
- `mean_accepted_length` = 1 + accepted / verify_steps: the tokens a verifying request-step emitted
  on average (its accepted drafts plus the one token the target samples itself);
- `acceptance_by_position[i]` = accepted_at[i] / drafted_at[i]: of the drafts that reached position
  i, the fraction accepted up to and including it.
"""

from dataclasses import dataclass, field

import numpy as np


def _acceptance_rate(accepted: int, drafts: int) -> float:
    return accepted / drafts if drafts else 0.0


def _mean_accepted_length(accepted: int, verify_steps: int) -> float:
    return 1.0 + accepted / verify_steps if verify_steps else 0.0


def _by_position(accepted_at, drafted_at) -> list[float]:
    return [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)]


@dataclass(frozen=True)
class SpecDecodeCounts:
    """An immutable copy of the counts (see the module's docstring for what each means)."""

    num_speculative_tokens: int
    verify_steps: int = 0
    drafts: int = 0
    accepted: int = 0
    drafted_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("drafted_at", "accepted_at"):  # one entry per draft position, zeros if not given
            values = tuple(getattr(self, name))
            if len(values) > self.num_speculative_tokens:
                raise ValueError(f"{name} has {len(values)} positions, more than {self.num_speculative_tokens}")
            object.__setattr__(self, name, values + (0,) * (self.num_speculative_tokens - len(values)))

    @property
    def acceptance_rate(self) -> float:
        return _acceptance_rate(self.accepted, self.drafts)

    @property
    def mean_accepted_length(self) -> float:
        return _mean_accepted_length(self.accepted, self.verify_steps)

    @property
    def acceptance_by_position(self) -> list[float]:
        return _by_position(self.accepted_at, self.drafted_at)

    def since(self, earlier: "SpecDecodeCounts") -> "SpecDecodeCounts":
        """The counts between `earlier` (a snapshot of the same tally) and this one."""
        if earlier.num_speculative_tokens != self.num_speculative_tokens:
            raise ValueError("the two snapshots are of different speculative configurations")
        return SpecDecodeCounts(self.num_speculative_tokens, self.verify_steps - earlier.verify_steps,
                                self.drafts - earlier.drafts, self.accepted - earlier.accepted,
                                tuple(a - b for a, b in zip(self.drafted_at, earlier.drafted_at)),
                                tuple(a - b for a, b in zip(self.accepted_at, earlier.accepted_at)))


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    verify_steps: int = 0  # request-steps that verified at least one draft
    drafts: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: accepted up to there
    drafted_at: list[int] = field(default_factory=list)  # per draft position: drafts that reached it

    def __post_init__(self) -> None:
        self.accepted_at = [0] * self.num_speculative_tokens
        self.drafted_at = [0] * self.num_speculative_tokens

    def record(self, num_drafts: np.ndarray, num_emitted: np.ndarray) -> None:
        """One step's entries: drafts verified and tokens emitted (1 + accepted) each."""
        verified = num_drafts > 0
        accepted = np.where(verified, num_emitted - 1, 0)
        self.verify_steps += int(verified.sum())
        self.drafts += int(num_drafts.sum())
        self.accepted += int(accepted.sum())
        for position in range(self.num_speculative_tokens):
            self.accepted_at[position] += int((accepted > position).sum())
            self.drafted_at[position] += int((num_drafts > position).sum())

    def snapshot(self) -> SpecDecodeCounts:
        """An immutable copy, safe to hand to another thread."""
        return SpecDecodeCounts(self.num_speculative_tokens, self.verify_steps, self.drafts, self.accepted,
                                tuple(self.drafted_at), tuple(self.accepted_at))

    @property
    def acceptance_rate(self) -> float:
        return _acceptance_rate(self.accepted, self.drafts)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request-step emitted on average (1 + its accepted drafts)."""
        return _mean_accepted_length(self.accepted, self.verify_steps)

    @property
    def acceptance_by_position(self) -> list[float]:
        return _by_position(self.accepted_at, self.drafted_at)

    def summary(self) -> str:
        per_position = ", ".join(f"{r:.2f}" for r in self.acceptance_by_position)
        return (f"speculative decoding: {self.accepted}/{self.drafts} drafts accepted "
                f"({100 * self.acceptance_rate:.1f} %), {self.mean_accepted_length:.2f} tokens per verifying step, "
                f"acceptance by position [{per_position}]")
