"""`--api-server-count N`: N HTTP processes on one port (a listening socket each, SO_REUSEPORT), all talking to one
engine core.

The first HTTP process (the one started by `ostinato serve`) binds the sockets, starts the engine and the
detokenizer process (which routes each request's outputs to the HTTP process whose index its id starts
with), then spawns the N - 1 others, each with its socket, the engine's limits and the ZMQ endpoints. Each
reports on its pipe when it is ready (linked to the engine) and starts accepting only on the first
process's "go", sent once all are ready: so /health answers only when all N serve (a benchmark that starts
at the first 200 would otherwise run while some are still starting). The kernel
spreads new connections over the sockets by a hash of the client's address (`listen_sockets`). Every
process keeps its own request metrics in prometheus_client's multiprocess files, so /metrics from any of
them sums all; the engine's counts are fed by the first one only.

Life cycle: a SIGINT / SIGTERM to the first process is passed to the others at once, all drain their
requests in parallel, then the first stops the engine. An HTTP process that dies makes the first shut the
server down (exit 1). The others watch the engine and detokenizer processes (pidfd) and answer 503 when
they die, as the first does; they die with the first (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ostinato.engine.async_client import AsyncEngineClient, EngineClientHooks, EngineInfo
from ostinato.proc_util import die_with_parent, set_process_name

logger = logging.getLogger("ostinato.serve")

START_TIMEOUT_S = 600.0  # an HTTP process imports the server's modules (and loads the tokenizer) in a few seconds


def listen_sockets(host: str, port: int, count: int, backlog: int = 2048) -> list[socket.socket]:
    """`count` TCP sockets listening on host:port, one per HTTP process, in one SO_REUSEPORT group: the kernel
    spreads new connections over them by a hash of the client's address and port. (On one shared socket, the
    process that woke first accepted a whole burst of connections: 28 / 18 / 16 / 2 of 64 over 4 processes,
    and a client keeps its connections, so the busiest process stayed the busiest.) The port is first taken
    without SO_REUSEPORT, so that a port in use (by another server of ours too) fails here, by name."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def bind(reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ValueError(f"port: cannot listen on {host}:{port}: {e}") from None
        return sock

    bind(reuse_port=False).close()
    socks = [bind(reuse_port=True) for _ in range(count)]
    for sock in socks:
        sock.listen(backlog)
        sock.set_inheritable(True)
    return socks


@dataclass
class WorkerSpec:
    """What an extra HTTP process needs to serve (picklable)."""

    ns: argparse.Namespace
    info: EngineInfo
    endpoints: tuple[str, str]
    pids: dict[str, int]
    index: int
    count: int


