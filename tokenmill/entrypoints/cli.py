"""The `tokenmill` command line: generate, chat (and serve, proxy, bench when installed).

The engine and loader flags are generated from the fields of `EngineConfig` and `LoadConfig`
(tokenmill/config.py): each field is one flag named after it, with its type, default and help.
"""

import argparse
import logging
import dataclasses
import json
import sys
import typing
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

from tokenmill.config import EngineConfig, LoadConfig, field_default, scalar_type
from tokenmill.errors import InvalidRequestError
from tokenmill.logger import DEFAULT_LEVEL

class Parser(argparse.ArgumentParser):
    """No abbreviated flags (`--max-token 5` would silently be --max-tokens), and a subcommand
    reports arguments it does not know with its own usage rather than the top level's."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:  # a leaf command: nothing after it could take them
            self.error("unrecognized arguments: " + " ".join(extras))
        return namespace, extras


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class _Switch(argparse.BooleanOptionalAction):
    """--x / --no-x, plus negative aliases (--no-prefix-caching)."""

    def __init__(self, option_strings, dest, negative_aliases: Sequence[str] = (), **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.option_strings = self.option_strings + list(negative_aliases)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_type(annotation: Any):
    """The flag parser of a field that is neither a number, a string nor a boolean: JSON (an object
    becomes the field's dataclass where the field is one)."""
    target = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)

    def parse(text: str):
        value = json.loads(text)
        return target(**value) if dataclasses.is_dataclass(target) and isinstance(value, dict) else value

    parse.__name__ = "JSON"  # argparse's message: "invalid JSON value: ..."
    return parse


def _help(f: dataclasses.Field, default_help: Optional[str]) -> str:
    text = f.metadata.get("help", "")
    return f"{text} (default: {default_help})" if default_help else text


def add_config_args(group, cls: type, skip_flags: Sequence[str] = (),
                    defaults: Mapping[str, tuple[Any, str]] = MappingProxyType({})) -> None:
    """One flag per field of the config dataclass `cls`, named after it (max_num_seqs: --max-num-seqs),
    with the field's type, default, help, choices and aliases. Flags in `skip_flags` are left out;
    `defaults` maps a field to another default for this parser: (value, what the help says of it)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flags = [s for s in (_flag(f.name), *f.metadata.get("aliases", ())) if s not in skip_flags]
        scalar, _ = scalar_type(hints[f.name])
        default, default_help = defaults.get(f.name, (field_default(f), f.metadata.get("default_help")))
        common = dict(dest=f.name, default=default, help=_help(f, default_help))
        if scalar is bool:
            group.add_argument(*[s for s in flags if not s.startswith("--no-")], action=_Switch,
                               negative_aliases=[s for s in flags if s.startswith("--no-")], **common)
        else:
            parse = f.metadata.get("cli_type") or scalar or _json_type(hints[f.name])
            group.add_argument(*flags, type=parse, choices=f.metadata.get("choices"), **common)


def add_engine_args(p: argparse.ArgumentParser, skip_flags: Sequence[str] = (),
                    defaults: Mapping[str, tuple[Any, str]] = MappingProxyType({})) -> None:
    """The loader's and the engine's flags (LoadConfig, EngineConfig); see add_config_args."""
    add_config_args(p.add_argument_group("model"), LoadConfig, skip_flags, defaults)
    add_config_args(p.add_argument_group("engine"), EngineConfig, skip_flags, defaults)


def _config_from_args(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def load_config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The loader's options; a Hub id (org/name) becomes its snapshot directory, fetched now."""
    from tokenmill.loader.hub import local_model

    load = _config_from_args(LoadConfig, args)
    return dataclasses.replace(load, model=local_model(load.model, load.load_format, load.revision,
                                                       load.download_dir))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return _config_from_args(EngineConfig, args)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The flags that give a launched `tokenmill serve` the engine options of `args` that differ
    from the defaults."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, field_default(f))
        if value == field_default(f):
            continue
        if isinstance(value, bool):
            flags.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
        elif isinstance(value, (int, float, str)):
            flags += [_flag(f.name), str(value)]
        else:
            plain = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
            flags += [_flag(f.name), json.dumps(plain)]
    return flags


