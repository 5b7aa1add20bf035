"""TR-DPO's reference-model syncing (arXiv 2404.09656), TRL's `sync_ref_model`: every `ref_model_sync_steps` optimizer
steps the reference model moves towards the policy, ref ← α·π + (1 − α)·ref (`mix_into_reference`, α =
`ref_model_mixup_alpha`).

Owns the mixing rule, the callback that applies it after an optimizer step, and the synced reference's file in a
checkpoint, written by `save` into the folder `checkpoints` seals (a run resumed from one continues from the reference
it had, not from a copy of the policy). What it does not own: building the reference (`models`) and its forward
(`logprobs`). As in TRL, there is nothing to sync under PEFT, whose reference is the base model with the adapter
disabled; a partitioned reference (ZeRO-3, FSDP) is refused, untested here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.utils import logging

from ..models.distributed import unwrap_model
from ..models.loading import is_peft_model

REFERENCE_FILE = "reference_model.safetensors"
logger = logging.get_logger(__name__)


@torch.no_grad()
def mix_into_reference(
    reference: Iterable[tuple[str, torch.Tensor]], policy: Iterable[tuple[str, torch.Tensor]], alpha: float
) -> None:
    """In place, for each named reference parameter: ref ← α·π + (1 − α)·ref, with π the policy's parameter of the
    same name (cast to the reference's dtype)."""
    policy = dict(policy)
    for name, target in reference:
        target.mul_(1.0 - alpha).add_(policy[name].to(target.dtype), alpha=alpha)


class ReferenceSync(TrainerCallback):
    """The callback of a run with `sync_ref_model` (`for_run`); otherwise a no-op holder."""

    def __init__(self, reference: Callable[[], torch.nn.Module | None], policy: Callable[[], torch.nn.Module], args):
        self.reference, self.policy, self.args = reference, policy, args

    @classmethod
    def for_run(cls, trainer) -> ReferenceSync:
        """The sync of `trainer`'s run, registered as its callback when `sync_ref_model` is on."""
        args = trainer.args
        sync = cls(lambda: trainer.ref_model, lambda: trainer.accelerator.unwrap_model(trainer.model), args)
        if not args.sync_ref_model:
            return sync
        if is_peft_model(trainer.accelerator.unwrap_model(trainer.model)):
            raise ValueError(
                "sync_ref_model=True with a PEFT adapter: the reference model is the base model with the adapter "
                "disabled, so there is no separate reference to sync (TRL refuses it too). Use sync_ref_model=False, "
                "or full fine-tuning."
            )
        if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ValueError("sync_ref_model=True is not supported under DeepSpeed ZeRO-3 yet; use ZeRO-2 or DDP.")
        if trainer.is_fsdp_enabled:
            raise ValueError("sync_ref_model=True is not supported under FSDP yet; use DDP or DeepSpeed ZeRO-2.")
        trainer.add_callback(sync)
        return sync

    def _parameters(self, model) -> list[tuple[str, torch.Tensor]]:
        return [(name, parameter.data) for name, parameter in unwrap_model(model).named_parameters()]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.args.ref_model_sync_steps == 0:
            policy = self._parameters(self.policy())
            mix_into_reference(self._parameters(self.reference()), policy, self.args.ref_model_mixup_alpha)

    def save(self, checkpoint_dir: str) -> None:
        """Write the synced reference into the checkpoint being written (every process holds the same one: the main
        process writes it, before the folder is sealed)."""
        if self.args.sync_ref_model and self.args.should_save:
            tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in self._parameters(self.reference())}
            save_file(tensors, os.path.join(checkpoint_dir, REFERENCE_FILE))

    def restore(self, checkpoint: str | None) -> None:
        """Resuming from `checkpoint`: the reference it saved. A checkpoint without one (written before the reference
        was saved) leaves it a copy of the resumed policy, with a warning."""
        if not self.args.sync_ref_model or checkpoint is None:
            return
        path = os.path.join(checkpoint, REFERENCE_FILE)
        if not os.path.isfile(path):
            logger.warning(
                f"sync_ref_model=True, but checkpoint {checkpoint} holds no {REFERENCE_FILE}: the reference restarts "
                "as a copy of the resumed policy, not the synced reference the run had."
            )
            return
        try:
            saved = load_file(path)
            with torch.no_grad():
                for name, target in self._parameters(self.reference()):
                    target.copy_(saved[name])
        except Exception as error:  # safetensors' own error, a missing tensor, a shape that does not fit
            raise ValueError(
                f"Cannot resume from checkpoint {checkpoint}: {REFERENCE_FILE} cannot be read into the reference model "
                f"({type(error).__name__}: {str(error)[:200]}). Resume from an earlier checkpoint."
            ) from error
