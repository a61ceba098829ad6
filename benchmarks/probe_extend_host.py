"""Why the offline shape's prefill time varies: its prompts prefilled alone (max_tokens=1), several runs in one
process, each with its extend steps' ms, the host's ms in the runner's prepare / forward / sample, the path each
step took, the allocator's counters and (with pynvml) the SM clock, power and clock-event reasons at each step.

The forty-second session's finding (docs/gpu-notes.md): an eager 8,192-token Qwen3-0.6B step takes ~16 ms of host
launches against ~16 ms of GPU work, so a slower host stretched it (to ~30 ms) with the GPU's clocks unchanged.

  python benchmarks/probe_extend_host.py --runs 6 [--profile] [--cprofile] [--chunked-prefill-size N]
"""

import argparse
import cProfile
import json
import pstats
import time

import torch
from bench_offline import logged_steps, make_prompts

from ostinato import LLM, SamplingParams

ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def nvml_reader():
    """A function giving (SM MHz, W, clock-event reasons) now, or None without pynvml or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 - no pynvml, no driver: the probe runs without clocks
        return lambda: None
    return lambda: (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    pynvml.nvmlDeviceGetPowerUsage(handle) // 1000,
                    pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def time_host_calls(runner, host: dict) -> None:
    """Wrap the runner's prepare / forward / sample to append their host ms, and extend_path its choice."""
    def wrap(name: str):
        inner = getattr(runner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            out = inner(*a, **k)
            host[name].append(round(1e3 * (time.perf_counter() - t), 2))
            return out
        return timed

    for name in ("prepare", "forward", "sample"):
        setattr(runner, name, wrap(name))

    def path(batch, _f=runner.extend_path):
        host["path"].append(_f(batch))
        return host["path"][-1]
    runner.extend_path = path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="torch.profiler on every other run: its kernels' ms")
    ap.add_argument("--cprofile", action="store_true", help="one more run under cProfile: the host's hot calls")
    ap.add_argument("--out", default="extend-probe.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    llm = LLM(args.model, load_format="dummy" if cuda else "auto", dtype="bfloat16" if cuda else "float32",
              max_running_requests=256, chunked_prefill_size=args.chunked_prefill_size)
    shape = argparse.Namespace(input_len=[100, 1024], output_len=[100, 1024], num_seqs=256)
    prompts, _ = make_prompts(shape, llm.engine.runner.vocab_size)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [t + 1 for t in p]} for p in prompts], params, use_tqdm=False)  # warm-up
    nvml = nvml_reader()
    host = {"prepare": [], "forward": [], "sample": [], "path": [], "nvml": []}
    time_host_calls(llm.engine.runner, host)
    core = llm.engine
    engine_step = type(core).step

    def sampled_step():
        host["nvml"].append(nvml())
        return engine_step(core)
    rows = []
    for i in range(args.runs):
        llm.reset_prefix_cache()
        for v in host.values():
            v.clear()
        prof = None
        if args.profile and i % 2 == 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        stats0 = torch.cuda.memory_stats() if cuda else {}
        core.step = sampled_step
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with logged_steps(llm) as log:  # (it removes the instance's step, ours included, on leaving)
            llm.generate(batch, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        row = {"run": i, "wall_s": round(time.perf_counter() - t, 4),
               "steps_ms": [round(1e3 * sec, 1) for *_, sec in log], **{k: list(v) for k, v in host.items()}}
        stats1 = torch.cuda.memory_stats() if cuda else {}
        row.update({k: stats1.get(k, 0) - stats0.get(k, 0) for k in ALLOC_KEYS})
        if prof is not None:
            prof.__exit__(None, None, None)
            kernels = [(e.key, e.self_device_time_total) for e in prof.key_averages() if e.self_device_time_total]
            row["gpu_kernels_ms"] = round(sum(v for _, v in kernels) / 1e3, 2)
            row["top_kernels_ms"] = [(k[:60], round(v / 1e3, 2)) for k, v in sorted(kernels, key=lambda x: -x[1])[:8]]
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("run", "wall_s", "steps_ms", "forward")}), flush=True)
    if args.cprofile:
        llm.reset_prefix_cache()
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(batch, params, use_tqdm=False)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
