"""Decode ms/step, eager vs CUDA graph, by batch size and context, beside the HBM floor.

A step here is what the engine does per decode step minus scheduling: build the batch tensors, run the
model (replay or eager), sample greedily and copy the tokens to the host. Modes "eager" and "graph" overlap
as the engine does by default (a step's tokens are waited for once the next step is launched);
"graph-sync" waits for each step's tokens before the next (--disable-overlap-schedule). `forward_ms` is
the GPU time of the model call alone (CUDA events). The floor is the bytes a step must read (all weights once + the
batch's KV) over the measured device copy bandwidth; for hybrid models (granite-4.0-h-*) plus each request's Mamba
state, read and written once (only the attention layers have KV).

Each row also reports, from torch.profiler over a few steps (`--no-launches` skips it): `launches`, the GPU
activities (kernels, copies, sets) of one forward (a graph replay with its input copies, or the eager forward),
`step_launches` the same for the whole step (inputs, forward, sampling, the copy to the host), `kernel_ms` their
summed GPU time per forward and `gap_ms` = forward_ms - kernel_ms: the time the GPU sat between the forward's
kernels (graph-node gaps in graph modes; host-bound launch gaps eagerly). LAUNCH_NAMES=1 lists the activities whose
counts differ between a forward and a step, LAUNCH_ORDER=step,prepare,forward reorders the profiled phases.
`--rope-store fused kernel unfused` runs each model as the engine does (rotary + KV store inside the decode kernel
up to the backend's rope_attend cap, by head dim, the fused `attention/triton_ops/rope_store.py` kernel above), with
that kernel at every batch size, and with neither.

python benchmarks/bench_decode.py --models llama-3.2-1b qwen3-0.6b
python benchmarks/bench_decode.py --models granite-4.0-h-1b llama-3.2-1b --cases 1:128 32:128 128:128
python benchmarks/bench_decode.py --models llama-3.2-1b --cases 1:128 32:4096 128:4096 256:1024 --modes graph \
    --kv-cache-dtype auto fp8_e4m3 --page-size 1 16     # bf16 vs fp8 KV, page 1 vs 16, in one run
python benchmarks/bench_decode.py --models llama-3.2-1b qwen3-0.6b granite-4.0-h-1b --cases 1:128 32:128 --modes graph \
    --pdl off on     # Programmatic Dependent Launch off vs on
python benchmarks/bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases 1:128 32:128 --modes graph \
    --rope-store fused unfused --out benchmarks/results/decode-rope-store-h200.json   # launches, fused vs not
TIMELINE=26 python benchmarks/bench_decode.py --models qwen3-0.6b --cases 1:128 --modes graph --no-launches \
    --profile 1:128     # and the profiled step's first 26 kernels in order: start, length, gap after the last
python benchmarks/bench_decode.py --models llama-3.2-1b --cases 32:128 32:288 --modes graph --no-launches \
    --decode-entry table "32:min_tokens_per_split=512" "32:block_n=64,num_warps=2"   # decode-kernel settings in
                                                                                  # the graph, one pass each
python benchmarks/bench_decode.py --models qwen3-0.6b --cases 32:256 --modes graph --no-launches \
    --gemm-tiles rule "gated:block_n=32" rule   # the wide / skinny GEMMs' tiles at 5-32 rows, one pass each
python benchmarks/bench_decode.py --models llama-3.2-1b --cases 1:128 --modes graph --no-launches \
    --gemm-tiles rule "fma_gated:block_k=1024" rule   # the FMA form's at 1-4 rows (gate_up, down)
"""

import argparse
import ast
import collections
import copy
import gc
import itertools
import os
import sys
import time

import torch
from common import RESULTS, copy_bandwidth, device_tag, write_report

from ostinato.attention.forward_batch import ForwardMode
from ostinato.attention.triton_backend import TritonAttentionBackend
from ostinato.attention.triton_ops.decode_attention import table_entry
from ostinato.config import EngineArgs
from ostinato.engine.request import Request
from ostinato.engine.scheduler import ScheduledBatch
from ostinato.layers.triton_ops import pdl, skinny_gemm, wide_gemm
from ostinato.loader import load_model_source
from ostinato.mem.kv_cache import MHATokenToKVPool
from ostinato.models.llama import head_dim_of
from ostinato.runner.model_runner import ModelRunner
from ostinato.sampling_params import SamplingParams

