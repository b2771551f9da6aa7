"""`tokenmill proxy --prefill URL --decode URL`: the routing front of prefill/decode disaggregation.

A command of its own rather than a `tokenmill serve` flag: it loads no model and runs no engine, so
it starts in a second, and restarts, scales or moves without touching the engines behind it.
Registered by the CLI's build_parser; its dependencies (fastapi, uvicorn, httpx: the `serve` extra)
are imported only when it runs.
"""

import argparse
import sys


def register(subparsers) -> None:
    from tokenmill.entrypoints.cli import add_command

    p = add_command(
        subparsers, "proxy", help="route OpenAI requests to a prefill engine, then a decode engine",
        description="Prefill/decode disaggregation: each completion or chat completion goes to the prefill "
                    "engine with max_tokens 1, then as sent to the decode engine, whose answer (streamed or not) "
                    "the client gets. Run the engines with --kv-transfer-config "
                    "'{\"kv_connector\": \"SharedStorageConnector\", \"kv_role\": \"kv_producer\"}' (prefill) "
                    "and kv_role kv_consumer (decode) on this host.")
    p.add_argument("--prefill", required=True, metavar="URL", help="the prefill engine, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL", help="the decode engine, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--connect-timeout", type=float, default=3.0, help="seconds to reach an engine")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds an engine may take to answer (the prefill), or between two chunks of a stream")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the HTTP server's own log level")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=cmd_proxy, log_level_default="INFO")


def cmd_proxy(args: argparse.Namespace) -> int:
    for flag, url in (("--prefill", args.prefill), ("--decode", args.decode)):
        if not url.startswith(("http://", "https://")):
            print(f"error: {flag} {url!r} must be an http:// or https:// URL", file=sys.stderr)
            return 2
    if args.connect_timeout <= 0 or args.timeout <= 0:
        print("error: --connect-timeout and --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        from tokenmill.serve.disagg_proxy import ProxySettings, run_proxy
    except ImportError as e:
        print(f"error: the proxy needs the 'serve' extra (pip install 'tokenmill[serve]'): {e}", file=sys.stderr)
        return 2
    settings = ProxySettings(args.prefill, args.decode, connect_timeout=args.connect_timeout, timeout=args.timeout)
    return run_proxy(settings, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                     access_log=args.access_log)
