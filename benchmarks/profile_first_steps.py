"""The step times of a process's first generates of the same prompts, and cProfile's table of the second one.

A kernel's first launch in a process loads it (CUDA's lazy module loading), so an op that a path runs for the first
time mid-serving costs that step tens of milliseconds. The second generate of the same prompts is the first whose
prompts (and, greedy or seeded, outputs) are in the prefix cache; its duplicates are freed there. Steps after the
first run should all be as short as the last run's.

python benchmarks/profile_first_steps.py --model llama-3.2-1b --batch-size 32

`--features` instead runs, after two greedy generates, each sampling feature twice in turn (temperature, top_k,
top_p, min_p, a seed, presence/frequency penalties, a repetition penalty, logprobs, prompt logprobs, and a batch
size the process has not sampled at): a first use that loads kernels, compiles or captures shows as its first
generate's longest step against the second's.

python benchmarks/profile_first_steps.py --model llama-3.2-1b --batch-size 32 --features
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
    ap.add_argument("--top", type=int, default=30, help="rows of the profiled run's cProfile table (cumulative time)")
    ap.add_argument("--profile-run", type=int, default=1, help="which run to profile (0: the process's first)")
    ap.add_argument("--features", action="store_true", help="each sampling feature's first and second generate")
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.runner.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(128)]}
               for _ in range(args.batch_size)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    if args.features:
        first_uses(llm, prompts, args.tokens)
        return
    for run in range(args.runs):
        prof = cProfile.Profile()
        with step_times(engine) as durations:
            if run == args.profile_run:
                prof.enable()
            llm.generate(prompts, params, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.disable()
        print(f"run {run}: {sum(durations) * 1e3:.1f} ms in {len(durations)} steps; the first five "
              f"{' '.join(f'{d * 1e3:.1f}' for d in durations[:5])} ms, the longest {max(durations) * 1e3:.1f} ms",
              flush=True)
        if run == args.profile_run:
            pstats.Stats(prof).sort_stats("cumtime").print_stats(args.top)


FEATURES = [  # (name, SamplingParams keywords, batch size divisor): each a first use after the one before
    ("greedy", {}, 1),
    ("temperature 0.6", dict(temperature=0.6), 1),
    ("top_k 50", dict(temperature=0.6, top_k=50), 1),
    ("top_p 0.9", dict(temperature=0.6, top_p=0.9), 1),
    ("min_p 0.05", dict(temperature=0.6, min_p=0.05), 1),
    ("seed", dict(temperature=0.6, seed=7), 1),
    ("presence + frequency", dict(temperature=0.6, presence_penalty=0.5, frequency_penalty=0.3), 1),
    ("repetition 1.1", dict(temperature=0.6, repetition_penalty=1.1), 1),
    ("logprobs 5", dict(temperature=0.6, logprobs=5), 1),
    ("prompt_logprobs 1", dict(temperature=0.6, prompt_logprobs=1), 1),
    ("temperature 0.6, a third of the batch", dict(temperature=0.6), 3),
]


def first_uses(llm, prompts: list, tokens: int) -> None:
    engine = llm.engine
    for name, extra, divisor in [FEATURES[0]] + FEATURES:
        batch = prompts[: max(1, len(prompts) // divisor)]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **{"temperature": 0.0, **extra})
        for run in ("first", "second"):
            with step_times(engine) as durations:
                llm.generate(batch, params, use_tqdm=False)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            steady = sorted(durations)[len(durations) // 2]
            longest = max(durations)
            print(f"{name:<40} {run:<6} bs {len(batch):>3}: {len(durations)} steps, median {steady * 1e3:6.2f} ms, "
                  f"longest {longest * 1e3:7.2f} ms (step {durations.index(longest)})", flush=True)


if __name__ == "__main__":
    main()
