"""The decoding loop built for RL rollouts: sample a batch of completions, finished rows leaving the batch.

Owns what happens at each decoding step: one forward of the newest token over the KV cache, the logits
processors `generate` would apply for the same sampling settings (HF's own classes, in HF's order), exact
sampling by inverse CDF (one uniform per row instead of `torch.multinomial` over the whole vocabulary),
and dropping the rows that have emitted EOS from the batch and the cache, so the remaining steps cost what
the unfinished rows need. What it does not own: prompt rendering and the EOS/truncation masks of the result
(`rollout.hf`), the prefill of shared prefixes (`prefix_sharing`), how a step's forward runs on CPU (`cpu`).

The uniforms come from the caller: `torch.rand` for ordinary sampling, or a pure function of each row's key
and position (`rollout.keyed_uniform`) for sampling that does not depend on the batch layout. On request the
loop also records each sampled token's log-prob under the model, temperature-scaled as training scores it
(`token_logps`): the behaviour policy's log-probs, which the trainer can take as π_old instead of a forward pass.
Where top-k / top-p / min-p cut the distribution, it records instead the truncated, renormalised log-probs the
tokens were drawn with and the policy's mass kept (`truncation`), whose sum is that log-prob.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ...models.moe.routing import RouteRecorder
from ...models.positions import positions_from_mask
from . import cpu, truncation
from .kv_cache import cache_kwargs

# GenerationConfig fields this loop implements. Any other field set to a non-default value (beams, n-gram
# bans, bad words, a minimum length, ...) is `generate`'s job: `supports` says so and the backend falls back.
HANDLED_FIELDS = frozenset(
    {
        "do_sample",
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "use_cache",
        "cache_implementation",
    }
)


def unsupported_settings(generation_config: GenerationConfig) -> list[str]:
    """The settings of `generation_config` that change sampling and that this loop does not implement (empty
    when it implements them all): greedy decoding, a `cache_implementation`, or any field outside
    `HANDLED_FIELDS` set to a non-default value."""
    unsupported = [] if generation_config.do_sample else ["do_sample=False"]
    if generation_config.cache_implementation is not None:
        unsupported.append(f"cache_implementation={generation_config.cache_implementation!r}")
    changed = set(generation_config.to_diff_dict()) - {"transformers_version", "_from_model_config"}
    return unsupported + sorted(changed - HANDLED_FIELDS)


def supports(generation_config: GenerationConfig) -> bool:
    """True when every setting of `generation_config` that changes sampling is one this loop implements."""
    return not unsupported_settings(generation_config)


def logits_processors(generation_config: GenerationConfig) -> LogitsProcessorList:
    """The processors `generate` builds for these sampling settings, in its order: the repetition penalty,
    then the warpers temperature, top-k, top-p, min-p."""
    g = generation_config
    if hasattr(g, "_get_default_generation_params"):  # unset (None) fields take generate's global defaults
        g = GenerationConfig(**g.to_dict())
        g.update(**g._get_default_generation_params(), defaults_only=True)
    processors = LogitsProcessorList()
    if g.repetition_penalty is not None and g.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=g.repetition_penalty))
    if g.temperature is not None and g.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(g.temperature))
    if g.top_k is not None and g.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=g.top_k))
    if g.top_p is not None and g.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=g.top_p))
    if g.min_p is not None:
        processors.append(MinPLogitsWarper(min_p=g.min_p))
    return processors


SAMPLING_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def inverse_cdf_sample(
    scores: torch.Tensor, uniforms: torch.Tensor, block: int = SAMPLING_BLOCK, with_logps: bool = False
):
    """(N,) token ids drawn from softmax(scores) (N, V), one uniform in [0, 1) per row; with `with_logps`, also
    (N,) float32 log softmax(scores) at those tokens (the normaliser comes free from the sampling weights).

    Inverse CDF in two levels, so that no float64 pass over the whole vocabulary is needed: the weights
    w = exp(scores - max) (float32, what softmax computes before it divides) are summed per block of `block`
    tokens (float32 sums of non-negative terms, relative error below 1e-6, accumulated across blocks in float64);
    u × total picks a block by its cumulative mass, then a token inside it by the block's own float64 cumulative
    weights. Token v in block b is drawn with probability (m_b / total) × (w_v / m_b) = w_v / total, up to float
    rounding; a token of weight 0 (score -inf) never is.
    """
    n, vocab = scores.shape
    scores = scores.float()
    maxes = scores.amax(dim=-1, keepdim=True)  # (N, 1)
    weights = (scores - maxes).exp_()  # (N, V), -inf -> 0
    padding = -vocab % block
    if padding:
        weights = torch.nn.functional.pad(weights, (0, padding))
    blocks = weights.view(n, -1, block)  # (N, B, block)
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)  # (N, B)
    target = uniforms.to(torch.float64).unsqueeze(1) * block_cdf[:, -1:]  # (N, 1), in [0, total)
    chosen = torch.searchsorted(block_cdf, target, right=True).clamp(max=blocks.shape[1] - 1)  # (N, 1)
    below = torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, chosen.unsqueeze(-1).expand(n, 1, block)).squeeze(1)  # (N, block)
    offset = torch.searchsorted(inner.to(torch.float64).cumsum(dim=-1), target - below, right=True)  # (N, 1)
    # Rounding can push the target past the block's last positive weight: take that token then.
    last_positive = torch.where(inner > 0, torch.arange(block, device=inner.device), -1).amax(dim=-1, keepdim=True)
    offset = torch.minimum(offset, last_positive)
    tokens = (chosen * block + offset).squeeze(1)
    if not with_logps:
        return tokens
    # log softmax = score - max - log Σ exp(score - max), the sum being the sampling weights' total.
    logps = (scores.gather(1, tokens.unsqueeze(1)) - maxes).squeeze(1).double() - block_cdf[:, -1].log()
    return tokens, logps.float()


# Positions a preallocated layer has room for beyond the prompt before its first growth.
INITIAL_ROOM = 64


class PreallocatedLayer(DynamicLayer):
    """A dynamic KV-cache layer whose keys and values live in buffers with room ahead: each step writes its
    token in place instead of concatenating (copying) the whole cache, as `DynamicLayer` does. A full buffer
    doubles, up to `capacity` (the rollout's longest possible row), so a rollout whose completions end early
    never holds the cache of the longest one it could have sampled: the buffers stay within twice what is filled
    and the growth copies cost O(1) per token, amortised. `keys`/`values` are views of the filled part, so
    attention sees exactly what a `DynamicLayer` holds."""

    @classmethod
    def from_layer(cls, layer: DynamicLayer, capacity: int) -> PreallocatedLayer:
        new = cls()
        # The dtype from the keys: transformers 5.24 dropped `DynamicLayer.dtype`.
        new.dtype, new.device, new.is_initialized = layer.keys.dtype, layer.keys.device, True
        length = layer.keys.shape[-2]
        new.capacity = max(capacity, length)
        new.key_buffer, new.value_buffer = layer.keys, layer.values
        new.length = length
        new._grow(min(new.capacity, length + INITIAL_ROOM))
        return new

    def _grow(self, size: int) -> None:
        n, heads, _, dim = self.key_buffer.shape
        keys = self.key_buffer.new_empty((n, heads, size, dim))
        values = self.value_buffer.new_empty((n, heads, size, self.value_buffer.shape[-1]))
        keys[:, :, : self.length] = self.key_buffer[:, :, : self.length]
        values[:, :, : self.length] = self.value_buffer[:, :, : self.length]
        self.key_buffer, self.value_buffer = keys, values
        self._expose(self.length)

    def _expose(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.length
        keys, values = self.advance(key_states.shape[-2])
        keys[:, :, start:] = key_states
        values[:, :, start:] = value_states
        return keys, values

    def advance(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` more positions exposed (grown into if the buffers are full), not yet written: the caller
        writes them (`keys[:, :, -positions:]`, as `cpu.forward`'s steps do) before anything reads them. Returns
        `keys`, `values`."""
        end = self.length + positions
        if end > self.key_buffer.shape[-2]:  # beyond `capacity` too if asked: grow like DynamicLayer would
            self._grow(max(end, min(self.capacity, 2 * self.key_buffer.shape[-2])))
        self._expose(end)
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.key_buffer = self.key_buffer.index_select(0, beam_idx.to(self.key_buffer.device))
        self.value_buffer = self.value_buffer.index_select(0, beam_idx.to(self.value_buffer.device))
        self._expose(self.length)

    def fill_holes(self, holes: torch.Tensor, movers: torch.Tensor, rows: int) -> None:
        """Keep the first `rows` batch rows, after copying the filled cache of the rows `movers` into the rows
        `holes`, in place. Only the moved rows are copied; `reorder_cache` would copy every kept row's buffer."""
        if len(holes):
            self.key_buffer[holes, :, : self.length] = self.key_buffer[movers, :, : self.length]
            self.value_buffer[holes, :, : self.length] = self.value_buffer[movers, :, : self.length]
        self.key_buffer, self.value_buffer = self.key_buffer[:rows], self.value_buffer[:rows]
        self._expose(self.length)


def drop_rows(cache: DynamicCache, finished: torch.Tensor) -> torch.Tensor:
    """Remove the `finished` (n,) rows from the batch of `cache`; returns the old batch index of each remaining
    row, in the new batch order. Each remaining row beyond the new batch size moves into the slot of a finished
    row before it, so a step where m rows end copies the cache of at most m rows (preallocated layers), not of
    every remaining row."""
    live = ~finished
    rows = int(live.sum())
    keep = torch.arange(rows, device=finished.device)
    holes = finished[:rows].nonzero().squeeze(1)
    movers = live[rows:].nonzero().squeeze(1) + rows
    keep[holes] = movers
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.fill_holes(holes, movers, rows)
        else:
            layer.reorder_cache(keep)
    return keep


def preallocate(cache: DynamicCache, capacity: int) -> None:
    """Swap every plain `DynamicLayer` of `cache` (filled) for a `PreallocatedLayer` of up to `capacity` positions.
    Other layer types (sliding windows, linear attention, ...) keep their own update."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[index] = PreallocatedLayer.from_layer(layer, capacity)


UniformSource = Callable[[torch.Tensor, int], torch.Tensor]  # (rows (n,) original indices, position) -> (n,)


@dataclass
class Decoded:
    """What a decoding loop returns for N prompt rows."""

    completion_ids: torch.Tensor  # (N, C) the sampled tokens, `pad_token_id` after a row's first EOS
    logps: torch.Tensor | None = None  # (N, C) float32 `token_logps` of those tokens (0 after a row's end), on request
    states: list[RowState | None] | None = None  # with `keep_states`: each row's kept cache, None without an EOS
    # (N, C) float32 log of the mass top-k / top-p / min-p kept at each token (0 after a row's end), where `logps`
    # were recorded and the processors truncate; `logps` are then the truncated, renormalised ones (`truncation`).
    kept_log_mass: torch.Tensor | None = None
    # With a `route_recorder` (Mixture-of-Experts): (N, C, L, k) the experts of the forward that sampled each token
    # (`moe.replay.rollout_routes` says which position that is), -1 after a row's end; and (N, P, L, k) the
    # prompt's, where the loop prefilled the prompts itself (no `cache` given), else None.
    step_routes: torch.Tensor | None = None
    prompt_routes: torch.Tensor | None = None


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n,) float32 log softmax(logits / temperature) at `tokens`: the log-prob of each sampled token under the
    model's temperature-scaled distribution, as `logprobs.completion_logprobs` scores it in training (the other
    logits processors, top-k / top-p / repetition penalty, shape sampling, not the policy's log-probs)."""
    scaled = logits.float() / temperature
    return scaled.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(scaled, dim=-1)


def only_scales(processors: LogitsProcessorList, temperature: float) -> bool:
    """Whether `processors` turn logits into exactly logits / `temperature` (none at 1.0, or temperature alone):
    then the scores sampled from are the ones `token_logps` normalises."""
    if not processors:
        return temperature == 1.0
    return (
        len(processors) == 1
        and type(processors[0]) is TemperatureLogitsWarper
        and processors[0].temperature == temperature
    )


def draw(
    scores: torch.Tensor,
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    logp_temperature: float | None,
    scores_are_scaled_logits: bool,
    truncated_at: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One decoding step's (n,) tokens, drawn from softmax(scores), and with `logp_temperature` their `token_logps`
    (None without): taken from the sampling weights when the scores are the logits / that temperature
    (`only_scales`), otherwise by a pass over `logits`. `truncated_at`: where the processors truncate (top-k, top-p,
    min-p), the policy's temperature; then the third value is each row's kept log-mass under softmax(logits /
    `truncated_at`) (`truncation.kept_log_mass`) and the log-probs are the truncated, renormalised ones the tokens
    were drawn with. None: nothing is cut, and the third value is None."""
    if scores_are_scaled_logits:
        return *inverse_cdf_sample(scores, uniforms, with_logps=True), None
    tokens = inverse_cdf_sample(scores, uniforms)
    log_mass = None if truncated_at is None else truncation.kept_log_mass(logits.float() / truncated_at, scores)
    if logp_temperature is None:
        return tokens, None, log_mass
    logps = token_logps(logits, tokens, logp_temperature)
    return tokens, logps if log_mass is None else truncation.truncated_logps(logps, log_mass), log_mass


def random_uniforms(rows: torch.Tensor, position: int) -> torch.Tensor:
    return torch.rand(rows.shape[0], dtype=torch.float64, device=rows.device)


@torch.no_grad()
def sample(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    processors: LogitsProcessorList,
    uniforms: UniformSource = random_uniforms,
    cache: DynamicCache | None = None,
    history: torch.Tensor | None = None,
    keep_states: bool = False,
    logp_temperature: float | None = None,
    cpu_kernels: cpu.CPUKernels | None = cpu.ALL,
    route_recorder: RouteRecorder | None = None,
) -> Decoded:
    """Sample up to `max_new_tokens` tokens after each left-padded prompt row; returns the (N, C) completion ids,
    `pad_token_id` after a row's first EOS, C the longest completion, and with `logp_temperature` each sampled
    token's `token_logps` at that temperature.

    `cache`, when given, holds every prompt token but the last (`prefix_sharing`); otherwise the first step
    prefills the prompts. The prompt rows may have gaps (mask 0) anywhere: position ids follow the mask.
    `history`: the token ids the logits processors see before the completion (default `prompt_ids`; the
    left-padded prompts when `prompt_ids` has gaps). Each step runs the model on the unfinished rows only: a row
    that samples an EOS leaves the batch, its KV cache rows with it. With `keep_states`, the cache of each row
    that ended with an EOS is kept as its `RowState` (its prompt and completion, the EOS excepted: the EOS is
    sampled, never run through the model) and returned with the completions, None for rows without an EOS.
    `cpu_kernels`: the accelerations of the steps on CPU (`cpu.CPUKernels`; None: PyTorch's operators throughout).
    `route_recorder`: record the experts of each token run (`Decoded.step_routes`, `Decoded.prompt_routes`).
    """
    n, prompt_length = prompt_ids.shape
    device = prompt_ids.device
    completions = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    eos = torch.tensor(eos_token_ids, device=device)
    rows = torch.arange(n, device=device)  # the original row of each live batch row
    sequences = prompt_ids if history is None else history  # (n, P' + t): what the processors see
    attention = prompt_mask  # (n, P + t)
    positions = positions_from_mask(prompt_mask)
    if cache is None:
        cache, step_ids, step_positions = DynamicCache(config=model.config), prompt_ids, positions
    else:
        step_ids, step_positions = prompt_ids[:, -1:], positions[:, -1:]
    states: list[RowState | None] = [None] * n
    logps = None if logp_temperature is None else torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    scores_are_scaled_logits = logp_temperature is not None and only_scales(processors, logp_temperature)
    truncated_at = truncation.truncated_at(processors, logp_temperature)
    log_mass = None if truncated_at is None else torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    length = 0
    routes = _RoutesOfRows(route_recorder, n, max_new_tokens) if route_recorder is not None else None
    recording = route_recorder.recording() if route_recorder is not None else contextlib.nullcontext()
    with cpu.accelerate(model, cpu_kernels) as step_forward, recording:  # None: the model's own forward every step
        for t in range(max_new_tokens):
            if t and step_forward is not None:
                logits = step_forward(step_ids, attention, step_positions, cache)  # (n, V)
            else:
                logits = model(
                    input_ids=step_ids,
                    attention_mask=attention,
                    position_ids=step_positions,
                    **cache_kwargs(model, cache),
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1, :]
            if routes is not None:
                routes.note(rows, t, step_ids.shape[1])
            if t == 0:  # the cache now holds every prompt token: give it room for the completions
                preallocate(cache, prompt_length + max_new_tokens)
                if not all(type(layer) is PreallocatedLayer for layer in cache.layers):
                    step_forward = None
            scores = processors(sequences, logits.float())
            tokens, step_logps, step_mass = draw(
                scores, logits, uniforms(rows, t), logp_temperature, scores_are_scaled_logits, truncated_at
            )
            if logps is not None:
                logps[rows, t] = step_logps
            if log_mass is not None:
                log_mass[rows, t] = step_mass
            completions[rows, t] = tokens
            length = t + 1
            sequences = torch.cat([sequences, tokens.unsqueeze(1)], dim=1)
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
            step_ids, step_positions = tokens.unsqueeze(1), step_positions[:, -1:] + 1
            finished = torch.isin(tokens, eos)  # (n,)
            if bool(finished.any()):
                if keep_states and keeps_states(cache.layers):
                    ended = finished.nonzero().squeeze(1)
                    for row, state in zip(rows[ended].tolist(), row_states(cache, ended, attention[:, :-1])):
                        states[row] = state
                if bool(finished.all()):
                    break
                keep = drop_rows(cache, finished)
                rows, sequences, attention = rows[keep], sequences[keep], attention[keep]
                step_ids, step_positions = step_ids[keep], step_positions[keep]
    return Decoded(
        completions[:, :length],
        None if logps is None else logps[:, :length],
        states if keep_states else None,
        None if log_mass is None else log_mass[:, :length],
        None if routes is None else routes.steps[:, :length],
        None if routes is None else routes.prompt,
    )


class _RoutesOfRows:
    """The experts a `RouteRecorder` saw in each step's forward, put in the rows and columns of the batch."""

    def __init__(self, recorder: RouteRecorder, rows: int, steps: int):
        self.recorder = recorder
        self.steps: torch.Tensor | None = None  # (N, steps, L, k), built at the first step (the device, k)
        self.prompt: torch.Tensor | None = None
        self.shape = (rows, steps)

    def note(self, rows: torch.Tensor, t: int, positions: int) -> None:
        """Step `t` ran `positions` positions of the live `rows` (the whole prompt at a prefill, else one)."""
        step = self.recorder.take()  # (live rows × positions, L, k)
        step = step.view(rows.shape[0], positions, *step.shape[1:])
        if self.steps is None:
            self.steps = step.new_full((*self.shape, *step.shape[2:]), -1)
        if positions > 1:
            self.prompt = step
        self.steps[rows.to(step.device), t] = step[:, -1]


@dataclass
class RowState:
    """The KV cache of one row's tokens, gaps dropped: each layer's (keys, values), (heads, length, head_dim).
    Positions are the row's own (0, 1, ...), so a later prefill can continue the row from it."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[1]


def keeps_states(layers) -> bool:
    """Whether every cache layer is a plain full-attention one whose rows can be kept and put back."""
    return bool(layers) and all(type(layer) in (DynamicLayer, PreallocatedLayer) for layer in layers)


def row_states(cache: DynamicCache, batch_rows: torch.Tensor, mask: torch.Tensor) -> list[RowState]:
    """The `RowState` of each of `batch_rows` (indices into the cache's batch); `mask` (n, L) marks the
    cache columns that hold tokens."""
    states = []
    for row in batch_rows.tolist():
        columns = mask[row].bool()
        states.append(
            RowState([(layer.keys[row][:, columns], layer.values[row][:, columns]) for layer in cache.layers])
        )
    return states
