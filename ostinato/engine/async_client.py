"""Front-end side of the engine process: spawn it, talk to it over ZMQ, stream each request's output.

One task reads the engine's output socket, detokenizes (stop strings included) and puts each choice's
delta on its request's own asyncio queue; it never waits on a client, so a slow reader only delays
itself. Requests and aborts are sent without blocking. When the engine process exits unasked, every
pending request gets `EngineDeadError` and so does every later one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from ostinato.config import EngineArgs
from ostinato.engine import ipc
from ostinato.engine.core_proc import run_engine_core
from ostinato.engine.limits import EngineLimits
from ostinato.engine.output_processor import OutputProcessor
from ostinato.runner.sampler import TokenLogprobs
from ostinato.sampling_params import SamplingParams

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


@dataclass
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


@dataclass
class RequestTiming:
    """One engine request's latencies, reported when it finishes (not when aborted)."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    num_tokens: int = 0
    finished: float | None = None
    finish_reason: str | None = None


@dataclass
class _Child:
    queue: asyncio.Queue
    index: int
    timing: RequestTiming


@dataclass
class EngineClientHooks:
    on_stats: Callable[[dict[str, int]], None] | None = None  # scheduler / KV-pool counts after engine steps
    on_finished: Callable[[RequestTiming], None] | None = None
    on_dead: Callable[[str], None] | None = None  # the engine process died (message)


def coalesce_deltas(items: list[ChoiceDelta | BaseException]) -> list[ChoiceDelta | BaseException]:
    """Merge each run of consecutive deltas of one choice into one delta (text, token ids and logprobs
    concatenated in order; the finish of the last). An exception ends merging and keeps its place."""
    out: list[ChoiceDelta | BaseException] = []
    for item in items:
        last = out[-1] if out else None
        if (isinstance(item, ChoiceDelta) and isinstance(last, ChoiceDelta) and last.index == item.index
                and last.finish_reason is None):
            out[-1] = dataclasses.replace(
                last, text=last.text + item.text, token_ids=last.token_ids + item.token_ids,
                logprobs=last.logprobs + item.logprobs, finish_reason=item.finish_reason,
                stop_reason=item.stop_reason, num_cached_tokens=item.num_cached_tokens)
        else:
            out.append(item)
    return out


