"""The engine core in its own process: receive requests over ZMQ, step, send outputs back.

The loop never waits on the front end: it drains whatever requests and aborts have arrived, runs one
step and pushes that step's outputs (with the scheduler and KV-pool counts) without blocking. When idle it
blocks on its input for up to a second at a time, and exits if its parent is gone.
"""

import contextlib
import logging
import os
import signal
import sys
from typing import Any

import zmq

from ostinato.config import EngineArgs
from ostinato.engine import ipc
from ostinato.engine.engine_core import EngineCore
from ostinato.engine.proc_util import die_with_parent
from ostinato.multimodal.inputs import mm_from_wire

logger = logging.getLogger("ostinato.engine")

IDLE_CHECK_AFTER_MS = 200  # idle this long (no input), the engine runs its deep KV leak check


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

    def run(self) -> None:
        self._send_stats()  # a fresh server reports its real KV and slot totals before the first request
        checked = True  # the deep leak check has run since the engine last went idle
        while True:
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
                    self.core.add_request(rid, prompt_ids, ipc.params_from_dict(params),
                                          mm=mm_from_wire(mm[0]) if mm else None)
                except (ValueError, TypeError) as e:
                    self.out.send(ipc.pack((ipc.REJECTED, rid, str(e))), zmq.NOBLOCK)
            elif kind == ipc.ABORT:
                for rid in msg[1]:
                    self.core.abort(rid)
            elif kind == ipc.SHUTDOWN:
                logger.info("engine core shutting down")
                return False

    def stats(self) -> dict[str, int | float]:
        core = self.core
        sched, alloc, slots = core.scheduler, core.runner.allocator, core.runner.req_to_token_pool
        return {
            "running": len(sched.running), "waiting": len(sched.waiting),
            # free counts what the prefix cache holds unused (it is evicted on demand)
            "kv_free_pages": sched.cache.available_pages(), "kv_total_pages": alloc.num_pages - 1,
            "req_slots_free": slots.available_size(), "req_slots_total": slots.size,
            "num_retractions": sched.num_retractions,
            "prefix_cache_queries": sched.cache.query_tokens, "prefix_cache_hits": sched.cache.hit_tokens,
            "prefix_cache_evictable_tokens": sched.cache.evictable_tokens(),
            **{f"{mode}_steps": n for mode, n in core.step_counts.items()},
            **{f"{mode}_tokens": n for mode, n in core.step_tokens.items()},
            **{f"{mode}_seconds": t for mode, t in core.step_seconds.items()},
        }
