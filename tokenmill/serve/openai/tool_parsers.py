"""Tool-call parsers: the model's text -> content and tool calls, whole or streamed.

A parser (`ToolParser`) knows one model family's call format. It has

- `extract(text)`: the finished output -> `ExtractedToolCalls` (content, calls);
- `streamer()`: a fresh `ToolCallStreamer`, fed the output's text deltas (`feed`) and told when it
  ends (`finish`); each call returns a `StreamDelta` (content to show, tool-call deltas). Fed any
  split of a text, a streamer gives the content and calls `extract` gives for the whole of it;
- `render_tools` / `render_calls` / `render_result`: the same format as prompt text, for chat
  templates that do not handle tools themselves (serve/openai/tools.py decides).

Registered by name (`TOOL_PARSERS`, `get_tool_parser`; vLLM's `--tool-call-parser` names):

- `hermes` (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text
  outside them is content. A block closes at `</tool_call>` or at the end of the output.
- `llama3_json` (Llama 3.1+): the whole output (after blanks and an optional `<|python_tag|>`) is a
  JSON object `{"name": ..., "parameters": {...}}`, or several separated by `;`; otherwise the whole
  output is content.

`FirstCallOnly` wraps a parser to keep only its first call (parallel_tool_calls false). Two more
parsers, not registered, read the output that tool_choice `required` and a named function
constrain with structured output (a JSON array of `{"name", "parameters"}`, and the arguments object).

Malformed JSON never raises: what does not parse as a call stays content. A call whose object starts
`{"name": "...", "arguments": {` (hermes blocks, the elements of `required`'s array) streams as it is
generated (`CallObjectStreamer`): a start delta with id and name once that head is read, then the
arguments object's text in fragments, as the model writes it; cut short at max_tokens the arguments
are incomplete JSON, as OpenAI's are (a named function's likewise). Other call objects (keys in
another order, arguments as JSON text) come out whole when complete; llama3_json holds its output
to the end (one malformed object makes all of it content).
"""

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

JSON_ERRORS = (ValueError, RecursionError)  # what json.loads raises on bad (or absurdly nested) text
CallDict = dict  # OpenAI's {"id", "type": "function", "function": {"name", "arguments": <JSON text>}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call; `arguments` is JSON text (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> CallDict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """What a finished output holds: the text outside calls, and the calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: its start (id and name set, arguments "") or arguments."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: "StreamDelta") -> "StreamDelta":
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


def call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    """A whole call as stream deltas: its start, then its arguments."""
    return [ToolCallDelta(index, id=call.id, name=call.name), ToolCallDelta(index, arguments=call.arguments)]


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj, args_keys: tuple[str, ...]) -> Optional[ToolCall]:
    """A call from a parsed `{"name": str, <args key>: object}`, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models emit the arguments as JSON text
        try:
            args = json.loads(args)
        except JSON_ERRORS:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], _dumps(args))


# A call object's head, up to the brace that opens its arguments: {"name": "<name>", "arguments": {
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"\s*:\s*\{')
HEAD_LIMIT = 512  # a head not complete within this many characters is read whole, at the object's end


class CallObjectStreamer:
    """One call object's JSON text, fed piece by piece. Once its head `{"name": "...", "arguments": {`
    is complete, the call starts (a delta with id and name) and its arguments object streams as the
    raw text the model writes, until that object closes (the rest of the text is not read); cut
    short, the arguments are incomplete JSON, as OpenAI's are. Without such a head, `finish` parses
    the whole text as before (None: not a call)."""

    def __init__(self, index: int, args_keys: tuple[str, ...]):
        self.index = index
        self.args_keys = args_keys
        self.text = ""
        self.call: Optional[ToolCall] = None  # once the head is seen; its arguments grow
        self.looking = True
        self.pos = 0  # the first character of the arguments not read yet
        self.scanner = JsonScanner()
        self.args_closed = False

    @property
    def started(self) -> bool:
        return self.call is not None

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        out: list[ToolCallDelta] = []
        if self.looking:
            m = _CALL_HEAD.match(self.text)
            if m is not None and m.end() <= HEAD_LIMIT:
                self.looking = False
                try:
                    name = json.loads(m.group(1))
                except JSON_ERRORS:
                    name = ""
                if name and m.group(2) in self.args_keys:
                    self.call = ToolCall(name, "")
                    out.append(ToolCallDelta(self.index, id=self.call.id, name=name))
                    self.pos = m.end() - 1
            elif len(self.text) >= HEAD_LIMIT:
                self.looking = False
        if self.call is None or self.args_closed:
            return out
        start, end = self.pos, len(self.text)
        for j in range(start, end):
            self.scanner.push(self.text[j])
            if self.scanner.depth == 0:
                end, self.args_closed = j + 1, True
                break
        self.pos = end
        if end > start:
            self.call.arguments += self.text[start:end]
            out.append(ToolCallDelta(self.index, arguments=self.text[start:end]))
        return out

    def finish(self) -> tuple[Optional[ToolCall], list[ToolCallDelta]]:
        """The call (None: the text is not one), and the deltas of it not sent yet."""
        if self.call is not None:
            return self.call, []
        try:
            call = call_from_object(json.loads(self.text), self.args_keys)
        except JSON_ERRORS:
            call = None
        return call, (call_deltas(self.index, call) if call is not None else [])


class ToolCallStreamer(ABC):
    """Incremental parsing of one output."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """The next piece of the output's text -> what can be shown now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output ended: whatever was held back."""

    @property
    @abstractmethod
    def num_calls(self) -> int:
        """Calls emitted so far."""


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """Content and calls of a finished output."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A streaming parser for one output."""

    # ---- the format as prompt text (templates that ignore tools) ------------------------------
    @abstractmethod
    def render_tools(self, tools: list[dict]) -> str:
        """A system-prompt text that lists the tools (OpenAI's dicts) and says how to call them."""

    @abstractmethod
    def render_calls(self, calls: list[dict]) -> str:
        """An assistant message's calls ({"name", "arguments": dict or JSON text}) as model text."""

    def render_result(self, content: str, name: Optional[str] = None) -> str:
        """A tool's result as text of a user turn."""
        return content


