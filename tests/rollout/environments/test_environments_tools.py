"""Tests for gspo_trl.rollout.environments.tools: TRL's tools / environment_factory convention played as episodes."""

import pytest
import torch
from test_rollout_episodes import ScriptedSampler, episode_args

from gspo_trl.rollout.environments.tools import (
    ToolEnvironment,
    environment_reward_functions,
    parse_hermes_tool_calls,
    tool_episode_factory,
)
from gspo_trl.rollout.episodes import EpisodeRunner


class Calculator:
    """TRL's documented pattern: reset(**row), public methods are tools, get_reward()."""

    def reset(self, **row):
        self.answer, self.calls = row["answer"], 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def divide(self, a: int, b: int) -> float:
        """Divide a by b.

        Args:
            a: The dividend.
            b: The divisor.
        """
        return a / b

    def get_reward(self) -> float:
        return float(self.calls > 0)


def test_hermes_parser_reads_calls_and_flags_malformed_ones():
    text = (
        'I will add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call> and '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call><tool_call>oops</tool_call>'
    )
    calls = parse_hermes_tool_calls(text)
    assert calls[:2] == [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1, "b": 1}}]
    assert calls[2]["name"] == "__malformed__"
    assert parse_hermes_tool_calls("The answer is 5.") == []


def test_tool_episode_runs_calls_feeds_results_back_and_ends_on_an_answer(tiny_tokenizer):
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    call = tok.encode('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>') + [eos]
    bad = tok.encode('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>') + [eos]
    answer = tok.encode("5") + [eos]
    sampler = ScriptedSampler([[call, bad], [answer, answer]], eos, tok.pad_token_id)
    factory = tool_episode_factory(None, Calculator)
    runner = EpisodeRunner(factory, tok, episode_args(max_completion_length=200))
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}] * 2
    batch = runner.run(sampler, rows, seeds=[0, 0])

    # The tools are described in the prompt; TRL's reset(**row) got the row.
    assert '"name": "add"' in batch.prompts[0][-1]["content"] and "<tool_call>" in batch.prompts[0][-1]["content"]
    assert [env.answer for env in batch.environments] == ["5", "5"]
    # Results come back as the next message (the tiny template has no tool role: <tool_response> in a user turn).
    assert batch.completions[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert batch.completions[1][1]["content"] == '{"error": "division by zero"}'
    result_tokens = batch.rollout.completion_ids[0][batch.rollout.turn_ids[0] == -1].tolist()
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(result_tokens)
    assert batch.ends == ["terminated", "terminated"]  # the second turn answered without a tool call
    assert batch.tool_calls.tolist() == [1, 1] and batch.tool_failures.tolist() == [0, 1]
    (get_reward,) = environment_reward_functions(Calculator)
    assert get_reward(environments=batch.environments) == [1.0, 0.0]


def test_max_tool_calling_iterations_bounds_the_episode(tiny_tokenizer):
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    call = tok.encode('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>') + [eos]
    sampler = ScriptedSampler([[call], [call], [call]], eos, tok.pad_token_id)
    runner = EpisodeRunner(
        tool_episode_factory(None, Calculator), tok, episode_args(max_completion_length=400), max_turns=2
    )  # what max_tool_calling_iterations=1 gives
    batch = runner.run(sampler, [{"prompt": [{"role": "user", "content": "Go."}], "answer": "2"}], seeds=[0])
    assert batch.ends == ["max_turns"] and batch.tool_calls.tolist() == [2]


def test_unknown_tools_and_bad_schemas():
    env = ToolEnvironment([], Calculator)
    env.reset(options={"answer": "1"})
    messages, *_ = asyncio_run(env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>'))
    assert "tool 'mul' not found" in messages[0]["content"] and env.tool_failures == 1

    def undocumented(x):
        return x

    with pytest.raises(TypeError, match="Cannot build a JSON schema for tool .*undocumented"):
        tool_episode_factory([undocumented], None)

    class NoReset:
        def add(self, a: int) -> int:
            """Add.

            Args:
                a: a.
            """
            return a

    with pytest.raises(TypeError, match=r"NoReset without a reset\(\) method"):
        tool_episode_factory(None, NoReset)
    with pytest.raises(ValueError, match="not both"):
        tool_episode_factory(None, Calculator, env_factory=lambda: None)


def test_multi_environment_rows_pick_their_environment():
    class Other(Calculator):
        pass

    env = ToolEnvironment([], {"calc": Calculator, "other": Other})
    env.reset(options={"environment": "other", "answer": "1"})
    assert type(env.unwrapped) is Other and env.unwrapped.answer == "1"
    with pytest.raises(ValueError, match="environment='missing'"):
        env.reset(options={"environment": "missing", "answer": "1"})


def asyncio_run(awaitable):
    import asyncio

    return asyncio.run(awaitable)


def test_trainer_trains_a_trl_environment_factory_unchanged(tmp_path, tiny_model_dir):
    from datasets import Dataset
    from helpers import small_config

    from gspo_trl import GSPOTrainer

    seen = {}

    def accuracy(completions, answer, environments, **kwargs):
        seen["environments"] = environments
        return [float(c[-1]["content"].strip().endswith(a)) for c, a in zip(completions, answer)]

    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(8)],
            "answer": [str(i + 3) for i in range(8)],
        }
    )
    args = small_config(tmp_path / "out", max_completion_length=24, max_tool_calling_iterations=2)
    trainer = GSPOTrainer(tiny_model_dir, [accuracy], args=args, train_dataset=data, environment_factory=Calculator)
    assert [f.name for f in trainer.reward_funcs] == ["accuracy", "Calculator"]
    assert trainer.episode_runner.max_turns == 3
    trainer.train()
    log = trainer.state.log_history[0]
    assert "rewards/Calculator/mean" in log and "tools/call_frequency" in log and "tools/failure_frequency" in log
    assert all(isinstance(env, Calculator) for env in seen["environments"])
    assert torch.isfinite(torch.tensor(log["loss"]))