CASES = [(1, 128), (8, 128), (32, 128), (64, 128), (128, 128), (256, 128), (1, 4096), (32, 4096)]


def context_lengths(bs: int, ctx: int | str) -> list[int]:
    """Each row's context: `ctx` for all, or for "LO-HI" (a mixed batch, as an offline run's) lengths drawn
    uniformly from LO..HI by a fixed seed, in that random order, or sorted with ":desc" / ":asc"."""
    if isinstance(ctx, int):
        return [ctx] * bs
    span, _, order = ctx.partition(":")
    lo, hi = map(int, span.split("-"))
    gen = torch.Generator().manual_seed(bs * 7919 + lo * 31 + hi)
    lens = torch.randint(lo, hi + 1, (bs,), generator=gen).tolist()
    if order not in ("", "desc", "asc"):
        raise ValueError(f"--cases: order {order!r}: expected desc or asc")
    return sorted(lens, reverse=order == "desc") if order else lens


def decode_batch(runner: ModelRunner, bs: int, ctx: int | str) -> tuple[ScheduledBatch, list[Request]]:
    """`bs` requests whose first tokens (context_lengths) hold (random) KV, scheduled for one decode step."""
    lens = context_lengths(bs, ctx)
    gen = torch.Generator().manual_seed(bs * 7919 + sum(lens))
    reqs = []
    for i, n in enumerate(lens):
        ids = torch.randint(0, runner.vocab_size, (n + 1,), generator=gen).tolist()
        r = Request(f"b{i}", ids, SamplingParams(temperature=0.0), seed=0)
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        runner.kv_manager.extend(r.req_pool_idx, 0, n)
        r.kv_len = n
        reqs.append(r)
    locs = torch.cat([runner.kv_manager.extend(r.req_pool_idx, n, n + 1) for r, n in zip(reqs, lens, strict=True)])
    return ScheduledBatch(ForwardMode.DECODE, reqs, lens, [1] * bs, locs, [True] * bs), reqs


