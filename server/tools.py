"""Tool calls on chat completions: the `tools` a request declares (checked), its `tool_choice` resolved (none, auto,
required, a named function), and for required and named choices the grammar that makes the model write calls in
its tool-call parser's format, whose arguments match each function's schema (an xgrammar structural tag: hermes's
`<tool_call>` JSON, llama3_json's JSON objects, mistral's `[TOOL_CALLS]` list)."""

import json
from dataclasses import dataclass
from typing import Any

from pegainfer.server.errors import ApiError
from pegainfer.server.structured import GrammarSpec


@dataclass(frozen=True)
class CallFormat:
    """How a parser's format writes calls: a call's text before its arguments (with the function's name), after
    them, the separator between calls, and the text around the whole list."""
    begin: str
    end: str
    separator: str
    prefix: str = ""
    suffix: str = ""


FORMATS = {
    "hermes": CallFormat('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": CallFormat('{{"name": {name}, "parameters": ', "}", "; "),
    "mistral": CallFormat('{{"name": {name}, "arguments": ', "}", ", ", "[TOOL_CALLS][", "]"),
}


@dataclass(frozen=True)
class ToolChoice:
    """What the request allows: mode none, auto, required or named (`name` set), over its declared functions."""
    mode: str
    functions: dict[str, dict]  # name -> its JSON schema of parameters
    name: str | None = None
    parallel: bool = True


def check_tools(tools: list[Any] | None) -> dict[str, dict]:
    """The declared functions by name, each with its parameters' schema ({} when it has none); a 400 on `tools`
    that do not have OpenAI's shape."""
    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name, parameters = function.get("name"), function.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"tools[{index}].function.name must be a non-empty string", "tools")
        if not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{index}].function.parameters must be a JSON schema object", "tools")
        if name in functions:
            raise ApiError(400, f"tools declares the function {name!r} twice", "tools")
        functions[name] = parameters
    return functions


def resolve_tool_choice(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
                        auto_enabled: bool) -> ToolChoice:
    """The request's tool choice as vLLM reads it: none when no tools are declared; auto by default with tools
    (which needs --enable-auto-tool-choice), required, or {"type": "function", "function": {"name": ...}}."""
    functions = check_tools(tools)
    parallel = True if parallel is None else parallel
    if not functions:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, f"tool_choice {json.dumps(tool_choice)[:60]} needs tools", "tool_choice")
        return ToolChoice("none", {})
    if tool_choice is None or tool_choice == "auto":
        if not auto_enabled:
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser',
                           "tool_choice")
        return ToolChoice("auto", functions, parallel=parallel)
    if tool_choice in ("none", "required"):
        return ToolChoice(tool_choice, functions, parallel=parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', "tool_choice")
    if name not in functions:
        raise ApiError(400, f"tool_choice names the function {name!r}, which tools does not declare "
                            f"(declared: {', '.join(functions)})", "tool_choice")
    return ToolChoice("named", functions, name, parallel=False)


def call_grammar(choice: ToolChoice, parser: str) -> GrammarSpec | None:
    """The structural tag forcing a required or named choice's calls in the parser's format; None otherwise."""
    if choice.mode not in ("required", "named"):
        return None
    if parser not in FORMATS:
        raise ApiError(400, f"tool_choice {choice.mode} needs a --tool-call-parser of {', '.join(FORMATS)}; "
                            f"this server has {parser or 'none'}", "tool_choice")
    form = FORMATS[parser]
    names = [choice.name] if choice.mode == "named" else list(choice.functions)
    tags = [{"type": "tag", "begin": form.begin.format(name=json.dumps(name)),
             "content": {"type": "json_schema", "json_schema": choice.functions[name], "max_whitespace_cnt": 1},
             "end": form.end}
            for name in names]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": form.separator, "at_least_one": True,
             "stop_after_first": not choice.parallel}
    if form.prefix or form.suffix:
        calls = {"type": "tag", "begin": form.prefix, "content": calls, "end": form.suffix}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": calls}), "tool_choice")