class Workers:
    """The extra HTTP processes (indices 1..N-1), seen from the first."""

    def __init__(self, procs: list[multiprocessing.process.BaseProcess], pipes: list[Connection]) -> None:
        self.procs = procs
        self._pipes = pipes  # per process: it sends "ready" on it, and is sent "go"
        self._stopping = False

    @classmethod
    def start(cls, ns: argparse.Namespace, client: AsyncEngineClient, socks: list[socket.socket]) -> Workers:
        """`socks`: the listening sockets of processes 1..N-1 (`listen_sockets`' after the first's), each handed to
        its process and closed here (a socket left open here, its process gone, would queue connections that
        nobody accepts)."""
        ctx = multiprocessing.get_context("spawn")
        procs, pipes = [], []
        for i, sock in enumerate(socks, start=1):
            spec = WorkerSpec(ns, client.info, client.endpoints[i], client.processes, i, ns.api_server_count)
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=run_worker, args=(spec, sock, theirs), name=f"ostinato-http-{i}")
            p.start()  # (the socket is duplicated for the child as it is pickled: closing ours now is safe)
            sock.close()
            theirs.close()  # the child holds its own copy
            procs.append(p)
            pipes.append(ours)
        return cls(procs, pipes)

    async def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every process is ready to serve (event-loop readers on the pipes and the process sentinels:
        nothing polls); RuntimeError naming the first that exits first, or one still starting after `timeout`
        seconds. Then `go()` lets them accept."""
        loop = asyncio.get_running_loop()
        pending = dict(zip(self._pipes, self.procs, strict=True))
        changed = asyncio.Event()
        fds = {conn: (conn.fileno(), p.sentinel) for conn, p in pending.items()}
        for fd in (fd for pair in fds.values() for fd in pair):
            loop.add_reader(fd, changed.set)
        try:
            async with asyncio.timeout(timeout):
                while pending:
                    await changed.wait()
                    changed.clear()
                    for conn, p in list(pending.items()):
                        try:
                            if conn.poll(0) and conn.recv():
                                del pending[conn]
                                for fd in fds.pop(conn):
                                    loop.remove_reader(fd)
                                continue
                        except EOFError:
                            pass
                        if not p.is_alive():  # (its pipe may not say so: the fd can still sit with the sharer)
                            p.join(5.0)
                            raise RuntimeError(f"HTTP process {p.pid} exited during start-up (exit code {p.exitcode})")
        except TimeoutError:
            raise RuntimeError(f"HTTP process {next(iter(pending.values())).pid} did not start in "
                               f"{timeout:.0f} s") from None
        finally:
            for fd in (fd for pair in fds.values() for fd in pair):
                loop.remove_reader(fd)

    def go(self) -> None:
        """Let every (ready) process accept connections."""
        for conn in self._pipes:
            conn.send(True)
            conn.close()
        self._pipes = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def signal(self, sig: int) -> None:
        """Pass a SIGINT / SIGTERM on: every process drains its own requests."""
        self._stopping = True
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[int, int | None], None]) -> None:
        """`on_exit(pid, exit code)` when one exits before it was asked to."""
        for p in self.procs:
            def exited(p: multiprocessing.process.BaseProcess = p) -> None:
                loop.remove_reader(p.sentinel)
                if not self._stopping:  # (once stopping, `stop` joins them)
                    p.join(0)
                    on_exit(p.pid, p.exitcode)

            loop.add_reader(p.sentinel, exited)

    def stop(self, timeout: float) -> None:
        """SIGTERM each, wait up to `timeout` for all, then kill what is left. (One still waiting for "go"
        sees its pipe close and exits.)"""
        for conn in self._pipes:
            conn.close()
        self._pipes = []
        self.signal(signal.SIGTERM)
        for p in self.procs:
            p.join(timeout)
        for p in self.procs:
            if p.is_alive():
                logger.warning("HTTP process %d did not exit in %.0f s: killing it", p.pid, timeout)
                p.kill()
                p.join(5.0)


def run_worker(spec: WorkerSpec, sock: socket.socket, pipe: Connection) -> None:
    """Process entry point (multiprocessing spawn) of HTTP process `spec.index`: sends "ready" on `pipe` once
    linked to the engine, serves after the first process's "go" (exits 0 if the pipe closes instead)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the first process passes it on
    die_with_parent()
    set_process_name(f"ostinato-http{spec.index}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ostinato.entrypoints.openai.api_server import _run_loop

    sys.exit(_run_loop(_serve_worker(spec, sock, pipe)))


async def recv(conn: Connection) -> Any:
    """`conn.recv()` without blocking the event loop (EOFError once the other end is closed)."""
    loop = asyncio.get_running_loop()
    if not conn.poll(0):
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


async def _serve_worker(spec: WorkerSpec, sock: socket.socket, pipe: Connection) -> int:
    from ostinato.config import EngineArgs
    from ostinato.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, _load_tokenizer, serve_app
    from ostinato.entrypoints.openai.metrics import ServerMetrics

    ns = spec.ns
    args = EngineArgs.from_cli_args(ns)
    names = ns.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    tokenizer = await asyncio.to_thread(_load_tokenizer, args)
    metrics = ServerMetrics(names[0])
    hooks = EngineClientHooks(on_finished=metrics.on_finished)  # the engine's counts: the first process's job
    client = await AsyncEngineClient.connect(args, tokenizer, spec.info, spec.endpoints, spec.pids, spec.index,
                                             spec.count, hooks)
    try:
        pipe.send(True)
        await recv(pipe)  # "go"
    except (EOFError, OSError):  # the first process gave up starting (or is gone): nothing to serve
        await client.shutdown()
        return 0
    finally:
        pipe.close()
    signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn handles it while serving and re-raises it after
    try:
        await serve_app(ns, client, metrics, hooks, names, sock)
    finally:
        await client.shutdown()
    return 1 if client.dead is not None else 0
