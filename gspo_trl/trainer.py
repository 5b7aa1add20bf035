"""`GSPOTrainer`: the `transformers.Trainer` that wires rollout → reward → advantage → loss → log.

It holds no math and no backend details: sampling lives in `rollout`, multi-turn episodes in
`environments`, log-probabilities in `logprobs` (checked on the first rollout by `logprob_check`), rewards in
`rewards`, the rollout's advantages in `scoring` (math in `advantages`), the objective in `loss`, a micro-batch's
training passes in `passes`. The trainer's own job is the schedule (one rollout reused for
`steps_per_generation × num_iterations` micro-steps, as in TRL), moving data between those modules, and logging.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, set_seed
from transformers.utils import logging
from trl.trainer.utils import RepeatSampler

from . import __version__
from .async_rollouts import RolloutPipeline, check_async_rollouts_supported
from .checkpointing import checkpoint_kwargs, enable_kept_attention
from .config import GSPOConfig
from .cpu_memory import pool_freed_memory
from .dataset_checks import check_enough_prompts, check_prompt_dataset
from .distributed import (
    check_deepspeed_batch_fields,
    fsdp_deferral,
    gather_ragged,
    gather_rollout,
    gradients_held,
    prepare_frozen_model,
    set_up_process_group,
    warn_if_fsdp_dropped,
    weights_for_generation,
)
from .entropy_control import EntropyCoefficient
from .environments.tools import environment_reward_functions, tool_episode_factory
from .logprob_check import check_first_rollout
from .logprobs import completion_logprobs
from .loss import Objective, masked_mean, policy_loss
from .loss_masks import high_entropy_token_mask
from .metrics import (
    MetricsBuffer,
    completion_length_metrics,
    episode_metrics,
    loss_metrics,
    metric_counts,
    print_completions,
    reduce_across_processes,
    reward_function_metrics,
    sampling_metrics,
)
from .model_card import render_model_card
from .models import (
    apply_peft,
    create_reference_model,
    is_peft_model,
    load_policy,
    load_tokenizer,
    prepare_weights,
    reference_weights,
    router_aux_loss_coef,
)
from .packing import packing_pays_on, padding_free_unsupported_reason
from .passes import micro_batch_passes, pass_budget, take_pass
from .precision import check_precision, precision_context, warn_if_fp32_head_is_cast_by_fsdp2
from .rewards import RewardModelFunction, compute_rewards, load_reward_funcs, resolve_reward_weights
from .rollout import EpisodeRunner, SampledRollout, create_rollout_backend, is_conversational_prompt, stream_keys
from .rollout.episodes import END_REASONS, end_codes
from .rollout_checkpoint import RolloutState, last_complete_checkpoint, load_rollout_state, save_rollout_state
from .rollout_func import check_rollout_func, sample_with_rollout_func
from .sampling_correction import sampler_logprobs_as_old, sampling_correction
from .schedule import micro_batches_needing_old_logprobs, micro_steps_into_epoch, split_into_micro_batches
from .scoring import score_rollout

logger = logging.get_logger(__name__)


def _keep_as_list(features: list[dict]) -> list[dict]:
    # Rows stay python objects until generation: prompts may be chat messages.
    return features


class GSPOTrainer(Trainer):
    """Group Sequence Policy Optimization (arXiv 2507.18071) with TRL's `GRPOTrainer` interface."""

    _tag_names = ["gspo", "gspo-trl", "trl"]

    def __init__(
        self,
        model,
        reward_funcs,
        args: GSPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        env_factory=None,
        tool_call_parser=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GSPOConfig(output_dir=f"{Path(str(name)).name}-GSPO")
        if not isinstance(args, GSPOConfig):
            raise TypeError(
                f"args must be a GSPOConfig, got {type(args).__name__}. Coming from TRL, replace GRPOConfig with "
                "gspo_trl.GSPOConfig (same field names)."
            )
        episodes = env_factory is not None or tools is not None or environment_factory is not None
        check_rollout_func(rollout_func, args, episodes)
        check_prompt_dataset(train_dataset, "train_dataset", needs_prompt=not episodes)
        check_prompt_dataset(eval_dataset, "eval_dataset", needs_prompt=not episodes)
        check_enough_prompts(train_dataset, args)

        set_up_process_group(args)  # before the model: ZeRO-3 partitions it while it loads
        check_deepspeed_batch_fields(args, args.world_size)
        # Seed before anything random is built (LoRA weights), as Trainer only seeds in its own __init__.
        set_seed(args.seed)
        model_source = model
        model = load_policy(model, args.model_init_kwargs)
        tokenizer = load_tokenizer(processing_class, model)
        prepare_weights(model, args)
        model = apply_peft(model, peft_config, args.activation_checkpointing)
        check_precision(model, args)
        self.objective = Objective.from_config(args)
        self.entropy_coefficient = EntropyCoefficient.from_config(args)
        self.router_aux_loss_coef = router_aux_loss_coef(model, args.router_aux_loss_coef)
        if reward_funcs is None and episodes:
            reward_funcs = []  # the environment's step rewards or get_reward may be the whole reward
        tool_episodes = tool_episode_factory(tools, environment_factory, tool_call_parser, env_factory, tokenizer)
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        environment_rewards = environment_reward_functions(environment_factory)  # weighted 1, as in TRL
        if reward_processing_classes is not None and environment_rewards:
            reward_processing_classes = (
                list(reward_processing_classes)
                if isinstance(reward_processing_classes, (list, tuple))
                else [reward_processing_classes]
            ) + [None] * len(environment_rewards)
        self.reward_funcs = load_reward_funcs(
            reward_funcs + environment_rewards, reward_processing_classes, args.model_init_kwargs
        )
        if not self.reward_funcs and (env_factory is None):
            raise ValueError(
                "reward_funcs is empty: pass at least one reward function, an env_factory whose step() "
                "returns rewards, or an environment_factory whose environment defines get_reward()."
            )
        self.reward_weights = torch.cat(
            [resolve_reward_weights(args.reward_weights, len(reward_funcs)), torch.ones(len(environment_rewards))]
        )
        self.ref_model = create_reference_model(model, model_source, args) if args.beta > 0 else None

        super().__init__(
            model=model,
            args=args,
            data_collator=_keep_as_list,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        warn_if_fsdp_dropped(args, self.accelerator)
        warn_if_fp32_head_is_cast_by_fsdp2(args, self.accelerator)
        if args.cpu_memory_pool and self.accelerator.device.type == "cpu":
            pool_freed_memory()
        # compute_loss returns a per-micro-batch mean; Trainer divides it by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        if self.ref_model is not None:
            self.ref_model = prepare_frozen_model(self.ref_model, self.accelerator, scored_by_logprobs=True)
        for reward_func in self.reward_funcs:
            if isinstance(reward_func, RewardModelFunction):
                reward_func.model = prepare_frozen_model(reward_func.model, self.accelerator)

        padding_free = args.padding_free
        if padding_free is None:
            padding_free = packing_pays_on(self.accelerator.device.type)
        self.padding_free = padding_free and _padding_free_supported(self.accelerator.unwrap_model(self.model))
        self.max_tokens_per_pass = pass_budget(args, self.accelerator.device.type, self.router_aux_loss_coef != 0.0)
        self.rollout_backend = create_rollout_backend(
            args, tokenizer, self.accelerator, lambda: self.accelerator.unwrap_model(self.model)
        )
        self.uses_tools = tool_episodes is not None
        if tool_episodes is not None:
            iterations = args.max_tool_calling_iterations
            max_turns = args.max_turns if iterations is None else min(args.max_turns or iterations + 1, iterations + 1)
            self.episode_runner = EpisodeRunner(tool_episodes, tokenizer, args, max_turns=max_turns)
        else:
            self.episode_runner = None if env_factory is None else EpisodeRunner(env_factory, tokenizer, args)
        self.rollout_func = rollout_func
        self.rollout_pipeline = None
        if args.async_rollouts:
            check_async_rollouts_supported(self.rollout_backend, self.accelerator)
            self.rollout_pipeline = RolloutPipeline(args, self.rollout_backend, self.episode_runner, tokenizer)
        self._metrics = MetricsBuffer()
        self._completion_samples: list[dict] = []
        self._buffered_inputs: list[dict] | None = None
        self._step = 0  # micro-steps trained, counted from the start of the epoch on resume
        self._window_global_step, self._window_offset = None, 0  # micro-steps since the last optimizer step
        self._rollout_global_step = 0  # optimizer steps done when the buffered rollout was sampled
        self._micro_steps_per_epoch = 0
        self._restored_rollout = None  # the rollout saved with the checkpoint a run resumes from
        self._num_tokens_seen = 0
        self._rollout_generator = torch.Generator().manual_seed(args.seed)
        self._entropy_window = None  # (entropy sum, token count) of this optimizer step so far, for adaptive control
        self._pass_metrics: list[tuple[dict, dict]] = []  # the loss metrics of a micro-batch's passes so far
        self._logprobs_unchecked = args.check_logprobs != "off"  # until the first training rollout (logprob_check)

    # --- precision ----------------------------------------------------------------------------

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        # Trainer wraps compute_loss in this; every other forward takes the same context, so the LM head
        # (outside the model's autocast-wrapped forward) and the old/new log-probs match.
        return precision_context(self.accelerator)

    # --- data ---------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self):
        # With remove_unused_columns=True, keep the prompt (the model's forward signature has none of ours).
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def get_train_dataloader(self):
        # One dataloader batch is a whole local generation batch (steps_per_generation micro-batches).
        dataloader = self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )
        self._micro_steps_per_epoch = len(dataloader)  # the Trainer's steps_in_epoch
        return dataloader

    def _get_train_sampler(self, dataset=None):
        # Each prompt appears num_generations times in a row; each generation batch is repeated for
        # every micro-step that trains on it, so the dataloader stays aligned with the schedule.
        return RepeatSampler(
            data_source=dataset if dataset is not None else self.train_dataset,
            mini_repeat_count=self.args.num_generations,
            batch_size=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self.args.num_iterations * self.args.steps_per_generation,
            shuffle=self.args.shuffle_dataset,
            seed=self.args.seed,
        )

    def _get_eval_sampler(self, eval_dataset):
        return RepeatSampler(data_source=eval_dataset, mini_repeat_count=self.args.num_generations, seed=self.args.seed)

    # --- schedule -----------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch: list[dict] | dict) -> dict[str, Any]:
        if isinstance(generation_batch, dict):
            return generation_batch  # a micro-batch, or one pass of it, prepared by training_step
        if not self.model.training:
            inputs = self._generate_and_score(generation_batch, mode="eval")
            inputs["num_items_in_batch"] = self._count_completion_tokens(inputs)
            return inputs
        args = self.args
        uses_per_rollout = args.steps_per_generation * args.num_iterations
        if self._buffered_inputs is None:
            # Start or resume: take up the schedule at the dataloader's position. A run resumed mid-rollout
            # continues the rollout saved with its checkpoint (or, from a checkpoint without one, samples a
            # new rollout there and trains on its remaining uses).
            self._step = micro_steps_into_epoch(
                self.state.global_step, self._micro_steps_per_epoch, args.gradient_accumulation_steps
            )
        use = self._step % uses_per_rollout
        restored, self._restored_rollout = self._restored_rollout, None
        if self._buffered_inputs is None and use != 0 and restored is not None and restored.micro_batches:
            # Resumed inside a rollout: continue the one saved with the checkpoint (its sampling weights
            # are gone, so it could not be sampled again).
            self._buffered_inputs = restored.micro_batches
            self._rollout_global_step = restored.sampled_at_step
        if use == 0 or self._buffered_inputs is None:
            if self.rollout_pipeline is None:
                rollout_batch, weights_step = (
                    self._generate_and_score(generation_batch, "train"),
                    self.state.global_step,
                )
            else:
                sampled, weights_step = self._take_prefetched_rollout(generation_batch)
                rollout_batch = self._score(generation_batch, sampled, "train")
            micro_batches = self._micro_batches(rollout_batch)
            num_items = self._count_completion_tokens(rollout_batch)
            for micro_batch in micro_batches:
                micro_batch["num_items_in_batch"] = num_items
            needs_old = micro_batches_needing_old_logprobs(
                steps_per_generation=args.steps_per_generation,
                num_iterations=args.num_iterations,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                window_offset=self._window_offset,
                first_use=use,
            )
            for micro_batch, needed in zip(micro_batches, needs_old):
                if micro_batch["old_per_token_logps"] is not None:
                    continue  # sampled ahead by weights trained past since: their own log-probs (async_rollouts)
                if args.use_vllm and args.vllm_logprobs_as_old:
                    micro_batch["old_per_token_logps"] = sampler_logprobs_as_old(micro_batch)
                elif args.always_compute_old_logprobs:
                    micro_batch["old_per_token_logps"] = self._score_without_grad(self.model, micro_batch)
                elif needed:
                    # the decoding loop's (decode_logprobs_as_old)
                    decoded = micro_batch.get("decoding_per_token_logps")
                    micro_batch["old_per_token_logps"] = (
                        decoded if decoded is not None else self._score_without_grad(self.model, micro_batch)
                    )
            self._buffered_inputs = micro_batches
            self._rollout_global_step = weights_step
        if self.rollout_pipeline is not None:
            self._metrics.add("train", "rollout/staleness", float(self.state.global_step - self._rollout_global_step))
            self._prefetch_next_rollout()
        return self._buffered_inputs[use % args.steps_per_generation]

    # --- async rollouts -----------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.rollout_pipeline is not None:  # read through a look-ahead, which finds the next rollout's prompts
            epoch_iterator = self.rollout_pipeline.wrap(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _take_prefetched_rollout(self, batch: list[dict]) -> tuple[SampledRollout, int]:
        """(the rollout sampled ahead for this step, the optimizer step of its weights); where none was (the first
        of an epoch, max_staleness=0, a resumed run), one is sampled now on the same path, with staleness 0."""
        step = self.state.global_step
        taken = self.rollout_pipeline.prefetcher.take(step)
        if taken is None:
            self._launch_rollout(batch, for_step=step)
            taken = self.rollout_pipeline.prefetcher.take(step)
        return taken

    def _prefetch_next_rollout(self) -> None:
        """Start sampling the next rollout once the weights are within max_staleness optimizer steps of it."""
        upcoming = self.rollout_pipeline.next_rollout(
            self.state.global_step, self._step, self._window_offset, self.current_gradient_accumulation_steps
        )
        if upcoming is not None and upcoming[1] < self.state.max_steps:  # not past the end of training
            self._launch_rollout(*upcoming)

    def _launch_rollout(self, batch: list[dict], for_step: int) -> None:
        weights_step = self.state.global_step
        backend, runner, frozen = self.rollout_pipeline.engines(
            self.model_wrapped, self.accelerator.unwrap_model(self.model), weights_step
        )

        ahead = for_step != weights_step  # sampling overlaps training

        def sample() -> SampledRollout:  # runs on the pipeline's thread
            with precision_context(self.accelerator):  # autocast is per thread
                # Overlapping training, which rewinds the global random state (checkpointed recomputation), it
                # draws from per-completion streams of its own.
                sampled = self._sample(backend, runner, batch, "train", for_step, keyed=ahead)
                if frozen is not None and ahead:  # π_old will be gone by the time it trains
                    rollout = sampled.rollout
                    sampled.behaviour_logps = (
                        rollout.sampling_logps
                        if rollout.sampled_by_policy
                        else self._score_without_grad(frozen, rollout.model_inputs())
                    )
            return sampled

        self.rollout_pipeline.prefetcher.submit(for_step, weights_step, sample)

    def _count_completion_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        """The completion tokens trained on in a rollout, over every process (the token-mean losses' count)."""
        return self.accelerator.gather(batch["completion_mask"].sum().reshape(1)).sum()

    def _micro_batches(self, rollout_batch: dict[str, Any]) -> list[dict[str, Any]]:
        """This process's micro-batches: its slice of each global micro-batch.

        The rollout of all processes is cut into micro-batches of whole groups in one shuffled order (the
        generator is seeded alike everywhere), and each process trains on its share of every one, so an
        optimizer step sees the same rows whatever the number of processes.
        """
        args, processes = self.args, self.accelerator.num_processes
        if processes == 1:
            return split_into_micro_batches(
                rollout_batch, args.steps_per_generation, args.num_generations, self._rollout_generator
            )
        local_rows = rollout_batch["input_ids"].shape[0] // args.steps_per_generation
        everything = gather_rollout(rollout_batch, self.accelerator, self.processing_class.pad_token_id)
        mine = slice(self.accelerator.process_index * local_rows, (self.accelerator.process_index + 1) * local_rows)
        global_micro_batches = split_into_micro_batches(
            everything, args.steps_per_generation, args.num_generations, self._rollout_generator
        )
        return [{key: None if v is None else v[mine] for key, v in batch.items()} for batch in global_micro_batches]

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.state.global_step != self._window_global_step:  # the first micro-step after an optimizer step
            self._window_global_step, self._window_offset = self.state.global_step, 0
        model.train()  # before the rollout: _prepare_inputs samples for training only in train mode
        self._pass_metrics = []  # nothing left over from a micro-step that raised
        micro_batch = self._prepare_inputs(inputs)
        passes = self._plan_passes(micro_batch)
        loss = torch.zeros((), device=self.accelerator.device)
        for index, rows in enumerate(passes):
            last = index == len(passes) - 1
            part = micro_batch if len(passes) == 1 else take_pass(micro_batch, rows, last)
            # Every pass but the last accumulates its gradient locally, like an earlier micro-step.
            held = contextlib.nullcontext() if last else gradients_held(self.accelerator, model, fsdp_deferral(self))
            with held:
                loss = loss + super().training_step(model, part, num_items_in_batch)
        self._step += 1
        self._window_offset += 1
        return loss

    def _plan_passes(self, micro_batch: dict[str, Any]) -> list[torch.Tensor]:
        accelerator = self.accelerator

        def most_of_all(passes: int) -> int:  # every process runs as many passes as the one that needs most
            return int(accelerator.reduce(torch.tensor(passes, device=accelerator.device), "max"))

        return micro_batch_passes(
            micro_batch, self.max_tokens_per_pass, most_of_all if accelerator.num_processes > 1 else None
        )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:  # Trainer would take the newest folder, even a half-written one
            resume_from_checkpoint, skipped = last_complete_checkpoint(
                self.args.output_dir, self.accelerator.num_processes
            )
            if skipped:
                logger.warning(f"Skipped incomplete checkpoints (cut off while being written): {skipped}")
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output_dir ({self.args.output_dir}) to resume from.")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _inner_training_loop(self, *args, **kwargs):
        enable_kept_attention(self.model, self.args)  # Trainer.train has just enabled checkpointing without it
        self._buffered_inputs = None
        self._window_global_step, self._window_offset = None, 0
        self._restored_rollout = None
        checkpoint = kwargs.get("resume_from_checkpoint")
        if checkpoint is not None:
            restored = load_rollout_state(checkpoint, self.accelerator.process_index, self.accelerator.device)
            if restored is not None:
                self._rollout_generator.set_state(restored.shuffle_generator_state)
                self._num_tokens_seen = restored.num_tokens_seen
                if restored.entropy_control is not None:
                    self.entropy_coefficient.load_state_dict(restored.entropy_control)
                self._restored_rollout = restored
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if self.rollout_pipeline is not None:
                self.rollout_pipeline.prefetcher.drain()
                self.rollout_pipeline.lookahead = None

    # --- rollout ------------------------------------------------------------------------------

    def _generate_and_score(self, batch: list[dict], mode: str) -> dict[str, Any]:
        """Sample a synchronous rollout on the current weights and score it (eval; train without async_rollouts)."""
        if self.rollout_pipeline is not None:
            # a server must not change weights under a rollout being sampled ahead
            self.rollout_pipeline.prefetcher.wait()
        self.rollout_backend.update_weights(self.model_wrapped, self.state.global_step)
        with self._generation_context():
            sampled = self._sample(self.rollout_backend, self.episode_runner, batch, mode, self.state.global_step)
        return self._score(batch, sampled, mode)

    def _sample(self, backend, runner, batch: list[dict], mode: str, step: int, keyed: bool = False) -> SampledRollout:
        """Completions (or episodes) for `batch`, with the sampling streams and seeds of optimizer step `step`
        (`keyed`: per-completion streams even without layout_independent_sampling)."""
        if self.rollout_func is not None:
            return sample_with_rollout_func(self.rollout_func, self, [row["prompt"] for row in batch])
        keys = self._stream_keys(len(batch), mode, step, keyed)
        if runner is None:
            rollout = backend.generate([row["prompt"] for row in batch], keys)
            return SampledRollout(rollout, [row["prompt"] for row in batch])
        episodes = runner.run(backend, batch, self._episode_seeds(len(batch), mode, step), keys)
        return SampledRollout(episodes.rollout, episodes.prompts, episodes)

    def _score(self, batch: list[dict], sampled: SampledRollout, mode: str) -> dict[str, Any]:
        args, device = self.args, self.accelerator.device
        rollout, prompts, episodes = sampled.rollout, sampled.prompts, sampled.episodes
        # The tokens trained on: those the model sampled (not an environment's observations).
        sampled_mask = rollout.sampled_mask
        completion_texts = self.processing_class.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        columns = {key: [row[key] for row in batch] for key in batch[0] if key != "prompt"}
        columns.update(sampled.reward_columns)
        if episodes is not None:
            completions, completion_ids = episodes.completions, episodes.completion_ids
            columns["environments"] = episodes.environments
        else:
            if is_conversational_prompt(prompts[0]):
                completions = [[{"role": "assistant", "content": text}] for text in completion_texts]
            else:
                completions = completion_texts
            completion_ids = [
                ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)
            ]

        extra_columns: dict[str, list] = {}
        local_rewards = compute_rewards(
            self.reward_funcs,
            prompts,
            completions,
            completion_ids,
            columns,
            self.state,
            log_metric=lambda name, value: self._metrics.add(mode, name, value),
            log_extra=extra_columns.__setitem__,
        ).to(device)  # (n, F)
        scores = score_rollout(local_rewards, self.reward_weights, args, self.accelerator, episodes)
        advantages = scores.advantages

        completion_mask = sampled_mask
        if args.mask_truncated_completions:
            completion_mask = completion_mask * (~rollout.is_truncated).unsqueeze(1).long()
        inputs = {
            **rollout.model_inputs(),
            "completion_mask": completion_mask,
            "advantages": advantages,
            # Log-probs another engine (a vLLM server) recorded as it sampled, for the sampling correction; and those
            # the trained model's decoding loop recorded (decode_logprobs_as_old), which are π_old.
            "sampling_per_token_logps": None if rollout.sampled_by_policy else rollout.sampling_logps,
            "decoding_per_token_logps": rollout.sampling_logps if rollout.sampled_by_policy else None,
            "turn_ids": rollout.turn_ids,  # multi-turn episodes only
        }
        # π_old: the sampling weights' log-probs when they are already gone (async_rollouts), else filled per
        # micro-batch by _prepare_inputs where needed.
        inputs["old_per_token_logps"] = sampled.behaviour_logps
        if mode == "train" and self._logprobs_unchecked:  # once, before a π_old or reference pass scores on a path
            self._logprobs_unchecked = False
            snapshot = getattr(self.rollout_pipeline, "snapshot_backend", None)  # async rollouts sample with it
            self.padding_free = check_first_rollout(
                self.model,
                inputs,
                self.args,
                self.accelerator,
                padding_free=self.padding_free,
                # Sampled ahead (async_rollouts: a resumed run's first rollout can be), the recorded log-probs are
                # those of weights trained past since, not the model's: only the scoring path is checked.
                decoding_loop=rollout.decoding_loop if sampled.behaviour_logps is None else None,
                backends=[backend for backend in (self.rollout_backend, snapshot) if backend is not None],
                checked_mask=sampled_mask,
            )
        inputs["ref_per_token_logps"] = None
        if args.beta > 0:
            with reference_weights(self.model, self.ref_model) as reference:
                inputs["ref_per_token_logps"] = self._score_without_grad(reference, inputs)

        self._record_rollout_metrics(mode, rollout, sampled_mask, scores.rewards_per_func, scores.stats, episodes)
        if args.log_completions and self.accelerator.is_main_process:
            local = slice(
                self.accelerator.process_index * len(batch), (self.accelerator.process_index + 1) * len(batch)
            )
            self._completion_samples = [
                {
                    "prompt": p,
                    "completion": c,
                    "reward": r,
                    "advantage": a,
                    **{k: v[i] for k, v in extra_columns.items()},
                }
                for i, (p, c, r, a) in enumerate(
                    zip(prompts, completion_texts, scores.rewards[local].tolist(), _row_advantages(advantages).tolist())
                )
            ]
        return inputs

    def _episode_seeds(self, num_rows: int, mode: str, step: int) -> list[int]:
        """One environment seed per group (its num_generations episodes start from the same state), whatever the
        process layout."""
        rows = self.accelerator.process_index * num_rows + torch.arange(num_rows)
        keys = stream_keys(self.args.seed, step, 0 if mode == "train" else 1, rows // self.args.num_generations)
        return (keys & 0x7FFFFFFF).tolist()

    def _generation_context(self) -> contextlib.AbstractContextManager:
        """Sampling on the trained model runs under the training precision and, under ZeRO-3, gathered weights."""
        if not self.rollout_backend.samples_with_training_model:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(precision_context(self.accelerator))
        stack.enter_context(
            weights_for_generation(
                self.model_wrapped,
                self.accelerator,
                self.args.ds3_gather_for_generation,
                checkpoint_kwargs(self.args),
            )
        )
        return stack

    def _stream_keys(self, num_rows: int, mode: str, step: int, keyed: bool = False) -> torch.Tensor | None:
        """Per-completion sampling keys that do not depend on the process layout (None: global RNG)."""
        if not (self.args.layout_independent_sampling or keyed):
            return None
        # Ranks hold consecutive slices of the global generation batch.
        rows = self.accelerator.process_index * num_rows + torch.arange(num_rows)
        return stream_keys(self.args.seed, step, 0 if mode == "train" else 1, rows)

    @torch.no_grad()
    def _score_without_grad(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """Per-token log-probs of a whole rollout batch, one training micro-batch at a time."""
        micro = self.args.per_device_train_batch_size
        chunks = []
        for start in range(0, inputs["input_ids"].shape[0], micro):
            rows = slice(start, start + micro)
            with precision_context(self.accelerator):
                logps = completion_logprobs(
                    model,
                    inputs["input_ids"][rows],
                    inputs["attention_mask"][rows],
                    inputs["completion_ids"][rows],
                    inputs["completion_mask"][rows],
                    temperature=self.args.temperature,
                    chunk_size=self.args.logprob_chunk_size,
                    padding_free=self.padding_free,
                ).logps
            chunks.append(logps)
        return torch.cat(chunks)

    def _record_rollout_metrics(self, mode, rollout, sampled_mask, rewards_per_func, advantage_stats, episodes) -> None:
        metrics, gather = self._metrics, self.accelerator.gather
        names = [f.name for f in self.reward_funcs]
        table = rewards_per_func
        if episodes is not None and self.uses_tools:
            table = table[:, 1:]  # the environment's column: tool episodes have no step rewards
        elif episodes is not None:
            names = ["env"] + names  # the environment's return is the table's first column
        metrics.add_many(mode, reward_function_metrics(table, names))
        for name in ("reward", "reward_std", "frac_reward_zero_std"):
            metrics.add(mode, name, advantage_stats[name])
        sampled_tokens = sampled_mask.sum(1, keepdim=True)  # (n, 1) model tokens, as TRL counts with tools
        lengths = completion_length_metrics(
            gather(sampled_tokens), gather(rollout.is_truncated.unsqueeze(1)).squeeze(1)
        )
        metrics.add_many(mode, lengths)
        if episodes is not None:
            device = sampled_mask.device
            env_tokens = rollout.completion_mask.sum(1, keepdim=True) - sampled_tokens
            metrics.add_many(
                mode,
                episode_metrics(
                    gather(self.accelerator.pad_across_processes(episodes.reached.to(device), dim=1)),
                    None
                    if self.uses_tools
                    else gather(self.accelerator.pad_across_processes(episodes.turn_rewards.to(device), dim=1)),
                    gather(sampled_tokens),
                    gather(env_tokens),
                    gather(end_codes(episodes.ends).to(device)),
                    END_REASONS,
                    gather(episodes.tool_calls.to(device)) if self.uses_tools else None,
                    gather(episodes.tool_failures.to(device)) if self.uses_tools else None,
                ),
            )
        if mode == "train":
            tokens = rollout.prompt_mask.sum() + rollout.completion_mask.sum()
            self._num_tokens_seen += self.accelerator.gather(tokens.reshape(1)).sum().item()

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GSPOTrainer.compute_loss does not return model outputs (return_outputs=True).")
        if inputs["old_per_token_logps"] is None and self.model.training:
            self._check_sampling_weights_unchanged()
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"]
        scores = completion_logprobs(
            model,
            inputs["input_ids"],
            inputs["attention_mask"],
            inputs["completion_ids"],
            mask,
            temperature=self.args.temperature,
            chunk_size=self.args.logprob_chunk_size,
            kept_logits_mb=self.args.logprob_kept_logits_mb,
            padding_free=self.padding_free,
            entropy_grad=self.entropy_coefficient.enabled,
            router_aux_loss=self.router_aux_loss_coef != 0.0,
        )
        policy_token_mask, learned, entropy_normalizer = self._selected_tokens(
            scores.entropy.detach(), mask, inputs.get("micro_batch_tokens")
        )
        entropy_coef = self.entropy_coefficient.to_apply()
        sampling_weights, sampling_stats = self._sampling_correction(inputs, scores.logps.detach())
        loss, stats = policy_loss(
            scores.logps,
            inputs["old_per_token_logps"],
            inputs["advantages"],
            mask,
            objective=self.objective,
            ref_per_token_logps=inputs["ref_per_token_logps"],
            sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
            sampling_weights=sampling_weights,
            policy_token_mask=policy_token_mask,
            turn_ids=inputs.get("turn_ids"),
            token_normalizer=self._token_normalizer(inputs, mode),
            per_token_entropy=scores.entropy,
            entropy_coef=entropy_coef,
            entropy_normalizer=entropy_normalizer,
            num_sequences=inputs.get("micro_batch_rows"),  # set on a pass: its loss is its share of the micro-batch's
            num_tokens=inputs.get("micro_batch_tokens"),
        )
        metrics = loss_metrics(stats, masked_mean(scores.entropy.detach(), mask), self.args.beta)
        metrics.update(sampling_metrics(sampling_stats))
        if scores.router_aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * scores.router_aux_loss
            metrics["aux_loss"] = scores.router_aux_loss.detach()
        if self.entropy_coefficient.enabled:
            metrics["entropy_coef"] = entropy_coef
            if mode == "train" and self.entropy_coefficient.adaptive:
                self._observe_entropy(scores.entropy.detach(), learned)
        counts = metric_counts(mask, self.objective.importance_sampling_level, self.args.vllm_importance_sampling_mode)
        self._pass_metrics.append((metrics, counts))
        if inputs.get("last_pass", True):  # the micro-batch's metrics, over all its passes and processes
            parts, self._pass_metrics = self._pass_metrics, []
            self._metrics.add_many(
                mode, reduce_across_processes([m for m, _ in parts], self.accelerator.gather, [c for _, c in parts])
            )
        return loss

    def _sampling_correction(self, inputs: dict[str, Any], logps: torch.Tensor):
        """(weights or None, stats) correcting a rollout sampled by another engine towards π_old: the old log-probs, or,
        where none were computed (the weights are still the sampling ones), the current ones."""
        sampling_logps = inputs.get("sampling_per_token_logps")
        if sampling_logps is None:
            return None, {}
        old = inputs["old_per_token_logps"] if inputs["old_per_token_logps"] is not None else logps
        args = self.args
        weights, stats = sampling_correction(
            old,
            sampling_logps,
            inputs["completion_mask"],
            args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min,
            args.vllm_importance_sampling_clip_max,
        )
        return (weights if args.vllm_importance_sampling_correction else None), stats

    def _selected_tokens(self, entropy: torch.Tensor, mask: torch.Tensor, micro_batch_tokens=None):
        """(the top-entropy token mask or None, the tokens the policy term learns from, their count per process
        over every process for the entropy bonus's mean or None): quantile and count span all processes, and the
        count the whole micro-batch (``micro_batch_tokens`` on a pass; passes need top_entropy_quantile = 1)."""
        policy_token_mask = None
        if self.args.top_entropy_quantile < 1.0:
            everyones = gather_ragged(entropy[mask.bool()], self.accelerator)
            policy_token_mask = high_entropy_token_mask(entropy, mask, self.args.top_entropy_quantile, everyones)
        learned = mask.bool() if policy_token_mask is None else mask.bool() & policy_token_mask.bool()
        entropy_normalizer = None
        if self.entropy_coefficient.enabled:
            count = learned.sum() if micro_batch_tokens is None else micro_batch_tokens
            entropy_normalizer = self.accelerator.reduce(count, "sum") / self.accelerator.num_processes
        return policy_token_mask, learned, entropy_normalizer

    def _token_normalizer(self, inputs: dict[str, Any], mode: str) -> torch.Tensor | None:
        """What the token-mean losses (dapo, cispo, vespo) divide a micro-batch's sum by: the completion tokens per
        process and optimizer step, averaged over the rollout (TRL's definition). Trainer then divides by the
        accumulation steps, and DDP averages over processes."""
        tokens = inputs.get("num_items_in_batch")
        if tokens is None:
            return None
        per_process = tokens / self.accelerator.num_processes
        return per_process / self.args.steps_per_generation if mode == "train" else per_process

    def _observe_entropy(self, entropy: torch.Tensor, learned: torch.Tensor) -> None:
        """Adaptive entropy control: accumulate this optimizer step's entropy; update the coefficient at its end."""
        window = torch.stack([entropy[learned].sum(), learned.sum().to(entropy.dtype)])
        self._entropy_window = window if self._entropy_window is None else self._entropy_window + window
        if self.accelerator.sync_gradients:
            total = self.accelerator.reduce(self._entropy_window, reduction="sum")
            self.entropy_coefficient.end_of_step((total[0] / total[1].clamp(min=1.0)).item())
            self._entropy_window = None

    def _check_sampling_weights_unchanged(self) -> None:
        # Training with old = sg[log π] is only right while the weights are those that sampled the rollout.
        if self.state.global_step != self._rollout_global_step:
            raise RuntimeError(
                f"gspo-trl schedule error: a micro-batch without π_old log-probs is trained at optimizer step "
                f"{self.state.global_step}, after its rollout was sampled at step {self._rollout_global_step}; its "
                "importance ratio would be wrong. Please report this with your GSPOConfig; "
                "always_compute_old_logprobs=True avoids it."
            )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # --- logging and saving -------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics.pop_averages(mode)
        if mode == "eval":
            metrics = {f"eval_{name}": value for name, value in metrics.items()}
        else:
            metrics["num_tokens"] = self._num_tokens_seen
        logs.update(metrics)
        super().log(logs, start_time)
        if self.args.log_completions and self._completion_samples and self.accelerator.is_main_process:
            print_completions(self._completion_samples, self.args.num_completions_to_print, self.state.global_step)
            self._completion_samples = []

    def _save_checkpoint(self, model, trial):
        # The rollout goes first: Trainer writes trainer_state.json last, which marks a complete checkpoint.
        checkpoint_dir = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        continues = self._step % (self.args.steps_per_generation * self.args.num_iterations) != 0
        state = RolloutState(
            micro_batches=self._buffered_inputs if continues else None,
            sampled_at_step=self._rollout_global_step,
            shuffle_generator_state=self._rollout_generator.get_state(),
            num_tokens_seen=self._num_tokens_seen,
            entropy_control=self.entropy_coefficient.state_dict(),
        )
        save_rollout_state(checkpoint_dir, self.accelerator.process_index, state)
        self.create_model_card(model_name=Path(self.args.hub_model_id or self.args.output_dir).name)
        super()._save_checkpoint(model, trial)

    def create_model_card(self, model_name: str | None = None, tags=None, **kwargs) -> None:
        if not self.is_world_process_zero():
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        base = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
        base_model = getattr(base.config, "_name_or_path", None)
        if base_model and os.path.isdir(base_model):
            base_model = None  # a local path means nothing to a reader of the Hub page
        card = render_model_card(
            model_name=model_name or Path(self.args.output_dir).name,
            base_model=base_model,
            reward_names=[reward_func.name for reward_func in self.reward_funcs],
            args=self.args,
            peft=is_peft_model(unwrapped),
            library_version=__version__,
            tags=[tags] if isinstance(tags, str) else tags,
        )
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)


def _padding_free_supported(model) -> bool:
    base = model.get_base_model() if is_peft_model(model) else model
    reason = padding_free_unsupported_reason(base)
    if reason is not None:
        logger.warning(f"padding_free is not used: {reason}. Training runs on padded rows.")
    return reason is None


def _row_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """(n,) one advantage per row for display: per-turn advantages show the first turn's."""
    return advantages if advantages.dim() == 1 else advantages[:, 0]
