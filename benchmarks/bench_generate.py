"""Decode cost as a user sees it: ms per output token through the public `LLM.generate`, the difference
between a long and a short generation from the same prompts divided by the extra tokens (prefill and
start-up cancel out), greedy and sampled, beside the HBM floor (weights + KV read once per step).

GPU: python benchmarks/bench_generate.py --models llama-3.2-1b qwen3-0.6b --batch-sizes 1 32 \
         --temperature 0 0.6 [--top-k 200]   # top-k 200: gpt-fast's sampling (bench_gpt_fast.py)
     python benchmarks/bench_generate.py --models model.gguf --load-format gguf --dtype bfloat16 --chat-prompts \
         --temperature 0 0.6 --top-p 0.9     # a real model on chat requests (common.CHAT_PROMPTS)
     python benchmarks/bench_generate.py --settings temperature=0 temperature=0.6 temperature=0.6,min_p=0.05 \
         temperature=0.6,top_k=50,top_p=0.9,repetition_penalty=1.1   # sampling settings side by side, one engine
"""

import argparse
import os
import random
import sys
import time

import numpy as np
import torch
from common import (
    RESULTS,
    add_penalty_args,
    chat_prompt_ids,
    copy_bandwidth,
    device_tag,
    load_file_module,
    penalty_params,
    step_times,
    write_report,
)

from ostinato import LLM, SamplingParams
from ostinato.runner import sampler

pinned_put = sampler._put