def engine_from_args(args: argparse.Namespace):
    """Validate the options (a ConfigError before anything loads), then load the model."""
    from tokenmill.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)  # before a Hub download
    load = load_config_from_args(args)
    return LLMEngine(load.model, config, dtype=load.dtype, device=load.device, load_format=load.load_format,
                     tokenizer=load.tokenizer)


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply")
    g.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens whose "
                                                              "probabilities add up to this (1: all)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    g.add_argument("--seed", dest="sample_seed", type=int, default=None,
                   help="sampling seed (default: one drawn from the engine's --engine-seed)")


def _sampling_params(args):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed)


def stream_completion(engine, prompt_ids: list[int], params, out=None) -> str:
    """Run one request, writing its text (to stdout by default) as it is generated; returns the full text."""
    out = out or sys.stdout  # looked up per call: stdout may have been replaced since import
    request_id = engine.add_request(None, params, prompt_ids=prompt_ids)
    shown, text = 0, ""
    try:
        while True:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
                if output.finished:
                    return text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        raise


def _render(engine, conversation: list[dict]) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return engine.tokenize(text, add_special_tokens=False)


def cmd_generate(args) -> int:
    engine = engine_from_args(args)
    params = _sampling_params(args)
    use_template = not args.raw and engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None)
    if use_template:
        ids = _render(engine, [{"role": "user", "content": args.prompt}])
    else:
        ids = engine.tokenize(args.prompt)
    stream_completion(engine, ids, params)
    print()
    if engine.spec_stats is not None:
        logging.getLogger("tokenmill").info("%s", engine.spec_stats.summary())
    return 0


def _context_tokens(engine) -> int:
    """The most tokens one request may hold: the context length, or the KV cache if smaller."""
    return min(engine.max_model_len, engine.kv.num_blocks * engine.config.block_size)


def fit_conversation(engine, history: list[dict], reply_tokens: int) -> Optional[list[int]]:
    """The prompt ids of `history` (ending with the new user message), leaving `reply_tokens` of
    room for the reply. Drops the oldest turns (a user message and its reply; never a leading system
    prompt) from `history` as needed, saying so on stderr. If the new message does not fit even
    alone, it is removed from `history` and None comes back."""
    limit = _context_tokens(engine)
    keep = 1 if history and history[0]["role"] == "system" else 0
    alone = len(_render(engine, history[:keep] + history[-1:]))
    if alone + reply_tokens > limit:
        history.pop()
        print(f"[this message needs {alone} tokens plus up to {reply_tokens} for the reply, more than the "
              f"context of {limit} tokens: dropped; send a shorter one or lower --max-tokens]", file=sys.stderr)
        return None
    dropped = 0
    while len(ids := _render(engine, history)) + reply_tokens > limit:
        del history[keep:keep + 2]
        dropped += 1
    if dropped:
        print(f"[context of {limit} tokens full: dropped the {dropped} oldest turn{'s' if dropped > 1 else ''}]",
              file=sys.stderr)
    return ids


def _chat_turn(engine, history: list[dict], line: str, params) -> None:
    """One user message and its streamed reply; a message that cannot run leaves `history` as it was."""
    history.append({"role": "user", "content": line})
    ids = fit_conversation(engine, history, params.max_tokens or 1)
    if ids is None:
        return
    try:
        reply = stream_completion(engine, ids, params)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        history.pop()
        return
    except InvalidRequestError as e:
        print(f"[{e}: message dropped]", file=sys.stderr)
        history.pop()
        return
    print()
    history.append({"role": "assistant", "content": reply})


