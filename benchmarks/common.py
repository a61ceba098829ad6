"""What every benchmark script shares: the measured bandwidth for the floor, the device tag, the report."""

import importlib.util
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "results")
# Short chat requests: on a real model, the next-token distributions of a conversation (random-token prompts give
# a model's logits on gibberish, flatter than a conversation's; the sampler's cost depends on how peaked they are)
CHAT_PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
                "Explain how a transistor works.", "List three uses of Python.", "Tell me a story about a dragon.",
                "How do I bake bread?", "What causes rain?", "Summarize the plot of Hamlet."]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of the device's sustained copy, counting bytes read + written: the floors' bandwidth. On CUDA, ten
    back-to-back copies of a buffer of up to 2 GiB (a quarter of the free memory at most), timed by CUDA events,
    median of 7. A single 512 MiB copy timed on the host (this function until the forty-first session) read 4.00
    TB/s on an H200 where this reads 4.28: the launch and the synchronization were in its time, and a shorter copy
    streams below the sustained rate (`benchmarks/copy_rate_probe.py`, docs/gpu-notes.md)."""
    if device.type != "cuda":
        n = 1 << 25
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return 2 * src.numel() * src.element_size() / sorted(times)[len(times) // 2]
    nbytes = min(1 << 31, torch.cuda.mem_get_info(device)[0] // 4) // 16 * 16
    rate = event_copy_rate(device, nbytes, reps=10, trials=7)
    torch.cuda.empty_cache()
    return rate


def event_copy_rate(device: torch.device, nbytes: int, reps: int, trials: int) -> float:
    """Bytes/s (read + written) of `reps` back-to-back copies of an `nbytes` buffer, timed by CUDA events, median
    of `trials`."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def gpu_timeline(kernels: list[tuple[float, float]], start: float, end: float) -> dict[str, float]:
    """Where a host-timed span [start, end] went on the GPU, from its kernels' (start, end) times on the same clock
    (any unit): `lead` before the first kernel started, `busy` with a kernel running (overlaps merged), `gaps`
    between the first kernel's start and the last one's end with none running, `tail` after the last ended."""
    if not kernels:
        return dict(lead=end - start, busy=0.0, gaps=0.0, tail=0.0)
    spans = sorted(kernels)
    busy, run_start, run_end = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > run_end:  # a gap: close the run
            busy += run_end - run_start
            run_start, run_end = s, e
        else:
            run_end = max(run_end, e)
    busy += run_end - run_start
    first, last = spans[0][0], max(e for _, e in spans)
    return dict(lead=first - start, busy=busy, gaps=last - first - busy, tail=end - last)


def capture(fn: Callable[[], object], calls: int = 1) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `calls` calls of `fn`, after one call on a side stream (Triton compiles, cuBLAS picks its
    kernels, the allocator warms up) outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_us(graph: "torch.cuda.CUDAGraph", calls: int, reps: int = 3) -> float:
    """us per call of a captured graph of `calls` calls: the best of `reps` timed replays, after one untimed."""
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def mean_replay_us(graph: "torch.cuda.CUDAGraph", iters: int = 200) -> float:
    """us per replay of a captured graph: the mean of `iters` back-to-back replays, after ten untimed."""
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return "h100" if "H100" in name else "h200" if "H200" in name else name.replace(" ", "-").lower()


def load_file_module(path: str, name: str):
    """A Python file as a module of its own (e.g. an earlier commit's copy of one of ours, timed beside the tree's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_report(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def add_model_args(ap) -> None:
    """--model / --load-format / --dtype, as every engine-starting benchmark takes them."""
    ap.add_argument("--model", default=None, help="default: the engine's default model (SmolLM2)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")


def cuda_ms_per_call(fn: Callable[[], object], iters: int, warmup: int = 3, repeats: int = 5,
                     before_repeat: Callable[[], None] | None = None) -> float:
    """Median over `repeats` of the CUDA-event milliseconds per call of `fn` (`iters` calls per repeat);
    `before_repeat` runs before each repeat (e.g. a barrier, so every rank starts together)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before_repeat is not None:
            before_repeat()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def kernel_times(fn: Callable[[], object], calls: int = 20, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """What `fn` launches on the GPU (torch.profiler, the kernels' own rows): kernel name -> (microseconds per
    call, launches per call)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us, count = defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            us[e.name] += (e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total) / calls
            count[e.name] += 1 / calls
    return {name: (us[name], count[name]) for name in us}


def chat_prompt_ids(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts as token ids, CHAT_PROMPTS in turn, each as one user message under the tokenizer's chat
    template with the assistant's turn opened (what a chat client sends)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(count)]


@contextmanager
def step_times(engine) -> Iterator[list[float]]:
    """Within the block, each `engine.step()` call's wall time (s) is appended to the yielded list."""
    durations: list[float] = []
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        durations.append(time.perf_counter() - t)
        return out

    engine.step = timed_step
    try:
        yield durations
    finally:
        del engine.step


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def add_penalty_args(ap) -> None:
    """--presence-penalty, --frequency-penalty, --repetition-penalty: SamplingParams' penalties of sampled runs."""
    for name in PENALTIES:
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                        help=f"SamplingParams.{name} of the sampled runs")


def penalty_params(args) -> dict:
    """The penalties given on the command line, as SamplingParams keywords."""
    return {name: getattr(args, name) for name in PENALTIES if getattr(args, name) is not None}
