"""`tokenmill serve [MODEL]`: the OpenAI-compatible HTTP server.

Registered by the CLI's build_parser. The server's own dependencies (the `serve` extra: fastapi,
uvicorn, pydantic, prometheus-client) are imported only when the command runs.
"""

import argparse
import os
import sys


def register(subparsers) -> None:
    from tokenmill.entrypoints.cli import add_engine_args

    p = subparsers.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server",
        description="Serve completions, chat completions, models, health and Prometheus metrics over HTTP, "
                    "compatible with OpenAI clients.")
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="HF directory, GGUF file, or preset with --load-format dummy (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$TOKENMILL_API_KEY if set)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the `model` field (default: the model's name)")
    g.add_argument("--max-waiting", type=int, default=4096,
                   help="refuse new requests with 503 while this many are waiting (0: no bound)")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (413 beyond)")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish on SIGINT/SIGTERM before being aborted")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            print(f"error: MODEL {args.model_arg!r} and --model {args.model!r} disagree", file=sys.stderr)
            return 2
        args.model = args.model_arg
    if args.max_body_bytes < 1024:
        print("error: --max-body-bytes must be at least 1024", file=sys.stderr)
        return 2
    try:
        from tokenmill.entrypoints.openai.api_server import ServerSettings, run_server
    except ImportError as e:
        print(f"error: the server needs the 'serve' extra (pip install 'tokenmill[serve]'): {e}", file=sys.stderr)
        return 2
    from tokenmill.entrypoints.cli import engine_from_args

    api_key = args.api_key if args.api_key is not None else os.environ.get("TOKENMILL_API_KEY") or None
    engine = engine_from_args(args)
    names = args.served_model_name
    if not names:  # the model's name, and the reference it was started with (e.g. a path) as an alias
        names = [engine.model_name] + ([args.model] if args.model and args.model != engine.model_name else [])
    settings = ServerSettings(served_model_names=names, api_key=api_key, max_waiting=args.max_waiting,
                              max_body_bytes=args.max_body_bytes)
    return run_server(engine, host=args.host, port=args.port, settings=settings, shutdown_grace=args.shutdown_grace,
                      log_level=args.uvicorn_log_level, access_log=args.access_log)
