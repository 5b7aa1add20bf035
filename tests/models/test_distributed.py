"""Multi-process training on CPU (gloo, torchrun, 2 processes) through tests/distributed_worker.py:
DDP, DeepSpeed ZeRO-2 and ZeRO-3 (every parameter partitioned), full fine-tuning and LoRA + KL, give the
same numbers; plus gspo_trl.models.distributed's unwrapping (a DeepSpeed engine forwards attribute access) and
its choice of a gloo group when no GPU is present."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import close, worker_env

from gspo_trl.models.distributed import needs_cpu_process_group, unwrap_model

WORKER = Path(__file__).parents[1] / "distributed_worker.py"
CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "accelerate_configs"


def launch(tmp_path, model_dir, mode, processes=2, name=None, must_succeed=True):
    out = tmp_path / (name or mode.replace("+", "_"))
    # --standalone: a free rendezvous port for every launch (a killed run must not block the next one)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        str(WORKER),
        model_dir,
        mode,
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=worker_env())
    if not must_succeed:
        return completed
    assert completed.returncode == 0, failure_report(completed.stderr)
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(processes)]


def failure_report(stderr: str) -> str:
    """The lines of a failed launch's stderr that say why (a rank's exception, an abort), then its tail."""
    telling = [
        line
        for line in stderr.splitlines()
        if any(word in line for word in ("Error", "error:", "terminate", "Signal", "Exception", "what()"))
    ]
    return "\n".join(telling[-40:]) + "\n--- tail ---\n" + stderr[-3000:]


def assert_same_run(a, b, tolerance, steps=3, compared_steps=None):
    """The same logs (the first `compared_steps` of the `steps`, all by default) within `tolerance` of max(1, |value|)
    (helpers.close) and the weights' checksum within `tolerance` relative."""
    assert len(a["logs"]) == len(b["logs"]) == steps
    for step, (x, y) in enumerate(zip(a["logs"][:compared_steps], b["logs"][:compared_steps])):
        assert x.keys() == y.keys()
        for name in x:
            assert x[name] == close(y[name], tolerance), (step, name)
    assert a["checksum"] == pytest.approx(b["checksum"], rel=tolerance)


@pytest.mark.slow  # torchrun launches
def test_two_processes_agree_on_truncated_sampling_and_on_skipped_rollouts(tmp_path, tiny_model_dir):
    # top-p 0.5: both ranks log the same mass cut away (reduced over the processes' tokens) and train against the
    # policy's π_old (ratio near 1 after the first update). No reward anywhere, skip_rollouts_without_rewards: both
    # ranks skip the same rollouts (the decision is taken on the gathered table), train on nothing, even with beta > 0.
    top_p = launch(tmp_path, tiny_model_dir, "ddp+topp")
    assert_same_run(top_p[0], top_p[1], 0)
    logs = top_p[0]["logs"]
    assert 0.3 < logs[0]["sampling/truncated_mass"] < 0.6 and 0.9 < logs[1]["ratio/min"]
    skipped = launch(tmp_path, tiny_model_dir, "ddp+skip+beta")
    assert_same_run(skipped[0], skipped[1], 0)
    logs = skipped[0]["logs"]
    assert [entry.get("rollout/skipped") for entry in logs] == [1.0, None, 1.0]  # a rollout every two steps
    assert all(entry["loss"] == 0.0 for entry in logs) and skipped[0]["grad_norms"] == [0.0] * 3


