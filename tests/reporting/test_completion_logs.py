"""gspo_trl/reporting/completion_logs.py: the completion table's columns (TRL's), log_unique_prompts, and where the
table goes:
the printout, output_dir/completions/*.parquet, wandb's and trackio's `completions` table (read back from their
offline files) and the Hub dataset upload (huggingface_hub's real CommitScheduler, with only HfApi's two HTTP calls,
create_repo and create_commit, replaced by recorders). The two-process gathering is tested under torchrun."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from datasets import Dataset
from helpers import count_digits, small_config, text_dataset, worker_env

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.reporting.completion_logs import completion_table, first_row_of_each_prompt, local_rows
from gspo_trl.scoring.advantages import group_advantages

WORKER = Path(__file__).parents[1] / "completion_log_worker.py"


def test_local_rows_take_the_first_turns_advantage_and_the_extra_columns():
    per_turn = torch.tensor([[0.5, -1.0, 0.0], [-0.5, 2.0, 0.0]])  # (n, C): the first turn's is the row's
    rows = local_rows(["p0", "p1"], ["c0", "c1"], per_turn, {"note": ["a", "b"]})
    assert rows == [
        {"prompt": "p0", "completion": "c0", "advantage": 0.5, "extra": {"note": "a"}},
        {"prompt": "p1", "completion": "c1", "advantage": -0.5, "extra": {"note": "b"}},
    ]


def test_completion_table_has_trls_columns_in_trls_order():
    rows = [
        {"prompt": "p", "completion": "a", "advantage": 1.0, "extra": {"note": "x"}},
        {"prompt": "p", "completion": "b", "advantage": -1.0, "extra": {}},  # a process that logged no column
    ]
    table = completion_table(rows, 7, ["f", "g"], [[1.0, float("nan")], [0.0, 2.0]])
    assert list(table) == ["step", "prompt", "completion", "f", "g", "note", "advantage"]
    assert table["step"] == [7, 7] and table["f"] == [1.0, 0.0] and table["note"] == ["x", None]
    assert math.isnan(table["g"][0]) and table["g"][1] == 2.0  # None from a reward function stays NaN, as in TRL
    assert table["advantage"] == [1.0, -1.0]


def test_first_row_of_each_prompt_compares_chat_prompts_by_their_messages():
    chat = [{"role": "user", "content": "hi"}]
    table = {"prompt": ["a", chat, "a", [dict(m) for m in chat], "b"], "completion": ["1", "2", "3", "4", "5"]}
    assert first_row_of_each_prompt(table) == {"prompt": ["a", chat, "b"], "completion": ["1", "2", "5"]}


def test_hub_repo_without_log_completions_is_refused(tmp_path):
    with pytest.raises(ValueError, match="log_completions_hub_repo is set but log_completions is False"):
        GSPOConfig(output_dir=str(tmp_path), log_completions_hub_repo="me/completions", use_cpu=True)


def test_hub_repo_without_a_token_is_refused_when_the_trainer_is_built(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored token either
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    config = small_config(tmp_path / "out", log_completions=True, log_completions_hub_repo="me/completions")
    with pytest.raises(ValueError, match="log_completions_hub_repo='me/completions' uploads with a Hugging Face token"):
        GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb writing offline runs under tmp_path/wandb; torn down afterwards, because wandb keeps the first
    WANDB_DIR of a process otherwise (and a later test's runs would land here)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield wandb
    wandb.finish()
    wandb.teardown()


def parquet_tables(output_dir: Path) -> dict[str, pd.DataFrame]:
    return {p.name: pd.read_parquet(p) for p in sorted((output_dir / "completions").glob("*.parquet"))}


def assert_rewards_and_advantages_match(table: pd.DataFrame, num_generations: int) -> None:
    """Each row's reward is its own completion's (count_digits), and its advantage is its group's (rows of a group
    are consecutive): the table's rows are aligned. Float32 advantages vs float64 here: within 1e-5 of values of
    order one (group-scaled advantages are at most sqrt(G-1) = 1.7 in size)."""
    assert table["count_digits"].tolist() == pytest.approx(count_digits(table["completion"].tolist()))
    rewards = torch.tensor(table["count_digits"].tolist(), dtype=torch.float32)
    expected, _ = group_advantages(rewards, num_generations)
    assert table["advantage"].tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_parquet_files_and_the_printout_hold_every_row_of_the_latest_rollout(tmp_path, tiny_model_dir, capsys):
    config = small_config(tmp_path / "out", log_completions=True, num_completions_to_print=3, max_steps=2)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()
    tables = parquet_tables(tmp_path / "out")
    # steps_per_generation=4 micro-batches of 4 rows: one rollout of 16 completions, logged at steps 1 and 2 only once
    assert list(tables) == ["completions_00001.parquet"]
    table = tables["completions_00001.parquet"]
    assert list(table.columns) == ["step", "prompt", "completion", "count_digits", "advantage"]
    assert len(table) == config.generation_batch_size and set(table["step"]) == {1}
    assert table["prompt"].nunique() == config.generation_batch_size // config.num_generations
    assert_rewards_and_advantages_match(table, config.num_generations)
    printed = capsys.readouterr().out
    assert printed.count("--- completions at step 1 ---") == 1 and printed.count("[reward") == 3


@pytest.mark.slow  # two rollouts, one sampled ahead, with LoRA and a reference pass under bf16 autocast
def test_rollouts_sampled_ahead_under_bf16_lora_and_kl_each_log_their_own_rows(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    config = small_config(
        tmp_path / "out", log_completions=True, max_steps=5, async_rollouts=True, bf16=True, beta=0.04
    )  # steps_per_generation=4: the rollouts of steps 1-4 and 5-8, logged at steps 1 and 5
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), peft_config=lora)
    trainer.train()
    tables = parquet_tables(tmp_path / "out")
    assert list(tables) == ["completions_00001.parquet", "completions_00005.parquet"]
    for table in tables.values():
        assert len(table) == 16 and table["prompt"].nunique() == 4
        assert_rewards_and_advantages_match(table, config.num_generations)
    first, second = tables.values()
    assert set(first["prompt"]).isdisjoint(second["prompt"])  # the 8 prompts, an epoch: each rollout has 4


@pytest.mark.slow  # a training step and an evaluation of two batches
def test_an_evaluation_gets_its_own_file_with_all_its_batches(tmp_path, tiny_model_dir, capsys):
    config = small_config(
        tmp_path / "out", log_completions=True, max_steps=1, eval_strategy="steps", eval_steps=1
    )  # per_device_eval_batch_size 8: the 4 eval prompts × 4 completions are two evaluation batches
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), eval_dataset=text_dataset(4)
    )
    trainer.train()
    tables = parquet_tables(tmp_path / "out")
    assert list(tables) == ["completions_00001.parquet", "completions_00001_eval.parquet"]
    evaluated = tables["completions_00001_eval.parquet"]
    assert len(evaluated) == 16 and sorted(set(evaluated["prompt"])) == sorted(text_dataset(4)["prompt"])
    assert_rewards_and_advantages_match(evaluated, 4)
    assert len(tables["completions_00001.parquet"]) == 16  # the training rollout's, not overwritten
    assert "--- eval completions at step 1 ---" in capsys.readouterr().out


def test_wandb_gets_a_completions_table_with_each_prompt_once_offline(tmp_path, tiny_model_dir, offline_wandb):
    config = small_config(
        tmp_path / "out", log_completions=True, log_unique_prompts=True, report_to="wandb", run_name="gspo-table"
    )
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()
    run_files = Path(offline_wandb.run.dir)
    offline_wandb.finish()
    written = list(run_files.rglob("completions_*.table.json"))
    assert len(written) == 1, sorted(map(str, run_files.rglob("*")))
    logged = json.loads(written[0].read_text())
    assert logged["columns"] == ["step", "prompt", "completion", "count_digits", "advantage"]
    full = parquet_tables(tmp_path / "out")["completions_00001.parquet"]
    expected = full.drop_duplicates("prompt")  # log_unique_prompts: each prompt's first row; the parquet file has all
    assert len(full) == 16 and len(logged["data"]) == len(expected) == 4
    assert [row[1:3] for row in logged["data"]] == expected[["prompt", "completion"]].values.tolist()
    assert [row[3] for row in logged["data"]] == pytest.approx(expected["count_digits"].tolist())


def test_trackio_gets_the_whole_completions_table_in_its_local_database(tmp_path, tiny_model_dir):
    from trackio.sqlite_storage import SQLiteStorage

    config = small_config(tmp_path / "out", log_completions=True, report_to="trackio", run_name="gspo-table")
    project = f"gspo-trl-tables-{tmp_path.name}"  # one project per test run: trackio's directory is shared
    config.project = project
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()  # transformers' callback ends the trackio run with training
    tables = [entry["completions"] for entry in SQLiteStorage.get_logs(project, "gspo-table") if "completions" in entry]
    assert len(tables) == 1
    assert tables[0]["_type"] == "trackio.table"
    rows = tables[0]["_value"]
    full = parquet_tables(tmp_path / "out")["completions_00001.parquet"]
    assert [row["prompt"] for row in rows] == full["prompt"].tolist() and len(rows) == 16
    assert [row["completion"] for row in rows] == full["completion"].tolist()
    assert [row["count_digits"] for row in rows] == pytest.approx(full["count_digits"].tolist())
    assert [row["advantage"] for row in rows] == pytest.approx(full["advantage"].tolist())


class TwoReplies:
    """An environment that rewards each reply with 0.5 and ends an episode after its second reply."""

    def reset(self, seed=None, options=None):
        self.turns = 0
        return "", {}

    def step(self, action):
        self.turns += 1
        return "Again.", 0.5, self.turns == 2, False, {}


@pytest.mark.slow  # episodes logged to two backends: 20-60 s on 2 cores
def test_episodes_with_chat_prompts_give_wandb_and_trackio_the_same_table(tmp_path, tiny_model_dir, offline_wandb):
    """Chat prompts (lists of messages) in every destination; the environment's return as the "env" column; with
    per-turn advantages, each row's first turn's. Both backends from one run."""
    from trackio.sqlite_storage import SQLiteStorage

    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(8)]})
    config = small_config(
        tmp_path / "out",
        log_completions=True,
        report_to=["wandb", "trackio"],
        run_name="gspo-episodes",
        max_completion_length=48,
        max_turns=3,
        importance_sampling_level="turn",
        advantage_granularity="turn",
    )
    config.project = project = f"gspo-trl-episode-tables-{tmp_path.name}"
    trainer = GSPOTrainer(tiny_model_dir, None, args=config, train_dataset=chat, env_factory=TwoReplies)
    trainer.train()
    run_files = Path(offline_wandb.run.dir)
    offline_wandb.finish()
    table = parquet_tables(tmp_path / "out")["completions_00001.parquet"]
    assert list(table.columns) == ["step", "prompt", "completion", "env", "advantage"]
    prompts = [list(map(dict, p)) for p in table["prompt"]]  # parquet holds them as lists of structs
    assert all(p == [{"role": "user", "content": p[0]["content"]}] and "Count to" in p[0]["content"] for p in prompts)
    # a return is 0.5 per reply, and an episode has one or two (the budget can end it after the first)
    assert set(table["env"]) <= {0.5, 1.0}
    logged = json.loads(next(run_files.rglob("completions_*.table.json")).read_text())
    assert logged["columns"] == list(table.columns)
    assert [row[1] for row in logged["data"]] == prompts
    tracked = [e["completions"] for e in SQLiteStorage.get_logs(project, "gspo-episodes") if "completions" in e]
    assert [row["prompt"] for row in tracked[0]["_value"]] == prompts
    assert [row["advantage"] for row in tracked[0]["_value"]] == pytest.approx(table["advantage"].tolist())


class HubRecorder:
    """Stands in for HfApi's two calls that would reach the Hub (create_repo, create_commit): records what they
    were given, the files' bytes included; `fail`: each commit raises instead, as on a lost connection."""

    def __init__(self, monkeypatch, fail: bool = False):
        from huggingface_hub import HfApi

        self.repos, self.commits, self.fail = [], [], fail
        monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: self.create_repo(api, repo_id, **kw))
        monkeypatch.setattr(
            HfApi, "create_commit", lambda api, repo_id, operations, **_: self.commit(repo_id, operations)
        )

    def create_repo(self, api, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        self.repos.append((repo_id, kwargs.get("repo_type"), kwargs.get("private"), api.token))
        return RepoUrl(f"https://huggingface.co/datasets/{repo_id}")

    def commit(self, repo_id, operations):
        if self.fail:
            raise ConnectionError("the Hub is unreachable")
        files = {}
        for operation in operations:
            source = operation.path_or_fileobj
            files[operation.path_in_repo] = source.read() if hasattr(source, "read") else Path(source).read_bytes()
        self.commits.append((repo_id, files))


def test_hub_upload_sends_the_card_and_the_parquet_files(tmp_path, tiny_model_dir, monkeypatch):
    """huggingface_hub's CommitScheduler runs for real; only HfApi's two calls that would reach the Hub record what
    they were given. The token is the hub_token field's, and nothing is left to upload once training ends."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub = HubRecorder(monkeypatch)
    config = small_config(
        tmp_path / "out",
        log_completions=True,
        log_completions_hub_repo="me/completions",
        hub_private_repo=True,
        hub_token="hf_test_token_not_sent_anywhere",
    )
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    try:
        trainer.train()  # its end uploads what the scheduler has not sent yet
    finally:
        trainer.completion_log.uploader.stop()  # no upload at interpreter exit, after the recorder is gone
    assert hub.repos == [("me/completions", "dataset", True, "hf_test_token_not_sent_anywhere")]
    uploaded = {name: content for _, files in hub.commits for name, content in files.items()}
    assert {repo for repo, _ in hub.commits} == {"me/completions"}
    assert set(uploaded) == {"README.md", "completions_00001.parquet"}
    assert b"gspo-trl" in uploaded["README.md"] and b"trl-logs" in uploaded["README.md"]
    local = tmp_path / "out" / "completions" / "completions_00001.parquet"
    assert uploaded["completions_00001.parquet"] == local.read_bytes()


def test_a_failed_upload_at_the_end_of_training_warns_and_keeps_the_files(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_not_sent_anywhere")
    HubRecorder(monkeypatch, fail=True)
    config = small_config(tmp_path / "out", log_completions=True, log_completions_hub_repo="me/completions")
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    try:
        trainer.train()  # returns: the model can still be saved
    finally:
        trainer.completion_log.uploader.stop()
    assert "Uploading the completion tables to me/completions failed (the Hub is unreachable)" in caplog.text
    assert (tmp_path / "out" / "completions" / "completions_00001.parquet").is_file()


@pytest.mark.slow  # a torchrun launch
def test_two_processes_log_every_row_once_on_the_main_process(tmp_path, tiny_model_dir):
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
        *(str(WORKER), tiny_model_dir, str(tmp_path)),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=worker_env())
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["printed"] for r in results] == [True, False]  # the printout is the main process's only
    tables = parquet_tables(tmp_path / "out")
    assert list(tables) == ["completions_00001.parquet"]
    table = tables["completions_00001.parquet"]
    # 2 processes × 4 micro-batches × 2 rows: 16 rows, each process's 8 in process order
    assert len(table) == results[0]["generation_batch_size"] == 16
    assert table["prompt"].tolist() == results[0]["prompts"] + results[1]["prompts"]
    assert_rewards_and_advantages_match(table, 4)
    # rank 1's reward function logged a column and rank 0's did not: missing (None, read back as NA) on rank 0's rows
    assert table["rank"].isna().tolist() == [True] * 8 + [False] * 8 and table["rank"][8:].tolist() == ["1"] * 8
    # log_metric as in TRL: the mean over every call on every process, (1 + 4 + 4) / 3; a metric one process logged
    # is the mean of its calls. Logged by the main process, with the rollout's other metrics.
    first_log = results[0]["log_history"][0]
    assert first_log["per_rank"] == 3.0 and first_log["rank_1_only"] == 5.0
