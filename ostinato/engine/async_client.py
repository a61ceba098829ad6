"""Front-end side of the engine process: spawn it, talk to it over ZMQ, stream each request's output.

With a tokenizer, a detokenizer process sits between this process and the engine (`detok_proc`): it
turns token ids into text deltas and applies stop strings, so none of that runs here. An event-loop reader
on the output socket's FD drains it (one message per engine step, every request's delta in it) and puts
each choice's delta on its request's own asyncio queue; it never waits on a client, so a slow reader only
delays itself.
Requests and aborts are sent without blocking. When the engine or the detokenizer process exits unasked,
every pending request gets `EngineDeadError` and so does every later one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ostinato.config import EngineArgs
from ostinato.engine import ipc
from ostinato.engine.limits import EngineLimits
from ostinato.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ostinato.runner.sampler import TokenLogprobs

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone: no request can be served."""


class EngineStartError(RuntimeError):
    """The engine-core process could not load the model."""


class RequestRejected(ValueError):
    """The engine core refused a request (its message names the field)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine process reports once loaded."""

    pid: int
    vocab_size: int
    max_model_len: int
    max_total_tokens: int
    page_size: int
    max_running_requests: int
    device: str
    dtype: str

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.vocab_size, self.max_model_len)


@dataclass(slots=True)
class ChoiceDelta:
    """What one step added to one choice (index = prompt index * n + sample index)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the choice's first delta, when asked for


@dataclass
class RequestTiming:
    """One engine request's latencies, reported when it finishes (not when aborted)."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    num_tokens: int = 0
    finished: float | None = None
    finish_reason: str | None = None


class Inbox:
    """One generate() call's deltas, in arrival order: a list and at most one waiter (cheaper per item than
    asyncio.Queue, which a stream that fell behind paid for every token)."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get_all(self) -> list[Any]:
        """Everything that arrived (waiting for at least one item), oldest first."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


@dataclass
class _Child:
    queue: Inbox
    index: int
    timing: RequestTiming
    num_cached_tokens: int = 0


@dataclass
class EngineClientHooks:
    on_stats: Callable[[dict[str, int]], None] | None = None  # scheduler / KV-pool counts after engine steps
    on_finished: Callable[[RequestTiming], None] | None = None
    on_dead: Callable[[str], None] | None = None  # the engine process died (message)


def run_engine_core(args: dict[str, Any], input_addr: str, output_addr: str) -> None:
    """The engine process's entry point, imported there: an HTTP process never loads the model code (torch,
    the runner), so extra HTTP processes start in a few seconds and hold no copy of them."""
    from ostinato.engine.core_proc import run_engine_core as run

    run(args, input_addr, output_addr)


def coalesce_deltas(items: list[ChoiceDelta | BaseException]) -> list[ChoiceDelta | BaseException]:
    """Merge each run of consecutive deltas of one choice into one delta (text, token ids and logprobs
    concatenated in order; the finish of the last; the prompt logprobs, which only a choice's first delta has,
    kept). An exception ends merging and keeps its place."""
    if len(items) == 1:
        return items
    out: list[ChoiceDelta | BaseException] = []
    for item in items:
        last = out[-1] if out else None
        if (type(item) is ChoiceDelta and type(last) is ChoiceDelta and last.index == item.index
                and last.finish_reason is None):
            out[-1] = ChoiceDelta(last.index, last.text + item.text, last.token_ids + item.token_ids,
                                  last.logprobs + item.logprobs, item.finish_reason, item.stop_reason,
                                  last.num_prompt_tokens, item.num_cached_tokens,
                                  last.prompt_logprobs if last.prompt_logprobs is not None else item.prompt_logprobs)
        else:
            out.append(item)
    return out


