"""How fast stage 1's reads alone can go: the split-KV decode kernel's grid (KV head, request, split), its split
bounds, its `req_to_token` reads and its K / V rows, with the softmax and the dots replaced by a sum of the
rows' 32-bit words (nothing widened: the least work a read can be given). Timed beside the decode kernel itself
(the table's entry) on the same buffers, in the engine's layout, so the gap between the two says how much of the
kernel's time is its reads and how much its work.

Each setting is `kv:block_n:warps:splits[:page]`: page 1 reads a table entry per key as the engine's
pages of 1 do; page 128 one per 128-slot run (the fp8 pool's slot groups), which also tells the compiler the
block's slots are consecutive. Every stream setting's sum is checked against torch's.

OSTINATO_PDL=0 python benchmarks/bench_kv_stream.py --bs 32 33 --contexts 4096 \\
    --settings fp8:32:1:4 fp8:64:1:4 bf16:32:1:2 [--out PATH]
python benchmarks/bench_kv_stream.py --smoke   # CPU, Triton's interpreter: one tiny case, checks the sums
"""

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_decode_entries import engine_kv_buffers  # noqa: E402
from common import RESULTS, copy_bandwidth, device_tag, replay_us  # noqa: E402

from ostinato.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from ostinato.attention.triton_ops.decode_attention import (  # noqa: E402
    compute_num_kv_splits,
    decode_attention,
    decode_kwargs,
    split_bounds,
    table_entry,
)
from ostinato.attention.triton_ops.paged_softmax import block_slots  # noqa: E402

KV_HEADS, HEADS, DIM = 8, 32, 64  # Llama-3.2-1B's attention


@triton.jit
def _kv_block(K_buf, V_buf, req_row, kv_head, n0, end, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
              WORDS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N's K and V rows of one KV head as 32-bit words, [BLOCK_N, WORDS] each (a whole
    block)."""
    slots, offs_n, n_mask = block_slots(req_row, n0, end, BLOCK_N, PAGE, MASK_N=False)
    offs_d = tl.arange(0, WORDS)
    k = tl.load(K_buf + slots[:, None] * stride_kbs + kv_head.to(tl.int64) * stride_kbh + offs_d[None, :])
    v = tl.load(V_buf + slots[:, None] * stride_vbs + kv_head.to(tl.int64) * stride_vbh + offs_d[None, :])
    return k, v


@triton.jit
def _kv_stream_kernel(K_buf, V_buf, Req_to_token, Seq_lens, Num_kv_splits, Out,
                      stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
                      WORDS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Out[b, kv_head, split] = the sum (mod 2**32) of the split's K and V rows as int32 words (stage 1's reads,
    nothing else; the buffers are int32 views, a row WORDS words). Splits are whole blocks (the caller's contexts
    are multiples of BLOCK_N)."""
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.load(Num_kv_splits + b)
    if split >= num_splits:
        return
    start, end, per_split = split_bounds(tl.load(Seq_lens + b), num_splits, split, BLOCK_N)
    req_row = Req_to_token + b * stride_r2t
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    # the next block's loads go out before this one is summed (Triton's pipeliner leaves loads that feed no dot
    # as plain loads waited on where used: sm_90 SASS has LDG, no LDGSTS), so a warp has one to two blocks in flight
    k, v = _kv_block(K_buf, V_buf, req_row, kv_head, start, end, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                     WORDS, BLOCK_N, PAGE)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        k_next, v_next = _kv_block(K_buf, V_buf, req_row, kv_head, n0, end, stride_kbs, stride_kbh, stride_vbs,
                                   stride_vbh, WORDS, BLOCK_N, PAGE)
        acc += k + v
        k, v = k_next, v_next
    acc += k + v
    tl.store(Out + (b * tl.num_programs(0) + kv_head) * tl.num_programs(2) + split, tl.sum(tl.sum(acc, 1), 0))


