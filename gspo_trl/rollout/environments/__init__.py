"""Multi-turn episodes: environments the policy acts in over several assistant turns.

`text_env` holds the gym-style convention (``reset`` / ``step`` with text observations and actions) and its
checks; `chat` turns an observation into the token ids appended after an assistant turn; `tools` plays function
calls as environment steps. The episodes themselves are played by a rollout backend's runner
(`gspo_trl.rollout.episodes`). The loss never sees an environment: only the masks, turn ids and
per-turn rewards the episodes leave behind.
"""

from .text_env import StepResult

__all__ = ["StepResult"]