@pytest.mark.parametrize("options", ["", "+lora+beta"])
@pytest.mark.slow  # torchrun launches
def test_deepspeed_zero2_and_zero3_train_like_ddp_and_ranks_agree(tmp_path, tiny_model_dir, options):
    ddp = launch(tmp_path, tiny_model_dir, ("ddp_no_flag" if not options else "ddp") + options)
    zero2 = launch(tmp_path, tiny_model_dir, "zero2" + options)
    zero3 = launch(tmp_path, tiny_model_dir, "zero3" + options)
    assert [r["distributed_type"] for r in ddp] == ["DistributedType.MULTI_CPU"] * 2  # gloo, even without use_cpu
    assert [r["distributed_type"] for r in zero2 + zero3] == ["DistributedType.DEEPSPEED"] * 4
    assert all(r["world_size"] == 2 for r in ddp + zero2 + zero3)
    for ranks in (ddp, zero2, zero3):
        assert_same_run(ranks[0], ranks[1], 0)  # every rank logs the same numbers and holds the same weights
    assert_same_run(ddp[0], zero2[0], 1e-6)
    assert_same_run(ddp[0], zero3[0], 1e-6)
    # ZeRO-3 really partitions: each rank holds about half of the parameters.
    assert zero3[0]["local_parameters"] <= 0.55 * ddp[0]["local_parameters"]
    # ... and gathers them once per rollout for generation (ds3_gather_for_generation=True, TRL's default).
    assert zero3[0]["whole_at_generation"] == [True, True]
    assert any(e["ratio/max"] != 1.0 for e in zero3[0]["logs"])  # off-policy steps happened
    if "beta" in options:
        assert any(e["kl"] > 0 for e in zero3[0]["logs"])  # the reference model, loaded partitioned, was used
    else:
        # ds3_gather_for_generation=False: the decoding loop runs on partitioned weights (gathered layer by layer
        # by ZeRO-3's hooks at every step) and samples and trains exactly the same run.
        partitioned = launch(tmp_path, tiny_model_dir, "zero3+nogather")
        assert partitioned[0]["whole_at_generation"] == [False, False]
        assert_same_run(zero3[0], partitioned[0], 0)
        # save_model() under ZeRO-3 gathers a full checkpoint that from_pretrained loads.
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "zero3.saved", dtype=torch.float64)
        checksum = sum(p.detach().abs().sum().item() for p in saved.parameters())
        assert checksum == pytest.approx(zero3[0]["checksum"], rel=1e-9)


@pytest.mark.parametrize(
    "zero_modes, options", [(["zero1", "zero3+offload"], "+beta"), (["zero2+offload"], "+lora+beta")]
)
@pytest.mark.slow  # torchrun launches
def test_deepspeed_zero1_and_zero_offload_train_like_ddp(tmp_path, tiny_model_dir, zero_modes, options):
    """ZeRO-1, and ZeRO-Offload (optimizer states in CPU memory; under ZeRO-3 the parameters too), with the reference
    model (beta > 0) or LoRA's disabled adapter: the same run as DDP. With offload, accelerate replaces the torch
    AdamW by DeepSpeedCPUAdam (compiled on first use), whose arithmetic differs in rounding only."""
    ddp = launch(tmp_path, tiny_model_dir, "ddp" + options)
    for mode in zero_modes:
        zero = launch(tmp_path, tiny_model_dir, mode + options)
        assert [r["distributed_type"] for r in zero] == ["DistributedType.DEEPSPEED"] * 2
        assert_same_run(zero[0], zero[1], 0)
        assert_same_run(ddp[0], zero[0], 1e-6)
        assert any(e["kl"] > 0 for e in zero[0]["logs"])
        assert zero[0]["optimizer"] == ("DeepSpeedCPUAdam" if "offload" in mode else "AdamW")
        if mode.startswith("zero3"):
            assert zero[0]["local_parameters"] <= 0.55 * ddp[0]["local_parameters"]


