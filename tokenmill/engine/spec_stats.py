"""Speculative decoding's counts, as the engine sees each step's results come back."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    verify_steps: int = 0  # request-steps that verified at least one draft
    drafts: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: accepted there

    def __post_init__(self) -> None:
        self.accepted_at = [0] * self.num_speculative_tokens

    def record(self, num_drafts: np.ndarray, num_emitted: np.ndarray) -> None:
        """One step's entries: drafts verified and tokens emitted (1 + accepted) each."""
        verified = num_drafts > 0
        accepted = np.where(verified, num_emitted - 1, 0)
        self.verify_steps += int(verified.sum())
        self.drafts += int(num_drafts.sum())
        self.accepted += int(accepted.sum())
        for position in range(self.num_speculative_tokens):
            self.accepted_at[position] += int((accepted > position).sum())

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request-step emitted on average (1 + its accepted drafts)."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 0.0

    def summary(self) -> str:
        per_position = ", ".join(f"{n / self.verify_steps:.2f}" if self.verify_steps else "0"
                                 for n in self.accepted_at)
        return (f"speculative decoding: {self.accepted}/{self.drafts} drafts accepted "
                f"({100 * self.acceptance_rate:.1f} %), {self.mean_accepted_length:.2f} tokens per verifying step, "
                f"acceptance by position [{per_position}]")
