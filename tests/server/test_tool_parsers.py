"""Tool-call parsers (serve/openai/tool_parsers.py) and the tool helpers (tools.py), in pure
Python: no engine, no server.

The streaming parsers are checked against `extract`: fed a text in any split, a streamer gives the
same content and the same calls (names and arguments) as extract does for the whole text.
"""

import json
import random

import pytest

from tokenmill.serve.openai.tool_parsers import (TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser,
                                                      NamedFunctionParser, RequiredCallsParser, StreamDelta,
                                                      get_tool_parser)
from tokenmill.serve.openai.tools import (FunctionTool, ToolChoice, ToolRequestError, forced_call_output,
                                                parse_tools, resolve_tool_choice, template_conversation)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'

HERMES_TEXTS = [
    "Just an answer, no calls.",
    "",
    f"<tool_call>\n{WEATHER}\n</tool_call>",
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n",
    f"<tool_call>{WEATHER}</tool_call><tool_call>" '{"name": "time", "arguments": {}}' "</tool_call> done",
    "<tool_call>{not json}</tool_call> and text after",
    f"<tool_call>\n{WEATHER}",  # cut at the end: the open block still parses
    "<tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"</tool_call> inside? no: \\u00e9\"}}",
    "a < b and <tool_ but not a tag <tool_call",
    "<tool_call>[1, 2]</tool_call>",  # JSON, but not a call
    '<tool_call>{"name": "f", "parameters": {"x": [1, {"y": "}"}]}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as JSON text
    '<tool_call>{"name": "f", "arguments": {"x": "a<b", "y": [1, 2]', # cut inside the arguments
    '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call> then text',  # no head: parsed whole
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # no name: content
]

LLAMA_TEXTS = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v;w"}}',
    "The weather is nice.",
    '{"name": "a", "parameters": {}} trailing words',
    '{"name": "a", "parameters": ',  # cut short
    "{not json}",
    "<|python_tag|>print('hi')",
    "",
    "   ",
]


def stream(parser, text: str, pieces: list[int]) -> StreamDelta:
    streamer, out, pos = parser.streamer(), StreamDelta(), 0
    for size in pieces:
        out.extend(streamer.feed(text[pos:pos + size]))
        pos += size
    out.extend(streamer.feed(text[pos:]))
    return out.extend(streamer.finish())


def calls_of(delta: StreamDelta) -> list[tuple[str, str]]:
    """(name, arguments) of each streamed call, accumulated by index as a client would."""
    calls: dict[int, list] = {}
    for d in delta.tool_calls:
        if d.id is not None:
            assert d.index not in calls and d.id.startswith("call_") and d.arguments == ""
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in range(len(calls))]


