"""`tokenmill serve [MODEL]`: the OpenAI-compatible HTTP server.

Registered by the CLI's build_parser. The server's own dependencies (the `serve` extra: fastapi,
uvicorn, pydantic, prometheus-client) are imported only when the command runs.
"""

import argparse
import os
import sys
from typing import Mapping, Optional, Sequence, Union

from tokenmill.config import ConfigError
from tokenmill.logger import init_logger

logger = init_logger(__name__)

API_KEY_ENV = "TOKENMILL_API_KEY"

# ---- scheduling defaults of the server (the offline LLM and bench throughput keep the fields' own) ----
# A step-time target on one CUDA device, chosen at start-up (engine/step_budget.py: auto_target_ms),
# holds inter-token latency down under load; off on the CPU and with tensor or pipeline parallelism.
SERVE_ENGINE_DEFAULTS = {
    "step_time_target_ms": ("auto", "auto: on one CUDA device the larger of 22 ms and twice the calibrated "
                                    "decode step of max_num_seqs requests; off on the CPU and with tensor or "
                                    "pipeline parallelism"),
}


def register(subparsers) -> None:
    from tokenmill.entrypoints.cli import add_command, add_engine_args
    from tokenmill.serve.openai.tool_parsers import TOOL_PARSERS  # plain Python: no server dependency

    p = add_command(
        subparsers, "serve", help="run an OpenAI-compatible HTTP server",
        description="Serve completions, chat completions, models, health and Prometheus metrics over HTTP, "
                    "compatible with OpenAI clients.")
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="HF directory, GGUF file, or preset with --load-format dummy (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to bind")
    # API keys and tenants (serve/openai/tenants.py).
    keys = g.add_mutually_exclusive_group()
    keys.add_argument("--api-key", action="append", default=None,
                      help="require 'Authorization: Bearer KEY' on every route but /health; repeat for several "
                           "keys (tenants), any one opens the server; the process list shows them, "
                           f"--api-key-file does not (default: ${API_KEY_ENV} if set, else no key)")
    keys.add_argument("--api-key-file", default=None, metavar="PATH",
                      help="read the keys from this file, one per line (surrounding whitespace stripped, blank "
                           "lines skipped) (default: none)")
    g.add_argument("--cache-salt-by-api-key", action="store_true",
                   help="salt every request's prefix cache by its API key: requests of different keys never share "
                        "cached blocks, so no tenant learns from hits or timing what another sent (a request's own "
                        "cache_salt is added to its key's)")
    g.add_argument("--metrics-api-key", default=None, metavar="KEY",
                   help="a key that opens /metrics only, and the only one shown the prefix-cache figures (a hit "
                        "rate tells whether a guessed prompt was sent before); without it they are shown only "
                        "while fewer than two API keys are configured")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the `model` field (default: the model's name)")
    g.add_argument("--max-waiting", type=int, default=4096,
                   help="sequences (prompts x n) that may wait to be scheduled: a request that would go past "
                        "this gets 503 + Retry-After, one larger than it alone a 400 (0: no bound)")
    g.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="sequences (prompts x n) one request may ask for (400 beyond)")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (413 beyond)")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish on SIGINT/SIGTERM before being aborted; "
                        "a second signal aborts them at once (exit status 128 + the signal's number)")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the HTTP server's own log level")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="API server processes (HTTP, tokenizing, detokenizing) sharing the port and the one "
                        "engine process, for when the front end is the bottleneck; each serves its own "
                        "/metrics")
    g.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="run the engine on a thread of the server's process instead of a process of its own "
                        "(default: its own process, so HTTP, tokenizing and detokenizing never share its GIL)")
    g.add_argument("--max-engine-restarts", type=int, default=3, metavar="N",
                   help="times a dead engine process is restarted (backoff 0.5 s, doubling) over the server's "
                        "life; streams it ran get an error event. With none left (or 0, or with "
                        "--data-parallel-size or --api-server-count above 1) the server exits with status 1")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the model's; a "
                        "request's chat_template (with --trust-request-chat-template) still wins (default: the "
                        "tokenizer's)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in requests (it runs the client's Jinja template on the server; "
                        "default: such requests are a 400)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" (the default when a request gives tools) read calls from the '
                        "model's text with --tool-call-parser; without it such requests are a 400")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen) or "
                        "llama3_json (a JSON object {name, parameters}: Llama 3.1+); also the format tools are "
                        "described in for chat templates that ignore them (default: none; hermes for that)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (needs --enable-lora), each as name=path or as JSON "
                        '\'{"name": "a", "path": "/p", "base_model_name": "m"}\'; requests name one as `model`. '
                        "Loaded at start-up (a bad one stops it)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="let POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters while "
                        "serving (one API server process only; needs --lora-root). Any API key holder can then "
                        "load adapters: default off, both routes a 400")
    g.add_argument("--lora-root", action="append", default=None, metavar="DIR",
                   help="a directory run-time loads may read adapters from (repeat for several): a lora_path, "
                        "absolute or relative to it, must resolve (symlinks followed) inside one")
    add_engine_args(p, defaults=SERVE_ENGINE_DEFAULTS)
    p.set_defaults(func=cmd_serve, log_level_default="INFO")


