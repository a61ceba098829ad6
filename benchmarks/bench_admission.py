"""Host cost of admitting prompts: the engine's extend-step time when N prompts arrive at once, new and with
their prefix cached (then each is a one-token extend, so the step is mostly bookkeeping).

python benchmarks/bench_admission.py --model llama-3.2-1b --load-format dummy --dtype bfloat16

Each row: the wall time of one `LLM.generate` of 4 tokens and the engine's mean extend- and decode-step time
(`EngineCore.step_seconds`: host work plus the wait for the GPU).
"""

import argparse
import random
import time

import torch

from ostinato import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
              max_running_requests=max(args.batches), skip_tokenizer_init=args.load_format == "dummy")
    core = llm.engine
    rng = random.Random(0)
    hi = min(10000, llm.engine.runner.vocab_size - 1)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(prompts: list[list[int]], label: str) -> None:
        steps, secs = dict(core.step_counts), dict(core.step_seconds)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = 1000 * (time.perf_counter() - t)
        per = {m: 1000 * (core.step_seconds[m] - secs.get(m, 0.0)) / max(core.step_counts[m] - steps.get(m, 0), 1)
               for m in core.step_counts}
        print(f"{label:<22} {wall:8.1f} ms   extend step {per.get('extend', 0):7.2f} ms   "
              f"decode step {per.get('decode', 0):6.2f} ms", flush=True)

    run([[rng.randrange(1000, hi) for _ in range(args.input_len)] for _ in range(8)], "warm-up")
    for n in args.batches:
        prompts = [[rng.randrange(1000, hi) for _ in range(args.input_len)] for _ in range(n)]
        run(prompts, f"{n} new prompts")
        run(prompts, f"{n} cached prompts")


if __name__ == "__main__":
    main()