def random_splits(text: str, rng: random.Random) -> list[list[int]]:
    splits = [[1] * len(text), [len(text)], [3] * (len(text) // 3 + 1)]
    for _ in range(20):
        sizes, left = [], len(text)
        while left > 0:
            sizes.append(rng.randint(0, 7))
            left -= sizes[-1]
        splits.append(sizes)
    return splits


@pytest.mark.parametrize("parser,text", [(HermesToolParser(), t) for t in HERMES_TEXTS]
                         + [(Llama3JsonToolParser(), t) for t in LLAMA_TEXTS]
                         + [(RequiredCallsParser(), t) for t in (
                             '[{"name":"a","parameters":{"x":"]}"}},{"name":"b","parameters":{}}]',
                             '[{"name":"a","parameters":{}}]', '[]', '[{"name":"a"', 'nope',
                             '[{"name":"a","parameters":{"x":1}},{"name":"b","param',
                             '[{"name":"a","parameters":{"x":{"y":"}"}}},{"name":"b","parameters":{"z":[1')]
                         + [(NamedFunctionParser("f"), t) for t in ('{"x":1,"y":"z"}', '{"x":', '')])
def test_streaming_equals_extract(parser, text):
    whole = parser.extract(text)
    rng = random.Random(hash(text) & 0xFFFF)
    for pieces in random_splits(text, rng):
        streamed = stream(parser, text, pieces)
        assert streamed.content == whole.content, (pieces, streamed)
        assert calls_of(streamed) == [(c.name, c.arguments) for c in whole.calls]


def test_forced_outputs_cut_short():
    required = RequiredCallsParser().extract('[{"name":"a","parameters":{"x":1}},{"name":"b","param')
    assert [(c.name, c.arguments) for c in required.calls] == [("a", '{"x":1}')] and required.content == ""
    assert RequiredCallsParser().extract('[{"name":"a"').calls == []
    inside = RequiredCallsParser().extract('[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":')
    assert [(c.name, c.arguments) for c in inside.calls] == [("a", '{"x":1}'), ("b", '{"y":')]
    named = NamedFunctionParser("f").extract('{"x":')
    assert [(c.name, c.arguments) for c in named.calls] == [("f", '{"x":')]  # OpenAI's partial arguments
    assert NamedFunctionParser("f").extract("").calls == []


@pytest.mark.parametrize("parser,text,args", [
    (HermesToolParser(), f"Sure.<tool_call>\n{WEATHER}\n</tool_call>", '{"city": "Paris", "unit": "celsius"}'),
    (RequiredCallsParser(), '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}}]',
     '{"city":"Paris","unit":"celsius"}'),
])
def test_arguments_stream_as_they_are_generated(parser, text, args):
    """Fed a few characters at a time, the call starts before its arguments are complete and they
    come in many pieces (the model's own text), which join to the arguments extract gives."""
    streamer, deltas = parser.streamer(), []
    for i in range(0, len(text), 4):
        got = streamer.feed(text[i:i + 4]).tool_calls
        deltas.append(got)
        if any(d.id is not None for d in got):
            assert not text[:i + 4].endswith(args), "the call started only once its arguments were complete"
    deltas.append(streamer.finish().tool_calls)
    pieces = [d.arguments for step in deltas for d in step if d.id is None]
    assert len(pieces) >= len(args) // 4 - 1 and all(pieces)
    assert "".join(pieces) == args == parser.extract(text).calls[0].arguments


def test_hermes_extract():
    p = get_tool_parser("hermes")
    found = p.extract(HERMES_TEXTS[3])
    assert found.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert found.calls[0].to_openai()["type"] == "function" and found.calls[0].id.startswith("call_")
    two = p.extract(HERMES_TEXTS[4])
    assert [c.name for c in two.calls] == ["get_weather", "time"] and two.content == " done"
    bad = p.extract(HERMES_TEXTS[5])
    assert bad.calls == [] and bad.content == HERMES_TEXTS[5]  # malformed stays content
    assert p.extract("<tool_call>[1, 2]</tool_call>").calls == []
    assert json.loads(p.extract(HERMES_TEXTS[11]).calls[0].arguments) == {"x": 1}  # arguments as JSON text
    cut = p.extract(HERMES_TEXTS[12])  # cut short inside the arguments: OpenAI's partial arguments
    assert [(c.name, c.arguments) for c in cut.calls] == [("f", '{"x": "a<b", "y": [1, 2]')] and cut.content == ""
    reordered = p.extract(HERMES_TEXTS[13])
    assert [(c.name, json.loads(c.arguments)) for c in reordered.calls] == [("f", {"x": 1})]
    assert reordered.content == " then text"
    assert p.extract(HERMES_TEXTS[14]).calls == []


def test_llama3_json_extract():
    p = get_tool_parser("llama3_json")
    found = p.extract(LLAMA_TEXTS[1])
    assert found.content == "" and [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "Paris"})]
    two = p.extract(LLAMA_TEXTS[2])
    assert [(c.name, json.loads(c.arguments)) for c in two.calls] == [("a", {}), ("b", {"k": "v;w"})]
    for text in LLAMA_TEXTS[3:]:
        found = p.extract(text)
        assert found.calls == [] and found.content == text


def test_first_call_only():
    from tokenmill.serve.openai.tools import output_parser

    parser = output_parser(ToolChoice("auto"), HermesToolParser(), max_calls=1)
    text = HERMES_TEXTS[4]
    assert [c.name for c in parser.extract(text).calls] == ["get_weather"]
    streamed = stream(parser, text, [5] * 40)
    assert calls_of(streamed) == [(c.name, c.arguments) for c in parser.extract(text).calls]
    assert streamed.content == parser.extract(text).content
    assert output_parser(ToolChoice("auto"), None) is None
    two = output_parser(ToolChoice("auto"), HermesToolParser(), max_calls=2)  # max_tool_calls
    three = HERMES_TEXTS[4] + HERMES_TEXTS[2]
    assert [c.name for c in two.extract(three).calls] == ["get_weather", "time"]
    assert calls_of(stream(two, three, [5] * 60)) == [(c.name, c.arguments) for c in two.extract(three).calls]
    assert output_parser(ToolChoice("none"), HermesToolParser()) is None


@pytest.mark.parametrize("parser,text", [
    (HermesToolParser(), "<tool_call>" + "[" * 5000),
    (Llama3JsonToolParser(), '{"name": "a", "parameters": ' + "[" * 5000),
    (RequiredCallsParser(), "[" * 5000), (NamedFunctionParser("f"), "{" * 5000)])
def test_absurd_nesting_is_content_not_an_exception(parser, text):
    assert parser.extract(text).calls == [] or isinstance(parser, NamedFunctionParser)
    streamed = stream(parser, text, [100] * 60)
    if not isinstance(parser, NamedFunctionParser):  # whose output is the arguments, whatever they are
        assert calls_of(streamed) == []


def test_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json"]
    with pytest.raises(KeyError, match="hermes"):
        get_tool_parser("nope")


def test_rendered_calls_parse_back():
    calls = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "t", "arguments": {}}]
    for parser in (HermesToolParser(), Llama3JsonToolParser()):
        text = parser.render_calls(calls)
        assert [(c.name, json.loads(c.arguments)) for c in parser.extract(text).calls] == [
            ("get_weather", {"city": "Paris"}), ("t", {})]
        assert "get_weather" in parser.render_tools([{"type": "function", "function": {"name": "get_weather"}}])


# ---- tools.py ---------------------------------------------------------------------------------
def fn(name, parameters=None):
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


