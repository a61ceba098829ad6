"""The step times of a process's first generates of the same prompts, and cProfile's table of the second one.

A kernel's first launch in a process loads it (CUDA's lazy module loading), so an op that a path runs for the first
time mid-serving costs that step tens of milliseconds. The second generate of the same prompts is the first whose
prompts (and, greedy or seeded, outputs) are in the prefix cache; its duplicates are freed there. Steps after the
first run should all be as short as the last run's.

python benchmarks/profile_first_steps.py --model llama-3.2-1b --batch-size 32
"""

import argparse
import cProfile
import pstats
import random

import torch
from common import step_times

from ostinato import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--top", type=int, default=30, help="rows of the second run's cProfile table (cumulative time)")
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16")
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.runner.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(128)]}
               for _ in range(args.batch_size)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for run in range(args.runs):
        prof = cProfile.Profile()
        with step_times(engine) as durations:
            if run == 1:
                prof.enable()
            llm.generate(prompts, params, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.disable()
        print(f"run {run}: {sum(durations) * 1e3:.1f} ms in {len(durations)} steps; the first five "
              f"{' '.join(f'{d * 1e3:.1f}' for d in durations[:5])} ms, the longest {max(durations) * 1e3:.1f} ms",
              flush=True)
        if run == 1:
            pstats.Stats(prof).sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
