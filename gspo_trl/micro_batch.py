"""The scored rollout and its micro-batches as one typed record, from the trainer's scoring to the loss.

Each log-prob quantity has one name from where it is produced to where the loss reads it:

| quantity                                    | name                | produced by                                  |
|---------------------------------------------|---------------------|----------------------------------------------|
| the sampler's per-token log-probs           | `sampling_logps`    | the engine, as it sampled (`Rollout`)        |
| whether the sampler was the trained policy  | `sampled_by_policy` | the rollout backend (`Rollout`)              |
| π_old, the weights that sampled             | `old_logps`         | `schedule.fill_old_logps` (None: unchanged)  |
| the reference model's                       | `ref_logps`         | the trainer's reference forward (beta > 0)   |
| the sampler's experts per position (MoE)    | `sampling_routes`   | the decoding loop (`Rollout`)                |
| π_old's experts per position (MoE)          | `old_routes`        | `schedule.fill_old_logps`'s forward          |
| the correction weight π_old / π_sampler     | `sampling_weights`  | `sampling_correction.correction_for`         |
| the current policy's (with a gradient)      | `logps`             | `compute_loss`'s forward                     |

`loss.policy_loss` takes them under the same names; its `sampling_logps` are another engine's only (`engine_logps`:
the decoding loop's own are π_old, not a sampler to correct for). The last two exist in the loss step only.

Owns the record, cutting rows out of it (`select`: micro-batches, a process's share, a training pass) and its
checkpoint form (`to_state` / `from_state`, which reads the key names of earlier checkpoints). What it does not own:
which rows go where (`schedule`, `passes`) and what the loss does with them (`loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

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
    sampling_logps: torch.Tensor | None = None  # (B, C) the sampler's, recorded as it sampled; NaN where none
    sampled_by_policy: bool = False  # sampling_logps are the trained model's own (decoding loop), not an engine's
    old_logps: torch.Tensor | None = None  # (B, C) π_old; None: the weights still are the sampling ones
    ref_logps: torch.Tensor | None = None  # (B, C) the reference model's (beta > 0)
    turn_ids: torch.Tensor | None = None  # (B, C) assistant turn of each token (multi-turn episodes)
    # (B, P + C, L, k) int8/int16 the experts each position was routed to by the sampler (Mixture-of-Experts models
    # sampled by the decoding loop; -1 where not recorded): the routing metrics' reference, replayed with
    # routing_replay='rollout' (`moe.replay`).
    sampling_routes: torch.Tensor | None = None
    old_routes: torch.Tensor | None = None  # (B, P + C, L, k) π_old's experts (routing_replay='old'): the π_old pass's
    num_items_in_batch: torch.Tensor | None = None  # () completion tokens of the whole rollout, every process
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
        return replace(self, **kept)

    def to_state(self) -> dict[str, Any]:
        """The record as a checkpoint stores it: field name → tensor or plain value."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MicroBatch:
        """The record of a saved micro-batch, from this version's names or an earlier checkpoint's keys."""
        state = dict(state)
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
    "sampling_logps",
    "old_logps",
    "ref_logps",
    "turn_ids",
    "sampling_routes",
    "old_routes",
)
