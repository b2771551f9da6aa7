"""Tools of a chat request: validation, tool_choice, the structured output that forces a call, and
the conversation a chat template gets.

- `parse_tools` checks OpenAI's `[{"type": "function", "function": {"name", "description"?,
  "parameters"?}}]` (a name of letters, digits, `_` and `-`; names unique; parameters a JSON schema
  object) -> `FunctionTool`s.
- `resolve_tool_choice` reads `tool_choice` ("none", "auto", "required", or `{"type": "function",
  "function": {"name"}}`; "auto" by default when tools are given, as OpenAI does) -> `ToolChoice`.
  "auto" needs the server's `--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags and
  answer: a 400 without them).
- `forced_call_output` turns "required" and a named function into structured output: the named
  function's `parameters` schema (the output is its arguments object), or for "required" a JSON array
  (minItems 1; maxItems 1 without parallel_tool_calls, else the request's `max_tool_calls` if given) of `{"name": <const>, "parameters": <schema>}`,
  one anyOf branch per tool, the schema's local `$ref`s rewritten to its new place (so `$defs` and
  recursive references still resolve); a `$ref` to a URL or file is a 400 (nothing is fetched).
  `compile_forced` compiles it on the prepare worker with the engine's compiler; a schema xgrammar
  cannot compile is a 400 naming the tool's parameters.
- `template_conversation` gives the template what it can use. A template whose source mentions
  `tools` gets the tools as `apply_chat_template(tools=...)`; otherwise the parser's own
  description of them (`ToolParser.render_tools`) goes into the system message, so any model is
  told how to call. Likewise assistant `tool_calls` and `role: "tool"` messages go structured to a
  template that mentions `tool_calls` (arguments as objects, as HF templates expect), and otherwise
  become text in the parser's format: the calls appended to the assistant's content, tool results
  (consecutive ones joined) as a user turn.

Errors are `ToolRequestError`s: InvalidRequestErrors that carry the field at fault (`param`).
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from tokenmill.errors import InvalidRequestError
from tokenmill.serve.openai.tool_parsers import (FirstCallOnly, HermesToolParser, NamedFunctionParser,
                                                      RequiredCallsParser, ToolParser)
from tokenmill.structured_outputs import (StructuredOutputsParams, non_local_ref, non_local_ref_message,
                                          relocate_refs)

_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
CHOICES = ("none", "auto", "required")


class ToolRequestError(InvalidRequestError):
    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema of the arguments object

    def to_openai(self) -> dict:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    @property
    def arguments_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: Optional[str] = None  # the function, when mode is "named"


def parse_tools(raw: Optional[list]) -> list[FunctionTool]:
    tools: list[FunctionTool] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolRequestError(f"{where} must be an object", f"tools.{i}")
        if entry.get("type", "function") != "function":
            raise ToolRequestError(f"{where}.type must be 'function' (got {entry.get('type')!r})", f"tools.{i}.type")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise ToolRequestError(f"{where} needs a 'function' object with a 'name'", f"tools.{i}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"{where}.function.name is required (a non-empty string)",
                                   f"tools.{i}.function.name")
        if not _NAME.match(name):
            raise ToolRequestError(f"{where}.function.name {name!r} must be 1 to 64 letters, digits, '_', '-' or '.'",
                                   f"tools.{i}.function.name")
        if name in seen:
            raise ToolRequestError(f"{where}.function.name {name!r} is a duplicate: tool names must be unique",
                                   f"tools.{i}.function.name")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolRequestError(f"{where}.function.description must be a string", f"tools.{i}.function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object (got "
                                       f"{type(parameters).__name__})", f"tools.{i}.function.parameters")
            kind = parameters.get("type")
            if kind is not None and kind != "object":
                raise ToolRequestError(f"{where}.function.parameters must describe an object (its type is {kind!r})",
                                       f"tools.{i}.function.parameters")
            bad = non_local_ref(parameters)
            if bad is not None:
                raise ToolRequestError(f"{where}.function.parameters: {non_local_ref_message(bad)}",
                                       f"tools.{i}.function.parameters")
        tools.append(FunctionTool(name, description, parameters))
    return tools


def resolve_tool_choice(raw, tools: list[FunctionTool], auto_parser: Optional[str]) -> ToolChoice:
    """`auto_parser`: the server's --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    if raw is None:
        if not tools:
            return ToolChoice("none")
        raw = "auto"
    elif not tools:
        raise ToolRequestError("tool_choice needs tools: give the functions in 'tools'", "tool_choice")
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise ToolRequestError(f"tool_choice {raw!r} is not one of none, auto, required, or "
                                   "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if raw == "auto" and auto_parser is None:
            raise ToolRequestError('"auto" tool choice (the default when tools are given) requires the server to '
                                   "run with --enable-auto-tool-choice and --tool-call-parser; give tool_choice "
                                   '"none", "required" or a named function otherwise', "tool_choice")
        return ToolChoice(raw)
    if isinstance(raw, dict):
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if raw.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolRequestError("tool_choice as an object must be {'type': 'function', 'function': {'name': ...}}",
                                   "tool_choice")
        if name not in {t.name for t in tools}:
            raise ToolRequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                                   f"({', '.join(t.name for t in tools)})", "tool_choice.function.name")
        return ToolChoice("named", name)
    raise ToolRequestError("tool_choice must be a string or an object", "tool_choice")