@pytest.mark.parametrize("options", ["+beta", "+lora+beta+gc", "+beta+bf16", "+seeded+episodes"])
@pytest.mark.slow  # torchrun launches
def test_accelerate_fsdp2_trains_like_ddp(tmp_path, tiny_model_dir, options):
    """A whole GSPOTrainer run under accelerate's FSDP2 (accelerate's own preparation, transformer-based wrapping:
    each decoder layer, the embeddings and the LM head their own units; its GPU-only gate lifted by
    tests/fsdp_on_cpu.py) trains the same run as DDP, with half the weights per rank, the reference model sharded
    too, generation on gathered weights, and a save_model() checkpoint that loads (+gc: activation checkpointing
    on, the usual GPU recipe; +seeded+episodes: two-turn episodes). bf16: FSDP2's bf16 policy
    (from accelerate) against DDP under bf16 autocast, the same run within bf16 rounding. Before the fixes it tests, the
    first backward crashed with SIGSEGV: FSDP2's hooks ran on the separately wrapped LM head once per log-prob
    chunk, and (LoRA) a first rollout before the root's lazy initialisation left the root resharding its
    parameters after every forward."""
    ddp = launch(tmp_path, tiny_model_dir, "ddp" + options)
    fsdp = launch(tmp_path, tiny_model_dir, "fsdp2" + options)
    assert [r["distributed_type"] for r in fsdp] == ["DistributedType.FSDP"] * 2 and all(r["fsdp"] for r in fsdp)
    assert_same_run(fsdp[0], fsdp[1], 0)  # every rank logs the same numbers and holds the same (gathered) weights
    assert_same_run(ddp[0], fsdp[0], 1e-2 if "bf16" in options else 1e-6)  # bf16: 2.3e-3 seen (ratio/max)
    assert any(e["ratio/max"] != 1.0 for e in fsdp[0]["logs"])  # off-policy steps happened
    assert fsdp[0]["local_parameters"] <= 0.55 * ddp[0]["local_parameters"]
    if "episodes" in options:  # two-turn episodes, each turn's cache continued (no generation spy there)
        assert all(e["episodes/turns/mean"] > 1 for e in fsdp[0]["logs"] if "episodes/turns/mean" in e)
        return
    assert any(e["kl"] > 0 for e in fsdp[0]["logs"])
    assert fsdp[0]["whole_at_generation"] == [True, True]  # ds3_gather_for_generation: gathered once per rollout
    if "lora" not in options:  # the reference model (LoRA has none: the adapter is disabled instead)
        assert 0 < fsdp[0]["local_reference_parameters"] <= 0.55 * ddp[0]["local_reference_parameters"]
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(
            tmp_path / ("fsdp2" + options.replace("+", "_") + ".saved"), dtype=torch.float64
        )
        checksum = sum(p.detach().abs().sum().item() for p in saved.parameters())
        assert checksum == pytest.approx(fsdp[0]["checksum"], rel=1e-9)


@pytest.mark.slow  # torchrun launches
def test_decode_linear_forms_train_the_same_run_under_ddp_zero3_and_fsdp2(tmp_path, tiny_model_dir):
    """decode_linear's transposed products (forced on: the tiny model is below its size threshold) in the decoding
    loops of every rank, with and without LoRA: the same run as F.linear's within float rounding, and the same under
    ZeRO-3 and FSDP2, whose weights are gathered whole for the rollout; not under ZeRO-3 without that gathering (the
    layers hold empty shards when the loop starts, and are left alone). The compiled form under DDP too."""
    plain = launch(tmp_path, tiny_model_dir, "ddp+beta")
    ddp = launch(tmp_path, tiny_model_dir, "ddp+beta+linears")
    assert plain[0]["forced_products"] == 0 and ddp[0]["forced_products"] > 0
    assert_same_run(ddp[0], ddp[1], 0)
    assert_same_run(plain[0], ddp[0], 1e-5)
    compiled = launch(tmp_path, tiny_model_dir, "ddp+beta+compiled")  # decode_kernel's loop on both ranks
    assert all(rank["forced_products"] > 0 for rank in compiled)
    assert_same_run(compiled[0], compiled[1], 0)
    assert_same_run(plain[0], compiled[0], 1e-5)
    for mode in ("zero3+beta+linears", "fsdp2+beta+linears"):
        sharded = launch(tmp_path, tiny_model_dir, mode)
        assert all(rank["forced_products"] > 0 for rank in sharded), mode
        assert_same_run(sharded[0], sharded[1], 0)
        assert_same_run(ddp[0], sharded[0], 1e-6)
    partitioned = launch(tmp_path, tiny_model_dir, "zero3+beta+nogather+linears")
    assert partitioned[0]["forced_products"] == 0
    assert_same_run(plain[0], partitioned[0], 1e-6)
    lora_plain = launch(tmp_path, tiny_model_dir, "ddp+lora+beta")  # peft's layers wrap plain nn.Linear ones
    lora = launch(tmp_path, tiny_model_dir, "ddp+lora+beta+linears")
    assert lora[0]["forced_products"] > 0
    assert_same_run(lora_plain[0], lora[0], 1e-5)


