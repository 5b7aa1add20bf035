"""GSPO against a real vLLM server started with `gspo-trl vllm-serve` (tests/rollout/real_vllm_servers.py): sampling,
weight sync after every rollout (full, LoRA, QLoRA; through the engine, a shared folder, HTTP, a delta), and the
server's log-probs against the trainer's after each."""

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import count_digits, small_config, text_dataset, worker_env
from peft import LoraConfig
from real_vllm_servers import fp32_logprobs, free_port, record_syncs, trainer_logprobs, vllm_config

from gspo_trl import GSPOTrainer
from gspo_trl.training.logprobs import completion_logprobs
from gspo_trl.vllm.auth import TOKEN_ENV
from gspo_trl.vllm.client import VLLMServerError
from gspo_trl.vllm.weight_sync import named_weights

pytestmark = pytest.mark.xdist_group(
    "vllm_server"
)  # every real server on one worker (tests/rollout/real_vllm_servers.py)


@pytest.mark.slow  # the real vLLM server
def test_server_samples_n_per_prompt_with_the_trainers_log_probs(tmp_path, server, served_model_dir):
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=vllm_config(tmp_path, server, max_completion_length=16),
        train_dataset=text_dataset(),
    )
    backend = trainer.rollout_backend
    backend.update_weights(trainer.model, 0)
    prompts = [p for p in ["What is 1 + 2?", "Reply with the number 7."] for _ in range(4)]
    rollout = backend.generate(prompts)
    assert rollout.completion_ids.shape[0] == 8 and rollout.sampling_logps.shape == rollout.completion_ids.shape
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[3]) and not torch.equal(
        rollout.prompt_ids[0], rollout.prompt_ids[4]
    )
    assert len({tuple(row.tolist()) for row in rollout.completion_ids[:4]}) > 1  # n samples, not one repeated
    lengths = rollout.completion_mask.sum(1)
    assert ((lengths == 16) | ~rollout.is_truncated).all() and (lengths <= 16).all()
    # The server's log-probs of what it sampled are the trainer's own (same weights, fp32), token by token.
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    ours = completion_logprobs(
        trainer.accelerator.unwrap_model(trainer.model), ids, mask, rollout.completion_ids, rollout.completion_mask
    ).logps
    valid = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampling_logps[valid], ours[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "setup",
    [
        "full",
        "full, engine through the group",
        "full, shared_dir",
        "lora adapter + KL",
        "lora merged",
        "qlora adapter + KL",
        "qlora merged",
    ],
)
@pytest.mark.slow  # the real vLLM server
def test_every_rollout_syncs_and_the_server_then_matches_the_trainer(tmp_path, server, served_model_dir, setup):
    """'auto' takes the server's weight-transfer engine (gloo, which `gspo-trl vllm-serve` loads): full and merged
    weights, and an adapter's frozen base, go in one broadcast, its buffers through files in the trainer's snapshot
    folder, which the server reads (or, where it cannot, as from another host, through the group itself); an adapter
    itself through the shared directory."""
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) if "lora" in setup else None
    )
    # QLoRA: a 4-bit base, which the server (started from the unquantized checkpoint) gets dequantized.
    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if setup.startswith("qlora") else None
    args = vllm_config(
        tmp_path,
        server,
        max_steps=6,
        steps_per_generation=2,
        learning_rate=3e-2 if peft_config else 1e-2,
        beta=0.05 if "KL" in setup else 0.0,
        vllm_lora_adapter_sync=False if setup.endswith("merged") else None,
        vllm_weight_transport="shared_dir" if "shared_dir" in setup else "auto",
        # a folder the server does not read from (not directly under /dev/shm or /tmp): as a server on another host
        vllm_weight_sync_dir=str(tmp_path / "unseen") if "through the group" in setup else None,
    )
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=args,
        train_dataset=text_dataset(),
        quantization_config=quantization,
        peft_config=peft_config,
    )
    assert trainer.rollout_backend.sends_adapter == setup.endswith("adapter + KL")
    transport = trainer.rollout_backend.transport
    assert transport.name == ("shared_dir" if "shared_dir" in setup else "engine")
    if transport.name == "engine":
        assert (transport.shared is None) == ("through the group" in setup)
    syncs = record_syncs(trainer)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2, 4]  # one sync per rollout, before it, with the new weights
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert all((a[1] - b[1]).abs().max() > 1e-3 for a, b in zip(syncs, syncs[1:]))  # the server's model did change
    logged = [entry for entry in trainer.state.log_history if "sampling/mismatch_kl" in entry]
    assert logged and all(entry["sampling/mismatch_kl"] < 1e-6 for entry in logged)
    assert all(entry["sampling/corrected_fraction"] == 0.0 for entry in logged)


