"""Smoke runs of the benchmarks that can run in seconds (figures meaningless; the measured ones live in docs):
the GPU suite's CPU mode, with both libraries' workers, the static-decoding agreement check, the sharded and offload
cells of the distributed benchmark, the decoding, async-rollouts and training-length benchmarks, the training
micro-batch's settings, and the QLoRA memory benchmark; the delta-sync benchmark's counting."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a benchmark's smoke run
def test_gpu_suite_smoke_runs_on_cpu(tmp_path):
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "gpu_suite.py"),
        "--device",
        "cpu",
        "--smoke",
        "--gradient_checkpointing",
        "--out_dir",
        str(tmp_path),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads((tmp_path / "tiny_8.json").read_text())
    finished = {run["impl"]: run["result"]["figures"] for run in data["runs"] if "result" in run}
    assert set(finished) == {"ours", "trl"}
    for figures in finished.values():
        assert figures["round_s"] > figures["generate_s"] > 0 and figures["train_s"] > 0
        assert figures["completion_tokens"] == 64 * 8  # random weights: every completion runs to the cap
    # --gradient_checkpointing reached both trainers' training phase
    assert all(run["result"]["checkpointing_during_training"] for run in data["runs"] if "result" in run)
    assert "| tiny, 8 |" in (tmp_path / "summary.md").read_text()


def test_gpu_suite_summary_of_a_cell_run_by_one_library():
    # --impls ours (a cell TRL cannot run): our figures alone, not "failed".
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    row = {key: {"ours": 2.0, "trl": None, "ratio": None} for key, _ in gpu_suite.SUMMARY}
    row["mfu"]["ours"] = 0.25
    table = gpu_suite.format_summary({("smollm2-1.7b", 4096): {**row, "failed": [], "impls": ["ours"]}})
    assert "| smollm2-1.7b, 4096 | ours 2 s | ours 2 s | ours 2 s | ours 25% | ours 2 GiB |" in table
    both = gpu_suite.format_summary({("tiny", 8): {**row, "failed": [], "impls": ["ours", "trl"]}})
    assert "| tiny, 8 | failed | failed |" in both  # TRL was to run and gave nothing


@pytest.mark.slow  # a benchmark's smoke run
def test_static_decoding_benchmark_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "static.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "static_decoding_gpu.py"),
        "--device",
        "cpu",
        "--smoke",
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    agreement = json.loads(out.read_text())["agreement"]
    assert set(agreement) == {"fp32", "bf16 weights", "fp32 weights, bf16 autocast"}
    assert all(cell["graphs_equal_eager_static"] for cell in agreement.values())  # no graphs on CPU: same loop
    assert agreement["fp32"]["token_agreement_with_dynamic"] == 1.0


@pytest.mark.slow  # a benchmark's smoke run
def test_distributed_benchmark_smoke_runs_the_sharded_cells(tmp_path, tiny_model_dir):
    # ZeRO-3 and FSDP2 on 2 processes (FSDP2 has no 1-process cell: the driver skips it)
    out = tmp_path / "distributed.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "distributed.py"),
        "--modes",
        "zero3,fsdp2",
        "--processes",
        "1,2",
        "--rollouts",
        "1",
        "--max_completion_length",
        "4",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["processes"], r["rank"]) for r in rows] == [
        ("zero3", 1, 0),
        ("zero3", 2, 0),
        ("zero3", 2, 1),
        ("fsdp2", 2, 0),
        ("fsdp2", 2, 1),
    ], rows
    assert [r["distributed_type"] for r in rows[3:]] == ["DistributedType.FSDP"] * 2
    for row in rows:
        assert row["parameter_share"] < 0.6 or row["processes"] == 1
        assert row["tensor_mib"] > 0 and row["step_s"] > 0 and row["peak_rss_mib"] > row["tensor_mib"]
    for first, second in (rows[1:3], rows[3:5]):
        assert first["reward"] == second["reward"]  # metrics reduced over ranks
    # layout-independent sampling: the first rollout is the same whatever the process count and sharding
    assert rows[0]["reward"][0] == rows[1]["reward"][0] == rows[3]["reward"][0]


@pytest.mark.slow  # a benchmark's smoke run
def test_decoding_benchmark_smoke_runs_both_loops(tmp_path, tiny_model_dir):
    out = tmp_path / "decoding.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "decoding.py"),
        "--repeats",
        "1",
        "--prompts",
        "2",
        "--max_completion_length",
        "4",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["gspo"]["median_s"] > 0 and summary["generate"]["median_s"] > 0
    assert 0 < summary["gspo"]["mean_length"] <= 4


@pytest.mark.slow  # a benchmark's smoke run
def test_decoding_benchmark_runs_the_ab_loops(tmp_path, tiny_model_dir):
    # A smoke test of --loops: the growing buffers themselves are tested against DynamicLayer in
    # test_decoding_dynamic.py, the linear layers' forms in test_decoding_cpu_linear.py (the tiny model's weights are
    # too small for them to apply).
    out = tmp_path / "ab.json"
    loops = "gspo,gspo_full_buffers,gspo_plain_linears,gspo_module_forward"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "decoding.py"),
        "--repeats",
        "1",
        "--prompts",
        "2",
        "--max_completion_length",
        "8",
        "--loops",
        loops,
        "--layout_independent_sampling",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"gspo", "gspo_full_buffers", "gspo_plain_linears", "gspo_module_forward"}
    assert (
        summary["gspo"]["mean_length"]
        == summary["gspo_full_buffers"]["mean_length"]
        == summary["gspo_plain_linears"]["mean_length"]
        == summary["gspo_module_forward"]["mean_length"]
        > 0
    )
    assert "| gspo_full_buffers |" in completed.stdout and "| gspo_module_forward |" in completed.stdout


@pytest.mark.slow  # a benchmark's smoke run
def test_decode_step_benchmark_smoke_times_the_four_forms(tmp_path, tiny_model_dir):
    out = tmp_path / "step.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "decode_step.py"),
        "--rows",
        "1,2",
        "--contexts",
        "8",
        "--repeats",
        "1",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert [(step["rows"], step["context"]) for step in steps] == [(1, 8), (2, 8)]
    assert all(
        step["plain_ms"] > 0
        and step["decode_linear_ms"] > 0
        and step["packed_gqa_ms"] > 0
        and step["step_forward_ms"] > 0
        for step in steps
    )
    assert "| 2 | 8 |" in completed.stdout


@pytest.mark.slow  # a benchmark's smoke run
def test_episode_rollout_benchmark_smoke_runs_the_three_ways(tmp_path, tiny_model_dir):
    out = tmp_path / "episodes.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "episode_rollout.py"),
        "--env",
        "retry",
        "--repeats",
        "1",
        "--prompts",
        "1",
        "--max_completion_length",
        "24",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"turn cache", "shared prefixes", "identical rows"}
    assert all(row["seconds_median"] > 0 and row["turns_per_episode"] >= 1 for row in summary.values())


@pytest.mark.slow  # a benchmark's smoke run
def test_async_rollouts_benchmark_smoke_runs_both_modes(tmp_path, tiny_model_dir):
    out = tmp_path / "async.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "async_rollouts.py"),
        "--repeats",
        "1",
        "--rounds",
        "3",
        "--max_completion_length",
        "4",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [run["mode"] for run in record["runs"]] == ["sync", "async"]
    assert record["median"]["sync"]["mean_staleness"] is None
    # Steps 0-3 train on the first rollout (staleness 0-3), the two others were sampled 4 steps ahead (4-7).
    assert record["median"]["async"]["mean_staleness"] == pytest.approx((0 + 1 + 2 + 3 + 2 * (4 + 5 + 6 + 7)) / 12)
    assert all(run["seconds_per_round"] > 0 and len(run["rewards_per_rollout"]) == 3 for run in record["runs"])
    assert all(len(run["mean_completion_length_per_rollout"]) == 3 for run in record["runs"])
    assert all(1 <= length <= 4 for run in record["runs"] for length in run["mean_completion_length_per_rollout"])


@pytest.mark.slow  # a benchmark's smoke run
def test_train_length_benchmark_smoke_runs_both_layouts(tmp_path, tiny_model_dir):
    out = tmp_path / "train_length.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "train_length.py"),
        "--lengths",
        "8",
        "16",
        "--completions",
        "2",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["length"], r["layout"]) for r in rows] == [(8, "packed"), (8, "padded"), (16, "packed"), (16, "padded")]
    assert all(r["seconds"] > 0 and r["tokens"] == 2 * r["length"] for r in rows)


@pytest.mark.slow  # a benchmark's smoke run
def test_train_length_benchmark_smoke_runs_each_checkpointing(tmp_path, tiny_model_dir):
    out = tmp_path / "train_length.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "train_length.py"),
        "--lengths",
        "8",
        "--layouts",
        "packed",
        "--checkpointing",
        "none",
        "full",
        "keep_attention",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["checkpointing"] for r in rows] == ["none", "full", "keep_attention"]
    assert all(r["seconds"] > 0 for r in rows)


@pytest.mark.slow  # a benchmark's smoke run
def test_packed_microbatch_benchmark_smoke_runs_two_passes(tmp_path, tiny_model_dir):
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "packed_microbatch.py"),
        "--lengths",
        "24",
        "--short",
        "3",
        "--short_length",
        "4",
        "--model",
        tiny_model_dir,
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    # 24 + 3 x 4 tokens after one 60-token prompt (a completion's last token is no input): one row of 92 positions.
    assert lines[0]["layout"] == [
        {"completions": 4, "rows": 1, "positions_per_row": 92, "real_tokens": 92, "dense_mask": True}
    ]  # one forward: cutting would not save 10%
    assert [line["pass"] for line in lines[1:]] == [0, 1]
    assert all(line["after_backward"]["peak_mib"] > 0 for line in lines[1:])


@pytest.mark.slow  # a benchmark's smoke run
def test_distributed_benchmark_smoke_runs_zero_offload_on_a_random_architecture(tmp_path):
    # the GPU row's cell (ZeRO-3 with optimizer and parameter offload, one process, a random-init architecture
    # on synthetic prompts), here on CPU
    out = tmp_path / "distributed.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "distributed.py"),
        "--modes",
        "zero3_offload",
        "--processes",
        "1",
        "--architecture",
        "tiny",
        "--rollouts",
        "1",
        "--max_completion_length",
        "4",
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["work"]["model"] == "tiny (random init)"
    assert record["deepspeed"]["zero3_offload"]["zero_optimization"]["offload_param"] == {"device": "cpu"}
    [row] = record["rows"]
    assert row["mode"] == "zero3_offload" and row["distributed_type"] == "DistributedType.DEEPSPEED"
    assert row["step_s"] > 0 and len(row["reward"]) == 2  # the warm-up rollout and the timed one


@pytest.mark.slow  # a benchmark's smoke run
def test_train_microbatch_benchmark_smoke_times_every_setting(tmp_path, tiny_model_dir):
    out = tmp_path / "train_microbatch.json"
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "train_microbatch.py"),
        "--rounds",
        "1",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record["times_s"]) == {"default", "recompute", "one_row", "one_row_recompute"}
    assert all(len(times) == 1 and times[0] > 0 for times in record["times_s"].values())
    assert record["layouts"]["one_row"][0][0] == 1  # attention free: the whole micro-batch in one row


@pytest.mark.slow  # a benchmark's smoke run
def test_qlora_memory_benchmark_smoke_run(tmp_path):
    pytest.importorskip("bitsandbytes")  # the dev extra installs it (CI's set-up)
    out = tmp_path / "qlora_memory.json"
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "qlora_memory.py"), "--smoke", "--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    rows = {row["weights"]: row for row in json.loads(out.read_text())["rows"]}
    per_parameter = {name: row["linear_bytes"] / row["linear_parameters"] for name, row in rows.items()}
    assert per_parameter["fp32"] == 4 and per_parameter["bf16"] == 2
    # NF4: 0.5 for the codes + 4/64 for the block scales, plus each layer's 16-entry fp32 code table: 14 layers × 64
    # bytes over the tiny model's 73,728 linear weights (2 layers × (64·64·2 + 64·32·2 + 3·64·128)).
    assert per_parameter["NF4"] == pytest.approx(0.5 + 4 / 64 + 14 * 64 / 73728, rel=1e-12)
    assert len({row["parameters"] for row in rows.values()}) == 1  # the same model, counted alike each way
    assert rows["fp32"]["model_bytes"] > rows["bf16"]["model_bytes"] > rows["NF4"]["model_bytes"]


@pytest.mark.slow  # a benchmark's smoke run
def test_dynamic_sampling_benchmark_smoke_runs_both_variants(tmp_path, tiny_model_dir):
    out = tmp_path / "dynamic_sampling.json"
    script = str(REPO_ROOT / "benchmarks" / "dynamic_sampling.py")
    flags = ["--max_steps", "1", "--max_completion_length", "4", "--model_name_or_path", tiny_model_dir]
    completed = subprocess.run(
        [sys.executable, script, *flags, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["variant"] for run in runs] == ["off", "on"]
    off, on = (run["steps"][0] for run in runs)
    assert off["wall_s"] > 0 and on["wall_s"] > 0 and "rollout/dynamic_sampling_rounds" not in off
    assert 1 <= on["rollout/dynamic_sampling_rounds"] <= 4  # dynamic_sampling_max_rounds=4
    assert 0 <= on["rollout/dynamic_sampling_filler_groups"] <= 8  # a rollout of 8 groups
    assert on["rollout/sampled_tokens_per_trained_token"] >= 1


def test_delta_sync_counts_the_changed_bf16_elements_and_each_encodings_bytes():
    spec = importlib.util.spec_from_file_location("delta_sync", REPO_ROOT / "benchmarks" / "delta_sync.py")
    delta_sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(delta_sync)
    last = {"a": torch.zeros(16, dtype=torch.bfloat16), "b": torch.ones(2, 5, dtype=torch.bfloat16)}
    now = {name: tensor.clone() for name, tensor in last.items()}
    now["a"][[1, 5, 9]] = 1.0
    now["b"][0, 0] = 1.0078125  # the next bf16 after 1.0: one bit apart still counts as changed
    result = delta_sync.compare(last, now)
    assert (result["elements"], result["changed"]) == (26, 4)
    assert result["unchanged_fraction"] == 22 / 26
    # dense: 26 x 2 bytes; indices: 4 x (4 + 2); bitmask: each tensor's mask in whole bytes (16 bits: 2; 10 bits: 2),
    # then 4 x 2 bytes of values.
    assert [result[key] * 2**20 for key in ("dense_mb", "indices_mb", "bitmask_mb")] == [52, 24, 12]