def time_steps(runner: ModelRunner, sched: ScheduledBatch, graph: bool, iters: int,
               overlap: bool = True) -> tuple[float, float]:
    """(wall ms per step, median GPU ms of the forward). `overlap`: as the engine runs by default, a step's
    tokens are waited for after the next step is launched; otherwise right after its own launch."""
    saved = runner.graph_runner
    runner.graph_runner = saved if graph else None
    try:
        for _ in range(3):
            runner.step(sched).result()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        in_flight = None
        t = time.perf_counter()
        for s, e in events:
            batch = runner.prepare(sched)
            tensors = runner.sampling_tensors(sched, batch)  # as ModelRunner.step: before the forward
            s.record()
            logits = runner.forward(batch, tensors)
            e.record()
            sampled = runner.sample(logits, sched, batch, tensors)
            if overlap:
                sampled, in_flight = in_flight, sampled
            if sampled is not None:
                sampled.result()  # waits for the step's tokens on the host, as the engine does
        if in_flight is not None:
            in_flight.result()
        step = (time.perf_counter() - t) / iters
        fwd = sorted(s.elapsed_time(e) for s, e in events)[iters // 2]
        return step * 1e3, fwd
    finally:
        runner.graph_runner = saved


def profile_steps(runner: ModelRunner, sched: ScheduledBatch, iters: int = 20) -> None:
    """Kernel table of graph-mode steps: where the forward's GPU time goes (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            runner.step(sched).result()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / iters  # kernels' rows
    kernels = sum(e.count for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA")
    print(f"profile bs {len(sched.reqs)}: GPU kernel time {gpu_us / 1e3:.3f} ms/step, {kernels / iters:.0f} "
          "kernels/step")
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    if os.environ.get("TIMELINE"):  # the last step's first TIMELINE kernels in order: start, length, gap after the last
        step_kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0),
                              key=lambda e: e.time_range.start)[-(kernels // iters):]
        t0, end = step_kernels[0].time_range.start, step_kernels[0].time_range.start
        for i, e in enumerate(step_kernels[: int(os.environ["TIMELINE"])]):
            r = e.time_range
            print(f"  {i:4} {r.start - t0:9.2f} us  {r.elapsed_us():7.2f} us  gap {r.start - end:7.2f}  {e.name[:60]}")
            end = r.end


def phase_spans(events: list) -> dict:
    """Each `bench_decode/<phase>` record_function's range on the host, which holds all of the phase's GPU work (it
    ends after a synchronize). The profiler also lists each range as GPU annotations of the same name, one a stream,
    spanning that stream's activities: the copy stream's spans the token copies alone, from the first step's copy
    on, so with those the step window lost the first step's inputs and forward (docs/gpu-notes.md, thirty-eighth
    and thirty-ninth sessions)."""
    from torch.autograd import DeviceType

    return {e.name.split("/")[1]: e.time_range for e in events
            if e.name.startswith("bench_decode/") and e.device_type == DeviceType.CPU}


def launch_stats(runner: ModelRunner, sched: ScheduledBatch, graph: bool, iters: int = 10) -> dict:
    """From one torch.profiler session: the GPU activities (kernels, copies, sets; each graph node of a replay on
    its own) of one forward and of one whole step, and the forward's summed GPU time. The forward's are those of
    prepare + forward less those of prepare alone (its host-to-device copies), as time_steps times it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    phases = {"prepare": lambda: runner.prepare(sched), "forward": lambda: runner.forward(runner.prepare(sched)),
              "step": lambda: runner.step(sched).result()}
    if order := os.environ.get("LAUNCH_ORDER"):
        if sorted(order.split(",")) != sorted(phases):
            raise SystemExit(f"LAUNCH_ORDER={order!r}: the phases {', '.join(phases)}, each once, comma-separated")
        phases = {k: phases[k] for k in order.split(",")}
    saved = runner.graph_runner
    runner.graph_runner = saved if graph else None
    try:
        for fn in phases.values():
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for name, fn in phases.items():
                with record_function(f"bench_decode/{name}"):  # its GPU work ends inside: synchronized
                    for _ in range(iters):
                        fn()
                    torch.cuda.synchronize()
    finally:
        runner.graph_runner = saved
    events = prof.events()
    spans = phase_spans(events)
    # (record_function's ranges also appear on the GPU timeline, as annotations spanning each phase: not kernels)
    device = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("bench_decode/")]
    count, ms, names = {}, {}, {}
    for name, span in spans.items():
        inside = [e for e in device if span.start <= e.time_range.start <= span.end]
        count[name] = len(inside) / iters
        ms[name] = sum(e.time_range.elapsed_us() for e in inside) / iters / 1e3
        names[name] = collections.Counter(e.name[:80] for e in inside)
    if os.environ.get("LAUNCH_NAMES"):  # per activity name, a step's count against the forward's (less prepare's)
        forward = names["forward"] - names["prepare"]
        for key in sorted(set(forward) | set(names["step"])):
            if forward[key] != names["step"][key]:
                print(f"  launches a forward / a step: {forward[key] / iters:6.1f} / {names['step'][key] / iters:6.1f}"
                      f"  {key}")
    return {"launches": count["forward"] - count["prepare"], "step_launches": count["step"],
            "kernel_ms": ms["forward"] - ms["prepare"]}


def patch_decode_tables(spec: str) -> None:
    """`--decode-entry` value: "table" (as the tree has it), or ";"-separated "BS:key=value,key=value" changes to
    the decode settings entry that batch size BS takes, in every (KV dtype, head dim) table (an entry keyed BS is
    added if the table has none). BS a power of two, as the tables' keys are (a batch takes the entry of its next
    power of two). Values are Python literals (16, True, "fp16_vcvt")."""
    if spec == "table":
        return
    for part in spec.split(";"):
        bs, changes = part.split(":", 1)
        if int(bs) & (int(bs) - 1):
            raise ValueError(f"--decode-entry {part!r}: the batch size must be a power of two")
        update = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in changes.split(","))}
        for table in TritonAttentionBackend.decode_tables.values():
            table[int(bs)] = table_entry(table, int(bs)) | update