@pytest.mark.slow  # trains TRL's trainer too
def test_side_by_side_with_trl_grpo_trainer(tmp_path):
    """The same environment class and reward function train under TRL 1.16's GRPOTrainer and GSPOTrainer (a
    Qwen3 template, which TRL requires for tools), log the same reward and tool metric names, and append a tool
    result as the same tokens."""
    import os

    from conftest import build_tiny_model, build_tiny_tokenizer
    from datasets import Dataset
    from helpers import small_config
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_chat_template

    from gspo_trl import GSPOTrainer
    from gspo_trl.rollout.environments.chat import ObservationEncoder

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = qwen3_chat_template

    def accuracy(completions, answer, **kwargs):
        return [float(c[-1]["content"].strip().endswith(a)) for c, a in zip(completions, answer)]

    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(8)],
            "answer": [str(i + 3) for i in range(8)],
        }
    )
    common = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=24,
        max_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        max_tool_calling_iterations=2,
        logging_steps=1,
    )
    trl = GRPOTrainer(
        model=build_tiny_model(tokenizer),
        reward_funcs=[accuracy],
        train_dataset=data,
        processing_class=tokenizer,
        environment_factory=Calculator,
        args=GRPOConfig(output_dir=str(tmp_path / "trl"), **common),
    )
    trl.train()
    ours = GSPOTrainer(
        build_tiny_model(tokenizer),
        [accuracy],
        train_dataset=data,
        processing_class=tokenizer,
        environment_factory=Calculator,
        args=small_config(tmp_path / "gspo", **common),
    )
    ours.train()
    names = {"rewards/accuracy/mean", "rewards/Calculator/mean", "tools/call_frequency", "tools/failure_frequency"}
    assert names <= set(trl.state.log_history[0]) and names <= set(ours.state.log_history[0])
    reward_names = {name for name in ours.state.log_history[0] if name.startswith("rewards/")}
    assert reward_names == {name for name in trl.state.log_history[0] if name.startswith("rewards/")}
    assert not any(name.startswith("episodes/reward_turn") for name in ours.state.log_history[0])

    tool_message = [{"role": "tool", "name": "add", "content": "5"}]
    encoder = ObservationEncoder(tokenizer, True, [tokenizer.eos_token_id])
    assert encoder(tool_message) == trl._get_tool_suffix_ids(tool_message)


def test_a_template_with_tool_support_presents_the_tools_itself():
    from conftest import build_tiny_tokenizer
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = qwen3_chat_template
    eos = tokenizer.eos_token_id
    sampler = ScriptedSampler([[tokenizer.encode("5") + [eos]]], eos, tokenizer.pad_token_id)
    runner = EpisodeRunner(tool_episode_factory(None, Calculator, tokenizer=tokenizer), tokenizer, episode_args())
    batch = runner.run(sampler, [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}], [0])
    rendered = tokenizer.decode(sampler.calls[0][0][0])
    assert "<tools>" in rendered and '"name": "add"' in rendered  # Qwen3's own tool prompt, as TRL renders it
    assert batch.prompts[0][-1]["content"] == "What is 2 + 3?"  # no Hermes description added to the question
    # Without tool support (the tiny ChatML template), the tools are described in the user message instead.
    plain = build_tiny_tokenizer()
    env = tool_episode_factory(None, Calculator, tokenizer=plain)()
    observation, _ = env.reset(options={"answer": "5"})
    assert "<tool_call>" in observation and env.template_tools is None


