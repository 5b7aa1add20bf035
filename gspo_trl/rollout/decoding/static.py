"""The decoding loop on a static KV cache, each model step replayed as a CUDA graph on a GPU.

On a GPU the per-step Python and kernel launches of a model's forward, not its arithmetic, set the speed of
decoding: on an H100, 64 rows of a 1.7B model, HF `generate` takes 20 ms per step and `dynamic.sample` 25 ms
where this loop's replayed graph takes 6 ms (docs/benchmarks.md, "GPU"). This module owns the static variant of the
loop: every row's keys and values live in buffers sized for the whole rollout (`StaticKVLayer`), attention reads a
window of them through a 4-D additive mask (0 where attended, the dtype's minimum elsewhere: what eager attention adds
to its scores and SDPA takes as a bias; eager attention would add a boolean one as 1s and 0s, masking nothing), and
the forward of one step is captured once per window size (a multiple of `WINDOW_BLOCK` positions) as a CUDA graph,
then replayed (`StaticDecoder`). Sampling and the logits
processors are `decoding`'s, run between replays. A finished row stays in the batch, its tokens discarded,
until at most half the rows are live; then the batch is compacted and the graphs are captured again. With
`keep_states`, the cache of each row that ended with an EOS is copied out as its `dynamic.RowState` (for the
next turn of an episode) before compaction drops the row.

Without graphs (a CPU, or `graphs=False`) the same static steps run eagerly: that is what the CPU tests compare
with `dynamic.sample`, token for token.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging

from ...models.distributed import fsdp2_modules, has_sharded_parameters
from ...models.packing import DENSE_MASKS_NEEDED, attention_mask_dtype, takes_dense_masks, uses_alibi
from ...models.positions import positions_from_mask
from . import truncation
from .dynamic import Decoded, RowState, UniformSource, draw, only_scales, random_uniforms
from .kv_cache import cache_kwargs
from .prefix_sharing import prefill

logger = logging.get_logger(__name__)

WINDOW_BLOCK = 256  # attention window granularity: one captured graph per multiple of this many positions
CHECK_EVERY = 8  # decoding steps between two looks (one device sync) at how many rows are still live
ATTENDED = 0.0  # the additive mask's value where a query attends a key; elsewhere the dtype's minimum


def unsupported_reason(model, cache: DynamicCache | None) -> str | None:
    """Why the static loop cannot decode for `model` (None when it can): it needs an attention implementation that
    applies a dense 4-D mask (`packing.takes_dense_masks`) and no ALiBi biases, plain full-attention cache layers, and
    parameters that are whole on this device. Whether the mask is applied right is checked on the first rollout, where
    the loop records its log-probs (`logprob_check`)."""
    attention = getattr(model.config, "_attn_implementation", None)
    if not takes_dense_masks(attention):
        return f"attn_implementation={attention!r} (the static loop {DENSE_MASKS_NEEDED})"
    if uses_alibi(model):
        return "ALiBi position biases (the model builds them from a 2-D padding mask, not the static loop's 4-D one)"
    if cache is None:
        return "no prefilled prompt cache"
    if any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in cache.layers):
        return "cache layers other than full attention (sliding windows, linear attention, ...)"
    if has_sharded_parameters(model):
        return "sharded parameters (DeepSpeed ZeRO-3 or FSDP)"
    if fsdp2_modules(model):  # whole for the rollout, but FSDP2's hooks would run (and be captured) in every forward
        return "FSDP2 (its forward hooks run around every step; CUDA-graph capture of them is untested)"
    return None


class StaticKVLayer(DynamicLayer):
    """A KV-cache layer on fixed buffers (rows, heads, capacity, dim): `update` writes the step's keys and
    values at `write_at`, a device tensor (so a replayed graph writes where the current step is), and returns
    the first `window` positions, whose validity the 4-D attention mask says."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, write_at: torch.Tensor):
        super().__init__()
        self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
        self.key_buffer, self.value_buffer, self.write_at = key_buffer, value_buffer, write_at
        self.set_window(key_buffer.shape[2])

    @classmethod
    def from_layer(cls, layer: DynamicLayer, capacity: int, write_at: torch.Tensor) -> StaticKVLayer:
        n, heads, length, dim = layer.keys.shape
        keys = layer.keys.new_zeros((n, heads, capacity, dim))
        values = layer.values.new_zeros((n, heads, capacity, layer.values.shape[-1]))
        keys[:, :, :length], values[:, :, :length] = layer.keys, layer.values
        return cls(keys, values, write_at)

    def set_window(self, window: int) -> None:
        self.window = window
        self.keys, self.values = self.key_buffer[:, :, :window], self.value_buffer[:, :, :window]

    def update(self, key_states, value_states, *args, **kwargs):
        # In the buffers' dtype, as `DynamicLayer`'s concatenation promotes (under autocast the prefill's keys
        # and values can be float32 and a step's values bfloat16).
        self.key_buffer.index_copy_(2, self.write_at, key_states.to(self.key_buffer.dtype))
        self.value_buffer.index_copy_(2, self.write_at, value_states.to(self.value_buffer.dtype))
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.key_buffer = self.key_buffer.index_select(0, beam_idx)
        self.value_buffer = self.value_buffer.index_select(0, beam_idx)
        self.set_window(self.window)