def _arguments_object(arguments) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except JSON_ERRORS:
            return arguments
    return arguments


# ---- hermes -----------------------------------------------------------------------------------
class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    @classmethod
    def parse_block(cls, body: str) -> Optional[ToolCall]:
        try:
            obj = json.loads(body)
        except JSON_ERRORS:
            return None
        return call_from_object(obj, ("arguments", "parameters"))

    def extract(self, text: str) -> ExtractedToolCalls:
        streamer = HermesStreamer(self)
        content = streamer.feed(text).extend(streamer.finish()).content
        return ExtractedToolCalls(content, streamer.found)

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer(self)

    def render_tools(self, tools: list[dict]) -> str:
        listed = "\n".join(_dumps(t) for t in tools)
        return ("You may call one or more functions to assist with the user query. The functions are listed "
                f"within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, "
                "return a JSON object with the function name and arguments within <tool_call></tool_call> XML "
                'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"{self.start}\n" + _dumps({"name": c["name"], "arguments": _arguments_object(c["arguments"])})
                         + f"\n{self.end}" for c in calls)

    def render_result(self, content: str, name: Optional[str] = None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _finish_content(content: str, calls: list[ToolCall]) -> ExtractedToolCalls:
    """With calls, the content loses its trailing blanks (streams hold them back, see _Held)."""
    return ExtractedToolCalls(content.rstrip() if calls else content, calls)


class _Held:
    """Content whose trailing blanks are held back: shown once more content follows, dropped at the
    end if calls were made (as `_finish_content` does)."""

    def __init__(self):
        self.blanks = ""

    def show(self, text: str) -> str:
        if not text:
            return ""
        stripped = text.rstrip()
        if not stripped:
            self.blanks += text
            return ""
        out = self.blanks + stripped
        self.blanks = text[len(stripped):]
        return out

    def end(self, made_calls: bool) -> str:
        out, self.blanks = ("" if made_calls else self.blanks), ""
        return out


class HermesStreamer(ToolCallStreamer):
    """Content outside blocks streams at once (a possible start tag held back); inside a block, the
    call streams as CallObjectStreamer reads it (a possible end tag held back)."""

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self.buffer = ""  # text not yet read: a possible start tag, or (in a block) a possible end tag
        self.block: Optional[CallObjectStreamer] = None  # the open block's call object
        self.held = _Held()
        self.found: list[ToolCall] = []

    @property
    def num_calls(self) -> int:
        return len(self.found) + (self.block is not None and self.block.started)

    def feed(self, text: str) -> StreamDelta:
        self.buffer += text
        out = StreamDelta()
        start, end = self.parser.start, self.parser.end
        while True:
            if self.block is not None:
                e = self.buffer.find(end)
                if e < 0:
                    keep = _partial_suffix(self.buffer, end)
                    out.tool_calls.extend(self.block.feed(self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out.tool_calls.extend(self.block.feed(self.buffer[:e]))
                self.buffer = self.buffer[e + len(end):]
                self._close(out, closed=True)
                continue
            s = self.buffer.find(start)
            if s >= 0:
                out.content += self.held.show(self.buffer[:s])
                self.buffer = self.buffer[s + len(start):]
                self.block = CallObjectStreamer(len(self.found), ("arguments", "parameters"))
                continue
            keep = _partial_suffix(self.buffer, start)
            out.content += self.held.show(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return out

    def _close(self, out: StreamDelta, closed: bool) -> None:
        call, deltas = self.block.finish()
        if call is None:  # not a call: the block is content, tags and all
            out.content += self.held.show(self.parser.start + self.block.text + (self.parser.end if closed else ""))
        else:
            out.tool_calls.extend(deltas)
            self.found.append(call)
        self.block = None

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.block is not None:
            out.tool_calls.extend(self.block.feed(self.buffer))
            self._close(out, closed=False)
        else:
            out.content += self.held.show(self.buffer)
        self.buffer = ""
        out.content += self.held.end(bool(self.found))
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- llama3_json ------------------------------------------------------------------------------
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.lstrip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag):].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text)
        calls = self._parse_objects(body)
        return ExtractedToolCalls("", calls) if calls else ExtractedToolCalls(text)

    @staticmethod
    def _parse_objects(body: str) -> list[ToolCall]:
        """`{...}; {...}` -> the calls, or [] if any part is not a call."""
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except JSON_ERRORS:
                return []
            call = call_from_object(obj, ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)
            rest = body[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return []
            pos = len(body) - len(rest) + 1
            while pos < len(body) and body[pos].isspace():
                pos += 1

    def streamer(self) -> ToolCallStreamer:
        return Llama3JsonStreamer(self)

    def render_tools(self, tools: list[dict]) -> str:
        listed = "\n\n".join(_dumps(t) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format "
                '{"name": function name, "parameters": dictionary of argument name and its value}. '
                f"Do not use variables.\n\n{listed}")

    def render_calls(self, calls: list[dict]) -> str:
        return "; ".join(_dumps({"name": c["name"], "parameters": _arguments_object(c["arguments"])}) for c in calls)


class Llama3JsonStreamer(ToolCallStreamer):
    """Content streams at once when the output does not start like a call; a call-like output is held
    to its end (one malformed object makes all of it content, as in extract)."""

    def __init__(self, parser: Llama3JsonToolParser):
        self.parser = parser
        self.buffer = ""
        self.mode: Optional[str] = None  # None: undecided, "content", "calls"
        self.calls = 0

    @property
    def num_calls(self) -> int:
        return self.calls

    def feed(self, text: str) -> StreamDelta:
        if self.mode == "content":
            return StreamDelta(content=text)
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            tag = self.parser.python_tag
            if head.startswith(tag):
                head = head[len(tag):].lstrip()
                if head and not head.startswith("{"):
                    self.mode = "content"
                elif head:
                    self.mode = "calls"
            elif head and not tag.startswith(head):
                self.mode = "calls" if head.startswith("{") else "content"
            if self.mode == "content":
                out, self.buffer = self.buffer, ""
                return StreamDelta(content=out)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        text, self.buffer = self.buffer, ""
        if self.mode == "content" or not text:
            return StreamDelta()
        found = self.parser.extract(text)
        out = StreamDelta(content=found.content)
        for call in found.calls:
            out.tool_calls.extend(call_deltas(self.calls, call))
            self.calls += 1
        return out


# ---- the outputs of forced tool choices (structured output) -----------------------------------
class NamedFunctionParser(ToolParser):
    """tool_choice names a function: the output is its arguments object (constrained by its schema)."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def extract(self, text: str) -> ExtractedToolCalls:
        # Cut short at max_tokens, the arguments are incomplete JSON (finish_reason "length"), as
        # OpenAI returns them.
        return ExtractedToolCalls("", [ToolCall(self.function, text)]) if text else ExtractedToolCalls(text)

    def streamer(self) -> ToolCallStreamer:
        return NamedFunctionStreamer(self.function)

    def render_tools(self, tools: list[dict]) -> str:
        return HermesToolParser().render_tools(tools)

    def render_calls(self, calls: list[dict]) -> str:
        return HermesToolParser().render_calls(calls)


class NamedFunctionStreamer(ToolCallStreamer):
    """Every piece of text is a piece of the arguments; the call starts with the first one."""

    def __init__(self, function: str):
        self.function = function
        self.calls = 0

    @property
    def num_calls(self) -> int:
        return self.calls

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        if not text:
            return out
        if self.calls == 0:
            out.tool_calls.append(ToolCallDelta(0, id=new_call_id(), name=self.function))
            self.calls = 1
        out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> StreamDelta:
        return StreamDelta()


class RequiredCallsParser(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"}."""

    name = "required"

    def extract(self, text: str) -> ExtractedToolCalls:
        streamer = RequiredCallsStreamer()
        content = streamer.feed(text).extend(streamer.finish()).content
        return ExtractedToolCalls(content, streamer.found)

    def streamer(self) -> ToolCallStreamer:
        return RequiredCallsStreamer()

    def render_tools(self, tools: list[dict]) -> str:
        return HermesToolParser().render_tools(tools)

    def render_calls(self, calls: list[dict]) -> str:
        return HermesToolParser().render_calls(calls)


class RequiredCallsStreamer(ToolCallStreamer):
    """Each element of the array streams as a call (CallObjectStreamer); cut short at max_tokens, the
    calls begun are the calls. An element that is not a call ends the calls; an output without a
    call is content, at the end."""

    def __init__(self):
        self.text = ""
        self.scanner = JsonScanner()
        self.element: Optional[CallObjectStreamer] = None  # the open element
        self.fed = 0  # how much of self.text the open element has read
        self.found: list[ToolCall] = []
        self.broken = False

    @property
    def num_calls(self) -> int:
        return len(self.found) + (self.element is not None and self.element.started)

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        for ch in text:
            pos = len(self.text)
            self.text += ch
            if self.broken:
                continue
            depth_before = self.scanner.depth
            self.scanner.push(ch)
            if depth_before == 1 and self.scanner.depth == 2 and not self.scanner.in_string:
                self.element, self.fed = CallObjectStreamer(len(self.found), ("parameters",)), pos
            elif depth_before == 2 and self.scanner.depth == 1 and self.element is not None:
                out.tool_calls.extend(self.element.feed(self.text[self.fed:]))
                call, deltas = self.element.finish()
                if call is None:
                    self.broken = True
                else:
                    out.tool_calls.extend(deltas)
                    self.found.append(call)
                self.element = None
        if self.element is not None and not self.broken:
            out.tool_calls.extend(self.element.feed(self.text[self.fed:]))
            self.fed = len(self.text)
        return out

    def finish(self) -> StreamDelta:
        if self.element is not None and self.element.started:  # cut short inside a call's arguments
            self.found.append(self.element.call)
        self.element = None
        return StreamDelta(content=self.text if not self.found else "")


class FirstCallOnly(ToolParser):
    """Another parser, keeping only its first `limit` calls (tool_choice auto with parallel_tool_calls
    false: 1, or with max_tool_calls)."""

    def __init__(self, parser: ToolParser, limit: int = 1):
        self.parser = parser
        self.name = parser.name
        self.limit = limit

    def extract(self, text: str) -> ExtractedToolCalls:
        found = self.parser.extract(text)
        return ExtractedToolCalls(found.content, found.calls[:self.limit])

    def streamer(self) -> ToolCallStreamer:
        return _FirstCallStreamer(self.parser.streamer(), self.limit)

    def render_tools(self, tools: list[dict]) -> str:
        return self.parser.render_tools(tools)

    def render_calls(self, calls: list[dict]) -> str:
        return self.parser.render_calls(calls)

    def render_result(self, content: str, name: Optional[str] = None) -> str:
        return self.parser.render_result(content, name)


class _FirstCallStreamer(ToolCallStreamer):
    def __init__(self, inner: ToolCallStreamer, limit: int):
        self.inner = inner
        self.limit = limit

    @property
    def num_calls(self) -> int:
        return min(self.inner.num_calls, self.limit)

    def _first(self, delta: StreamDelta) -> StreamDelta:
        delta.tool_calls = [d for d in delta.tool_calls if d.index < self.limit]
        return delta

    def feed(self, text: str) -> StreamDelta:
        return self._first(self.inner.feed(text))

    def finish(self) -> StreamDelta:
        return self._first(self.inner.finish())


class JsonScanner:
    """Tracks the nesting depth of a JSON text fed a character at a time (strings and escapes aware)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def push(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The registered parser of that name; KeyError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})") from None
