"""The log-prob check: before training, the first rollout's log-probs are compared with the model's own.

Every path that scores completions lays rows out otherwise than the model sees one row alone: padded rows (left
padding, position ids from the mask), packed rows (a block-tree mask, positions restarting per completion), the
decoding loop that records log-probs as it samples (a KV cache; the static loop's 4-D mask over fixed buffers). A
layout a model does not read right costs nats per token and raises nothing: GPT-2's padded rows were scored at
positions counted from the first pad, eager attention added the static loop's boolean mask as 1s and 0s and masked
nothing, and the importance ratios of the first step were far from 1. On a few rows of the first training rollout,
`check_first_rollout` compares the path training scores with (padded or packed rows) and the decoding loop's recorded
log-probs, where it recorded them, with a plain forward of each row alone, unpadded
(`model(input_ids=row).logits`, log-softmax at the sampling temperature). A disagreement raises a ValueError or,
with `check_logprobs="warn"`, warns and falls back to the safer path: packed rows to padded rows, the static loop to
the dynamic one, the dynamic loop to transformers' `generate` (the rollout's recorded log-probs then get a π_old
forward). Padded rows are the safe path: a disagreement there always raises.

Owns when it runs too: once, on the first training rollout (`FirstRolloutCheck`). What it does not own: the paths
(`logprobs`, `decoding.dynamic`, `decoding.static`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..models.distributed import has_sharded_parameters, unwrap_model
from ..models.multimodal import is_vision_config
from ..models.precision import precision_context
from ..rollout.decoding.truncation import policy_logps
from .logprobs import completion_logprobs
from .micro_batch import MicroBatch

logger = logging.get_logger(__name__)

CHECKED_ROWS = 4  # rows of the first rollout compared, one plain forward each
CHECKED_TOKENS = 128  # completion tokens per row compared (the plain forward keeps logits for these only)


@dataclass(frozen=True)
class Tolerance:
    """What a path may differ from the plain forward by: |Δ log p| ≤ atol + rtol · |log p| nats on every token, and
    the mean |Δ log p| of a row's tokens (the size of its sequence log-ratio, GSPO's ratio) ≤ row_mean nats."""

    atol: float
    rtol: float
    row_mean: float
    precision: str
    tokens_decide: bool = True  # False: tokens beyond the per-token bound are counted and reported, rows decide

    def describe(self) -> str:
        tokens = f"{self.atol:g} + {self.rtol:g}·|log p| per token"
        if not self.tokens_decide:
            tokens += " (reported only)"
        return f"{tokens}, {self.row_mean:g} on a row's mean ({self.precision})"


# Float32: two forwards of one row in different layouts (padded, packed, another batch size, a KV cache, SDPA's kernel
# or eager's) differ by summation order only: ≤ 6e-6 nats per token measured on the tiny test models (Llama, GPT-2;
# padded, packed, the decoding loop). The bound is over 100 times that and 900 times below the broken paths' ≥ 0.9
# nats.
FLOAT32 = Tolerance(atol=1e-3, rtol=1e-3, row_mean=1e-3, precision="float32")
# bf16/fp16 autocast, half weights, or float32 products in TF32: each layout rounds its products to 8 (bf16) or 11
# bits, so logits of size |z| ≈ 10-30 differ by ~2^-8·|z|, a few tenths of a nat, between two layouts on an unlucky
# token, and a few hundredths on a row's mean (measured on the tiny models with weights of std 0.2: ≤ 0.04 nats per
# token, ≤ 0.03·|log p|, ≤ 0.01 on a row's mean). On a large model (dozens of layers, logits of size 30) a single
# token of a correct layout can exceed any per-token bound that would still flag a broken token, so in half precision
# only a row's mean decides: it averages the rounding (independent per token) down and keeps a layout error, which
# shifts every token of a row (padding, positions: 0.36 to 4 nats per token seen), far above 0.1.
HALF_PRECISION = Tolerance(atol=0.5, rtol=0.05, row_mean=0.1, precision="bf16/fp16", tokens_decide=False)


@dataclass
class PathReport:
    """How one path's log-probs compare with the plain forward's over the checked tokens."""

    path: str  # "padded rows", "packed rows", "static decoding loop", "dynamic decoding loop"
    max_error: float  # nats, the largest |Δ log p|
    max_row_mean: float  # nats, the largest mean |Δ log p| of a row
    tokens_off: int  # tokens beyond the per-token bound
    rows_off: int  # rows beyond the row-mean bound
    tokens: int  # tokens compared
    tokens_decide: bool = True  # whether tokens beyond the per-token bound alone make a disagreement

    @property
    def agrees(self) -> bool:
        return self.rows_off == 0 and (self.tokens_off == 0 or not self.tokens_decide)


def checked_rows(
    attention_mask: torch.Tensor, completion_mask: torch.Tensor, count: int = CHECKED_ROWS
) -> torch.Tensor:
    """(min(count, B),) the rows to check: rows with scored tokens and the most left padding first (what a layout bug
    needs to show), ties in batch order, so that completions of one prompt stay together (packed rows share them)."""
    prompt_length = attention_mask.shape[1] - completion_mask.shape[1]
    padding = (prompt_length - attention_mask[:, :prompt_length].sum(1)).tolist()
    scored = completion_mask.bool().any(1).tolist()
    order = sorted(range(len(padding)), key=lambda row: (not scored[row], -padding[row], row))
    return torch.tensor(order[:count], dtype=torch.long, device=attention_mask.device)


def plain_logprobs(
    model,
    input_ids: torch.Tensor,  # (B, P + C) left-padded prompt followed by the completion
    attention_mask: torch.Tensor,  # (B, P + C)
    completion_ids: torch.Tensor,  # (B, C)
    temperature: float,
) -> torch.Tensor:
    """(B, C) log-probs of the completion tokens from one forward per row, alone: its attended tokens, no padding, the
    model's own default positions and masks; 0 where the completion is not attended, NaN in a row without a prompt
    token (nothing predicts its first completion token)."""
    completion_length = completion_ids.shape[1]
    prompt_length = input_ids.shape[1] - completion_length
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    for row in range(input_ids.shape[0]):
        attended = attention_mask[row].bool()
        sequence = input_ids[row][attended]
        completion = attended[prompt_length:]
        n = int(completion.sum())
        if n + 1 > sequence.numel():
            logps[row] = float("nan")
            continue
        # The hidden state before each completion token predicts it: the last n + 1 positions' logits.
        logits = model(input_ids=sequence[None], logits_to_keep=n + 1, use_cache=False).logits[0, :-1].float()
        row_logps = (logits / temperature).log_softmax(-1)
        logps[row, completion] = row_logps.gather(-1, completion_ids[row][completion].unsqueeze(-1)).squeeze(-1)
    return logps


def compare(path: str, logps: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, tolerance: Tolerance):
    """The `PathReport` of (B, C) `logps` against the plain forward's `reference` on the tokens of `mask`."""
    scored = mask.bool() & ~reference.isnan()
    error = (logps.float() - reference).abs().nan_to_num().masked_fill(~scored, 0.0)  # (B, C)
    bound = tolerance.atol + tolerance.rtol * reference.abs().nan_to_num()
    row_mean = error.sum(1) / scored.sum(1).clamp(min=1)  # (B,)
    return PathReport(
        path,
        max_error=float(error.max()) if error.numel() else 0.0,
        max_row_mean=float(row_mean.max()) if row_mean.numel() else 0.0,
        tokens_off=int((error > bound).sum()),
        rows_off=int((row_mean > tolerance.row_mean).sum()),
        tokens=int(scored.sum()),
        tokens_decide=tolerance.tokens_decide,
    )


