"""The completion log of `log_completions`: a rollout's rows gathered to the main process, then at each log printed,
written to `output_dir/completions/completions_<step>.parquet` (TRL's layout), logged as a `completions` table to
wandb and trackio when they are in `report_to`, and uploaded to a Hub dataset repository
(`log_completions_hub_repo`).

Owns the table's columns (TRL's: step, prompt, completion, each reward function's reward, the columns reward
functions added with `log_extra`, advantage) and where the table goes. The numbers come from
`scoring.RolloutScores`; the scalar metrics are `metrics`'.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

COMPLETIONS_FOLDER = "completions"
HUB_UPLOAD_MINUTES = 2  # TRL's interval between two uploads of the completions folder


def local_rows(prompts, texts, advantages: torch.Tensor, extra_columns: dict[str, list]) -> list[dict]:
    """This process's rows: prompt, completion, advantage (per-turn advantages (n, C): the first turn's) and the
    columns its reward functions logged."""
    advantages = advantages if advantages.dim() == 1 else advantages[:, 0]
    return [
        {"prompt": p, "completion": c, "advantage": a, "extra": {k: v[i] for k, v in extra_columns.items()}}
        for i, (p, c, a) in enumerate(zip(prompts, texts, advantages.tolist()))
    ]


def gather_to_main(rows: list, accelerator) -> list | None:
    """Every process's `rows`, in process order, on the main process (None on the others): one collective that
    sends each process's rows to the main process only."""
    if accelerator.num_processes == 1:
        return rows
    parts = [None] * accelerator.num_processes if accelerator.is_main_process else None
    torch.distributed.gather_object(rows, parts, dst=0)
    return None if parts is None else [row for part in parts for row in part]


def completion_table(rows: list[dict], step: int, reward_names: list[str], rewards_per_func: list[list]) -> dict:
    """TRL's table as columns: step, prompt, completion, one column per reward function (`rewards_per_func`: a row
    per completion; NaN where the function gave None), one per `log_extra` column (None on rows that did not set
    it), advantage."""
    extra_names = sorted({name for row in rows for name in row["extra"]})
    table = {
        "step": [step] * len(rows),
        "prompt": [row["prompt"] for row in rows],
        "completion": [row["completion"] for row in rows],
    }
    for index, name in enumerate(reward_names):
        table[name] = [float(values[index]) for values in rewards_per_func]
    for name in extra_names:
        table[name] = [row["extra"].get(name) for row in rows]
    table["advantage"] = [row["advantage"] for row in rows]
    return table


def first_row_of_each_prompt(table: dict) -> dict:
    """`log_unique_prompts`: the table without the rows whose prompt an earlier row has (prompts compared as text,
    so chat prompts compare by their messages)."""
    seen, keep = set(), []
    for index, prompt in enumerate(table["prompt"]):
        if str(prompt) not in seen:
            seen.add(str(prompt))
            keep.append(index)
    return {name: [column[i] for i in keep] for name, column in table.items()}


def print_completions(table: dict, reward_names: list[str], totals: list[float], limit: int | None, title: str):
    """Under `title`, the first `limit` rows (all: None) as one line each: total reward, advantage and `log_extra`
    columns, then the prompt (a chat prompt's last message) and the completion."""
    extra_names = [name for name in table if name not in {"step", "prompt", "completion", "advantage", *reward_names}]
    print(f"--- {title} ---")
    for index in range(min(len(totals), limit or len(totals))):
        prompt = table["prompt"][index]
        if isinstance(prompt, list):
            prompt = prompt[-1]["content"]
        notes = "".join(f" | {name} {table[name][index]}" for name in extra_names)
        scores = f"[reward {totals[index]:+.3f} | advantage {table['advantage'][index]:+.3f}{notes}]"
        print(f"{scores} {prompt!r} -> {table['completion'][index]!r}")


def dataset_card(repo_id: str) -> str:
    """The README.md of the completions dataset: tags, and what one parquet file holds."""
    from huggingface_hub import DatasetCardData

    data = DatasetCardData(pretty_name="gspo-trl completion logs", tags=["gspo-trl", "trl-logs", "completions"])
    return (
        f"---\n{data.to_yaml()}\n---\n\n# Completions logged by gspo-trl\n\n"
        f"`{repo_id}` holds one parquet file per log step (`completions_<step>.parquet`): the step, each prompt and "
        "completion, each reward function's reward, the columns reward functions logged, and the advantage.\n"
    )


def hub_uploader(repo_id: str, folder: Path, private: bool | None, token: str):
    """A `huggingface_hub.CommitScheduler` that uploads `folder`'s parquet files and dataset card to the dataset
    repository `repo_id` (created if missing) every `HUB_UPLOAD_MINUTES` and when the process exits."""
    from huggingface_hub import CommitScheduler, HfApi

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(dataset_card(repo_id), encoding="utf-8")
    return CommitScheduler(
        repo_id=repo_id,
        repo_type="dataset",
        folder_path=folder,
        every=HUB_UPLOAD_MINUTES,
        private=private,
        allow_patterns=["*.parquet", "README.md"],
        hf_api=HfApi(token=token),
    )