def record_transport(backend):
    """Every path the trainer names to the server (snapshot reloads, adapters) and the HTTP chunks it sends."""
    client, seen = backend.client, {"paths": [], "chunks": 0}
    reload_weights, load_adapter, load_chunk = (
        client.reload_weights,
        client.load_lora_adapter,
        client.load_weights_chunk,
    )
    client.reload_weights = lambda path: seen["paths"].append(path) or reload_weights(path)
    client.load_lora_adapter = lambda name, path: seen["paths"].append(path) or load_adapter(name, path)
    client.load_weights_chunk = lambda payload: seen.__setitem__("chunks", seen["chunks"] + 1) or load_chunk(payload)
    return seen


@pytest.mark.parametrize(
    "setup", ["full, auto", "full, bf16 weights", "lora adapter + KL", "lora merged", "qlora adapter + KL"]
)
@pytest.mark.slow  # the real vLLM server
def test_weights_sent_over_http_reach_a_server_that_cannot_see_the_trainers_files(
    tmp_path, server, served_model_dir, setup, monkeypatch
):
    """The HTTP transport: chunks of whole layers through /collective_rpc, the adapter copied into the server's own
    temporary folder. The sync directory is relative to the trainer's working directory, which is not the server's:
    the server cannot see it, so 'auto' picks HTTP, and no path of the trainer's is ever named to the server."""
    monkeypatch.chdir(tmp_path)
    if "auto" in setup:  # as a server without a weight-transfer engine, which 'auto' would otherwise take
        import gspo_trl.vllm.client as client

        monkeypatch.setattr(client.VLLMServerClient, "server_config", lambda self: None)
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) if "lora" in setup else None
    )
    bf16 = "bf16" in setup
    args = vllm_config(
        tmp_path,
        server,
        max_steps=4,
        steps_per_generation=2,
        learning_rate=3e-2 if peft_config else 1e-2,
        beta=0.05 if "KL" in setup else 0.0,
        vllm_lora_adapter_sync=False if setup.endswith("merged") else None,
        vllm_weight_sync_dir="trainer-only",
        vllm_weight_transport="auto" if "auto" in setup else "http",
        vllm_weight_chunk_mb=0.05,  # 50 KiB: several chunks even for this tiny model (a layer is ~260 KiB in fp32)
        bf16=bf16,
        model_init_kwargs={"dtype": torch.bfloat16} if bf16 else None,
    )
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=args,
        train_dataset=text_dataset(),
        quantization_config={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if "qlora" in setup else None,
        peft_config=peft_config,
    )
    backend = trainer.rollout_backend
    assert backend.transport.name == "http"
    assert backend.sends_adapter == setup.endswith("adapter + KL")
    if bf16:
        # The weights go as bf16 tensors (as to a bf16 server); this fp32 server widens them exactly, so its log-probs
        # are those of an fp32 forward of the trainer's bf16 weights.
        backend.server_info["dtype"] = "bfloat16"
    seen, syncs = record_transport(backend), record_syncs(trainer, fp32_logprobs if bf16 else trainer_logprobs)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2]
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert (syncs[0][1] - syncs[1][1]).abs().max() > 1e-3  # the server's model did change
    # A full sync is 4 chunks: the embedding, each layer (over 50 KiB each), the final norm; adapter syncs send the
    # base once.
    assert seen["chunks"] == 4 * (1 if backend.sends_adapter else len(syncs))
    # No path of the trainer's reached the server: adapters were loaded from the server's own temporary folder.
    assert all(not str(path).startswith(str(tmp_path)) and "trainer-only" not in str(path) for path in seen["paths"])
    server_cwd = os.readlink(f"/proc/{server['process'].pid}/cwd")
    assert (tmp_path / "trainer-only").is_dir() and not os.path.exists(os.path.join(server_cwd, "trainer-only"))