class StaticDecoder:
    """One model step at a time on a static cache: `logits(step_ids, positions, t)` writes position P - 1 + t
    (P the padded prompt length) and returns the (rows, V) logits of the newest token. With `graphs`, each
    window size's step is run once eagerly, captured, and replayed from then on."""

    def __init__(
        self,
        model,
        cache: DynamicCache,
        prompt_mask: torch.Tensor,
        capacity: int,
        graphs: bool,
        window_block: int = WINDOW_BLOCK,
    ):
        self.model, self.cache, self.capacity, self.window_block = model, cache, capacity, window_block
        self.prompt_length = prompt_mask.shape[1]
        device = prompt_mask.device
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)
        for index, layer in enumerate(cache.layers):
            cache.layers[index] = StaticKVLayer.from_layer(layer, capacity, self.write_at)
        # (rows, 1, 1, capacity) additive, a static buffer (replayed graphs read it): the prompt's tokens attended,
        # its padding and gaps and the completion's unwritten slots not; in the queries' dtype, as the packed mask.
        dtype = attention_mask_dtype(model)
        self.mask = torch.full(
            (prompt_mask.shape[0], 1, 1, capacity), torch.finfo(dtype).min, dtype=dtype, device=device
        )
        self.mask[:, 0, 0, : self.prompt_length].masked_fill_(prompt_mask.bool(), ATTENDED)
        self.step_ids = torch.zeros((prompt_mask.shape[0], 1), dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.step_ids)
        self.graphs = graphs
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _forward(self, window: int) -> torch.Tensor:
        for layer in self.cache.layers:
            layer.set_window(window)
        out = self.model(
            input_ids=self.step_ids,
            attention_mask=self.mask[:, :, :, :window],
            position_ids=self.positions,
            **cache_kwargs(self.model, self.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def logits(self, step_ids: torch.Tensor, positions: torch.Tensor, t: int) -> torch.Tensor:
        write = self.prompt_length - 1 + t
        self.mask[:, 0, 0, write] = ATTENDED
        self.write_at.fill_(write)
        self.step_ids.copy_(step_ids)
        self.positions.copy_(positions)
        window = min(self.capacity, -(-(write + 1) // self.window_block) * self.window_block)
        if not self.graphs:
            return self._forward(window)
        if window in self.captured:
            graph, logits = self.captured[window]
            graph.replay()
            return logits
        logits = self._forward(window).clone()  # this step, run eagerly; later steps of this window replay
        self._capture(window)
        return logits

    def _capture(self, window: int) -> None:
        graph = torch.cuda.CUDAGraph()
        # Autocast must not cache casts across the capture: they would live in the graph's memory pool.
        autocast = torch.autocast(
            "cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,
        )
        try:
            with autocast, torch.cuda.graph(graph, pool=self.pool):
                output = self._forward(window)
        except RuntimeError as error:  # something in the forward cannot be captured: decode eagerly from here
            logger.warning(f"CUDA graph capture of the decoding step failed ({error}); decoding without graphs.")
            self.graphs = False
            return
        self.pool = graph.pool()
        self.captured[window] = (graph, output)

    def row_states(self, batch_rows: list[int], lengths: list[int]) -> list[RowState]:
        """The `RowState` of each of `batch_rows` whose completion has `lengths` tokens, its EOS the last: the
        prompt's cache columns and those of the completion but the EOS (sampled, never run through the model)."""
        states = []
        for row, length in zip(batch_rows, lengths):
            columns = torch.cat(
                [
                    (self.mask[row, 0, 0, : self.prompt_length] == ATTENDED).nonzero().squeeze(1),
                    torch.arange(self.prompt_length, self.prompt_length + length - 1, device=self.mask.device),
                ]
            )
            states.append(
                RowState(
                    [
                        (layer.key_buffer[row][:, columns], layer.value_buffer[row][:, columns])
                        for layer in self.cache.layers
                    ]
                )
            )
        return states

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (the live ones); graphs are captured again for the new batch size."""
        self.cache.reorder_cache(rows)
        self.mask, self.step_ids, self.positions = self.mask[rows], self.step_ids[rows], self.positions[rows]
        self.captured.clear()
        self.pool = None


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
    cache: DynamicCache | None = None,
    uniforms: UniformSource = random_uniforms,
    history: torch.Tensor | None = None,
    graphs: bool = True,
    window_block: int = WINDOW_BLOCK,
    check_every: int = CHECK_EVERY,
    keep_states: bool = False,
    logp_temperature: float | None = None,
    route_recorder=None,  # taken for `dynamic.sample`'s signature; graph replays run no hooks: no routes recorded
) -> Decoded:
    """`dynamic.sample` on a static cache: (N, C) completion ids after each left-padded prompt row, the
    `pad_token_id` after a row's first EOS, C the longest completion (and with `logp_temperature` their
    log-probs, as `dynamic.sample` records them). `cache` holds every prompt token but the
    last (`prefix_sharing`; prefilled here when None) and becomes the static cache. The prompt rows
    may have gaps (mask 0): position ids follow the mask. `history`: the token ids the logits processors see
    before the completion (default `prompt_ids`), as in `dynamic.sample`. With `keep_states`, also the
    `RowState` of each row that ended with an EOS (None for the others), as `dynamic.sample` returns them."""
    if cache is None and (cache := prefill(model, prompt_ids, prompt_mask)) is None:
        raise ValueError(
            "decoding.static.sample needs at least two tokens in every prompt row; use decoding.dynamic.sample."
        )
    n, prompt_length = prompt_ids.shape
    device = prompt_ids.device
    decoder = StaticDecoder(model, cache, prompt_mask, prompt_length + max_new_tokens, graphs, window_block)
    completions = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)  # steps up to each row's EOS
    eos = torch.tensor(eos_token_ids, device=device)
    rows = torch.arange(n, device=device)  # the original row of each batch row
    live = torch.ones(n, dtype=torch.bool, device=device)
    states: list[RowState | None] = [None] * n
    kept = torch.zeros(n, dtype=torch.bool, device=device)  # batch rows whose state has been copied out
    logps = None if logp_temperature is None else torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)

    def copy_out_states():  # rows that ended with an EOS since the last look, before compaction drops them
        ended = (~live & ~kept).nonzero().squeeze(1)
        if keep_states and len(ended):
            originals = rows[ended].tolist()
            for row, state in zip(originals, decoder.row_states(ended.tolist(), lengths[originals].tolist())):
                states[row] = state
        kept.logical_or_(~live)

    history = prompt_ids if history is None else history
    sequences = torch.cat([history, completions], dim=1)  # what the processors see: sequences[:, :H + t]
    step_ids, positions = prompt_ids[:, -1:], positions_from_mask(prompt_mask)[:, -1:]
    scores_are_scaled_logits = logp_temperature is not None and only_scales(processors, logp_temperature)
    truncated_at = truncation.truncated_at(processors, logp_temperature)
    log_mass = None if truncated_at is None else torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    for t in range(max_new_tokens):
        logits = decoder.logits(step_ids, positions, t)
        scores = processors(sequences[:, : history.shape[1] + t], logits.float())
        # A finished row's draw is replaced by the pad token, its log-prob dropped below.
        tokens, step_logps, step_mass = draw(
            scores, logits, uniforms(rows, t), logp_temperature, scores_are_scaled_logits, truncated_at
        )
        if logps is not None:
            logps[rows, t] = step_logps
        if log_mass is not None:
            log_mass[rows, t] = step_mass
        tokens = tokens.masked_fill(~live, pad_token_id)
        completions[rows, t] = tokens
        sequences[:, history.shape[1] + t] = tokens
        finished = live & torch.isin(tokens, eos)
        lengths[rows] = torch.where(finished, t + 1, lengths[rows])
        live = live & ~finished
        step_ids, positions = tokens.unsqueeze(1), positions + 1
        if (t + 1) % check_every == 0:
            copy_out_states()
            still = int(live.sum())
            if still == 0:
                break
            if still <= live.shape[0] // 2:
                keep = live.nonzero().squeeze(1)
                decoder.keep(keep)
                rows, live, sequences, kept = rows[keep], live[keep], sequences[keep], kept[keep]
                step_ids, positions = step_ids[keep], positions[keep]
    copy_out_states()
    width = int(lengths.max())
    ended = torch.arange(width, device=device) >= lengths.unsqueeze(1)  # (N, width): after a row's EOS
    if logps is not None:  # rows that had ended drew pad tokens afterwards: no log-prob there
        logps = logps[:, :width].masked_fill(ended, 0.0)
    if log_mass is not None:
        log_mass = log_mass[:, :width].masked_fill(ended, 0.0)
    return Decoded(completions[:, :width], logps, states if keep_states else None, log_mass)
