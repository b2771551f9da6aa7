"""The command line: generated flags and their help, serve's API key and start-up line, chat's context."""

import argparse
import dataclasses
import logging

import pytest

from tests.test_config import COMMANDS
from tokenmill.config import ConfigError, EngineConfig, LoadConfig
from tokenmill.entrypoints import cli, serve_cli


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_every_default(name):
    formatter = cli.HelpFormatter(name)
    for action in COMMANDS[name]._actions:
        if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "help":
            assert action.help, f"{name}: {action.option_strings[0]} has no help"
            assert "(default" in formatter._get_help_string(action), f"{name}: {action.option_strings[0]}"
    COMMANDS[name].format_help()  # no stray % in a help text


def test_serve_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for cls in (LoadConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in out, f.name
    assert "--no-enable-prefix-caching, --no-prefix-caching" in out and "--seed SEED, --engine-seed SEED" in out
    assert "(default: 256)" in out and "--api-key-file PATH" in out


def test_flags_and_their_earlier_spellings_parse():
    args = parse("serve", "--no-prefix-caching", "--no-async-scheduling", "--no-fused-small-batch-linear",
                 "--engine-seed", "5", "--max-model-len", "128", "--kv-cache-memory-gb", "0.5")
    config = cli.engine_config_from_args(args)
    assert (config.enable_prefix_caching, config.async_scheduling, config.fused_small_batch_linear) == (False,) * 3
    assert (config.seed, config.max_model_len, config.kv_cache_memory_gb) == (5, 128, 0.5)
    fresh = parse("serve", "--no-enable-prefix-caching", "--enable-prefix-caching", "--seed", "9")
    assert fresh.enable_prefix_caching and fresh.seed == 9
    assert parse("serve").enable_prefix_caching and parse("serve").max_model_len is None


def test_seed_in_generate_and_chat_is_the_sampling_seed():
    for command in (["generate", "hi"], ["chat"]):
        args = parse(*command, "--seed", "3", "--engine-seed", "4")
        assert (args.sample_seed, args.seed) == (3, 4)


@pytest.mark.parametrize("argv,message", [
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["--block-size", "7"], "argument --block-size: invalid choice: 7"),
    (["--load-format", "pt"], "argument --load-format: invalid choice: 'pt'"),
    (["--gpu-memory-utilization", "x"], "invalid float value: 'x'"),
])
def test_bad_flag_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def no_engine(*args, **kwargs):
    raise AssertionError("the model must not load")


def test_out_of_range_values_fail_before_loading(monkeypatch, capsys):
    import tokenmill.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "LLMEngine", no_engine)
    assert cli.main(["generate", "hi", "--max-num-seqs", "0"]) == 2
    assert "error: max_num_seqs must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["chat", "--gpu-memory-utilization", "1.5"]) == 2
    assert "gpu_memory_utilization must be in (0, 1]" in capsys.readouterr().err


# ---- serve: the API key ---------------------------------------------------------------------

def test_api_key_sources(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret\n")
    assert serve_cli.resolve_api_key(None, None, {}) is None
    assert serve_cli.resolve_api_key(" k1 ", None, {"TOKENMILL_API_KEY": "env"}) == "k1"
    assert serve_cli.resolve_api_key(None, str(key_file), {"TOKENMILL_API_KEY": "env"}) == "s3cret"
    assert serve_cli.resolve_api_key(None, None, {"TOKENMILL_API_KEY": "env"}) == "env"


@pytest.mark.parametrize("api_key,file_text,environ,message", [
    ("", None, {}, "--api-key is empty"),
    ("  \t", None, {}, "--api-key is empty"),
    (None, " \n", {}, "--api-key-file .* is empty"),
    (None, None, {"TOKENMILL_API_KEY": ""}, r"\$TOKENMILL_API_KEY is empty"),
    (None, None, {"TOKENMILL_API_KEY": "  "}, r"\$TOKENMILL_API_KEY is empty"),
    ("k", "k", {}, "not both"),
])
def test_empty_api_keys_are_errors(api_key, file_text, environ, message, tmp_path):
    path = None
    if file_text is not None:
        path = tmp_path / "key"
        path.write_text(file_text)
    with pytest.raises(ConfigError, match=message):
        serve_cli.resolve_api_key(api_key, None if path is None else str(path), environ)


def test_missing_key_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read --api-key-file"):
        serve_cli.resolve_api_key(None, str(tmp_path / "absent"), {})


@pytest.mark.parametrize("argv,env,message", [
    (["--api-key", ""], None, "error: --api-key is empty"),
    (["--api-key", "   "], None, "error: --api-key is empty"),
    ([], "", "error: $TOKENMILL_API_KEY is empty"),
])
def test_serve_refuses_an_empty_key_before_loading(argv, env, message, monkeypatch, capsys):
    monkeypatch.setattr(cli, "engine_from_args", no_engine)
    if env is None:
        monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TOKENMILL_API_KEY", env)
    assert cli.main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_both_key_flags(tmp_path, capsys):
    (tmp_path / "key").write_text("k")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--api-key", "k", "--api-key-file", str(tmp_path / "key")])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# ---- serve: the start-up line ---------------------------------------------------------------

@pytest.fixture
def small_engine(smollm, monkeypatch):
    """engine_from_args over the session's embedded model (no second load), with the parsed config."""
    from tokenmill.engine.llm_engine import LLMEngine

    made = []

    def build(args):
        made.append(LLMEngine(config=cli.engine_config_from_args(args), loaded=smollm))
        return made[-1]

    monkeypatch.setattr(cli, "engine_from_args", build)
    return made


@pytest.fixture
def tokenmill_log():
    """Records of the tokenmill loggers; the level the test left is put back."""
    root = logging.getLogger("tokenmill")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    level = root.level
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)
    root.setLevel(level)