@pytest.mark.slow  # torchrun launches
def test_micro_batches_trained_in_passes_train_the_same_run_under_ddp_zero_and_fsdp2(tmp_path, tiny_model_dir):
    """max_tokens_per_pass cuts each micro-batch of 4 rows into passes of 2, each back-propagated on its own: under
    DDP (the first pass under no_sync), DeepSpeed ZeRO-2 and ZeRO-3 (no accumulation boundary until the last pass)
    and accelerate's FSDP2 (gradient sync held), the first optimizer step's gradient is one pass's (its norm within
    float rounding: a pass missing from the sum, or reduced twice, would be far off), and the run stays the same.
    The later steps differ a little more (2e-5 seen in the KL): AdamW's first update, lr·g/(|g| + 1e-8), turns
    rounding-level differences in the many near-zero gradient elements into differences of up to 2·lr. Step 3 trains
    on a second rollout sampled from those weights, where a near-tie can flip a token (under DDP with decode_kernel's
    attention: a reward 0.0045 apart), so its logs are not compared; the weights after it are."""
    whole = launch(tmp_path, tiny_model_dir, "ddp+beta")
    for mode in ("ddp+beta+passes", "zero2+beta+passes", "zero3+beta+passes", "fsdp2+beta+passes"):
        ranks = launch(tmp_path, tiny_model_dir, mode)
        assert ranks[0]["pass_rows"] == ranks[1]["pass_rows"] == [2] * 6, mode  # 3 micro-steps of 2 passes
        assert_same_run(ranks[0], ranks[1], 0)
        assert ranks[0]["grad_norms"][0] == pytest.approx(whole[0]["grad_norms"][0], rel=1e-5), mode
        for name, value in whole[0]["logs"][0].items():
            assert ranks[0]["logs"][0][name] == close(value, 1e-6), (mode, name)
        assert_same_run(whole[0], ranks[0], 5e-4, compared_steps=2)  # steps 1-2: the first rollout
        assert any(e["kl"] > 0 for e in ranks[0]["logs"]) and any(e["ratio/max"] != 1.0 for e in ranks[0]["logs"])


@pytest.mark.slow  # torchrun launches
def test_micro_batches_trained_in_passes_under_bf16_autocast_on_two_processes(tmp_path, tiny_model_dir):
    """The GPU recipe's autocast with passes, under DDP and ZeRO-3: each micro-batch is cut into passes of 2 rows, the
    ranks agree exactly, and the run is the one-pass bf16 run within bf16 rounding (one process: each pass's weight
    gradient rounds on its own, 0.45% of the norm seen in tests/test_trainer.py)."""
    whole = launch(tmp_path, tiny_model_dir, "ddp+bf16+beta")
    for mode in ("ddp+bf16+beta+passes", "zero3+bf16+beta+passes"):
        ranks = launch(tmp_path, tiny_model_dir, mode)
        assert ranks[0]["pass_rows"] == ranks[1]["pass_rows"] == [2] * 6, mode
        assert_same_run(ranks[0], ranks[1], 0)
        # a pass left out of the sum, or reduced twice, would be ~30% off; 2e-4 (DDP) and 1.1e-3 (ZeRO-3) seen
        assert ranks[0]["grad_norms"][0] == pytest.approx(whole[0]["grad_norms"][0], rel=5e-3), mode
        assert_same_run(whole[0], ranks[0], 2e-2)  # 2.6e-3 (kl) and 9.3e-3 (ratio/max) seen; bf16 vs fp32: 8.9e-3
        assert any(e["kl"] > 0 for e in ranks[0]["logs"]) and any(e["ratio/max"] != 1.0 for e in ranks[0]["logs"])


