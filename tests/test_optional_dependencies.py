"""The library needs none of the demo's packages (the `demo` extra: gguf, reasoning-gym, matplotlib): with them
made unimportable, `import gspo_trl`, a training run on a user's model and the `gspo-trl train` command with a user's
model, data and rewards work, and the demo itself stops with an error naming the extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import json, sys
    BLOCKED = ("gguf", "reasoning_gym", "matplotlib")
    for name in BLOCKED:
        sys.modules[name] = None  # `import name` fails; importlib.util.find_spec(name) is None
    sys.path.insert(0, {tests!r})
    from datasets import Dataset
    from helpers import count_digits, small_config, text_dataset

    import gspo_trl
    from gspo_trl import GSPOTrainer
    from gspo_trl.demo.cli import main

    out = {{}}
    trainer = GSPOTrainer({model!r}, count_digits, args=small_config({tmp!r} + "/lib", max_steps=1),
                          train_dataset=text_dataset())
    trainer.train()
    out["library_steps"] = trainer.state.global_step
    data = {tmp!r} + "/prompts.jsonl"
    Dataset.from_dict({{"prompt": ["Say 1", "Say 2", "Say 3", "Say 4"]}}).to_json(data)
    out["cli_code"] = main(["train", "--model_name_or_path", {model!r}, "--dataset_name", data, "--reward_funcs",
                            "helpers:count_digits", "--output_dir", {tmp!r} + "/cli", "--max_steps", "1",
                            "--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation",
                            "1", "--max_completion_length", "4", "--disable_tqdm", "true", "--save_strategy", "no"])
    try:
        main(["train", "--max_steps", "1"])
        out["demo_error"] = None
    except ImportError as error:
        out["demo_error"] = str(error)
    out["imported"] = sorted(name for name in BLOCKED if sys.modules.get(name) is not None)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow  # a fresh interpreter that imports TRL and trains
def test_the_library_and_the_command_run_without_the_demo_packages(tmp_path, tiny_model_dir):
    script = SCRIPT.format(tests=str(TESTS), model=tiny_model_dir, tmp=str(tmp_path))
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["library_steps"] == 1
    assert result["cli_code"] == 0
    assert "reward curve not drawn: it needs matplotlib (pip install 'gspo-trl[demo]')" in completed.stdout
    assert not (tmp_path / "cli" / "reward_curve.png").exists()
    assert json.loads((tmp_path / "cli" / "metrics.json").read_text())["summary"]["steps"] == 1
    assert result["demo_error"] is not None and "gguf" in result["demo_error"]
    assert "pip install 'gspo-trl[demo]'" in result["demo_error"]
    assert result["imported"] == []
