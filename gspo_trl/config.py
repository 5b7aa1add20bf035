"""`GSPOConfig`: every knob of a GSPO run, as dataclass fields with their help.

Fields shared with TRL's `GRPOConfig` keep TRL's names and meaning, so a TRL user changes only the
import. Defaults follow the GSPO paper (arXiv 2507.18071), not TRL: sequence-level importance ratios,
the paper's clipping range (3e-4, 4e-4), no KL term, and four optimizer steps per rollout batch.
Every field carries `metadata={"help": ...}`: the single source for the CLI, YAML files and
`docs/config.md`. This module owns the fields only; their checks and derived defaults are the
functions of `config_checks`, which `__post_init__` calls once at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from . import config_checks as checks


@dataclass
class GSPOConfig(TrainingArguments):
    r"""Configuration for [`GSPOTrainer`].

    Only the fields that differ from `transformers.TrainingArguments` are listed here; see each
    field's `help` (or `docs/config.md`) for its meaning.
    """

    # JSON strings in these fields (from the CLI or YAML) are parsed into dicts by TrainingArguments.
    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
    ]

    # --- TrainingArguments fields whose defaults differ --------------------------------------
    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every X update steps (an integer, or a float in [0, 1) for a ratio of total steps)."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Use bf16 mixed precision. None: on with a bf16-capable CUDA GPU unless fp16 or use_cpu is set, "
            "off otherwise."
        },
    )
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={
            "help": "False passes every dataset column to the reward functions as keyword arguments; True keeps only "
            "the 'prompt' column."
        },
    )

    # --- Model -------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` (and for reward models given as "
            "a path) when the `model` argument of `GSPOTrainer` is a string."
        },
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Keep the LM head in fp32 and project to the vocabulary in fp32, for precise log-probabilities "
            "with a bf16/fp16 model (as in TRL). A tied head's input embedding becomes fp32 too; not with a PEFT "
            "adapter on lm_head."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Set every dropout probability to 0, so that old, current and reference log-probabilities differ "
            "only through the weights (TRL's default is False)."
        },
    )

    # --- Data and rollouts -------------------------------------------------------------------
    num_generations: int = field(
        default=8,
        metadata={"help": "Completions sampled per prompt (the group size G). At least 2."},
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Completions per prompt in evaluation; None: num_generations. 1 measures rewards only."},
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Truncate prompts longer than this many tokens from the left; None keeps them whole."},
    )
    max_completion_length: int = field(
        default=512, metadata={"help": "Maximum number of tokens generated per completion."}
    )
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle the training prompts."})
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated per rollout over all processes: a multiple of num_generations and of "
            "per_device_train_batch_size × num_processes. Set this or steps_per_generation, not both."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches trained on per rollout (as in TRL). None: 4 × gradient_accumulation_steps, the GSPO "
            "paper's four optimizer steps per rollout (unless generation_batch_size is set)."
        },
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Passes over each rollout batch (μ in the GRPO/GSPO papers)."},
    )
    async_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Sample the next rollout in a background thread while the current one trains, from a snapshot of "
            "the weights (or on the vLLM server), with the sampling weights' log-probs as π_old. See "
            "docs/async_rollouts.md#when-it-pays."
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "With async_rollouts: the most optimizer steps between the weights that sample a rollout and its "
            "first training step; None: the optimizer steps per rollout, 0: synchronous sampling. See "
            "docs/async_rollouts.md#what-happens."
        },
    )
    always_compute_old_logprobs: bool = field(
        default=False,
        metadata={
            "help": "Run the π_old forward pass for every micro-batch, also where it is skipped by default (ratio "
            "exactly 1, or log-probs recorded while decoding); same results, slower. See "
            "docs/performance-options.md#old-log-probs."
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature. Must be > 0."})
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling: keep the top tokens of this mass, in (0, 1]."}
    )
    top_k: int = field(default=0, metadata={"help": "Keep only the k most likely tokens when sampling; 0 disables it."})
    min_p: float | None = field(
        default=None,
        metadata={
            "help": "Drop tokens less likely than min_p × the top token's probability, in [0, 1]. None disables."
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={"help": "Penalty (> 0) on tokens already in the prompt or completion; 1.0 disables it."},
    )
    generation_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments for `GenerationConfig`; they override the sampling fields above."},
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments for `apply_chat_template` on conversational prompts."},
    )
    layout_independent_sampling: bool = field(
        default=False,
        metadata={
            "help": "Give every completion its own random stream keyed by (seed, optimizer step, index in the global "
            "generation batch), so rollouts do not depend on the number of processes. See "
            "docs/distributed.md#same-results-on-1-or-n-processes."
        },
    )
    decode_loop: str = field(
        default="gspo",
        metadata={
            "help": "'gspo': gspo-trl's decoding loop (the same distribution as generate; finished completions leave "
            "the batch); 'generate': transformers' `generate`, also used when generation_kwargs or "
            "cache_implementation need it. See docs/performance-options.md#decoding."
        },
    )
    decode_cuda_graphs: bool = field(
        default=True,
        metadata={
            "help": "With decode_loop='gspo' on a CUDA device, decode on a static KV cache and replay each step as a "
            "CUDA graph (models that cannot take it decode without; no effect on CPU). See "
            "docs/performance-options.md#decoding."
        },
    )
    decode_max_rows: int | None = field(
        default=None,
        metadata={
            "help": "The most completions the trained model decodes at once, larger rollouts being decoded in slices; "
            "None: on a GPU, the fewest even slices whose KV cache fits in free memory, on CPU all rows. See "
            "docs/performance-options.md#decoding."
        },
    )
    cpu_decoding_kernels: str = field(
        default="auto",
        metadata={
            "help": "gspo-trl's CPU decoding accelerations (timed product forms, packed attention, compiled C "
            "kernels): 'auto' uses them where the policy samples on CPU, 'on' always, 'off' never. See "
            "docs/performance-options.md#decoding."
        },
    )
    decode_logprobs_as_old: bool | None = field(
        default=None,
        metadata={
            "help": "With decode_loop='gspo', use the log-probs the decoding loop recorded as π_old instead of a π_old "
            "forward pass; None: on when sampling runs in float32 (no bf16, fp16 or TF32), off otherwise. See "
            "docs/performance-options.md#old-log-probs."
        },
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={"help": "KV cache implementation for `generate` (e.g. 'static'); None uses the model's default."},
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "Under DeepSpeed ZeRO-3 or FSDP2, gather all parameters once per rollout for generation instead of "
            "layer by layer at each decoding step: faster, for a full copy of the weights per process. False if the "
            "model does not fit one device."
        },
    )
    # --- Generation with vLLM (TRL's names) --------------------------------------------------
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Sample completions on a vLLM server instead of the trained model; the server gets the trained "
            "weights before each rollout whose weights changed. See docs/vllm.md#set-up."
        },
    )
    vllm_mode: str = field(
        default="server",
        metadata={
            "help": "'server': a vLLM server started with `gspo-trl vllm-serve MODEL` (the default here). 'colocate', "
            "TRL's default, is not available yet."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={"help": "Base URL of the vLLM server (e.g. 'http://127.0.0.1:8000'); overrides host and port."},
    )
    vllm_server_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Host of the vLLM server when vllm_server_base_url is unset (TRL's default is 0.0.0.0)."},
    )
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the vLLM server."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait for the vLLM server to answer /health at start before failing."},
    )
    vllm_weight_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory the trainer writes weight snapshots to and the server reloads them from; None: a "
            "temporary directory in /dev/shm, for a server on this machine. See "
            "docs/vllm.md#the-weights-on-their-way-to-the-server."
        },
    )
    vllm_lora_adapter_sync: bool | None = field(
        default=None,
        metadata={
            "help": "When training LoRA, send the server only the adapter (needs --enable-lora) instead of merged "
            "weights; None: whenever the server and adapter allow, True: required, False: merged weights. See "
            "docs/vllm.md#the-weights-on-their-way-to-the-server."
        },
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={"help": "TRL's NCCL weight-sync port. Accepted for compatibility; gspo-trl syncs through files."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Colocate mode only (not available yet); set it on the server instead."}
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Colocate mode only (not available yet); set it on the server instead."}
    )
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Colocate mode only (not available yet)."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "Colocate mode only (not available yet)."})
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "Colocate mode only (not available yet); set --max-model-len on the server."}
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "Constrain the server's completions to this regular expression."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Weight the loss by π_old / π_vllm, truncated or masked, to correct for the numerical gap between "
            "the trainer and the vLLM server. See docs/vllm.md#the-trainerserver-mismatch-and-its-correction."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask': `*_truncate` clips the "
            "correction weight to [clip_min, clip_max], `*_mask` drops the token or sequence outside it (sequence "
            "weights are length-normalised). See docs/vllm.md#the-trainerserver-mismatch-and-its-correction."
        },
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "C_min of the correction weight; None: no lower bound."}
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "C_max of the correction weight; None: no upper bound."}
    )
    vllm_logprobs_as_old: bool = field(
        default=False,
        metadata={
            "help": "Use the server's log-probs as π_old and skip the trainer's π_old forward pass; the ratio then "
            "also carries the engines' numerical gap. See docs/vllm.md#skipping-the-π_old-pass-paper-54."
        },
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated in TRL: the same as vllm_importance_sampling_clip_max."}
    )

    logprob_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Completion tokens projected through the LM head at once when computing log-probs, bounding the "
            "logits memory to chunk × vocabulary floats. See docs/performance-options.md#memory."
        },
    )
    logprob_kept_logits_mb: float = field(
        default=1024,
        metadata={
            "help": "MiB of fp32 logits the training forward keeps for the backward pass; chunks past it are projected "
            "again in the backward pass (0: recompute every chunk, least memory). See "
            "docs/performance-options.md#memory."
        },
    )
    activation_checkpointing_keep_attention: bool = field(
        default=True,
        metadata={
            "help": "With activation checkpointing, keep each layer's attention output for the backward pass instead "
            "of recomputing it: same gradients, faster long completions, a little more memory; False recomputes all. "
            "See docs/performance-options.md#memory."
        },
    )
    max_tokens_per_pass: int | None = field(
        default=None,
        metadata={
            "help": "The most positions (rows × padded length) in one training forward/backward pass; larger "
            "micro-batches run as several passes with the same gradient (None: 8192 on a CUDA GPU, no limit on CPU; 0: "
            "one pass). See docs/performance-options.md#memory."
        },
    )
    cpu_memory_pool: bool = field(
        default=True,
        metadata={
            "help": "On CPU with glibc, keep freed memory in the process for reuse instead of faulting in fresh pages "
            "every step; resident memory stays near its peak. See docs/performance-options.md#memory."
        },
    )
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Pack each prompt once with its completions under a block-tree attention mask for the training and "
            "log-prob passes; None: packed on CPU, padded rows on GPUs. See docs/performance-options.md#packed-rows."
        },
    )
    check_logprobs: str = field(
        default="raise",
        metadata={
            "help": "On the first rollout, compare the log-probs of the path training scores with (padded or packed "
            "rows) and those the decoding loop recorded with a plain forward of a few rows alone: 'raise' fails on a "
            "disagreement, 'warn' warns and falls back to a safe path, 'off' skips the check. See "
            "docs/performance-options.md#log-prob-check."
        },
    )

    # --- Objective ---------------------------------------------------------------------------
    importance_sampling_level: str | None = field(
        default=None,
        metadata={
            "help": "'sequence' (GSPO), 'sequence_token' (GSPO-token, per-token advantages), 'token' (GRPO's ratio) or "
            "'turn' (one ratio per assistant turn). None: 'sequence' for loss_type grpo, sapo and luspo, 'token' for "
            "the others."
        },
    )
    epsilon: float | None = field(
        default=None,
        metadata={
            "help": "Lower clipping range, in (0, 1): ratios below 1 − epsilon are clipped. None: 3e-4 (the paper's) "
            "for sequence-level ratios, 0.2 (TRL's) for importance_sampling_level='token'."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clipping range: ratios above 1 + epsilon_high are clipped (for 'cispo', the cap on the "
            "weight). None: 5.0 for 'cispo', 4e-4 with epsilon unset and a non-token level, else epsilon."
        },
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta (> 1, best > 1 + epsilon_high) "
            "to bound the loss of negative-advantage samples; None: off. See "
            "docs/objective.md#options-that-combine-with-any-loss_type."
        },
    )
    sapo_temperature_pos: float = field(
        default=1.0,
        metadata={"help": "SAPO's gate temperature for positive advantages (loss_type='sapo')."},
    )
    sapo_temperature_neg: float = field(
        default=1.05,
        metadata={"help": "SAPO's gate temperature for zero or negative advantages (loss_type='sapo')."},
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={"help": "VESPO's power k for advantages >= 0: how fast weights of sequence ratios below 1 fall."},
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={"help": "VESPO's decay λ for advantages >= 0: how fast weights of sequence ratios above 1 fall."},
    )
    vespo_k_neg: float = field(
        default=3.0,
        metadata={"help": "VESPO's power k for negative advantages."},
    )
    vespo_lambda_neg: float = field(
        default=2.0,
        metadata={"help": "VESPO's decay λ for negative advantages."},
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient against the reference model (k3 estimator). 0.0, the paper's setting, loads no "
            "reference model and skips its forward pass."
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the per-token KL by the importance ratio (TRL's default and meaning). Used when beta > 0."
        },
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "'grpo' (GSPO's clipped objective, each sequence weighing the same), 'sapo', 'cispo', 'vespo', "
            "'luspo', or the token-summed 'dapo', 'bnpo' and 'dr_grpo'. See "
            "docs/objective.md#the-gspo-family-loss_type."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantage scaling: 'group' divides by each group's reward std, 'batch' by the batch std, "
            "'none' does not scale (True and False mean 'group' and 'none')."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per reward function; None weights every function 1.0."},
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': weighted sum of the rewards, then advantages per scale_rewards; "
            "'normalize_then_sum' (GDPO): each function normalised within its group, summed, then scaled by the "
            "batch std (scale_rewards unused). See docs/migrating-from-trl.md#reward-functions-same-convention."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Exclude completions cut off at max_completion_length from the loss (DAPO's overlong filtering)."
        },
    )

    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2): drop negative-advantage sequences whose mean "
            "per-token log(π_sampler / π_θ) exceeds this (e.g. 0.5); None: off. See "
            "docs/objective.md#options-that-combine-with-any-loss_type."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Keep the policy gradient only on this top quantile of completion tokens by entropy, over all "
            "processes (0.2 in Beyond the 80/20 Rule). In [0, 1]; 1.0 keeps every token."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus: subtract entropy_coef × the mean entropy of the tokens the policy term learns "
            "from; with use_adaptive_entropy, the starting coefficient. 0.0: off."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Skywork-OR1's adaptive entropy control: after each optimizer step, raise entropy_coef by "
            "entropy_coef_delta when the mean entropy is at or below entropy_target, else lower it. See "
            "docs/objective.md#options-that-combine-with-any-loss_type."
        },
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Lower bound of the adaptive entropy_coef."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Upper bound of the adaptive entropy_coef."})
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Change of the adaptive entropy_coef per optimizer step."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Mean per-token entropy (nats) at or below which adaptive control applies the bonus. Set it near "
            "the entropy you see early in training (often 1–3 nats)."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of a Mixture-of-Experts model's load-balancing loss, added to the loss and logged as "
            "aux_loss. None: the model config's own coefficient (0 without one)."
        },
    )

    # --- Multi-turn episodes (env_factory) ------------------------------------------------------
    max_turns: int | None = field(
        default=None,
        metadata={
            "help": "Most assistant turns per env_factory episode, after which it ends as truncated; None: only the "
            "environment or max_completion_length (which counts every turn's tokens) ends it."
        },
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "With tools or environment_factory, the most rounds of tool calls per episode (TRL's field); None: "
            "bounded by max_turns and max_completion_length only."
        },
    )
    advantage_granularity: str = field(
        default="trajectory",
        metadata={
            "help": "'trajectory': every turn gets the episode's advantage; 'turn': each turn gets the "
            "group-normalised advantage of its discounted return (needs importance_sampling_level 'turn', "
            "'sequence_token' or 'token'). See docs/agents.md#turn-level-gspo."
        },
    )
    turn_discount: float = field(
        default=1.0,
        metadata={"help": "Discount per turn, in [0, 1], applied to step rewards in an episode's return."},
    )

    # --- Logging -----------------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "At each log, print the latest rollout's (prompt, completion, reward, advantage) rows, plus any "
            "column a reward function added with log_extra."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "How many rows log_completions prints; None prints them all."},
    )

    def __post_init__(self):
        # Set before TrainingArguments' own checks, which read use_cpu and bf16.
        self.use_cpu = checks.cpu_process_group_default(self.use_cpu)
        if self.bf16 is None:
            self.bf16 = checks.bf16_default(self.fp16, self.use_cpu)
        self.scale_rewards = checks.scale_rewards_option(self.scale_rewards)
        self.importance_sampling_level, self.epsilon, self.epsilon_high = checks.objective_defaults(
            self.loss_type, self.importance_sampling_level, self.epsilon, self.epsilon_high
        )
        steps_per_generation_was_set = self.steps_per_generation is not None
        super().__post_init__()
        checks.check_objective(self)
        checks.check_episodes(self)
        checks.check_sampling(self)
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name for the same bound
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        checks.check_vllm(self)
        checks.check_liger(self)
        self.steps_per_generation, self.generation_batch_size = checks.batch_sizes(self, steps_per_generation_was_set)
        self.max_staleness = checks.max_staleness(self)

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """How many optimizer steps train on each rollout (over all its iterations)."""
        return self.steps_per_generation * self.num_iterations // self.gradient_accumulation_steps

    @property
    def is_on_policy(self) -> bool:
        """True when every rollout is trained on by exactly one optimizer step with the weights that sampled it."""
        return self.steps_per_generation == self.gradient_accumulation_steps and self.num_iterations == 1
