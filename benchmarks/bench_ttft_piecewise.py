"""TTFT through `ostinato serve`, piecewise graphs on vs off: one server per variant, in sequence, each
measured by bench_serving's client at every --concurrency, then one table.

Prompts: --num-prompts random token-id prompts of --input-len MIN MAX tokens (uniform, seed 0, the same
for every variant), --output-len outputs each (ignore_eos), all sent at once with at most c in flight.
Before each measured run the server sees --warmup-prompts of the same lengths (lazy inits, autotuning).
Variants are NAME:FLAGS (engine flags of that server); the default compares

  off        the engine's defaults (full extend graphs up to 2048 tokens, else eager)
  pw         + piecewise graphs (inductor pieces): they take what the full graph cannot run
  eager      no extend graphs at all (--extend-cuda-graph-max-tokens 0)
  pw-only    piecewise graphs alone (no full extend graph): piecewise against eager, step for step

GPU (~3 min on an H200; the server needs fastapi/uvicorn/pydantic and the client aiohttp, carried as wheels):
  python benchmarks/bench_ttft_piecewise.py --model llama-3.2-1b --load-format dummy --dtype bfloat16
CPU smoke (SmolLM2):
  python benchmarks/bench_ttft_piecewise.py --input-len 32 128 --output-len 4 4 --num-prompts 4 \\
      --concurrency 1 2 --warmup-prompts 2 --variants "off:" "pw:--enable-piecewise-cuda-graph" --out /tmp/ttft.json
"""

import argparse
import asyncio
import os
import random
import shlex
import subprocess
import sys
import tempfile
import types

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import run, summarize  # noqa: E402
from bench_serving_overhead import stop_server, wait_healthy  # noqa: E402
from common import RESULTS, add_model_args, device_tag, write_report  # noqa: E402

PW = "--enable-piecewise-cuda-graph --piecewise-cuda-graph-compiler inductor"
DEFAULT_VARIANTS = ["off:", f"pw:{PW}", "eager:--extend-cuda-graph-max-tokens 0",
                    f"pw-only:{PW} --extend-cuda-graph-max-tokens 0"]


def start_server(cmd: list[str], url: str, log, timeout: float) -> tuple[subprocess.Popen, float]:
    """Start `cmd` and wait for /health; returns the process and the seconds it took to become healthy."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, wait_healthy(proc, url, log, timeout, "bench_ttft_piecewise")


def startup_lines(log_path: str) -> list[str]:
    """The server log's start-up summary lines (capture times, piecewise split and compile)."""
    keys = ("captured", "piecewise", "KV pool", "model ")
    with open(log_path, errors="replace") as f:
        return [line.rstrip() for line in f if any(k in line for k in keys)][:12]


def bench_variant(args, name: str, flags: str, requests: list, warm: list) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    try:
        httpx.get(url + "/health", timeout=2)
        sys.exit(f"bench_ttft_piecewise: something already answers on port {args.port}")
    except httpx.HTTPError:
        pass
    common = (["--model", args.model] if args.model else []) + ["--load-format", args.load_format, "--dtype",
                                                                 args.dtype]
    if args.load_format == "dummy":
        common.append("--skip-tokenizer-init")
    cmd = [sys.executable, "-m", "ostinato.entrypoints.cli", "serve", "--port", str(args.port),
           "--disable-uvicorn-access-log", *common, *shlex.split(args.engine_args), *shlex.split(flags)]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    rows = []
    with tempfile.NamedTemporaryFile("w", prefix=f"ttft-{name}-", suffix=".log", delete=False) as log:
        proc, ready_s = start_server(cmd, url, log, args.server_timeout)
        try:
            ns = types.SimpleNamespace(max_concurrency=max(args.concurrency), seed=args.seed, model=None,
                                       api_key=None, timeout=600.0)
            asyncio.run(run(ns, url, float("inf"), warm))
            for c in args.concurrency:
                ns.max_concurrency = c
                results, duration = asyncio.run(run(ns, url, float("inf"), requests))
                row = summarize(results, duration, float("inf"), c)
                if row["failed"]:
                    sys.exit(f"bench_ttft_piecewise: {row['failed']} requests failed ({name}, c={c}): {row['errors']}")
                rows.append({"variant": name, "flags": flags, "concurrency": c, "server_ready_s": ready_s, **row})
                print(f"[{name}] c={c}: TTFT mean {row['ttft_ms']['mean']:.1f} p50 {row['ttft_ms']['p50']:.1f} "
                      f"p99 {row['ttft_ms']['p99']:.1f} ms", flush=True)
        finally:
            stop_server(proc)
        for line in startup_lines(log.name):
            print(f"[{name}]   {line}")
        rows[0]["startup_log"] = startup_lines(log.name)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--engine-args", default="", help="engine flags for every server")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="NAME:FLAGS, one server each")
    ap.add_argument("--input-len", type=int, nargs=2, default=[128, 2048], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 16], metavar=("MIN", "MAX"))
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--warmup-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--id-range", type=int, nargs=2, default=[1000, 10000], metavar=("LOW", "HIGH"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8125)
    ap.add_argument("--server-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ttft-piecewise.json)")
    args = ap.parse_args()

    rng = random.Random(args.seed)

    def draw(n: int) -> list:
        return [([rng.randrange(*args.id_range) for _ in range(rng.randint(*args.input_len))],
                 rng.randint(*args.output_len)) for _ in range(n)]

    warm, requests = draw(args.warmup_prompts), draw(args.num_prompts)
    rows = []
    for v in args.variants:
        name, _, flags = v.partition(":")
        rows += bench_variant(args, name, flags, requests, warm)

    print(f"\n{'variant':<10} {'conc':>4} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'ITL p50':>8} {'out tok/s':>10} "
          f"{'ready s':>8}   (ms; prompts {args.input_len[0]}-{args.input_len[1]} tokens)")
    for r in rows:
        t = r["ttft_ms"]
        print(f"{r['variant']:<10} {r['concurrency']:>4} {t['mean']:>10.1f} {t['p50']:>8.1f} {t['p99']:>8.1f} "
              f"{r['itl_ms']['p50']:>8.2f} {r['output_tok_s']:>10.1f} {r['server_ready_s']:>8.1f}")
    import torch  # (already imported by bench_serving_overhead) the client's host: the servers ran beside it

    cuda = torch.cuda.is_available()
    report = {"device": device_tag(torch.device("cuda")) if cuda else "cpu", "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "config": vars(args), "rows": rows}
    write_report(report, args.out or os.path.join(RESULTS, "ttft-piecewise.json"))


if __name__ == "__main__":
    main()
