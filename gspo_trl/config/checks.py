"""The checks and derived defaults behind `GSPOConfig`: one function per section of its fields.

`GSPOConfig.__post_init__` calls these in order: the defaults that `TrainingArguments` itself reads (the CPU
process group, bf16), the objective's defaults, then, after `TrainingArguments.__post_init__`, the checks of each
section and the derived batch sizes. A check raises `ValueError` (or `TypeError`) naming the field and what to
set instead; a default returns the value to store. The loss fields' own bounds belong to `loss.Objective`, which
`check_objective` builds, so they are written once. The fields themselves and their help live in `config`.
"""

from __future__ import annotations

import math

import torch
from transformers.utils import logging

from ..models.distributed import launched_processes, needs_cpu_process_group
from ..objective.loss import Objective
from ..objective.sampling_correction import CORRECTION_MODES
from ..rollout.decoding.cpu import SETTINGS as CPU_DECODING_KERNELS
from ..scoring.advantages import AGGREGATION_OPTIONS, SCALE_REWARDS_OPTIONS
from ..vllm.address import base_url, check_base_urls
from ..vllm.auth import resolve_token
from .generation_kwargs import check_generation_kwargs

# How episode rewards become advantages (see `advantage_granularity`).
ADVANTAGE_GRANULARITIES = ("trajectory", "turn")
# How completions are sampled (see `decode_loop`).
DECODE_LOOPS = ("gspo", "generate")
# What a disagreement found by the log-prob check does (see `check_logprobs`).
CHECK_LOGPROBS_OPTIONS = ("raise", "warn", "off")

# Optimizer steps per rollout batch when the user leaves `steps_per_generation` unset (the paper's
# "each batch of rollouts is split into four minibatches for gradient updates").
PAPER_MINIBATCHES_PER_ROLLOUT = 4
# The clipping range the GSPO paper reports, GRPO's customary token-level one (TRL's default), and ScaleRL's
# recommended cap for CISPO's importance weight.
PAPER_EPSILON, PAPER_EPSILON_HIGH = 3e-4, 4e-4
TOKEN_LEVEL_EPSILON = 0.2
CISPO_EPSILON_MAX = 5.0
# Loss types that sum per-token losses, so that a sequence-level ratio ends up weighted by the sequence's length.
TOKEN_SUM_LOSS_TYPES = ("bnpo", "dr_grpo", "dapo", "cispo")

logger = logging.get_logger(__name__)


# --- Defaults read before TrainingArguments' own checks ----------------------------------------


def cpu_process_group_default(use_cpu: bool) -> bool:
    """`use_cpu`, or True (with a warning) for several processes launched on a machine without a GPU."""
    if needs_cpu_process_group(use_cpu):
        # Otherwise accelerate trains each process alone on a full copy of the batch.
        logger.warning(
            f"{launched_processes()} processes were launched on a machine without a GPU: training on CPU over a "
            "gloo process group (use_cpu=True)."
        )
        return True
    return use_cpu


def bf16_default(fp16: bool, use_cpu: bool) -> bool:
    """bf16 left unset: on with a bf16-capable CUDA GPU unless fp16 or use_cpu is set."""
    return not fp16 and not use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def scale_rewards_option(scale_rewards):
    """TRL's spellings of `scale_rewards` (True, False, "true", "false") as one of `SCALE_REWARDS_OPTIONS`."""
    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if isinstance(scale_rewards, str):
        scale_rewards = {"true": "group", "false": "none"}.get(scale_rewards.lower(), scale_rewards)
    return scale_rewards


# --- Objective ---------------------------------------------------------------------------------


