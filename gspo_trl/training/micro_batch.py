"""The scored rollout and its micro-batches as one typed record, from the trainer's scoring to the loss.

Each log-prob quantity has one name from where it is produced to where the loss reads it:

| quantity                                    | name                | produced by                                  |
|---------------------------------------------|---------------------|----------------------------------------------|
| the sampler's per-token log-probs           | `sampling_logps`    | the engine, as it sampled (`Rollout`)        |
| whether the sampler was the trained policy  | `sampled_by_policy` | the rollout backend (`Rollout`)              |
| the policy's mass the loop's top-k/p kept   | `kept_log_mass`     | the decoding loop, where it truncated        |
| π_old, the weights that sampled             | `old_logps`         | `schedule.fill_old_logps` (None: unchanged)  |
| the reference model's                       | `ref_logps`         | the trainer's reference forward (beta > 0)   |
| the sampler's experts per position (MoE)    | `sampling_routes`   | the decoding loop (`Rollout`)                |
| π_old's experts per position (MoE)          | `old_routes`        | `schedule.fill_old_logps`'s forward          |
| the correction weight π_old / π_sampler     | `sampling_weights`  | `sampling_correction.correction_for`         |
| the current policy's (with a gradient)      | `logps`             | `compute_loss`'s forward                     |

`loss.policy_loss` takes them under the same names; its `sampling_logps` are another engine's only (`engine_logps`:
the decoding loop's own are π_old, not a sampler to correct for). The last two exist in the loss step only.

Owns the record, cutting rows out of it (`select`: micro-batches, a process's share, a training pass), padding its
columns to a multiple (`padded_to_multiple`) and its checkpoint form (`to_state` / `from_state`, which reads the key
names of earlier checkpoints). What it does not own: which rows go where (`schedule`, `passes`) and what the loss does
with them (`loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..models.multimodal import VisionInputs

# Key names of checkpoints written before the record (gspo-trl 0.2.0 and earlier): their names here; the sampler's
# log-probs were two keys, by whether they were the trained policy's own (the decoding loop's) or another engine's.
LEGACY_NAMES = {
    "old_per_token_logps": "old_logps",
    "ref_per_token_logps": "ref_logps",
}
_LEGACY_SAMPLING = {"sampling_per_token_logps": False, "decoding_per_token_logps": True}


@dataclass(slots=True)
class MicroBatch:
    """Scored completions: a whole rollout after scoring, one micro-batch of it, or one training pass of that.

    B rows, P prompt columns (left-padded), C completion columns (right-padded). Fields are tensors or None; a
    misspelled field is an `AttributeError` (slots), never a silent None.
    """

    input_ids: torch.Tensor  # (B, P + C) prompt then completion
    attention_mask: torch.Tensor  # (B, P + C)
    completion_ids: torch.Tensor  # (B, C)
    completion_mask: torch.Tensor  # (B, C) 1 on the tokens trained on
    advantages: torch.Tensor | None = None  # (B,), or (B, C) per token (per-turn advantages)
    rewards: torch.Tensor | None = None  # (B,) each row's total reward (an episode's return), NaN where none
    sampling_logps: torch.Tensor | None = None  # (B, C) the sampler's, recorded as it sampled; NaN where none
    sampled_by_policy: bool = False  # sampling_logps are the trained model's own (decoding loop), not an engine's
    # (B, C) log of the policy's mass the decoding loop's top-k / top-p / min-p kept at each token: its sampling_logps
    # (where recorded) are then the truncated, renormalised ones, `decoding.truncation.policy_logps` the policy's.
    # None: nothing cut, or another engine sampled.
    kept_log_mass: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None  # (B, C) π_old; None: the weights still are the sampling ones
    ref_logps: torch.Tensor | None = None  # (B, C) the reference model's (beta > 0)
    turn_ids: torch.Tensor | None = None  # (B, C) assistant turn of each token (multi-turn episodes)
    vision: VisionInputs | None = None  # a vision-language prompt's images, once per prompt (`multimodal`)
    # (B, P + C, L, k) int8/int16 the experts each position was routed to by the sampler (Mixture-of-Experts models
    # sampled by the decoding loop; -1 where not recorded): the routing metrics' reference, replayed with
    # routing_replay='rollout' (`moe.replay`).
    sampling_routes: torch.Tensor | None = None
    old_routes: torch.Tensor | None = None  # (B, P + C, L, k) π_old's experts (routing_replay='old'): the π_old pass's
    num_items_in_batch: torch.Tensor | None = None  # () completion tokens of the whole rollout, every process
    # A rollout no reward function scored (`skip_rollouts_without_rewards`): its loss is multiplied by 0, so that every
    # term (policy, KL, entropy) has a zero gradient while every parameter stays in the graph (DDP expects them all).
    skipped: bool = False
    # Set on one training pass of a micro-batch (`passes.take_pass`): the whole micro-batch's counts.
    micro_batch_rows: int | None = None
    micro_batch_tokens: torch.Tensor | None = None  # ()
    last_pass: bool = True

    @property
    def engine_logps(self) -> torch.Tensor | None:
        """(B, C) the log-probs of another engine that sampled (a vLLM server), for the sampling correction."""
        return None if self.sampled_by_policy else self.sampling_logps

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What `logprobs.completion_logprobs` scores: input_ids, attention_mask, completion_ids, completion_mask."""
        return self.input_ids, self.attention_mask, self.completion_ids, self.completion_mask

    @property
    def rows(self) -> int:
        return self.completion_ids.shape[0]

    def select(self, rows: torch.Tensor | slice, completion_width: int | None = None) -> MicroBatch:
        """These rows (an index tensor or a slice), and with `completion_width` only that many completion columns
        (the prompt's columns, left padding included, all stay)."""
        width = self.completion_ids.shape[1]
        cut = width if completion_width is None else completion_width
        kept = {}
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            if value is None:
                kept[name] = None
                continue
            value = value[rows if isinstance(rows, slice) else rows.to(value.device)]
            if name in ("input_ids", "attention_mask", "sampling_routes", "old_routes"):  # position-aligned
                value = value[:, : value.shape[1] - width + cut]
            elif value.dim() == 2 and value.shape[1] == width:  # completion-aligned
                value = value[:, :cut]
            kept[name] = value
        if self.vision is not None:
            kept["vision"] = self.vision.select(rows if isinstance(rows, slice) else rows.to(self.vision.groups.device))
        return replace(self, **kept)

    def padded_to_multiple(self, multiple: int | None, pad_token_id: int) -> MicroBatch:
        """The same rows with the prompt columns (on the left) and the completion columns (on the right) each padded
        to a multiple of `multiple` (TRL's `pad_to_multiple_of`): pad tokens, mask 0, zeros in completion-aligned
        fields. Attended tokens keep their positions (counted from the mask); None or a fit: unchanged."""
        width = self.completion_ids.shape[1]
        prompt_width = self.input_ids.shape[1] - width
        if multiple is None or (prompt_width % multiple == 0 and width % multiple == 0):
            return self
        left, right = -prompt_width % multiple, -width % multiple

        def pad(value: torch.Tensor, fill, sides: tuple[int, int]) -> torch.Tensor:
            return torch.nn.functional.pad(value, sides, value=fill)

        padded = {
            "input_ids": pad(self.input_ids, pad_token_id, (left, right)),
            "attention_mask": pad(self.attention_mask, 0, (left, right)),
            "completion_ids": pad(self.completion_ids, pad_token_id, (0, right)),
        }
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            if name not in padded and value is not None and value.dim() == 2 and value.shape[1] == width:
                padded[name] = pad(value, 0, (0, right))  # completion-aligned
        for name in ("sampling_routes", "old_routes"):  # (B, P + C, L, k) position-aligned; -1: not recorded
            if getattr(self, name) is not None:
                padded[name] = pad(getattr(self, name), -1, (0, 0, 0, 0, left, right))
        return replace(self, **padded)

    def to_state(self) -> dict[str, Any]:
        """The record as a checkpoint stores it: field name → tensor or plain value (the images as tensors named
        `vision.*`, see `VisionInputs.to_state`)."""
        state = {field.name: getattr(self, field.name) for field in fields(self) if field.name != "vision"}
        if self.vision is not None:
            state.update(self.vision.to_state())
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MicroBatch:
        """The record of a saved micro-batch, from this version's names or an earlier checkpoint's keys."""
        state = dict(state)
        state["vision"] = VisionInputs.from_state(state)  # pops its keys
        for key, by_policy in _LEGACY_SAMPLING.items():
            value = state.pop(key, None)
            if value is not None:
                state["sampling_logps"], state["sampled_by_policy"] = value, by_policy
        for key, name in LEGACY_NAMES.items():
            if key in state:
                state[name] = state.pop(key)
        return cls(**state)


# Fields with one entry per row (B, ...), cut by `select`.
_ROW_FIELDS = (
    "input_ids",
    "attention_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "rewards",
    "sampling_logps",
    "kept_log_mass",
    "old_logps",
    "ref_logps",
    "turn_ids",
    "sampling_routes",
    "old_routes",
)
