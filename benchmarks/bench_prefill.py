"""Prefill time as a user sees it: `LLM.generate` of one fresh random prompt with max_tokens=1 (median of
several, after a warm-up), for each model in one run, with the ratio to the first model.

python benchmarks/bench_prefill.py --models llama-3.2-1b granite-4.0-h-1b --tokens 512 2048   # ~1 min, H200

A hybrid (Mamba) model is timed once per `--ssm-prefill` value, switched through OSTINATO_SSM_PREFILL on the same
engine (the op reads it per call); its rows say which. The default runs every extend path: `ssd` (what the
engine picks), `ssd-fused`, `ssd-2pass`, `ssd-torchconv` (the gather conv) and `serial` (the path before the
SSD kernels: gather conv, token-serial scan).
"""

import argparse
import gc
import os
import statistics
import time

import torch
from common import RESULTS, device_tag, write_report

from ostinato import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "granite-4.0-h-1b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ssm-prefill", nargs="+", default=["ssd", "ssd-fused", "ssd-2pass", "ssd-torchconv", "serial"],
                    help="OSTINATO_SSM_PREFILL values for hybrid models (see layers/mamba2.py)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for model in a.models:
        llm = LLM(model, load_format="dummy", dtype="bfloat16", disable_radix_cache=True)
        vocab = llm.engine.runner.vocab_size
        hybrid = getattr(llm.engine.runner, "mamba_pool", None) is not None
        for kernels in a.ssm_prefill if hybrid else [None]:
            if kernels is not None:
                os.environ["OSTINATO_SSM_PREFILL"] = kernels
            for n in a.tokens:
                times = []
                for i in range(a.repeats + 1):
                    prompt = {"prompt_token_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()}
                    t = time.perf_counter()
                    llm.generate([prompt], params, use_tqdm=False)
                    if i:  # the first is the warm-up
                        times.append((time.perf_counter() - t) * 1e3)
                rows.append(dict(model=model, ssm_prefill=kernels, tokens=n, ms=round(statistics.median(times), 3)))
                print(f"{model:>18} {kernels or '':>13} {n:>6} tokens  prefill {rows[-1]['ms']:8.2f} ms", flush=True)
        os.environ.pop("OSTINATO_SSM_PREFILL", None)
        llm.shutdown()
        del llm
        gc.collect()
    first = a.models[0]
    for r in rows:
        base = next(x for x in rows if x["model"] == first and x["tokens"] == r["tokens"])
        r["vs_first"] = round(r["ms"] / base["ms"], 3)
        print(f"{r['model']:>18} {r['ssm_prefill'] or '':>13} {r['tokens']:>6} tokens  {r['vs_first']:.2f}x {first}")
    if torch.cuda.is_available():
        write_report(dict(device=device_tag(torch.device("cuda")), rows=rows),
                     a.out or f"{RESULTS}/prefill-{device_tag(torch.device('cuda'))}.json")


if __name__ == "__main__":
    main()