def upload_token(repo_id: str, hub_token: str | None) -> str:
    """The token the upload uses: `hub_token` (a `TrainingArguments` field), else the one `hf auth login` stored or
    HF_TOKEN; a `ValueError` naming the field when there is none."""
    from huggingface_hub import get_token

    token = hub_token or get_token()
    if token is None:
        raise ValueError(
            f"log_completions_hub_repo={repo_id!r} uploads with a Hugging Face token, and none is set: run "
            "`hf auth login`, set HF_TOKEN or hub_token to a token with write access, or leave "
            "log_completions_hub_repo unset."
        )
    return token


class CompletionLog(TrainerCallback):
    """The latest rollout's completion table, kept on the main process until the next log writes it; as a
    callback, it uploads what is left to the Hub when training ends."""

    def __init__(self, args, accelerator):
        self.args, self.accelerator = args, accelerator
        self.folder = Path(args.output_dir) / COMPLETIONS_FOLDER
        self.latest: tuple | None = None  # (mode, rows, reward names, reward-function table, total rewards)
        self.uploader = None
        if args.log_completions_hub_repo is not None:
            token = upload_token(args.log_completions_hub_repo, args.hub_token)  # every process: all of them stop
            if accelerator.is_main_process:
                self.uploader = hub_uploader(args.log_completions_hub_repo, self.folder, args.hub_private_repo, token)

    def record(self, mode: str, prompts, texts, scores, extra_columns: dict, reward_names: list[str], table):
        """Keep a scored `mode` rollout's rows (called on every process: it gathers them), after the earlier batches'
        of the same evaluation. `scores`: its
        `scoring.RolloutScores`; `table`: the (N, F) reward-function table over every process whose columns are
        `reward_names` (`metrics.reward_columns`)."""
        rows = gather_to_main(local_rows(prompts, texts, scores.advantages, extra_columns), self.accelerator)
        if rows is None:
            return
        rewards_per_func, totals = table.tolist(), scores.rewards.tolist()
        if mode == "eval" and self.latest is not None and self.latest[0] == "eval":  # the evaluation's next batch
            _, earlier_rows, _, earlier_rewards, earlier_totals = self.latest
            rows, rewards_per_func = earlier_rows + rows, earlier_rewards + rewards_per_func
            totals = earlier_totals + totals
        self.latest = (mode, rows, list(reward_names), rewards_per_func, totals)

    def write(self, step: int, eval_prefix: str = "eval") -> None:
        """At a log, on the main process: print the latest rollout's rows, write them as a parquet file and log
        them as a table to wandb and trackio. An evaluation rollout's go to `completions_<step>_eval.parquet` and
        the `eval/completions` table, so that the training table of the same step stays; with several evaluation
        datasets, each under its metric prefix (`eval_prefix`: `completions_<step>_eval_<name>.parquet`,
        `eval_<name>/completions`), so that no dataset's table replaces another's."""
        if self.latest is None or not self.accelerator.is_main_process:
            return
        mode, rows, reward_names, rewards_per_func, totals = self.latest
        self.latest = None
        table = completion_table(rows, step, reward_names, rewards_per_func)
        prefix, suffix = ("", "") if mode == "train" else (f"{eval_prefix} ", f"_{eval_prefix}")
        title = f"{prefix}completions at step {step}"
        print_completions(table, reward_names, totals, self.args.num_completions_to_print, title)
        import pandas as pd

        self.folder.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(table).to_parquet(self.folder / f"completions_{step:05d}{suffix}.parquet")
        shown = first_row_of_each_prompt(table) if self.args.log_unique_prompts else table
        key = "completions" if mode == "train" else f"{eval_prefix}/completions"
        for backend in tracking_backends(self.args.report_to):
            backend.log({key: backend.Table(dataframe=pd.DataFrame(shown))})

    def on_train_end(self, args, state, control, **kwargs):
        if self.uploader is None:
            return
        try:  # a failed upload must not lose the trained model: the script goes on to save it
            self.uploader.trigger().result()
        except Exception as error:
            logger.warning(
                f"Uploading the completion tables to {self.uploader.repo_id} failed ({error}); they are in "
                f"{self.folder}, and another upload is tried when the process exits."
            )


def tracking_backends(report_to: list[str]) -> list:
    """The modules the table is logged to: wandb with a run started (transformers' callback starts it) and trackio,
    each when in `report_to`."""
    backends = []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            backends.append(wandb)
    if "trackio" in report_to:
        import trackio

        backends.append(trackio)
    return backends
