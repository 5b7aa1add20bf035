"""Pipelined rollouts (`async_rollouts`): the next rollout is sampled while the current one trains.

Owns the one-rollout-ahead schedule (from which optimizer step the next rollout may start sampling under
`max_staleness`), the background thread that samples it, the weight snapshot that sampling on the trained
model reads while the live weights keep training, and the look-ahead on the trainer's batch iterator that
finds the next rollout's prompts. What it does not own: sampling itself (a `RolloutBackend` or an
`EpisodeRunner`, called through the function the trainer submits), rewards and advantages (scored when
the rollout is trained on), and the loss. It does record π_old of a rollout sampled ahead (`SampledRollout.old_logps`):
the weights that sampled it are gone by the time it trains.

Staleness counts optimizer steps between the weights that sampled a rollout and the weights of its first
optimizer step. The synchronous trainer's is 0; one-step-off pipelining (as in verl and PipelineRL) makes it
the number of optimizer steps per rollout.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as concurrent_wait
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ..rollout import EpisodeRunner, HFGenerateBackend, RolloutBackend
from ..rollout.decoding.truncation import policy_logps
from .micro_batch import MicroBatch

logger = logging.get_logger(__name__)


def earliest_launch_step(rollout_start_step: int, steps_per_rollout: int, max_staleness: int) -> int:
    """The first optimizer step whose weights may sample the rollout after the one that started training at
    `rollout_start_step`: it trains from step `rollout_start_step + steps_per_rollout`, at most
    `max_staleness` steps later, and no earlier than the current rollout's start (one rollout ahead at most)."""
    if steps_per_rollout < 1 or max_staleness < 0:
        raise ValueError(
            f"steps_per_rollout must be >= 1 and max_staleness >= 0, got {steps_per_rollout} and {max_staleness}."
        )
    return max(rollout_start_step, rollout_start_step + steps_per_rollout - max_staleness)


def check_async_rollouts_supported(backend: RolloutBackend, accelerator) -> None:
    """Sampling ahead on the trained model reads a whole copy of the weights, which sharded training has not got;
    on a CPU it competes with training for the same cores."""
    if not backend.samples_with_training_model:
        return
    if accelerator.device.type == "cpu":
        logger.warning(
            "async_rollouts=True on a CPU: sampling and training run side by side on the same cores, which "
            "measured no faster than async_rollouts=False (docs/async_rollouts.md). It pays with a vLLM "
            "server or on a GPU."
        )
    plugin = accelerator.state.deepspeed_plugin
    sharded = "DeepSpeed ZeRO-3" if plugin is not None and plugin.zero_stage == 3 else None
    if accelerator.distributed_type.name == "FSDP":
        sharded = "FSDP"
    if sharded:
        raise ValueError(
            f"async_rollouts=True samples the next rollout from a copy of the weights, which {sharded} "
            "shards across processes: sample on a vLLM server (use_vllm=True) or set async_rollouts=False."
        )


class Lookahead:
    """An iterator that can be read ahead: `peek(k)` is the item `next` returns k calls from now (None past the end)."""

    def __init__(self, iterator: Iterator):
        self.iterator = iterator
        self.buffer: deque = deque()
        self.exhausted = False

    def __iter__(self):
        return self

    def __next__(self):
        if self.buffer:
            return self.buffer.popleft()
        return next(self.iterator)

    def peek(self, ahead: int) -> Any | None:
        if ahead < 0:
            raise ValueError(f"Lookahead.peek needs ahead >= 0, got {ahead}: that item has been taken already.")
        while len(self.buffer) <= ahead and not self.exhausted:
            try:
                self.buffer.append(next(self.iterator))
            except StopIteration:
                self.exhausted = True
        return self.buffer[ahead] if ahead < len(self.buffer) else None


