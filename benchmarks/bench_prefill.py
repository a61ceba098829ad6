"""Prefill time as a user sees it: `LLM.generate` of one fresh random prompt with max_tokens=1 (median of
several, after a warm-up), for each model in one run, with the ratio to the first model.

python benchmarks/bench_prefill.py --models llama-3.2-1b granite-4.0-h-1b --tokens 512 2048   # ~1 min, H200

`--rounds N` starts each model's engine N times, the models taking turns, and reports the median over rounds
(with each round's figure): engines of one tree started one after another differ by up to 6%.

A hybrid (Mamba) model is timed once per `--ssm-prefill` value, switched through OSTINATO_SSM_PREFILL on the same
engine (the op reads it per call); its rows say which. The default runs every extend path: `ssd` (the
default), `ssd-torchconv` (the gather conv) and `serial` (the path before the SSD kernels: gather conv,
token-serial scan). Steps captured in piecewise graphs (the default for up to 2,048 tokens) always take `ssd`.

`--piecewise default off eager inductor` times each model once per extend-graph setting, each on an engine of its
own: `default` as the engine starts by default (the full extend graph), `off` with every extend eager
(`extend_cuda_graph_max_tokens=0`), `eager` / `inductor` with piecewise graphs on (and the full extend graph off)
and that piece compiler.
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
    ap.add_argument("--ssm-prefill", nargs="+", default=["ssd", "ssd-torchconv", "serial"],
                    help="OSTINATO_SSM_PREFILL values for hybrid models (see layers/mamba2.py)")
    ap.add_argument("--piecewise", nargs="+", default=["default"], choices=["default", "off", "eager", "inductor"],
                    help="extend graphs as by default, off (eager extends), or piecewise with this piece compiler")
    ap.add_argument("--rounds", type=int, default=1,
                    help="start every model's engine this many times, the models taking turns; each row is the "
                         "median over rounds (engines of one tree differ by up to 6%%, more than the changes timed)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: at least 1")
    gen = torch.Generator().manual_seed(0)
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for model, rnd in [(m, r) for r in range(a.rounds) for m in a.models]:
        for piecewise in a.piecewise:
            extra = {"default": {}, "off": dict(extend_cuda_graph_max_tokens=0)}.get(
                piecewise, dict(enable_piecewise_cuda_graph=True, piecewise_cuda_graph_compiler=piecewise,
                                extend_cuda_graph_max_tokens=0))
            t0 = time.perf_counter()
            llm = LLM(model, load_format="dummy", dtype="bfloat16", disable_radix_cache=True, **extra)
            startup = time.perf_counter() - t0
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
                    rows.append(dict(model=model, piecewise=piecewise, ssm_prefill=kernels, tokens=n,
                                     ms=round(statistics.median(times), 3), startup_s=round(startup, 1), round=rnd))
                    print(f"{model:>18} pw={piecewise:<8} {kernels or '':>13} {n:>6} tokens  prefill "
                          f"{rows[-1]['ms']:8.2f} ms  (start-up {startup:.1f} s, round {rnd})", flush=True)
            os.environ.pop("OSTINATO_SSM_PREFILL", None)
            llm.shutdown()
            del llm
            gc.collect()
    if a.rounds > 1:  # one row per setting: the median over rounds, with each round's figure
        merged = {}
        for r in rows:
            merged.setdefault((r["model"], r["piecewise"], r["ssm_prefill"], r["tokens"]), []).append(r)
        rows = [dict(runs[0], ms=round(statistics.median(x["ms"] for x in runs), 3),
                     round_ms=[x["ms"] for x in runs], round=None) for runs in merged.values()]
    first = a.models[0]
    for r in rows:
        base = min(x["ms"] for x in rows if x["model"] == first and x["tokens"] == r["tokens"])
        r["vs_first"] = round(r["ms"] / base, 3)
        print(f"{r['model']:>18} pw={r['piecewise']:<8} {r['ssm_prefill'] or '':>13} {r['tokens']:>6} tokens  "
              f"{r['vs_first']:.2f}x {first} (its fastest)")
    if torch.cuda.is_available():
        write_report(dict(device=device_tag(torch.device("cuda")), rows=rows),
                     a.out or f"{RESULTS}/prefill-{device_tag(torch.device('cuda'))}.json")


if __name__ == "__main__":
    main()
