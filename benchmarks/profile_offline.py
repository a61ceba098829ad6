"""Where an offline decode step's time goes: wall time per engine step vs GPU kernel time, with the top
kernels and host functions, over a window of steady decode steps (torch.profiler; nsys is unavailable).

python benchmarks/profile_offline.py --model qwen3-0.6b --num-seqs 256 --ctx 512
python benchmarks/profile_offline.py --model llama-3.2-1b --num-seqs 32 --ctx 128 --temperature 0.6 --top-k 200
"""

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ostinato import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="SamplingParams.seed of every request (bench_generate: 0)")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16")
    engine = llm.engine
    rng = random.Random(0)
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=10_000,
                        ignore_eos=True, seed=args.seed)
    for i in range(args.num_seqs):
        engine.add_request(str(i), [rng.randrange(1000, 30000) for _ in range(args.ctx)], sp)
    t = time.perf_counter()
    prefill_steps = 0
    while any(r.kv_len < r.seq_len - 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
        prefill_steps += 1
    torch.cuda.synchronize()
    print(f"prefill of {args.num_seqs}x{args.ctx} tokens: {prefill_steps} steps, {time.perf_counter() - t:.2f} s")
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # the kernels' own rows: an eager op's row carries its kernels' time too
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / args.steps
    print(f"decode bs {len(engine.scheduler.running)}: wall {wall * 1e3:.2f} ms/step, GPU kernels "
          f"{gpu_us / 1e3:.2f} ms/step ({gpu_us / 1e3 / (wall * 1e3):.0%} busy)")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()


if __name__ == "__main__":
    main()