def child_params(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n independent samples: n = 1, and the seed offset by j (so they differ reproducibly)."""
    seed = None if params.seed is None else params.seed + j
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass
class AsyncEngineClient:
    """One HTTP process's link to the engine. The first (`start`) owns the engine and detokenizer processes;
    with several HTTP processes, the others (`connect`) only talk to them, and watch them."""

    args: EngineArgs
    tokenizer: Any
    info: EngineInfo
    hooks: EngineClientHooks
    _proc: multiprocessing.process.BaseProcess | None  # the engine process (None: not ours)
    _ctx: zmq.Context
    _input: zmq.Socket  # PUSH: sends never block (no high-water mark)
    _output: zmq.Socket  # PULL, read by an event-loop reader on its FD (`_on_readable`)
    _tmpdir: str | None
    _detok: subprocess.Popen | None = None  # the detokenizer process, when this process started one
    front_index: int = 0  # this HTTP process's index among num_fronts
    num_fronts: int = 1
    endpoints: list[tuple[str, str]] = field(default_factory=list)  # per HTTP process: (its input, its output)
    _children: dict[str, _Child] = field(default_factory=dict)
    _reading: bool = False
    stats: dict[str, int] = field(default_factory=dict)
    dead: str | None = None  # why the engine is dead; None while it lives
    _dead_reason: str | None = None
    _closing: bool = False
    _pids: dict[str, int] = field(default_factory=dict)  # the processes this one depends on: name -> pid
    _unwatchers: list[Callable[[], None]] = field(default_factory=list)

    # ------------------------------------------------------------------ start / stop
    @classmethod
    async def start(cls, args: EngineArgs, load_tokenizer: Callable[[], Any],
                    hooks: EngineClientHooks | None = None, num_fronts: int = 1) -> AsyncEngineClient:
        """Spawn the engine process (and, with a tokenizer or several HTTP processes, the detokenizer process)
        and load the tokenizer here meanwhile; return once the engine is ready."""
        tmpdir = tempfile.mkdtemp(prefix="ostinato-ipc-")
        ctx = zmq.Context()
        inp = ctx.socket(zmq.PUSH)
        inp.setsockopt(zmq.SNDHWM, 0)
        inp.setsockopt(zmq.LINGER, 0)
        out = ctx.socket(zmq.PULL)
        out.setsockopt(zmq.RCVHWM, 0)
        out.setsockopt(zmq.LINGER, 0)
        detok = None
        if args.skip_tokenizer_init and num_fronts == 1:  # nothing to detokenize or route: straight to the engine
            engine_in, engine_out = f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"
            endpoints = [(engine_in, engine_out)]
            inp.bind(engine_in)
            out.bind(engine_out)
        else:
            engine_in, engine_out = f"ipc://{tmpdir}/engine-input", f"ipc://{tmpdir}/engine-output"
            endpoints = [(f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output-{i}") for i in range(num_fronts)]
            inp.connect(endpoints[0][0])
            out.bind(endpoints[0][1])
            detok = start_detokenizer(None if args.skip_tokenizer_init else args, endpoints[0][0],
                                      [o for _, o in endpoints], engine_in, engine_out)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(dataclasses.asdict(args), engine_in, engine_out),
            name="ostinato-engine-core")
        proc.start()
        logger.info("engine core process started (pid %d); loading the model", proc.pid)
        tokenizer_future = _in_daemon_thread(load_tokenizer)
        try:
            ready = await _wait_ready(out, proc, detok)
            tokenizer = await tokenizer_future
        except BaseException:
            tokenizer_future.cancel()  # the engine's error says the same; an interrupt need not wait for it
            _stop_process(proc, timeout=0.0, warn=False)
            if detok is not None:
                _stop_popen(detok, timeout=0.0)
            inp.close()
            out.close()
            ctx.term()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        info = EngineInfo(**{f.name: ready[f.name] for f in dataclasses.fields(EngineInfo)})
        client = cls(args, tokenizer, info, hooks or EngineClientHooks(), proc, ctx, inp, out, tmpdir, detok,
                     0, num_fronts, endpoints)
        client._pids = {"engine core": proc.pid, **({"detokenizer": detok.pid} if detok is not None else {})}
        client._start_reading()
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, client._on_process_exit)
        client._unwatchers.append(lambda: loop.remove_reader(proc.sentinel))
        if detok is not None:
            client._watch(detok.pid, "detokenizer", detok.poll)
        return client

    @classmethod
    async def connect(cls, args: EngineArgs, tokenizer: Any, info: EngineInfo, endpoints: tuple[str, str],
                      pids: dict[str, int], front_index: int, num_fronts: int,
                      hooks: EngineClientHooks | None = None) -> AsyncEngineClient:
        """Another HTTP process's link to the running engine (through the detokenizer process, which routes
        each request's outputs to the process whose index its id starts with)."""
        ctx = zmq.Context()
        inp = ctx.socket(zmq.PUSH)
        inp.setsockopt(zmq.SNDHWM, 0)
        inp.setsockopt(zmq.LINGER, 0)
        inp.connect(endpoints[0])
        out = ctx.socket(zmq.PULL)
        out.setsockopt(zmq.RCVHWM, 0)
        out.setsockopt(zmq.LINGER, 0)
        out.bind(endpoints[1])
        client = cls(args, tokenizer, info, hooks or EngineClientHooks(), None, ctx, inp, out, None, None,
                     front_index, num_fronts, [endpoints])
        client._pids = dict(pids)
        client._start_reading()
        for name, pid in pids.items():
            client._watch(pid, name)
        return client

    def _watch(self, pid: int, name: str, reap: Callable[[], Any] | None = None) -> None:
        """Declare the engine dead when process `pid` exits (pidfd where there is one, else a look every 0.5 s)."""
        loop = asyncio.get_running_loop()

        def gone() -> None:
            if reap is not None:
                reap()
            if not self._closing:
                self._unwatch()
                self._declare_dead(self._dead_reason or f"the {name} process exited unexpectedly")

        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: poll
            def look() -> None:
                if self._closing or self.dead is not None:
                    return
                try:
                    os.kill(pid, 0)
                    exited = reap is not None and reap() is not None
                except ProcessLookupError:
                    exited = True
                if exited:
                    gone()
                else:
                    handle[0] = loop.call_later(0.5, look)

            handle = [loop.call_later(0.5, look)]
            self._unwatchers.append(lambda: handle[0].cancel())
            return
        loop.add_reader(fd, gone)

        def unwatch() -> None:
            loop.remove_reader(fd)
            os.close(fd)

        self._unwatchers.append(unwatch)

    def _unwatch(self) -> None:
        for unwatch in self._unwatchers:
            unwatch()
        self._unwatchers.clear()

    @property
    def processes(self) -> dict[str, int]:
        """The processes this HTTP process depends on: name -> pid."""
        return dict(self._pids)

    @property
    def rid_prefix(self) -> str:
        return f"{self.front_index}:" if self.num_fronts > 1 else ""

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, wait for it (terminate / kill past `timeout`), release sockets. (A process
        that did not start the engine only releases its sockets.)"""
        if self._closing:
            return
        self._closing = True
        self._unwatch()
        if self._proc is not None:
            sent = False
            try:
                self._send((ipc.SHUTDOWN,))
                sent = True
            except EngineDeadError:
                pass
            await asyncio.to_thread(_stop_process, self._proc, timeout)
            if self._detok is not None:
                if not sent:  # the engine is dead: the detokenizer still has to go
                    with contextlib.suppress(zmq.ZMQError):
                        self._input.send(ipc.pack((ipc.SHUTDOWN,)), zmq.NOBLOCK)
                await asyncio.to_thread(_stop_popen, self._detok, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._stop_reading()
        self._input.close()
        self._output.close()
        self._ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def kill(self) -> None:
        """Last resort, synchronous: make sure the engine process is gone."""
        if self._proc is not None:
            _stop_process(self._proc, timeout=2.0)
        if self._detok is not None:
            _stop_popen(self._detok, timeout=2.0)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self._pids.get("engine core")

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                       max_in_engine: int | None = None, mm_wire: dict | None = None) -> AsyncIterator[ChoiceDelta]:
        """Deltas of every choice (prompt p, sample j -> index p * n + j) until all have finished.

        Fair share: at most `max_in_engine` choices of this call are in the engine at once (None: no limit);
        the next is sent when one finishes. One request with a large `n` (or many prompts) thus holds at
        most that many request slots and adds at most that many prompts to a prefill, however many choices
        it asks for, and other clients' requests still find slots and keep their decode steps short. The
        scheduler needs no notion of groups for this. Leaving early (the client went away, an error) aborts
        the unfinished choices in the engine; the ones not sent yet are simply dropped.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        queue = Inbox()
        unsent = [(p * params.n + j, ids, j) for p, ids in enumerate(prompts) for j in range(params.n)]
        unsent.reverse()  # popped from the end: in index order
        window = len(unsent) if max_in_engine is None else max(1, max_in_engine)
        in_engine: dict[int, str] = {}

        def send_next() -> None:
            index, ids, j = unsent.pop()
            rid = f"{self.rid_prefix}{request_id}-{index}"
            sp = child_params(params, j) if params.n > 1 else params
            self._children[rid] = _Child(queue, index, RequestTiming(time.monotonic(), len(ids)))
            in_engine[index] = rid
            self._send((ipc.ADD, rid, ids, ipc.params_to_dict(sp), *([mm_wire] if mm_wire else [])))

        try:
            while unsent and len(in_engine) < window:
                send_next()
            while in_engine:
                # what piled up while the consumer was busy goes out as one delta per choice, so a slow
                # stream sends fewer, larger chunks instead of falling further behind
                for item in coalesce_deltas(await queue.get_all()):
                    if isinstance(item, BaseException):
                        raise item
                    if item.finish_reason is not None:
                        in_engine.pop(item.index, None)
                        if unsent:
                            send_next()
                    yield item
        finally:
            if in_engine:
                rids = list(in_engine.values())
                for rid in rids:
                    self._children.pop(rid, None)
                try:
                    self._send((ipc.ABORT, rids))
                except EngineDeadError:
                    pass

    def _send(self, msg: tuple) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            self._input.send(ipc.pack(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    # ------------------------------------------------------------------ engine -> front end
    # A reader on the output socket's FD drains every message waiting, in the event loop's own callback: no
    # task and no future per message (zmq.asyncio's recv cost ~20% of the HTTP process at 256 streams). The
    # FD is edge-triggered, so a drain always runs until the socket is empty (or hands over to a next call).
    MAX_MESSAGES_PER_CALL = 64  # then the streams' tasks run before the rest is read

    def _start_reading(self) -> None:
        loop = asyncio.get_running_loop()
        self._reading = True
        loop.add_reader(self._output.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)  # what came before the reader was added

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self._output.getsockopt(zmq.FD))

    def _on_readable(self) -> None:
        if not self._reading:
            return
        try:
            for _ in range(self.MAX_MESSAGES_PER_CALL):
                try:
                    raw = self._output.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                self._on_message(ipc.unpack(raw))
            asyncio.get_running_loop().call_soon(self._on_readable)  # more may wait: no new edge will say so
        except Exception as e:
            logger.exception("engine output reader failed")
            self._stop_reading()
            self._declare_dead(f"the engine output loop failed: {e}")

    def _on_message(self, msg: Any) -> None:
        kind = msg[0] if isinstance(msg, list) else msg.get("type")
        if kind == ipc.OUTPUTS:
            self._on_outputs(msg[1], msg[2])
        elif kind == ipc.REJECTED:
            child = self._children.pop(msg[1], None)
            if child is not None:
                child.queue.put_nowait(RequestRejected(msg[2]))
        elif kind == ipc.DEAD:  # the process exits right after; _on_process_exit reports it
            logger.error("engine core failed: %s", msg[1])
            self._dead_reason = f"the engine core failed: {msg[1]}"

    def _on_outputs(self, rows: list, stats: dict[str, int]) -> None:
        """One engine step: rows [rid, new ids, finish, stop, logprobs, cached tokens, prompt logprobs(, text
        delta)]; the text is there when the detokenizer process made the row (ipc.encode_outputs' rows have
        none)."""
        now = time.monotonic()
        children = self._children
        for row in rows:
            child = children.get(row[0])
            if child is None:
                continue
            ids, finish, cached = row[1], row[2], row[5]
            t = child.timing
            if t.first_token is None and ids:
                t.first_token = now
            t.num_tokens += len(ids)
            if cached is not None:
                child.num_cached_tokens = cached
            child.queue.put_nowait(ChoiceDelta(child.index, row[7] if len(row) > 7 else "", ids, row[4] or [],
                                               finish, row[3], t.num_prompt_tokens, child.num_cached_tokens,
                                               row[6] if len(row) > 6 else None))
            if finish is not None:
                rid = row[0]
                del children[rid]
                t.finished, t.finish_reason = now, finish
                if self.hooks.on_finished is not None and finish != "abort":
                    self.hooks.on_finished(t)
        if stats:  # with several HTTP processes only the first gets the counts
            self.stats = stats
            if self.hooks.on_stats is not None:
                self.hooks.on_stats(stats)

    def _on_process_exit(self) -> None:
        self._unwatch()
        self._proc.join(timeout=0)
        if self._closing:
            return
        code = self._proc.exitcode
        self._declare_dead(self._dead_reason or f"the engine core process exited unexpectedly (exit code {code})")

    def _declare_dead(self, message: str) -> None:
        if self.dead is not None or self._closing:
            return
        self.dead = message
        logger.error("%s; failing %d pending request(s)", self.dead, len(self._children))
        self._fail_all(EngineDeadError(self.dead))
        if self.hooks.on_dead is not None:
            self.hooks.on_dead(self.dead)

    def _fail_all(self, error: Exception) -> None:
        for child in self._children.values():
            child.queue.put_nowait(error)
        self._children.clear()


def start_detokenizer(args: EngineArgs | None, front_in: str, front_outs: list[str], engine_in: str,
                      engine_out: str) -> subprocess.Popen:
    """`python -m ostinato.engine.detok_proc` between the front ends' sockets and the engine's (`args` None:
    no tokenizer, it only routes)."""
    cmd = [sys.executable, "-m", "ostinato.engine.detok_proc", "--parent", str(os.getpid()), "--front-in", front_in,
           "--front-out", *front_outs, "--engine-in", engine_in, "--engine-out", engine_out]
    if args is not None:
        cmd += ["--args", json.dumps({"model": args.model, "load_format": args.load_format,
                                      "trust_remote_code": args.trust_remote_code})]
    detok = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    logger.info("detokenizer process started (pid %d)", detok.pid)
    return detok


async def _readable(sock: zmq.Socket, timeout: float) -> bool:
    """Whether `sock` has a message, waiting up to `timeout` seconds on its FD (no polling loop)."""
    if sock.poll(0):
        return True
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = sock.getsockopt(zmq.FD)
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, timeout)
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)
    return bool(sock.poll(0))