GEMM_KINDS = ("plain", "gated", "skinny", "fma", "fma_gated")
CONFIG_RULES = {"wide": wide_gemm.config_for, "skinny": skinny_gemm.config_for,
                "prenorm": skinny_gemm.prenorm_config}


def patch_gemm_tiles(spec: str) -> None:
    """`--gemm-tiles` value: "rule" (config_for as the tree has it), or ";"-separated "KIND:key=value,..." changes to
    the tiles config_for picks, keys the config's fields (block_n=32,num_stages=4). KIND at 5-32 rows: plain / gated
    (wide_gemm.py: qkv / gate_up) and skinny (skinny_gemm.py's tensor-core form: o / down); at 1-4 rows, skinny_gemm's
    FMA form: fma (plain: Llama-3.2-1B's down at one row) and fma_gated (gate_up; block_n is output columns, each
    reading a gate and an up row). At 1-4 rows the change applies to the tiles launched: after prenorm_config's
    widening where the norm is folded in (gate_up). Projections on the resident GEMV (resident_gemv.py) never ask.
    Read when a kernel launches, so also by the capture; "rule" restores the rules."""
    wide_gemm.config_for, skinny_gemm.config_for = CONFIG_RULES["wide"], CONFIG_RULES["skinny"]
    skinny_gemm.prenorm_config = CONFIG_RULES["prenorm"]
    if spec == "rule":
        return
    changes: dict[str, dict] = {}
    for part in spec.split(";"):
        kind, _, fields = part.partition(":")
        if kind not in GEMM_KINDS or not fields:
            raise ValueError(f"--gemm-tiles {part!r}: KIND:key=value,... with KIND one of {', '.join(GEMM_KINDS)}")
        keys = (wide_gemm.WideConfig if kind in ("plain", "gated") else skinny_gemm.SkinnyConfig)._fields
        changes[kind] = {}
        for kv in fields.split(","):
            key, _, value = kv.partition("=")
            if key not in keys or not value.isdigit():
                raise ValueError(f"--gemm-tiles {part!r}: {kv!r} is not key=integer with key one of {', '.join(keys)}")
            changes[kind][key] = int(value)

    def wide_rule(m: int, n: int, k: int, gated: bool = False) -> wide_gemm.WideConfig:
        cfg = CONFIG_RULES["wide"](m, n, k, gated)
        return cfg._replace(**changes.get("gated" if gated else "plain", {})) if m <= 32 else cfg

    def fma_change(cfg: skinny_gemm.SkinnyConfig, m: int, gated: bool) -> skinny_gemm.SkinnyConfig:
        return cfg._replace(**changes.get("fma_gated" if gated else "fma", {})) if m <= 4 else cfg

    def skinny_rule(m: int, n: int, k: int, num_sms: int = 132, gated: bool = False) -> skinny_gemm.SkinnyConfig:
        cfg = CONFIG_RULES["skinny"](m, n, k, num_sms, gated)
        if m <= 4:
            return fma_change(cfg, m, gated)
        return cfg._replace(**changes.get("skinny", {})) if m <= 32 and not gated else cfg

    def prenorm_rule(m: int, n: int, k: int, num_sms: int = 132, gated: bool = False) -> skinny_gemm.SkinnyConfig:
        # the tree's prenorm_config on the tree's config_for (it looks config_for up in its module), then the change
        skinny_gemm.config_for = CONFIG_RULES["skinny"]
        try:
            cfg = CONFIG_RULES["prenorm"](m, n, k, num_sms, gated)
        finally:
            skinny_gemm.config_for = skinny_rule
        return fma_change(cfg, m, gated)

    wide_gemm.config_for, skinny_gemm.config_for = wide_rule, skinny_rule
    skinny_gemm.prenorm_config = prenorm_rule