@pytest.mark.parametrize("tools,fragment", [
    ([{"type": "function"}], "tools[0] needs a 'function'"),
    ([{"type": "function", "function": {"description": "x"}}], "tools[0].function.name is required"),
    ([fn("a"), fn("a")], "duplicate"),
    ([fn("a", parameters=[1])], "parameters must be a JSON schema object"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}], "describe an object"),
    ([fn("has space")], "letters, digits"),
    ([{"type": "retrieval", "function": {"name": "a"}}], "type must be 'function'"),
])
def test_bad_tools(tools, fragment):
    with pytest.raises(ToolRequestError, match=fragment.replace("[", r"\[").replace("]", r"\]")) as e:
        parse_tools(tools)
    assert e.value.param.startswith("tools.")


def test_tool_choice():
    tools = parse_tools([fn("a"), fn("b", {"type": "object", "properties": {"x": {"type": "integer"}}})])
    assert resolve_tool_choice(None, [], None) == ToolChoice("none")
    assert resolve_tool_choice(None, tools, "hermes") == ToolChoice("auto")
    assert resolve_tool_choice({"type": "function", "function": {"name": "b"}}, tools, None) == ToolChoice("named", "b")
    for raw, auto, fragment in [(None, None, "--enable-auto-tool-choice"), ("auto", None, "--tool-call-parser"),
                                ("sometimes", "hermes", "not one of"),
                                ({"type": "function", "function": {"name": "zz"}}, None, "not among the tools")]:
        with pytest.raises(ToolRequestError, match=fragment):
            resolve_tool_choice(raw, tools, auto)
    with pytest.raises(ToolRequestError, match="needs tools"):
        resolve_tool_choice("required", [], None)

    named = forced_call_output(ToolChoice("named", "b"), tools, None)
    assert named.json == tools[1].parameters
    required = forced_call_output(ToolChoice("required"), tools, 1).json
    assert required["minItems"] == 1 and required["maxItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in required["items"]["anyOf"]] == [["a"], ["b"]]
    assert "maxItems" not in forced_call_output(ToolChoice("required"), tools, None).json
    assert forced_call_output(ToolChoice("required"), tools, 3).json["maxItems"] == 3  # max_tool_calls
    assert forced_call_output(ToolChoice("auto"), tools, None) is None


def test_template_conversation_fallback_and_structured():
    tools = parse_tools([fn("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_1"},
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_2"},
    ]
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    conv, passed = template_conversation(messages, tools, plain, None)
    assert passed is None  # described in the system message instead
    assert conv[0]["role"] == "system" and conv[0]["content"].startswith("Be brief.\n\n")
    assert "<tools>" in conv[0]["content"]
    assert "get_weather" in conv[0]["content"]
    assert conv[2] == {"role": "assistant", "content":
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert conv[3]["role"] == "user" and conv[3]["content"].count("<tool_response>") == 2 and len(conv) == 4

    aware = "{{ tools }}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
    conv, passed = template_conversation(messages, tools, aware, None)
    assert passed == [t.to_openai() for t in tools]
    assert conv[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object for templates
    assert conv[3]["role"] == "tool" and conv[3]["tool_call_id"] == "call_1"
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the input is untouched

    no_system, _ = template_conversation(messages[1:2], tools, plain, Llama3JsonToolParser())
    assert no_system[0]["role"] == "system" and '"parameters"' in no_system[0]["content"]
    assert template_conversation(messages[1:2], [], plain, None) == (messages[1:2], None)


def test_required_keeps_references_resolvable():
    """In "required"'s array each tool's schema moves under items/anyOf/k: its local $refs follow it."""
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}, "self": {"$ref": "#"}},
            "enum": [{"$ref": "#/not/a/reference"}]}
    tools = parse_tools([fn("a"), fn("b", {"type": "object", "$defs": {"node": node},
                                            "properties": {"n": {"$ref": "#/$defs/node"}}})])
    b = forced_call_output(ToolChoice("required"), tools, None).json["items"]["anyOf"][1]["properties"]["parameters"]
    where = "#/items/anyOf/1/properties/parameters"
    assert b["properties"]["n"]["$ref"] == where + "/$defs/node"
    assert b["$defs"]["node"]["properties"]["next"]["$ref"] == where + "/$defs/node"
    assert b["$defs"]["node"]["properties"]["self"]["$ref"] == where
    assert b["$defs"]["node"]["enum"] == [{"$ref": "#/not/a/reference"}]  # data, not a schema
    assert tools[1].parameters["properties"]["n"]["$ref"] == "#/$defs/node"  # the request's own is untouched
    for ref in ("https://example.com/s.json", "file:///etc/passwd", "other.json#/x"):
        with pytest.raises(ToolRequestError, match="not supported") as e:
            parse_tools([fn("c", {"type": "object", "properties": {"x": {"anyOf": [{"$ref": ref}]}}})])
        assert e.value.param == "tools.0.function.parameters"


def test_function_tool_defaults():
    tool = FunctionTool("f")
    assert tool.arguments_schema == {"type": "object"} and tool.to_openai() == {"type": "function",
                                                                                "function": {"name": "f"}}
