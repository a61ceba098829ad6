"""The detokenizer process (ostinato.engine.detok_proc): text deltas and stop strings out of the HTTP process,
and `--api-server-count`.

The transforms against the real SmolLM2 tokenizer (deltas concatenate to a full decode, stop strings end and
abort, rows it does not know pass through, rows routed to their HTTP process); the real process relaying
between fake front-end and engine sockets; a watched helper process's death failing requests as the engine's
does; and a real server with two HTTP processes through the `openai` client (streams, disconnects, metrics,
SIGTERM).
"""

import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from ostinato.engine import ipc  # noqa: E402
from ostinato.engine.detok_proc import Detokenizer  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402

TEXT = "The quick brown fox. héllo 世界 🙂 naïve café STOP after the stop, 日本語 👍🏽 more text"


@pytest.fixture(scope="module")
def tok():
    from ostinato.loader import load_model_source

    return load_model_source(None).tokenizer


def add(rid: str, **params) -> list:
    return [ipc.ADD, rid, [1, 2, 3], ipc.params_to_dict(SamplingParams(max_tokens=200, **params))]


def wire(msg):
    """What the other side of a socket sees (msgpack turns tuples into lists)."""
    return ipc.unpack(ipc.pack(msg))


def test_deltas_stop_strings_and_passthrough(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = Detokenizer(tok)
    d.on_input(wire(add("plain", logprobs=1)))
    d.on_input(wire(add("stop", stop=["STOP", "never"])))
    d.on_input(wire(add("gone")))
    d.on_input(wire([ipc.ABORT, ["gone"]]))  # the front end left: its rows pass through untouched from now on
    texts = {"plain": [], "stop": []}
    finished, aborted = {}, []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        lp = [-0.5, 1, [t], [-0.5]]
        rows = [["plain", [t], "length" if last else None, None, [lp], 2]]
        if "stop" not in finished:
            rows.append(["stop", [t], None, None, None, 0])
        rows.append(["gone", [t], None, None, None, 0])
        stats = {"running": 2}
        ((front, out),), to_abort = d.on_output(wire((ipc.OUTPUTS, rows, stats)))
        assert front == 0
        out = wire(out)
        assert out[0] == ipc.OUTPUTS and out[2] == stats
        by_rid = {r[0]: r for r in out[1]}
        assert by_rid["gone"] == ["gone", [t], None, None, None, 0]  # unknown: as the engine sent it
        plain = by_rid["plain"]
        assert plain[1] == [t] and plain[4] == [lp] and plain[5] == 2 and plain[6] is None and len(plain) == 8
        texts["plain"].append(plain[7])
        if plain[2] is not None:
            finished["plain"] = plain[2]
        if "stop" in by_rid:
            texts["stop"].append(by_rid["stop"][7])
            if by_rid["stop"][2] is not None:
                finished["stop"] = (by_rid["stop"][2], by_rid["stop"][3])
        aborted += to_abort
    assert "".join(texts["plain"]) == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert finished == {"plain": "length", "stop": ("stop", "STOP")}
    assert "".join(texts["stop"]) == TEXT[: TEXT.index("STOP")]
    assert aborted == ["stop"]  # ended by the stop string: the engine is told once
    assert d.processor.states == {}  # nothing left behind
    # the engine's acknowledgement of that abort passes through; a rejection forgets the request
    ((_, out),), to_abort = d.on_output(wire((ipc.OUTPUTS, [["stop", [], "abort", None, None, 0]], {})))
    assert out[1] == [["stop", [], "abort", None, None, 0]] and to_abort == []
    d.on_input(wire(add("bad")))
    assert d.on_output(wire([ipc.REJECTED, "bad", "prompt: too long"])) == ([(0, None)], [])
    assert d.processor.states == {}


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_routes_rows_to_their_http_process(tok, with_tokenizer):
    """Several HTTP processes: a request's rows go to the process its id names, the step's counts to the first
    only; a rejection to its owner, an engine failure to all. Without a tokenizer the rows pass untouched."""
    d = Detokenizer(tok if with_tokenizer else None, num_fronts=3)
    ids = tok.encode(" hello world", add_special_tokens=False)
    for rid in ("0:a-0", "2:b-0", "2:b-1"):
        d.on_input(wire(add(rid)))
    rows = [[rid, [ids[0]], None, None, None, 0] for rid in ("2:b-1", "0:a-0", "2:b-0")]
    sends, to_abort = d.on_output(wire((ipc.OUTPUTS, rows, {"running": 3})))
    got = {front: wire(msg) for front, msg in sends}
    assert sorted(got) == [0, 2] and to_abort == []
    assert got[0][2] == {"running": 3} and got[2][2] is None
    assert [r[0] for r in got[0][1]] == ["0:a-0"] and sorted(r[0] for r in got[2][1]) == ["2:b-0", "2:b-1"]
    text = tok.decode(ids[:1])
    for r in got[0][1] + got[2][1]:
        assert r[:4] == [r[0], [ids[0]], None, None] and not r[4] and r[5] == 0
        assert r[6:] == ([None, text] if with_tokenizer else [])  # (prompt logprobs: none asked for)
    # a step with rows for process 1 only still tells the first the counts
    sends, _ = d.on_output(wire((ipc.OUTPUTS, [["1:c-0", [5], "length", None, None, 0]], {"running": 0})))
    assert sorted(front for front, _ in sends) == [0, 1]
    assert d.on_output(wire([ipc.REJECTED, "2:b-0", "no"]))[0] == [(2, None)]
    assert d.on_output(wire([ipc.DEAD, "boom"]))[0] == [(0, None), (1, None), (2, None)]


def test_process_relays_both_ways(tok):
    """The real process between fake front-end and engine sockets: bytes forwarded, outputs detokenized, a stop
    string aborted in the engine, "shutdown" forwarded and the process gone."""
    tmp = tempfile.mkdtemp(prefix="ostinato-detok-test-")
    addrs = [f"ipc://{tmp}/{n}" for n in ("in", "out", "engine-in", "engine-out")]
    ctx = zmq.Context()
    front_in, front_out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    front_in.connect(addrs[0])
    front_out.bind(addrs[1])
    engine_in, engine_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    engine_in.connect(addrs[2])
    engine_out.connect(addrs[3])
    for s in (front_in, front_out, engine_in, engine_out):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 60_000)
    spec = '{"model": null, "load_format": "auto", "trust_remote_code": false}'
    proc = subprocess.Popen([sys.executable, "-m", "ostinato.engine.detok_proc", "--args", spec,
                             "--parent", str(os.getpid()), "--front-in", addrs[0], "--front-out", addrs[1],
                             "--engine-in", addrs[2], "--engine-out", addrs[3]])
    try:
        engine_out.send(ipc.pack({"type": ipc.READY, "pid": 1}))
        assert ipc.unpack(front_out.recv()) == {"type": ipc.READY, "pid": 1}
        raw = ipc.pack(add("r", stop=[" fox"]))
        front_in.send(raw)
        assert engine_in.recv() == raw
        ids = tok.encode("The quick brown fox jumps", add_special_tokens=False)
        text = ""
        for t in ids:
            engine_out.send(ipc.pack((ipc.OUTPUTS, [["r", [t], None, None, None, 0]], {})))
            (row,) = ipc.unpack(front_out.recv())[1]
            text += row[7]
            if row[2] is not None:
                break
        assert row[2:4] == ["stop", " fox"] and text == "The quick brown"
        assert ipc.unpack(engine_in.recv()) == [ipc.ABORT, ["r"]]
        front_in.send(ipc.pack((ipc.SHUTDOWN,)))
        assert ipc.unpack(engine_in.recv()) == [ipc.SHUTDOWN]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)