async def _wait_ready(out: zmq.Socket, proc: multiprocessing.process.BaseProcess,
                      detok: subprocess.Popen | None = None) -> dict[str, Any]:
    """The engine's ready message; EngineStartError if it reports a failure or exits first."""
    while True:
        if await _readable(out, 0.2):
            msg = ipc.unpack(out.recv())
            if isinstance(msg, dict) and msg.get("type") == ipc.READY:
                return msg
            if isinstance(msg, dict) and msg.get("type") == ipc.STARTUP_ERROR:
                raise EngineStartError(msg["message"])
            continue
        if not proc.is_alive():
            raise EngineStartError(f"the engine core process exited during start-up (exit code {proc.exitcode})")
        if detok is not None and detok.poll() is not None:
            raise EngineStartError(f"the detokenizer process exited during start-up (exit code {detok.returncode})")


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """`fn()` in a daemon thread (unlike asyncio.to_thread, exiting the process does not wait for it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            result = (True, fn())
        except BaseException as e:  # delivered to the awaiting task
            result = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop may be closed by then
            loop.call_soon_threadsafe(settle, *result)

    threading.Thread(target=run, name="ostinato-tokenizer-load", daemon=True).start()
    return future


def _stop_process(proc: multiprocessing.process.BaseProcess, timeout: float, warn: bool = True) -> None:
    """Join; past `timeout` terminate, then kill."""
    proc.join(timeout)
    if proc.is_alive():
        if warn:
            logger.warning("engine core did not exit in %.0f s: terminating it", timeout)
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


def _stop_popen(proc: subprocess.Popen, timeout: float) -> None:
    """Wait; past `timeout` terminate, then kill."""
    for stop in (None, proc.terminate, proc.kill):
        if stop is not None:
            if proc.poll() is not None:
                return
            stop()
        try:
            proc.wait(timeout if stop is None else 5.0)
            return
        except subprocess.TimeoutExpired:
            pass
