"""`ostinato serve`: the FastAPI app and the server's life cycle.

Process layout: this (HTTP) process runs uvicorn, validates, applies chat templates, tokenizes and
detokenizes; the engine core (scheduler + model runner) runs in a spawned process and talks to it
over ZMQ (`ostinato.engine.async_client` / `core_proc`). SIGINT / SIGTERM: uvicorn stops accepting,
lets in-flight requests finish (up to --graceful-shutdown-timeout, then cancels them, which aborts
them in the engine), then the engine is asked to exit and joined. If the engine process dies, every
pending and new request gets a 503, /health turns 503, and the server exits with status 1 shortly after.
"""

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ostinato.config import EngineArgs
from ostinato.engine.async_client import AsyncEngineClient, EngineClientHooks, EngineStartError
from ostinato.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES, check_serve_args
from ostinato.entrypoints.openai.errors import OpenAIError, engine_dead, error_body, from_validation_error
from ostinato.entrypoints.openai.metrics import ServerMetrics
from ostinato.entrypoints.openai.protocol import (
    BatchRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from ostinato.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("ostinato.serve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
ENGINE_DEATH_GRACE_S = 3.0  # after the engine dies, keep answering 503 this long, then exit 1


# ---------------------------------------------------------------------------- the app
PROTECTED_PATHS = ("/completions", "/tokenize", "/detokenize")  # with every /v1 path: the API key's


class ApiKeyMiddleware:
    """401 in OpenAI's format unless the bearer token matches (the API paths only; /health and /metrics stay
    open). The scheme is case-insensitive (RFC 7235): `bearer KEY` works too."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in PROTECTED_PATHS):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                body = error_body("Invalid or missing API key (expected `Authorization: Bearer <key>`)",
                                  "invalid_request_error", None, "invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


M = TypeVar("M", bound=BaseModel)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body exceeds the server's limit of {limit} bytes "
                            "(--max-request-body-bytes)", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 415 unless JSON and with 413 past `limit` bytes: at once from Content-Length,
    else (chunked uploads) as soon as the bytes streamed in pass the limit; nothing is parsed before."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise OpenAIError(415, f"Content-Type must be application/json, got {content_type!r}",
                              code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


# bodies up to this size are parsed on the event loop (tens of microseconds); larger ones on the worker thread,
# so that a 20 MB body does not hold up the other streams (a thread hop costs a request ~50 us of CPU)
INLINE_PARSE_BYTES = 16 * 1024

# a JSON escape of a UTF-16 surrogate: json.loads makes a lone one a str that no tokenizer (nor UTF-8) takes
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(obj: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in `obj` holding a lone surrogate, else None."""
    if isinstance(obj, str):
        try:
            obj.encode()
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if (where := lone_surrogate(v, f"{path}.{k}" if path else str(k))) is not None:
                return where
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, str | dict | list) and (where := lone_surrogate(v, f"{path}[{i}]")) is not None:
                return where
    return None


def parse_json(raw: bytes, model: type[M]) -> M:
    """JSON -> the request model; OpenAIError 400 naming the field. Runs on the serving worker thread."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"Malformed JSON in the request body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "The request body must be a JSON object", code="invalid_json")
    if SURROGATE_ESCAPE.search(raw) and (where := lone_surrogate(data)) is not None:
        raise OpenAIError(400, f"{where}: not valid Unicode (a lone UTF-16 surrogate escape, \\ud800-\\udfff)",
                          param=where, code="invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


class SSEResponse(Response):
    """Streams `text/event-stream` chunks and stops (closing the chunk iterator, which aborts the request in
    the engine) when the client disconnects.

    Starlette's StreamingResponse does the same through an anyio task group per response; under 64 busy
    streams that task group alone took ~40% of the HTTP process's per-request CPU. Here one plain asyncio
    task waits for the disconnect and cancels the streaming task.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str]) -> None:
        self.status_code, self.background, self.chunks = 200, None, chunks
        # no body and so no content-length: chunked transfer encoding
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from elsewhere (shutdown), not by a disconnect
            streaming.uncancel()  # the client left: nothing more to send
        finally:
            watcher.cancel()
            await self.chunks.aclose()  # type: ignore[attr-defined]


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody reads it
    return task.result()


