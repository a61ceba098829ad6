"""The detokenizer process: incremental detokenization, stop strings and routing, between the HTTP
process(es) and the engine.

It is a proxy on both paths, so the engine core needs no change and every ordering holds by construction:

    HTTP process(es) --(add/abort/shutdown)--> detokenizer --(the same bytes)--> engine core
    HTTP process(es) <--(outputs with text)--- detokenizer <--(outputs, ids)---- engine core

An "add" registers the request's detokenizer state before it is forwarded, so its outputs can never arrive
first. Each engine step's outputs message becomes one message per HTTP process with, per updated request,
the text delta beside the token ids; a request that a stop string ends is reported finished ("stop", the
string) and aborted in the engine. Rows of requests it does not know (an abort acknowledged after a stop
string) pass through unchanged. With several HTTP processes (`--api-server-count`) a request id starts
with its process's index ("2:cmpl-..."), and rows go to that process only; the scheduler / KV counts of
each step go to the first one, which keeps the engine's metrics. It runs when the server has a tokenizer
or several HTTP processes (then, without a tokenizer, it only routes); otherwise the HTTP process talks to
the engine directly and the text is empty.

Started by the first HTTP process as `python -m ostinato.engine.detok_proc` (so `ps` names it); it dies
with its parent (PR_SET_PDEATHSIG, and a parent check while idle), ignores SIGINT (the HTTP process shuts
it down) and exits after forwarding "shutdown".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from typing import Any

import zmq

from ostinato.engine import ipc
from ostinato.engine.output_processor import OutputProcessor
from ostinato.proc_util import die_with_parent, set_process_name

logger = logging.getLogger("ostinato.detokenizer")


def front_of(rid: str) -> int:
    """The HTTP process that owns a request: its id starts with "<index>:" when there are several."""
    head, sep, _ = rid.partition(":")
    return int(head) if sep and head.isdigit() else 0


class Detokenizer:
    """The message transforms, free of sockets (tested directly). `tokenizer` None: route only."""

    def __init__(self, tokenizer: Any, num_fronts: int = 1) -> None:
        self.processor = OutputProcessor(tokenizer) if tokenizer is not None else None
        self.num_fronts = num_fronts

    def on_input(self, msg: Any) -> None:
        """A front-end message on its way to the engine: register adds, forget aborted requests."""
        if self.processor is None:
            return
        kind = msg[0]
        if kind == ipc.ADD:
            self.processor.add(msg[1], [], ipc.params_from_dict(msg[3]))
        elif kind == ipc.ABORT:
            for rid in msg[1]:
                self.processor.remove(rid)

    def on_output(self, msg: Any) -> tuple[list[tuple[int, tuple | None]], list[str]]:
        """An engine message on its way to the front ends -> ([(front index, the message to send, None for the
        message as it came)], the ids of requests to abort in the engine)."""
        kind = msg[0] if isinstance(msg, list) else None
        if kind == ipc.REJECTED:
            if self.processor is not None:
                self.processor.remove(msg[1])
            return [(front_of(msg[1]), None)], []
        if kind == ipc.DEAD:
            return [(i, None) for i in range(self.num_fronts)], []
        if kind != ipc.OUTPUTS:  # ready / startup_error: the first HTTP process starts the others
            return [(0, None)], []
        rows, to_abort = self.detokenize(msg[1]) if self.processor is not None else (msg[1], [])
        if self.num_fronts == 1:
            return [(0, (ipc.OUTPUTS, rows, *msg[2:]))], to_abort
        by_front: dict[int, list] = {0: []}  # the first HTTP process keeps the metrics: it gets every step's stats
        for row in rows:
            by_front.setdefault(front_of(row[0]), []).append(row)
        return [(i, (ipc.OUTPUTS, rs, msg[2] if i == 0 else None)) for i, rs in by_front.items()], to_abort

    def detokenize(self, rows: list[list[Any]]) -> tuple[list[list[Any]], list[str]]:
        """Engine rows -> rows with the text delta appended (ipc.encode_outputs' order + text), and the ids
        of requests a stop string ended (to abort in the engine)."""
        states = self.processor.states
        known = [r for r in rows if r[0] in states]
        out = [r for r in rows if r[0] not in states]  # not ours (any more): passed through
        updated, to_abort = self.processor.process(ipc.decode_outputs(known))
        out += [[s.rid, s.delta_token_ids, s.finish_reason, s.stop_reason, s.delta_logprobs, s.num_cached_tokens,
                 s.delta_prompt_logprobs, s.delta_text] for s in updated]
        return out, to_abort


def serve(args: dict[str, Any] | None, front_in: str, front_outs: list[str], engine_in: str, engine_out: str) -> int:
    """Load the tokenizer (`args` None: route only), then relay until "shutdown" (0) or the parent is gone;
    1 if loading failed."""
    ctx = zmq.Context()

    def socket(kind: int, addr: str, bind: bool) -> zmq.Socket:
        s = ctx.socket(kind)
        s.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 2000)
        s.bind(addr) if bind else s.connect(addr)
        return s

    f_in, f_outs = socket(zmq.PULL, front_in, True), [socket(zmq.PUSH, a, False) for a in front_outs]
    e_in, e_out = socket(zmq.PUSH, engine_in, True), socket(zmq.PULL, engine_out, True)
    try:
        tok = None
        if args is not None:
            try:
                import ostinato.engine.engine_core  # noqa: F401 (ipc.decode_outputs' rows: loaded now, not at step 1)
                from ostinato.loader import load_model_source

                tok = load_model_source(args["model"], args["load_format"], args["trust_remote_code"],
                                        convert_gguf=False).tokenizer
            except Exception as e:
                logger.exception("detokenizer failed to load the tokenizer")
                f_outs[0].send(ipc.pack({"type": ipc.STARTUP_ERROR, "message": f"detokenizer: {e}"}))
                return 1
        return relay(Detokenizer(tok, len(f_outs)), f_in, f_outs, e_in, e_out)
    finally:
        for s in (f_in, *f_outs, e_in, e_out):
            s.close()
        ctx.term()


def relay(detok: Detokenizer, f_in: zmq.Socket, f_outs: list[zmq.Socket], e_in: zmq.Socket,
          e_out: zmq.Socket) -> int:
    parent = os.getppid()
    poller = zmq.Poller()
    poller.register(f_in, zmq.POLLIN)
    poller.register(e_out, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(1000))
        if not ready and os.getppid() != parent:
            logger.warning("parent process gone: detokenizer exits")
            return 0
        # engine outputs first: they are what the clients wait for
        while True:
            try:
                raw = e_out.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            sends, to_abort = detok.on_output(ipc.unpack(raw))
            for i, msg in sends:
                f_outs[i].send(raw if msg is None else ipc.pack(msg), zmq.NOBLOCK)
            if to_abort:
                e_in.send(ipc.pack((ipc.ABORT, to_abort)), zmq.NOBLOCK)
        while True:
            try:
                raw = f_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = ipc.unpack(raw)
            detok.on_input(msg)
            e_in.send(raw, zmq.NOBLOCK)
            if msg[0] == ipc.SHUTDOWN:
                return 0


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the HTTP process stops us
    die_with_parent()
    set_process_name("ostinato-detok")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description="Ostinato's detokenizer process (started by `ostinato serve`)")
    ap.add_argument("--args", default=None,
                    help="JSON: the EngineArgs fields model, load_format, trust_remote_code (none: route only)")
    ap.add_argument("--parent", type=int, required=True, help="pid of the HTTP process (exit if it is gone)")
    ap.add_argument("--front-in", required=True, help="address the HTTP processes send to (bound here)")
    ap.add_argument("--front-out", nargs="+", required=True, help="each HTTP process's output address, in order")
    ap.add_argument("--engine-in", required=True, help="address the engine core reads (bound here)")
    ap.add_argument("--engine-out", required=True, help="address the engine core writes (bound here)")
    ns = ap.parse_args()
    if os.getppid() != ns.parent:  # the parent died before PR_SET_PDEATHSIG took effect
        sys.exit(0)
    code = 1
    with contextlib.suppress(KeyboardInterrupt):
        code = serve(None if ns.args is None else json.loads(ns.args), ns.front_in, ns.front_out, ns.engine_in,
                     ns.engine_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