def objective_defaults(
    loss_type: str, importance_sampling_level: str | None, epsilon: float | None, epsilon_high: float | None
) -> tuple[str, float, float]:
    """(importance_sampling_level, epsilon, epsilon_high) with the unset ones resolved for `loss_type`."""
    if importance_sampling_level is None:
        token_level = loss_type in TOKEN_SUM_LOSS_TYPES or loss_type == "vespo"
        importance_sampling_level = "token" if token_level else "sequence"
    epsilon_was_set = epsilon is not None
    if not epsilon_was_set:
        epsilon = TOKEN_LEVEL_EPSILON if importance_sampling_level == "token" else PAPER_EPSILON
    if epsilon_high is None:
        if loss_type == "cispo":
            epsilon_high = CISPO_EPSILON_MAX
        elif not epsilon_was_set and importance_sampling_level != "token":
            epsilon_high = PAPER_EPSILON_HIGH
        else:
            epsilon_high = epsilon
    return importance_sampling_level, epsilon, epsilon_high


def check_objective(config) -> None:
    """The loss fields (through `Objective`), how they combine, the entropy terms and the reward options."""
    Objective.from_config(config)  # every loss field's own bounds, naming the field out of range
    if config.loss_type == "vespo" and config.importance_sampling_level != "token":
        raise ValueError(
            f"loss_type='vespo' builds its own weight from the product of the token ratios, so "
            f"importance_sampling_level must be 'token' (or unset), got {config.importance_sampling_level!r}."
        )
    if config.loss_type == "luspo" and config.importance_sampling_level != "sequence":
        logger.warning(
            "loss_type='luspo' is defined on GSPO's sequence ratio; importance_sampling_level="
            f"{config.importance_sampling_level!r} departs from the LUSPO paper."
        )
    if config.importance_sampling_level == "sequence" and config.loss_type in TOKEN_SUM_LOSS_TYPES:
        logger.warning(
            f"loss_type={config.loss_type!r} sums per-token losses, so each sequence's sequence-level term is "
            "weighted by its length instead of GSPO's per-sequence objective; loss_type='grpo' is the paper's."
        )
    if config.loss_type == "cispo" and config.epsilon_high < 1:
        logger.warning(
            f"loss_type='cispo' caps every importance weight at epsilon_high={config.epsilon_high} < 1, "
            f"which shrinks every gradient; ScaleRL recommends {CISPO_EPSILON_MAX}."
        )
    if not 0 <= config.top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {config.top_entropy_quantile}.")
    if not math.isfinite(config.entropy_coef):
        raise ValueError(f"entropy_coef must be a finite number, got {config.entropy_coef}.")
    if config.use_adaptive_entropy and not (
        0 <= config.entropy_coef_min <= config.entropy_coef_max and config.entropy_coef_delta >= 0
    ):
        raise ValueError(
            "use_adaptive_entropy needs 0 <= entropy_coef_min <= entropy_coef_max and entropy_coef_delta >= 0, got "
            f"{config.entropy_coef_min}, {config.entropy_coef_max}, {config.entropy_coef_delta}."
        )
    if config.scale_rewards not in SCALE_REWARDS_OPTIONS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS_OPTIONS}, got {config.scale_rewards!r}.")
    if config.multi_objective_aggregation not in AGGREGATION_OPTIONS:
        raise ValueError(
            f"multi_objective_aggregation must be one of {AGGREGATION_OPTIONS}, got "
            f"{config.multi_objective_aggregation!r}."
        )
    if config.reward_weights is not None:
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in config.reward_weights):
            raise ValueError(f"reward_weights must be finite numbers, got {config.reward_weights!r}.")
    if config.num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {config.num_iterations}.")


def check_reference_sync(config) -> None:
    """TR-DPO's reference syncing: a reference model to sync (beta > 0), α in [0, 1], a positive period."""
    if not config.sync_ref_model:
        return
    if config.beta == 0.0:
        raise ValueError(
            "sync_ref_model=True needs a reference model, but beta=0.0 loads none: set beta > 0, or "
            "sync_ref_model=False."
        )
    if not 0.0 <= config.ref_model_mixup_alpha <= 1.0:
        raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {config.ref_model_mixup_alpha}.")
    if not isinstance(config.ref_model_sync_steps, int) or config.ref_model_sync_steps < 1:
        raise ValueError(f"ref_model_sync_steps must be an int >= 1, got {config.ref_model_sync_steps!r}.")


