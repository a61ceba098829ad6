"""ITL under prefill pressure: the decoding requests' inter-token latency while long prompts keep arriving,
`--enable-mixed-chunk` off vs on (and any other engine-flag variants), in one run.

In-process, on the EngineCore (no HTTP, so the figures are the engine's): `--decoders` requests decode
throughout (short random prompts, output lengths drawn from --decode-len, by default longer than the run; one
that finishes is replaced at once, so the decode batch stays full); after a warm-up, prompts of --prompt-len random
tokens arrive every 1/--rate s (evenly spaced, the same schedule for every variant) for --duration s, each
asking for --prompt-max-tokens outputs. Per variant (a fresh engine each) it reports, over that window, the
decoding requests' ITL (time between consecutive tokens as step() hands them back: p50 / p90 / p99 /
p99.9 / max, and each decoder's worst gap), output tok/s of all requests, the long prompts' TTFT (from their
scheduled arrival), and the engine's steps by kind and by extend path (extend graph / piecewise / eager).
A stall shows in p99 only when stalled gaps are over 1% of all gaps: at ~700 decode steps/s and 2 prompts/s a
prompt that stalls the decoders for one step is ~0.3% of them, seen in p99.9, max and the worst gaps.

GPU (the issue's shape, ~2.5 min on an H200):
  python benchmarks/bench_itl_prefill.py --model llama-3.2-1b --load-format dummy --dtype bfloat16
CPU smoke (SmolLM2, seconds):
  python benchmarks/bench_itl_prefill.py --decoders 4 --decode-len 40 80 --prompt-len 200 --rate 2 \\
      --duration 3 --warmup 1 --out /tmp/itl.json
Variants are NAME:FLAGS; the default is the issue's comparison:
  --variants "mixed-off:" "mixed-on:--enable-mixed-chunk"
  --variants "mixed-off:--enable-piecewise-cuda-graph" "mixed-on:--enable-piecewise-cuda-graph --enable-mixed-chunk"
"""

import argparse
import gc
import os
import random
import shlex
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, add_model_args, device_tag, write_report  # noqa: E402

from ostinato import LLM, SamplingParams  # noqa: E402
from ostinato.attention.forward_batch import ForwardMode  # noqa: E402
from ostinato.config import EngineArgs  # noqa: E402

DEFAULT_VARIANTS = ["mixed-off:", "mixed-on:--enable-mixed-chunk"]


def percentiles(xs: list[float]) -> dict[str, float]:
    """ms: mean, p50, p90, p99, p99.9, max (nearest rank); NaN for an empty list."""
    keys = ("mean", "p50", "p90", "p99", "p99.9", "max")
    if not xs:
        return dict.fromkeys(keys, float("nan"))
    s = sorted(xs)
    pick = lambda q: 1000 * s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"mean": 1000 * sum(s) / len(s), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99),
            "p99.9": pick(0.999), "max": 1000 * s[-1]}


def engine_kwargs(args, flags: str) -> dict:
    """EngineArgs fields from the common flags plus a variant's, through the engine's own CLI parser."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    argv = (["--model", args.model] if args.model else []) + ["--load-format", args.load_format, "--dtype",
                                                               args.dtype]
    if args.load_format == "dummy":
        argv.append("--skip-tokenizer-init")
    ns = parser.parse_args(argv + shlex.split(args.engine_args) + shlex.split(flags))
    return vars(EngineArgs.from_cli_args(ns))


class Workload:
    """The requests of one variant and the times their tokens came back."""

    def __init__(self, args, vocab: int) -> None:
        self.args = args
        self.rng = random.Random(args.seed)  # the same draws for every variant
        self.id_lo, self.id_hi = min(1000, vocab // 4), min(10000, vocab - 1)
        self.decoders: set[str] = set()
        self.token_times: dict[str, list[float]] = {}  # rid -> perf_counter of each token's arrival
        self.arrival: dict[str, float] = {}
        self.count = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.id_lo, self.id_hi) for _ in range(n)]

    def add_decoder(self, engine) -> None:
        rid = f"d{self.count}"
        self.count += 1
        n = self.rng.randint(*self.args.decode_len)
        engine.add_request(rid, self.prompt(self.args.decoder_prompt_len),
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        self.decoders.add(rid)
        self.token_times[rid] = []

    def add_prompt(self, engine, when: float) -> str:
        rid = f"p{self.count}"
        self.count += 1
        engine.add_request(rid, self.prompt(self.args.prompt_len),
                           SamplingParams(temperature=0.0, max_tokens=self.args.prompt_max_tokens, ignore_eos=True))
        self.token_times[rid] = []
        self.arrival[rid] = when
        return rid

    def step(self, engine, replace: bool) -> None:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.rid not in self.token_times:
                continue
            self.token_times[o.rid].extend([now] * len(o.new_token_ids))
            if o.finish_reason is not None and o.rid in self.decoders:
                self.decoders.discard(o.rid)
                if replace and o.finish_reason != "abort":
                    self.add_decoder(engine)


def step_stats(engine) -> dict[str, dict[str, float]]:
    """The engine's cumulative step counters, by mode: counts, tokens, seconds."""
    return {k: dict(getattr(engine, f"step_{k}")) for k in ("counts", "tokens", "seconds")}