def tolerance_in_use(model) -> Tolerance:
    """`HALF_PRECISION` where this forward's products round to fewer bits than float32's: under bf16/fp16 autocast,
    with half-precision weights, or with float32 products in TF32 or bf16 (`torch.set_float32_matmul_precision`,
    `tf32`); `FLOAT32` otherwise. Call it inside the precision context the forwards run in."""
    parameters = list(unwrap_model(model).parameters())
    device = parameters[0].device.type
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in (torch.bfloat16, torch.float16)
    reduced = torch.get_float32_matmul_precision() != "highest" or (
        device == "cuda" and torch.backends.cuda.matmul.allow_tf32
    )
    # Any of them: the first is often the input embedding, float32 beside bf16 layers under cast_lm_head_to_fp32.
    half = any(parameter.dtype in (torch.bfloat16, torch.float16) for parameter in parameters)
    return HALF_PRECISION if autocast or reduced or half else FLOAT32


def check_first_rollout(
    model,
    inputs: MicroBatch,
    args,
    accelerator=None,
    *,
    padding_free: bool,
    decoding_loop: str | None,
    backends: list,
    checked_mask: torch.Tensor | None = None,
) -> bool:
    """Check the first rollout's log-probs (see the module docstring); returns `padding_free` as training goes on.

    `inputs`: the rollout's `MicroBatch`: its model inputs and, with `sampled_by_policy`, the decoding loop's recorded
    `sampling_logps` (None where none were), which a fallback sets to None.
    `args`: the `GSPOConfig` (`check_logprobs`, `temperature`, `logprob_chunk_size`). `decoding_loop`: the loop that
    recorded them (`Rollout.decoding_loop`; None where no loop did with the model's current weights); `backends`: those
    a loop fallback applies to (`RolloutBackend.avoid_loop`).
    `checked_mask`: (B, C) the tokens compared, by default `completion_mask`; the trainer passes every sampled token,
    those of truncated completions that `mask_truncated_completions` leaves out of the loss included.
    `accelerator`: training's, whose precision context the forwards run in and whose processes all fall back (or
    raise) alike; None: one process, no autocast.
    """
    option, temperature, chunk_size = args.check_logprobs, args.temperature, args.logprob_chunk_size
    if option == "off":
        return padding_free
    precision = contextlib.nullcontext if accelerator is None else lambda: precision_context(accelerator)
    agree = None
    if accelerator is not None and accelerator.num_processes > 1:

        def agree(flags: torch.Tensor) -> torch.Tensor:
            return accelerator.reduce(flags.to(accelerator.device), "max")

    config = unwrap_model(model).config
    family = f"model_type={config.model_type!r}, attn_implementation={getattr(config, '_attn_implementation', None)!r}"
    checked_mask = inputs.completion_mask if checked_mask is None else checked_mask
    rows = checked_rows(inputs.attention_mask, checked_mask)
    width = min(CHECKED_TOKENS, inputs.completion_ids.shape[1])
    keep = inputs.input_ids.shape[1] - inputs.completion_ids.shape[1] + width
    batch = (
        inputs.input_ids[rows, :keep],
        inputs.attention_mask[rows, :keep],
        inputs.completion_ids[rows, :width],
        checked_mask[rows, :width],
    )
    decoded = policy_logps(inputs.sampling_logps, inputs.kept_log_mass) if inputs.sampled_by_policy else None
    collective = agree is not None and has_sharded_parameters(model)
    was_training = unwrap_model(model).training
    model.eval()  # dropout (disable_dropout=False) would make every comparison differ
    try:
        with torch.no_grad(), precision():
            tolerance = tolerance_in_use(model)
            reference = plain_logprobs(model, batch[0], batch[1], batch[2], temperature)

            def scored_on(packed: bool) -> PathReport:
                logps = completion_logprobs(
                    model, *batch, temperature=temperature, chunk_size=chunk_size, padding_free=packed
                )
                return compare("packed rows" if packed else "padded rows", logps.logps, reference, batch[3], tolerance)

            scoring = None
            if padding_free and collective:
                # Packed rows may take a different number of forwards on each process, which ZeRO-3 and FSDP cannot run.
                logger.info("check_logprobs: packed rows are not checked under ZeRO-3 or FSDP with several processes.")
            else:
                scoring = scored_on(padding_free)
            loop = None
            if decoded is not None and decoding_loop is not None:
                loop = compare(f"{decoding_loop} decoding loop", decoded[rows, :width], reference, batch[3], tolerance)
            elif decoding_loop is not None:
                logger.info(f"check_logprobs: the {decoding_loop} decoding loop recorded no log-probs to check.")
            else:
                logger.info(
                    "check_logprobs: no log-probs of these weights recorded by gspo-trl's decoding loop; only the "
                    "scoring path is checked."
                )
            scoring_off, loop_off = _agreed(
                agree, scoring is not None and not scoring.agrees, loop is not None and not loop.agrees
            )
            padded = scoring if not padding_free else None
            if scoring_off and padding_free and option == "warn":
                logger.warning(_disagreement(scoring, tolerance, family) + " Falling back to padded rows.")
                padded = scored_on(False)
                padding_free = False
                (scoring_off,) = _agreed(agree, not padded.agrees)
            if scoring_off:
                report = padded if padded is not None else scoring
                raise ValueError(_disagreement(report, tolerance, family) + _advice(report.path))
    finally:
        model.train(was_training)
    if loop_off:
        if option == "raise":
            raise ValueError(_disagreement(loop, tolerance, family) + _advice(loop.path))
        logger.warning(_disagreement(loop, tolerance, family) + _loop_fallback(decoding_loop))
        inputs.sampling_logps = None  # π_old of this rollout: a forward on the path just checked
        for backend in backends:
            backend.avoid_loop(decoding_loop)
    for report in (scoring, loop):
        if report is not None and report.agrees:
            logger.info(
                f"check_logprobs: {report.path} agree with a plain forward within {report.max_error:.2g} nats per "
                f"token ({report.tokens} tokens of {len(rows)} rows compared)."
            )
    return padding_free