def pad_to_multiple_of(value) -> int | None:
    """`pad_to_multiple_of` as a number of columns or None: TRL's 'auto' pads only on Neuron devices, which gspo-trl
    does not run on; 'none' / 'null' and digit strings come from the command line."""
    if isinstance(value, str):
        if value.lower() in ("auto", "none", "null"):
            return None
        if not value.isdigit():
            raise ValueError(f"pad_to_multiple_of must be an int >= 1, 'auto' or None, got {value!r}.")
        value = int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"pad_to_multiple_of must be an int >= 1, 'auto' or None, got {value!r}.")
    return value


# --- Multi-turn episodes -----------------------------------------------------------------------


def check_episodes(config) -> None:
    """How episode rewards become advantages, and the bounds of an episode."""
    if config.advantage_granularity not in ADVANTAGE_GRANULARITIES:
        raise ValueError(
            f"advantage_granularity must be one of {ADVANTAGE_GRANULARITIES}, got {config.advantage_granularity!r}."
        )
    if config.advantage_granularity == "turn" and config.importance_sampling_level == "sequence":
        raise ValueError(
            "advantage_granularity='turn' gives each turn its own advantage, which one ratio per "
            "sequence cannot carry: set importance_sampling_level='turn' (one ratio per turn) or "
            "'sequence_token' (GSPO-token)."
        )
    if config.advantage_granularity == "turn" and config.loss_type == "vespo":
        raise ValueError(
            "loss_type='vespo' weighs whole sequences and takes one advantage per sequence: use "
            "advantage_granularity='trajectory' with it."
        )
    if config.max_tool_calling_iterations is not None and config.max_tool_calling_iterations < 0:
        raise ValueError(f"max_tool_calling_iterations must be >= 0 or None, got {config.max_tool_calling_iterations}.")
    if config.max_turns is not None and config.max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 or None, got {config.max_turns}.")
    if not 0 <= config.turn_discount <= 1:
        raise ValueError(f"turn_discount must be in [0, 1], got {config.turn_discount}.")


# --- Sampling, decoding and log-probs ----------------------------------------------------------


