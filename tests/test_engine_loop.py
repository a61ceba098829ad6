"""The engine-core process's loop (engine/core_proc.EngineLoop) over real ZMQ sockets, with a stand-in core: the
deep KV leak check runs once the engine has been idle a while, never on the step that goes idle."""

import contextlib
import threading
import time
import types

import zmq

from ostinato.engine import core_proc, ipc
from ostinato.sampling_params import SamplingParams


class FakeCore:
    """Records the loop's calls; a request "runs" for one step."""

    def __init__(self) -> None:
        self.args = types.SimpleNamespace(disable_leak_check=False)
        self.pending = 0
        self.calls: list[tuple[str, float]] = []
        self.step_counts = self.step_tokens = self.step_seconds = {}

    def has_unfinished(self) -> bool:
        return self.pending > 0

    def add_request(self, rid, prompt_ids, params, mm=None) -> None:
        self.pending += 1

    def step(self) -> list:
        self.calls.append(("step", time.monotonic()))
        self.pending = 0
        return []

    def check_memory_leak(self, deep: bool = True) -> None:
        self.calls.append(("deep" if deep else "counts", time.monotonic()))


@contextlib.contextmanager
def running_loop(core):
    """core_proc.EngineLoop over `core` on a thread, between in-process ZMQ sockets: yields (send, recv), the
    front end's ends; sends SHUTDOWN at the end and checks the loop stopped."""
    ctx = zmq.Context()
    send, inp = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out, recv = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inp.bind("inproc://in")
    send.connect("inproc://in")
    recv.bind("inproc://out")
    out.connect("inproc://out")
    thread = threading.Thread(target=core_proc.EngineLoop(core, inp, out).run, daemon=True)
    thread.start()
    try:
        yield send, recv
    finally:
        send.send(ipc.pack((ipc.SHUTDOWN,)))
        thread.join(10)
        for sock in (send, inp, out, recv):
            sock.close(linger=0)
        ctx.term()
    assert not thread.is_alive()


def test_deep_leak_check_waits_for_idle(monkeypatch):
    monkeypatch.setattr(core_proc, "IDLE_CHECK_AFTER_MS", 300)
    monkeypatch.setattr(core_proc.EngineLoop, "stats", lambda self: {})
    core = FakeCore()
    with running_loop(core) as (send, _):
        add = (ipc.ADD, "r0", [1, 2, 3], ipc.params_to_dict(SamplingParams(max_tokens=1)))
        send.send(ipc.pack(add))
        deadline = time.monotonic() + 10
        while not any(c == "deep" for c, _ in core.calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        kinds = [c for c, _ in core.calls]
        assert kinds == ["step", "deep"], kinds
        # the check came IDLE_CHECK_AFTER_MS after the step that went idle, not on it
        assert core.calls[1][1] - core.calls[0][1] >= 0.29
        # a request arriving within the wait defers the check: it runs once, after the engine is idle again
        # (the second one comes 250 ms before the check would)
        send.send(ipc.pack(add))
        time.sleep(0.05)
        send.send(ipc.pack(add))
        deadline = time.monotonic() + 10
        while [c for c, _ in core.calls].count("deep") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c for c, _ in core.calls] == ["step", "deep", "step", "step", "deep"], core.calls
        time.sleep(0.5)
        assert [c for c, _ in core.calls].count("deep") == 2, "the check ran again with nothing new"


def test_sampling_params_survive_the_wire():
    """params_to_dict (shallow, not dataclasses.asdict) -> msgpack -> params_from_dict gives equal params."""
    import dataclasses

    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=-3, stop=["a", "bc"], stop_token_ids=[7, 9],
                       max_tokens=11, min_tokens=2, logprobs=3, ignore_eos=True)
    assert ipc.params_to_dict(p) == dataclasses.asdict(p)
    assert ipc.params_from_dict(ipc.unpack(ipc.pack(ipc.params_to_dict(p)))) == p


class CompilingCore(FakeCore):
    """Grammars compile slowly (on the loop's worker thread); "bad" ones do not compile."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[tuple[str, object, float]] = []

    def validate(self, prompt_ids, params) -> None:
        pass

    def compile_grammar(self, params):
        time.sleep(0.3)
        if params.structured_outputs.regex == "bad":
            raise ValueError("structured_outputs: the regex constraint does not compile: bad")
        return f"matcher<{params.structured_outputs.regex}>"

    def add_request(self, rid, prompt_ids, params, mm=None, grammar=None) -> None:
        self.added.append((rid, grammar, time.monotonic()))
        super().add_request(rid, prompt_ids, params, mm)

    def abort(self, rid) -> None:
        self.calls.append((f"abort {rid}", time.monotonic()))


def test_grammars_compile_off_the_loop(monkeypatch):
    """A request with structured outputs joins once its grammar is compiled, on a worker thread: a plain request
    sent after it is served meanwhile; a constraint that does not compile is rejected; one aborted while
    compiling never joins."""
    from ostinato.sampling_params import StructuredOutputsParams

    monkeypatch.setattr(core_proc.EngineLoop, "stats", lambda self: {})
    core = CompilingCore()
    with running_loop(core) as (send, recv):

        def add(rid: str, regex: str | None) -> None:
            so = StructuredOutputsParams(regex=regex) if regex else None
            send.send(ipc.pack((ipc.ADD, rid, [1, 2], ipc.params_to_dict(SamplingParams(max_tokens=1,
                                                                                      structured_outputs=so)))))

        t0 = time.monotonic()
        add("slow", "[0-9]+")
        add("plain", None)
        add("bad", "bad")
        add("gone", "[a-z]")
        send.send(ipc.pack((ipc.ABORT, ["gone"])))
        deadline = time.monotonic() + 10
        while len(core.added) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        rejected = []
        while recv.poll(2000):
            msg = ipc.unpack(recv.recv())
            if msg[0] == ipc.REJECTED:
                rejected.append(msg[1:])
                break
        time.sleep(0.5)  # "gone" would have compiled by now
        names = [(rid, g) for rid, g, _ in core.added]
        assert names == [("plain", None), ("slow", "matcher<[0-9]+>")], names
        assert core.added[0][2] - t0 < 0.25 <= core.added[1][2] - t0  # plain did not wait for the compile
        assert rejected == [["bad", "structured_outputs: the regex constraint does not compile: bad"]]
