"""Does work done for a graph captured mid-serving slow the decode graphs? Greedy ms per token (288 - 32 tokens,
bs 1, through LLM.generate) before and after one of:

  sampler       a T=0.6 generation: the engine captures its sampler graph lazily (graph.warmed_capture, mid_serving)
  side-stream   two runs of a one-op step on the capture stream, no capture (what a warm-up there did)
  current       a one-op graph captured as the engine captures mid-serving (warm-up on the current stream)

Each variant runs in a process of its own (the effect, where there is one, lasts for the process):
    for v in sampler side-stream current; do python benchmarks/bench_lazy_capture.py --variant $v; done
"""

import argparse
import json
import random
import time

import torch

from ostinato import LLM, SamplingParams
from ostinato.graphs.graph import capture_stream, warmed_capture


def ms_per_token(llm: LLM, prompts: list[dict], temperature: float) -> float:
    took = {}
    for n in (32, 288):
        params = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        took[n] = time.perf_counter() - start
    return (took[288] - took[32]) / 256 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["sampler", "side-stream", "current"], required=True)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy")
    device = llm.engine.runner.device
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]}]
    ms_per_token(llm, prompts, 0.0)  # warm-up
    before = [ms_per_token(llm, prompts, 0.0) for _ in range(2)]
    x = torch.ones(1024, device=device)
    if args.variant == "sampler":
        ms_per_token(llm, prompts, 0.6)
    elif args.variant == "side-stream":
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            x.add_(1.0)
            x.add_(1.0)
        torch.cuda.synchronize(device)
    else:
        warmed_capture(device, lambda: x.add_(1.0), free_memory=False, mid_serving=True)
    after = [ms_per_token(llm, prompts, 0.0) for _ in range(2)]
    row = {"model": args.model, "variant": args.variant, "greedy_before_ms": before, "greedy_after_ms": after}
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
