"""Run by test_rollout_vllm_colocate.py with the vLLM venv's Python (alone, or under `torchrun --nproc_per_node 2`): a
short GSPO run with `vllm_mode="colocate"` (a vLLM engine in this process) on a tiny tied Llama; `setup` names the
variant ("learn": full weights and a learnable reward; "lora+kl"; "async": rollouts sampled ahead; "episodes":
multi-turn episodes). After every real
weight push it records the engine's and the trainer's log-probs of a fixed text; after every rollout, the largest gap
between the engine's log-probs of what it sampled and the trainer's own. Each rank writes <out>.rank<R>.json.

It runs where pytest is not installed (the vLLM venv), so it imports nothing from the test helpers."""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
from datasets import Dataset

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.training.logprobs import completion_logprobs

FIXED_TEXT = [5, 17, 40, 99, 120, 7, 33, 250, 12, 64, 3, 81]  # token ids whose log-probs both sides compute


def count_digits(completions, **kwargs):
    """A dense toy reward: the fraction of characters that are digits."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def low_tokens(completion_ids, **kwargs):
    """A reward the tiny model can learn in a few steps: the share of sampled tokens in the lower half of the
    vocabulary (about 0.5 for a random model)."""
    return [sum(token < 200 for token in ids) / max(len(ids), 1) for ids in completion_ids]


def engine_logprobs(backend, ids: list[int]) -> torch.Tensor:
    """The colocated engine's log p(token_t | tokens_<t), t >= 1, of a fixed text."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    backend.engine.wake()
    (output,) = backend.engine.llm.generate([{"prompt_token_ids": ids}], sampling_params=params, use_tqdm=False)
    backend.engine.sleep()
    return torch.tensor([entry[token].logprob for token, entry in zip(ids[1:], output.prompt_logprobs[1:])])


def trainer_logprobs(trainer, ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([ids])
    with torch.no_grad():
        return completion_logprobs(
            trainer.model_wrapped, ids, torch.ones_like(ids), ids[:, 1:], torch.ones_like(ids[:, 1:])
        ).logps[0]


def record(trainer, syncs: list, rollouts: list) -> None:
    """Wrap the backend: after each real push the fixed text's log-probs on both sides; after each rollout, the
    largest |sampling_logps - trainer's log-probs| over its sampled tokens."""
    backend = trainer.rollout_backend
    update_weights, generate = backend.update_weights, backend.generate

    def recorded_update(model, global_step):
        before = len(backend.sync_seconds)
        update_weights(model, global_step)
        if len(backend.sync_seconds) > before:
            engine = engine_logprobs(backend, FIXED_TEXT)
            error = (engine - trainer_logprobs(trainer, FIXED_TEXT)).abs().max().item()
            syncs.append({"step": global_step, "max_error": error, "engine_logps": engine.tolist()})

    def recorded_generate(prompts, stream_keys=None):
        rollout = generate(prompts, stream_keys)
        rows, thread = rollout.completion_ids.shape[0], threading.current_thread().name
        if trainer.args.async_rollouts:  # sampled ahead: the trainer's weights move on meanwhile
            rollouts.append({"rows": rows, "thread": thread, "completion_ids": rollout.completion_ids.tolist()})
            return rollout
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
        completion = (rollout.completion_ids, rollout.completion_mask)
        with torch.no_grad():
            ours = completion_logprobs(trainer.model_wrapped, ids, mask, *completion)
        valid = rollout.completion_mask.bool()
        gap = (rollout.sampling_logps[valid] - ours.logps[valid]).abs().max().item()
        rollouts.append(
            {"rows": rows, "thread": thread, "max_error": gap, "completion_ids": rollout.completion_ids.tolist()}
        )
        return rollout

    backend.update_weights, backend.generate = recorded_update, recorded_generate


class AskAgain:
    """Never ends an episode by itself: every turn gets an observation (the loop's budget and max_turns end it)."""

    def reset(self, seed=None, options=None):
        return "", {}

    def step(self, action):
        return " Again:", float(len(action) % 3), False, False, {}


def episodes(model_dir: str, out: str) -> None:
    """Multi-turn episodes sampled turn by turn on the engine from token ids: the engine's log-probs of every
    sampled token are the trainer's own on the whole episode; then a short run trains on such episodes."""
    config = GSPOConfig(
        output_dir=f"{out}.output",
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=2,
        max_completion_length=40,
        max_turns=3,
        importance_sampling_level="turn",
        advantage_granularity="turn",
        logging_steps=1,
        report_to="none",
        seed=0,
        use_cpu=True,
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
    )
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(8)]})
    trainer = GSPOTrainer(model_dir, None, args=config, train_dataset=dataset, env_factory=AskAgain)
    backend = trainer.rollout_backend
    # The random model seldom emits its end-of-turn token: 40 frequent tokens end a turn too, so episodes have turns.
    stops = backend.eos_token_ids + list(range(3, 43))
    backend.eos_token_ids, backend.sampling["stop_token_ids"] = stops, stops
    backend.update_weights(trainer.model_wrapped, 0)
    batch = trainer.episode_runner.run(backend, [{"prompt": "What is 1 + 2?"}] * 4, seeds=[0] * 4)
    rollout = batch.rollout
    sampled = (rollout.completion_mask * rollout.env_mask).bool()
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    with torch.no_grad():
        ours = completion_logprobs(trainer.model_wrapped, ids, mask, rollout.completion_ids, sampled.long()).logps
    trainer.train()
    result = {
        "observations": bool((rollout.completion_mask.bool() & ~sampled).any()),
        "later_turns": bool(batch.reached[:, 1].any()),
        "max_error": (rollout.sampling_logps[sampled] - ours[sampled]).abs().max().item(),
        "logs": [{k: e[k] for k in ("loss", "episodes/turns/mean") if k in e} for e in trainer.state.log_history],
    }
    with open(f"{out}.rank0.json", "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def main(model_dir: str, setup: str, out: str) -> None:
    from peft import LoraConfig

    if setup == "episodes":
        return episodes(model_dir, out)

    lora = "lora" in setup
    config = GSPOConfig(
        output_dir=f"{out}.output",
        per_device_train_batch_size=8 if setup == "learn" else 4,
        num_generations=4,
        steps_per_generation=2,
        max_steps=12 if setup == "learn" else 6,
        max_completion_length=12,
        learning_rate=3e-2 if lora or setup == "learn" else 1e-2,
        beta=0.05 if "kl" in setup else 0.0,
        logging_steps=1,
        report_to="none",
        seed=0,
        use_cpu=True,
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
        async_rollouts="async" in setup,
        vllm_logprobs_as_old="async" in setup,  # π_old of a rollout sampled ahead: the engine's
    )
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) if lora else None
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(16)]})
    reward = low_tokens if setup == "learn" else count_digits
    trainer = GSPOTrainer(model_dir, reward, args=config, train_dataset=dataset, peft_config=peft_config)
    syncs, rollouts = [], []
    record(trainer, syncs, rollouts)
    trainer.train()
    trainer.rollout_backend.update_weights(trainer.model_wrapped, -1)  # the final weights, through the same path
    rank = int(os.environ.get("RANK", "0"))
    result = {
        "world_size": trainer.accelerator.num_processes,
        "syncs": syncs,
        "rollouts": rollouts,
        "sync_seconds": trainer.rollout_backend.sync_seconds,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "logs": [
            {k: e[k] for k in ("step", "loss", "reward", "sampling/mismatch_kl", "rollout/staleness") if k in e}
            for e in trainer.state.log_history
            if "loss" in e
        ],
    }
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the engine's threads would hold up the interpreter's teardown
