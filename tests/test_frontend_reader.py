"""The HTTP process's side of the engine link without an engine: the output socket's event-loop reader (bursts
longer than one drain call arrive complete and in order, a stream of several requests is routed by id), and
the first HTTP process's wait for the others to serve (a process that exits before it serves is named)."""

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import tempfile

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from ostinato.config import EngineArgs  # noqa: E402
from ostinato.engine import ipc  # noqa: E402
from ostinato.engine.async_client import AsyncEngineClient, EngineInfo  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402

INFO = EngineInfo(pid=0, vocab_size=1000, max_model_len=4096, max_total_tokens=1 << 16, page_size=16,
                  max_running_requests=64, device="cpu", dtype="float32")


def test_reader_delivers_bursts_in_order():
    """Three requests; the fake engine pushes 3 x 150 step messages at once (more than one drain call takes),
    with random tokens, one request at a time per message and all three interleaved: every request gets
    exactly its own tokens, in order, then its finish."""
    import random

    rng = random.Random(os.getpid())
    tmp = tempfile.mkdtemp(prefix="ostinato-reader-test-")
    in_addr, out_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx = zmq.Context()
    engine_in, engine_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (engine_in, engine_out):
        s.setsockopt(zmq.LINGER, 0)
    engine_in.bind(in_addr)
    engine_in.setsockopt(zmq.RCVTIMEO, 10_000)

    async def main() -> tuple[dict, dict]:
        client = await AsyncEngineClient.connect(EngineArgs(skip_tokenizer_init=True), None, INFO,
                                                 (in_addr, out_addr), {}, 0, 1)
        engine_out.connect(out_addr)
        gens = {name: client.generate(name, [[1, 2, 3]], SamplingParams(max_tokens=150)) for name in "abc"}
        firsts = {name: asyncio.ensure_future(g.__anext__()) for name, g in gens.items()}
        await asyncio.sleep(0)  # the generators send their adds
        rids = sorted(await asyncio.to_thread(lambda: [ipc.unpack(engine_in.recv())[1] for _ in range(3)]))
        assert rids == ["a-0", "b-0", "c-0"]
        want = {rid: [rng.randrange(1000) for _ in range(150)] for rid in rids}
        for k in range(150):
            for rid in rng.sample(rids, 3):
                row = [rid, [want[rid][k]], "length" if k == 149 else None, None, None, 0 if k == 0 else None]
                engine_out.send(ipc.pack((ipc.OUTPUTS, [row], {})))
        got = {}
        for name, gen in gens.items():
            ids, finish = [], None
            d = await asyncio.wait_for(firsts[name], 10)
            while True:
                ids += d.token_ids
                finish = d.finish_reason
                if finish is not None:
                    break
                d = await asyncio.wait_for(gen.__anext__(), 10)
            got[f"{name}-0"] = (ids, finish)
            await gen.aclose()
        await client.shutdown()
        return got, want

    try:
        got, want = asyncio.run(main())
        assert got == {rid: (ids, "length") for rid, ids in want.items()}
    finally:
        ctx.destroy(linger=0)


def _serves(conn) -> None:
    conn.send(True)
    conn.recv()  # "go"
    conn.send("went")


def test_wait_ready_then_go_and_a_process_that_exits_first():
    """The first HTTP process's start-up gate: it waits for every other to be ready, then lets them all go;
    one that exits before it is ready, or is still starting past the timeout, is named."""
    from ostinato.entrypoints.openai.api_workers import Workers, recv

    ctx = multiprocessing.get_context("fork")

    def start(target) -> tuple:
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=target, args=(theirs,))
        p.start()
        theirs.close()
        return p, ours

    def exits(conn) -> None:
        os._exit(3)

    async def gate(workers: Workers, timeout: float = 30.0) -> None:
        await workers.wait_ready(timeout)

    good = [start(_serves) for _ in range(2)]
    pipes = [r for _, r in good]
    workers = Workers([p for p, _ in good], list(pipes))
    asyncio.run(gate(workers))
    dups = [  # (go() closes our ends: the answers are read through duplicates)
        multiprocessing.connection.Connection(os.dup(r.fileno())) for r in pipes]
    workers.go()
    assert [d.recv() for d in dups] == ["went", "went"]
    bad = [start(_serves), start(exits)]
    with pytest.raises(RuntimeError, match=rf"HTTP process {bad[1][0].pid} exited during start-up \(exit code 3\)"):
        asyncio.run(gate(Workers([p for p, _ in bad], [r for _, r in bad])))
    stuck = [start(lambda conn: __import__("time").sleep(30))]
    with pytest.raises(RuntimeError, match="did not start in"):
        asyncio.run(gate(Workers([p for p, _ in stuck], [r for _, r in stuck]), timeout=0.5))
    # a process waiting for "go" whose pipe closes sees EOFError (and exits): the first gave up starting
    ours, theirs = ctx.Pipe()
    ours.close()
    with pytest.raises(EOFError):
        asyncio.run(asyncio.wait_for(recv(theirs), 10))
    for p, _ in good + bad + stuck:
        p.kill()
        p.join()
    for d in dups:
        d.close()


def test_http_process_imports_no_model_code():
    """An HTTP process (without a tokenizer) loads neither torch nor transformers: extra HTTP processes start in a
    few seconds, and each holds no copy of them."""
    import subprocess
    import sys

    code = ("import sys, ostinato.entrypoints.openai.api_server, ostinato.entrypoints.openai.api_workers; "
            "print(sorted(m for m in ('torch', 'transformers', 'ostinato.runner.model_runner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
