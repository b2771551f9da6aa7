"""Multi-LoRA serving: `tokenmill serve --enable-lora --lora-modules ...` with the official `openai`
client, checked token for token against HF transformers + PEFT (greedy, fp32 on the CPU).

One server for the module (the embedded model, its engine in a process of its own) with three
adapters from --lora-modules and one loaded at run time (--allow-runtime-lora-updating, --lora-root
the adapters' directory); the same server is probed as an attacker holding the key would (paths out
of the root, symlinks, names). The checks without a model (flags, LoRA not enabled, run-time
loading off by default) run in this process. Generations are short: the model decodes only a few steps per
second on a CPU.
"""

import asyncio
import json
import os
import shutil

import httpx
import pytest
import torch

from tests.lora_adapters import make_adapter, peft_reference
from tests.server.conftest import SMALL_ENGINE

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

MODEL = "smollm2-135m-instruct"
PROMPT = "The best way to learn a new language is"
QUESTION = [{"role": "user", "content": "Name a colour."}]
MAX_LORA_RANK = 16
NEW_TOKENS = 8
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# name -> make_adapter arguments; the first three are served from the start.
ADAPTERS = {
    "ad-all": dict(rank=8, alpha=16.0, seed=1),
    "ad-attn": dict(rank=4, alpha=8.0, target_modules=ATTENTION, seed=2),
    "ad-mlp": dict(rank=16, alpha=32.0, target_modules=MLP, seed=3),
    "late": dict(rank=8, alpha=8.0, seed=4),
}
STARTUP = ["ad-all", "ad-attn", "ad-mlp"]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def adapters(hf_smollm, adapter_dir) -> dict[str, str]:
    return {name: make_adapter(hf_smollm, adapter_dir / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def bad_adapters(hf_smollm, adapter_dir) -> dict[str, str]:
    """Directories the server must refuse, by what is wrong with them."""
    missing = make_adapter(hf_smollm, adapter_dir / "missing-weights", rank=4, seed=5)
    os.remove(os.path.join(missing, "adapter_model.safetensors"))
    dora = make_adapter(hf_smollm, adapter_dir / "dora", rank=4, seed=6)
    config_path = os.path.join(dora, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["use_dora"] = True
    with open(config_path, "w") as f:
        json.dump(config, f)
    too_big = make_adapter(hf_smollm, adapter_dir / "rank32", rank=2 * MAX_LORA_RANK, seed=7)
    return {"missing-weights": missing, "dora": dora, "rank32": too_big,
            "nonexistent": str(adapter_dir / "no-such-adapter")}


@pytest.fixture(scope="module")
def server(start_server, adapters, adapter_dir):
    modules = [f"ad-all={adapters['ad-all']}",
               json.dumps({"name": "ad-attn", "path": adapters["ad-attn"], "base_model_name": MODEL}),
               f"ad-mlp={adapters['ad-mlp']}"]
    return start_server(SMALL_ENGINE + ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "8",
                                        "--max-lora-rank", str(MAX_LORA_RANK), "--allow-runtime-lora-updating",
                                        "--lora-root", str(adapter_dir), "--lora-modules", *modules])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def tokenize(server, **body) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def prompt_ids(server) -> list[int]:
    return tokenize(server, prompt=PROMPT)


@pytest.fixture(scope="module")
def chat_ids(server) -> list[int]:
    return tokenize(server, messages=QUESTION)


def hf_greedy(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """HF generate(do_sample=False) from exactly these prompt ids, never stopping early."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def expected(hf_smollm, adapters, prompt_ids, chat_ids) -> dict:
    """HF (+ PEFT) greedy tokens: (model, "prompt" | "chat" | "long") -> ids."""
    refs = {(MODEL, "prompt"): hf_greedy(hf_smollm, prompt_ids)}
    for name, path in adapters.items():
        peft_model = peft_reference(hf_smollm, path)
        refs[(name, "prompt")] = hf_greedy(peft_model, prompt_ids)
        if name == "ad-attn":
            refs[(name, "chat")] = hf_greedy(peft_model, chat_ids)
        if name == "late":
            refs[(name, "long")] = hf_greedy(peft_model, prompt_ids, 2 * NEW_TOKENS)
        del peft_model
    # The adapters must matter, or matching them would show nothing.
    base = refs[(MODEL, "prompt")]
    assert all(refs[(name, "prompt")] != base for name in adapters)
    return refs


def completion_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def greedy(**kw) -> dict:
    return dict(kw, temperature=0, extra_body={"ignore_eos": True})


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and "message" in body["error"], body
    return body["error"]


def load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120)


def unload(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", json=body, timeout=60)


def test_models_lists_the_adapters(server, client, adapters, adapter_dir):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [MODEL] + STARTUP
    for name in STARTUP:
        card = models[name].model_dump()
        assert card["object"] == "model" and card["owned_by"]
        assert card["root"] == name and card["parent"] == MODEL
    assert client.models.retrieve("ad-mlp").model_dump()["root"] == "ad-mlp"
    # No client learns where the server keeps its adapters.
    for url in ("/v1/models", "/v1/models/ad-mlp"):
        assert str(adapter_dir) not in httpx.get(server.url + url, timeout=30).text
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("late")  # not loaded yet


def test_adapters_and_base_in_one_burst_match_hf_peft(server, prompt_ids, chat_ids, expected):
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

    async def streamed(model: str) -> list[int]:
        ids = []
        stream = await aclient.completions.create(**greedy(model=model, prompt=prompt_ids, max_tokens=NEW_TOKENS,
                                                           stream=True))
        async for chunk in stream:
            for choice in chunk.choices:
                assert chunk.model == model
                ids += completion_ids(choice)
        return ids

    async def burst():
        completions = [aclient.completions.create(**greedy(model=m, prompt=prompt_ids, max_tokens=NEW_TOKENS))
                       for m in [MODEL] + STARTUP]
        chat = aclient.chat.completions.create(**greedy(model="ad-attn", messages=QUESTION,
                                                        max_tokens=NEW_TOKENS))
        try:
            return await asyncio.gather(*completions, chat, streamed("ad-mlp"))
        finally:
            await aclient.close()

    *outs, chat, stream_ids = asyncio.run(burst())
    for model, out in zip([MODEL] + STARTUP, outs):
        assert out.model == model
        assert completion_ids(out.choices[0]) == expected[(model, "prompt")], model
    assert chat.model == "ad-attn"
    assert completion_ids(chat.choices[0]) == expected[("ad-attn", "chat")]
    assert stream_ids == expected[("ad-mlp", "prompt")]


def test_unknown_model_is_still_a_404(client, prompt_ids):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt=prompt_ids, max_tokens=2)
    assert "no-such-adapter" in str(info.value)


def test_tokenize_accepts_adapter_names(server, prompt_ids):
    assert tokenize(server, model="ad-all", prompt=PROMPT) == prompt_ids


def test_load_use_and_unload_while_in_use(server, client, adapters, prompt_ids, expected):
    r = load(server, "late", adapters["late"])
    assert r.status_code == 200, r.text
    assert "late" in r.text
    assert [m.id for m in client.models.list().data] == [MODEL] + STARTUP + ["late"]
    card = client.models.retrieve("late").model_dump()
    assert card["root"] == "late" and card["parent"] == MODEL
    out = client.completions.create(**greedy(model="late", prompt=prompt_ids, max_tokens=NEW_TOKENS))
    assert completion_ids(out.choices[0]) == expected[("late", "prompt")]

    again = load(server, "late", adapters["ad-all"])
    assert again.status_code == 400 and "already loaded" in error_of(again)["message"]
    assert adapters["late"] not in error_of(again)["message"]
    clash = load(server, MODEL, adapters["ad-all"])
    assert clash.status_code == 400 and "base model" in error_of(clash)["message"]

    # Unloaded while a request streams with it: that request finishes with the adapter.
    stream = client.completions.create(**greedy(model="late", prompt=prompt_ids, max_tokens=2 * NEW_TOKENS,
                                                stream=True))
    chunks = iter(stream)
    ids = completion_ids(next(chunks).choices[0])
    gone = unload(server, lora_name="late")
    assert gone.status_code == 200, gone.text
    for chunk in chunks:
        for choice in chunk.choices:
            ids += completion_ids(choice)
    assert ids == expected[("late", "long")]

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=prompt_ids, max_tokens=2)
    assert [m.id for m in client.models.list().data] == [MODEL] + STARTUP
    twice = unload(server, lora_name="late")
    assert twice.status_code == 404 and "late" in error_of(twice)["message"]
    base = unload(server, lora_name=MODEL)
    assert base.status_code == 400 and "base model" in error_of(base)["message"]


@pytest.mark.parametrize("kind, words", [
    ("missing-weights", ("adapter_model", "safetensors", "missing", "not found", "no such")),
    ("dora", ("dora",)),
    ("rank32", ("rank",)),
    ("nonexistent", ("--lora-root",)),
])
def test_bad_adapter_is_a_400_and_the_server_keeps_serving(server, client, bad_adapters, prompt_ids, expected,
                                                           kind, words):
    r = load(server, f"bad-{kind}", bad_adapters[kind])
    assert r.status_code == 400, r.text
    message = error_of(r)["message"]
    assert any(w in message.replace(bad_adapters[kind], "").lower() for w in words), message
    if kind == "rank32":
        assert str(MAX_LORA_RANK) in message or "32" in message, message
    assert f"bad-{kind}" not in [m.id for m in client.models.list().data]
    out = client.completions.create(**greedy(model="ad-all", prompt=prompt_ids, max_tokens=NEW_TOKENS))
    assert completion_ids(out.choices[0]) == expected[("ad-all", "prompt")]
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_attacker_cannot_probe_the_servers_files(server, client, adapters, adapter_dir, tmp_path_factory,
                                                    prompt_ids):
    """Every lora_path outside --lora-root, or not an adapter, gets the same answer; names are a safe
    set; an adapter under the root loads by a relative path too."""
    from tokenmill.serve.openai.lora import REFUSED_PATH

    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(adapters["late"], outside / "stolen")  # a valid adapter, but not under the root
    (outside / "secret.json").write_text("{}")
    os.symlink(outside / "stolen", adapter_dir / "link-out")  # a link in the root to a directory out of it
    linked_files = adapter_dir / "linked-files"
    linked_files.mkdir()
    os.symlink(outside / "stolen" / "adapter_config.json", linked_files / "adapter_config.json")
    os.symlink(outside / "stolen" / "adapter_model.safetensors", linked_files / "adapter_model.safetensors")
    (adapter_dir / "no-config").mkdir()
    (adapter_dir / "a-file").write_text("x")
    up = os.path.relpath("/", adapter_dir)
    probes = [
        str(adapter_dir / ".." / outside.name / "stolen"), "../" + outside.name + "/stolen",  # .. out of the root
        os.path.join(up, "etc"), os.path.join(up, "etc", "passwd"), "/etc", "/etc/passwd", "/",
        str(outside / "stolen"), str(outside / "secret.json"),  # absolute paths out of the root
        str(adapter_dir / "link-out"), "link-out", str(linked_files),  # symlinks out of the root
        str(adapter_dir / "no-such-dir"), str(outside / "no-such-dir"),  # nonexistent ...
        str(adapter_dir / "no-config"), str(adapter_dir / "a-file"), str(outside),  # ... and no adapter_config.json
        str(adapter_dir), ".", "x\x00y",
    ]
    messages = set()
    for i, path in enumerate(probes):
        r = load(server, f"probe-{i}", path)
        assert r.status_code == 400, (path, r.text)
        error = error_of(r)
        assert error["param"] == "lora_path", (path, error)
        messages.add(error["message"])
    assert messages == {REFUSED_PATH}  # one text: nothing tells what exists out there

    for name in ["../../x", "a/b", "..", ".hidden", "-x", "x y", "x\n", "é", "", "a" * 129]:
        r = load(server, name, adapters["late"])
        assert r.status_code == 400 and error_of(r)["param"] == "lora_name", (name, r.text)
    assert [m.id for m in client.models.list().data] == [MODEL] + STARTUP

    r = load(server, "relative", "ad-all")  # relative to the root
    assert r.status_code == 200, r.text
    outs = [client.completions.create(**greedy(model=m, prompt=prompt_ids, max_tokens=NEW_TOKENS))
            for m in ("relative", "ad-all")]
    assert completion_ids(outs[0].choices[0]) == completion_ids(outs[1].choices[0])  # the same adapter
    assert unload(server, lora_name="relative").status_code == 200


# ---- without a served model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from tokenmill.loader import load_model

    return load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32")


def tiny_app(tiny, **settings):
    """The app around a tiny engine that is never started: the LoRA routes refuse before using it."""
    from starlette.testclient import TestClient

    from tokenmill.config import EngineConfig
    from tokenmill.serve.async_engine import AsyncLLMEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.serve.openai.api_server import ServerSettings, build_app

    engine = LLMEngine(config=EngineConfig(num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=256), loaded=tiny)
    return TestClient(build_app(AsyncLLMEngine(engine), ServerSettings(**settings)))


def test_lora_not_enabled_and_several_api_servers_refuse_loading(tiny, adapters, adapter_dir):
    from tokenmill.config import ConfigError

    app = tiny_app(tiny)
    r = app.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["late"]})
    assert r.status_code == 400 and "--enable-lora" in error_of(r)["message"]
    r = app.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and "--enable-lora" in error_of(r)["message"]
    r = app.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in error_of(r)["message"]

    # LoRA on, run-time updating not allowed (the default): both routes refuse, naming the flag.
    default = tiny_app(tiny, enable_lora=True)
    for route, body in [("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["late"]}),
                        ("/v1/unload_lora_adapter", {"lora_name": "x"})]:
        r = default.post(route, json=body)
        assert r.status_code == 400 and "--allow-runtime-lora-updating" in error_of(r)["message"], r.text
    with pytest.raises(ConfigError, match="--lora-root"):
        tiny_app(tiny, enable_lora=True, allow_runtime_lora_updating=True)

    several = tiny_app(tiny, enable_lora=True, api_server_count=2, allow_runtime_lora_updating=True,
                       lora_roots=[str(adapter_dir)])
    r = several.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["late"]})
    assert r.status_code == 400 and "--api-server-count" in error_of(r)["message"]


def test_lora_flags_are_checked_before_the_model_loads(capsys, adapters, tmp_path):
    from tokenmill.config import ConfigError
    from tokenmill.entrypoints.cli import main
    from tokenmill.serve.openai.lora import LoRAModuleSpec, assign_ids, parse_lora_module

    assert main(["serve", "--lora-modules", f"a={adapters['late']}"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--lora-modules", f"a={tmp_path / 'nothing'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--served-model-name", "m", "--lora-modules", f"m={adapters['late']}"]) == 2
    assert "served model name" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--lora-modules", f"../x={adapters['late']}"]) == 2
    assert "not allowed" in capsys.readouterr().err
    for flags, words in [(["--allow-runtime-lora-updating"], "needs --enable-lora"),
                         (["--enable-lora", "--allow-runtime-lora-updating"], "needs --lora-root"),
                         (["--enable-lora", "--lora-root", str(tmp_path)], "needs --allow-runtime-lora-updating"),
                         (["--enable-lora", "--allow-runtime-lora-updating", "--lora-root", str(tmp_path / "no")],
                          "not a directory")]:
        assert main(["serve", *flags]) == 2
        assert words in capsys.readouterr().err

    assert parse_lora_module("a=/p") == LoRAModuleSpec("a", "/p")
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "b"}') == LoRAModuleSpec("a", "/p", "b")
    for bad in ["a", "=/p", "a=", '{"name": "a"}', '{"name": "a", "path": "/p", "rank": 4}', "{oops"]:
        with pytest.raises(ConfigError):
            parse_lora_module(bad)
    modules = assign_ids([LoRAModuleSpec("a", "/p"), LoRAModuleSpec("b", "/q")], ["m"])
    assert [(m.name, m.request.lora_int_id) for m in modules] == [("a", 1), ("b", 2)]
    with pytest.raises(ConfigError, match="twice"):
        assign_ids([LoRAModuleSpec("a", "/p"), LoRAModuleSpec("a", "/q")], ["m"])


def test_a_bad_adapter_at_start_up_stops_the_server(bad_adapters):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "tiny-llama", "--load-format", "dummy",
           "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32", "--no-engine-process", "--enable-lora",
           "--lora-modules", f"bad={bad_adapters['dora']}", "--port", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"--lora-modules bad={bad_adapters['dora']}:" in done.stderr, done.stderr[-3000:]
    assert "dora" in done.stderr.replace(bad_adapters["dora"], "").lower(), done.stderr[-3000:]
