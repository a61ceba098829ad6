"""Offline throughput: Ostinato's LLM.generate beside transformers' padded batch generate, same prompts,
same machine, same run; with the memory-bandwidth floor (weights read once per decode step).

CPU (issue default):  python benchmarks/bench_offline.py
GPU, nano-vllm shape: python benchmarks/bench_offline.py --load-format dummy --model qwen3-0.6b \
                          --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-hf
"""

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from bench_decode import patch_decode_tables
from common import RESULTS, add_model_args, copy_bandwidth, device_tag, write_report

from ostinato import LLM, SamplingParams
from ostinato.attention.forward_batch import ForwardMode


def make_prompts(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    lo, hi = args.input_len
    olo, ohi = args.output_len
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(args.num_seqs)]
    outs = [rng.randint(olo, ohi) for _ in range(args.num_seqs)]
    return prompts, outs


def bench_hf(llm: LLM, prompts: list[list[int]], max_new: int, device: torch.device) -> float:
    """transformers generate on the same weights, one left-padded batch, greedy, EOS ignored."""
    import transformers

    cfg = llm.source.hf_config
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=llm.engine.runner.dtype).to(device).eval()
    sd = {}
    for name, t in llm.source.iter_weights() if llm.source.load_format != "dummy" else []:
        sd[name] = t
    if sd:
        hf.load_state_dict(sd, strict=False)
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, pad_token_id=pad)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    assert out.shape[1] == width + max_new
    return elapsed


def step_split(llm: LLM, before: dict | None = None) -> dict:
    """The engine's step counts, tokens and step() seconds by mode (extend, decode), less `before`'s. Under overlap
    scheduling a step() call returns once the step before it is done on the GPU, so the seconds are the GPU's,
    shifted by a step where the mode changes."""
    core = llm.engine
    now = {f"{mode}_{key}": value for key, counts in (("steps", core.step_counts), ("tokens", core.step_tokens),
                                                       ("seconds", core.step_seconds))
           for mode, value in counts.items()}
    return now if before is None else {k: v - before[k] for k, v in now.items()}


BUCKETS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1 << 30))


@contextmanager
def logged_steps(llm: LLM) -> Iterator[list]:
    """Yields a list that fills with one (mode, rows, context tokens, seconds) a step: what each step() call
    scheduled, with the seconds of the NEXT call, which returns once this step is done on the GPU (overlap
    scheduling: a call launches its step, then reads the one before back)."""
    core, log = llm.engine, []
    scheduler, engine_step = core.scheduler, core.step
    schedule = scheduler.schedule
    scheduled = []

    def logged_schedule():
        sched = schedule()
        scheduled.append(None if sched is None else ("decode" if sched.mode is ForwardMode.DECODE else "extend",
                                                     len(sched.reqs), sum(r.seq_len for r in sched.reqs)))
        return sched

    def timed_step():
        t = time.perf_counter()
        out = engine_step()
        if len(scheduled) >= 2 and scheduled[-2] is not None:
            log.append((*scheduled[-2], time.perf_counter() - t))
        return out

    scheduler.schedule, core.step = logged_schedule, timed_step
    try:
        yield log
    finally:
        del scheduler.schedule, core.step  # the class's methods again