def check_sampling(config) -> None:
    """Group size, lengths, sampling parameters, the decoding loop and the log-prob passes."""
    if config.num_generations is None or config.num_generations < 2:
        raise ValueError(
            f"num_generations must be >= 2 (advantages are relative within a group), got {config.num_generations}."
        )
    if config.max_completion_length is None or config.max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {config.max_completion_length}.")
    if config.max_prompt_length is not None and config.max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 or None, got {config.max_prompt_length}.")
    if not config.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {config.temperature}. Sampling needs a positive temperature.")
    if not 0 < config.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {config.top_p}.")
    if config.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {config.top_k}.")
    if config.top_k == 1 or config.min_p == 1:
        setting = "top_k=1" if config.top_k == 1 else "min_p=1"
        raise ValueError(
            f"{setting} keeps only the likeliest token: every completion of a group would be the same, so no group "
            "has a reward spread to learn from. Use top_k=0 (off) or >= 2, or a min_p below 1."
        )
    if config.decode_loop not in DECODE_LOOPS:
        raise ValueError(f"decode_loop must be one of {DECODE_LOOPS}, got {config.decode_loop!r}.")
    if config.cpu_decoding_kernels not in CPU_DECODING_KERNELS:
        raise ValueError(f"cpu_decoding_kernels must be 'auto', 'on' or 'off', got {config.cpu_decoding_kernels!r}.")
    if config.decode_max_rows is not None and config.decode_max_rows < 1:
        raise ValueError(f"decode_max_rows must be >= 1 or None (automatic), got {config.decode_max_rows}.")
    if config.decode_logprobs_as_old and (config.decode_loop != "gspo" or config.use_vllm):
        raise ValueError(
            "decode_logprobs_as_old=True needs decode_loop='gspo' and use_vllm=False (the log-probs "
            "come from gspo-trl's decoding loop); with use_vllm=True, vllm_logprobs_as_old=True takes "
            "the server's."
        )
    if config.min_p is not None and not 0 <= config.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] or None, got {config.min_p}.")
    if not config.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {config.repetition_penalty}.")
    if config.max_tokens_per_pass is not None and config.max_tokens_per_pass < 0:
        raise ValueError(f"max_tokens_per_pass must be >= 0 (0: no limit) or None, got {config.max_tokens_per_pass}.")
    if config.check_logprobs not in CHECK_LOGPROBS_OPTIONS:
        raise ValueError(f"check_logprobs must be one of {CHECK_LOGPROBS_OPTIONS}, got {config.check_logprobs!r}.")
    if config.logprob_chunk_size < 1:
        raise ValueError(f"logprob_chunk_size must be >= 1, got {config.logprob_chunk_size}.")
    kept_mb = config.logprob_kept_logits_mb
    if isinstance(kept_mb, bool) or not isinstance(kept_mb, (int, float)):
        raise TypeError(f"logprob_kept_logits_mb must be a number of MiB, got {kept_mb!r}.")
    if not kept_mb >= 0:
        raise ValueError(f"logprob_kept_logits_mb must be >= 0 (MiB; 0 recomputes every chunk), got {kept_mb}.")
    if not isinstance(config.activation_checkpointing_keep_attention, bool):
        raise TypeError(
            f"activation_checkpointing_keep_attention must be True or False, got "
            f"{config.activation_checkpointing_keep_attention!r}."
        )
    check_generation_kwargs(config)
    eval_group = config.num_generations_eval
    if eval_group is not None and (isinstance(eval_group, bool) or not isinstance(eval_group, int) or eval_group < 1):
        raise ValueError(f"num_generations_eval must be an int >= 1 or None (num_generations), got {eval_group!r}.")
    eval_group = eval_group or config.num_generations
    if config.eval_strategy != "no" and config.per_device_eval_batch_size * config.world_size % eval_group:
        name = "num_generations_eval" if config.num_generations_eval else "num_generations"
        raise ValueError(
            f"per_device_eval_batch_size × num_processes ({config.per_device_eval_batch_size} × {config.world_size}) "
            f"must be a multiple of {name} ({eval_group}) so eval groups are whole."
        )
    if config.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size is not supported: shrinking the batch would split a prompt's group of "
            "num_generations completions. Lower per_device_train_batch_size instead."
        )


def check_dynamic_sampling(config) -> None:
    """Dynamic sampling's bound, and the advantages it cannot recompute over the rollout it keeps."""
    rounds = config.dynamic_sampling_max_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"dynamic_sampling_max_rounds must be an int >= 1 (the first round included), got {rounds!r}.")
    if not config.dynamic_sampling:
        return
    if config.multi_objective_aggregation == "normalize_then_sum":
        raise ValueError(
            "dynamic_sampling=True keeps the groups whose total reward varies, while "
            "multi_objective_aggregation='normalize_then_sum' (GDPO) scores each reward function apart and scales "
            "over the whole batch: use multi_objective_aggregation='sum_then_normalize' or dynamic_sampling=False."
        )
    if config.scale_rewards == "batch" and config.advantage_granularity == "turn":
        raise ValueError(
            "dynamic_sampling=True with scale_rewards='batch' rescales the kept rollout's advantages from each "
            "episode's return, which per-turn advantages (advantage_granularity='turn') are not made of: use "
            "scale_rewards='group' or 'none', or advantage_granularity='trajectory'."
        )
    if config.skip_rollouts_without_rewards:
        raise ValueError(
            "dynamic_sampling=True already replaces the groups no reward function scored (they have no reward "
            "spread) with new prompts, so skip_rollouts_without_rewards=True has nothing to skip: set one of them."
        )


ROUTING_REPLAYS = ("none", "old", "rollout")