def parse_setting(spec: str) -> dict:
    """`kv:block_n:warps:splits[:page]` -> its fields (argparse's type: a clear error for a bad spec)."""
    parts = spec.split(":")
    try:
        assert parts[0] in ("fp8", "bf16") and len(parts) in (4, 5)
        block_n, warps, splits = (int(p) for p in parts[1:4])
        page = int(parts[4]) if len(parts) == 5 else 1
    except (AssertionError, ValueError):
        raise argparse.ArgumentTypeError(f"{spec!r}: want kv:block_n:warps:splits[:page], kv fp8 or bf16") from None
    if page not in (1, 128) or block_n not in (16, 32, 64, 128) or splits < 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: page 1 or 128, block_n 16-128 (a power of two), splits >= 1")
    return dict(spec=spec, fp8=parts[0] == "fp8", block_n=block_n, warps=warps, splits=splits,
                page=page)


class Buffers:
    """One layer's K / V in the engine's pool layout for the dtype (fp8 head-major in slot groups of 128, bf16
    token-major), random values, each request's slots contiguous from slot 128 (bench_decode_entries')."""

    def __init__(self, fp8: bool, bs: int, ctx: int, dtype: torch.dtype, dev: torch.device) -> None:
        self.k, self.v, self.req_to_token, _ = engine_kv_buffers(fp8, bs, ctx, KV_HEADS, DIM, dtype, dev)
        self.k_words, self.v_words = self.k.view(torch.int32), self.v.view(torch.int32)

    def runs_of(self, page: int) -> bool:
        """Whether each request's slot numbers are consecutive within every run of `page` tokens (what a table
        read per page assumes)."""
        steps = self.req_to_token[:, 1:] - self.req_to_token[:, :-1]
        inside = (torch.arange(1, self.req_to_token.shape[1], device=steps.device) % page) != 0
        return bool((steps[:, inside] == 1).all())

    def reference_sum(self) -> int:
        """Every request's K and V rows as int32 words, summed mod 2**32 by torch."""
        idx = self.req_to_token.flatten().long()
        return sum(w[idx].long().sum().item() for w in (self.k_words, self.v_words)) % 2**32


def stream_call(buf: Buffers, s: dict, seq_lens: torch.Tensor, num_splits: torch.Tensor, out: torch.Tensor):
    bs = seq_lens.shape[0]
    assert buf.runs_of(s["page"]), f"{s['spec']}: the pool's slot numbers are not consecutive within pages"

    def call() -> None:
        _kv_stream_kernel[(KV_HEADS, bs, s["splits"])](
            buf.k_words, buf.v_words, buf.req_to_token, seq_lens, num_splits, out, buf.k_words.stride(0),
            buf.k_words.stride(1), buf.v_words.stride(0), buf.v_words.stride(1), buf.req_to_token.stride(0),
            WORDS=buf.k_words.shape[2], BLOCK_N=s["block_n"], PAGE=s["page"], num_warps=s["warps"])
    return call


def attention_call(buf: Buffers, fp8: bool, bs: int, seq_lens: torch.Tensor, num_sms: int, dtype: torch.dtype,
                   dev: torch.device):
    """The decode kernel at the table's entry for bs, launched as the engine launches it (splits combined in stage
    1 where the engine combines them)."""
    entry = table_entry(TritonAttentionBackend.decode_table_for(DIM, fp8), bs)
    cap = TritonAttentionBackend.split_cap(bs, entry.get("programs_per_sm", 2), KV_HEADS, num_sms,
                                           TritonAttentionBackend.max_kv_splits)
    num_splits = torch.empty(bs, dtype=torch.int32, device=dev)
    compute_num_kv_splits(seq_lens, num_splits, entry.get("min_tokens_per_split",
                                                          TritonAttentionBackend.min_tokens_per_split), cap)
    q = torch.randn(bs, HEADS, DIM, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    mid_o = torch.empty(bs, HEADS, cap, DIM, device=dev)
    mid_lse = torch.empty(bs, HEADS, cap, device=dev)
    counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device=dev)
    combine = counters if TritonAttentionBackend.entry_combines(entry, bs) else None
    rows = torch.arange(bs, dtype=torch.int32, device=dev)
    fp8_args = {}
    if fp8:
        scale = torch.ones(1, device=dev)
        fp8_args = dict(kv_fp8=torch.float8_e4m3fn, k_scale=scale, v_scale=scale)

    def call() -> None:
        decode_attention(q, buf.k, buf.v, out, buf.req_to_token, rows, seq_lens, num_splits, mid_o, mid_lse,
                         DIM**-0.5, counters=combine, **fp8_args,
                         **(dict(block_n=TritonAttentionBackend.decode_block_n) | decode_kwargs(entry)))
    return call, cap


