"""The engine core in its own process: receive requests over ZMQ, step, send outputs back.

The loop never waits on the front end: it drains whatever requests and aborts have arrived, runs one
step and pushes that step's outputs (with the scheduler and KV-pool counts) without blocking. When idle it
blocks on its input for up to a second at a time, and exits if its parent is gone. A request with structured
outputs has its grammar compiled on a worker thread (a large JSON schema takes xgrammar 0.1-0.3 s, which would
stall every running request) and joins the scheduler when it is ready.
"""

import contextlib
import logging
import os
import signal
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zmq

from ostinato.config import EngineArgs
from ostinato.engine import ipc
from ostinato.engine.engine_core import EngineCore
from ostinato.multimodal.inputs import mm_from_wire
from ostinato.proc_util import die_with_parent

logger = logging.getLogger("ostinato.engine")

IDLE_CHECK_AFTER_MS = 200  # idle this long (no input), the engine runs its deep KV leak check
COMPILE_POLL_MS = 2  # while only grammar compiles are pending: how often the loop looks for finished ones


def run_engine_core(args: dict[str, Any], input_addr: str, output_addr: str) -> None:
    """Process entry point (multiprocessing spawn): load the model, report ready, serve until shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the HTTP process shuts us down
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, inp, out = ipc.engine_sockets(input_addr, output_addr, linger_ms=2000)
    code = 0
    try:
        try:
            core = _load(args)
        except Exception as e:
            if isinstance(e, ValueError):  # a bad argument: its message says which
                logger.error("engine core failed to start: %s", e)
            else:
                logger.exception("engine core failed to start")
            out.send(ipc.pack({"type": ipc.STARTUP_ERROR, "message": str(e)}))
            code = 1
            return
        out.send(ipc.pack(_ready_message(core)))
        try:
            EngineLoop(core, inp, out).run()
        except Exception as e:
            logger.exception("engine core failed")
            with contextlib.suppress(zmq.ZMQError):
                out.send(ipc.pack((ipc.DEAD, f"{type(e).__name__}: {e}")), zmq.NOBLOCK)
            code = 1
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
        if code:
            sys.exit(code)


def _load(args: dict[str, Any]) -> EngineCore:
    from ostinato.loader import load_model_source

    engine_args = EngineArgs(**args)
    source = load_model_source(engine_args.model, engine_args.load_format, engine_args.trust_remote_code)
    return EngineCore(engine_args, source)


def _ready_message(core: EngineCore) -> dict[str, Any]:
    r = core.runner
    return {
        "type": ipc.READY, "pid": os.getpid(), "vocab_size": r.vocab_size, "max_model_len": core.max_model_len,
        "max_total_tokens": r.max_total_tokens, "page_size": r.allocator.page_size,
        "max_running_requests": r.max_running_requests, "device": str(r.device),
        "dtype": str(r.dtype).removeprefix("torch."),
    }


class EngineLoop:
    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket) -> None:
        self.core, self.inp, self.out = core, inp, out
        self.parent = os.getppid()
        self.last_stats: dict[str, int | float] | None = None
        # requests with structured outputs whose grammar is compiling: rid -> (future, prompt ids, params, mm)
        self.compiling: dict[str, tuple[Future, list[int], Any, Any]] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="ostinato-grammar")

    def run(self) -> None:
        try:
            self._run()
        finally:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        self._send_stats()  # a fresh server reports its real KV and slot totals before the first request
        checked = True  # the deep leak check has run since the engine last went idle
        while True:
            self._admit_compiled()
            if self.compiling and not self.core.has_unfinished():  # only compiles pending: look again soon
                checked = False
                if self.inp.poll(COMPILE_POLL_MS) and not self._drain():
                    return
                continue
            if not self.core.has_unfinished():
                # the step that went idle checked the counts; the deep check waits until no request has come
                # for a while, so that it never holds up one arriving just after the others finished
                if not self.inp.poll(IDLE_CHECK_AFTER_MS if not checked else 1000):
                    if not checked and not self.core.args.disable_leak_check:
                        self.core.check_memory_leak(deep=True)
                    checked = True
                    if os.getppid() != self.parent:
                        logger.warning("parent process gone: engine core exits")
                        return
                    continue
                checked = False
            if not self._drain():
                return
            self._send_stats(self.core.step())

    def _send_stats(self, outputs: list | None = None) -> None:
        """Send the step's outputs with the counts, if there are outputs or the counts changed."""
        stats = self.stats()
        if outputs or stats != self.last_stats:
            self.out.send(ipc.pack((ipc.OUTPUTS, ipc.encode_outputs(outputs or []), stats)), zmq.NOBLOCK)
            self.last_stats = stats

    def _drain(self) -> bool:
        """Apply every message waiting; False on shutdown."""
        while True:
            try:
                msg = ipc.unpack(self.inp.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            kind = msg[0]
            if kind == ipc.ADD:
                _, rid, prompt_ids, params, *mm = msg  # mm: the images of a vision request (multimodal.inputs)
                try:
                    params = ipc.params_from_dict(params)
                    mm = mm_from_wire(mm[0]) if mm else None
                    if params.structured_outputs is not None:
                        self.core.validate(prompt_ids, params)  # the cheap checks answer at once
                        future = self._compiler.submit(self.core.compile_grammar, params)
                        self.compiling[rid] = (future, prompt_ids, params, mm)
                    else:
                        self.core.add_request(rid, prompt_ids, params, mm=mm)
                except (ValueError, TypeError) as e:
                    self.out.send(ipc.pack((ipc.REJECTED, rid, str(e))), zmq.NOBLOCK)
            elif kind == ipc.ABORT:
                for rid in msg[1]:
                    if self.compiling.pop(rid, None) is None:  # (a compiling one is dropped when it is done)
                        self.core.abort(rid)
            elif kind == ipc.SHUTDOWN:
                logger.info("engine core shutting down")
                return False

    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled join the scheduler; those whose constraint did not compile are
        rejected, as a bad request is at once."""
        for rid in [rid for rid, (future, *_) in self.compiling.items() if future.done()]:
            future, prompt_ids, params, mm = self.compiling.pop(rid)
            try:
                self.core.add_request(rid, prompt_ids, params, mm=mm, grammar=future.result())
            except (ValueError, TypeError) as e:
                self.out.send(ipc.pack((ipc.REJECTED, rid, str(e))), zmq.NOBLOCK)
            except Exception as e:  # an unforeseen compile failure costs this request, not the engine
                logger.exception("request %s: compiling its structured-output constraint failed", rid)
                self.out.send(ipc.pack((ipc.REJECTED, rid, f"structured_outputs: {type(e).__name__}: {e}")),
                              zmq.NOBLOCK)

    def stats(self) -> dict[str, int | float]:
        core = self.core
        sched, alloc, slots = core.scheduler, core.runner.allocator, core.runner.req_to_token_pool
        return {
            "running": len(sched.running), "waiting": len(sched.waiting),
            # free counts what the prefix cache holds unused (it is evicted on demand)
            "kv_free_pages": sched.cache.available_pages(), "kv_total_pages": alloc.usable_pages,
            "req_slots_free": slots.available_size(), "req_slots_total": slots.size,
            "num_retractions": sched.num_retractions,
            "prefix_cache_queries": sched.cache.query_tokens, "prefix_cache_hits": sched.cache.hit_tokens,
            "prefix_cache_evictable_tokens": sched.cache.evictable_tokens(),
            **{f"{mode}_steps": n for mode, n in core.step_counts.items()},
            **{f"{mode}_tokens": n for mode, n in core.step_tokens.items()},
            **{f"{mode}_seconds": t for mode, t in core.step_seconds.items()},
        }