def check_routing_replay(config) -> None:
    """Routing replay needs the routes gspo-trl's own decoding loop records, and forwards it can replay them in."""
    if config.routing_replay not in ROUTING_REPLAYS:
        raise ValueError(f"routing_replay must be one of {ROUTING_REPLAYS}, got {config.routing_replay!r}.")
    if config.routing_replay == "none":
        return
    needs = f"routing_replay={config.routing_replay!r} replays the experts gspo-trl's decoding loop recorded"
    if config.use_vllm:
        raise ValueError(f"{needs}; the vLLM server returns no routes. Set use_vllm=False or routing_replay='none'.")
    if config.decode_loop != "gspo":
        raise ValueError(f"{needs}; transformers' generate records none. Set decode_loop='gspo'.")
    if config.async_rollouts:
        raise ValueError(f"{needs}; async_rollouts is not available with it yet. Set async_rollouts=False.")
    if config.activation_checkpointing:
        raise ValueError(
            f"{needs} in each training forward; activation checkpointing would recompute the forward in the backward "
            "pass with the router's own choice. Set activation_checkpointing=False."
        )
    if config.padding_free:
        raise ValueError(
            f"{needs} in the padded layout of the rollout; padding_free=True packs rows in another layout. "
            "Leave padding_free=None or set it to False."
        )


# --- Generation with vLLM ----------------------------------------------------------------------


def check_vllm(config) -> None:
    """The sampling correction's settings always; the server's settings when use_vllm is on."""
    if config.vllm_importance_sampling_mode not in CORRECTION_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode must be one of {CORRECTION_MODES}, got "
            f"{config.vllm_importance_sampling_mode!r}."
        )
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if (
        (low is not None and low < 0)
        or (high is not None and high <= 0)
        or (low is not None and high is not None and low > high)
    ):
        raise ValueError(
            f"vllm_importance_sampling_clip_min/max must satisfy 0 <= min <= max and max > 0, got {low} and {high}."
        )
    if not config.use_vllm:
        if config.vllm_logprobs_as_old:
            raise ValueError("vllm_logprobs_as_old=True needs use_vllm=True (the log-probs come from the server).")
        return
    if config.vllm_mode not in ("server", "colocate"):
        raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {config.vllm_mode!r}.")
    if config.vllm_mode == "colocate":
        check_colocated_model_length(config)
        check_colocate(config)
    else:
        check_vllm_server(config)
    if (
        config.loss_type == "vespo"
        and config.vllm_importance_sampling_correction
        and config.vllm_importance_sampling_mode.startswith("sequence")
    ):
        raise ValueError(
            "loss_type='vespo' takes the sampling correction into its own sequence weight, token by "
            "token: set vllm_importance_sampling_mode to 'token_truncate' or 'token_mask' (as TRL)."
        )
    if config.layout_independent_sampling:
        raise ValueError(
            "layout_independent_sampling=True is not available with use_vllm=True: the vLLM server "
            "samples with its own random state (start it with --seed for reproducible runs)."
        )
    if config.decode_loop != "gspo" or config.cache_implementation is not None:
        logger.warning(
            "decode_loop and cache_implementation apply to sampling on the trained model; with "
            "use_vllm=True the vLLM server samples."
        )


def check_vllm_server(config) -> None:
    """The servers' addresses (one URL or several, else host and port) and token, read as the clients will use them,
    so that a malformed one fails here rather than after vllm_server_timeout seconds of waiting for an answer."""
    if config.vllm_server_base_url is not None:
        servers = len(check_base_urls(config.vllm_server_base_url))
        last_port = config.vllm_group_port + servers - 1
        if config.vllm_group_port and servers > 1 and last_port > 65535:
            raise ValueError(
                f"vllm_group_port={config.vllm_group_port} with {servers} servers: the i-th server's workers join at "
                f"vllm_group_port + i, up to {last_port}, past 65535. Choose a lower port, or 0 for free ones."
            )
    else:
        base_url(config.vllm_server_host, config.vllm_server_port)
    resolve_token(config.vllm_server_token)  # the field, else $GSPO_TRL_VLLM_TOKEN: a header must carry it