def test_construction_builds_one_environment_to_check(tmp_path, tiny_model_dir):
    from datasets import Dataset
    from helpers import small_config

    from gspo_trl import GSPOTrainer

    built = []

    class CountedCalculator(Calculator):
        def __init__(self):
            built.append(self)

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1 + 3?"}]] * 8, "answer": ["4"] * 8})
    args = small_config(tmp_path / "out", max_completion_length=24)
    trainer = GSPOTrainer(tiny_model_dir, None, args=args, train_dataset=data, environment_factory=CountedCalculator)
    assert len(built) == 1  # checked once; the reward function is found on the class
    assert [f.name for f in trainer.reward_funcs] == ["CountedCalculator"]

    gym_built = []

    class OneTurn:
        def __init__(self):
            gym_built.append(self)

        def reset(self, seed=None, options=None):
            return "", {}

        def step(self, action):
            return "", 0.0, True, False, {}

    trainer = GSPOTrainer(tiny_model_dir, None, args=args, train_dataset=data, env_factory=OneTurn)
    assert len(gym_built) == 1 and len(trainer.episode_runner.pool) == 1  # the checked one is kept for use


def response_template_tokenizer(template: str, eos_token: str | None = None):
    from conftest import build_tiny_tokenizer
    from trl.chat_template_utils import add_response_schema

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    if eos_token is not None:  # the template's end of turn must be the token sampling stops at
        tokenizer.add_special_tokens({"eos_token": eos_token})
    return add_response_schema(tokenizer)  # TRL's response template for known chat templates


@pytest.mark.parametrize(
    "template_name, eos_token, call_text",
    [
        # Llama 3's JSON call, which the Hermes parser cannot read.
        ("llama3_2_chat_template", "<|eot_id|>", '{"name": "add", "parameters": {"a": "2", "b": 3}}'),
        ("qwen3_chat_template", None, '<tool_call>\n{"name": "add", "arguments": {"a": "2", "b": 3}}\n</tool_call>'),
    ],
)
def test_a_tokenizers_response_template_reads_the_tool_calls(template_name, eos_token, call_text):
    """With a response template (TRL's add_response_schema), tool calls are read by it from the turn's token ids
    after the conversation so far, and the arguments are typed by the tool's schema ("2" -> 2), as in TRL."""
    import trl.chat_template_utils as templates

    from gspo_trl.rollout.environments.tools import ResponseTemplateParser

    tok = response_template_tokenizer(getattr(templates, template_name), eos_token)
    eos = tok.eos_token_id
    call = tok.encode(call_text, add_special_tokens=False) + [eos]
    answer = tok.encode("5", add_special_tokens=False) + [eos]
    factory = tool_episode_factory(None, Calculator, tokenizer=tok)
    assert isinstance(factory().parser, ResponseTemplateParser)
    runner = EpisodeRunner(factory, tok, episode_args(max_completion_length=400))
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}]
    batch = runner.run(ScriptedSampler([[call], [answer]], eos, tok.pad_token_id), rows, seeds=[0])
    assert batch.completions[0][1] == {"role": "tool", "name": "add", "content": "5"}  # 2 + 3, not "2" + 3
    assert batch.tool_calls.tolist() == [1] and batch.tool_failures.tolist() == [0]
    assert batch.ends == ["terminated"]
    # A user's tool_call_parser still wins over the template.
    assert (
        tool_episode_factory(None, Calculator, parse_hermes_tool_calls, tokenizer=tok)().parser
        is parse_hermes_tool_calls
    )


def test_a_turn_the_response_template_cannot_parse_is_plain_text():
    from trl.chat_template_utils import qwen3_chat_template

    from gspo_trl.rollout.environments.tools import ResponseTemplateParser

    parser = ResponseTemplateParser(response_template_tokenizer(qwen3_chat_template))
    assert parser("The answer is 5.") == []
    assert parser('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>') == [
        {"name": "add", "arguments": {"a": 1, "b": 2}}
    ]  # plain text (no token ids): tokenized
    assert parser('<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>') == []  # TRL: plain text


def test_the_calculator_warm_up_shows_what_the_episodes_render(tiny_tokenizer):
    """environments/calculator.py (examples/train_calculator_agent.py, `--env calculator`): its supervised transcripts
    have the episode's first prompt (the tools described after the question) and its tool result message, so the
    warm-up teaches the format GSPO samples in."""
    from gspo_trl.demo import calculator
    from gspo_trl.rollout.environments.chat import ObservationEncoder

    transcript = calculator.warm_up_transcripts(size=1, seed=3)[0]
    row = calculator.questions(size=1, seed=3)[0]
    environment = tool_episode_factory(None, calculator.Calculator, tokenizer=tiny_tokenizer)()
    observation, _ = environment.reset(options=row)
    assert transcript["prompt"][0]["content"] == row["prompt"][0]["content"] + observation
    call, result, answer = transcript["completion"]
    assert parse_hermes_tool_calls(call["content"]) == [
        {"name": "multiply", "arguments": {"a": row["a"], "b": row["b"]}}
    ]
    messages, *_ = asyncio_run(environment.step(call["content"]))
    encoder = ObservationEncoder(tiny_tokenizer, True, [tiny_tokenizer.eos_token_id])
    assert encoder(messages) == encoder([result])  # the tool result as the episode shows it
    assert calculator.correct_answer([[answer]], [row["answer"]]) == [1.0]
    assert calculator.correct_answer([[{"role": "assistant", "content": "It is 12."}]], [row["answer"]]) == [0.0]
