"""The HTTP front end alone: the real `ostinato serve` process(es) (and the detokenizer process) against a fake
engine core that emits one token per running request every --step-ms (no model), driven by many concurrent
streaming clients. Reports delivered output tok/s and the CPU seconds of every server process, per process and
per delivered token: the front end's cost per token, which is what bounds serving at high concurrency.
It runs on a CPU machine (say so when quoting its figures: they are CPU figures, not the GPU server's).

python benchmarks/bench_frontend.py --concurrency 64 256 --api-server-count 1 2
    --tokenizer: the detokenizer process decodes text (the default model's tokenizer); default: token ids only
    (--skip-tokenizer-init, as bench_serving_overhead's dummy runs). --py-spy DIR: collapsed stacks (py-spy's
    raw format, for flamegraph.pl or speedscope) of every HTTP and detokenizer process during the last
    concurrency's run, if py-spy is installed and may attach.

Its figures are noisy on a small shared machine: the CPU per token falls as a lagging server merges more
tokens per SSE chunk (the tokens/chunk column), so compare runs at equal tokens per chunk, or by profile.

The fake engine never waits for the front end (as the real one): a front end that cannot keep up falls behind,
and its delivered tok/s falls short of concurrency x 1000 / step_ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------- the fake engine core
def fake_engine_core(args: dict, input_addr: str, output_addr: str) -> None:
    """Stands in for core_proc.run_engine_core: same sockets and messages, one token per request per step."""
    import zmq

    from ostinato.engine import ipc
    from ostinato.proc_util import die_with_parent

    die_with_parent()
    step_s = float(os.environ.get("FAKE_STEP_MS", "2")) / 1000
    ctx, inp, out = ipc.engine_sockets(input_addr, output_addr, linger_ms=0)
    out.send(ipc.pack({"type": ipc.READY, "pid": os.getpid(), "vocab_size": 32000, "max_model_len": 4096,
                       "max_total_tokens": 1 << 20, "page_size": 16, "max_running_requests": 1024,
                       "device": "fake", "dtype": "none"}))
    running: dict[str, list] = {}  # rid -> [tokens left, tokens so far, prompt length]
    steps = tokens = 0
    busy = 0.0
    parent = os.getppid()
    next_step = time.perf_counter()
    while True:
        if not running:
            if not inp.poll(1000):
                if os.getppid() != parent:
                    return
                continue
            next_step = time.perf_counter()
        while True:  # drain the front end's messages
            try:
                msg = ipc.unpack(inp.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if msg[0] == ipc.ADD:
                running[msg[1]] = [msg[3]["max_tokens"], 0, len(msg[2])]
            elif msg[0] == ipc.ABORT:
                for rid in msg[1]:
                    if running.pop(rid, None) is not None:
                        out.send(ipc.pack((ipc.OUTPUTS, [[rid, [], "abort", None, None, 0]], None)))
            elif msg[0] == ipc.SHUTDOWN:
                out.close()
                inp.close()
                ctx.term()
                return
        if not running:
            continue
        rows = []
        for rid, st in list(running.items()):
            st[0] -= 1
            st[1] += 1
            tok = 1000 + (st[1] * 7919 + len(rid)) % 20000
            finish = "length" if st[0] <= 0 else None
            rows.append([rid, [tok], finish, None, None, 0 if st[1] == 1 else None])
            if finish:
                del running[rid]
        steps += 1
        tokens += len(rows)
        busy += step_s
        stats = {"running": len(running), "waiting": 0, "kv_free_pages": 1000, "kv_total_pages": 1000,
                 "req_slots_free": 1024 - len(running), "req_slots_total": 1024, "num_retractions": 0,
                 "decode_steps": steps, "decode_tokens": tokens, "decode_seconds": busy,
                 "extend_steps": 0, "extend_tokens": 0, "extend_seconds": 0.0}
        out.send(ipc.pack((ipc.OUTPUTS, rows, stats)), zmq.NOBLOCK)
        next_step += step_s
        delay = next_step - time.perf_counter()
        if delay > 0:
            inp.poll(delay * 1000)  # wakes early on a new request: it joins the next step
            time.sleep(max(0.0, next_step - time.perf_counter()))
        elif delay < -step_s:
            next_step = time.perf_counter()


def serve_fake(argv: list[str]) -> int:
    """`ostinato serve argv...` with the fake engine core in place of the real one."""
    import logging

    from ostinato.engine import async_client
    from ostinato.entrypoints import cli

    async_client.run_engine_core = fake_engine_core
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return cli.main(["serve", *argv])


# ---------------------------------------------------------------------------- measuring
def server_processes(log_path: str, count: int, timeout: float = 300.0) -> dict[int, str]:
    """pid -> role ("http0".., "engine", "detokenizer") from the server's start-up log line, once every HTTP
    process logged that it serves (uvicorn's "Started server process")."""
    t = time.time()
    while time.time() - t < timeout:
        with open(log_path) as f:
            text = f.read()
        line = next((ln for ln in text.splitlines() if " processes: " in ln and "(pid " in ln), None)
        if line is not None and text.count("Started server process") >= count:
            procs = {}
            for name, pid in re.findall(r"([A-Za-z ]+?\d*) \(pid (\d+)\)", line.split(" processes: ", 1)[1]):
                name = name.strip().lower()
                role = ("http" + (name.split()[1] if " " in name else "0") if name.startswith("http")
                        else "engine" if name.startswith("engine") else "detokenizer")
                procs[int(pid)] = role
            return procs
        time.sleep(0.3)
    sys.exit(f"bench_frontend: not every HTTP process started (log {log_path})")


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


async def stream(http, url: str, prompt: list[int], max_tokens: int) -> tuple[int, int]:
    """One streaming completion -> (the completion tokens its usage chunk reports (-1 on failure), SSE chunks)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return -1, 0
        n, chunks = -1, 0
        async for raw in r.content:
            if raw.startswith(b"data: {"):
                chunks += 1
                if b'"usage"' in raw:
                    n = json.loads(raw[6:])["usage"]["completion_tokens"]
        return n, chunks


async def drive(url: str, concurrency: int, num_requests: int, output_len: int) -> tuple[int, int, int, float]:
    """-> (tokens delivered, SSE chunks, failed requests, seconds)"""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one(i: int) -> tuple[int, int]:
            async with sem:
                return await stream(http, url, [1 + i % 100, 2, 3, 4], output_len)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(i) for i in range(num_requests)))
        dt = time.perf_counter() - t0
    return sum(n for n, _ in got if n > 0), sum(k for _, k in got), sum(n != output_len for n, _ in got), dt


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    import urllib.request

    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            sys.exit(f"bench_frontend: the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    sys.exit("bench_frontend: the server did not become healthy")


def run_one(args, count: int) -> list[dict]:
    url = f"http://127.0.0.1:{args.port}"
    flags = ["--port", str(args.port), "--disable-uvicorn-access-log", "--api-server-count", str(count)]
    flags += [] if args.tokenizer else ["--load-format", "dummy", "--skip-tokenizer-init"]
    env = {**os.environ, "FAKE_STEP_MS": str(args.step_ms)}
    log = tempfile.NamedTemporaryFile("w", prefix="bench-frontend-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *flags], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_healthy(proc, url)
        t = time.perf_counter()
        log.flush()
        procs = server_processes(log.name, count)
        print(f"N={count}: every HTTP process serves {time.perf_counter() - t:.1f} s after /health answered")
        asyncio.run(drive(url, 8, 8, 4))  # warm-up
        for c in args.concurrency:
            n = max(c, int(args.requests_per_stream * c))
            spy = []
            if args.py_spy and c == args.concurrency[-1]:
                os.makedirs(args.py_spy, exist_ok=True)
                for pid, name in procs.items():
                    if name.startswith(("http", "detok")):
                        out = os.path.join(args.py_spy, f"n{count}-c{c}-{name}-{pid}.txt")
                        spy.append(subprocess.Popen(["py-spy", "record", "-r", "200", "-f", "raw", "-o", out, "-p",
                                                     str(pid), "-d", str(args.py_spy_seconds), "--nonblocking"],
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            cpu0 = {p: cpu_seconds(p) for p in procs}
            own0 = os.times()
            tokens, chunks, bad, dt = asyncio.run(drive(url, c, n, args.output_len))
            own1 = os.times()
            cpu = {f"{name}:{p}": cpu_seconds(p) - cpu0[p] for p, name in procs.items()}
            cpu["client"] = own1.user + own1.system - own0.user - own0.system
            for s in spy:
                s.wait()
            server = sum(v for k, v in cpu.items() if k.startswith(("http", "detok")))
            row = {"api_server_count": count, "concurrency": c, "requests": n, "failed": bad,
                   "output_tok_s": tokens / dt, "demand_tok_s": c * 1000 / args.step_ms, "seconds": dt,
                   "cpu_s": cpu, "cpu_fraction": {k: v / dt for k, v in cpu.items()},
                   "server_cpu_us_per_token": 1e6 * server / max(tokens, 1), "chunks": chunks,
                   "tokens_per_chunk": tokens / max(chunks, 1)}
            rows.append(row)
            busy = ", ".join(f"{k.split(':')[0]} {v / dt:.2f}" for k, v in cpu.items() if v > 0.01 * dt)
            print(f"N={count} c={c:>4}: {row['output_tok_s']:>9.0f} tok/s (fake engine offers "
                  f"{row['demand_tok_s']:.0f}), server CPU {row['server_cpu_us_per_token']:.1f} us/token "
                  f"({row['tokens_per_chunk']:.2f} tokens/chunk);"
                  f" busy: {busy}{'; FAILED ' + str(bad) if bad else ''}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if proc.returncode not in (0, -15):
            print(f"(server exit {proc.returncode}; log {log.name})")
        else:
            os.unlink(log.name)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.path.insert(0, os.path.dirname(HERE))
        sys.exit(serve_fake(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--api-server-count", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-stream", type=float, default=2.0, help="requests per concurrency slot")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the fake engine's step time")
    ap.add_argument("--tokenizer", action="store_true", help="text deltas through the detokenizer process")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--py-spy", default=None, metavar="DIR", help="flame graphs of the last concurrency's run")
    ap.add_argument("--py-spy-seconds", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args()
    if args.py_spy and shutil.which("py-spy") is None:
        sys.exit("bench_frontend: py-spy is not installed")
    rows = [r for count in args.api_server_count for r in run_one(args, count)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": "cpu", "cpus": os.cpu_count(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
