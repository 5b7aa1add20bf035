"""Run under `torchrun --nproc_per_node 2` by test_distributed.py: gspo-trl's scoring and decoding on a model
sharded with FSDP2 (`fully_shard` over a gloo CPU mesh; accelerate enables FSDP on GPUs only, so the sharding is
applied here by hand, as a GPU run's accelerate would) against the same model whole.

Each rank scores its own rows with `completion_logprobs` (padded and packed) and back-propagates a weighted sum;
the whole model on every rank scores both ranks' rows, so the averaged gradient FSDP2 reduces can be checked.
`+reshard` also reshards the root after its forward, so the LM head is projected from a sharded (DTensor)
weight; `+head` makes the LM head a unit of its own (as accelerate's transformer-based wrapping does); `+bf16`
computes in bf16 (FSDP2's MixedPrecisionPolicy, gradients reduced in float32) against the whole model under bf16
autocast. Then `dynamic.sample` runs with layout-independent streams inside
`fsdp2_whole_weights`, counting FSDP2's all-gathers. Last, a frozen model (the reference) goes through
`prepare_frozen_model` with accelerate's FSDP2 plugin and scores without gradients. Writes <out>.rank<R>.json."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from helpers import leave_worker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from gspo_trl.models.distributed import fsdp2_modules, fsdp2_whole_weights, prepare_frozen_model
from gspo_trl.rollout import keyed_uniform, stream_keys
from gspo_trl.rollout.decoding import dynamic, static
from gspo_trl.rollout.decoding.prefix_sharing import prefill
from gspo_trl.training.logprobs import completion_logprobs

PROMPTS = [["What is 2 + 3?", "Hi there"], ["Solve: 7 - 4", "Say ok"]]  # rank r scores PROMPTS[r]


def batch(tokenizer, prompts, seed):
    """Left-padded prompts followed by random completions of different lengths (right-padded)."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    generator = torch.Generator().manual_seed(seed)
    completions = torch.randint(3, len(tokenizer) - 1, (len(prompts), 6), generator=generator)
    completion_mask = torch.ones_like(completions)
    completion_mask[0, 4:] = 0
    ids = torch.cat([encoded.input_ids, completions], dim=1)
    mask = torch.cat([encoded.attention_mask, completion_mask], dim=1)
    return ids, mask, completions, completion_mask


