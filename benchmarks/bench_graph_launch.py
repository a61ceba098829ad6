"""What a decode graph's launch costs the host, and whether it grows when more graphs exist.

A lead from the twenty-eighth session: capturing the 29 temperature-only sampler graphs at start-up made every later
bs-1 decode step slower (Qwen3-0.6B +54 us, Llama-3.2-1B +30 us, bs 32 level), and a synthetic chain's launch cost the
host about 0.55 us a Triton node. If more graphs make each launch dearer on the host, a bs-1 step turns host-bound.

Per batch size: the host's time inside `graph.replay()` (the call returns once the work is queued; the GPU is idle
before each call, so nothing waits), and the GPU's time of a replay (CUDA events over back-to-back replays). Then the
sampler graphs of every decode size are captured, as a start-up capture would, and both are timed again.

With `--generate-runs N`, first N greedy `LLM.generate` runs of bs-32 requests (128-token prompts, 288 tokens), each
followed by the same timings: the twenty-seventh and twenty-eighth sessions saw Llama-3.2-1B's bs-32 greedy decode
2.5-4% slower in a process's later runs and fast again in a new process. Whether a replay's GPU time or the host's
launch grows tells which side that is on.

python benchmarks/bench_graph_launch.py --model qwen3-0.6b [--batch-sizes 1 32] [--generate-runs 3] [--out FILE]
"""

import argparse
import os
import statistics
import time

import torch
from common import RESULTS, device_tag, write_report

from ostinato import LLM, SamplingParams
from ostinato.graphs.sample import SampleKey

REPLAYS = 200


def launch_times(graph) -> dict[str, float]:
    """Replays read the static inputs as they stand: the padding at first, after a generate run its last step's (that
    step's KV slots, of requests since finished, are written again; no later run reads past their 128-token
    prompts)."""
    host = []
    for _ in range(REPLAYS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return {"host_launch_us": 1e6 * statistics.median(host), "gpu_replay_us": 1e3 * start.elapsed_time(end) / REPLAYS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--generate-runs", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16")
    runner = llm.engine.runner
    decode, sampler = runner.graph_runner, runner.sample_graph_runner
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, runner.vocab_size - 100, (128,), generator=gen).tolist()}
               for _ in range(32)]
    rows = []
    phases = ["decode graphs only"] + [f"after generate run {i + 1}" for i in range(args.generate_runs)]
    for phase in [*phases, "with every size's sampler graph"]:
        if phase.startswith("after generate"):
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=288, ignore_eos=True), use_tqdm=False)
            print(f"generate: {time.perf_counter() - t:.3f} s", flush=True)
        elif phase.startswith("with every"):
            for bs in sorted(decode.batch_sizes, reverse=True):
                key = SampleKey(bs, False, False, False)
                if key not in sampler.graphs:
                    sampler.graphs[key] = sampler._capture(key)
        for bs in args.batch_sizes:
            r = {"phase": phase, "batch_size": bs, "graphs": len(decode.graphs) + len(sampler.graphs),
                 **launch_times(decode.graphs[decode.padded_size(bs)])}
            rows.append(r)
            print(f"{phase:>32}: bs {bs:3d}, {r['graphs']} graphs: host launch {r['host_launch_us']:.1f} us, "
                  f"GPU replay {r['gpu_replay_us']:.1f} us", flush=True)
    write_report({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                  "rows": rows}, args.out or os.path.join(RESULTS, f"graph-launch-{device_tag(runner.device)}.json"))


if __name__ == "__main__":
    main()
