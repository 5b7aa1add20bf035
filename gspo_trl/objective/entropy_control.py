"""The entropy bonus coefficient, fixed or adaptive (Skywork-OR1, arXiv 2505.22312), with TRL 1.16's rule.

Owns the coefficient applied to the entropy bonus and how it changes between optimizer steps; the bonus itself is
part of the loss (`loss.policy_loss(entropy_coef=...)`); the entropy of each micro-batch comes from the trainer,
and `observe` adds it up over an optimizer step. Adaptive rule: after each optimizer step, with H the mean
per-token entropy of that step over every process, the coefficient rises by `delta` if H <= target and falls by
`delta` otherwise (kept in [minimum, maximum]); the bonus is applied only while the last measured H <= target.
Before the first measurement nothing is applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class EntropyCoefficient:
    coefficient: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    minimum: float = 0.0
    maximum: float = 1.0
    last_entropy: float = math.inf  # the mean entropy of the last optimizer step
    _window: object = field(default=None, repr=False, compare=False)  # this step's (entropy sum, tokens) so far

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

    def observe(self, entropy, learned, accelerator) -> None:
        """Add a micro-batch's (B, C) `entropy` on its `learned` tokens to this optimizer step's; at the step's end
        (`accelerator.sync_gradients`), update the coefficient with the step's mean over every process."""
        window = torch.stack([entropy[learned].sum(), learned.sum().to(entropy.dtype)])
        self._window = window if self._window is None else self._window + window
        if accelerator.sync_gradients:
            total = accelerator.reduce(self._window, reduction="sum")
            self.end_of_step((total[0] / total[1].clamp(min=1.0)).item())
            self._window = None

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in _STATE}

    def load_state_dict(self, state: dict) -> None:
        self.coefficient, self.last_entropy = state["coefficient"], state["last_entropy"]


_STATE = ("coefficient", "adaptive", "target", "delta", "minimum", "maximum", "last_entropy")
