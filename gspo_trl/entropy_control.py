"""The entropy bonus coefficient, fixed or adaptive (Skywork-OR1, arXiv 2505.22312), with TRL 1.16's rule.

Owns the coefficient applied to the entropy bonus and how it changes between optimizer steps; the
bonus itself is part of the loss (`loss.policy_loss(entropy_coef=...)`) and the entropy measurement
comes from the trainer. Adaptive rule: after each optimizer step, with H the mean per-token entropy of
that step over every process, the coefficient rises by `delta` if H <= target and falls by `delta`
otherwise (kept in [minimum, maximum]); the bonus is applied only while the last measured H <= target.
Before the first measurement nothing is applied.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class EntropyCoefficient:
    coefficient: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    minimum: float = 0.0
    maximum: float = 1.0
    last_entropy: float = math.inf  # the mean entropy of the last optimizer step

    @classmethod
    def from_config(cls, args) -> EntropyCoefficient:
        return cls(
            args.entropy_coef,
            args.use_adaptive_entropy,
            args.entropy_target,
            args.entropy_coef_delta,
            args.entropy_coef_min,
            args.entropy_coef_max,
        )

    @property
    def enabled(self) -> bool:
        """Whether the loss needs entropies with a gradient (for the whole run: adaptive may re-engage)."""
        return self.adaptive or self.coefficient != 0.0

    def to_apply(self) -> float:
        if not self.adaptive:
            return self.coefficient
        return self.coefficient if self.last_entropy <= self.target else 0.0

    def end_of_step(self, mean_entropy: float) -> None:
        """Update the adaptive coefficient with the mean entropy of the optimizer step that just ended."""
        if not self.adaptive:
            return
        if mean_entropy <= self.target:
            self.coefficient = min(self.coefficient + self.delta, self.maximum)
        else:
            self.coefficient = max(self.coefficient - self.delta, self.minimum)
        self.last_entropy = mean_entropy

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.coefficient, self.last_entropy = state["coefficient"], state["last_entropy"]