def set_mlp_kernel(mode: str) -> None:
    """mlp_bs1.SETTINGS from "MODE[:key=N,...]" (slots, trigger, copies, blocks_per_sm, probe; the defaults where a
    key is not given)."""
    from ostinato.layers.cuda_ops import mlp_bs1

    mlp_bs1.SETTINGS.update(mlp_bs1.DEFAULT_SETTINGS)
    _, _, opts = mode.partition(":")
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        if key not in mlp_bs1.SETTINGS:
            raise ValueError(f"--decode-mlp-kernel: unknown setting {key!r} ({', '.join(mlp_bs1.SETTINGS)})")
        mlp_bs1.SETTINGS[key] = bool(int(value)) if key == "trigger" else int(value)


def bench_model(name: str, args: argparse.Namespace, bw: float, kv_dtype: str = "auto",
                page_size: int = 1, rope_store: str = "fused", use_pdl: str | None = None,
                decode_entry: str = "table", gemm_tiles: str = "rule",
                megakernel: str = "off", mlp_kernel: str = "off") -> tuple[list[dict], dict]:
    need = max(sum(n + page_size for n in context_lengths(bs, ctx)) for bs, ctx in CASES) + 1024
    eargs = EngineArgs(model=name, load_format="dummy", dtype="bfloat16", max_total_tokens=need,
                       max_running_requests=256, cuda_graph_bs=sorted({bs for bs, _ in CASES}),
                       enable_torch_compile=args.compile, torch_compile_max_bs=args.compile_max_bs,
                       kv_cache_dtype=kv_dtype, page_size=page_size, decode_megakernel=megakernel,
                       decode_mlp_kernel=mlp_kernel.split(":")[0])
    set_mlp_kernel(mlp_kernel)
    # read at each forward, so also by the capture
    TritonAttentionBackend.fuse_rope_store = rope_store != "unfused"
    rope_max_bs = TritonAttentionBackend.decode_rope_max_bs
    if rope_store == "kernel":  # the rope_store kernel at every batch size, none in the decode kernel
        TritonAttentionBackend.decode_rope_max_bs = 0
    pdl_before = pdl.ENABLED
    if use_pdl is not None:  # else as OSTINATO_PDL set it
        pdl.ENABLED = use_pdl == "on"  # read at each kernel launch, so also by the capture
    use_pdl = "on" if pdl.ENABLED else "off"
    tables = copy.deepcopy(TritonAttentionBackend.decode_tables)
    patch_decode_tables(decode_entry)  # read when the backend is built
    patch_gemm_tiles(gemm_tiles)
    runner = ModelRunner(eargs, load_model_source(name, "dummy"))
    gc.collect()
    gc.freeze()  # as EngineCore does after start-up: no collection walks the model's objects mid-timing
    cache = runner.kv_cache
    for layer in range(cache.layer_num):  # never time on zeros; through the storage (a grouped fp8 view spans
        for buf in cache.get_kv_buffer(layer):  # more slot numbers than it holds: mem/kv_cache.SlotLayout)
            flat = torch.empty(0, dtype=buf.dtype, device=buf.device).set_(buf.untyped_storage())
            if cache.is_fp8:  # random fp8 values (no NaN bytes), one layer-sized bf16 temporary
                flat.copy_(torch.empty(flat.shape, dtype=torch.bfloat16, device=buf.device).normal_())
            else:
                flat.normal_()
    cfg = runner.config
    kv_per_token = MHATokenToKVPool.bytes_per_token(cfg.num_key_value_heads, head_dim_of(cfg),
                                                    runner.kv_layers, runner.kv_cache.dtype)
    state_per_req = 0  # hybrid models: each request's Mamba state is read and written once per step
    if runner.mamba_pool is not None:
        state_per_req = 2 * runner.mamba_pool.bytes() // (runner.mamba_pool.size + 1)
    gr = runner.graph_runner
    print(f"{name} (kv {kv_dtype}, page {page_size}, rope+store {rope_store}, pdl {use_pdl}, decode entry "
          f"{decode_entry}, GEMM tiles {gemm_tiles}, megakernel {megakernel}, MLP kernel {mlp_kernel}): weights "
          f"{runner.weight_bytes / 1e9:.2f} GB, KV {kv_per_token} B/token, capture {gr.capture_seconds:.1f} s for "
          f"{gr.batch_sizes}, graph memory {gr.graph_memory_bytes / 2**30:.2f} GiB", flush=True)
    rows = []
    for bs, ctx in CASES:
        sched, reqs = decode_batch(runner, bs, ctx)
        floor_ms = (runner.weight_bytes + sum(n + 1 for n in context_lengths(bs, ctx)) * kv_per_token
                    + bs * state_per_req) / bw * 1e3
        if runner.mamba_pool is not None:  # states are zero-filled at alloc: time on random ones
            runner.mamba_pool.conv.normal_(0, 0.1)
            runner.mamba_pool.ssm.normal_(0, 0.1)
        launches: dict[bool, dict] = {}  # graph or eager: graph and graph-sync run the same forward
        for mode in args.modes:
            iters = args.eager_iters if mode == "eager" else args.iters
            graph = mode != "eager"
            step_ms, fwd_ms = time_steps(runner, sched, graph, iters, overlap=mode != "graph-sync")
            row = {"model": name, "bs": bs, "context": ctx, "mode": mode, "ms_per_step": step_ms,
                   "forward_ms": fwd_ms, "floor_ms": floor_ms, "compile": args.compile,
                   "kv_cache_dtype": kv_dtype, "page_size": page_size, "rope_store": rope_store, "pdl": use_pdl,
                   "decode_entry": decode_entry, "gemm_tiles": gemm_tiles, "megakernel": megakernel,
                   "mlp_kernel": mlp_kernel}
            if args.launches:
                if graph not in launches:
                    launches[graph] = launch_stats(runner, sched, graph, iters=min(iters, 10))
                row.update(launches[graph], gap_ms=fwd_ms - launches[graph]["kernel_ms"])
            rows.append(row)
            extra = (f"{row['launches']:>9.0f}{row['step_launches']:>7.0f}{row['kernel_ms']:>9.3f}{row['gap_ms']:>8.3f}"
                     if args.launches else "")
            print(f"{name:<14}{kv_dtype:>9}{page_size:>5}{rope_store:>9}{use_pdl:>4}{bs:>5}{ctx:>7}{mode:>11}"
                  f"{step_ms:>10.3f}"
                  f"{fwd_ms:>10.3f}{floor_ms:>9.3f}{extra}", flush=True)
        if f"{bs}:{ctx}" in (args.profile or []):
            profile_steps(runner, sched)
        for r in reqs:
            runner.kv_manager.release(r.req_pool_idx, r.kv_len)
    meta = {"pdl": use_pdl, "capture_seconds": gr.capture_seconds, "graph_memory_GiB": gr.graph_memory_bytes / 2**30,
            "batch_sizes": gr.batch_sizes}
    runner.shutdown()
    del runner
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()
    TritonAttentionBackend.fuse_rope_store = None
    TritonAttentionBackend.decode_rope_max_bs = rope_max_bs
    TritonAttentionBackend.decode_tables = tables
    patch_gemm_tiles("rule")
    pdl.ENABLED = pdl_before
    return rows, meta


