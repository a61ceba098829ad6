"""The split-KV decode kernel at the backend's settings-table entries, and at a few tweaks of each entry (register
caps, twice the split cap, the other stage count), for both KV dtypes and head dims 64 (Llama-3.2-1B heads
32:8:64) and 128 (Qwen3-0.6B, 16:8:128), batch 8-256 at contexts 128 / 1,024 / 4,096.

The kernel runs as the engine runs it: splits capped by the entry (`TritonAttentionBackend.kv_splits_cap`'s
rule), scratch as deep as that cap (the in-kernel combine sizes its tile by it), splits combined in stage 1 where
the engine combines them (`TritonAttentionBackend.entry_combines`), each request's slots contiguous as
`bench_decode.py` allocates them. Run it with `OSTINATO_PDL=0`: back-to-back calls under PDL overlap one call's
tail with the next one's start, which a step does not (the GEMM after attention waits for all of it), and which
hides the cost of a few slow programs.
20 calls a graph replay; us per call, KV bytes read per second, and each tweak's largest difference from the
entry's output (relative to its largest value).

OSTINATO_PDL=0 python benchmarks/bench_decode_entries.py [--entries-only] [--kv fp8] [--dims 64] [--bs 32 128]
                                                     [--layout engine|token|head] [--stages 7 10] [--fold]
                                                     [--contexts 4096 8192] [--splits 2 4 6]
                                                     [--out PATH]
                                                     # ~3 min on an H200 for everything
python benchmarks/bench_decode_entries.py --smoke   # CPU, Triton's interpreter: one tiny case, checks the script
"""

import argparse
import ast
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from common import RESULTS, device_tag, replay_us  # noqa: E402

from ostinato.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from ostinato.attention.triton_ops.decode_attention import (  # noqa: E402
    _decode_stage1_kernel,
    compute_num_kv_splits,
    decode_attention,
    decode_kwargs,
    table_entry,
)
from ostinato.mem.kv_cache import MHATokenToKVPool  # noqa: E402

HEADS = {64: (32, 8), 128: (16, 8)}  # head dim -> (query heads, KV heads)


def tweaks(entry: dict, fp8: bool) -> list[tuple[str, dict]]:
    pps = entry.get("programs_per_sm", 2)
    other_stages = 5 if entry.get("num_stages", 2) != 5 else 2
    out = [("maxnreg128", entry | dict(maxnreg=128)), ("maxnreg96", entry | dict(maxnreg=96)),
           ("splits2x", entry | dict(programs_per_sm=pps * 2)),
           ("splits2x_maxnreg96", entry | dict(programs_per_sm=pps * 2, maxnreg=96)),
           ("stages", entry | dict(num_stages=other_stages))]
    if fp8:  # the other way of widening V (fp16 <-> fp16_vcvt), with the register and split tweaks
        other = entry | dict(variant="fp16" if entry.get("variant") == "fp16_vcvt" else "fp16_vcvt")
        out += [("vcvt", other), ("vcvt_maxnreg128", other | dict(maxnreg=128)),
                ("vcvt_splits2x", other | dict(programs_per_sm=pps * 2)),
                ("vcvt_stages", other | dict(num_stages=other_stages)),
                ("vcvt_block64", other | dict(block_n=64))]
    return out


def deeper(entry: dict, stages: list[int]) -> list[tuple[str, dict]]:
    """The entry at other pipeline depths (a key block's K/V buffers grow with num_stages: 2 at 5, 3 at 7, 4 at
    10 for the one-warp fp8 entries, `sass_decode_attention.py`), alone and with twice the split cap."""
    pps = entry.get("programs_per_sm", 2)
    return [(f"{tag}stages{n}", entry | dict(num_stages=n) | knobs) for n in stages
            for tag, knobs in (("", {}), ("splits2x_", dict(programs_per_sm=pps * 2)))]


