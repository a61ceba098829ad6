"""What the GPU runs between two decode forwards, through the public API: `LLM.generate` under torch.profiler, then
for each step the GPU events from the end of one step's argmax kernel (the decode graph's last kernel) to the start
of the next step's first GEMV (the forward's first weight read), with their offsets. The median step's sequence is
printed, and the median length of that boundary beside the median step; the Chrome trace goes to --trace.

python benchmarks/profile_step_boundary.py --model llama-3.2-1b --batch-size 1 --temperature 0 0.6 [--trace DIR]
python benchmarks/profile_step_boundary.py --model model.gguf --load-format gguf --batch-size 32 --temperature 0 0.6 \
    --top-p 0.9 --chat-prompts     # a real model's logits on chat requests, top_p on the sampled runs
"""

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import tempfile

import torch
from common import add_penalty_args, chat_prompt_ids, penalty_params

from ostinato import LLM, SamplingParams

STEP_END = "_rows_argmax_kernel"  # the decode graph's last kernel
# a GEMV or small-batch GEMM: the first layer's first weight read
FORWARD_START = ("_skinny_fma_kernel", "_skinny_dot_kernel", "_wide_kernel", "_resident_gemv_kernel")
GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def gpu_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    return sorted(events, key=lambda e: e["ts"])


def boundaries(events: list[dict]) -> list[tuple[float, list[tuple[str, float, float]], int]]:
    """Per step boundary: (its length in us, [(event name, start offset, duration)], the next GEMV's event index) from
    the end of the first argmax kernel after a forward (the decode graph's; a sampled step's sampler graph ends with
    the same kernel) to the next GEMV's start."""
    out = []
    ends, after_forward = [], True
    for i, e in enumerate(events):
        if e["name"].startswith(FORWARD_START):
            after_forward = True
        elif e["name"].startswith(STEP_END) and after_forward:
            ends.append(i)
            after_forward = False
    for i in ends:
        t0 = events[i]["ts"] + events[i]["dur"]
        seq = []
        for j, e in enumerate(events[i + 1:], i + 1):
            if e["name"].startswith(FORWARD_START):
                out.append((e["ts"] - t0, seq, j))
                break
            seq.append((e["name"][:70], e["ts"] - t0, e["dur"]))
    return out


def step_spans(events: list[dict], starts: list[int]) -> tuple[list[float], list[float]]:
    """For each step from one first GEMV to the next: its period and the GPU's busy time in it (the union of
    its events' intervals), in us."""
    periods, busy = [], []
    for a, b in zip(starts, starts[1:], strict=False):
        t0, t1 = events[a]["ts"], events[b]["ts"]
        covered, end = 0.0, t0
        for e in events[a:b]:
            s, f = max(e["ts"], end), min(e["ts"] + e["dur"], t1)
            if f > s:
                covered += f - s
                end = f
        periods.append(t1 - t0)
        busy.append(covered)
    return periods, busy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trace", default=None, help="a folder for the Chrome traces (gzipped)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--top-k", type=int, default=0, help="SamplingParams.top_k of the sampled runs (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="SamplingParams.top_p of the sampled runs")
    add_penalty_args(ap)
    ap.add_argument("--chat-prompts", action="store_true", help="chat requests (common.CHAT_PROMPTS), not random "
                    "tokens: a real model's logits on text")
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16")
    rng = random.Random(0)
    vocab = llm.engine.runner.vocab_size
    if args.chat_prompts:
        ids = chat_prompt_ids(llm.get_tokenizer(), args.batch_size)
    else:
        ids = [[rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(args.batch_size)]
    prompts = [{"prompt_token_ids": p} for p in ids]
    for temp in args.temperature:
        cut = dict(top_k=args.top_k, top_p=args.top_p) if temp > 0 else {}
        if temp > 0:
            cut.update(penalty_params(args))
        params = SamplingParams(temperature=temp, max_tokens=args.tokens, ignore_eos=True, seed=0, **cut)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the sampler graph's capture)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        gpu_events_list = gpu_events(path)
        steps = boundaries(gpu_events_list)[5:-2]  # past the prefill's first steps, before the last
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            with open(path, "rb") as src, gzip.open(os.path.join(
                    args.trace, f"step-boundary-{os.path.basename(args.model)}-bs{args.batch_size}-t{temp:g}.json.gz"),
                    "wb") as dst:
                shutil.copyfileobj(src, dst)
        shutil.rmtree(tmp)
        lengths = [s[0] for s in steps]
        med = statistics.median(lengths)
        length, seq, _ = min(steps, key=lambda s: abs(s[0] - med))
        periods, busy = step_spans(gpu_events_list, [s[2] for s in steps])
        print(f"{os.path.basename(args.model)} bs {args.batch_size} T={temp:g} {cut}: {len(steps)} boundaries, "
              f"median {med:.1f} us (min {min(lengths):.1f}, max {max(lengths):.1f}); the median one, offsets from "
              "the argmax's end:")
        for name, start, dur in seq:
            print(f"  {start:8.1f} us  +{dur:6.1f}  {name}")
        print(f"  {length:8.1f} us  the first GEMV")
        idle = statistics.median(p - b for p, b in zip(periods, busy, strict=True))
        print(f"  step period median {statistics.median(periods):.1f} us, GPU busy in it "
              f"{statistics.median(busy):.1f} us (idle {idle:.1f})")


if __name__ == "__main__":
    main()
