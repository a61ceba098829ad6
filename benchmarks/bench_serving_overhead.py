"""Serving overhead: `ostinato serve` measured against the offline engine, same engine flags, same machine, one run.

The offline phase runs in a subprocess (so its memory is freed before the server starts): LLM.generate
on the prompts, timing (a) the decode step at batch 1, (t[max_tokens=N] - t[max_tokens=1]) / (N - 1) of one
request alone, median over --single-prompts requests; (b) for each --concurrency c > 1, all --num-prompts
requests at once with the scheduler capped at c running requests: output tokens / wall seconds. Then the
server is started with the same engine flags and bench_serving streams the same requests from
/v1/completions at request rate inf with at most c in flight. The issue's check: at concurrency 1 the
streamed TPOT is within 10% of the offline decode step at batch 1; at concurrency 64 the output throughput
is within 10% of the offline figure. Prompts: random token ids in [1000, min(10000, vocab - 1)), fixed
input and output lengths, greedy, ignore_eos.

CPU: python benchmarks/bench_serving_overhead.py --input-len 32 --output-len 16 --num-prompts 16 \\
         --concurrency 1 8 --single-prompts 2
GPU: python benchmarks/bench_serving_overhead.py --model llama-3.2-1b --load-format dummy --dtype bfloat16
     (the server takes its default HTTP process count, a quarter of the cores; to set it, add --server-args
     "--disable-uvicorn-access-log --api-server-count 4"; with
     --client-procs K the streaming client runs in K processes, each with 1/K of the streams, so that at high
     concurrency it, not the server, is not the limit; --api-server-counts 1 4: one online phase per count,
     after one offline phase)

Beside each row: the engine's steps, mean decode batch and busy fraction, and the CPU busy fraction of every
server process (HTTP processes, engine, detokenizer) and of this script's own streaming client (near 100%:
the client, not the server, is the limit).
"""

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import types

import httpx
import torch
from bench_serving import run, summarize
from common import RESULTS, device_tag, write_report


def engine_flags(args) -> list[str]:
    """The engine flags both phases run with (the server gets them on its command line)."""
    flags = (["--model", args.model] if args.model else []) + ["--load-format", args.load_format,
                                                              "--dtype", args.dtype,
                                                              "--max-running-requests", str(max(args.concurrency))]
    return flags + (["--skip-tokenizer-init"] if args.load_format == "dummy" else []) + shlex.split(args.extra_args)