def bucket_table(log: list, weight_bytes: int, kv_token: int, bw: float) -> list[dict]:
    """Decode steps by batch rows: count, seconds, and their bytes' floor (the weights once a step, every row's
    context of KV once) at `bw`; extend steps as one row."""
    rows = []
    for lo, hi in BUCKETS:
        steps = [(n, ctx, sec) for mode, n, ctx, sec in log if mode == "decode" and lo <= n <= hi]
        if steps:
            floor = sum(weight_bytes + ctx * kv_token for _, ctx, _ in steps) / bw
            rows.append({"rows": f"{lo}-{hi}", "steps": len(steps), "seconds": sum(s for *_, s in steps),
                         "floor_s": floor})
    extend = [sec for mode, *_, sec in log if mode == "extend"]
    rows.append({"rows": "extend", "steps": len(extend), "seconds": sum(extend), "floor_s": None,
                 "step_seconds": extend})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3 | fp8_e5m2")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the engine's")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--decode-entry", default="table",
                    help='decode-kernel settings: "table", or "BS:key=value,..." changes (bench_decode.py\'s)')
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                    help="one run per temperature (nano-vllm's own bench samples at 0.6)")
    ap.add_argument("--arrival-order", action="store_true",
                    help="decode rows in arrival order, as before the forty-fifth session (Scheduler.longest_first "
                         "off; A/B runs)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline-<device>.json)")
    args = ap.parse_args()

    patch_decode_tables(args.decode_entry)
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              max_running_requests=args.max_running_requests, max_total_tokens=args.max_total_tokens,
              kv_cache_dtype=args.kv_cache_dtype, chunked_prefill_size=args.chunked_prefill_size)
    runner = llm.engine.runner
    device = runner.device
    llm.engine.scheduler.longest_first = not args.arrival_order
    prompts, outs = make_prompts(args, runner.vocab_size)
    batch = [{"prompt_token_ids": p} for p in prompts]
    timed = []
    # the warm-up: other prompts of the same lengths, the whole batch (a kernel compiles per batch-size class)
    warm = [{"prompt_token_ids": [t + 1 for t in p]} for p in prompts]
    for temperature in args.temperature:
        params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True) for o in outs]
        llm.generate(warm, [SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)] * len(warm),
                     use_tqdm=False)
        llm.reset_prefix_cache()  # every timed run computes its prompts (the previous temperature's run cached them)
        before = step_split(llm)
        t = time.perf_counter()
        with logged_steps(llm) as log:
            results = llm.generate(batch, params)
        if device.type == "cuda":
            torch.cuda.synchronize()
        timed.append((temperature, time.perf_counter() - t, step_split(llm, before), log))
        out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
        assert out_tokens == sum(outs)

    bw = copy_bandwidth(device)
    # floor: every decode step reads all weights once (a batch holds at most max_running_requests), and
    # every generated token reads its request's KV so far once
    steps = max(outs) * -(-args.num_seqs // args.max_running_requests)
    kv_token = runner.kv_cache.bytes() // runner.kv_cache.size
    kv_reads = sum((len(p) * o + o * (o - 1) // 2) * kv_token for p, o in zip(prompts, outs, strict=True))
    floor = (steps * runner.weight_bytes + kv_reads) / bw
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    rows = []
    for temperature, elapsed, split, log in timed:
        # the decode steps the engine ran, against the same bytes: its weights each step, every token's KV once
        split["decode_floor_s"] = (split["decode_steps"] * runner.weight_bytes + kv_reads) / bw
        rows.append({"engine": f"ostinato T={temperature:g}", "temperature": temperature, "seconds": elapsed,
                     "output_tok_s": out_tokens / elapsed, "floor_s": floor, "fraction_of_floor": floor / elapsed,
                     **split, "by_rows": bucket_table(log, runner.weight_bytes, kv_token, bw)})
    if not args.no_hf:
        assert len(set(outs)) == 1, "the HF baseline needs one output length"
        hf_s = bench_hf(llm, prompts, outs[0], device)
        rows.append({"engine": "transformers-generate", "seconds": hf_s, "output_tok_s": out_tokens / hf_s,
                     "floor_s": floor, "fraction_of_floor": floor / hf_s})
    report = {"device": name, "device_type": device.type, "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "model": args.model or "SmolLM2-135M-Instruct (default)", "dtype": str(runner.dtype),
              "chunked_prefill_size": runner.chunked_prefill_size,
              "num_seqs": args.num_seqs, "input_len": args.input_len, "output_len": args.output_len,
              "decode_entry": args.decode_entry,
              "arrival_order": args.arrival_order,
              "output_tokens": out_tokens, "copy_bandwidth_GBps": bw / 1e9,
              "weight_bytes": runner.weight_bytes, "kv_bytes_read": kv_reads, "decode_steps_floor": steps,
              "max_total_tokens": runner.max_total_tokens, "rows": rows}
    print(f"{'engine':<24}{'seconds':>10}{'out tok/s':>12}{'floor s':>10}{'floor frac':>12}")
    for r in rows:
        print(f"{r['engine']:<24}{r['seconds']:>10.2f}{r['output_tok_s']:>12.1f}{r['floor_s']:>10.2f}"
              f"{r['fraction_of_floor']:>12.1%}")
    for r in rows:
        if "decode_steps" in r:
            print(f"  {r['engine']}: {r['extend_steps']} extend steps ({r['extend_tokens']} tokens) "
                  f"{r['extend_seconds']:.2f} s; {r['decode_steps']} decode steps {r['decode_seconds']:.2f} s, "
                  f"their floor {r['decode_floor_s']:.2f} s ({r['decode_floor_s'] / r['decode_seconds']:.1%})")
            for b in r["by_rows"]:  # each step timed by the step() call after it (logged_steps)
                floor_s = "" if b["floor_s"] is None else \
                    f", floor {b['floor_s']:.3f} s ({b['floor_s'] / b['seconds']:.1%})"
                print(f"    {b['rows']:>9} rows: {b['steps']:5} steps {b['seconds']:.3f} s{floor_s}")
                if "step_seconds" in b:  # each extend step's ms: a stall shows as one outlier, a slow GPU as all
                    print("      extend steps, ms: " + " ".join(f"{1e3 * s:.0f}" for s in b["step_seconds"]))
    write_report(report, args.out or os.path.join(RESULTS, f"offline-{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