def test_serve_logs_a_start_up_summary_at_the_default_level(small_engine, tokenmill_log, monkeypatch):
    api_server = pytest.importorskip("tokenmill.serve.openai.api_server")
    served = []
    monkeypatch.setattr(api_server, "run_server", lambda engine, **kw: served.append(kw) or 0)
    monkeypatch.delenv("TOKENMILL_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    argv = ["serve", "--num-kv-blocks", "64", "--max-model-len", "512", "--port", "8123", "--host", "0.0.0.0"]
    for mode in ([], ["--no-engine-process"]):
        tokenmill_log.clear()
        served.clear()
        assert cli.main(argv + mode) == 0
        assert served and served[0]["port"] == 8123
        assert tokenmill_log[-1].levelno == logging.INFO
        text = [r.getMessage() for r in tokenmill_log]
        summaries = [line for line in text if "KV cache 64 blocks" in line]
        assert len(summaries) == 1, (mode, text)  # the engine's summary once, whether in a process or not
        for part in ("smollm2-135m-instruct", "LlamaForCausalLM", "float32 on cpu", "context length 512",
                     "KV cache 64 blocks x 16 = 1024 tokens", "CUDA graphs off"):
            assert part in summaries[0], (part, summaries[0])
        assert sum("binding http://0.0.0.0:8123" in line for line in text) == 1, (mode, text)


def test_summary_brackets_an_ipv6_address(small_engine):
    engine = cli.engine_from_args(parse("serve", "--num-kv-blocks", "8", "--max-model-len", "64"))
    assert serve_cli.startup_summary(engine, "::1", 80).endswith("binding http://[::1]:80")


# ---- chat: a conversation that outgrows the context ----------------------------------------

def test_chat_drops_the_oldest_turns_and_keeps_going(small_engine, monkeypatch, capsys):
    lines = iter(["Name a colour.", "Name a fruit.", "Name a tree.", "word " * 100, "Name a bird.", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    prompts = []
    real = cli.stream_completion
    monkeypatch.setattr(cli, "stream_completion", lambda engine, ids, params: prompts.append(ids) or
                        real(engine, ids, params))
    # Each turn takes some 18 tokens, the system prompt 12: a third turn does not fit beside two others.
    argv = ["chat", "--system", "Be brief.", "--max-model-len", "48", "--max-tokens", "4", "--temperature", "0"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "dropped the 1 oldest turn]" in err
    assert "this message needs" in err and "dropped; send a shorter one" in err
    assert len(prompts) == 4  # the long message never ran; the one after it did
    tok = small_engine[0].tokenizer
    texts = [tok.decode(ids) for ids in prompts]
    assert all("Be brief." in t for t in texts)  # the system prompt stays
    assert "Name a colour." in texts[1] and "Name a colour." not in texts[2] and "Name a fruit." in texts[2]
    assert "Name a bird." in texts[3] and "word word" not in texts[3]


def test_serve_refuses_a_zero_per_request_limit(capsys):
    assert cli.main(["serve", "--max-sequences-per-request", "0"]) == 2
    assert "--max-sequences-per-request must be at least 1" in capsys.readouterr().err


# ---- usage errors, Ctrl-C, the progress bar's rates -----------------------------------------

@pytest.mark.parametrize("argv, usage", [
    (["generate", "hi", "--max-tokenz", "5"], "usage: tokenmill generate"),
    (["generate", "hi", "--max-token", "5"], "usage: tokenmill generate"),  # no abbreviations
    (["bench", "throughput", "--workload", "tiny", "--repat", "2"], "usage: tokenmill bench throughput"),
])
def test_unknown_flags_show_their_subcommands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(usage), err
    assert "unrecognized arguments: " + argv[-2] in err


def test_ctrl_c_in_generate_exits_quietly_with_130(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    # Random weights never end the reply early, so it is still generating when the signal comes.
    argv = [sys.executable, "-m", "tokenmill.entrypoints.cli", "generate", "Once upon a time", "--raw",
            "--load-format", "dummy", "--model", "smollm2-135m", "--tokenizer", "smollm2-135m-instruct",
            "--max-model-len", "1024", "--num-kv-blocks", "64", "--max-tokens", "1000"]
    def as_from_a_shell():  # an ignored or blocked SIGINT in this test process would be inherited
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy(),
                            preexec_fn=as_from_a_shell)
    try:
        assert proc.stdout.read(1), "no token before the process ended"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()


@pytest.mark.parametrize("tokens, seconds, shown", [
    (1234, 1.0, "1234 tok/s"), (35, 10.0, "3.5 tok/s"), (4, 10.0, "0.4 tok/s"), (2, 5.0, "0.4 tok/s"),
    (1, 25.0, "25.0 s/tok"), (0, 3.0, "0 tok/s"),
])
def test_progress_bar_rates_below_one_token_a_second(tokens, seconds, shown):
    from tokenmill.entrypoints.llm import format_rate

    assert format_rate(tokens, seconds) == shown


def test_convert_writes_the_embedded_models_hf_directory_in_bf16(tmp_path, capsys):
    import json

    from safetensors import safe_open

    out = tmp_path / "hf"
    assert cli.main(["convert", "smollm2-135m-instruct", str(out), "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [config["vocab_size"], config["hidden_size"]]
        assert embed.get_dtype() == "BF16"
    assert (out / "tokenizer.json").is_file()
    assert cli.main(["convert", "smollm2-135m-instruct", str(out)]) == 2  # never over an existing directory