def offline(args) -> dict:
    from ostinato import LLM, SamplingParams
    from ostinato.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    llm = LLM(**vars(EngineArgs.from_cli_args(parser.parse_args(engine_flags(args)))))
    device = llm.engine.runner.device
    rng = random.Random(0)
    hi = min(10000, llm.engine.runner.vocab_size - 1)
    prompts = [[rng.randrange(1000, hi) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    def timed(batch: list[list[int]], max_tokens: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    timed(prompts[:max(args.concurrency)], 4)  # warm-up
    timed(prompts[:1], args.output_len)
    core = llm.engine
    before, t0 = core_counts(core), time.perf_counter()
    steps = [(timed([p], args.output_len) - timed([p], 1)) / (args.output_len - 1)
             for p in prompts[:args.single_prompts]]
    engine = {1: engine_summary(before, core_counts(core), time.perf_counter() - t0)}
    tok_s = {}
    for c in (c for c in args.concurrency if c > 1):
        core.scheduler.max_running_requests = c  # a plain attribute the scheduler reads each step
        before = core_counts(core)
        elapsed = timed(prompts, args.output_len)
        tok_s[c] = args.num_prompts * args.output_len / elapsed
        engine[c] = engine_summary(before, core_counts(core), elapsed)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "device_tag": device_tag(device), "torch": torch.__version__, "prompts": prompts,
            "decode_step_ms": [1000 * s for s in steps], "output_tok_s": tok_s, "engine": engine}


def start_server(args, log) -> subprocess.Popen:
    url = f"http://127.0.0.1:{args.port}"
    try:
        httpx.get(url + "/health", timeout=2)
        sys.exit(f"bench_serving_overhead: something already answers on port {args.port}")
    except httpx.HTTPError:
        pass
    cmd = [sys.executable, "-m", "ostinato.entrypoints.cli", "serve", "--port", str(args.port), *engine_flags(args),
           *shlex.split(args.server_args)]
    print("starting:", shlex.join(cmd), f"(log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=False)
    wait_healthy(proc, url, log, args.server_timeout, "bench_serving_overhead")
    return proc


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float, who: str) -> float:
    """Seconds until the server at `url` answers /health; exits with its log's tail if it dies or times out."""
    t = time.perf_counter()
    while time.perf_counter() - t < timeout:
        if proc.poll() is not None:
            log.flush()
            with open(log.name) as f:
                tail = f.read()[-4000:]
            sys.exit(f"{who}: the server exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    sys.exit(f"{who}: the server was not healthy after {timeout} s (log: {log.name})")


def engine_counts(url: str) -> dict[str, float]:
    """The engine's cumulative step counters from the server's /metrics: {mode}_steps, _tokens, _seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"ostinato:engine_steps_total": "steps", "ostinato:engine_step_tokens_total": "tokens",
             "ostinato:engine_step_seconds_total": "seconds"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name in names:
                out[f"{s.labels['mode']}_{names[s.name]}"] = s.value
    return out


def core_counts(core) -> dict[str, float]:
    """The same counters, read off an in-process EngineCore."""
    return {f"{mode}_{key}": v for key, d in (("steps", core.step_counts), ("tokens", core.step_tokens),
                                              ("seconds", core.step_seconds)) for mode, v in d.items()}


def engine_summary(before: dict[str, float], after: dict[str, float], duration: float) -> dict[str, float]:
    """What the engine did during one run: the fraction of the run it spent in steps, and per mode the
    steps, their mean wall time and (decode) their mean batch."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    busy = d.get("extend_seconds", 0.0) + d.get("decode_seconds", 0.0)
    out = {"busy_fraction": busy / duration}
    for mode in ("extend", "decode"):
        n = d.get(f"{mode}_steps", 0.0)
        out[f"{mode}_steps"] = n
        out[f"{mode}_ms_per_step"] = 1000 * d.get(f"{mode}_seconds", 0.0) / max(n, 1.0)
        out[f"{mode}_tokens_per_step"] = d.get(f"{mode}_tokens", 0.0) / max(n, 1.0)
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of one process so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return out


def process_tree(pid: int) -> dict[str, int]:
    """The server's processes by role: "http" (the server itself), "ostinato-http<i>" (more HTTP processes),
    "engine", "detokenizer", "other-<pid>" (Linux /proc; only "http" elsewhere)."""
    procs, todo = {"http": pid}, [pid]
    while todo:
        for kid in _children(todo.pop()):
            try:
                with open(f"/proc/{kid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
                with open(f"/proc/{kid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            role = ("detokenizer" if "detok_proc" in cmd else comm if comm.startswith("ostinato-http")
                    else "engine" if "spawn_main" in cmd else "other")
            procs[role if role not in procs and role != "other" else f"{role}-{kid}"] = kid
            todo.append(kid)
    return procs


def cpu_by_process(procs: dict[str, int]) -> dict[str, float | None]:
    out = {name: cpu_seconds(pid) for name, pid in procs.items()}
    t = os.times()
    # this process and its finished client processes (--client-procs): the benchmark's own streaming client
    out["client"] = t.user + t.system + t.children_user + t.children_system
    return out


def _client_proc(ns, url: str, reqs: list, go, results) -> None:
    go.wait()
    try:
        results.put(asyncio.run(run(ns, url, float("inf"), reqs)))
    except BaseException as e:  # (bench_serving exits on a failed warm-up): the parent must not wait forever
        results.put(f"{type(e).__name__}: {e}")


def stream_all(ns, url: str, reqs: list, procs: int) -> tuple[list, float]:
    """bench_serving's client over `reqs`, in `procs` processes (forked: this process has not touched CUDA)
    that split the requests and the concurrency; the duration is the longest process's."""
    procs = max(1, min(procs, ns.max_concurrency, len(reqs)))
    if procs == 1:
        return asyncio.run(run(ns, url, float("inf"), reqs))
    import copy
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    go, results, kids = ctx.Event(), ctx.Queue(), []
    for i in range(procs):
        sub = copy.copy(ns)
        sub.max_concurrency = ns.max_concurrency // procs + (i < ns.max_concurrency % procs)
        kids.append(ctx.Process(target=_client_proc, args=(sub, url, reqs[i::procs], go, results)))
        kids[-1].start()
    go.set()
    got = [results.get() for _ in kids]
    for k in kids:
        k.join()
    failed = [g for g in got if isinstance(g, str)]
    if failed:
        sys.exit(f"bench_serving_overhead: a client process failed: {failed[0]}")
    return [r for rs, _ in got for r in rs], max(d for _, d in got)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def online(args, prompts: list[list[int]]) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    rows = {}
    with tempfile.NamedTemporaryFile("w", prefix="serving-overhead-", suffix=".log", delete=False) as log:
        proc = start_server(args, log)
        try:
            warm = [(p, 4) for p in prompts[:max(args.concurrency)]]
            ns = types.SimpleNamespace(max_concurrency=max(args.concurrency), seed=0, model=None, api_key=None,
                                       timeout=1800.0)
            asyncio.run(run(ns, url, float("inf"), warm))
            for c in args.concurrency:
                reqs = [(p, args.output_len) for p in prompts[:args.single_prompts if c == 1 else args.num_prompts]]
                ns.max_concurrency = c
                procs = process_tree(proc.pid)
                before, cpu0 = engine_counts(url), cpu_by_process(procs)
                results, duration = stream_all(ns, url, reqs, 1 if c == 1 else args.client_procs)
                cpu1 = cpu_by_process(procs)
                rows[c] = summarize(results, duration, float("inf"), c)
                rows[c]["engine"] = engine_summary(before, engine_counts(url), duration)
                # CPU busy fraction of each process over the run: the HTTP process (its children not counted),
                # the engine, the detokenizer (when the server has a tokenizer) and the benchmark's client.
                # Near 1.0 for the HTTP process means the front end, not the engine, sets the pace; near 1.0
                # for the client means the measurement itself is the limit.
                rows[c]["cpu_fraction"] = {k: None if cpu0[k] is None or cpu1[k] is None else
                                           (cpu1[k] - cpu0[k]) / duration for k in cpu0}
                rows[c]["http_process_cpu_fraction"] = rows[c]["cpu_fraction"]["http"]
                if rows[c]["failed"] or any(r.output_len != args.output_len for r in results):
                    sys.exit(f"bench_serving_overhead: requests failed at concurrency {c}: {rows[c]['errors']}")
        finally:
            stop_server(proc)
    return rows


def compare(args, off: dict, on: dict, count: int | None, variant: str | None = None) -> list[dict]:
    """Offline against online per concurrency (`count`: the server's HTTP processes, when --api-server-counts;
    `variant`: the label of a --server-variants entry)."""
    rows = []
    tag = ({} if count is None else {"api_server_count": count}) | ({} if variant is None else {"variant": variant})
    for c in args.concurrency:
        if c == 1:
            x, y = statistics.median(off["decode_step_ms"]), on[1]["tpot_ms"]["mean"]
            rows.append({**tag, "concurrency": 1, "offline_ms_per_token": x, "online_tpot_ms_mean": y,
                         "online_tpot_ms_p50": on[1]["tpot_ms"]["p50"], "ratio": y / x})
            rows[-1].update({"offline_engine": off["engine"]["1"], "online_engine": on[1]["engine"],
                             "online_http_process_cpu_fraction": on[1]["http_process_cpu_fraction"],
                             "online_cpu_fraction": on[1]["cpu_fraction"]})
        else:
            x, y = off["output_tok_s"][str(c)], on[c]["output_tok_s"]
            rows.append({**tag, "concurrency": c, "offline_output_tok_s": x, "online_output_tok_s": y,
                         "ratio": y / x,
                         "offline_engine": off["engine"][str(c)], "online_engine": on[c]["engine"],
                         "online_http_process_cpu_fraction": on[c]["http_process_cpu_fraction"],
                         "online_cpu_fraction": on[c]["cpu_fraction"]})
        # the check is one-sided: serving may not cost more than 10% (a faster server passes)
        rows[-1]["within_10pct"] = rows[-1]["ratio"] <= 1.10 if c == 1 else rows[-1]["ratio"] >= 0.90
    return rows


def print_rows(rows: list[dict]) -> None:
    def label(r: dict) -> str:
        n = " ".join(x for x in (f"N{r['api_server_count']}" if "api_server_count" in r else "",
                                 r.get("variant", "")) if x)
        return f"{n:>3} {r['concurrency']:>5}"

    print(f"\n{'conc':>9} {'metric':<18} {'offline':>10} {'online':>10} {'ratio':>7}  within 10%")
    for r in rows:
        metric, x, y = (("TPOT ms", r["offline_ms_per_token"], r["online_tpot_ms_mean"]) if r["concurrency"] == 1
                        else ("output tok/s", r["offline_output_tok_s"], r["online_output_tok_s"]))
        print(f"{label(r)} {metric:<18} {x:>10.2f} {y:>10.2f} {r['ratio']:>7.3f}  {r['within_10pct']}")
    for r in rows:
        for phase in ("offline", "online"):
            e = r[f"{phase}_engine"]
            print(f"{label(r)} engine {phase:<8} in steps {100 * e['busy_fraction']:5.1f}% of the run; "
                  f"{e['decode_steps']:.0f} decode steps of {e['decode_ms_per_step']:.3f} ms "
                  f"(mean batch {e['decode_tokens_per_step']:.1f}); {e['extend_steps']:.0f} extend steps of "
                  f"{e['extend_ms_per_step']:.2f} ms ({e['extend_tokens_per_step']:.0f} tokens)")
        cpu = {k: v for k, v in r["online_cpu_fraction"].items() if v is not None}
        print(f"{label(r)} CPU busy by process: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in cpu.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the engine's default model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=256, help="requests per concurrency > 1")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--single-prompts", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--server-timeout", type=float, default=300.0, help="seconds the server gets to become healthy")
    ap.add_argument("--extra-args", default="", help="more engine flags for both phases, e.g. '--page-size 16'")
    ap.add_argument("--server-args", default="--disable-uvicorn-access-log",
                    help="flags for `ostinato serve` only (default: no access-log line per request)")
    ap.add_argument("--api-server-counts", type=int, nargs="+", default=None,
                    help="run the online phase once per count, with --api-server-count N added to --server-args "
                         "(one offline phase for all)")
    ap.add_argument("--server-variants", nargs="+", default=None, metavar="LABEL=ARGS",
                    help="run the online phase once per variant (and per --api-server-counts entry), with ARGS "
                         "added to --server-args, e.g. mixed='--enable-mixed-chunk' (one offline phase for all)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="processes of the streaming client at concurrency > 1 (each runs 1/K of the streams)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving-overhead-<device>.json)")
    ap.add_argument("--phase", choices=["all", "offline"], default="all", help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    assert args.output_len > 1 and args.single_prompts <= args.num_prompts
    if args.phase == "offline":
        with open(args.phase_out, "w") as f:
            json.dump(offline(args), f)
        return

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "offline.json")
        if subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--phase", "offline",
                           "--phase-out", path]).returncode:
            sys.exit("bench_serving_overhead: the offline phase failed (its traceback is above)")
        with open(path) as f:
            off = json.load(f)
    counts = args.api_server_counts or [None]
    variants = [v.split("=", 1) for v in args.server_variants] if args.server_variants else [(None, "")]
    on_by, rows = {}, []
    server_args = args.server_args
    for count in counts:
        for label, extra in variants:
            args.server_args = " ".join(x for x in (server_args, extra) if x)
            if count is not None:
                args.server_args += f" --api-server-count {count}"
            key = " ".join(x for x in (f"N{count}" if count is not None else None, label) if x)
            on_by[key] = online(args, off["prompts"])
            rows += compare(args, off, on_by[key], count, label)
    args.server_args = server_args
    print_rows(rows)
    report = {"device": off["device"], "torch": off["torch"],
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "config": {k: v for k, v in vars(args).items() if not k.startswith("phase")},
              "engine_flags": engine_flags(args), "offline_decode_step_ms": off["decode_step_ms"],
              "offline_output_tok_s": off["output_tok_s"],
              "online": ({str(c): r for c, r in on_by[""].items()} if list(on_by) == [""] else
                         {key: {str(c): r for c, r in on.items()} for key, on in on_by.items()}),
              "comparison": rows}
    write_report(report, args.out or os.path.join(RESULTS, f"serving-overhead-{off['device_tag']}.json"))


if __name__ == "__main__":
    main()