def check_colocated_model_length(config) -> None:
    """A colocated engine's context length holds a prompt (max_prompt_length, or one token) and its completion."""
    length, budget = config.vllm_max_model_length, (config.max_prompt_length or 1) + config.max_completion_length
    if length is not None and budget > length:
        raise ValueError(
            f"vllm_max_model_length={length} holds fewer than the {budget} tokens of a prompt (max_prompt_length="
            f"{config.max_prompt_length}, at least 1) and its completion (max_completion_length="
            f"{config.max_completion_length}): the engine would refuse those requests. Raise it, or leave it None."
        )


def check_colocate(config) -> None:
    """A colocated engine's layout; sleep mode, which vLLM offers on GPUs only."""
    if config.vllm_tensor_parallel_size < 1 or config.world_size % config.vllm_tensor_parallel_size:
        raise ValueError(
            f"vllm_tensor_parallel_size ({config.vllm_tensor_parallel_size}) must divide the number of training "
            f"processes ({config.world_size}): each group of that many processes drives one colocated engine."
        )
    if not 0 < config.vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1], got {config.vllm_gpu_memory_utilization}.")
    if config.vllm_tensor_parallel_size > 1 and config.async_rollouts:
        raise ValueError(
            "async_rollouts=True with vllm_tensor_parallel_size > 1: the engine's group collectives would run on the "
            "sampling thread beside training's own. Set vllm_tensor_parallel_size=1 or async_rollouts=False."
        )
    on_cpu = config.use_cpu or not torch.cuda.is_available()
    if config.vllm_enable_sleep_mode and on_cpu:
        raise ValueError(
            "vllm_enable_sleep_mode=True needs a GPU: vLLM's sleep mode offloads GPU memory and is not supported on "
            "CPU (its weights and KV cache stay in host memory anyway). Set vllm_enable_sleep_mode=False here."
        )


def check_vllm_weight_transport(config) -> None:
    """How the weights reach the vLLM server: one of the transports, chunks of a positive size."""
    transports = ("auto", "engine", "shared_dir", "http")
    if config.vllm_weight_transport not in transports:
        raise ValueError(
            f"vllm_weight_transport must be one of {transports}, got {config.vllm_weight_transport!r}: 'auto' takes "
            "vLLM's weight-transfer engine where the server has one, else the shared directory or HTTP."
        )
    if not 0 <= config.vllm_group_port < 65536:
        raise ValueError(f"vllm_group_port must be a TCP port (0 for any free one), got {config.vllm_group_port}.")
    if not config.vllm_weight_chunk_mb > 0:
        raise ValueError(f"vllm_weight_chunk_mb must be > 0 (MiB per HTTP chunk), got {config.vllm_weight_chunk_mb}.")
    if config.vllm_weight_sync_delta and config.vllm_weight_transport in ("engine", "shared_dir"):
        raise ValueError(
            f"vllm_weight_sync_delta=True sends deltas over HTTP only, but vllm_weight_transport="
            f"{config.vllm_weight_transport!r} sends whole weights. Set vllm_weight_transport='http' (or 'auto', "
            "which uses the delta when it falls back to HTTP), or vllm_weight_sync_delta=False."
        )


def check_liger(config) -> None:
    """liger-kernel's layer kernels are Triton GPU kernels, which do not run on CPU."""
    on_cpu = config.use_cpu or not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))
    if config.use_liger_kernel and on_cpu:
        raise ValueError(
            "use_liger_kernel=True needs a GPU: liger-kernel's RMSNorm, SwiGLU and RoPE kernels are Triton GPU "
            "kernels, and this run trains on CPU. Set use_liger_kernel=False here; keep it on GPU machines."
        )


def check_logging(config) -> None:
    """The Hub upload sends the tables log_completions writes."""
    if config.log_completions_hub_repo is not None and not config.log_completions:
        raise ValueError(
            "log_completions_hub_repo is set but log_completions is False: the uploaded tables are the ones "
            "log_completions writes. Set log_completions=True, or leave log_completions_hub_repo unset."
        )