def run_case(bs: int, ctx: int, settings: list[dict], num_sms: int, dev: torch.device, timed: bool) -> list[dict]:
    dtype = torch.bfloat16 if timed else torch.float32
    rows = []
    for fp8 in sorted({s["fp8"] for s in settings}, reverse=True):
        buf = Buffers(fp8, bs, ctx, dtype, dev)
        kv_bytes = bs * ctx * KV_HEADS * DIM * 2 * buf.k.element_size()
        seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        ref = buf.reference_sum()
        attn, cap = attention_call(buf, fp8, bs, seq_lens, num_sms, dtype, dev)
        cases = [("entry", attn, cap)]
        for s in (s for s in settings if s["fp8"] == fp8):
            assert ctx % (s["block_n"] * s["splits"]) == 0, f"{s['spec']}: ctx {ctx} in whole blocks a split"
            num_splits = torch.full((bs,), s["splits"], dtype=torch.int32, device=dev)
            out = torch.empty(bs * KV_HEADS * s["splits"], dtype=torch.int32, device=dev)
            call = stream_call(buf, s, seq_lens, num_splits, out)
            call()
            got = out.long().sum().item() % 2**32
            assert got == ref, f"{s['spec']}: stream sum {got} against torch's {ref}"
            cases.append((s["spec"], call, s["splits"]))
        for name, call, splits in cases:
            row = dict(kv="fp8_e4m3" if fp8 else "bf16", bs=bs, ctx=ctx, setting=name, splits=splits,
                       programs=bs * KV_HEADS * splits)
            if timed:
                graph = torch.cuda.CUDAGraph()
                call()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        call()
                row["us"] = replay_us(graph, 20)
                row["kv_tbps"] = kv_bytes / row["us"] / 1e6
            rows.append(row)
            print(f"{row['kv']:9} bs {bs:3} ctx {ctx:5} {name:18} splits {splits:2} programs {row['programs']:5} "
                  f"{row.get('us', 0):8.2f} us {row.get('kv_tbps', 0):5.2f} TB/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--settings", type=parse_setting, nargs="+",
                    default=[parse_setting(s) for s in ("fp8:64:1:4", "bf16:32:1:2")],
                    help="kv:block_n:warps:splits[:page]")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, one tiny case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    timed = not args.smoke
    dev = torch.device("cuda" if timed else "cpu")
    if not timed:
        args.bs, args.contexts = [4], [128]
        args.settings = [parse_setting(s) for s in ("fp8:32:1:4", "fp8:32:1:2:128", "bf16:64:1:2")]
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if timed else 8
    start = time.time()
    copy = copy_bandwidth(dev) if timed else 0.0
    print(f"device copy rate {copy / 1e12:.2f} TB/s", flush=True)
    rows = [r for bs in args.bs for ctx in args.contexts
            for r in run_case(bs, ctx, args.settings, num_sms, dev, timed)]
    if timed:
        path = args.out or os.path.join(RESULTS, f"kv-stream-{device_tag(dev)}.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), pdl=os.environ.get("OSTINATO_PDL", "1"),
                           copy_tbps=copy / 1e12, seconds=time.time() - start, rows=rows), f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