class WeightSnapshot:
    """A frozen copy of the policy for sampling while the original trains. The first `refresh` copies the whole
    module; later ones copy only what can have changed since: the trainable parameters and the buffers."""

    def __init__(self):
        self.model: torch.nn.Module | None = None

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.model is None:
            self.model = copy.deepcopy(model)
            self.model.requires_grad_(False)
            for parameter in self.model.parameters():
                parameter.grad = None  # deepcopy copies gradients too
            self.trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
            return self.model
        ours = dict(self.model.named_parameters())
        theirs = dict(model.named_parameters())
        for name in self.trainable:
            ours[name].copy_(theirs[name])
        for mine, live in zip(self.model.buffers(), model.buffers()):
            mine.copy_(live)
        return self.model


@dataclass
class PendingRollout:
    for_step: int  # the optimizer step that starts training on it
    weights_step: int  # optimizer steps done on the weights that sample it
    future: Future


class RolloutPrefetcher:
    """One background thread that samples at most one rollout ahead."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gspo-rollout")
        self.pending: PendingRollout | None = None

    def submit(self, for_step: int, weights_step: int, sample: Callable[[], Any]) -> None:
        if self.pending is not None:
            raise RuntimeError("RolloutPrefetcher.submit: a rollout is already being sampled ahead.")
        self.pending = PendingRollout(for_step, weights_step, self._executor.submit(sample))

    def take(self, for_step: int) -> tuple[Any, int] | None:
        """(the rollout sampled for `for_step`, its weights' step), waiting for it; None if none was launched for
        that step (then one still pending for another step is dropped). An error in the thread is raised here."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        result = pending.future.result()  # wait even when it is dropped: the thread must not outlive its inputs
        return (result, pending.weights_step) if pending.for_step == for_step else None

    def wait(self) -> None:
        """Let the rollout being sampled ahead finish (it is kept for its step)."""
        if self.pending is not None:
            concurrent_wait([self.pending.future])

    def drain(self) -> None:
        """Drop the rollout being sampled ahead once it has finished (training ended before its step)."""
        pending, self.pending = self.pending, None
        if pending is not None and not pending.future.cancel():
            concurrent_wait([pending.future])


class RolloutPipeline:
    """The trainer's side of `async_rollouts`: when the next rollout starts, which prompts it samples, and the
    engines the background thread samples with (a snapshot of the weights for sampling on the trained model; the
    server itself, given the weights at launch, for a vLLM server), kept apart from the trainer's own (their own
    tokenizer copy and environments, so evaluation or logging on the main thread never shares them)."""

    def __init__(self, args, backend: RolloutBackend, runner: EpisodeRunner | None, tokenizer):
        self.args = args
        self.backend = backend
        self.prefetcher = RolloutPrefetcher()
        self.lookahead: Lookahead | None = None
        self.tokenizer = copy.deepcopy(tokenizer)
        self.runner = (
            None
            if runner is None
            else EpisodeRunner(runner.env_factory, self.tokenizer, args, max_turns=runner.max_turns)
        )
        self.snapshot = WeightSnapshot() if backend.samples_with_training_model else None
        self.snapshot_backend: HFGenerateBackend | None = None  # samples on the weight snapshot, once made
        self.sample_rows: Callable | None = None  # the last launch's sampling, for more rows on the same weights

    @property
    def backends(self) -> list[HFGenerateBackend]:
        """The backends this pipeline samples with besides the trainer's (the snapshot's, once made)."""
        return [] if self.snapshot_backend is None else [self.snapshot_backend]

    def wrap(self, iterator: Iterator) -> Lookahead:
        """The look-ahead over the trainer's batch iterator (a new one for a new epoch's iterator)."""
        if self.lookahead is None or self.lookahead.iterator is not iterator:
            self.lookahead = Lookahead(iterator)
        return self.lookahead

    def next_rollout(self, global_step: int, micro_step: int, step_micro_steps: int, taken_micro_steps: int):
        """(the next rollout's batch, the step it trains from) if it may start sampling now, else None.

        `micro_step` is the current micro-step's index in the epoch, `step_micro_steps` the micro-steps of this
        optimizer step before it, `taken_micro_steps` the batches the trainer has taken for this optimizer step.
        Rollouts start on optimizer-step boundaries (GSPOConfig checks it), so the current one started
        `micro_step // uses` rollouts into the epoch, `(micro_step % uses) // accumulation` optimizer steps ago."""
        args = self.args
        if self.prefetcher.pending is not None or step_micro_steps != 0 or self.lookahead is None:
            return None
        uses = args.steps_per_generation * args.num_iterations
        start = global_step - (micro_step % uses) // args.gradient_accumulation_steps
        if global_step < earliest_launch_step(start, args.optimizer_steps_per_rollout, args.max_staleness):
            return None
        next_micro_step = (micro_step // uses + 1) * uses
        batch = self.lookahead.peek(next_micro_step - (micro_step + taken_micro_steps))
        return None if batch is None else (batch, start + args.optimizer_steps_per_rollout)

    def engines(self, model_wrapped, model: torch.nn.Module, global_step: int):
        """(backend, episode runner, scoring model or None) holding the weights of `global_step` for the thread."""
        if self.snapshot is None:
            self.backend.update_weights(model_wrapped, global_step)  # the server samples what it was given
            return self.backend, self.runner, None
        frozen = self.snapshot.refresh(model)
        if self.snapshot_backend is None:
            self.snapshot_backend = HFGenerateBackend(lambda: self.snapshot.model, self.tokenizer, self.args)
        return self.snapshot_backend, self.runner, frozen

    def take(self, batch, step: int, launch) -> tuple[Any, int]:
        """(the rollout sampled ahead for optimizer step `step`, the optimizer step of its weights); where none was
        (the first of an epoch, max_staleness=0, a resumed run), `launch(batch, for_step=step)` samples one now on
        the same path, with staleness 0."""
        taken = self.prefetcher.take(step)
        if taken is None:
            launch(batch, for_step=step)
            taken = self.prefetcher.take(step)
        return taken

    def launch(self, batch, for_step: int, weights_step: int, models, sample, score, context) -> None:
        """Start sampling `batch` for optimizer step `for_step` on the weights of `weights_step` in the background.

        `models`: (the wrapped model, the unwrapped one); `sample(backend, runner, batch, mode, step, keyed=...)`
        samples a `SampledRollout`; `score(model, batch)` gives a `MicroBatch`'s log-probs; `context()` is training's
        precision (autocast is per thread). Sampled ahead on a snapshot of the weights, the rollout keeps π_old
        (`old_logps`): the decoding loop's log-probs, or the snapshot's forward, as those weights will be gone."""
        backend, runner, frozen = self.engines(*models, weights_step)
        ahead = for_step != weights_step  # sampling overlaps training

        def sample_rows(rows, first_row: int = 0):  # on the pipeline's thread (or `sample_more`'s caller)
            with context():
                # Overlapping training, which rewinds the global random state (checkpointed recomputation), it
                # draws from per-completion streams of its own.
                sampled = sample(backend, runner, rows, "train", for_step, keyed=ahead, first_row=first_row)
                if frozen is not None and ahead:
                    rollout = sampled.rollout
                    sampled.old_logps = (
                        policy_logps(rollout.sampling_logps, rollout.kept_log_mass)
                        if rollout.sampled_by_policy
                        else score(frozen, MicroBatch(**rollout.model_inputs()))
                    )
            return sampled

        self.sample_rows = sample_rows
        self.prefetcher.submit(for_step, weights_step, lambda: sample_rows(batch))

    def sample_more(self, batch, first_row: int):
        """`batch` sampled like the rollout taken last, on its weights (a dynamic sampling round; the next launch
        comes after it, so the snapshot or the server still holds them), as the global rows from `first_row` on."""
        return self.sample_rows(batch, first_row)