@pytest.mark.slow  # the real vLLM server
def test_an_adapter_the_server_cannot_take_is_refused_when_required(tmp_path, server, served_model_dir):
    args = vllm_config(tmp_path, server, vllm_lora_adapter_sync=True)
    with pytest.raises(ValueError, match="rank 16 exceeds the server's --max-lora-rank 8"):
        GSPOTrainer(
            served_model_dir,
            count_digits,
            args=args,
            train_dataset=text_dataset(),
            peft_config=LoraConfig(r=16, target_modules=["q_proj"]),
        )


@pytest.mark.slow  # the real vLLM server
def test_model_mismatch_is_refused_at_construction(tmp_path, server, tiny_model_dir):
    with pytest.raises(ValueError, match="serves a different model.*hidden_size: trainer 64, server 128"):
        GSPOTrainer(tiny_model_dir, count_digits, args=vllm_config(tmp_path, server), train_dataset=text_dataset())


@pytest.mark.slow  # the real vLLM server
def test_weight_sync_dir_the_server_cannot_read_is_refused(tmp_path, server, served_model_dir, monkeypatch):
    import gspo_trl.vllm.client as client

    monkeypatch.setattr(client.VLLMServerClient, "can_read", lambda self, path: [False])
    args = vllm_config(tmp_path, server, vllm_weight_transport="shared_dir")
    with pytest.raises(ValueError, match="cannot read the weight-sync directory.*vllm_weight_transport='http'"):
        GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())


def test_unreachable_server_is_an_error_naming_the_url(tmp_path, served_model_dir):
    port = free_port()
    args = small_config(tmp_path, use_vllm=True, vllm_server_port=port, vllm_server_timeout=2)
    with pytest.raises(VLLMServerError, match=f"127.0.0.1:{port}"):
        GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())


@pytest.mark.slow  # the real vLLM server
def test_server_logprobs_as_old_skip_the_old_forward(tmp_path, server, served_model_dir):
    args = vllm_config(
        tmp_path,
        server,
        max_steps=4,
        steps_per_generation=2,
        vllm_logprobs_as_old=True,
        always_compute_old_logprobs=True,
    )
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    calls = []
    original = trainer._score_without_grad
    trainer._score_without_grad = lambda *a, **k: calls.append(1) or original(*a, **k)
    trainer.train()
    assert calls == []  # no π_old forward, even with always_compute_old_logprobs
    ratios = [entry for entry in trainer.state.log_history if "ratio/max" in entry]
    assert len(ratios) == 4 and any(entry["ratio/max"] != 1.0 for entry in ratios[1::2])  # off-policy steps moved


@pytest.mark.slow  # the real vLLM server
def test_the_server_samples_the_next_rollout_ahead_with_the_weights_of_its_launch(tmp_path, server, served_model_dir):
    args = vllm_config(
        tmp_path,
        server,
        max_steps=6,
        steps_per_generation=2,
        learning_rate=1e-2,
        async_rollouts=True,
        vllm_logprobs_as_old=True,
    )
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    syncs, threads, scored = record_syncs(trainer), [], []
    generate, score = trainer.rollout_backend.generate, trainer._score_without_grad
    trainer.rollout_backend.generate = lambda *a: threads.append(threading.current_thread().name) or generate(*a)
    trainer._score_without_grad = lambda *a: scored.append(1) or score(*a)
    trainer.train()
    # Rollouts for steps 0, 2 and 4 were launched at steps 0, 0 and 2: the server got the weights of steps 0 and 2.
    assert [step for step, _, _ in syncs] == [0, 2] and threads == ["gspo-rollout_0"] * 3
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert scored == []  # π_old is the server's
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["rollout/staleness"] for entry in logs] == [0, 1, 2, 3, 2, 3]
    with pytest.raises(ValueError, match="vllm_logprobs_as_old=True"):
        vllm_config(tmp_path, server, async_rollouts=True)