@pytest.mark.parametrize("mode", ["ddp", "zero3", "zero3+offload", "fsdp2"])
@pytest.mark.slow  # torchrun launches
def test_kill_9_of_one_rank_mid_window_then_resume_continues_the_trajectory(tmp_path, tiny_model_dir, mode):
    whole = launch(tmp_path, tiny_model_dir, f"{mode}+checkpoints", name="whole")
    killed = launch(tmp_path, tiny_model_dir, f"{mode}+kill", name="cut", must_succeed=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    # Rank 1 died inside optimizer step 3; checkpoint-2 (inside a 3-step rollout) is the last complete one.
    # Under ZeRO-3 it holds each rank's partition of the weights and optimizer (DeepSpeed's own checkpoint; with
    # offload, DeepSpeedCPUAdam's states).
    resumed = launch(tmp_path, tiny_model_dir, f"{mode}+resume", name="cut")
    assert_same_run(whole[0], resumed[0], 1e-6, steps=4)
    assert_same_run(resumed[0], resumed[1], 0, steps=4)
    assert any(e["ratio/max"] != 1.0 for e in resumed[0]["logs"] if e["step"] == 3)  # continued rollout, off-policy
    if mode == "fsdp2":  # accelerate's FSDP2 (tests/fsdp_on_cpu.py): its sharded checkpoint, resumed
        assert resumed[0]["distributed_type"] == "DistributedType.FSDP"


@pytest.mark.slow  # torchrun launches
def test_an_error_on_one_rank_ends_every_rank_promptly(tmp_path, tiny_model_dir):
    # rank 1's reward function raises while rank 0 waits in the reward gather: both must end, with the
    # message naming the function, not hang until the process group's timeout.
    import time

    start = time.monotonic()
    completed = launch(tmp_path, tiny_model_dir, "ddp+raise", must_succeed=False)
    assert completed.returncode != 0
    assert "reward function 'fails_on_rank_1' raised KeyError" in completed.stderr
    assert time.monotonic() - start < 120


@pytest.mark.parametrize(
    "mode",
    [
        "ddp+seeded",
        "ddp+seeded+family",
        "ddp+seeded+lora+beta",
        "ddp+seeded+lora+beta+qlora",
        "zero3+seeded",
        "ddp+seeded+episodes",
        "ddp+seeded+async",
        "ddp+scripted",
        "ddp+seeded+dynsamp",
        "ddp+seeded+dynsamp+async",
        "ddp+seeded+dynsamp+episodes",
    ],
)
@pytest.mark.slow  # torchrun launches
def test_one_and_two_processes_train_the_same_run(tmp_path, tiny_model_dir, mode):
    # 8 completions per micro-step: one process of 8, or two of 4, with layout-independent sampling. Both
    # sample the same rollouts and cut them into the same global micro-batches (each process its slice).
    # +family: a token-mean loss, an entropy quantile and an entropy bonus, all over both processes' tokens.
    # +lora+beta: the adapter and the KL to the disabled-adapter reference (+qlora: over a 4-bit base); zero3:
    # partitioned on 2 processes.
    # +scripted: TRL's rollout_func on each process's prompts (its tokens do not depend on the layout).
    one = launch(tmp_path, tiny_model_dir, mode, processes=1, name="one")
    two = launch(tmp_path, tiny_model_dir, mode, processes=2, name="two")
    assert_same_run(one[0], two[0], 1e-5)
    assert_same_run(two[0], two[1], 0)
    assert any(e["ratio/max"] != 1.0 for e in one[0]["logs"])  # an off-policy step was compared too
    assert one[0]["logs"][0]["completions/mean_length"] == two[0]["logs"][0]["completions/mean_length"]
    if "family" in mode:  # TRL's entropy metrics, over both processes: one process's numbers
        assert all("policy_loss" in e and e["entropy_coef"] == 0.01 for e in one[0]["logs"])
    if "beta" in mode:  # the token-weighted KL mean over processes is one process's number
        assert any(e["kl"] > 0 for e in one[0]["logs"])
    if "async" in mode:  # the second rollout was sampled two optimizer steps ahead of its training
        assert [e["rollout/staleness"] for e in two[0]["logs"]] == [0, 1, 2]
    if "dynsamp" in mode:  # extra rounds sampled the same prompts and completions whatever the process layout
        assert max(e.get("rollout/dynamic_sampling_rounds", 0) for e in two[0]["logs"]) >= 2
    if "episodes" in mode:  # the same episodes, a second turn included, whatever the process layout
        assert one[0]["logs"][0]["episodes/turns/mean"] > 1
        assert one[0]["logs"][0]["episodes/env_token_fraction"] == two[0]["logs"][0]["episodes/env_token_fraction"]


@pytest.mark.parametrize("mode", ["ddp+bf16+beta", "zero3+bf16+lora+beta"])
@pytest.mark.slow  # torchrun launches
def test_bf16_recipes_train_on_two_processes(tmp_path, tiny_model_dir, mode):
    # The GPU recipe (bf16 autocast) on several processes: ranks agree, the KL term and an off-policy step run.
    ranks = launch(tmp_path, tiny_model_dir, mode)
    assert_same_run(ranks[0], ranks[1], 0)
    logs = ranks[0]["logs"]
    assert all(math.isfinite(e["loss"]) for e in logs)
    assert any(e["kl"] > 0 for e in logs) and any(e["ratio/max"] != 1.0 for e in logs)


@pytest.mark.parametrize("mode", ["", "+reshard", "+bf16", "+head", "+reshard+head"])
@pytest.mark.slow  # torchrun launches
def test_fsdp2_sharded_model_scores_and_decodes_like_the_whole_model(tmp_path, tiny_model_dir, mode):
    """FSDP2 by hand (accelerate enables it on GPUs only): log-probs, the gradient FSDP2 averages over the two
    ranks' different rows, and samples equal the whole model's (bf16: within bf16 rounding of the whole model
    under autocast); a rollout gathers each sharded module once; a frozen model prepared like the reference is
    sharded block by block and scores like the whole model."""
    logp_tolerance, grad_tolerance = (1e-2, 2.5e-2) if mode == "+bf16" else (1e-6, 1e-6)  # bf16: 3e-3, 1.1e-2 seen
    out = tmp_path / "fsdp2"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER.with_name("fsdp2_worker.py")),
        tiny_model_dir,
        mode or "plain",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=worker_env())
    assert completed.returncode == 0, failure_report(completed.stderr)
    for rank in range(2):
        result = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert result["sharded_head"] == "DTensor"
        # the root reshards after its forward only when asked: then the LM head is projected outside the forward
        # from a sharded weight, which logprobs makes whole through its owner first. +head: the head is a unit of
        # its own (resharded after its forward, made whole once and projected without its hooks); with +reshard
        # the root's own parameters (final norm) are freed after the forward too and must be gathered again for
        # the backward pass (the model's output is attached to the graph for that: it crashed before)
        assert result["head_after_forward"] == ("DTensor" if "+reshard" in mode or "+head" in mode else "Parameter")
        for layout in ("padded", "packed"):
            assert result[f"{layout}_logp_error"] <= logp_tolerance
            errors = result[f"{layout}_grad_errors"]
            assert None not in errors.values() and len(errors) > 10
            assert max(errors.values()) <= grad_tolerance * max(1.0, result[f"{layout}_grad_scale"])
        assert result["steps"] > 3 and (result["samples_equal"] or mode == "+bf16")
        # per-step gathers: the decoder layers at every forward; in fsdp2_whole_weights: each module once
        assert result["gathers_per_forward"] >= 2 * result["steps"]
        assert result["gathers_whole_weights"] <= (4 if "+head" in mode else 3)
        assert result["resharded_after"] == "DTensor"  # sharded again after the rollout
        assert result["static_refusal"].startswith("FSDP2")
        # a frozen model (the reference) that prepare_frozen_model shards from accelerate's FSDP2 plugin: each
        # decoder layer and the root, about half of the weights per rank, no gradients, evaluation mode
        blocks = result["frozen_sharded_modules"] - 1
        assert blocks >= 2 and result["frozen_local_fraction"] <= 0.55
        assert not result["frozen_requires_grad"] and not result["frozen_training"]
        for layout in ("padded", "packed"):
            assert result[f"frozen_{layout}_logp_error"] <= logp_tolerance
            # scored block by block: one gather per layer and one of the root, kept for the LM head's projection
            # (gathering the root again for the head made it blocks + 2)
            assert result[f"frozen_{layout}_gathers"] == blocks + 1
        assert result["frozen_after"] == ["DTensor", "DTensor"]  # sharded again once scored


