"""The torch backend over a paged cache against dense float64 attention."""

import pytest
import torch

from ostinato.attention.base import AttentionSpec
from ostinato.attention.forward_batch import ForwardBatch, ForwardMode
from ostinato.attention.torch_backend import TorchAttentionBackend
from ostinato.mem.kv_cache import MHATokenToKVPool
from ostinato.mem.kv_manager import KVManager
from ostinato.mem.req_to_token_pool import ReqToTokenPool
from ostinato.mem.token_allocator import TokenToKVPoolAllocator


def dense_attention(q, k, v, q_pos, scale):
    """q [n, H, D] at absolute positions q_pos; k/v [L, Hkv, D]; causal; float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def setup(page, heads=4, kv_heads=2, dim=16):
    gen = torch.Generator().manual_seed(page)
    kv = KVManager(ReqToTokenPool(8, 128, "cpu"), TokenToKVPoolAllocator(512, page, "cpu"))
    cache = MHATokenToKVPool(512, torch.float32, kv_heads, dim, 1, "cpu")
    backend = TorchAttentionBackend(kv.req_pool, cache)
    spec = AttentionSpec(0, heads, kv_heads, dim, dim**-0.5)
    return gen, kv, backend, spec


def run(backend, spec, kv, mode, slots, prefix, new, full_k, full_v, q_all):
    locs, qs, ks, vs = [], [], [], []
    for s, p, n, k, v, q in zip(slots, prefix, new, full_k, full_v, q_all, strict=True):
        locs.append(kv.extend(s, p, p + n))
        ks.append(k[p : p + n])
        vs.append(v[p : p + n])
        qs.append(q[p : p + n])
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    batch = ForwardBatch(
        mode, len(slots), torch.zeros(sum(new), dtype=torch.int64), torch.zeros(sum(new), dtype=torch.int64),
        torch.tensor(slots), torch.tensor(seq, dtype=torch.int32), torch.cat(locs),
        torch.tensor(new).cumsum(0) - 1, seq, list(prefix), list(new),
    )
    backend.init_forward_metadata(batch)
    H, Hk, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    out = backend.forward(torch.cat(qs).view(-1, H * D), torch.cat(ks).view(-1, Hk * D),
                          torch.cat(vs).view(-1, Hk * D), spec, batch)
    return out.view(-1, H, D)


@pytest.mark.parametrize("page", [1, 4])
def test_extend_with_cached_prefix_then_decode(page):
    gen, kv, backend, spec = setup(page)
    lens = [37, 5, 64]
    slots = [kv.req_pool.alloc() for _ in lens]
    q = [torch.randn(n + 1, 4, 16, generator=gen) for n in lens]
    k = [torch.randn(n + 1, 2, 16, generator=gen) for n in lens]
    v = [torch.randn(n + 1, 2, 16, generator=gen) for n in lens]
    # chunk 1: the first half of each prompt; chunk 2: the rest over the cached half; then one decode
    half = [n // 2 for n in lens]
    run(backend, spec, kv, ForwardMode.EXTEND, slots, [0] * 3, half, k, v, q)
    rest = [n - h for n, h in zip(lens, half, strict=True)]
    out = run(backend, spec, kv, ForwardMode.EXTEND, slots, half, rest, k, v, q)
    start = 0
    for i, (h, r) in enumerate(zip(half, rest, strict=True)):
        ref = dense_attention(q[i][h : h + r], k[i][: h + r], v[i][: h + r], torch.arange(h, h + r), spec.scaling)
        torch.testing.assert_close(out[start : start + r].double(), ref, atol=1e-5, rtol=1e-5)
        start += r
    out = run(backend, spec, kv, ForwardMode.DECODE, slots, lens, [1, 1, 1], k, v, q)
    for i, n in enumerate(lens):
        ref = dense_attention(q[i][n : n + 1], k[i], v[i], torch.tensor([n]), spec.scaling)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)