@pytest.mark.slow  # the real vLLM server
def test_a_rollout_func_samples_on_the_synced_server_and_its_logprobs_correct_the_ratio(
    tmp_path, server, served_model_dir
):
    """TRL's rollout_func with use_vllm: the server gets the new weights before every rollout (as for built-in
    sampling), and the function's "logprobs" are the sampling engine's for the sampling correction."""

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        rollout = trainer.rollout_backend.generate_from_ids(prompt_ids, max_new_tokens=8)
        sampled = rollout.completion_mask.bool()
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, sampled)],
            "logprobs": [logps[mask].tolist() for logps, mask in zip(rollout.sampling_logps, sampled)],
        }

    args = vllm_config(tmp_path, server, max_steps=4, steps_per_generation=2, learning_rate=1e-2)
    trainer = GSPOTrainer(
        served_model_dir, count_digits, args=args, train_dataset=text_dataset(), rollout_func=rollout_func
    )
    syncs = record_syncs(trainer)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2]
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    logged = [entry for entry in trainer.state.log_history if "sampling/mismatch_kl" in entry]
    assert len(logged) == 4 and all(entry["sampling/mismatch_kl"] < 1e-6 for entry in logged)


@pytest.mark.parametrize(
    "mode", ["ddp", "zero3", "zero3+shared_dir", "zero3+http", "zero3+http, two servers"]
)  # no "+": the engine
@pytest.mark.slow  # the real vLLM server
def test_two_processes_sample_on_the_server_and_sync_every_rollout(tmp_path, server, served_model_dir, mode, request):
    """Two servers: ZeRO-3's gathers pair up across the processes as process 0 syncs one server after the other."""
    import json

    urls = [server["url"]] + ([request.getfixturevalue("second_server")["url"]] if "two servers" in mode else [])
    mode = mode.removesuffix(", two servers")
    out = tmp_path / mode
    worker = Path(__file__).parents[1] / "vllm_worker.py"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(worker),
            served_model_dir,
            mode,
            ",".join(urls),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**worker_env(), TOKEN_ENV: server["token"]},  # the worker's config names no token: the variable's
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["partitioned"] == mode.startswith("zero3")
    assert [r["transport"] for r in ranks] == [mode.split("+")[1] if "+" in mode else "engine"] * 2
    assert [r["syncs"] for r in ranks] == [3, 3]  # two rollouts, then the final sync
    assert ranks[0]["logs"] == ranks[1]["logs"] and len(ranks[0]["logs"]) == 4  # every rank logs the same numbers
    assert ranks[0]["max_error"] < 1e-4 and ranks[0]["servers"] == len(urls)  # each holds the trained weights


class AskAgain:
    """Never ends an episode by itself: every turn gets an observation (the loop's budget and max_turns end it)."""

    def reset(self, seed=None, options=None):
        return "", {}

    def step(self, action):
        return " Again:", float(len(action) % 3), False, False, {}


@pytest.mark.slow  # the real vLLM server
def test_episodes_sample_each_turn_on_the_server_from_token_ids(tmp_path, server, served_model_dir):
    args = vllm_config(
        tmp_path,
        server,
        max_completion_length=40,
        max_turns=3,
        importance_sampling_level="turn",
        advantage_granularity="turn",
    )
    trainer = GSPOTrainer(served_model_dir, None, args=args, train_dataset=text_dataset(), env_factory=AskAgain)
    backend = trainer.rollout_backend
    # The random model seldom emits its end-of-turn token: let 40 frequent tokens end a turn too, so that episodes
    # have several turns (the server stops on them and the loop appends the observation after them).
    stops = backend.eos_token_ids + list(range(3, 43))
    backend.eos_token_ids, backend.sampling["stop_token_ids"] = stops, stops
    backend.update_weights(trainer.model, 0)
    batch = trainer.episode_runner.run(backend, [{"prompt": "What is 1 + 2?"}] * 4, seeds=[0] * 4)
    rollout = batch.rollout
    sampled = (rollout.completion_mask * rollout.env_mask).bool()
    assert (rollout.completion_mask.bool() & ~sampled).any() and batch.reached[:, 1].any()  # later turns happened
    # The server's log-probs of every sampled token, in every turn, are the trainer's own on the whole episode.
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    ours = completion_logprobs(
        trainer.accelerator.unwrap_model(trainer.model), ids, mask, rollout.completion_ids, sampled.long()
    ).logps
    torch.testing.assert_close(rollout.sampling_logps[sampled], ours[sampled], atol=1e-4, rtol=0)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"]) and "episodes/turns/mean" in trainer.state.log_history[0]