def test_unwrap_model_peels_engines_that_forward_attributes(tiny_model):
    class ForwardingEngine(torch.nn.Module):  # like deepspeed.DeepSpeedEngine: unknown attributes go to the module
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.config = {"train_batch_size": 8}  # its own config, not the model's

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.module, name)

    engine = ForwardingEngine(tiny_model)
    assert engine.get_output_embeddings() is tiny_model.get_output_embeddings()  # why probing is wrong
    assert unwrap_model(engine) is tiny_model
    assert unwrap_model(torch.compile(tiny_model)) is tiny_model
    assert unwrap_model(tiny_model) is tiny_model


def test_cpu_process_group_only_for_multi_process_launches_without_accelerator(monkeypatch):
    import gspo_trl.models.distributed as distributed

    monkeypatch.setattr(distributed, "has_accelerator", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert needs_cpu_process_group(use_cpu=False)
    assert not needs_cpu_process_group(use_cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not needs_cpu_process_group(use_cpu=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "has_accelerator", lambda: True)
    assert not needs_cpu_process_group(use_cpu=False)


def test_fsdp_that_accelerate_leaves_out_is_reported(caplog):
    from types import SimpleNamespace

    from gspo_trl.models.distributed import warn_if_fsdp_dropped

    dropped = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=None))
    with caplog.at_level("WARNING"):
        warn_if_fsdp_dropped(SimpleNamespace(fsdp=True, use_cpu=True), dropped)
        warn_if_fsdp_dropped(SimpleNamespace(fsdp=False, use_cpu=True), dropped)
        warn_if_fsdp_dropped(
            SimpleNamespace(fsdp=True, use_cpu=False), SimpleNamespace(state=SimpleNamespace(fsdp_plugin=object()))
        )
    assert caplog.text.count("did not enable FSDP") == 1


