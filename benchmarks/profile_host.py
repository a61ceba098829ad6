"""Where the engine's host time goes at a large decode batch: cProfile over one `LLM.generate` of N requests.

With overlap scheduling a step costs max(GPU time, host time). The host time is everything the engine's thread does
between waits: scheduling, building inputs, sampling parameters, launching, reading back and processing outputs.
The wait for the GPU shows up as `Event.synchronize` (inside `SampledTensors.result`); what is left is the host's.
If the waits are short against the steps, the loop is host-bound and the table says where to cut.

    python benchmarks/profile_host.py --model llama-3.2-1b --load-format dummy --batch-size 256 --temperature 0 0.6

Each temperature is run three times: a warm-up, a timed run without the profiler (its wall time and steps are
the figures; cProfile roughly doubles the cost of Python calls) and the profiled run (the table).
`--stub-forward` replaces the model's forward with a fixed logits tensor, so what is timed is the engine's host loop
alone (scheduling, inputs, sampling, outputs), on the CPU as on the GPU:

    python benchmarks/profile_host.py --model tests/... --device cpu --stub-forward --batch-size 256
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

from common import step_times

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WAITS = ("synchronize", "_local_scalar_dense")  # the host blocked on the GPU


def timed_once(llm, prompts, params) -> dict:
    """One generate without the profiler: wall time, steps and the engine's time inside them."""
    eng = llm.engine
    before = {k: dict(getattr(eng, k)) for k in ("step_counts", "step_seconds")}
    start = time.perf_counter()
    with step_times(eng) as durations:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steady = sorted(durations[len(durations) // 4: -2])  # past the prefill, before the last steps
    steps = {k: eng.step_counts[k] - before["step_counts"][k] for k in eng.step_counts}
    step_s = {k: eng.step_seconds[k] - before["step_seconds"][k] for k in eng.step_seconds}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "steps": steps,
            "decode_ms_per_step": 1e3 * step_s["decode"] / max(1, steps["decode"]),
            "ms_per_step": 1e3 * wall / max(1, sum(steps.values())), "outside_step_s": wall - sum(step_s.values()),
            "step_ms_p10_p50_p90_max_mean": [1e3 * steady[int(q * (len(steady) - 1))] for q in (0.1, 0.5, 0.9, 1.0)]
            + [1e3 * sum(steady) / len(steady)]}


def profile_once(llm, prompts, params, top: int) -> dict:
    eng = llm.engine
    before = {k: dict(getattr(eng, k)) for k in ("step_counts", "step_seconds")}
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(prof)
    wait = sum(tt for (_, _, name), (_, _, tt, _, _) in stats.stats.items() if any(w in name for w in WAITS))
    steps = {k: eng.step_counts[k] - before["step_counts"][k] for k in eng.step_counts}
    step_s = {k: eng.step_seconds[k] - before["step_seconds"][k] for k in eng.step_seconds}
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    n = max(1, steps["decode"])
    return {
        "wall_s": wall, "output_tokens": tokens, "steps": steps, "step_seconds": step_s,
        "decode_ms_per_step": 1e3 * step_s["decode"] / n,
        "gpu_wait_s": wait, "host_s": wall - wait,
        "host_ms_per_step": 1e3 * (wall - wait) / max(1, sum(steps.values())),
        "outside_step_s": wall - sum(step_s.values()),
        "table": text.getvalue(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (the CPU default is small)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--top-k", type=int, default=0, help="SamplingParams.top_k of the sampled runs (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="SamplingParams.top_p of the sampled runs")
    ap.add_argument("--top", type=int, default=30, help="rows of the cProfile table (by own time)")
    ap.add_argument("--stub-forward", action="store_true",
                    help="fixed random logits instead of the model's forward: the host loop alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from ostinato import LLM, SamplingParams

    kw = {"device": args.device} if args.device else {}
    if args.max_total_tokens:
        kw["max_total_tokens"] = args.max_total_tokens
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, skip_tokenizer_init=True,
              max_running_requests=args.batch_size, disable_radix_cache=True, **kw)
    runner = llm.engine.runner
    vocab = runner.vocab_size
    if args.stub_forward:
        import torch

        logits = torch.randn(args.batch_size, vocab, device=runner.device)

        def stub(batch):
            runner._argmax = runner._prompt_lp = None  # what forward() leaves for sample()
            return logits[: batch.batch_size]

        runner.forward = stub
    prompts = [{"prompt_token_ids": [(i * 131 + j * 7) % (vocab - 1) + 1 for j in range(args.input_len)]}
               for i in range(args.batch_size)]
    results = {}
    for temp in args.temperature:
        cut = dict(top_k=args.top_k, top_p=args.top_p) if temp > 0 else {}
        params = SamplingParams(temperature=temp, max_tokens=args.output_len, ignore_eos=True, **cut)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels compiled, sizes seen
        t = timed_once(llm, prompts, params)
        print(f"T={temp}: wall {t['wall_s']:.3f} s, {t['tok_s']:,.0f} tok/s; steps {t['steps']}; "
              f"{t['ms_per_step']:.3f} ms/step ({t['decode_ms_per_step']:.3f} in decode steps, "
              f"{t['outside_step_s']:.3f} s outside engine steps); steady step() ms p10/p50/p90/max/mean "
              f"{' / '.join(f'{v:.3f}' for v in t['step_ms_p10_p50_p90_max_mean'])}")
        r = profile_once(llm, prompts, params, args.top)
        results[f"T={temp}"] = {"timed": t, "profiled": r}
        print(f"  profiled: wall {r['wall_s']:.3f} s; waiting on the GPU {r['gpu_wait_s']:.3f} s, host "
              f"{r['host_s']:.3f} s ({r['host_ms_per_step']:.3f} ms/step)")
        print(r["table"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "config": vars(args), "results": results}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
