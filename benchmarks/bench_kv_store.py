"""How new K/V reach the cache, inside CUDA graphs: the fused Triton store kernel (K and V in one launch,
quantizing fp8), indexed writes K then V on one stream, and indexed writes with V on a second stream joined
back before attention (seed 001's capture-mode path).

Part 1: a graph of the 16 layers' stores alone (Llama-3.2-1B KV shape), replay time per graph, by batch.
Part 2: the whole decode step (DecodeGraphRunner replay, dummy Llama-3.2-1B), ms/step, by batch.

python benchmarks/bench_kv_store.py            # ~1-2 min on an H200
"""

import argparse
import os
import sys

import torch
from bench_decode import decode_batch, time_steps
from common import RESULTS, capture, device_tag, mean_replay_us, write_report

from ostinato.config import EngineArgs
from ostinato.graphs.decode import DecodeGraphRunner
from ostinato.loader import load_model_source
from ostinato.mem.kv_cache import MHATokenToKVPool
from ostinato.runner.model_runner import ModelRunner

MODES = ("fused", "one-stream", "two-stream")
KV_DTYPES = {"auto": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def set_mode(backend, cache: MHATokenToKVPool, mode: str) -> None:
    backend.kv_store = "fused" if mode == "fused" else "indexed"
    cache.alt_stream = torch.cuda.Stream() if mode == "two-stream" else None


def store_only(bs: int, kv: str, mode: str, iters: int, layers: int = 16, kv_heads: int = 8, dim: int = 64) -> float:
    """Microseconds per replay of a graph holding `layers` K/V stores of `bs` tokens."""
    from ostinato.attention.triton_backend import TritonAttentionBackend
    from ostinato.mem.req_to_token_pool import ReqToTokenPool

    dev = torch.device("cuda")
    cache = MHATokenToKVPool(65536, KV_DTYPES[kv], kv_heads, dim, layers, dev)
    backend = TritonAttentionBackend(ReqToTokenPool(1, 8, dev), cache, num_heads=32)
    set_mode(backend, cache, mode)
    loc = cache.layout.numbers(torch.randperm(65535, device=dev)[:bs] + 1)
    k = torch.randn(bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def step() -> None:
        for layer in range(layers):
            backend.store_kv(layer, loc, k, v)

    us = mean_replay_us(capture(step), iters)
    ref = cache.read_kv(layers - 1, loc, torch.float32)  # every mode stores the same values
    assert torch.allclose(ref[1], v.float(), rtol=0.07 if kv != "auto" else 0.0, atol=0.02 if kv != "auto" else 0)
    return us


def decode_step(model: str, kv: str, cases: list[tuple[int, int]], iters: int) -> list[dict]:
    rows = []
    eargs = EngineArgs(model=model, load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv,
                       max_total_tokens=max(bs * (ctx + 1) for bs, ctx in cases) + 1024, max_running_requests=256,
                       cuda_graph_bs=sorted({bs for bs, _ in cases}), disable_cuda_graph=True)
    runner = ModelRunner(eargs, load_model_source(model, "dummy"))
    for mode in MODES:
        set_mode(runner.backend, runner.kv_cache, mode)
        runner.graph_runner = DecodeGraphRunner(runner)  # captured with this mode's writes
        for bs, ctx in cases:
            sched, reqs = decode_batch(runner, bs, ctx)
            ms, fwd = time_steps(runner, sched, True, iters)
            rows.append({"part": "decode-step", "model": model, "kv_cache_dtype": kv, "mode": mode, "bs": bs,
                         "context": ctx, "ms_per_step": ms, "forward_ms": fwd})
            print(f"decode step {model} kv {kv:<9}{mode:<12} bs {bs:>4} ctx {ctx:>5}: {ms:.3f} ms/step "
                  f"(forward {fwd:.3f})", flush=True)
            for r in reqs:
                runner.kv_manager.release(r.req_pool_idx, r.kv_len)
        runner.graph_runner.graphs.clear()
        runner.graph_runner = None
    runner.shutdown()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32, 128, 256])
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "fp8_e4m3"])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--cases", nargs="+", default=["1:128", "32:1024", "128:1024"])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for kv in args.kv_cache_dtype:
        for bs in args.batch_sizes:
            line = []
            for mode in MODES:
                us = store_only(bs, kv, mode, args.iters)
                rows.append({"part": "stores-only", "kv_cache_dtype": kv, "mode": mode, "bs": bs, "us_per_graph": us})
                line.append(f"{mode} {us:7.1f}")
            print(f"16 layers' stores, kv {kv:<9} bs {bs:>4}: " + "  ".join(line) + " us/graph", flush=True)
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
    for kv in args.kv_cache_dtype:
        rows += decode_step(args.model, kv, cases, args.iters // 4)
    device = torch.device("cuda")
    write_report({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                  "command": " ".join(["python"] + sys.argv), "rows": rows},
                 args.out or os.path.join(RESULTS, f"kv-store-{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