@pytest.mark.slow  # the real vLLM server
@pytest.mark.parametrize("async_rollouts", [False, True], ids=["sync", "async"])
def test_dynamic_sampling_samples_its_extra_rounds_on_the_server(tmp_path, server, served_model_dir, async_rollouts):
    from test_dynamic_sampling import assert_only_informative_groups, half_constant, metric, trained_rollouts

    args = vllm_config(
        tmp_path,
        server,
        max_steps=3,
        per_device_train_batch_size=8,
        steps_per_generation=1,  # a rollout per step: 2 groups of 4
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=8,
        async_rollouts=async_rollouts,
        vllm_logprobs_as_old=async_rollouts,  # π_old of a rollout sampled ahead: the server's (checked at construction)
    )
    trainer = GSPOTrainer(served_model_dir, [half_constant], args=args, train_dataset=text_dataset(8))
    rollouts = trained_rollouts(trainer)
    trainer.train()
    assert len(rollouts) == 3
    assert_only_informative_groups(rollouts, 4)
    assert max(metric(trainer, "rollout/dynamic_sampling_rounds")) >= 2  # an extra round ran on the server
    assert metric(trainer, "rollout/dynamic_sampling_filler_groups") == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("setup", ["full", "lora merged"])
@pytest.mark.slow  # the real vLLM server
def test_a_delta_sync_sends_less_and_leaves_the_server_with_the_trainers_weights_bit_for_bit(
    tmp_path, server, served_model_dir, setup
):
    """vllm_weight_sync_delta over HTTP, bf16 weights (as to a bf16 server): after the first sync, whole, each sync
    sends the elements whose bf16 bits moved; the server's copy is then the trainer's bf16 weights bit for bit. With
    LoRA the weights sent are the merged ones: only the adapted modules move."""
    import hashlib

    args = vllm_config(
        tmp_path,
        server,
        max_steps=6,
        steps_per_generation=2,
        learning_rate=2e-5,  # Adam moves each weight ~2e-5 a step; bf16's spacing near 0.02 is 1.2e-4: most stay
        vllm_weight_transport="http",
        vllm_weight_sync_delta=True,
        bf16=True,
        model_init_kwargs={"dtype": torch.bfloat16},
        vllm_lora_adapter_sync=False if setup == "lora merged" else None,
    )
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]) if "lora" in setup else None
    trainer = GSPOTrainer(
        served_model_dir, count_digits, args=args, train_dataset=text_dataset(), peft_config=peft_config
    )
    backend = trainer.rollout_backend
    assert not backend.sends_adapter
    backend.server_info["dtype"] = "bfloat16"  # weights go as bf16; this fp32 server widens them exactly
    sent, digests, send = [], [], backend.transport.send_weights

    def send_weights(model, **kwargs):
        sent.append(send(model, **kwargs))
        ours = {
            name: hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, tensor in named_weights(model, torch.bfloat16, merge_lora=True)
        }
        digests.append((ours, backend.client.delta_digest()))
        return sent[-1]

    backend.transport.send_weights = send_weights
    syncs = record_syncs(trainer, fp32_logprobs)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2, 4]
    for ours, workers in digests:
        assert all(theirs == ours for theirs in workers)  # every tensor, every worker, bit for bit
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    # The first sync is whole; the next ones carry a bitmask (1/16 of the bf16 bytes) and the moved elements only.
    assert sent[1] < 0.8 * sent[0] and sent[2] < 0.8 * sent[0], sent
    # and there was something to follow: some bf16 weights moved before each sync (with LoRA, in q_proj and v_proj)
    assert digests[0][0] != digests[1][0] != digests[2][0]
