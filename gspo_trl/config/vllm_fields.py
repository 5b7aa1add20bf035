"""The vLLM fields of `GSPOConfig`: sampling on a vLLM server or a colocated engine, and the mismatch correction,
with TRL's names.

A mixin dataclass that `GSPOConfig` inherits; its checks are `config_checks.check_vllm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VLLMFields:
    """`GSPOConfig`'s fields for generation with vLLM (see docs/vllm.md)."""

    # --- Generation with vLLM (TRL's names) --------------------------------------------------
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Sample completions with vLLM (a server, or an engine in each training process: vllm_mode) "
            "instead of the trained model; it gets the trained weights before each rollout whose weights changed. "
            "See docs/vllm.md#set-up."
        },
    )
    vllm_mode: str = field(
        default="server",
        metadata={
            "help": "'server': a vLLM server started with `gspo-trl vllm-serve MODEL` (the default here); "
            "'colocate' (TRL's default): a vLLM engine in each training process. See docs/vllm.md#colocated-vllm."
        },
    )
    vllm_server_base_url: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Base URL of the vLLM server (e.g. 'http://127.0.0.1:8000'), overriding host and port; or several "
            "servers, as a list or comma-separated, which share every rollout and each get every sync. See "
            "docs/vllm.md#several-servers."
        },
    )
    vllm_server_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "Host of the vLLM server when vllm_server_base_url is unset (TRL's default is 0.0.0.0); one "
            "server only, several go in vllm_server_base_url."
        },
    )
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the vLLM server."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait for the vLLM server to answer /health at start before failing."},
    )
    vllm_server_token: str | None = field(
        default=None,
        metadata={
            "help": "The vLLM server's token, sent as `Authorization: Bearer` on every request; None: the "
            "GSPO_TRL_VLLM_TOKEN environment variable, where `gspo-trl vllm-serve` reads it too (preferred: a value "
            "set here is saved in checkpoints' training_args.bin). See docs/vllm.md#the-servers-token."
        },
    )
    vllm_weight_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory the trainer writes weight snapshots to and the server reloads them from; None: a "
            "temporary directory in /dev/shm, for a server on this machine. See "
            "docs/vllm.md#the-weights-on-their-way-to-the-server."
        },
    )
    vllm_weight_transport: str = field(
        default="auto",
        metadata={
            "help": "How weights reach the server: 'engine' (vLLM's weight-transfer engine: one broadcast over gloo, "
            "or NCCL on GPUs), 'shared_dir' (a snapshot in vllm_weight_sync_dir), 'http' (chunks through the "
            "server's HTTP endpoint), or 'auto': the engine where the server has one, else 'shared_dir' if the "
            "server sees the directory, else 'http'. See docs/vllm.md#the-weights-on-their-way-to-the-server."
        },
    )
    vllm_weight_chunk_mb: float = field(
        default=64,
        metadata={
            "help": "With the HTTP transport, the most MiB of weights in one request (a layer larger than that goes "
            "alone). The trainer holds about two chunks at a time, the server about ten; see "
            "docs/vllm.md#several-hosts."
        },
    )
    vllm_weight_sync_delta: bool = field(
        default=False,
        metadata={
            "help": "With the HTTP transport, send only the elements whose bits changed since the last sync (exact); "
            "both sides keep a copy of the weights in the sent dtype. Pays with bf16 weights on a slow link; see "
            "docs/vllm.md#sending-only-what-changed."
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
        default=0,
        metadata={
            "help": "The port this trainer opens for the server's workers to join its weight-transfer group (the "
            "'engine' transport; TRL's NCCL port, 51216 there; with several servers, the next ports for the next "
            "servers); 0: any free port."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Colocate mode: the share of GPU memory (on CPU, of the machine's memory) the engine may use for "
            "weights and KV cache; for a server, pass it when starting the server."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Colocate mode: how many training processes share one engine, split tensor-parallel (it must "
            "divide the number of processes); for a server, pass it when starting the server."
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Colocate mode on GPUs: offload the engine's weights and free its KV cache while training, and "
            "wake it before sampling (vLLM has no sleep mode on CPU)."
        },
    )
    vllm_model_impl: str = field(
        default="vllm", metadata={"help": "Colocate mode: the engine's model implementation, 'vllm' or 'transformers'."}
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Colocate mode: the engine's context length; None: max_prompt_length + max_completion_length, or "
            "the model's own without max_prompt_length. For a server, pass --max-model-len."
        },
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