def print_comparison(rows: list[dict]) -> None:
    """Per (model, bs, context, mode): each kv dtype / page size / rope store / PDL against the first one run."""
    base: dict[tuple, float] = {}
    for r in rows:
        key = (r["model"], r["bs"], r["context"], r["mode"])
        if key not in base:
            base[key] = r["ms_per_step"]
            continue
        launches = f", {r['launches']:.0f} launches" if "launches" in r else ""
        print(f"{r['model']:<14}bs {r['bs']:>4} ctx {r['context']:>5} {r['mode']:<10} kv {r['kv_cache_dtype']:<9} "
              f"page {r['page_size']:>3} rope+store {r['rope_store']} pdl {r['pdl']} entry {r['decode_entry']} "
              f"tiles {r['gemm_tiles']} megakernel {r.get('megakernel', 'off')} mlp {r.get('mlp_kernel', 'off')}: "
              f"{r['ms_per_step']:.3f} ms"
              f"{launches}, "
              f"{base[key] / r['ms_per_step']:.3f}x of the first configuration")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen3-0.6b"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--eager-iters", type=int, default=10, help="eager steps are ~10 ms and host-bound: fewer")
    ap.add_argument("--compile", action="store_true", help="--enable-torch-compile for the captured sizes")
    ap.add_argument("--compile-max-bs", type=int, default=32)
    ap.add_argument("--cases", nargs="+", default=None, help="bs:context pairs, e.g. 1:128 32:128; a mixed "
                    "batch as bs:LO-HI, its rows in random order, or bs:LO-HI:desc / :asc sorted by length")
    ap.add_argument("--profile", nargs="*", default=None, help="bs:context pairs to profile in graph mode")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="e.g. auto fp8_e4m3: one pass each")
    ap.add_argument("--page-size", nargs="+", type=int, default=[1], help="e.g. 1 16: one pass each")
    ap.add_argument("--rope-store", nargs="+", default=["fused"], choices=["fused", "kernel", "unfused"],
                    help="rotary fused with the KV store (as the engine does: in the decode kernel up to "
                         "the rope_attend cap), in the rope_store kernel at every size, or not fused "
                         "(Triton backend): one pass each")
    ap.add_argument("--pdl", nargs="+", default=[None], choices=["on", "off"],
                    help="Programmatic Dependent Launch for the Triton kernels (Hopper): one pass each "
                    "(default: as OSTINATO_PDL sets it, on)")
    ap.add_argument("--decode-entry", nargs="+", default=["table"],
                    help='decode-kernel settings, one pass each: "table", or "BS:key=value,..." (";" between '
                         "batch sizes) changes to the entry BS takes (see patch_decode_tables)")
    ap.add_argument("--gemm-tiles", nargs="+", default=["rule"],
                    help='GEMM tiles, one pass each: "rule", or "KIND:key=value,..." (";" between kinds plain / '
                         "gated / skinny at 5-32 rows, fma / fma_gated at 1-4) changes to config_for's pick (see "
                         "patch_gemm_tiles)")
    ap.add_argument("--no-launches", dest="launches", action="store_false",
                    help="skip the launch count and gap columns (torch.profiler over a few steps per row)")
    ap.add_argument("--modes", nargs="+", default=["eager", "graph", "graph-sync"],
                    choices=["eager", "graph", "graph-sync"])
    ap.add_argument("--decode-megakernel", nargs="+", choices=["off", "on", "auto"], default=["off"],
                    help="EngineArgs.decode_megakernel: one pass each (e.g. off on)")
    ap.add_argument("--decode-mlp-kernel", nargs="+", default=["off"],
                    help='EngineArgs.decode_mlp_kernel: one pass each (e.g. off on off); "on:slots=8,blocks_per_sm=1" '
                         "also sets the kernel's launch (see set_mlp_kernel)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cases:
        CASES[:] = [(int(b), int(c) if c.isdigit() else c) for b, c in (x.split(":", 1) for x in args.cases)]
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'model':<14}{'kv':>9}{'page':>5}{'rope+st':>9}{'pdl':>4}{'bs':>5}{'ctx':>7}{'mode':>11}{'ms/step':>10}"
          f"{'fwd ms':>10}{'floor':>9}" + (f"{'launches':>9}{'step':>7}{'kern ms':>9}{'gap ms':>8}" if args.launches
                                            else ""))
    rows, meta = [], {}
    for name in args.models:
        for kv in args.kv_cache_dtype:
            for page in args.page_size:
                for rope in args.rope_store:
                    for use_pdl in args.pdl:
                        for entry in args.decode_entry:
                            for tiles, mk, mlp in itertools.product(args.gemm_tiles, args.decode_megakernel,
                                                                    args.decode_mlp_kernel):
                                r, m = bench_model(name, args, bw, kv, page, rope, use_pdl, entry, tiles, mk, mlp)
                                rows += r
                                meta[f"{name}/{kv}/page{page}/{rope}/pdl-{m['pdl']}/{entry}/{tiles}/mk-{mk}/"
                                     f"mlp-{mlp}"] = m
    print_comparison(rows)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "command": " ".join(["python"] + sys.argv), "copy_bandwidth_TBps": bw / 1e12,
              "capture": meta, "rows": rows}
    write_report(report, args.out or os.path.join(RESULTS, f"decode-{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
