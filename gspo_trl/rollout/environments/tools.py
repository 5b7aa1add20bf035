"""TRL's tool calling as episodes: `tools=` callables and `environment_factory=` classes, played by the same loop as
gym-style environments (`gspo_trl.rollout.episodes`).

`ToolEnvironment` adapts them to the gym convention: ``reset`` builds the row's environment (TRL's
``reset(**row)``, whose text joins the prompt) and describes the tools; ``step`` parses the tool calls of an
assistant turn, runs them (an exception becomes an ``{"error": ...}`` result, as in TRL) and returns the results as
the next observation; a turn without a tool call ends the episode. Tools are the standalone ``tools`` plus the
environment's public methods (not ``reset``/``get_reward``); their JSON schemas come from type hints and
docstrings (`transformers.utils.get_json_schema`).

Tool calls are read by a parser, text -> [{"name": ..., "arguments": {...}}]: the user's `tool_call_parser`, else the
tokenizer's response template when it has one (`ResponseTemplateParser`, TRL's `parse_response`), else
`parse_hermes_tool_calls`, which reads ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (the
Hermes/Qwen format). A chat template
with tool support (TRL's `supports_tool_calling`, e.g. Qwen's) presents the tools itself, as TRL renders them; for
any other template (SmolLM2's has no tool support) the tools are described in the user message in that format.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from transformers.utils import get_json_schema
from trl.chat_template_utils import parse_response, supports_tool_calling

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", flags=re.DOTALL)
MALFORMED = "__malformed__"  # the name given to a tool call that could not be read


def parse_hermes_tool_calls(text: str) -> list[dict]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of `text`, in order. A block that is
    not such JSON becomes a call to `MALFORMED`, which the episode answers with an error result."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            calls.append({"name": MALFORMED, "arguments": {"text": block}})
            continue
        calls.append({"name": name, "arguments": arguments})
    return calls


class ResponseTemplateParser:
    """Tool calls read by the tokenizer's own response template (TRL's `parse_response`, as TRL reads them): from
    the turn's token ids after the conversation so far, with arguments typed by the tools' JSON schemas. The
    default for a tokenizer with a `response_template` (or `response_schema`), e.g. after TRL's
    `add_response_schema`, which covers formats the Hermes parser cannot read (Llama 3's JSON, GPT-OSS). A turn
    the template cannot parse is plain text (no call), as in TRL."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, action: str, tools: list[dict] | None = None) -> list[dict]:
        token_ids = getattr(action, "token_ids", None)
        if token_ids is None:  # not from the episode loop: the text is all there is
            token_ids = self.tokenizer(action, add_special_tokens=False)["input_ids"]
        message = parse_response(self.tokenizer, token_ids, prefix=getattr(action, "prefix_ids", []), tools=tools)
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            name, arguments = function.get("name"), function.get("arguments", {})
            try:
                if isinstance(arguments, str):
                    arguments = json.loads(arguments)
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise TypeError
            except (ValueError, TypeError):
                calls.append({"name": MALFORMED, "arguments": {"text": json.dumps(function, default=str)}})
                continue
            calls.append({"name": name, "arguments": arguments})
        return calls


def has_response_template(tokenizer) -> bool:
    return any(getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema"))


def tool_schema(tool: Callable) -> dict:
    """The JSON schema of a tool, from its type hints and docstring; the error names the tool."""
    try:
        return get_json_schema(tool)
    except Exception as error:
        name = getattr(tool, "__qualname__", repr(tool))
        raise TypeError(
            f"Cannot build a JSON schema for tool {name}: {error}. A tool needs type hints for every argument and a "
            "Google-style docstring with a description and an 'Args:' entry per argument."
        ) from error


def describe_tools(schemas: list[dict]) -> str:
    """The tool instructions appended to the prompt."""
    lines = "\n".join(json.dumps(schema["function"], ensure_ascii=False) for schema in schemas)
    return (
        "\n\nYou can call these tools:\n" + lines + "\nTo call a tool, reply with "
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>. The result comes back in the '
        "next message. When you have the final answer, reply without a tool call."
    )


def public_methods(environment) -> list[Callable]:
    """The environment's tools: its public methods except reset and get_reward (TRL's rule)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


class ToolEnvironment:
    """One episode's tools and (optionally) TRL-style environment, behind the gym-style interface."""

    def __init__(
        self,
        tools: list[Callable],
        environment_factory=None,
        tool_call_parser: Callable[[str], list[dict]] = parse_hermes_tool_calls,
        template_presents_tools=False,
    ):
        self.standalone_tools = list(tools)
        self.template_presents_tools = template_presents_tools
        self.schemas: list[dict] = []  # the JSON schemas of this episode's tools
        self.template_tools: list[dict] | None = None  # the schemas the chat template renders, when it can
        self.environment_factory = environment_factory
        self.parser = tool_call_parser
        self.environment = None  # the TRL environment of the current episode
        self._instances: dict[Any, Any] = {}
        self.tool_calls = self.tool_failures = 0

    def _environment_for(self, row: dict):
        factories = self.environment_factory
        if factories is None:
            return None
        name = row.get("environment") if isinstance(factories, dict) else None
        if isinstance(factories, dict) and name not in factories:
            raise ValueError(
                f"A row has environment={name!r}, which is not among the environments passed to "
                f"environment_factory: {sorted(factories)}."
            )
        if name not in self._instances:
            factory = factories[name] if isinstance(factories, dict) else factories
            self._instances[name] = factory()
            if not callable(getattr(self._instances[name], "reset", None)):
                raise TypeError(
                    f"environment_factory returned a {type(self._instances[name]).__name__} without a "
                    "reset() method; TRL's convention is reset(**row) -> optional text for the prompt."
                )
        return self._instances[name]

    @property
    def unwrapped(self):
        """What reward functions get as this episode's environment (TRL's `environments=`)."""
        return self.environment

    def reset(self, seed=None, options=None):
        row = dict(options or {})
        self.environment = self._environment_for(row)
        self.tool_calls = self.tool_failures = 0
        observation = ""
        if self.environment is not None:
            reset_row = (
                {k: v for k, v in row.items() if k != "environment"}
                if isinstance(self.environment_factory, dict)
                else row
            )
            observation = self.environment.reset(**reset_row) or ""
            if not isinstance(observation, str):
                raise TypeError(
                    f"{type(self.environment).__name__}.reset returned {type(observation).__name__}; "
                    "it may return text for the prompt, or None."
                )
        self.tools = {tool.__name__: tool for tool in self.standalone_tools}
        if self.environment is not None:
            self.tools.update({tool.__name__: tool for tool in public_methods(self.environment)})
        self.schemas = [tool_schema(tool) for tool in self.tools.values()]
        if self.template_presents_tools:
            self.template_tools = self.schemas or None
        elif self.schemas:
            observation += describe_tools(self.schemas)
        return observation, {}

    async def step(self, action: str):
        if isinstance(self.parser, ResponseTemplateParser):
            calls = self.parser(action, self.schemas)
        else:
            calls = self.parser(action)
        if not calls:
            return "", 0.0, True, False, {}  # an answer without a tool call ends the episode
        results = await asyncio.gather(*(self._call(call) for call in calls))
        messages = [{"role": "tool", "name": call["name"], "content": result} for call, result in zip(calls, results)]
        return messages, 0.0, False, False, {"tool_calls": len(calls)}

    async def _call(self, call: dict) -> str:
        self.tool_calls += 1
        tool = self.tools.get(call["name"])
        try:
            if call["name"] == MALFORMED:
                raise ValueError(
                    f"could not read the tool call {call['arguments']['text'][:200]!r}: expected "
                    '{"name": ..., "arguments": {...}}'
                )
            if tool is None:
                raise ValueError(f"tool {call['name']!r} not found; the tools are {sorted(self.tools)}")
            result = tool(**call["arguments"])
            if inspect.isawaitable(result):
                result = await result
        except Exception as error:
            self.tool_failures += 1
            result = {"error": str(error)}
        return result if isinstance(result, str) else json.dumps(result, default=str)


def tool_episode_factory(tools, environment_factory, tool_call_parser=None, env_factory=None, tokenizer=None):
    """The factory of `ToolEnvironment`s for `GSPOTrainer(tools=..., environment_factory=...)`, checked now (tool
    schemas, the environments' ``reset``), or None when neither is given. With a `tokenizer` whose chat template
    supports tool calling, the template presents the tools."""
    if tools is None and environment_factory is None:
        return None
    if env_factory is not None:
        raise ValueError(
            "Pass env_factory (gym-style environments) or tools / environment_factory (TRL's tool calling), not both."
        )
    tools = list(tools or [])
    for tool in tools:
        if not callable(tool):
            raise TypeError(f"tools must be callables, got {type(tool).__name__}.")
        tool_schema(tool)
    factories = (
        environment_factory
        if isinstance(environment_factory, dict)
        else ({} if environment_factory is None else {None: environment_factory})
    )
    for name, factory in factories.items():
        environment = factory()
        if not callable(getattr(environment, "reset", None)):
            raise TypeError(
                f"environment_factory{'' if name is None else f'[{name!r}]'} returned a "
                f"{type(environment).__name__} without a reset() method; TRL's convention is "
                "reset(**row) -> optional text for the prompt."
            )
        for method in public_methods(environment):
            tool_schema(method)
    if tool_call_parser is not None:
        parser = tool_call_parser
    elif tokenizer is not None and has_response_template(tokenizer):
        parser = ResponseTemplateParser(tokenizer)
    else:
        parser = parse_hermes_tool_calls
    native = (
        tokenizer is not None
        and getattr(tokenizer, "chat_template", None) is not None
        and supports_tool_calling(tokenizer)
    )

    def factory():
        return ToolEnvironment(tools, environment_factory, parser, template_presents_tools=native)

    return factory


def environment_reward_functions(environment_factory) -> list[Callable]:
    """TRL's rule: an environment class with ``get_reward()`` adds a reward function, named after the class and
    weighted 1, that asks each episode's environment of that class for its reward (None for the others)."""
    factories = (
        environment_factory.values()
        if isinstance(environment_factory, dict)
        else ([] if environment_factory is None else [environment_factory])
    )
    functions, seen = [], set()
    for factory in factories:
        environment_type = factory if isinstance(factory, type) else type(factory())  # a class needs no instance
        if environment_type in seen or not callable(getattr(environment_type, "get_reward", None)):
            continue
        seen.add(environment_type)
        functions.append(_get_reward_function(environment_type))
    return functions


def _get_reward_function(environment_type):
    if inspect.iscoroutinefunction(environment_type.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is environment_type else None for e in environments]
    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is environment_type else None for e in environments]

    get_reward.__name__ = get_reward.__qualname__ = environment_type.__name__
    return get_reward