def gone(pids: list[int], timeout: float = 15.0) -> bool:
    from test_server_helpers import alive

    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def test_helper_process_death_fails_requests():
    """A watched process (the detokenizer, or for another HTTP process the engine) that exits fails every
    pending request and every later one with EngineDeadError naming it, as the engine's death does (the server
    then answers 503 and exits 1: tests/test_server_death.py)."""
    import asyncio

    from test_fair_share import make_client

    from ostinato.engine.async_client import EngineDeadError

    async def main() -> tuple[str | None, list]:
        client = make_client()
        dead = []
        client.hooks.on_dead = dead.append
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        client._watch(helper.pid, "detokenizer", helper.poll)
        gen = client.generate("r", [[1, 2, 3]], SamplingParams(max_tokens=4))
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        helper.kill()
        with pytest.raises(EngineDeadError, match="detokenizer"):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(EngineDeadError, match="detokenizer"):
            await client.generate("s", [[1]], SamplingParams(max_tokens=1)).__anext__()
        assert helper.poll() is not None  # reaped
        return client.dead, dead

    reason, dead = asyncio.run(main())
    assert "detokenizer process exited" in reason and dead == [reason]


def test_two_http_processes(tmp_path, tiny_llama_path):
    """--api-server-count 2 through the official client: concurrent streams complete with the right text and
    usage, streams left early are aborted (the KV pool and slots all come back), /metrics sums both
    processes, and SIGTERM ends every process with status 0."""
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from test_server_helpers import Server, children, metric

    server = Server(tmp_path / "server.log", [tiny_llama_path, "--api-server-count", "2"], threads=1)
    try:
        log = server.log()
        assert "4 processes: HTTP 0 (pid" in log and "HTTP 1 (pid" in log and "detokenizer (pid" in log, log
        assert "1 more HTTP processes ready" in log, log  # before the first one serves (and /health answers)
        kids = children(server.proc.pid)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompt = "Write a short poem about the sea."
        model = client.models.list().data[0].id
        reference = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0]

        def one(i: int) -> tuple[str, str | None, int | None]:
            # a stream left early asks for many tokens, so it cannot finish before its abort arrives (on a busy
            # machine a 12-token one sometimes did, and counted as a success)
            stream = client.completions.create(prompt=prompt, max_tokens=12 if i % 3 else 400, temperature=0,
                                               stream=True,
                                               stream_options={"include_usage": True}, model=model,
                                               extra_body={"ignore_eos": True})
            text, finish, used = "", None, None
            for k, chunk in enumerate(stream):
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
                if i % 3 == 0 and k == 2:
                    stream.close()  # the client goes away mid-stream
                    return "left", None, None
            return text, finish, used

        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(one, range(12)))
        done = [r for i, r in enumerate(results) if i % 3]
        assert all(r == (reference.text, "length", 12) for r in done), results
        # the aborted streams give everything back: no running request, every KV page and slot free
        deadline = time.monotonic() + 20
        while True:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            free = (metric(text, "ostinato:num_requests_running"), metric(text, "ostinato:kv_cache_free_pages"),
                    metric(text, "ostinato:req_slots_free"))
            if free[0] == 0 and free[1] == metric(text, "ostinato:kv_cache_total_pages") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert free[0] == 0 and free[1] == metric(text, "ostinato:kv_cache_total_pages"), text
        # finished requests of both processes, summed (the reference request and the 8 complete streams)
        assert metric(text, "ostinato:request_success_total") == 9, text
        assert server.stop() == 0, server.log()
        assert gone(kids), "a child process outlived the server"
        assert "server stopped" in server.log()
    finally:
        server.stop(timeout=10)