def _agreed(agree, *flags: bool) -> tuple[bool, ...]:
    if agree is None:
        return flags
    reduced = agree(torch.tensor([float(flag) for flag in flags]))
    return tuple(bool(value > 0) for value in reduced.tolist())


def _disagreement(report: PathReport, tolerance: Tolerance, family: str) -> str:
    if report.agrees:  # the verdict of another process
        return f"check_logprobs: the log-probs of the {report.path} differ from a plain forward on another process."
    return (
        f"check_logprobs: the log-probs of the {report.path} differ from a plain forward of each row alone by up to "
        f"{report.max_error:.3g} nats per token and {report.max_row_mean:.3g} on a row's mean ({report.tokens_off} of "
        f"{report.tokens} tokens, {report.rows_off} rows beyond {tolerance.describe()}) for {family}."
    )


def _advice(path: str) -> str:
    if path == "padded rows":
        return (
            " Padded rows are what every other path falls back to, so nothing is left to fall back to; please report "
            "this with the model. check_logprobs='off' trains on them anyway."
        )
    fallback = "padded rows" if path == "packed rows" else "a safer decoding loop"
    return f" check_logprobs='warn' falls back to {fallback}; 'off' trains on them anyway."


def _loop_fallback(loop: str) -> str:
    if loop == "static":
        return " Decoding without the static KV cache (and CUDA graphs) from now on."
    return " Sampling with transformers' generate from now on."


