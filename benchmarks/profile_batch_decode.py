"""Where a large decode batch's step goes, at each temperature: the wall time per step through the engine
(overlap scheduling on), the GPU kernel table of 20 steps and the host functions of 50 (cProfile).

python benchmarks/profile_batch_decode.py --model qwen3-0.6b --batch 256 --prompt-len 512 --temperature 0 0.6
"""

import argparse
import cProfile
import pstats
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ostinato import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    args = ap.parse_args()
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_running_requests=args.batch,
              skip_tokenizer_init=True)
    core = llm.engine
    rng = random.Random(0)
    for temp in args.temperature:
        sp = SamplingParams(temperature=temp, max_tokens=3000, ignore_eos=True)
        rids = [f"{temp}-{i}" for i in range(args.batch)]
        for rid in rids:
            core.add_request(rid, [rng.randrange(1000, 10000) for _ in range(args.prompt_len)], sp)
        for _ in range(40):  # prefill, then decode at the full batch
            core.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            core.step()
        torch.cuda.synchronize()
        print(f"T={temp:g}: {1000 * (time.perf_counter() - t) / 100:.3f} ms per step (wall)", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                core.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        host = cProfile.Profile()
        host.enable()
        for _ in range(50):
            core.step()
        host.disable()
        pstats.Stats(host).sort_stats("cumulative").print_stats("ostinato", 20)
        for rid in rids:
            core.abort(rid)
        while core.has_unfinished():
            core.step()


if __name__ == "__main__":
    main()
