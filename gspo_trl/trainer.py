"""`GSPOTrainer`: the `transformers.Trainer` that wires rollout → reward → advantage → loss → log.

It holds no math and no backend details: sampling lives in `rollout` (multi-turn episodes in `rollout.episodes`,
what they are played in in `environments`), log-probabilities in `logprobs` (checked on the first rollout by
`logprob_check`), rewards in `rewards`, the rollout's advantages in `scoring` (math in `advantages`), the objective
in `loss` (one micro-batch's loss assembled in `micro_batch_loss`), a micro-batch's training passes in `passes`,
the schedule (one rollout reused for `steps_per_generation × num_iterations` micro-steps, as in TRL, and π_old per
micro-batch) in `schedule`. The trainer's own job is moving data between those modules, as one typed `MicroBatch`,
and logging.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from transformers import Trainer, set_seed
from transformers.utils import logging

from . import __version__
from .config.gspo_config import GSPOConfig
from .config.trl_attributes import TRLAttributes
from .data.checks import (
    RowCollator,
    check_dataset_modalities,
    check_datasets,
    environment_owned_prompts,
    trainer_config,
)
from .data.streaming import check_stream_resume, micro_steps_per_epoch, streamed, use_stream_settings
from .models.checkpointing import enable_kept_attention
from .models.distributed import (
    check_deepspeed_batch_fields,
    fsdp_deferral,
    generation_context,
    gradients_held,
    prepare_frozen_model,
    set_up_process_group,
    warn_if_fsdp_dropped,
)
from .models.loading import (
    create_reference_model,
    load_policy_and_tokenizer,
    load_renamed_checkpoint,
    reference_weights,
    router_aux_loss_coef,
)
from .models.moe.replay import RoutingReplay
from .models.multimodal import IMAGE_COLUMNS, check_vision_support, prompts_with_images
from .models.packing import padding_free_in_use
from .models.precision import precision_context, warn_if_fp32_head_is_cast_by_fsdp2
from .objective.entropy_control import EntropyCoefficient
from .objective.loss import Objective
from .reporting.completion_logs import CompletionLog
from .reporting.metrics import MetricsBuffer, record_rollout_metrics, reward_columns
from .reporting.model_card import write_trainer_model_card
from .rollout import SampledRollout, create_rollout_backend, episode_runner_for, stream_keys
from .rollout.environments.tools import environment_reward_functions, tool_episode_factory
from .rollout.rollout_func import check_rollout_func, sample_with_rollout_func
from .scoring.dynamic_sampling import DynamicSampler
from .scoring.rewards import load_rewards, prepare_reward_models
from .scoring.score import completions_per_prompt, reward_and_score, scored_batch
from .scoring.signal_warnings import SignalWarnings
from .training.async_rollouts import RolloutPipeline, check_async_rollouts_supported
from .training.checkpoints import Checkpoints
from .training.cpu_memory import pool_freed_memory
from .training.logprob_check import FirstRolloutCheck
from .training.logprobs import completion_logprobs, logprobs_without_grad
from .training.micro_batch import MicroBatch
from .training.micro_batch_loss import micro_batch_loss
from .training.passes import pass_budget, passes_on_every_process, take_pass
from .training.reference_sync import ReferenceSync
from .training.rollout_checkpoint import save_rollout_state
from .training.schedule import RolloutSchedule, fill_old_logps, rollout_tokens

logger = logging.get_logger(__name__)


class GSPOTrainer(TRLAttributes, Trainer):
    """Group Sequence Policy Optimization (arXiv 2507.18071) with TRL's `GRPOTrainer` interface."""

    _tag_names = ["gspo", "gspo-trl", "trl"]

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GSPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        env_factory=None,
        tool_call_parser=None,
    ):
        args = trainer_config(args, model)
        episodes = env_factory is not None or tools is not None or environment_factory is not None
        check_rollout_func(rollout_func, args, episodes)
        train_dataset = environment_owned_prompts(train_dataset, args, environment_factory or env_factory)
        check_datasets(train_dataset, eval_dataset, args, episodes)
        use_stream_settings(train_dataset, eval_dataset, args)  # TRL's: dispatch_batches=False, a stream's one worker

        set_up_process_group(args)  # before the model: ZeRO-3 partitions it while it loads
        check_deepspeed_batch_fields(args, args.world_size)
        # Seed before anything random is built (LoRA weights), as Trainer only seeds in its own __init__.
        set_seed(args.seed)
        model_source = model
        model, tokenizer, processor = load_policy_and_tokenizer(
            model, processing_class, peft_config, args, quantization_config
        )
        check_vision_support(processor, args, episodes, rollout_func)
        check_dataset_modalities(processor, train_dataset, eval_dataset)
        self.tokenizer = tokenizer  # a vision-language model's processor is `processing_class`, its tokenizer this
        self.objective = Objective.from_config(args)
        self.entropy_coefficient = EntropyCoefficient.from_config(args)
        self.router_aux_loss_coef = router_aux_loss_coef(model, args.router_aux_loss_coef)
        tool_episodes = tool_episode_factory(tools, environment_factory, tool_call_parser, env_factory, tokenizer)
        self.reward_funcs, self.reward_weights = load_rewards(
            reward_funcs,
            environment_reward_functions(environment_factory),
            reward_processing_classes,
            args,
            steps_reward=env_factory is not None,
        )
        # TRL's public attribute: each reward function's tokenizer (a reward model's), None for callables.
        self.reward_processing_classes = [getattr(f, "processing_class", None) for f in self.reward_funcs]
        self.ref_model = create_reference_model(model, model_source, args) if args.beta > 0 else None

        super().__init__(
            model=model,
            args=args,
            data_collator=RowCollator(needs_prompt=not episodes),  # lists of rows, each with a prompt
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processor or tokenizer,
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
        prepare_reward_models(self.reward_funcs, self.accelerator)
        self.reference_sync = ReferenceSync.for_run(self)  # TR-DPO's sync_ref_model
        self.checkpoints = Checkpoints(args, self.accelerator)  # each written aside and moved into place whole

        unwrapped, device_type = self.accelerator.unwrap_model(self.model), self.accelerator.device.type
        self.padding_free = padding_free_in_use(args.padding_free, device_type, unwrapped)
        self.routing = RoutingReplay(args.routing_replay, getattr(unwrapped, "get_base_model", lambda: unwrapped)())
        self.max_tokens_per_pass = pass_budget(args, self.accelerator.device.type, self.router_aux_loss_coef != 0.0)
        self.rollout_backend = create_rollout_backend(
            args, tokenizer, self.accelerator, lambda: self.accelerator.unwrap_model(self.model), processor
        )
        self.uses_tools = tool_episodes is not None
        self.episode_runner = episode_runner_for(tool_episodes, env_factory, tokenizer, args)
        self.rollout_func = rollout_func
        self.rollout_pipeline = None
        if args.async_rollouts:
            check_async_rollouts_supported(self.rollout_backend, self.accelerator)
            self.rollout_pipeline = RolloutPipeline(args, self.rollout_backend, self.episode_runner, tokenizer)
        self._metrics = MetricsBuffer()
        self._eval_prefix = "eval"  # the metric prefix of the evaluation running: eval_<name> for one of several
        self.completion_log = CompletionLog(args, self.accelerator) if args.log_completions else None
        if self.completion_log is not None:
            self.add_callback(self.completion_log)  # uploads the rest of the log when training ends
        self.schedule = RolloutSchedule(args)  # the buffered rollout, the window position, π_old per micro-batch
        self._num_tokens_seen = 0
        self.first_rollout_check = FirstRolloutCheck(args)
        self.signal_warnings = SignalWarnings(args)  # rollouts that train on nothing, warned once
        self.dynamic_sampler = DynamicSampler.create(args, train_dataset, tokenizer.pad_token_id, self._metrics)

    # --- precision ----------------------------------------------------------------------------

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        # Trainer wraps compute_loss in this; every other forward takes the same context, so the LM head
        # (outside the model's autocast-wrapped forward) and the old/new log-probs match.
        return precision_context(self.accelerator)

    # --- data ---------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self):
        # With remove_unused_columns=True, keep the prompt (the model's forward signature has none of ours).
        if self._signature_columns is None:
            self._signature_columns = ["prompt", *IMAGE_COLUMNS]

    def get_train_dataloader(self):
        # One dataloader batch is a whole local generation batch (steps_per_generation micro-batches).
        dataloader = self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )
        self.schedule.micro_steps_per_epoch = micro_steps_per_epoch(dataloader, self.train_dataset, self.args)
        return dataloader

    def _get_dataloader(self, dataset, description, *args, **kwargs):
        with streamed(dataset, description == "Training", self.args, self.accelerator) as dataset:  # a stream: ordered
            return super()._get_dataloader(dataset, description, *args, **kwargs)

    def _get_train_sampler(self, dataset=None):
        return self.schedule.train_sampler(dataset if dataset is not None else self.train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        return self.schedule.eval_sampler(eval_dataset)

    # --- schedule -----------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch: list[dict] | MicroBatch) -> MicroBatch:
        """The micro-batch this micro-step trains on (sampling and scoring a rollout when the schedule needs one);
        in evaluation, the scored batch. A `MicroBatch` is prepared already and passes through (Trainer's
        `training_step` hands each pass back here)."""
        if isinstance(generation_batch, MicroBatch):
            return generation_batch
        if not self.model.training:
            batch = self._generate_and_score(generation_batch, mode="eval")
            batch.num_items_in_batch = rollout_tokens(batch, self.accelerator)
            return batch
        schedule = self.schedule
        if schedule.start(self.state.global_step):
            schedule.fill(*self._rollout_micro_batches(generation_batch))
        if self.rollout_pipeline is not None:
            self._metrics.add("train", "rollout/staleness", float(self.state.global_step - schedule.sampled_at_step))
            # Start sampling the next rollout once the weights are within max_staleness optimizer steps of it.
            upcoming = self.rollout_pipeline.next_rollout(
                self.state.global_step, schedule.step, schedule.window_offset, self.current_gradient_accumulation_steps
            )
            if upcoming is not None and upcoming[1] < self.state.max_steps:  # not past the end of training
                self._launch_rollout(*upcoming)
        return schedule.current()

    def _rollout_micro_batches(self, generation_batch: list[dict]) -> tuple[list[MicroBatch], int]:
        """(this process's micro-batches of a rollout sampled now or ahead, with their π_old, the optimizer step of
        the weights that sampled it)."""
        if self.rollout_pipeline is None:
            rollout, weights_step = self._generate_and_score(generation_batch, "train"), self.state.global_step
        else:
            sampled, weights_step = self.rollout_pipeline.take(
                generation_batch, self.state.global_step, self._launch_rollout
            )
            rollout = self._score(generation_batch, sampled, "train")
        if self.dynamic_sampler is not None:  # informative groups only, sampling more prompts where needed
            rollout = self.dynamic_sampler.fill(rollout, self.state.global_step, self.accelerator, self._score_more)
        micro_batches = self.schedule.cut(rollout, self.accelerator, self.tokenizer.pad_token_id)
        fill_old_logps(
            micro_batches,
            self.schedule.needs_old_logps(),
            self.args,
            forward=lambda micro_batch: self.routing.old_pass(self._score_without_grad, self.model, micro_batch),
        )
        return micro_batches, weights_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()  # before the rollout: _prepare_inputs samples for training only in train mode
        self._metrics.passes = []  # nothing left over from a micro-step that raised
        micro_batch = self._prepare_inputs(inputs)
        passes = passes_on_every_process(micro_batch, self.max_tokens_per_pass, self.accelerator)
        loss = torch.zeros((), device=self.accelerator.device)
        for index, rows in enumerate(passes):
            last = index == len(passes) - 1
            part = micro_batch if len(passes) == 1 else take_pass(micro_batch, rows, last, self.args.pad_to_multiple_of)
            # Every pass but the last accumulates its gradient locally, like an earlier micro-step.
            held = contextlib.nullcontext() if last else gradients_held(self.accelerator, model, fsdp_deferral(self))
            with held:
                loss = loss + super().training_step(model, part, num_items_in_batch)
        self.schedule.advance()
        return loss

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # A used output_dir, a damaged checkpoint or another number of processes: refused before anything loads.
        resume_from_checkpoint = self.checkpoints.before_training(resume_from_checkpoint, logger.warning)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not load_renamed_checkpoint(model or self.model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _inner_training_loop(self, *args, **kwargs):
        enable_kept_attention(self.model, self.args)  # Trainer.train has just enabled checkpointing without it
        check_stream_resume(kwargs.get("resume_from_checkpoint"), self.train_dataset)
        self.reference_sync.restore(kwargs.get("resume_from_checkpoint"))
        restored = self.schedule.restore(kwargs.get("resume_from_checkpoint"), self.accelerator)
        if restored is not None:
            self._num_tokens_seen = restored.num_tokens_seen
            if restored.entropy_control is not None:
                self.entropy_coefficient.load_state_dict(restored.entropy_control)
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if self.rollout_pipeline is not None:
                self.rollout_pipeline.prefetcher.drain()
                self.rollout_pipeline.lookahead = None

    # --- async rollouts -----------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.rollout_pipeline is not None:  # read through a look-ahead, which finds the next rollout's prompts
            epoch_iterator = self.rollout_pipeline.wrap(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _launch_rollout(self, batch: list[dict], for_step: int) -> None:
        models = (self.model_wrapped, self.accelerator.unwrap_model(self.model))
        sampling = (self._sample, self._score_without_grad, functools.partial(precision_context, self.accelerator))
        self.rollout_pipeline.launch(batch, for_step, self.state.global_step, models, *sampling)

    # --- rollout ------------------------------------------------------------------------------

    def _generate_and_score(self, batch: list[dict], mode: str, first_row: int = 0) -> MicroBatch:
        """Sample a synchronous rollout on the current weights and score it (eval; train without async_rollouts);
        `first_row`: the global row index of this rollout's first row (a dynamic sampling round's)."""
        if self.rollout_pipeline is not None:  # a server must not change weights under a rollout sampled ahead
            self.rollout_pipeline.prefetcher.wait()
        self.rollout_backend.update_weights(self.model_wrapped, self.state.global_step)
        on_model = self.rollout_backend.samples_with_training_model
        with generation_context(self.model_wrapped, self.accelerator, self.args, on_model):
            step, backend = self.state.global_step, self.rollout_backend
            sampled = self._sample(backend, self.episode_runner, batch, mode, step, first_row=first_row)
        return self._score(batch, sampled, mode)

    def _score_more(self, batch: list[dict], first_row: int) -> MicroBatch:
        """A dynamic sampling round: `batch` sampled as the global rows from `first_row` on, and scored."""
        if self.rollout_pipeline is None:
            return self._generate_and_score(batch, "train", first_row)
        return self._score(batch, self.rollout_pipeline.sample_more(batch, first_row), "train")

    def _sample(self, backend, runner, batch, mode: str, step: int, keyed=False, first_row=0) -> SampledRollout:
        """Completions (or episodes) for `batch`, with the sampling streams and seeds of optimizer step `step` (`keyed`:
        per-completion streams even without layout_independent_sampling; `first_row`: see `_row_keys`)."""
        if self.rollout_func is not None:
            return sample_with_rollout_func(self.rollout_func, self, [row["prompt"] for row in batch])
        # Per-completion sampling streams (None: the global RNG); one environment seed per group.
        keyed = keyed or self.args.layout_independent_sampling
        keys = self._row_keys(len(batch), mode, step, 1, first_row) if keyed else None
        if runner is None:
            rollout = backend.generate(prompts_with_images(batch, self.processing_class), keys)  # images inlined
            return SampledRollout(rollout, [row["prompt"] for row in batch])
        group = completions_per_prompt(self.args, mode)
        seeds = (self._row_keys(len(batch), mode, step, group, first_row) & 0x7FFFFFFF).tolist()
        episodes = runner.run(backend, batch, seeds, keys)
        return SampledRollout(episodes.rollout, episodes.prompts, episodes)

    def _score(self, batch: list[dict], sampled: SampledRollout, mode: str) -> MicroBatch:
        """Rewards, advantages and (beta > 0) the reference's log-probs of a sampled rollout, and its metrics."""
        args, accelerator = self.args, self.accelerator
        scores, texts, extra_columns = reward_and_score(
            batch,
            sampled,
            self.reward_funcs,
            self.reward_weights,
            self.tokenizer,
            self.state,
            args,
            accelerator,
            log_metric=lambda name, value: self._metrics.add(mode, name, value),
            group_size=completions_per_prompt(args, mode),
        )
        scored = scored_batch(sampled, scores, args.mask_truncated_completions)
        if mode == "train":  # the first rollout, before a π_old or reference pass scores on a path
            pipeline = self.rollout_pipeline
            backends = [self.rollout_backend, *(pipeline.backends if pipeline is not None else [])]
            self.padding_free = self.first_rollout_check.run(
                self.model, scored, sampled, args, accelerator, self.padding_free, backends
            )
            self.signal_warnings.check(sampled.rollout, completions_per_prompt(args, mode), accelerator)
        if args.beta > 0:
            with reference_weights(self.model, self.ref_model) as reference:
                scored.ref_logps = self._score_without_grad(reference, scored)
        reward_names = [f.name for f in self.reward_funcs]
        record_rollout_metrics(self._metrics, mode, sampled, scores, reward_names, self.uses_tools, accelerator)
        if mode == "train":
            tokens = sampled.rollout.prompt_mask.sum() + sampled.rollout.completion_mask.sum()
            self._num_tokens_seen += accelerator.gather(tokens.reshape(1)).sum().item()
        if self.completion_log is not None:  # every process: the rows are gathered to the main one
            columns = reward_columns(scores, reward_names, sampled.episodes, self.uses_tools)
            self.completion_log.record(mode, sampled.prompts, texts, scores, extra_columns, *columns)
        return scored

    def _row_keys(self, num_rows: int, mode: str, step: int, group_size: int = 1, first_row: int = 0) -> torch.Tensor:
        """A key per row (or per group of `group_size` rows) of this process's slice of the global generation
        batch (ranks hold consecutive slices; a dynamic sampling round's rows follow the earlier rounds' from
        `first_row`), drawn for optimizer step `step`: whatever the process layout."""
        rows = first_row + self.accelerator.process_index * num_rows + torch.arange(num_rows)
        return stream_keys(self.args.seed, step, 0 if mode == "train" else 1, rows // group_size)

    def _score_without_grad(self, model, inputs: MicroBatch) -> torch.Tensor:
        """(B, C) per-token log-probs of a whole rollout batch, one training micro-batch at a time."""
        return logprobs_without_grad(
            model,
            inputs,
            self.args.per_device_train_batch_size,
            functools.partial(precision_context, self.accelerator),
            temperature=self.args.temperature,
            chunk_size=self.args.logprob_chunk_size,
            padding_free=self.padding_free,
            routing=self.routing.without_grad(inputs),
        )

    # --- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, inputs: MicroBatch, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GSPOTrainer.compute_loss does not return model outputs (return_outputs=True).")
        if inputs.old_logps is None and self.model.training:
            self.schedule.check_weights_unchanged(self.state.global_step)
        mode = "train" if self.model.training else "eval"
        scores = completion_logprobs(
            model,
            *inputs.model_inputs(),
            temperature=self.args.temperature,
            chunk_size=self.args.logprob_chunk_size,
            kept_logits_mb=self.args.logprob_kept_logits_mb,
            padding_free=self.padding_free,
            entropy_grad=self.entropy_coefficient.enabled,
            router_aux_loss=self.router_aux_loss_coef != 0.0,
            vision=inputs.vision,
            routing=self.routing.training(inputs, lambda name, value: self._metrics.add(mode, name, value)),
        )
        loss, metrics, counts = micro_batch_loss(scores, inputs, self, mode)
        self._metrics.add_pass(mode, metrics, counts, inputs.last_pass, self.accelerator.gather)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # --- logging and saving -------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        self._eval_prefix = metric_key_prefix  # Trainer evaluates each of several datasets under eval_<name>
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics.pop_averages(mode)
        if mode == "eval":
            metrics = {f"{self._eval_prefix}_{name}": value for name, value in metrics.items()}
        else:
            metrics["num_tokens"] = self._num_tokens_seen
        logs.update(metrics)
        super().log(logs, start_time)
        if self.completion_log is not None:
            self.completion_log.write(self.state.global_step, self._eval_prefix)

    def _save_checkpoint(self, model, trial):
        # Everything goes into a staging folder (Trainer's files too: see _get_output_dir), renamed into place whole.
        with self.checkpoints.staged(self._get_output_dir(trial=trial), self.state) as checkpoint_dir:
            state = self.schedule.checkpoint_state(self._num_tokens_seen, self.entropy_coefficient.state_dict())
            save_rollout_state(checkpoint_dir, self.accelerator.process_index, state)
            self.reference_sync.save(checkpoint_dir)
            self.create_model_card(model_name=Path(self.args.hub_model_id or self.args.output_dir).name)
            super()._save_checkpoint(model, trial)

    def _get_output_dir(self, trial):
        return self.checkpoints.staging or super()._get_output_dir(trial)

    def create_model_card(self, model_name: str | None = None, tags=None, **kwargs) -> None:
        write_trainer_model_card(self, model_name, tags, __version__)