def folded(entry: dict) -> list[tuple[str, dict]]:
    """The entry with stage 1's rows folded over the keys (decode_attention's `fold`), at key blocks of 64 and 128
    and a few depths and warp counts (a folded block does the softmax of block_n / (16 / group) keys a row)."""
    fold = entry | dict(fold=True)
    return [("fold_b64", fold | dict(block_n=64)), ("fold_b64_s3", fold | dict(block_n=64, num_stages=3)),
            ("fold_b128", fold | dict(block_n=128)), ("fold_b128_s3", fold | dict(block_n=128, num_stages=3)),
            ("fold_b128_s2", fold | dict(block_n=128, num_stages=2)),
            ("fold_b128_w2", fold | dict(block_n=128, num_warps=2, num_stages=3))]


def resident_programs(n_regs: int, shared: int, num_warps: int) -> int:
    """Stage-1 programs an H100/H200 SM holds at once: the least of its register file (64K, allocated 256 a
    warp), shared memory (228 KB, 1 KB reserved a block), 64 warps and 32 blocks."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps) if n_regs else 32
    return min(by_regs, 228 * 1024 // (shared + 1024), 64 // num_warps, 32)


def compiled(fn) -> list:
    """The kernels Triton compiled for `fn` so far (its per-device caches), oldest first; none off CUDA."""
    return [k for caches in getattr(fn, "device_caches", {}).values() for k in caches[0].values()]


_KERNELS: dict[tuple, dict] = {}


def kernel_info(key: tuple, before: int) -> dict:
    """Registers, shared memory, warps and resident programs an SM of the stage-1 kernel a setting (`key`) ran:
    the one compiled since `before` kernels were cached, else what this key recorded earlier (a later context
    reuses the kernel); empty off CUDA."""
    kernels = compiled(_decode_stage1_kernel)
    if len(kernels) > before and hasattr(kernels[-1], "n_regs"):
        k = kernels[-1]
        info = dict(n_regs=k.n_regs, shared=k.metadata.shared, num_warps=k.metadata.num_warps)
        _KERNELS[key] = info | dict(per_sm=resident_programs(**info))
    return _KERNELS.get(key, {})


def split_settings(entry: dict, caps: list[int]) -> list[tuple[str, dict]]:
    """The entry at fixed split caps (the bench's own `kv_splits` key, in place of programs_per_sm's rule)."""
    return [(f"splits{n}", entry | dict(kv_splits=n)) for n in caps]


def changed(entry: dict, specs: list[str]) -> list[tuple[str, dict]]:
    """The entry with `--change` specs applied: "NAME:key=value,key=value" (values Python literals; kv_splits
    fixes the split cap)."""
    out = []
    for spec in specs:
        name, changes = spec.split(":", 1)
        out.append((name, entry | {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in changes.split(","))}))
    return out


def kv_interleaved_buffers(group: int, size: int, heads: int, dim: int, dtype: torch.dtype, dev: torch.device):
    """K and V of one layer in one buffer [slot group, {K, V}, head, G slots, dim] (a question for the bench, not an
    engine layout): the views index [slot number, head, dim] with slot numbers (s // G) x 2 x G x heads + s % G.
    Returns the K and V views and the slot -> number map."""
    groups = -(-size // group)
    flat = torch.empty(groups * 2 * heads * group * dim, dtype=dtype, device=dev)
    rows = (groups - 1) * 2 * group * heads + group
    k = flat.as_strided((rows, heads, dim), (dim, group * dim, 1))
    v = flat.as_strided((rows, heads, dim), (dim, group * dim, 1), heads * group * dim)
    return k, v, lambda s: s // group * (2 * group * heads) + s % group


def engine_kv_buffers(fp8: bool, bs: int, ctx: int, kv_heads: int, dim: int, dtype: torch.dtype, dev: torch.device,
                      layout: str = "engine") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """One layer's K / V buffers of random values (never zeros), each of `bs` requests' `ctx` slots contiguous from
    slot 128 (a slot group's start: the engine's allocator reserves the first group, the sink's): (k, v,
    req_to_token int32 [bs, ctx], the layout's name or the pool's head_major). `layout` as `--layout` says: the
    engine's pool in its layout for the dtype ("engine"), one asked for, or K and V side by side in slot groups."""
    real = torch.arange(128, 128 + bs * ctx, device=dev)
    if layout.startswith("kvgroup"):  # K and V runs of a group side by side too (kv_interleaved_buffers)
        k, v, numbers = kv_interleaved_buffers(int(layout[7:]), 128 + bs * ctx, kv_heads, dim,
                                               torch.uint8 if fp8 else dtype, dev)
        req_to_token, head_major = numbers(real).to(torch.int32).view(bs, ctx), layout
    else:
        # the engine's pool, in its layout for the dtype ("engine") or the one asked for; slot numbers from its layout
        group = int(layout[5:]) if layout.startswith("group") else (None if layout == "engine" else 0)
        pool = MHATokenToKVPool(128 + bs * ctx, torch.float8_e4m3fn if fp8 else dtype, kv_heads, dim, 1, dev,
                                head_major=None if layout == "engine" else layout == "head", slot_group=group)
        k, v = pool.get_store_buffer(0)
        head_major = layout if group else pool.head_major
        req_to_token = pool.layout.numbers(real).to(torch.int32).view(bs, ctx)
    for buf in (k, v):  # through the storage (a grouped view spans more numbers than slots)
        flat = torch.empty(0, dtype=buf.dtype, device=dev).set_(buf.untyped_storage())
        x = torch.randn(flat.shape, device=dev, dtype=dtype)
        flat.copy_(x.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else x)
    return k, v, req_to_token, head_major


def run_case(fp8: bool, dim: int, bs: int, ctx: int, entries_only: bool, num_sms: int, dev: torch.device,
             timed: bool, layout: str = "engine", stages: list[int] | None = None, fold: bool = False,
             splits: list[int] | None = None, changes: list[str] | None = None) -> list[dict]:
    heads, kv_heads = HEADS[dim]
    dtype = torch.bfloat16 if timed else torch.float32
    k, v, req_to_token, head_major = engine_kv_buffers(fp8, bs, ctx, kv_heads, dim, dtype, dev, layout)
    fp8_args = {}
    if fp8:
        scale = torch.ones(1, device=dev)
        fp8_args = dict(kv_fp8=torch.float8_e4m3fn, k_scale=scale, v_scale=scale)
    q = torch.randn(bs, heads, dim, device=dev, dtype=dtype)
    rows = torch.arange(bs, dtype=torch.int32, device=dev)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    counters = torch.zeros(bs * kv_heads, dtype=torch.int32, device=dev)
    entry = table_entry(TritonAttentionBackend.decode_table_for(dim, fp8), bs)
    out_rows, ref = [], None
    settings = ([("entry", entry)] + ([] if entries_only else tweaks(entry, fp8)) + deeper(entry, stages or [])
                + (folded(entry) if fold else []) + split_settings(entry, splits or []) + changed(entry, changes or []))
    for name, cfg in settings:
        cap = cfg.pop("kv_splits", None) or TritonAttentionBackend.split_cap(
            bs, cfg.get("programs_per_sm", 2), kv_heads, num_sms, TritonAttentionBackend.max_kv_splits)
        num_splits = torch.empty(bs, dtype=torch.int32, device=dev)
        compute_num_kv_splits(seq_lens, num_splits,
                              cfg.get("min_tokens_per_split", TritonAttentionBackend.min_tokens_per_split), cap)
        mid_o = torch.empty(bs, heads, cap, dim, device=dev)
        mid_lse = torch.empty(bs, heads, cap, device=dev)
        out = torch.empty(bs, heads, dim, device=dev, dtype=dtype)
        combine = counters if TritonAttentionBackend.entry_combines(cfg, bs) else None

        def call(cfg=cfg, num_splits=num_splits, mid_o=mid_o, mid_lse=mid_lse, out=out, combine=combine) -> None:
            decode_attention(q, k, v, out, req_to_token, rows, seq_lens, num_splits, mid_o, mid_lse, dim**-0.5,
                             counters=combine, **fp8_args,
                             **(dict(block_n=TritonAttentionBackend.decode_block_n) | decode_kwargs(cfg)))

        before = len(compiled(_decode_stage1_kernel))
        call()
        ref = out.float().clone() if ref is None else ref
        row = dict(kv="fp8_e4m3" if fp8 else "bf16", dim=dim, bs=bs, ctx=ctx, setting=name, splits=cap,
                   head_major=head_major,
                   entry=dict(cfg), kernel=kernel_info((fp8, dim, bs, name), before),
                   rel_diff=((out.float() - ref).abs().max() / ref.abs().max()).item())
        if timed:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    call()
            row["us"] = replay_us(graph, 20)
            row["kv_tbps"] = bs * ctx * kv_heads * dim * 2 * k.element_size() / row["us"] / 1e6
        out_rows.append(row)
        per_sm = row["kernel"].get("per_sm", 0)
        print(f"{row['kv']:9} dim {dim:3} bs {bs:3} ctx {ctx:5} {name:19} splits<={cap:2} "
              f"{row.get('us', 0):8.2f} us {row.get('kv_tbps', 0):5.2f} TB/s  diff {row['rel_diff']:.1e}  "
              f"programs {bs * kv_heads * cap} ({per_sm} an SM: {bs * kv_heads * cap / max(1, per_sm * num_sms):.2f}"
              " waves)", flush=True)
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries-only", action="store_true", help="the table entries alone (a tree's baseline)")
    ap.add_argument("--budget-s", type=float, default=400, help="no new case starts after this many seconds")
    ap.add_argument("--kv", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128], choices=[64, 128])
    ap.add_argument("--layout", default="engine",
                    choices=["engine", "token", "head", "group32", "group128", "kvgroup32", "kvgroup128"],
                    help="the KV buffers' layout: the engine's (fp8 head-major in groups of 128 slots, bf16 "
                         "token-major), or one for both (groupG: head-major within groups of G slots, "
                         "mem/kv_cache.SlotLayout; kvgroupG: K and V side by side in each group too, "
                         "kv_interleaved_buffers)")
    ap.add_argument("--bs", type=int, nargs="+", default=[8, 32, 64, 128, 256], help="batch sizes")
    ap.add_argument("--stages", type=int, nargs="*", default=[],
                    help="also time each entry at these num_stages (deeper K/V pipelines), alone and with 2x splits")
    ap.add_argument("--fold", action="store_true", help="also time each entry with stage 1's rows folded")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096], help="tokens a request")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also time each entry at these split caps (in place of its programs_per_sm rule)")
    ap.add_argument("--change", nargs="*", default=[],
                    help='also time each entry with these changes: "NAME:key=value,..." '
                         '(e.g. "s8:kv_splits=8,maxnreg=128")')
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, one tiny case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    timed = not args.smoke
    dev = torch.device("cuda" if timed else "cpu")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if timed else 132
    kvs = [kv == "fp8" for kv in args.kv]
    cases = ([(fp8, dim, bs, ctx) for fp8 in kvs for dim in args.dims for bs in args.bs
              for ctx in args.contexts] if timed else [(fp8, 64, 9, 100) for fp8 in kvs])
    start, rows = time.time(), []
    for case in cases:
        if time.time() - start > args.budget_s:
            print("budget spent: stopping", flush=True)
            break
        rows += run_case(*case, entries_only=args.entries_only, num_sms=num_sms, dev=dev, timed=timed,
                         layout=args.layout, stages=args.stages, fold=args.fold, splits=args.splits,
                         changes=args.change)
    if timed:
        path = args.out or os.path.join(RESULTS, f"decode-entries-{device_tag(dev)}.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), pdl=os.environ.get("OSTINATO_PDL", "1"),
                           seconds=time.time() - start, rows=rows), f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