def child_params(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n independent samples: n = 1, and the seed offset by j (so they differ reproducibly)."""
    seed = None if params.seed is None else params.seed + j
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass
class AsyncEngineClient:
    args: EngineArgs
    tokenizer: Any
    info: EngineInfo
    hooks: EngineClientHooks
    _proc: multiprocessing.process.BaseProcess
    _ctx: zmq.asyncio.Context
    _input: zmq.Socket  # sync PUSH: sends never block (no high-water mark)
    _output: zmq.asyncio.Socket
    _tmpdir: str
    _processor: OutputProcessor = field(init=False)
    _children: dict[str, _Child] = field(default_factory=dict)
    _task: asyncio.Task | None = None
    stats: dict[str, int] = field(default_factory=dict)
    dead: str | None = None  # why the engine is dead; None while it lives
    _dead_reason: str | None = None
    _closing: bool = False

    def __post_init__(self) -> None:
        self._processor = OutputProcessor(self.tokenizer)

    # ------------------------------------------------------------------ start / stop
    @classmethod
    async def start(cls, args: EngineArgs, load_tokenizer: Callable[[], Any],
                    hooks: EngineClientHooks | None = None) -> AsyncEngineClient:
        """Spawn the engine process and load the tokenizer here meanwhile; return once the engine is ready."""
        tmpdir = tempfile.mkdtemp(prefix="ostinato-ipc-")
        in_addr, out_addr = f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"
        ctx = zmq.asyncio.Context()
        sync_ctx = zmq.Context.shadow(ctx.underlying)
        inp = sync_ctx.socket(zmq.PUSH)
        inp.setsockopt(zmq.SNDHWM, 0)
        inp.setsockopt(zmq.LINGER, 0)
        inp.bind(in_addr)
        out = ctx.socket(zmq.PULL)
        out.setsockopt(zmq.RCVHWM, 0)
        out.setsockopt(zmq.LINGER, 0)
        out.bind(out_addr)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(dataclasses.asdict(args), in_addr, out_addr), name="ostinato-engine-core")
        proc.start()
        logger.info("engine core process started (pid %d); loading the model", proc.pid)
        tokenizer_future = _in_daemon_thread(load_tokenizer)
        try:
            ready = await _wait_ready(out, proc)
            tokenizer = await tokenizer_future
        except BaseException:
            tokenizer_future.cancel()  # the engine's error says the same; an interrupt need not wait for it
            _stop_process(proc, timeout=0.0, warn=False)
            inp.close()
            out.close()
            ctx.term()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        info = EngineInfo(**{f.name: ready[f.name] for f in dataclasses.fields(EngineInfo)})
        client = cls(args, tokenizer, info, hooks or EngineClientHooks(), proc, ctx, inp, out, tmpdir)
        client._task = asyncio.create_task(client._output_loop())
        asyncio.get_running_loop().add_reader(proc.sentinel, client._on_process_exit)
        return client

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, wait for it (terminate / kill past `timeout`), release sockets."""
        if self._closing:
            return
        self._closing = True
        try:
            self._send((ipc.SHUTDOWN,))
        except EngineDeadError:
            pass
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._proc.sentinel)
        await asyncio.to_thread(_stop_process, self._proc, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._input.close()
        self._output.close()
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def kill(self) -> None:
        """Last resort, synchronous: make sure the engine process is gone."""
        _stop_process(self._proc, timeout=2.0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

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
        queue: asyncio.Queue = asyncio.Queue()
        unsent = [(p * params.n + j, ids, j) for p, ids in enumerate(prompts) for j in range(params.n)]
        unsent.reverse()  # popped from the end: in index order
        window = len(unsent) if max_in_engine is None else max(1, max_in_engine)
        in_engine: dict[int, str] = {}

        def send_next() -> None:
            index, ids, j = unsent.pop()
            rid = f"{request_id}-{index}"
            sp = child_params(params, j) if params.n > 1 else params
            self._children[rid] = _Child(queue, index, RequestTiming(time.monotonic(), len(ids)))
            self._processor.add(rid, ids, sp)
            in_engine[index] = rid
            self._send((ipc.ADD, rid, ids, ipc.params_to_dict(sp), *([mm_wire] if mm_wire else [])))

        try:
            while unsent and len(in_engine) < window:
                send_next()
            while in_engine:
                # what piled up while the consumer was busy goes out as one delta per choice, so a slow
                # stream sends fewer, larger chunks instead of falling further behind
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in coalesce_deltas(items):
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
                    self._processor.remove(rid)
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
    async def _output_loop(self) -> None:
        try:
            while True:
                msg = ipc.unpack(await self._output.recv())
                kind = msg[0] if isinstance(msg, list) else msg.get("type")
                if kind == ipc.OUTPUTS:
                    self._on_outputs(msg[1], msg[2])
                elif kind == ipc.REJECTED:
                    child = self._children.pop(msg[1], None)
                    self._processor.remove(msg[1])
                    if child is not None:
                        child.queue.put_nowait(RequestRejected(msg[2]))
                elif kind == ipc.DEAD:  # the process exits right after; _on_process_exit reports it
                    logger.error("engine core failed: %s", msg[1])
                    self._dead_reason = f"the engine core failed: {msg[1]}"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("engine output loop failed")
            self._declare_dead(f"the engine output loop failed: {e}")

    def _on_outputs(self, rows: list, stats: dict[str, int]) -> None:
        states, to_abort = self._processor.process(ipc.decode_outputs(rows))
        if to_abort:
            try:
                self._send((ipc.ABORT, to_abort))
            except EngineDeadError:
                pass
        now = time.monotonic()
        for st in states:
            child = self._children.get(st.rid)
            if child is None:
                continue
            t = child.timing
            if st.delta_token_ids and t.first_token is None:
                t.first_token = now
            t.num_tokens = len(st.token_ids)
            child.queue.put_nowait(ChoiceDelta(child.index, st.delta_text, st.delta_token_ids, st.delta_logprobs,
                                               st.finish_reason, st.stop_reason, t.num_prompt_tokens,
                                               st.num_cached_tokens))
            if st.finish_reason is not None:
                del self._children[st.rid]
                t.finished, t.finish_reason = now, st.finish_reason
                if self.hooks.on_finished is not None and st.finish_reason != "abort":
                    self.hooks.on_finished(t)
        self.stats = stats
        if self.hooks.on_stats is not None:
            self.hooks.on_stats(stats)

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
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
        for rid, child in list(self._children.items()):
            child.queue.put_nowait(error)
            self._processor.remove(rid)
        self._children.clear()


async def _wait_ready(out: zmq.asyncio.Socket, proc: multiprocessing.process.BaseProcess) -> dict[str, Any]:
    """The engine's ready message; EngineStartError if it reports a failure or exits first."""
    while True:
        if await out.poll(200):
            msg = ipc.unpack(await out.recv())
            if isinstance(msg, dict) and msg.get("type") == ipc.READY:
                return msg
            if isinstance(msg, dict) and msg.get("type") == ipc.STARTUP_ERROR:
                raise EngineStartError(msg["message"])
            continue
        if not proc.is_alive():
            raise EngineStartError(f"the engine core process exited during start-up (exit code {proc.exitcode})")


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