def cmd_chat(args) -> int:
    engine = engine_from_args(args)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        print("this model has no chat template", file=sys.stderr)
        return 2
    params = _sampling_params(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    print(f"chatting with {engine.model_name}; /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(system)
        elif line.strip():
            _chat_turn(engine, history, line, params)


def cmd_convert(args) -> int:
    from tokenmill.errors import ModelLoadError
    from tokenmill.loader.gguf_loader import export_gguf_as_hf
    from tokenmill.loader.resolve import resolve_model

    source = resolve_model(args.gguf)
    if source.kind != "gguf":
        raise ModelLoadError(f"{args.gguf} is not a GGUF file")
    print(export_gguf_as_hf(source.path, args.out_dir, args.dtype))
    return 0


def add_command(subparsers, name: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose help shows every flag's default."""
    return subparsers.add_parser(name, formatter_class=HelpFormatter, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tokenmill", description="A compact, fast LLM inference engine.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default=None, type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="tokenmill's log level (default: $TOKENMILL_LOG_LEVEL if set, else INFO for serve "
                             "and WARNING otherwise)")
    parser.set_defaults(log_level_default=DEFAULT_LEVEL)  # a command may set its own (serve: INFO)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = add_command(sub, "generate", help="answer one prompt, printing tokens as they come")
    gen.add_argument("prompt", help="the prompt")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    # --seed is the sampling seed here; the engine's is --engine-seed.
    add_engine_args(gen, skip_flags=("--seed",))
    _add_sampling_args(gen, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    chat = add_command(sub, "chat", help="interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="a system prompt (default: none; the chat template "
                                                     "may add its own)")
    add_engine_args(chat, skip_flags=("--seed",))
    _add_sampling_args(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    conv = add_command(sub, "convert", help="write a GGUF file's HF directory (config, safetensors, tokenizer)",
                       description="Dequantizes the GGUF file into an HF model directory that HF transformers "
                                   "and PEFT load. The conversion is cached (under $TOKENMILL_CACHE_DIR, else "
                                   "~/.cache/tokenmill/gguf/), so this copies it when the file was loaded before.")
    conv.add_argument("gguf", help="a GGUF file, or smollm2-135m-instruct for the embedded model")
    conv.add_argument("out_dir", help="the directory to write (new or empty)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "bf16", "float16", "fp16"],
                      help="the weights' dtype")
    conv.set_defaults(func=cmd_convert)

    for extra in ("tokenmill.entrypoints.serve_cli", "tokenmill.entrypoints.proxy_cli", "tokenmill.bench.cli"):
        try:
            module = __import__(extra, fromlist=["register"])
        except ImportError:
            continue
        module.register(sub)
    return parser


def _torchrun_worker_rank(args: argparse.Namespace) -> bool:
    """Under torchrun every rank runs the same command; ranks other than 0 of a tensor-parallel
    engine become its workers (executor/tensor_parallel.py) instead."""
    import os

    parallel = getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1)
    if parallel == 1:
        return False
    from tokenmill.executor.tensor_parallel import under_torchrun

    return under_torchrun() and int(os.environ["RANK"]) > 0


def _run_torchrun_worker(args: argparse.Namespace) -> int:
    from tokenmill.executor.tensor_parallel import torchrun_worker

    if getattr(args, "model_arg", None) is not None and args.model is None:  # serve's positional MODEL
        args.model = args.model_arg
    load, config = load_config_from_args(args), engine_config_from_args(args)
    return torchrun_worker(load.model, config, dtype=load.dtype, device=load.device, load_format=load.load_format)


def main(argv: Optional[list[str]] = None) -> int:
    import os

    from tokenmill.logger import set_log_level

    parser = build_parser()
    args = parser.parse_args(argv)
    set_log_level(args.log_level or os.environ.get("TOKENMILL_LOG_LEVEL") or args.log_level_default)
    from tokenmill.errors import TokenmillError

    try:
        if _torchrun_worker_rank(args):
            return _run_torchrun_worker(args)
        return args.func(args)
    except TokenmillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what ran was stopped cleanly; no traceback
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