class FirstRolloutCheck:
    """`check_first_rollout` once, on the first training rollout (unless `check_logprobs="off"`)."""

    def __init__(self, args):
        self.pending = args.check_logprobs != "off"

    def run(self, model, scored: MicroBatch, sampled, args, accelerator, padding_free: bool, backends: list) -> bool:
        """`padding_free` as training goes on after the check of `scored`, the `MicroBatch` of the `SampledRollout`
        `sampled`, which `backends` sampled (a loop fallback applies to each)."""
        if not self.pending:
            return padding_free
        self.pending = False
        # A plain forward takes no images. Decided from the model, the same on every process (the check's collectives
        # would wait for a process whose prompts have images, and skip it).
        if scored.vision is not None or is_vision_config(unwrap_model(model).config):
            logger.info("check_logprobs: vision-language rollouts are not checked.")
            return padding_free
        # Sampled ahead (async_rollouts: a resumed run's first rollout can be), the recorded log-probs are those of
        # weights trained past since, not the model's: only the scoring path is checked.
        loop = sampled.rollout.decoding_loop if sampled.old_logps is None else None
        return check_first_rollout(
            model,
            scored,
            args,
            accelerator,
            padding_free=padding_free,
            decoding_loop=loop,
            backends=backends,
            checked_mask=sampled.rollout.sampled_mask,
        )
