"""bench_gather_granularity.py's kernel reads what it claims: each token's piece (and, paired, the V piece) of each
head at the token's slot, for the three layouts it times."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the benchmark's kernel is Triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_gather_granularity as bench  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only (CPU tensors)")
@pytest.mark.parametrize("kv", ["one", "split", "interleaved"])
def test_gather_kernel_sums_each_heads_pieces(kv):
    g = torch.Generator().manual_seed(len(kv))
    tokens, heads, chunk, per_prog = 64, 4, 32, 32
    row = heads * chunk
    buf = torch.randint(0, 255, (tokens + 1, row * (2 if kv == "interleaved" else 1)), generator=g,
                        dtype=torch.uint8)
    buf2 = torch.randint(0, 255, (tokens + 1, row), generator=g, dtype=torch.uint8) if kv == "split" else buf
    slots = (torch.randperm(tokens, generator=g) + 1).to(torch.int32)
    out = torch.empty(2 * heads, dtype=torch.int32)
    second = row if kv == "interleaved" else 0
    bench._gather_sum_kernel[(2, heads)](buf, buf2, slots, out, tokens, buf.stride(0), second, CHUNK=chunk,
                                         BLOCK=16, TOKENS_PER_PROG=per_prog, PAIR=kv != "one")
    want = []
    for p in range(2):
        s = slots[p * per_prog:(p + 1) * per_prog].long()
        for h in range(heads):
            total = buf[s, h * chunk:(h + 1) * chunk].long().sum()
            if kv != "one":
                cols = second + h * chunk + torch.arange(chunk)
                total += buf2.view(-1)[(s[:, None] * buf.stride(0) + cols).view(-1)].long().sum()
            want.append(total)
    assert out.tolist() == torch.stack(want).tolist()
