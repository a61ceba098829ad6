"""HBM read rate of a paged KV gather by chunk size: what a decode kernel can read when each token's K (or V) for
one KV head is a CHUNK-byte piece at a random slot (page 1, shuffled), with no attention math at all.

A bf16 cache of 64-dim heads gives 128-byte pieces, an fp8 one 64-byte pieces. "one" reads one buffer; "split"
a piece of a K and of a V buffer per token (the cache's layout: each buffer's slot row is heads x chunk bytes);
"interleaved" both pieces from one buffer whose slot row holds K's heads then V's (rows twice as long). Each
program streams BLOCK tokens at a time through a loop (as the decode kernel's key loop does) and sums the
pieces, so only the reads cost. Reported: TB/s of pieces read, beside the device copy bandwidth.

python benchmarks/bench_gather_granularity.py [--out PATH]
"""

import argparse

import torch
import triton
import triton.language as tl
from common import RESULTS, copy_bandwidth, device_tag, replay_us, write_report


@triton.jit
def _gather_sum_kernel(Buf, Buf2, Slots, Out, n_tokens, stride_slot, second_off, CHUNK: tl.constexpr,
                       BLOCK: tl.constexpr, TOKENS_PER_PROG: tl.constexpr, PAIR: tl.constexpr):
    """PAIR: each token's piece of Buf and its piece `second_off` bytes further in Buf2 (K and V)."""
    pid = tl.program_id(0)
    head_off = tl.program_id(1) * CHUNK
    offs_c = tl.arange(0, CHUNK)
    acc = tl.zeros([BLOCK, CHUNK], dtype=tl.int32)
    start = pid * TOKENS_PER_PROG
    for t0 in range(start, start + TOKENS_PER_PROG, BLOCK):
        offs_t = t0 + tl.arange(0, BLOCK)
        slots = tl.load(Slots + offs_t, mask=offs_t < n_tokens, other=0).to(tl.int64)
        ptrs = slots[:, None] * stride_slot + head_off + offs_c[None, :]
        acc += tl.load(Buf + ptrs).to(tl.int32)
        if PAIR:
            acc += tl.load(Buf2 + second_off + ptrs).to(tl.int32)
    tl.store(Out + pid * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


def time_gather(chunk: int, heads: int, tokens: int, block: int, per_prog: int, kv: str = "one",
                iters: int = 20) -> float:
    """us per gather of `tokens` pieces per head, `heads` heads of `chunk` bytes a slot (rows of chunk * heads).
    kv "one": one buffer; "split": a K and a V buffer, a piece of each per token (the cache's layout today);
    "interleaved": one buffer whose slot row holds K's heads then V's, both pieces read."""
    row = heads * chunk
    buf = torch.randint(0, 255, (tokens + 1, row * (2 if kv == "interleaved" else 1)), dtype=torch.uint8,
                        device="cuda")
    buf2 = torch.randint(0, 255, (tokens + 1, row), dtype=torch.uint8, device="cuda") if kv == "split" else buf
    slots = (torch.randperm(tokens, device="cuda") + 1).to(torch.int32)
    grid = (triton.cdiv(tokens, per_prog), heads)
    out = torch.empty(grid[0] * heads, dtype=torch.int32, device="cuda")

    def run() -> None:
        _gather_sum_kernel[grid](buf, buf2, slots, out, tokens, buf.stride(0), row if kv == "interleaved" else 0,
                                 CHUNK=chunk, BLOCK=block, TOKENS_PER_PROG=per_prog, PAIR=kv != "one",
                                 num_warps=2, num_stages=4)

    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            run()
    return replay_us(g, iters, reps=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32 * 4096, help="tokens (bs 32 x 4096); kv one: twice as many")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = []
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s")
    print("chunk B  heads  kv           block  us      TB/s   of copy")
    cases = [(c, h, "one") for c, h in ((64, 8), (128, 8), (256, 8), (64, 16), (128, 4))]
    cases += [(64, 8, "split"), (64, 8, "interleaved"), (128, 8, "split"), (128, 8, "interleaved")]
    for chunk, heads, kv in cases:
        for block in (32, 64, 128):
            if chunk * block > 16384:  # a [block, chunk] int32 sum spills
                continue
            us = time_gather(chunk, heads, a.tokens, block, per_prog=2048, kv=kv)
            tbps = a.tokens * heads * chunk * (1 if kv == "one" else 2) / us / 1e6
            rows.append(dict(chunk=chunk, heads=heads, kv=kv, block=block, us=us, tbps=tbps,
                             frac_of_copy=tbps * 1e12 / bw))
            print(f"{chunk:7}  {heads:5}  {kv:11}  {block:5}  {us:6.1f}  {tbps:5.2f}  {tbps * 1e12 / bw:6.1%}",
                  flush=True)
    report = dict(device=torch.cuda.get_device_name(dev), tokens=a.tokens, copy_bandwidth_TBps=bw / 1e12, rows=rows)
    write_report(report, a.out or f"{RESULTS}/gather-granularity-{device_tag(dev)}.json")


if __name__ == "__main__":
    main()