def _no_native_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.165 asks OpenTelemetry on every request whether it is configured (~7 us, reading
    os.environ); the server reports through /metrics, so its OpenTelemetry hooks are off where they exist."""
    import inspect

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


class DirectRoutes:
    """POSTs to the generation endpoints go straight to their handlers; everything else to the FastAPI app.

    FastAPI's stack (error and exception middleware, its exit-stack middleware, the router) wraps every
    request, and every `send` of a stream passes through two of its wrappers: per SSE chunk, that is several
    coroutine hops of the HTTP process's CPU, which is what bounds serving at high concurrency. The handlers
    here answer errors the way the app's exception handlers do: OpenAIError in OpenAI's format, anything else
    a logged 500."""

    def __init__(self, app: ASGIApp, routes: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive, send))
        except OpenAIError as e:
            response = JSONResponse(e.body(), status_code=e.status)
        except Exception as e:
            response = internal_error(e)
        await response(scope, receive, send)


def internal_error(e: Exception) -> JSONResponse:
    logger.exception("internal error")
    return JSONResponse(error_body(f"Internal server error: {type(e).__name__}: {e}", "server_error", None,
                                   "internal_error"), status_code=500)


def build_app(serving: OpenAIServing, metrics: ServerMetrics, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> ASGIApp:
    app = FastAPI(title="Ostinato", version="0.1.0", **_no_native_telemetry())
    client = serving.client

    async def parse_body(request: Request, model: type[M]) -> M:
        raw = await read_body(request, max_body_bytes)
        if len(raw) <= INLINE_PARSE_BYTES:  # a hop to the worker thread would cost more than the parse
            return parse_json(raw, model)
        return await serving.run_blocking(parse_json, raw, model)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        return internal_error(e)

    async def respond(request: Request, work: Awaitable[Any], stream: bool = False) -> Response:
        # a stream's handler returns at once (the stream itself notices a disconnect); other requests run
        # until done or until the client leaves
        result = await work if stream else await until_disconnected(request, work)
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result)

    @app.get("/health")
    async def health() -> Response:
        if client.dead is not None:
            return JSONResponse(engine_dead(client.dead).body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "ostinato",
             "max_model_len": client.info.max_model_len} for name in serving.model_names]}

    # The generation endpoints parse their own bodies, so they are plain Starlette routes: FastAPI's
    # per-request dependency solving would only add host time to every request.
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        return await respond(request, serving.completions(req), req.stream)

    async def chat(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        return await respond(request, serving.chat(req), req.stream)

    async def batch(request: Request) -> Response:
        return await respond(request, serving.batch(await parse_body(request, BatchRequest)))

    async def tokenize(request: Request) -> Response:
        return await respond(request, serving.tokenize(await parse_body(request, TokenizeRequest)))

    async def detokenize(request: Request) -> Response:
        return await respond(request, serving.detokenize(await parse_body(request, DetokenizeRequest)))

    routes = {"/v1/completions": completions, "/v1/chat/completions": chat, "/completions": batch,
              "/tokenize": tokenize, "/detokenize": detokenize}
    for path, handler in routes.items():  # (what DirectRoutes does not take, a GET say, gets FastAPI's answer)
        app.add_route(path, handler, methods=["POST"])
    direct = DirectRoutes(app, routes)
    return ApiKeyMiddleware(direct, api_key) if api_key else direct


# ---------------------------------------------------------------------------- life cycle
def run_server(ns: argparse.Namespace) -> int:
    """`ostinato serve`: exit status 0 after a clean shutdown, 1 if the engine died or failed to start."""
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"model: given twice ({ns.model_tag!r} and --model {ns.model!r})")
        ns.model = ns.model_tag
    check_serve_args(ns)
    args = EngineArgs.from_cli_args(ns)
    if args.load_format != "dummy" and args.model is not None:
        from ostinato.loader import check_model_exists

        check_model_exists(args.model)  # a wrong path fails here, once, before the engine process starts
    try:
        return _run_loop(_serve(ns, args))
    except EngineStartError as e:
        logger.error("the engine failed to start: %s", e)
        return 1


def _run_loop(main: Awaitable[int]) -> int:
    """Run the server on uvloop where it is installed (it halves the per-chunk cost of streaming: socket
    writes and task wake-ups are the HTTP process's hot path), on asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _load_tokenizer(args: EngineArgs) -> Any:
    if args.skip_tokenizer_init:
        return None
    from ostinato.loader import load_model_source

    return load_model_source(args.model, args.load_format, args.trust_remote_code, convert_gguf=False).tokenizer


async def _serve(ns: argparse.Namespace, args: EngineArgs) -> int:
    loop = asyncio.get_running_loop()
    names = ns.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    count = ns.api_server_count
    socks, metrics_dir = [None], None
    if count > 1:  # every HTTP process accepts on its own socket of one port, all made (the port taken) here first
        from ostinato.entrypoints.openai import api_workers
        from ostinato.entrypoints.openai.metrics import enable_multiprocess_metrics

        socks = api_workers.listen_sockets(ns.host, ns.port, count)
        metrics_dir = enable_multiprocess_metrics()
    metrics = ServerMetrics(names[0])
    hooks = EngineClientHooks(on_stats=metrics.on_stats, on_finished=metrics.on_finished)

    # start-up (model loading) can be interrupted by SIGINT / SIGTERM
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(AsyncEngineClient.start(args, lambda: _load_tokenizer(args), hooks, count))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        logger.info("interrupted during start-up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    client = starting.result()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
        signal.signal(sig, lambda *_: None)  # uvicorn handles them while serving and re-raises them after
    info = client.info
    logger.info("engine ready (pid %d): %s on %s (%s), max_model_len %d, KV pool %d tokens; serving %s",
                info.pid, names[0], info.device, info.dtype, info.max_model_len, info.max_total_tokens,
                ", ".join(names))
    workers = None
    try:
        if count > 1:
            workers = api_workers.Workers.start(ns, client, socks[1:])
            t = time.perf_counter()
            try:
                if not await _unless_stopped(workers.wait_ready()):
                    logger.info("interrupted during start-up")
                    return 0
            except RuntimeError as e:  # one exited, or is stuck
                logger.error("%s: shutting down", e)
                return 1
            workers.go()
            logger.info("%d more HTTP processes ready (%.1f s)", count - 1, time.perf_counter() - t)
        http = {f"HTTP {i}" if count > 1 else "HTTP": pid
                for i, pid in enumerate([os.getpid(), *(workers.pids if workers else [])])}
        procs = {**http, **client.processes}
        logger.info("%d processes: %s; %s", len(procs),
                    ", ".join(f"{name} (pid {pid})" for name, pid in procs.items()), http_stack())
        code = await serve_app(ns, client, metrics, hooks, names, socks[0], workers)
    finally:
        if workers is not None:
            await asyncio.to_thread(workers.stop, ns.graceful_shutdown_timeout + 5.0)
        await client.shutdown()
        client.kill()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if client.dead is not None:
        logger.error("exiting with status 1: %s", client.dead)
        return 1
    if code:
        return code
    logger.info("server stopped")
    return 0


async def _unless_stopped(work: Awaitable[Any]) -> bool:
    """Run `work` unless SIGINT / SIGTERM comes first (then cancel it and return False); True once it is done
    (its exception raised here)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task, stopping = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, lambda *_: None)  # uvicorn handles them while serving and re-raises them after
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()
    return True


def http_stack() -> str:
    """Which event loop and HTTP parser serve (uvloop and httptools cut the per-chunk cost roughly in half)."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio (install uvloop: faster streaming)"
    parser = "httptools" if importlib.util.find_spec("httptools") else "h11 (install httptools: faster streaming)"
    return f"event loop {loop}, HTTP parser {parser}"


async def serve_app(ns: argparse.Namespace, client: AsyncEngineClient, metrics: ServerMetrics,
                    hooks: EngineClientHooks, names: list[str], sock: Any = None, workers: Any = None) -> int:
    """Serve HTTP until SIGINT / SIGTERM or the engine's death (then 503s for a grace period). `sock`: this
    process's listening socket of a port shared with other HTTP processes (`workers`, which get each signal
    too). Returns 1 if a worker died, else 0."""
    loop = asyncio.get_running_loop()
    serving = OpenAIServing(client, names, ns.max_n, ns.max_choices_in_engine)
    app = build_app(serving, metrics, ns.api_key, ns.max_request_body_bytes)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                            access_log=not ns.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=ns.graceful_shutdown_timeout, lifespan="off")

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if workers is not None:
                workers.signal(sig)
            super().handle_exit(sig, frame)

    server = Server(config)

    def on_dead(message: str) -> None:
        logger.error("shutting down in %.0f s: %s", ENGINE_DEATH_GRACE_S, message)
        loop.call_later(ENGINE_DEATH_GRACE_S, setattr, server, "should_exit", True)

    hooks.on_dead = on_dead
    if client.dead is not None:
        on_dead(client.dead)
    failed = []
    if workers is not None:
        def on_worker_exit(pid: int, code: int | None) -> None:
            if client.dead is not None:  # it saw the engine die too, and left after its grace period
                return
            logger.error("HTTP process %d exited unexpectedly (exit code %s): shutting down", pid, code)
            failed.append(pid)
            server.should_exit = True

        workers.watch(loop, on_worker_exit)
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        serving.close()
    return 1 if failed else 0
