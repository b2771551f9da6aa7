"""Chat-template options (the request's chat_template and chat_template_kwargs, `--chat-template`),
/tokenize and /detokenize, and tool_choice "auto" on a server without the tool flags.

One server for the module, started with `--chat-template FILE` (a template that marks its output and
prints the `greeting` variable when a request sets it) and no tool flags.
"""

import json
from types import SimpleNamespace

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
FLAG_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if greeting is defined %}FLAG {{ greeting }}\n{% endif %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REQUEST_TEMPLATE = "REQ[{{ messages[0]['content'] }}|{{ who }}]{% if add_generation_prompt %}!{% endif %}"
HI = [{"role": "user", "content": "Hello there"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "flag.jinja"
    path.write_text(FLAG_TEMPLATE)
    return start_server(SMALL_ENGINE + ["--chat-template", str(path), "--trust-request-chat-template"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def tokenize(server, **body) -> dict:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


def detokenize(server, tokens) -> str:
    r = post(server, "/detokenize", {"tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_tokenize_detokenize_round_trip(server, smollm):
    tok = smollm.tokenizer
    for text in ["The capital of France is", "Hello, wörld! 🙂 <|im_start|>", ""]:
        out = tokenize(server, prompt=text, model=MODEL)
        assert out["tokens"] == tok(text, add_special_tokens=True)["input_ids"]
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0 and out["token_strs"] is None
        assert detokenize(server, out["tokens"]) == tok.decode(out["tokens"])
        assert detokenize(server, out["tokens"]) == text
    strs = tokenize(server, prompt="Hello world", return_token_strs=True)["token_strs"]
    assert strs == tok.convert_ids_to_tokens(tok("Hello world")["input_ids"])
    for bad in ([len(tok) + 10], [-1], [2**40]):
        r = post(server, "/detokenize", {"tokens": bad})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text
    for body, fragment in [({"prompt": "x", "messages": HI}, "exactly one"), ({}, "exactly one"),
                           ({"prompt": "x", "model": "other"}, "does not exist"), ({"tokens": "x"}, None)]:
        r = post(server, "/tokenize", body)
        assert r.status_code in (400, 404), r.text
        assert fragment is None or fragment in r.json()["error"]["message"]
    assert detokenize(server, tokenize(server, prompt="still serving")["tokens"]) == "still serving"


def test_flag_template_and_kwargs_reach_the_template(server, client, smollm):
    out = tokenize(server, messages=HI)
    text = detokenize(server, out["tokens"])
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"  # the flag's template
    assert out["tokens"] == smollm.tokenizer(text, add_special_tokens=False)["input_ids"]
    greeted = detokenize(server, tokenize(server, messages=HI, chat_template_kwargs={"greeting": "ahoy"})["tokens"])
    assert "FLAG ahoy\n" in greeted
    bare = detokenize(server, tokenize(server, messages=HI, add_generation_prompt=False)["tokens"])
    assert bare == "<|im_start|>user\nHello there<|im_end|>\n"

    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0,
                                       extra_body={"chat_template_kwargs": {"greeting": "ahoy"}})
    assert r.usage.prompt_tokens == len(smollm.tokenizer(greeted, add_special_tokens=False)["input_ids"])


def test_request_chat_template_overrides(server, client):
    body = dict(messages=HI, chat_template=REQUEST_TEMPLATE, chat_template_kwargs={"who": "xyz"})
    out = tokenize(server, **body)
    assert detokenize(server, out["tokens"]) == "REQ[Hello there|xyz]!"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                       extra_body={"chat_template": REQUEST_TEMPLATE,
                                                   "chat_template_kwargs": {"who": "xyz"}})
    assert r.usage.prompt_tokens == out["count"]
    # A template that handles tools gets them, and the calls and results, structured.
    aware = ("{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}:"
             "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
             "{{ m.content }}{{ m.tool_call_id or '' }}|{% endfor %}")
    conversation = HI + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "-3"}]
    text = detokenize(server, tokenize(server, messages=conversation, tools=[TOOL], chat_template=aware)["tokens"])
    assert text == "T:get_weather;user:Hello there|assistant:get_weather(Oslo)|tool:-3call_7|"
    # Tools reach a template that ignores them as a system message (hermes' format by default).
    text = detokenize(server, tokenize(server, messages=HI, tools=[TOOL])["tokens"])
    assert text.startswith("<|im_start|>system\n") and '"name": "get_weather"' in text and "<tool_call>" in text


@pytest.mark.parametrize("extra,fragment", [
    ({"chat_template": "{% for m in messages %}{{ m['content'] }"}, "chat template"),
    ({"chat_template": "{{ raise_exception('no such luck') }}"}, "no such luck"),
    ({"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
])
def test_bad_templates_are_400s(server, client, extra, fragment):
    for route, body in (("/v1/chat/completions", {"messages": HI, "max_tokens": 2}), ("/tokenize", {"messages": HI})):
        r = post(server, route, dict(body, **extra))
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices[0].finish_reason


def test_auto_tool_choice_needs_the_server_flags(server, client):
    for extra in ({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "auto"}):
        r = post(server, "/v1/chat/completions", dict({"messages": HI, "max_tokens": 2}, **extra))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]
        assert error["param"] == "tool_choice"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, tools=[TOOL], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_llm_chat_template_options(smollm):
    """LLM.render_chat / LLM.chat take chat_template, chat_template_kwargs and tools as vLLM's do."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.errors import InvalidRequestError
    from tokenmill.sampling_params import SamplingParams

    renderer = LLM.from_engine(SimpleNamespace(tokenizer=smollm.tokenizer))  # render_chat reads only the tokenizer
    assert renderer.render_chat(HI, chat_template=REQUEST_TEMPLATE, chat_template_kwargs={"who": "me"}) == \
        "REQ[Hello there|me]!"
    with pytest.raises(InvalidRequestError, match="chat template"):
        renderer.render_chat(HI, chat_template="{% if %}")
    tools_template = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ messages[-1]['content'] }}"
    assert renderer.render_chat(HI, chat_template=tools_template, tools=[TOOL]) == "get_weather;Hello there"

    llm = LLM.from_engine(LLMEngine(config=EngineConfig(num_kv_blocks=64, max_num_seqs=4), loaded=smollm))
    params = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat(HI, params, use_tqdm=False, chat_template=REQUEST_TEMPLATE, chat_template_kwargs={"who": "me"})[0]
    assert out.prompt == "REQ[Hello there|me]!"
    out = llm.chat(HI, params, use_tqdm=False, tools=[TOOL])[0]  # the model's template ignores tools
    assert out.prompt.startswith("<|im_start|>system\n") and "get_weather" in out.prompt
    out = llm.chat(HI, params, use_tqdm=False, tools=[TOOL], chat_template=tools_template)[0]
    assert out.prompt == "get_weather;Hello there"


def test_chat_template_flag_values(tmp_path):
    from tokenmill.config import ConfigError
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.entrypoints.serve_cli import _check_server_args, load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(FLAG_TEMPLATE)
    assert load_chat_template(str(path)) == FLAG_TEMPLATE
    assert load_chat_template(REQUEST_TEMPLATE) == REQUEST_TEMPLATE  # inline
    assert load_chat_template(None) is None
    with pytest.raises(ConfigError, match="neither a readable file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    parser = build_parser()
    args = parser.parse_args(["serve", "--enable-auto-tool-choice"])
    assert "--tool-call-parser" in _check_server_args(args)
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert _check_server_args(args) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "nope"])
