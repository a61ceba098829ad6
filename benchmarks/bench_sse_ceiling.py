"""The streaming harness's own ceiling: bench_serving's client against a stub server on the same HTTP
stack as `ostinato serve` (FastAPI + uvicorn, one JSON chunk per token) that streams every token at once,
with no engine behind it. Output tok/s here bounds what any server can show through this client on this
machine, so a serving figure near it is limited by the client / HTTP per-chunk cost, not by the engine.

python benchmarks/bench_sse_ceiling.py --concurrency 64 --num-prompts 256 --output-len 128
"""

import argparse
import asyncio
import json
import subprocess
import sys
import time
import types

import httpx
from bench_serving import run, summarize

STUB = r'''
import asyncio, json, sys
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

app = FastAPI()

@app.get("/health")
async def health():
    return {}

@app.post("/v1/completions")
async def completions(req: Request):
    n = (await req.json())["max_tokens"]

    async def chunks():
        for _ in range(n):
            yield "data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                                         "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                                      "finish_reason": None}]}) + "\n\n"
            await asyncio.sleep(0)
        yield "data: " + json.dumps({"id": "cmpl-stub", "choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8124)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([sys.executable, "-c", STUB, str(args.port)])
    try:
        for _ in range(100):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        rows = []
        for c in args.concurrency:
            ns = types.SimpleNamespace(max_concurrency=c, seed=0, model=None, api_key=None, timeout=600.0)
            reqs = [([1, 2, 3], args.output_len)] * args.num_prompts
            results, duration = asyncio.run(run(ns, url, float("inf"), reqs))
            row = summarize(results, duration, float("inf"), c)
            rows.append({"concurrency": c, "output_tok_s": row["output_tok_s"], "failed": row["failed"],
                         "itl_ms": row["itl_ms"]})
            print(f"concurrency {c:>4}: {row['output_tok_s']:>10.1f} output tok/s through the stub "
                  f"(ITL mean {row['itl_ms']['mean']:.3f} ms)", flush=True)
        print(json.dumps(rows))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
