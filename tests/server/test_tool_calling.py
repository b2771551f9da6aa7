"""Tool calling through the official `openai` client against `tokenmill serve` on the embedded model.

One server for the module, started with `--enable-auto-tool-choice --tool-call-parser hermes`. The
embedded SmolLM2-135M's chat template ignores tools, so the server describes them in the system
message in hermes' format and renders earlier calls and results as hermes text. Under greedy
decoding the 135M model really does emit a `<tool_call>` block for `auto` when the conversation
holds three earlier rounds of question, call, result and answer (with two it copies the result
tag instead); `required` and a named function are forced by structured output.
"""

import json
import re

import httpx
import jsonschema
import pytest

from tests.server.conftest import SMALL_ENGINE

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the time in a time zone",
                                      "parameters": ZONE}},
]
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}


def history() -> list[dict]:
    """Three earlier rounds (question, the assistant's call, the tool's result, the answer), then a
    new question."""
    messages = [{"role": "system", "content": "You are a helpful assistant with tools."}]
    for i, (city, temp) in enumerate([("Paris", 18), ("London", 12), ("Rome", 24)]):
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"temperature": temp})},
            {"role": "assistant", "content": f"It is {temp} degrees in {city}."},
        ]
    return messages + [{"role": "user", "content": "What is the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(SMALL_ENGINE + ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, names=None) -> list[tuple[str, dict]]:
    """Each call is well formed and its arguments validate against its tool's parameters."""
    out = []
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS and (names is None or call.function.name in names)
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def streamed(client, **kwargs):
    """The stream's final completion as the openai client accumulates it, and the raw chunks' deltas."""
    with client.chat.completions.stream(model=MODEL, temperature=0, **kwargs) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def follow_up(messages: list[dict], message) -> list[dict]:
    """The conversation with the assistant's calls and a result for each."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls]
    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 25})}
               for c in message.tool_calls]
    return messages + [{"role": "assistant", "content": message.content, "tool_calls": calls}] + results


def test_auto_round_trip(client):
    messages = history()
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert check_calls(choice.message.tool_calls) == [("get_weather", {"city": "Tokyo"})]

    s = streamed(client, messages=messages, tools=TOOLS, max_tokens=40)
    assert s.choices[0].finish_reason == "tool_calls"
    assert not s.choices[0].message.content
    assert check_calls(s.choices[0].message.tool_calls) == [("get_weather", {"city": "Tokyo"})]

    final = client.chat.completions.create(model=MODEL, messages=follow_up(messages, choice.message), tools=TOOLS,
                                           max_tokens=20, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "25" in answer.message.content and "Tokyo" in answer.message.content
    s = streamed(client, messages=follow_up(messages, choice.message), tools=TOOLS, max_tokens=20)
    assert s.choices[0].message.content == answer.message.content and not s.choices[0].message.tool_calls


def test_auto_streams_raw_deltas_in_openai_form(server):
    body = {"model": MODEL, "messages": history(), "tools": TOOLS, "max_tokens": 40, "temperature": 0, "stream": True}
    deltas, finish = [], None
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                deltas.extend(choice["delta"].get("tool_calls") or [])
                finish = choice["finish_reason"] or finish
    assert finish == "tool_calls"
    start = deltas[0]
    assert start["index"] == 0 and start["type"] == "function" and start["id"].startswith("call_")
    assert start["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])
    assert json.loads("".join(d["function"]["arguments"] for d in deltas[1:])) == {"city": "Tokyo"}


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_streamed_arguments_come_in_fragments(client, mode):
    """Streamed, a call's arguments arrive in several fragments as they are generated (not whole at
    the end), joining to the arguments the same request gets unstreamed; no chunk is an empty
    content delta, and the chunks still carry every token id."""
    if mode == "auto":
        kwargs = dict(messages=history(), tools=TOOLS, max_tokens=40)
    else:
        kwargs = dict(messages=[{"role": "user", "content": "What is the weather in Tokyo?"}], tools=TOOLS,
                      tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    whole = client.chat.completions.create(model=MODEL, temperature=0, **kwargs)
    [call] = whole.choices[0].message.tool_calls
    fragments, starts, finish, token_ids = [], [], None, 0
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kwargs):
        [choice] = chunk.choices
        delta = choice.delta
        if delta.role is None:  # after the first chunk (the role's)
            assert delta.content != "" and (delta.content or delta.tool_calls or choice.finish_reason), chunk
        for d in delta.tool_calls or []:
            if d.id is not None:
                starts.append((d.index, d.function.name))
            elif d.function.arguments:
                fragments.append(d.function.arguments)
        finish = choice.finish_reason or finish
        token_ids += len(choice.model_extra.get("token_ids") or [])
    assert finish == "tool_calls"
    assert starts == [(0, call.function.name)]
    assert len(fragments) > 1, fragments
    assert "".join(fragments) == call.function.arguments
    json.loads(call.function.arguments)
    assert token_ids == whole.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_required_round_trip(client, stream):
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    kwargs = dict(messages=messages, tools=TOOLS, tool_choice="required", max_tokens=40, parallel_tool_calls=False)
    if stream:
        r = streamed(client, **kwargs)
    else:
        r = client.chat.completions.create(model=MODEL, temperature=0, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = check_calls(choice.message.tool_calls)
    assert len(calls) == 1  # parallel_tool_calls false: maxItems 1
    final = client.chat.completions.create(model=MODEL, messages=follow_up(messages, choice.message), tools=TOOLS,
                                           tool_choice="none", max_tokens=12, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_round_trip(client, stream):
    messages = [{"role": "user", "content": "Is it raining in Tokyo?"}]
    kwargs = dict(messages=messages, tools=TOOLS, max_tokens=30,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = streamed(client, **kwargs) if stream else client.chat.completions.create(model=MODEL, temperature=0, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [(name, args)] = check_calls(choice.message.tool_calls, names={"get_weather"})
    final = client.chat.completions.create(model=MODEL, messages=follow_up(messages, choice.message), tools=TOOLS,
                                           tool_choice="none", max_tokens=12, temperature=0)
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")


TREE = {"type": "object", "$defs": {"node": {"type": "object", "properties": {
    "label": {"type": "string", "maxLength": 6},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["label"], "additionalProperties": False}},
    "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"], "additionalProperties": False}


def test_required_with_recursive_defs(client):
    """A tool whose parameters use $defs and a recursive $ref works with tool_choice "required" (the
    tool's schema sits inside the array's, so its references are rewritten to resolve there)."""
    tree = {"type": "function", "function": {"name": "draw_tree", "parameters": TREE}}
    messages = [{"role": "user", "content": "Draw a tree with a root and one child."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[tree, TOOLS[1]], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "tool_calls":
        [call] = choice.message.tool_calls
        schema = {"draw_tree": TREE, "get_time": ZONE}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    else:  # cut short: the text is still a prefix of a valid call
        assert choice.message.content is None or choice.message.content.startswith('[{"name":')
    # The same schema as response_format compiles too.
    ok = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "t", "schema": TREE}})
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_returns_text(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


Q = [{"role": "user", "content": "What is the weather in Tokyo?"}]
BAD_REQUESTS = [
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name",
     "tools.0.function.name"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "duplicate", "tools.1.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "an object"}}]), "JSON schema object",
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "intger"}}}}}], tool_choice="required"), "could not be compiled",
     "tools.0.function.parameters"),
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strng"}}}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}), "tools[1].function.parameters ('f')",
     "tools.1.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "https://example.com/x.json"}}}}}], tool_choice="required"), "is not supported",
     "tools.0.function.parameters"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"$ref": "file:///etc/passwd"}}}}}), "is not supported", None),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools",
     "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice needs tools", "tool_choice"),
    (dict(tools=TOOLS, tool_choice="always"), "not one of", "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "cannot be combined",
     "tool_choice"),
    (dict(messages=Q + [{"role": "tool", "content": "18 degrees"}]), "tool_call_id", "messages.1.tool_call_id"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), "only assistant messages",
     "messages.0.tool_calls"),
]


@pytest.mark.parametrize("extra,fragment,param", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_tool_requests_are_400s(server, client, extra, fragment, param):
    body = dict({"model": MODEL, "messages": Q, "max_tokens": 4}, **extra)
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert not re.search(r"\[\d+:\d+:\d+\]|\.cc:\d+", error["message"]), error  # no compiler log prefix
    if param is not None:
        assert error["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=2, tools=TOOLS, tool_choice="none")
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert "Traceback" not in server.log()


def test_request_chat_template_needs_the_trust_flag(server, client):
    """This server was started without --trust-request-chat-template: a request's own template (chat
    or /tokenize) is a 400 naming the flag, and the server goes on."""
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"chat_template": "{{ messages[0]['content'] }}"})
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "chat_template": "{{ 1 }}"}, timeout=30)
    assert r.status_code == 400 and "trust-request-chat-template" in r.json()["error"]["message"]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].message