def score(model, rows, padding_free):
    ids, mask, completions, completion_mask = rows
    scores = completion_logprobs(
        model, ids, mask, completions, completion_mask, temperature=0.7, padding_free=padding_free
    )
    weights = torch.arange(1, completions.numel() + 1, dtype=torch.float32).view_as(completions) / 10
    return scores.logps, (scores.logps * weights * completion_mask).sum()


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main(model_dir: str, mode: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sharded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    bf16 = "+bf16" in mode
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    sharding = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for layer in sharded.model.layers:
        fully_shard(layer, **sharding)
    if "+head" in mode:  # the LM head a unit of its own, as accelerate's transformer-based wrapping makes it
        fully_shard(sharded.lm_head, **sharding)
    fully_shard(sharded, **sharding)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)  # the whole model's bf16
    if "+reshard" in mode:
        sharded.set_reshard_after_forward(True)
    result = {"rank": rank, "sharded_head": type(sharded.lm_head.weight).__name__}
    heads = []  # the LM head's weight as the model's forward leaves it, seen by a hook after FSDP2's own
    sharded.register_forward_hook(lambda module, args, output: heads.append(type(module.lm_head.weight).__name__))

    rows = [batch(tokenizer, prompts, seed) for seed, prompts in enumerate(PROMPTS)]
    for padding_free in (False, True):
        sharded.zero_grad(set_to_none=True)
        whole.zero_grad(set_to_none=True)
        logps, loss = score(sharded, rows[rank], padding_free)
        result["head_after_forward"] = heads[-1]
        loss.backward()
        whole_logps = None
        for r in range(world):  # the gradient FSDP2 averages over ranks: the mean of each rank's loss
            with autocast:
                own_logps, own_loss = score(whole, rows[r], padding_free)
            (own_loss / world).backward()
            whole_logps = own_logps if r == rank else whole_logps
        name = "packed" if padding_free else "padded"
        result[f"{name}_logp_error"] = (logps - whole_logps).abs().max().item()
        errors = {}
        for (key, p), (_, q) in zip(sharded.named_parameters(), whole.named_parameters()):
            errors[key] = (full(p.grad) - q.grad).abs().max().item() if p.grad is not None else None
        result[f"{name}_grad_errors"] = errors
        result[f"{name}_grad_scale"] = max(q.grad.abs().max().item() for q in whole.parameters())

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = tokenizer(PROMPTS[rank], return_tensors="pt", padding=True, padding_side="left")
    keys = stream_keys(7, rank, torch.arange(len(PROMPTS[rank])))

    def sample(model):
        return dynamic.sample(
            model,
            encoded.input_ids,
            encoded.attention_mask,
            max_new_tokens=12,
            eos_token_ids=[eos],
            pad_token_id=pad,
            processors=LogitsProcessorList(),
            uniforms=lambda r, t: keyed_uniform(keys[r], t, 1).squeeze(1),
        ).completion_ids

    gathers = []
    original = dist.all_gather_single

    def counting(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    dist.all_gather_single = counting
    try:
        with torch.no_grad(), autocast:
            expected = sample(whole)
            per_step = sample(sharded)
            result["gathers_per_forward"] = len(gathers)
            gathers.clear()
            with fsdp2_whole_weights(sharded):
                once = sample(sharded)
                # whole weights, yet no CUDA-graph decoding: FSDP2's hooks still run around every forward
                result["static_refusal"] = static.unsupported_reason(
                    sharded, prefill(sharded, encoded.input_ids, encoded.attention_mask)
                )
            result["gathers_whole_weights"] = len(gathers)
    finally:
        dist.all_gather_single = original
    result["steps"] = expected.shape[1]

    # A model that is only evaluated (the reference under beta > 0, a reward model), sharded by
    # prepare_frozen_model from accelerate's FSDP2 plugin as a GPU run's trainer would: block by block.
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy)
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin, deepspeed_plugin=None),
        torch_device_mesh=None,
        parallelism_config=None,
    )
    frozen = prepare_frozen_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), accelerator, scored_by_logprobs=True
    )
    result["frozen_sharded_modules"] = len(fsdp2_modules(frozen))
    result["frozen_local_fraction"] = sum(p.to_local().numel() for p in frozen.parameters()) / sum(
        p.numel() for p in whole.parameters()
    )
    result["frozen_requires_grad"] = any(p.requires_grad for p in frozen.parameters())
    result["frozen_training"] = frozen.training
    dist.all_gather_single = counting
    try:
        for padding_free in (False, True):
            gathers.clear()
            with torch.no_grad():
                frozen_logps = score(frozen, rows[rank], padding_free)[0]
                with autocast:
                    whole_logps = score(whole, rows[rank], padding_free)[0]
            name = "packed" if padding_free else "padded"
            result[f"frozen_{name}_logp_error"] = (frozen_logps - whole_logps).abs().max().item()
            result[f"frozen_{name}_gathers"] = len(gathers)
    finally:
        dist.all_gather_single = original
    # sharded again after scoring: the head (the root's, kept whole from its forward for the projection) and a block
    result["frozen_after"] = [
        type(frozen.lm_head.weight).__name__,
        type(frozen.model.layers[0].mlp.up_proj.weight).__name__,
    ]
    result["samples_equal"] = torch.equal(per_step, expected) and torch.equal(once, expected)
    result["resharded_after"] = type(sharded.model.layers[0].self_attn.q_proj.weight).__name__
    result["reshard_after_forward_kept"] = type(sharded.lm_head.weight).__name__
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    leave_worker()