# --- Batch sizes and the rollout schedule ------------------------------------------------------


# The batch fields that count rows or steps: each must be an int >= 1 (None: derived from the others).
POSITIVE_BATCH_FIELDS = (
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
)


def check_batch_fields(config) -> None:
    """A batch field of zero, a negative one or a non-int is refused by name (Trainer or torch's sampler would fail
    later with `batch_size=0`, or an optimizer step would count zero micro-batches), and so is a run of no step."""
    for name in POSITIVE_BATCH_FIELDS:
        value = getattr(config, name)
        if value is None and name in ("steps_per_generation", "generation_batch_size"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    if config.max_steps <= 0 and not config.num_train_epochs > 0:
        raise ValueError(
            f"num_train_epochs={config.num_train_epochs} with max_steps={config.max_steps} (unset) trains no step: "
            "set num_train_epochs > 0 or max_steps >= 1."
        )


def batch_sizes(config, steps_per_generation_was_set: bool) -> tuple[int, int]:
    """(steps_per_generation, generation_batch_size) from whichever of the two was set, checked against the groups: a
    rollout holds whole groups. An optimizer step need not (as in TRL): advantages are computed on the whole rollout,
    so a group whose completions fall into two optimizer steps gives each completion the same advantage."""
    global_batch = config.per_device_train_batch_size * config.world_size
    steps_per_generation, generation_batch_size = config.steps_per_generation, config.generation_batch_size
    if steps_per_generation_was_set and generation_batch_size is not None:
        raise ValueError("Set generation_batch_size or steps_per_generation, not both.")
    if generation_batch_size is not None:
        if generation_batch_size % global_batch != 0:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}) must be a multiple of "
                f"per_device_train_batch_size × num_processes ({global_batch})."
            )
        steps_per_generation = generation_batch_size // global_batch
    else:
        if steps_per_generation is None:
            steps_per_generation = PAPER_MINIBATCHES_PER_ROLLOUT * config.gradient_accumulation_steps
        if steps_per_generation < 1:
            raise ValueError(f"steps_per_generation must be >= 1, got {steps_per_generation}.")
        generation_batch_size = global_batch * steps_per_generation
    if generation_batch_size % config.num_generations != 0:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size} = per_device_train_batch_size × num_processes "
            f"× steps_per_generation) must be a multiple of num_generations ({config.num_generations}) so every "
            "prompt's group is generated whole. Adjust per_device_train_batch_size or steps_per_generation."
        )
    return steps_per_generation, generation_batch_size


def max_staleness(config) -> int | None:
    """`max_staleness` checked against async_rollouts; unset with async_rollouts, the optimizer steps per rollout."""
    if not config.async_rollouts:
        if config.max_staleness is not None:
            raise ValueError(
                f"max_staleness={config.max_staleness} only applies with async_rollouts=True; set "
                "async_rollouts=True to sample rollouts ahead, or leave max_staleness unset."
            )
        return None
    if config.steps_per_generation * config.num_iterations % config.gradient_accumulation_steps:
        raise ValueError(
            f"async_rollouts=True needs every rollout to start on an optimizer step: steps_per_generation × "
            f"num_iterations ({config.steps_per_generation} × {config.num_iterations}) must be a multiple of "
            f"gradient_accumulation_steps ({config.gradient_accumulation_steps})."
        )
    staleness = config.optimizer_steps_per_rollout if config.max_staleness is None else config.max_staleness
    if staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or None, got {staleness}.")
    if config.use_vllm and staleness > 0 and not config.vllm_logprobs_as_old:
        raise ValueError(
            "async_rollouts=True with use_vllm=True and max_staleness > 0 trains on rollouts sampled by weights "
            "that only the vLLM server still has, so π_old must be the server's log-probs: set "
            "vllm_logprobs_as_old=True (or max_staleness=0)."
        )
    return staleness