@pytest.mark.parametrize(
    "field, value", [("train_micro_batch_size_per_gpu", 2), ("gradient_accumulation_steps", 3), ("train_batch_size", 8)]
)
def test_deepspeed_batch_fields_that_contradict_the_config_fail_at_construction(field, value):
    from types import SimpleNamespace

    from gspo_trl.models.distributed import check_deepspeed_batch_fields

    args = SimpleNamespace(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        deepspeed={"zero_optimization": {"stage": 2}, field: value},
    )
    with pytest.raises(ValueError, match=f"on 2 process.*{field}={value}"):
        check_deepspeed_batch_fields(args, num_processes=2)
    args.deepspeed[field] = "auto"
    check_deepspeed_batch_fields(args, num_processes=2)
    args.deepspeed["train_batch_size"] = 16  # 4 × 2 × 2: consistent
    check_deepspeed_batch_fields(args, num_processes=2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accelerate_launch(tmp_path, model_dir, config: str, machines: int = 1, bf16: bool = False) -> list[dict]:
    """`accelerate launch --config_file examples/accelerate_configs/<config>.yaml` of the worker, as a user runs it,
    with two processes in all and no mixed precision (a CPU run's overrides on the command line), or with `bf16` the
    file's own bf16 and `bf16=True` in the script; a multi-machine config starts one launcher per machine rank, all
    on this host. The worker's `launcher` mode sets nothing about the sharding: it comes from the config, through
    accelerate's environment."""
    out, port = tmp_path / f"launched_{config}{'_bf16' if bf16 else ''}", free_port()
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / f"{config}.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
    ] + ([] if bf16 else ["--mixed_precision", "no"])
    worker = [str(WORKER), model_dir, "launcher+beta" + ("+bf16" if bf16 else ""), str(out)]
    launchers = [
        subprocess.Popen(
            command
            + (["--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"] if machines > 1 else [])
            + worker,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_env(),
        )
        for rank in range(machines)
    ]
    for launcher in launchers:
        _, stderr = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, failure_report(stderr)
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow  # torchrun launches
def test_example_accelerate_configs_run_as_is_under_accelerate_launch(tmp_path, tiny_model_dir):
    """Every config of examples/accelerate_configs/ trains the same run (with the reference model, beta > 0) under
    `accelerate launch` on 2 CPU processes, with only the process count and precision overridden: DDP (multi_gpu:
    gloo chosen without a GPU), ZeRO-2, ZeRO-3 (partitioned while loading), FSDP2 (its GPU-only gate lifted,
    `fsdp_cpu_ram_efficient_loading` and a full state dict as in the file) and the two-machine ZeRO-3 config as two
    launchers (machine ranks 0 and 1, one process each). The ZeRO-3 and FSDP2 files also with their own bf16, within
    bf16 rounding of DDP's fp32 run."""
    runs = {
        config: accelerate_launch(tmp_path, tiny_model_dir, config)
        for config in ("multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp2")
    }
    runs["multi_node_zero3"] = accelerate_launch(tmp_path, tiny_model_dir, "multi_node_zero3", machines=2)
    ddp = runs["multi_gpu"][0]
    assert ddp["distributed_type"] == "DistributedType.MULTI_CPU"
    for config, ranks in runs.items():
        assert all(rank["world_size"] == 2 for rank in ranks), config
        assert_same_run(ranks[0], ranks[1], 0)
        assert_same_run(ddp, ranks[0], 1e-6)
        assert any(e["kl"] > 0 for e in ranks[0]["logs"])
    for config in ("deepspeed_zero2", "deepspeed_zero3", "multi_node_zero3"):
        assert runs[config][0]["distributed_type"] == "DistributedType.DEEPSPEED"
    assert runs["fsdp2"][0]["distributed_type"] == "DistributedType.FSDP"
    for config in ("deepspeed_zero3", "multi_node_zero3", "fsdp2"):  # sharded: half the weights per rank
        assert runs[config][0]["local_parameters"] <= 0.55 * ddp["local_parameters"]
        assert runs[config][0]["whole_at_generation"] == [True, True]
    # the files' own mixed precision (bf16, CPU autocast / FSDP2's bf16 policy), the script asking for bf16 too
    for config in ("deepspeed_zero3", "fsdp2"):
        ranks = accelerate_launch(tmp_path, tiny_model_dir, config, bf16=True)
        assert_same_run(ranks[0], ranks[1], 0)
        assert_same_run(ddp, ranks[0], 2e-2)  # bf16 rounding: 6.8e-3 seen (ratio/max of step 1)