def run_variant(args, name: str, flags: str) -> dict:
    kw = engine_kwargs(args, flags)
    t = time.perf_counter()
    llm = LLM(**kw)
    build_s = time.perf_counter() - t
    engine, runner = llm.engine, llm.engine.runner
    paths: Counter = Counter()
    extend_path = runner.extend_path

    def counted(batch):
        path = extend_path(batch)
        paths[path] += 1
        return path

    runner.extend_path = counted  # count which path each non-decode-graph step took
    runner_step = runner.step

    def step(sched):  # count mixed steps: prompt tokens and decoding requests' tokens (past the prompt) together
        if sched.mode is ForwardMode.EXTEND:
            past = [start >= len(r.prompt_token_ids) for r, start in zip(sched.reqs, sched.prefix_lens, strict=True)]
            if any(past) and not all(past):
                paths["mixed_steps"] += 1
        return runner_step(sched)

    runner.step = step
    w = Workload(args, runner.vocab_size)
    try:
        for _ in range(args.decoders):
            w.add_decoder(engine)
        w.add_prompt(engine, time.perf_counter())  # one long prompt in the warm-up: its first run is not timed
        t_warm = time.perf_counter()
        while time.perf_counter() - t_warm < args.warmup or any(not w.token_times[r] for r in w.decoders):
            w.step(engine, replace=True)
        steps0 = step_stats(engine)
        paths.clear()
        t0 = time.perf_counter()
        t1 = t0 + args.duration
        schedule = [t0 + i / args.rate for i in range(int(args.duration * args.rate))]
        prompts: list[str] = []
        while time.perf_counter() < t1:
            now = time.perf_counter()
            while schedule and schedule[0] <= now:
                prompts.append(w.add_prompt(engine, schedule.pop(0)))
            w.step(engine, replace=True)
        t_end = time.perf_counter()
        steps = {k: {m: v - steps0[k][m] for m, v in d.items()} for k, d in step_stats(engine).items()}
        for rid in list(engine.requests):  # the window is over: abort what still runs, drain
            engine.abort(rid)
        while engine.has_unfinished():
            w.step(engine, replace=False)
    finally:
        runner.extend_path, runner.step = extend_path, runner_step

    itl, worst, out_tokens, ttft, unfinished = [], [], 0, [], 0
    for rid, times in w.token_times.items():
        out_tokens += sum(t0 <= x < t_end for x in times)
        if rid.startswith("d"):
            gaps = [b - a for a, b in zip(times, times[1:], strict=False) if t0 <= b < t_end]
            itl += gaps
            if gaps:
                worst.append(max(gaps))
    for rid in prompts:
        if w.token_times[rid]:
            ttft.append(w.token_times[rid][0] - w.arrival[rid])
        else:
            unfinished += 1
    row = {"variant": name, "device": device_tag(runner.device), "flags": flags, "engine_build_s": build_s,
           "window_s": t_end - t0, "prompts_sent": len(prompts), "prompts_without_first_token": unfinished,
           "itl_ms": percentiles(itl), "itl_samples": len(itl), "worst_itl_per_decoder_ms": percentiles(worst),
           "output_tok_s": out_tokens / (t_end - t0),
           "prompt_ttft_ms": percentiles(ttft), "steps": steps, "extend_paths": dict(paths),
           "retractions": engine.scheduler.num_retractions,
           "chunked_prefill_size": runner.chunked_prefill_size}
    llm.shutdown()
    del llm, engine, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict]) -> None:
    print(f"\n{'variant':<14} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'worst':>7} "
          f"{'out tok/s':>10} {'prompt TTFT p50/p99':>20} {'ext/dec steps':>14}  extend paths")
    print("(ms; worst: the median over decoders of each one's longest gap)")
    for r in rows:
        i, p = r["itl_ms"], r["prompt_ttft_ms"]
        print(f"{r['variant']:<14} {i['p50']:>8.2f} {i['p90']:>7.2f} {i['p99']:>7.2f} {i['p99.9']:>7.2f} "
              f"{i['max']:>7.2f} {r['worst_itl_per_decoder_ms']['p50']:>7.2f} {r['output_tok_s']:>10.1f} "
              f"{p['p50']:>9.1f}/{p['p99']:<9.1f} "
              f"{r['steps']['counts']['extend']:>6}/{r['steps']['counts']['decode']:<7}  {r['extend_paths']}")
    if len(rows) >= 2:
        a, b = rows[0], rows[1]
        print(f"{b['variant']} vs {a['variant']}: ITL p99 {a['itl_ms']['p99'] / b['itl_ms']['p99']:.2f}x lower, "
              f"p99.9 {a['itl_ms']['p99.9'] / b['itl_ms']['p99.9']:.2f}x lower; output tok/s "
              f"{b['output_tok_s'] / a['output_tok_s']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--engine-args", default="", help="engine flags for every variant, e.g. '--page-size 16'")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="NAME:FLAGS, one engine each")
    ap.add_argument("--decoders", type=int, default=32, help="requests decoding throughout")
    ap.add_argument("--decoder-prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, nargs=2, default=[16384, 16384], metavar=("MIN", "MAX"),
                    help="a decoder's max_tokens, drawn uniformly (one that finishes is replaced by a fresh one)")
    ap.add_argument("--prompt-len", type=int, default=2000, help="tokens of each arriving prompt")
    ap.add_argument("--prompt-max-tokens", type=int, default=8, help="outputs each arriving prompt asks for")
    ap.add_argument("--rate", type=float, default=2.0, help="arriving prompts per second (evenly spaced)")
    ap.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals (the measured window)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of decoding before the window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/itl-prefill-<device>.json)")
    args = ap.parse_args()
    variants = [v.partition(":")[::2] for v in args.variants]
    rows = []
    for name, flags in variants:
        print(f"variant {name}: {flags or '(engine defaults)'}", flush=True)
        rows.append(run_variant(args, name, flags))
        print_table(rows[-1:])
    print_table(rows)
    report = {"device": rows[0]["device"], "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "config": vars(args), "rows": rows}
    write_report(report, args.out or os.path.join(RESULTS, f"itl-prefill-{report['device']}.json"))


if __name__ == "__main__":
    main()