def _pageable_put(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """sampler._put before the twenty-fifth session: a copy from pageable memory, which waits for the stream."""
    return torch.from_numpy(np.array(data, dtype=sampler._NP[dtype])).to(device, non_blocking=True)


def timed_generate(llm: LLM, prompts: list[list[int]], new_tokens: int, sampling: dict) -> float:
    """Wall seconds of one seeded generate of new_tokens per prompt; sampling: SamplingParams keywords."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=0, **sampling)
    batch = [{"prompt_token_ids": p} for p in prompts]
    t = time.perf_counter()
    with step_times(llm.engine) as durations:
        out = llm.generate(batch, params, use_tqdm=False)
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    assert all(len(r.outputs[0].token_ids) == new_tokens for r in out)
    if STEP_LOG is not None:
        STEP_LOG.append((new_tokens, elapsed, durations))
    return elapsed


STEP_LOG: list | None = None  # --step-log: (tokens, wall, [step() seconds]) of each timed generate

SETTING_TYPES = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "presence_penalty": float,
                 "frequency_penalty": float, "repetition_penalty": float}


def parse_setting(spec: str) -> dict:
    """"temperature=0.6,top_k=50" -> SamplingParams keywords; an unknown key or a bad value names itself."""
    out = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key not in SETTING_TYPES:
            raise SystemExit(f"--settings {spec!r}: unknown key {key!r} (one of {', '.join(SETTING_TYPES)})")
        try:
            out[key] = SETTING_TYPES[key](value)
        except ValueError:
            kind = SETTING_TYPES[key].__name__
            raise SystemExit(f"--settings {spec!r}: {key} needs a {kind}, got {value!r}") from None
    try:  # SamplingParams' own limits, before any engine starts
        SamplingParams(**out)
    except ValueError as e:
        raise SystemExit(f"--settings {spec!r}: {e}") from None
    return out


def _greedy(sampling: dict) -> bool:
    return SamplingParams(**sampling).is_greedy


def settings_from(args) -> list[dict]:
    """--settings as given, else one setting per --temperature (--top-k, --top-p and the penalties on sampled ones)."""
    if args.settings:
        return [parse_setting(s) for s in args.settings]
    return [dict(temperature=t, top_k=args.top_k, top_p=args.top_p, **penalty_params(args)) if t > 0
            else dict(temperature=t) for t in args.temperature]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen3-0.6b"])
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long", type=int, default=288)
    ap.add_argument("--top-k", type=int, default=0, help="SamplingParams.top_k for sampled rows (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="SamplingParams.top_p for sampled rows (1: off)")
    add_penalty_args(ap)
    ap.add_argument("--settings", nargs="+", default=None,
                    help="sampling settings as SamplingParams keywords, e.g. temperature=0.6,min_p=0.05, one row "
                         "each in one engine (in place of --temperature / --top-k / --top-p / the penalties)")
    ap.add_argument("--chat-prompts", action="store_true",
                    help="chat requests (common.CHAT_PROMPTS through the model's chat template) instead of "
                         "--prompt-len random tokens: a real model's logits on text")
    ap.add_argument("--sampler-graph", nargs="+", choices=["on", "off"], default=["on"],
                    help="sampled rows drawn from the sampler graphs (on) or by eager launches (off); both: A/B")
    ap.add_argument("--host-copies", nargs="+", choices=["pinned", "pageable"], default=["pinned"],
                    help="sampling inputs copied to the GPU through pinned memory (the engine's) or pageable memory "
                         "(the twenty-fifth session's start); both: A/B")
    ap.add_argument("--repeats", type=int, default=3, help="each length is timed this often; the median counts")
    ap.add_argument("--sampler", default=None,
                    help="another fused_sample.py (e.g. an earlier commit's) in place of the tree's for sampled rows")
    ap.add_argument("--step-log", action="store_true",
                    help="also report each timed generate's wall time, step count and steady step() times")
    ap.add_argument("--decode-megakernel", nargs="+", choices=["off", "on", "auto"], default=["off"],
                    help="EngineArgs.decode_megakernel: one engine each, in turn (e.g. off on)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = settings_from(args)  # (a bad setting stops here, before any engine starts)
    global STEP_LOG
    if args.sampler:  # sampler.sample_fused looks fused_sample up in its module at each call
        import ostinato.runner.fused_sample as tree_sampler

        tree_sampler.fused_sample = load_file_module(args.sampler, "fused_sample_other").fused_sample

    rows, device = [], None
    # the copy rate once, before any engine: measured after each engine's start, the first model's read about 3.6 TB/s
    # on an H200 where the second's and bench_decode's read 3.9-4.1 (2026-11-28, fortieth session)
    bw = copy_bandwidth(torch.device("cuda")) if torch.cuda.is_available() else None
    for model, megakernel in ((m, k) for m in args.models for k in args.decode_megakernel):
        llm = LLM(model, load_format=args.load_format, dtype=args.dtype, decode_megakernel=megakernel)
        runner = llm.engine.runner
        device = runner.device
        if bw is None or device.type != "cuda":
            bw = copy_bandwidth(device)
        kv_token = runner.kv_cache.bytes() // runner.kv_cache.size
        rng = random.Random(0)
        for bs in args.batch_sizes:
            if args.chat_prompts:
                prompts = chat_prompt_ids(llm.get_tokenizer(), bs)
            else:
                prompts = [[rng.randrange(100, runner.vocab_size - 100) for _ in range(args.prompt_len)]
                           for _ in range(bs)]
            prompt_len = sum(map(len, prompts)) / bs
            graphs = runner.sample_graph_runner
            cases = [(sampling, mode, copies) for sampling in settings
                     for mode in (args.sampler_graph if not _greedy(sampling) else ["on"])
                     for copies in (args.host_copies if not _greedy(sampling) else ["pinned"])]
            for sampling, mode, copies in cases:
                runner.sample_graph_runner = graphs if mode == "on" else None
                sampler._put = pinned_put if copies == "pinned" else _pageable_put
                # warm-up twice: the second run is the first whose prompts are in the prefix cache, a path of its own
                for _ in range(2):
                    timed_generate(llm, prompts, args.short, sampling)
                STEP_LOG = [] if args.step_log else None
                med = {}
                for n in (args.short, args.long):
                    times = sorted(timed_generate(llm, prompts, n, sampling)
                                   for _ in range(args.repeats))
                    med[n] = times[len(times) // 2]
                ms = (med[args.long] - med[args.short]) / (args.long - args.short) * 1e3
                mean_ctx = prompt_len + (args.short + args.long) / 2
                floor_ms = (runner.weight_bytes + bs * mean_ctx * kv_token) / bw * 1e3
                rows.append({"model": model, "decode_megakernel": megakernel, "batch_size": bs,
                             "chat_prompts": args.chat_prompts,
                             "top_k": 0, "top_p": 1.0, **sampling,
                             "sampler_graph": mode,
                             "host_copies": copies, "ms_per_token": ms, "floor_ms": floor_ms,
                             "fraction_of_floor": floor_ms / ms})
                if STEP_LOG:
                    rows[-1]["generates"] = [{"tokens": n, "wall_s": w, "steps": len(d), "sum_step_s": sum(d),
                                              "steady_step_ms": 1e3 * float(np.median(d[len(d) // 4:-2]))}
                                             for n, w, d in STEP_LOG]
                    for g in rows[-1]["generates"]:
                        print(f"    {g['tokens']} tokens: {g['wall_s'] * 1e3:.1f} ms, {g['steps']} steps "
                              f"(step() sum {g['sum_step_s'] * 1e3:.1f} ms), steady step {g['steady_step_ms']:.3f} ms")
                setting = " ".join(f"{k}={v:g}" for k, v in sampling.items())
                print(f"{model:<16} megakernel {megakernel:<4} bs {bs:>4} {setting:<28} "
                      f"sampler graph {mode:<3} {copies:<8} {ms:8.3f} ms/token   floor {floor_ms:.3f} "
                      f"({floor_ms / ms:.0%})",
                      flush=True)
            runner.sample_graph_runner = graphs
            sampler._put = pinned_put
        getattr(llm, "shutdown", lambda: None)()  # frees the GPU memory for the next model
        del llm
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "copy_bandwidth_TBps": bw / 1e12, "rows": rows}
    write_report(report, args.out or os.path.join(RESULTS, f"generate-{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