def test_example_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = {path.stem: load_config_from_file(str(path)) for path in sorted(CONFIGS.glob("*.yaml"))}
    assert set(loaded) == {"multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp2", "multi_node_zero3"}
    assert loaded["deepspeed_zero3"].deepspeed_config["zero_stage"] == 3
    assert loaded["deepspeed_zero3"].deepspeed_config["zero3_init_flag"] is True
    assert loaded["fsdp2"].fsdp_config["fsdp_version"] == 2


@pytest.mark.slow  # a torchrun launch
def test_two_processes_train_on_their_own_prompts_of_a_stream(tmp_path, tiny_model_dir):
    ranks = launch(tmp_path, tiny_model_dir, "ddp+stream")
    # 3 optimizer steps, a rollout every 2 (steps_per_generation=2): 2 rollouts, each of 8 rows per process
    assert [[len(rollout) for rollout in rank["sampled_prompts"]] for rank in ranks] == [[8, 8], [8, 8]]
    prompts = []
    for rank in ranks:
        for rollout in rank["sampled_prompts"]:
            groups = [rollout[start : start + 4] for start in range(0, 8, 4)]  # num_generations=4
            assert all(len(set(group)) == 1 for group in groups), rollout  # every group whole, on one process
            prompts += [group[0] for group in groups]
    assert len(set(prompts)) == len(prompts) == 8  # no prompt on both processes, nor twice
    assert_same_run(ranks[0], ranks[1], 0)  # and the ranks train one model


@pytest.mark.slow  # a torchrun launch
def test_two_processes_sync_the_reference_alike(tmp_path, tiny_model_dir):
    ranks = launch(tmp_path, tiny_model_dir, "ddp+beta+sync")
    before, after = ranks[0]["reference_checksums"]
    assert after != before  # synced towards the trained policy after each of the 3 optimizer steps
    assert ranks[1]["reference_checksums"] == [before, after]  # every process holds the same reference
    assert_same_run(ranks[0], ranks[1], 0)