def resolve_api_keys(api_keys: Union[None, str, Sequence[str]], api_key_file: Optional[str],
                     environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys from --api-key (each), --api-key-file (one per line) or $TOKENMILL_API_KEY (in that
    order), stripped and without repeats; [] when none is given. An empty or blank key from the flag or
    the variable, or a file without a key, is a ConfigError, never "no key"."""
    if isinstance(api_keys, str):
        api_keys = [api_keys]
    if api_keys is not None and api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                keys, source = [line.strip() for line in f if line.strip()], f"--api-key-file {api_key_file}"
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --api-key-file {api_key_file}: {e}") from None
        if not keys:
            keys = [""]
    elif api_keys is not None:
        keys, source = [k.strip() for k in api_keys], "--api-key"
    elif API_KEY_ENV in environ:
        keys, source = [environ[API_KEY_ENV].strip()], f"${API_KEY_ENV}"
    else:
        return []
    if not all(keys):
        raise ConfigError(f"{source} is empty: give a key, or leave it out to serve without one")
    return list(dict.fromkeys(keys))


def resolve_api_key(api_key: Optional[str], api_key_file: Optional[str],
                    environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The first key resolve_api_keys finds, or None."""
    keys = resolve_api_keys(api_key, api_key_file, environ)
    return keys[0] if keys else None


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: the file's text if it names a file, else the value itself if it looks like a
    Jinja template; anything else is a ConfigError (a mistyped path, most likely)."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --chat-template {value}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


def startup_summary(engine, host: str, port: int) -> str:
    """engine_summary (an in-process engine, or a summary as text) and the address; the address
    alone for None (an engine process, whose client logged the summary when it was ready)."""
    address = f"[{host}]" if ":" in host else host
    if engine is None:
        return f"binding http://{address}:{port}"
    if isinstance(engine, str):
        summary = engine
    else:
        from tokenmill.engine.llm_engine import engine_summary

        summary = engine_summary(engine)
    return f"{summary}; binding http://{address}:{port}"


def _check_server_args(args: argparse.Namespace) -> Optional[str]:
    """Resolves MODEL against --model; returns what is wrong with the server flags, if anything."""
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            return f"MODEL {args.model_arg!r} and --model {args.model!r} disagree"
        args.model = args.model_arg
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be at least 1024"
    if args.max_sequences_per_request < 1:
        return "--max-sequences-per-request must be at least 1"
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return "--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)"
    if args.api_server_count < 1:
        return "--api-server-count must be at least 1"
    if args.max_engine_restarts < 0:
        return "--max-engine-restarts must be at least 0"
    if args.api_server_count > 1 and not args.engine_process:
        return "--api-server-count above 1 needs the engine in its own process (leave out --no-engine-process)"
    if args.lora_modules and not args.enable_lora:
        return "--lora-modules needs --enable-lora"
    if args.allow_runtime_lora_updating and not args.enable_lora:
        return "--allow-runtime-lora-updating needs --enable-lora"
    if args.allow_runtime_lora_updating and not args.lora_root:
        return "--allow-runtime-lora-updating needs --lora-root DIR (the directories adapters may be loaded from)"
    if args.lora_root and not args.allow_runtime_lora_updating:
        return "--lora-root is where run-time loads read from: it needs --allow-runtime-lora-updating"
    for root in args.lora_root or []:
        if not os.path.isdir(root):
            return f"--lora-root {root}: not a directory"
    dp = getattr(args, "data_parallel_size", 1)
    if dp > 1 and not args.engine_process:
        return (f"--data-parallel-size {dp} needs the engines in processes of their own (leave out "
                "--no-engine-process)")
    if dp > 1 and args.api_server_count > 1:
        return f"--data-parallel-size {dp} works with one API server process only (leave out --api-server-count)"
    return None


def lora_specs(args: argparse.Namespace) -> list:
    """--lora-modules parsed and checked before anything slow starts (ConfigError)."""
    from tokenmill.serve.openai.lora import check_adapter_dir, check_adapter_name, parse_lora_module

    specs = [parse_lora_module(v) for v in args.lora_modules or []]
    for spec in specs:
        problem = check_adapter_name(spec.name) or check_adapter_dir(spec.path)
        if problem:
            raise ConfigError(f"--lora-modules {spec.name}: {problem}")
    return specs


def add_lora_modules(engine, specs: list, names: list[str]) -> list:
    """Give the adapters ids 1, 2, ... and load each into the engine (LLMEngine or EngineCoreClient)
    before the server starts; ConfigError naming the adapter if one cannot be served."""
    from tokenmill.serve.openai.lora import assign_ids
    from tokenmill.errors import InvalidRequestError

    modules = assign_ids(specs, names)
    for module in modules:
        try:
            engine.add_lora(module.request)
        except InvalidRequestError as e:  # LoRAError: a bad adapter, a rank above --max-lora-rank...
            raise ConfigError(f"--lora-modules {module.name}={module.path}: {e}") from None
        logger.info("LoRA adapter %s (id %d) loaded from %s", module.name, module.request.lora_int_id, module.path)
    return modules


def cmd_serve(args: argparse.Namespace) -> int:
    problem = _check_server_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    api_keys = resolve_api_keys(args.api_key, args.api_key_file)  # before anything slow
    if args.cache_salt_by_api_key and not api_keys:
        print("error: --cache-salt-by-api-key needs API keys (--api-key, --api-key-file or "
              f"${API_KEY_ENV})", file=sys.stderr)
        return 2
    metrics_api_key = None if args.metrics_api_key is None else args.metrics_api_key.strip()
    if metrics_api_key is not None and (not metrics_api_key or metrics_api_key in api_keys):
        print("error: --metrics-api-key must be a non-empty key of its own (not one of the API keys)",
              file=sys.stderr)
        return 2
    chat_template = load_chat_template(args.chat_template)
    specs = lora_specs(args)
    if args.served_model_name:
        from tokenmill.serve.openai.lora import assign_ids

        assign_ids(specs, args.served_model_name)  # names unique and not a served name: before the model loads
    try:
        from tokenmill.serve.openai.api_server import ServerSettings, run_server
    except ImportError as e:
        print(f"error: the server needs the 'serve' extra (pip install 'tokenmill[serve]'): {e}", file=sys.stderr)
        return 2
    if args.engine_process:
        engine = _start_engine_process(args)
        # one engine's client logged its summary when the process was ready: not twice; replicas
        # logged theirs each, and the whole (with the replica count) is said here
        summary = engine.summary if args.data_parallel_size > 1 else None
    else:
        from tokenmill.engine.llm_engine import engine_summary
        from tokenmill.entrypoints.cli import engine_from_args

        engine = engine_from_args(args)
        summary = engine_summary(engine)
    try:
        names = args.served_model_name
        if not names:  # the model's name, and the reference it was started with (e.g. a path) as an alias
            names = [engine.model_name] + ([args.model] if args.model and args.model != engine.model_name else [])
        modules = add_lora_modules(engine, specs, names)
        settings = ServerSettings(served_model_names=names, api_keys=api_keys, max_waiting=args.max_waiting,
                                  cache_salt_by_api_key=args.cache_salt_by_api_key,
                                  metrics_api_key=metrics_api_key,
                                  max_sequences_per_request=args.max_sequences_per_request,
                                  max_body_bytes=args.max_body_bytes, chat_template=chat_template,
                                  enable_auto_tool_choice=args.enable_auto_tool_choice,
                                  tool_call_parser=args.tool_call_parser,
                                  trust_request_chat_template=args.trust_request_chat_template,
                                  enable_lora=args.enable_lora, lora_modules=modules,
                                  api_server_count=args.api_server_count,
                                  allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                                  lora_roots=list(args.lora_root or []))
        logger.info("%s", startup_summary(summary, args.host, args.port))
        if args.api_server_count > 1:
            from tokenmill.serve.api_servers import serve_with_several

            return serve_with_several(engine, args, settings)
        return run_server(engine, host=args.host, port=args.port, settings=settings,
                          shutdown_grace=args.shutdown_grace, log_level=args.uvicorn_log_level,
                          access_log=args.access_log)
    finally:
        if args.engine_process:
            engine.close()


def _start_engine_process(args: argparse.Namespace):
    """Validate the options here (a ConfigError before anything starts), then start the engine process
    and wait until its model is loaded and warmed up. With --data-parallel-size N > 1: N engine
    processes (replicas) behind one DPEngineClient (serve/dp_client.py)."""
    import logging

    from tokenmill.serve.core_client import EngineCoreClient
    from tokenmill.serve.core_process import EngineLaunch
    from tokenmill.entrypoints.cli import engine_config_from_args, load_config_from_args

    load, config = load_config_from_args(args), engine_config_from_args(args)
    launch = EngineLaunch(load.model, config, dtype=load.dtype, device=load.device, load_format=load.load_format,
                          tokenizer=load.tokenizer, log_level=logging.getLogger("tokenmill").level)
    if config.data_parallel_size > 1:
        from tokenmill.serve.dp_client import DPEngineClient

        logger.info("starting %d data-parallel engine replicas", config.data_parallel_size)
        client = DPEngineClient.launch(launch, config.data_parallel_size)
    else:  # the other API servers could not follow a new engine process: with several, none is restarted
        restarts = args.max_engine_restarts if args.api_server_count == 1 else 0
        client = EngineCoreClient.launch(launch, max_restarts=restarts)
    client.on_give_up = _exit_with_the_engine
    return client


def _exit_with_the_engine(why: str) -> None:
    """A dead engine that stays dead ends the server as a SIGTERM would (its streams were failed
    already); run_server then returns 1, the engine having failed, for a supervisor to act on."""
    import signal

    logger.error("the engine is gone for good; the server exits with status 1 (%s)", why)
    os.kill(os.getpid(), signal.SIGTERM)
