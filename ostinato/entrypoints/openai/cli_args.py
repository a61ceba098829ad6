"""Flags of `ostinato serve` (kept free of the server's imports, so building the CLI stays cheap)."""

import argparse
import os

from ostinato.config import EngineArgs

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
DEFAULT_MAX_N = 128  # OpenAI's own bound on n


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="model to serve (same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on /v1 and /completions")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts and reports (default: the model argument)")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT / SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no log line per HTTP request (formatting it costs ~100 us of the HTTP process each)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413 before they are parsed (default 32 MiB: a 1M-token prompt "
                        "as token ids, or a long context as text, fits many times over)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="most choices (n) one request may ask for")
    p.add_argument("--max-choices-in-engine", type=int, default=None,
                   help="most choices (n x prompts) of one /v1 request in the engine at once, the rest follow as "
                        "those finish, so one request cannot take every slot (default: max_running_requests / 4)")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="HTTP processes sharing the port, all talking to one engine (more: more streamed tokens per "
                        "second before the front end, not the engine, sets the pace; default: a quarter of the "
                        "cores, 1 to 4)")
    EngineArgs.add_cli_args(p)


def default_api_server_count() -> int:
    """HTTP processes where none were asked for: a quarter of the cores this process may use, 1 to 4 (4 on a
    16-core GPU host, 1 on a 2-core machine). One HTTP process saturates at a few hundred concurrent streams,
    where four keep the engine's batch full (docs/serve-notes.md); the engine core and the detokenizer take cores
    too."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores // 4))


def check_serve_args(ns: argparse.Namespace) -> None:
    """Raise ValueError naming the flag (before anything starts); fill in the defaults that depend on the machine."""
    if ns.api_server_count is None:
        ns.api_server_count = default_api_server_count()
    for name in ("max_request_body_bytes", "max_n", "max_choices_in_engine", "api_server_count"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
