"""The docs stay true to the code: the generated config reference, help texts, TRL field names, and the
claims that docs/migrating-from-trl.md makes about TRL's `GRPOConfig` (checked against the installed TRL)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import json
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Trainer
from trl import GRPOConfig, GRPOTrainer

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.reporting.metrics import LOSS_STAT_NAMES, SAMPLING_STAT_NAMES, completion_length_metrics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MIGRATION = DOCS / "migrating-from-trl.md"

# Concepts that GSPOConfig shares with TRL's GRPOConfig: they must keep TRL's names.
SHARED_WITH_TRL = [
    "num_generations",
    "per_device_train_batch_size",
    "steps_per_generation",
    "generation_batch_size",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "epsilon",
    "epsilon_high",
    "beta",
    "use_bias_correction_kl",
    "scale_rewards",
    "reward_weights",
    "mask_truncated_completions",
    "importance_sampling_level",
    "log_completions",
    "log_unique_prompts",
    "log_completions_hub_repo",
]
# Rows the defaults table of the migration guide must have.
REQUIRED_DEFAULT_ROWS = {
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "steps_per_generation",
    "loss_type",
    "disable_dropout",
    "bf16",
    "gradient_checkpointing",
    "learning_rate",
}
# Fields whose value differs only because another listed field differs (explained in the guide's prose).
DERIVED_FIELDS = {"generation_batch_size"}
GRADIENT_ACCUMULATION = 3  # != 1, so that "4 × gradient_accumulation_steps" is really checked
CUDA_BF16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _table(text: str, header: list[str]) -> list[list[str]]:
    """Body rows of the first markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[: len(header)] == header:
            rows = []
            for row in lines[index + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            return rows
    raise AssertionError(f"no table with header {header} in {MIGRATION.name}")


@pytest.fixture(scope="module")
def migration_text() -> str:
    return MIGRATION.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def default_configs(tmp_path_factory):
    """(GSPOConfig, GRPOConfig) built with only output_dir and gradient_accumulation_steps set."""
    kwargs = dict(
        output_dir=str(tmp_path_factory.mktemp("docs-config")), gradient_accumulation_steps=GRADIENT_ACCUMULATION
    )
    if not CUDA_BF16:
        kwargs["use_cpu"] = True  # TRL's bf16=True default refuses to construct without a bf16 GPU otherwise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's gradient_checkpointing default is a deprecated alias
        return GSPOConfig(**kwargs), GRPOConfig(**kwargs)


# --- docs/config.md ----------------------------------------------------------------------------


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_up_to_date():
    expected = _load_generator().render_config_reference()
    actual = (DOCS / "config.md").read_text(encoding="utf-8")
    assert actual == expected, "docs/config.md is stale: run `python docs/gen_config_reference.py`"


def test_config_reference_lists_every_declared_field():
    rendered = _load_generator().render_config_reference()
    for name in GSPOConfig.__dict__["__annotations__"]:
        assert f"| `{name}` |" in rendered, name


def test_every_declared_field_has_help():
    declared = GSPOConfig.__dict__["__annotations__"]
    assert declared, "GSPOConfig declares no fields?"
    missing = [name for name in declared if not GSPOConfig.__dataclass_fields__[name].metadata.get("help", "").strip()]
    assert not missing, f"GSPOConfig fields without metadata help: {missing}"


def test_shared_fields_keep_trl_names():
    missing_here = [name for name in SHARED_WITH_TRL if name not in _field_names(GSPOConfig)]
    missing_in_trl = [name for name in SHARED_WITH_TRL if name not in _field_names(GRPOConfig)]
    assert not missing_here, f"GSPOConfig lacks TRL's field names {missing_here}"
    assert not missing_in_trl, f"TRL's GRPOConfig no longer has {missing_in_trl}: update SHARED_WITH_TRL and the docs"


# A field's help is one or two sentences (as TRL's); explanations belong in the docs page it points to.
MAX_HELP_SENTENCES, MAX_HELP_WORDS = 2, 60
_ABBREVIATION = re.compile(r"\b(?:e\.g|i\.e|vs|cf|etc|Eq)\.", re.IGNORECASE)
_SENTENCE_BREAK = re.compile(r"[.!?][)'\"]*\s+(?=[A-Z0-9'\"`(])")
_DOCS_POINTER = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")


def _sentences(text: str) -> int:
    return len(_SENTENCE_BREAK.split(_ABBREVIATION.sub("abbr", text.strip())))


def _heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown page (code fences skipped)."""
    anchors, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6}\s+(.+?)\s*$", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-"))
    return anchors


def test_sentence_counter():
    assert _sentences("Keep it short (e.g. 0.5); None: off. See docs/vllm.md#set-up.") == 2
    assert _sentences("'a' (i.e. one) vs. 'b'. 'c' is off. Three.") == 3


def test_every_declared_field_help_is_one_or_two_sentences():
    too_long, pointers = [], []
    for name in GSPOConfig.__dict__["__annotations__"]:
        text = GSPOConfig.__dataclass_fields__[name].metadata["help"]
        if _sentences(text) > MAX_HELP_SENTENCES or len(text.split()) > MAX_HELP_WORDS:
            too_long.append(f"{name} ({_sentences(text)} sentences, {len(text.split())} words)")
        assert "%" not in text, f"{name}: argparse expands '%' in help texts (`gspo-trl train --help` would fail)"
        pointers += [(name, *match.groups()) for match in _DOCS_POINTER.finditer(text)]
    assert not too_long, f"help texts longer than {MAX_HELP_SENTENCES} sentences / {MAX_HELP_WORDS} words: {too_long}"
    assert pointers, "no help text points to a docs section?"
    for name, page, anchor in pointers:
        assert (DOCS / page).is_file(), f"{name}: docs/{page} does not exist"
        assert anchor is None or anchor in _heading_anchors(DOCS / page), f"{name}: no heading #{anchor} in docs/{page}"


# --- docs/migrating-from-trl.md ----------------------------------------------------------------


def _claimed_value(expression: str):
    namespace = {"gradient_accumulation_steps": GRADIENT_ACCUMULATION, "cuda_bf16": CUDA_BF16}
    return eval(expression.replace("×", "*"), {"__builtins__": {}}, namespace)  # noqa: S307 (our own doc)


def test_migration_defaults_table_matches_both_classes(migration_text, default_configs):
    gspo, grpo = default_configs
    rows = _table(migration_text, ["field", "GSPOConfig", "GRPOConfig (TRL)"])
    documented = set()
    for row in rows:
        names = _code_spans(row[0])
        assert names, f"row without a field name: {row}"
        gspo_claim, grpo_claim = _code_spans(row[1])[0], _code_spans(row[2])[0]
        for name in names:
            documented.add(name)
            assert hasattr(gspo, name) and hasattr(grpo, name), f"{MIGRATION.name}: {name!r} is not a field of both"
            assert getattr(gspo, name) == _claimed_value(gspo_claim), (
                f"{MIGRATION.name}: GSPOConfig.{name} is {getattr(gspo, name)!r}, the doc says {gspo_claim}"
            )
            assert getattr(grpo, name) == _claimed_value(grpo_claim), (
                f"{MIGRATION.name}: GRPOConfig.{name} is {getattr(grpo, name)!r}, the doc says {grpo_claim}"
            )
    assert REQUIRED_DEFAULT_ROWS <= documented, f"defaults table lacks {sorted(REQUIRED_DEFAULT_ROWS - documented)}"

    shared = _field_names(GSPOConfig) & _field_names(GRPOConfig)
    differing = {name for name in shared if getattr(gspo, name) != getattr(grpo, name)} - DERIVED_FIELDS
    assert differing <= documented, f"defaults that differ but are not in the table: {sorted(differing - documented)}"


def test_migration_lists_exactly_the_missing_trl_fields(migration_text):
    rows = _table(migration_text, ["TRL fields"])
    listed = {name for row in rows for name in _code_spans(row[0])}
    missing_in_gspo = _field_names(GRPOConfig) - _field_names(GSPOConfig)
    assert not missing_in_gspo - listed, (
        f"{MIGRATION.name}: GRPOConfig fields that GSPOConfig lacks, missing from the table 'GRPOConfig fields that "
        f"GSPOConfig does not have' (add each with the reason): {sorted(missing_in_gspo - listed)}"
    )
    assert not listed - missing_in_gspo, (
        f"listed as unsupported but GSPOConfig has them (or TRL dropped them): {sorted(listed - missing_in_gspo)}"
    )


def _assigned_in_init(cls) -> set[str]:
    """The public attributes `cls.__init__` assigns (`self.<name> = ...`, on any branch)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
            if node.value.id == "self" and not node.attr.startswith("_"):
                names.add(node.attr)
    return names


def trainer_differences() -> dict[str, str]:
    """Every way `GSPOTrainer` differs from TRL's `GRPOTrainer`, name → what differs: `__init__` parameters missing,
    added, at another position or with another default; public attributes (assigned by `__init__`, or on the class)
    that TRL has and gspo-trl lacks. What `transformers.Trainer` provides to both is left out."""
    ours, theirs = (list(inspect.signature(cls.__init__).parameters.values()) for cls in (GSPOTrainer, GRPOTrainer))
    our_index, their_index = ({p.name: i for i, p in enumerate(params)} for params in (ours, theirs))
    differences = {}
    for parameter in theirs:
        if parameter.name not in our_index:
            differences[parameter.name] = "a GRPOTrainer.__init__ parameter that GSPOTrainer.__init__ lacks"
        elif our_index[parameter.name] != their_index[parameter.name]:
            differences[parameter.name] = (
                f"parameter at position {our_index[parameter.name]} here, {their_index[parameter.name]} in TRL"
            )
        elif ours[our_index[parameter.name]].default != parameter.default:
            differences[parameter.name] = (
                f"default {ours[our_index[parameter.name]].default!r}, TRL's {parameter.default!r}"
            )
    for parameter in ours:
        if parameter.name not in their_index:
            differences[parameter.name] = "a GSPOTrainer.__init__ parameter that TRL does not have"
    trainer_names = _assigned_in_init(Trainer) | set(dir(Trainer))
    their_attributes = _assigned_in_init(GRPOTrainer) | {n for n in vars(GRPOTrainer) if not n.startswith("_")}
    our_attributes = _assigned_in_init(GSPOTrainer) | set(dir(GSPOTrainer))
    for name in their_attributes - trainer_names - our_attributes:
        differences.setdefault(name, "a public GRPOTrainer attribute that GSPOTrainer lacks")
    return differences


def test_trainer_signature_and_attributes_differ_from_trl_only_where_documented(migration_text):
    rows = _table(migration_text, ["TRL argument or attribute", "in gspo-trl"])
    documented = {name: row[1] for row in rows for name in _code_spans(row[0])}
    assert all(len(reason.split()) >= 5 for reason in documented.values()), "each row says why, in a sentence"
    differences = trainer_differences()
    undocumented = {name: what for name, what in differences.items() if name not in documented}
    assert not undocumented, (
        f"{MIGRATION.name}: add a row for each of these to the table '## `GRPOTrainer` arguments and attributes that "
        f"differ', saying why: {undocumented}"
    )
    stale = sorted(set(documented) - set(differences))
    assert not stale, f"{MIGRATION.name}: these rows no longer differ from TRL's GRPOTrainer, remove them: {stale}"


def test_trl_attribute_copies_read_the_config(tmp_path, tiny_model_dir):
    from helpers import count_digits, small_config, text_dataset

    args = small_config(tmp_path, num_generations=4, beta=0.0, epsilon=0.1, epsilon_high=0.3, temperature=0.7)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    assert (trainer.num_generations, trainer.beta, trainer.temperature) == (4, 0.0, 0.7)
    assert (trainer.epsilon_low, trainer.epsilon_high, trainer.num_generations_eval) == (0.1, 0.3, 4)
    assert trainer.reward_func_names == ["count_digits"] and trainer.generation_kwargs == {}
    with pytest.raises(AttributeError, match="no reference model was loaded"):  # setting: tests/config
        trainer.beta = 0.5


def trl_reward_keywords() -> set[str]:
    """The keyword arguments TRL's `GRPOTrainer` passes to every reward function besides the dataset's columns, read
    from `_calculate_rewards`: those named in its calls `f(..., **reward_kwargs)` and the keys it sets in
    `reward_kwargs`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._calculate_rewards)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg is None for k in node.keywords):
            names |= {k.arg for k in node.keywords if k.arg is not None}
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "reward_kwargs":
                names.add(node.slice.value)
    return names


def test_reward_functions_get_trls_keyword_arguments(tmp_path, tiny_model_dir):
    from helpers import small_config, text_dataset

    received = {}

    def record(completions, **kwargs):
        received.update(kwargs)
        return [0.0] * len(completions)

    dataset = text_dataset()
    GSPOTrainer(tiny_model_dir, record, args=small_config(tmp_path, max_steps=1), train_dataset=dataset).train()
    theirs = trl_reward_keywords()
    assert {"prompts", "completion_ids", "trainer_state", "log_extra", "log_metric"} <= theirs  # the reading works
    columns = set(dataset.column_names) - {"prompt"}  # passed by both under their own names
    assert columns <= set(received)
    # TRL passes `environments` only when episodes run in environments; so does gspo-trl (test_trainer_episodes).
    assert (set(received) - columns) | {"completions"} == theirs - {"environments"}
    assert callable(received["log_metric"]) and callable(received["log_extra"])


def test_trainer_takes_trl_constructor_arguments_in_trls_order(migration_text):
    """The guide says GSPOTrainer takes GRPOTrainer's arguments in the same order (a positional call carries over)."""
    import inspect

    from trl import GRPOTrainer

    from gspo_trl import GSPOTrainer

    trl_names = list(inspect.signature(GRPOTrainer.__init__).parameters)
    ours = list(inspect.signature(GSPOTrainer.__init__).parameters)
    assert ours[: len(trl_names)] == trl_names
    assert "in the same order" in migration_text


def test_migration_mentions_gspo_only_fields(migration_text):
    for name in _field_names(GSPOConfig) - _field_names(GRPOConfig):
        assert f"`{name}`" in migration_text, name


def test_migration_metrics_table_covers_logged_names(migration_text):
    rows = _table(migration_text, ["gspo-trl", "TRL `GRPOTrainer`"])
    ours = {name for row in rows for name in _code_spans(row[0])}
    lengths = completion_length_metrics(torch.ones(2, 3), torch.zeros(2, dtype=torch.bool))
    logged = (
        set(LOSS_STAT_NAMES.values())
        | set(SAMPLING_STAT_NAMES.values())
        | set(lengths)
        | {"entropy", "reward", "reward_std", "frac_reward_zero_std", "num_tokens", "loss"}
    )
    assert logged <= ours, f"metrics missing from the guide: {sorted(logged - ours)}"

    trl_source = Path(importlib.util.find_spec("trl.trainer.grpo_trainer").origin).read_text(encoding="utf-8")
    for row in rows:
        for name in _code_spans(row[1]):
            if "<" in name or "*" in name or name == "loss":  # patterns, and Trainer's own metric
                continue
            assert f'"{name}"' in trl_source, f"TRL's GRPOTrainer does not log {name!r}"


def test_benchmark_tables_match_the_result_files():
    """docs/benchmarks.md shows what benchmarks/results/*.json hold (benchmarks/report.py writes the tables)."""
    spec = importlib.util.spec_from_file_location("benchmark_report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert report.render(text) == text, "run: python benchmarks/report.py"
    assert "| 0." in text  # the tables are filled in, not empty markers


def test_objective_comparison_table_matches_the_result_files():
    """docs/objective.md shows what benchmarks/results/objectives/*.json hold (benchmarks/objectives.py prints it)."""
    spec = importlib.util.spec_from_file_location("objectives_benchmark", ROOT / "benchmarks" / "objectives.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.load_results()
    assert set(results) == set(bench.OBJECTIVES), "run: python benchmarks/objectives.py"
    assert bench.render_table(results) in (DOCS / "objective.md").read_text(encoding="utf-8")


def test_moe_replay_table_matches_the_result_file():
    """docs/moe.md shows what benchmarks/results/moe_replay.json holds (benchmarks/moe_replay.py writes the table)."""
    spec = importlib.util.spec_from_file_location("moe_replay_benchmark", ROOT / "benchmarks" / "moe_replay.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = json.loads((ROOT / "benchmarks" / "results" / "moe_replay.json").read_text())["runs"]
    assert set(results) == set(bench.RUNS), "run: python benchmarks/moe_replay.py"
    text = (DOCS / "moe.md").read_text(encoding="utf-8")
    assert f"<!-- results:moe_replay -->\n{bench.render_table(results)}\n<!-- /results:moe_replay -->" in text


def test_distributed_memory_table_matches_the_result_file():
    """docs/distributed.md shows what benchmarks/results/distributed.json holds (benchmarks/distributed.py prints
    it)."""
    spec = importlib.util.spec_from_file_location("distributed_benchmark", ROOT / "benchmarks" / "distributed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.load_rows()
    assert {(r["mode"], r["processes"]) for r in rows} == {(m, p) for m in ("ddp", "zero2", "zero3") for p in (1, 2)}
    assert not any("error" in r for r in rows)
    assert bench.table(rows) in (DOCS / "distributed.md").read_text(encoding="utf-8")


def test_decoding_tables_match_the_result_files():
    """docs/benchmarks.md's decoding table is what benchmarks/results/decoding_epyc_compiled.json holds."""
    spec = importlib.util.spec_from_file_location("decoding_benchmark", ROOT / "benchmarks" / "decoding.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    for name in ("decoding_epyc_compiled.json",):
        record = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        assert bench.render_table(record) in text, name


def test_vllm_page_shows_the_measured_table_and_demo_run():
    """docs/vllm.md shows what benchmarks/results/vllm_rollout.json and vllm_demo_metrics.json hold."""
    spec = importlib.util.spec_from_file_location("vllm_benchmark", ROOT / "benchmarks" / "vllm_rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = (DOCS / "vllm.md").read_text(encoding="utf-8")
    record = json.loads((ROOT / "benchmarks" / "results" / "vllm_rollout.json").read_text())
    assert bench.render_table(record) in text, "run: python benchmarks/vllm_rollout.py"
    colocated = json.loads((ROOT / "benchmarks" / "results" / "vllm_colocate_rollout.json").read_text())
    assert bench.render_table(colocated) in text, "run: benchmarks/vllm_rollout.py --colocate in the vLLM venv"
    demo = json.loads((ROOT / "benchmarks" / "results" / "vllm_demo_metrics.json").read_text())["summary"]
    assert f"| **{demo['reward_last_window']:.3f}** |" in text and f"| {demo['reward_first_window']:.3f} |" in text
    assert f"+{demo['reward_gain']:.3f}" in text


def test_vllm_page_shows_the_measured_weight_transports():
    """docs/vllm.md's "several hosts" table, and docs/benchmarks.md's, is what
    benchmarks/results/vllm_weight_transport.json holds."""
    path = ROOT / "benchmarks" / "vllm_weight_transport.py"
    spec = importlib.util.spec_from_file_location("vllm_transport_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    record = json.loads((ROOT / "benchmarks" / "results" / "vllm_weight_transport.json").read_text())
    for page in ("vllm.md", "benchmarks.md"):
        assert bench.render_table(record) in (DOCS / page).read_text(encoding="utf-8"), f"{page}: run python {path}"


def test_agents_page_shows_the_measured_retry_run():
    """docs/agents.md's table is what benchmarks/results/retry_env_demo.json holds."""
    text = (DOCS / "agents.md").read_text(encoding="utf-8")
    record = json.loads((ROOT / "benchmarks" / "results" / "retry_env_demo.json").read_text())
    for rollout in record["rollouts"]:
        row = (
            f"| {rollout['step']} | {rollout['reward']:.3f} | {rollout['episodes/reward_turn_0/mean']:.3f} | "
            f"{rollout['episodes/ended_by/terminated']:.0%} | {rollout['completions/mean_length']:.1f} |"
        )
        assert row in text, row
    assert f"+{record['summary']['reward_gain']:.3f}" in text
    assert record["command"].split("train ", 1)[1].split()[:2] == ["--env", "retry"]


def test_agents_page_shows_the_measured_calculator_run():
    """docs/agents.md's calculator table is what benchmarks/results/calculator_agent.json holds."""
    text = (DOCS / "agents.md").read_text(encoding="utf-8")
    record = json.loads((ROOT / "benchmarks" / "results" / "calculator_agent.json").read_text())
    for rollout in record["rollouts"]:
        row = (
            f"| {rollout['step']} | {rollout['reward']:.3f} | {rollout['tools/call_frequency']:.2f} | "
            f"{rollout['tools/failure_frequency']:.2f} |"
        )
        assert row in text, row
    assert f"warm-up {record['warm_up_seconds']:.0f} s" in text and f"in {record['gspo_seconds']:.0f} s" in text


def test_readme_demo_record_is_the_recorded_run():
    """README's "The demo, measured" table is what benchmarks/results/demo_metrics.json (that run's metrics) holds."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    record = json.loads((ROOT / "benchmarks" / "results" / "demo_metrics.json").read_text())
    summary = record["summary"]
    assert (
        f"| **{summary['reward_last_window']:.3f}** |" in text and f"| {summary['reward_first_window']:.3f} |" in text
    )
    assert f"+{summary['reward_gain']:.3f}" in text
    assert f"({summary['train_runtime_s']:.1f} s of training)" in text