def forced_call_output(choice: ToolChoice, tools: list[FunctionTool], max_calls: Optional[int]
                       ) -> Optional[StructuredOutputsParams]:
    """The structured output that makes "required" and a named function produce a valid call;
    `max_calls` bounds the calls (1: parallel_tool_calls false; None: no bound)."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        return StructuredOutputsParams(json=tool.arguments_schema)
    if choice.mode == "required":
        # Each tool's schema moves under items/anyOf/k: its local $refs ($defs, '#') are rewritten to match.
        items = {"anyOf": [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.name]},
            "parameters": relocate_refs(t.arguments_schema, f"#/items/anyOf/{k}/properties/parameters")},
            "required": ["name", "parameters"], "additionalProperties": False} for k, t in enumerate(tools)]}
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        return StructuredOutputsParams(json=schema)
    return None


def compile_forced(compile: Callable[[StructuredOutputsParams], Any], choice: ToolChoice, tools: list[FunctionTool],
                   forced: StructuredOutputsParams) -> None:
    """Compile the forced output with the engine's compiler (cached, so the engine's own validation
    finds it compiled); if it does not compile, name the tool whose parameters are at fault."""
    try:
        compile(forced)
    except InvalidRequestError:
        for i, tool in enumerate(tools):
            if choice.mode == "named" and tool.name != choice.name:
                continue
            try:
                compile(StructuredOutputsParams(json=tool.arguments_schema))
            except InvalidRequestError as e:
                raise ToolRequestError(f"tools[{i}].function.parameters ({tool.name!r}) is not a JSON schema the "
                                       f"output can be constrained to: {e}", f"tools.{i}.function.parameters") from None
        raise


def output_parser(choice: ToolChoice, auto_parser: Optional[ToolParser], max_calls: Optional[int] = None
                  ) -> Optional[ToolParser]:
    """What reads the output into calls: None when no calls can be made. With `max_calls`, "auto"
    keeps the first calls it finds (the forced choices' schema allows no more)."""
    if choice.mode == "named":
        return NamedFunctionParser(choice.name)
    if choice.mode == "required":
        return RequiredCallsParser()
    if choice.mode == "auto" and auto_parser is not None:
        return auto_parser if max_calls is None else FirstCallOnly(auto_parser, max_calls)
    return None


def _template_source(template) -> str:
    if isinstance(template, str):
        return template
    if isinstance(template, dict):  # named templates
        return " ".join(str(v) for v in template.values())
    return ""


def template_handles(template, word: str) -> bool:
    return word in _template_source(template)


def template_conversation(messages: list[dict], tools: list[FunctionTool], template,
                          parser: Optional[ToolParser]) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) for apply_chat_template: see the module's docstring. `parser` is the
    format of the text fallback (hermes when the server has none)."""
    parser = parser or HermesToolParser()
    tool_dicts = [t.to_openai() for t in tools] or None
    structured_calls = template_handles(template, "tool_calls")
    out: list[dict] = []
    for m in messages:
        if structured_calls:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_for_template(c) for c in m["tool_calls"]]
            out.append(m)
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = parser.render_calls([c["function"] for c in m["tool_calls"]])
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            result = parser.render_result(m.get("content") or "", m.get("name"))
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("_tool_results", None)
    if tool_dicts is None or template_handles(template, "tools"):
        return out, tool_dicts
    described = parser.render_tools(tool_dicts)
    if out and out[0]["role"] == "system":
        out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{described}" if out[0]["content"] else described)
    else:
        out.insert(0, {"role": "system", "content": described})
    return out, None


def _for_template(call: dict) -> dict:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (TypeError, ValueError, RecursionError):
        pass
    return dict(call, function=function)
