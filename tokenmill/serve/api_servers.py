"""`tokenmill serve --api-server-count N`: N API server processes in front of one engine process.

The first server's process (the one `tokenmill serve` runs in) binds the listening socket, starts
the engine process and spawns servers 1..N-1, which get the socket (the kernel hands each new
connection to one of the processes waiting on it) and connect to the engine as clients of their own
(EngineCoreClient with their index). Each tokenizes, detokenizes and streams its own connections;
the engine batches them all.

Signals: servers 1..N-1 run in process groups of their own, so a terminal's Ctrl-C reaches only
the first, which passes every SIGINT / SIGTERM on to them: all of them then shut down gracefully at
once, as one server would. If one of them ends on its own, the first shuts down as after a SIGTERM.
The exit status is the first server's, or 1 if another one failed.
"""

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from tokenmill.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ApiServerLaunch:
    """What API server `index` (1..N-1) needs; picklable (it crosses to a spawned process)."""

    index: int
    count: int
    engine_dir: str
    engine_pid: int
    settings: object  # ServerSettings
    shutdown_grace: Optional[float]
    uvicorn_log_level: str
    access_log: bool
    log_level: int


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.set_inheritable(True)
    return sock


def run_api_server(launch: ApiServerLaunch, sock: socket.socket) -> None:
    """The main of API server process 1..N-1."""
    os.setpgrp()  # the first server passes signals on (a terminal's would otherwise come twice)
    from tokenmill.serve.core_client import EngineCoreClient
    from tokenmill.serve.openai.api_server import run_server
    from tokenmill.logger import set_log_level

    set_log_level(logging.getLevelName(launch.log_level))
    client = EngineCoreClient(launch.engine_dir, launch.index, engine_pid=launch.engine_pid)
    logger.info("API server %d of %d ready (pid %d)", launch.index, launch.count, os.getpid())
    try:
        status = run_server(client, settings=launch.settings, shutdown_grace=launch.shutdown_grace,
                            log_level=launch.uvicorn_log_level, access_log=launch.access_log, sock=sock)
    finally:
        client.close()
    sys.exit(status)


def serve_with_several(engine, args, settings) -> int:
    """Run API server 0 here and servers 1..N-1 in processes of their own, all on one socket."""
    from tokenmill.serve.openai.api_server import run_server

    sock = listening_socket(args.host, args.port)
    ctx = multiprocessing.get_context("spawn")
    children = []
    for index in range(1, args.api_server_count):
        launch = ApiServerLaunch(index, args.api_server_count, engine.engine_dir, engine.pid, settings,
                                 args.shutdown_grace, args.uvicorn_log_level, args.access_log,
                                 logging.getLogger("tokenmill").level)
        child = ctx.Process(target=run_api_server, args=(launch, sock), name=f"tokenmill-api-{index}")
        child.start()
        children.append(child)
    stopping = threading.Event()

    def pass_on(sig: int) -> None:
        stopping.set()
        for child in children:
            if child.exitcode is None:
                try:
                    os.kill(child.pid, sig)
                except ProcessLookupError:
                    pass

    def watch() -> None:  # one of them ended on its own: shut down as after a SIGTERM
        multiprocessing.connection.wait([c.sentinel for c in children])
        if not stopping.is_set():
            ended = [c for c in children if c.exitcode is not None]
            logger.error("API server process %s ended (exit code %s); shutting down", ended[0].name,
                         ended[0].exitcode)
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tokenmill-api-watch", daemon=True).start()
    try:
        status = run_server(engine, settings=settings, shutdown_grace=args.shutdown_grace,
                            log_level=args.uvicorn_log_level, access_log=args.access_log, sock=sock,
                            on_signal=pass_on)
    finally:
        if not stopping.is_set():  # (those told of a signal already are ending: a second would force them)
            pass_on(signal.SIGTERM)
        limit = (args.shutdown_grace or 0) + 30
        for child in children:
            child.join(limit)
            if child.exitcode is None:
                logger.warning("API server process %s did not stop; killing it", child.name)
                child.kill()
                child.join(5)
        sock.close()
    failed = [c for c in children if c.exitcode != 0]
    return status if status or not failed else 1
