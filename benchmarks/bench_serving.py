"""Online serving benchmark against a running OpenAI-compatible server (`ostinato serve`, or any other).

Random token-id prompts (so no tokenizer is needed here), random output lengths forced with the
`ignore_eos` extra field, streamed from /v1/completions; arrivals are Poisson at each --request-rate
(`inf`: all at once), optionally capped by --max-concurrency. Reports request throughput, output tok/s,
TTFT / TPOT / ITL / end-to-end latency (mean, p50, p99), writes JSON under benchmarks/results/ and a
PNG plot when matplotlib is installed. Streams with aiohttp (the faster client: with httpx the client
itself capped a stub server at 76% of our offline figure); no openai package, no internet.

  ostinato serve &    # or, on a GPU: ostinato serve --model qwen3-0.6b --load-format dummy --skip-tokenizer-init
  python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --num-prompts 64 --request-rate 2 8 inf \\
      --input-len 32 256 --output-len 32 128
"""

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import httpx


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_requests(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    lo, hi = args.input_len
    olo, ohi = args.output_len
    return [([rng.randrange(args.id_range[0], args.id_range[1]) for _ in range(rng.randint(lo, hi))],
             rng.randint(olo, ohi)) for _ in range(args.num_prompts)]


async def one_request(http: aiohttp.ClientSession, url: str, model: str | None, prompt: list[int],
                      max_tokens: int) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    res = Result(False, len(prompt))
    res.start = t0 = last = time.perf_counter()
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return res
            async for raw in r.content:  # one SSE line at a time
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                # A chunk with a choice, no usage and no error is only timed, not parsed: at 64+ streams this
                # client's JSON parsing was a large part of its own CPU (near 100%: it, not the server, set the
                # pace). A JSON string holds no bare quote, so these keys can only match the chunk's own keys.
                if b'"choices": [{' in raw and b'"usage"' not in raw and b'"error"' not in raw:
                    chunk = None
                else:
                    chunk = json.loads(raw[6:])
                    if "error" in chunk:
                        res.error = chunk["error"].get("message", "error")
                        return res
                now = time.perf_counter()
                if chunk is None or chunk.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk is not None and chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - t0
        res.ok = res.ttft > 0.0
        if not res.ok:
            res.error = "no tokens streamed"
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args, url: str, rate: float, requests: list[tuple[list[int], int]]) -> tuple[list[Result], float]:
    limit = args.max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(args.seed + 1)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=limit + 4)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as http:
        warm = await one_request(http, url, args.model, requests[0][0][:8], 4)
        if not warm.ok:
            sys.exit(f"bench_serving: warm-up request failed: {warm.error}")

        async def limited(prompt: list[int], n: int) -> Result:
            async with sem:
                return await one_request(http, url, args.model, prompt, n)

        tasks = []
        t0 = time.perf_counter()
        for prompt, n in requests:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float, rate: float, concurrency: int | None) -> dict:
    ok = [r for r in results if r.ok]

    def stats(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
        s = sorted(xs)
        pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
        return {"mean": 1000 * statistics.fmean(s), "p50": 1000 * pick(0.5), "p99": 1000 * pick(0.99)}

    out_tokens = sum(r.output_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": concurrency,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for r in ok for x in r.itl]), "e2e_ms": stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def print_table(rows: list[dict]) -> None:
    head = (f"{'rate':>6} {'conc':>5} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} "
            f"{'TTFT mean/p50/p99 ms':>24} {'TPOT mean/p50/p99 ms':>24} {'ITL mean/p50/p99 ms':>24}")
    print(head)
    fmt = lambda d: f"{d['mean']:.1f}/{d['p50']:.1f}/{d['p99']:.1f}"  # noqa: E731
    for r in rows:
        print(f"{r['request_rate']!s:>6} {r['max_concurrency'] or '-'!s:>5} {r['completed']:>5} {r['failed']:>4} "
              f"{r['request_throughput']:>7.2f} {r['output_tok_s']:>9.1f} {fmt(r['ttft_ms']):>24} "
              f"{fmt(r['tpot_ms']):>24} {fmt(r['itl_ms']):>24}")


def plot(rows: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return False
    labels = [str(r["request_rate"]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = range(len(rows))
    for key, ax, name in (("ttft_ms", axes[0], "TTFT (ms)"), ("tpot_ms", axes[1], "TPOT (ms)")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][q] for r in rows], style, label=q)
        ax.set_title(name)
        ax.legend()
    axes[2].plot(x, [r["output_tok_s"] for r in rows], "o-")
    axes[2].set_title("output tokens / s")
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                    help="Poisson arrival rates in requests/s; inf sends all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--id-range", type=int, nargs=2, default=[1000, 10000], metavar=("LOW", "HIGH"),
                    help="prompt token ids are drawn from [LOW, HIGH)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout (s)")
    ap.add_argument("--label", default="", help="free text stored in the JSON (device, build, ...)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving-<time>.json)")
    args = ap.parse_args()

    url = args.url.rstrip("/")
    try:
        models = httpx.get(url + "/v1/models", timeout=30,
                           headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
    except (httpx.HTTPError, ValueError) as e:
        sys.exit(f"bench_serving: cannot reach {url}: {e}")
    model = args.model or models["data"][0]["id"]
    requests = make_requests(args)
    rows = []
    for rate in args.request_rate:
        results, duration = asyncio.run(run(args, url, rate, requests))
        rows.append(summarize(results, duration, rate, args.max_concurrency))
        print_table(rows[-1:])
    print()
    print_table(rows)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"serving-{stamp}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    report = {"command": " ".join(sys.argv), "url": url, "model": model, "server_models": models.get("data"),
              "label": args.label, "client_host": platform.node(), "time": stamp,
              "config": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
              "runs": rows}
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {path}")
    png = os.path.splitext(path)[0] + ".png"
    if plot(rows, png, f"{model} @ {url} {args.label}".strip()):
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
