"""benchmarks/fused_attn_o_bs1.py's attention + o_proj kernel (an experiment timed in the step): its sum equals the
engine's rope_attend (stage 1 with rotary, the K/V store and the deferred input norm, then stage 2) followed by the
o projection, and it stores the same K/V bits, in Triton's interpreter."""

import os
import shutil
import sys

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402
from test_rope_store import DEVICE, EPS, llama3_table, residual_rows, setup  # noqa: E402

from ostinato.attention.base import Rope  # noqa: E402
from ostinato.attention.forward_batch import ForwardMode  # noqa: E402
from ostinato.attention.triton_ops.decode_attention import NewTokens  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from fused_attn_o_bs1 import attn_o  # noqa: E402


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "qk_norm", "hidden", "prefix", "fold"), [
    (8, 2, 32, False, 64, 40, False),   # Llama's GQA group of 4, the deferred input norm, one partial block
    (4, 2, 64, True, 0, 79, False),     # Qwen3's group of 2 with q/k norm, a whole block and a partial one
    (8, 2, 32, False, 0, 63, True),     # the folded rows, one whole block
])
def test_attn_o_equals_rope_attend_then_o_proj(heads, kv_heads, dim, qk_norm, hidden, prefix, fold):
    seed = heads + dim + prefix + qk_norm
    dtype = torch.float32
    env, batch, positions, qkv, (q, k, v), norm = setup(1, heads, kv_heads, dim, dtype, dtype, qk_norm, seed,
                                                        ForwardMode.DECODE, decode_prefix=(prefix,))
    x = residual_rows(1, hidden, dtype, seed) if hidden else None
    rope = Rope(positions, llama3_table(dim), *norm, EPS, x, EPS)
    gen = torch.Generator(DEVICE).manual_seed(seed)
    n_out, bn = 40, 16  # three row chunks, the last one partial
    wo = torch.randn(n_out, heads * dim, generator=gen, device=DEVICE) / (heads * dim) ** 0.5
    y0 = torch.randn(n_out, generator=gen, device=DEVICE)  # the kernel adds into it
    y_zero = torch.randn(n_out, generator=gen, device=DEVICE)
    s = env.spec
    qs, ks = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    bufs = env.cache.get_store_buffer(0)
    before = [b.clone() for b in bufs]

    env.tri.fuse_rope_store = True
    env.tri.init_forward_metadata(batch)
    a = env.tri.rope_attend(qkv[:, :qs].clone(), qkv[:, qs : qs + ks].clone(), qkv[:, qs + ks :].clone(), s, batch,
                            rope)
    kv_want = [b.clone() for b in bufs]
    for buf, b in zip(bufs, before, strict=True):
        buf.copy_(b)

    y = y0.clone()
    new = NewTokens(positions, batch.out_cache_loc, k.clone(), v.clone(), rope.cos_sin, *norm, EPS, x, EPS)
    attn_o(q.clone(), new, *bufs, env.tri.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
           s.scaling, wo, y, y_zero, bn=bn, fold=fold, block_n=64, early_kv=0)

    for got, want in zip(bufs, kv_want, strict=True):  # the new token's K/V: the same bits in the interpreter
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        else:  # compiled, the q/k norm's sum may run in another order in the two kernels' layouts
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert any(not torch.equal(b, w) for b, w in zip(before, kv_want, strict=True))
    want = y0.double() + a.double()[0] @ wo.double().T
    # one split against the engine's several: the softmax sums in another order
    torch.testing.assert_close(y.double(), want, atol=1e-4 * want.abs().max().item(), rtol=0)
    assert torch.equal(y_zero, torch.zeros_like(y_zero))