def test_listen_sockets_spread_connections_and_refuse_a_taken_port():
    """The HTTP processes' sockets (one SO_REUSEPORT group): a burst of connections reaches every socket, not
    just the first to accept; a second group on the same port (another server of ours) is refused by name."""
    import socket

    from ostinato.entrypoints.openai.api_workers import listen_sockets

    socks = listen_sockets("127.0.0.1", 0, 1)  # a free port, then the group on it
    port = socks[0].getsockname()[1]
    socks[0].close()
    socks = listen_sockets("127.0.0.1", port, 4)
    clients = []
    try:
        with pytest.raises(ValueError, match=f"port: cannot listen on 127.0.0.1:{port}"):
            listen_sockets("127.0.0.1", port, 2)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        counts = []
        for s in socks:
            s.setblocking(False)
            n = 0
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                n += 1
            counts.append(n)
        assert sum(counts) == 64 and min(counts) >= 4, counts  # P(a socket gets < 4 of 64 by hash) ~ 1e-5
    finally:
        for s in socks + clients:
            s.close()


def test_api_server_count_defaults_to_a_quarter_of_the_cores(monkeypatch):
    import argparse

    from ostinato.entrypoints.openai import cli_args

    for cores, want in ((2, 1), (7, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        ns = argparse.Namespace(api_server_count=None, max_request_body_bytes=1, max_n=1, max_choices_in_engine=None)
        cli_args.check_serve_args(ns)
        assert ns.api_server_count == want, cores
    ns = argparse.Namespace(api_server_count=3, max_request_body_bytes=1, max_n=1, max_choices_in_engine=None)
    cli_args.check_serve_args(ns)  # asked for: kept
    assert ns.api_server_count == 3
    ns.api_server_count = 0
    with pytest.raises(ValueError, match="--api-server-count must be >= 1"):
        cli_args.check_serve_args(ns)
