"""Flags of `ostinato serve` (kept free of the server's imports, so building the CLI stays cheap)."""

import argparse

from ostinato.config import EngineArgs


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
    EngineArgs.add_cli_args(p)
