"""Rotary (with Qwen3's q/k norm) fused with the K/V store (`attention/triton_ops/rope_store.py`) against
rotary-then-store: the torch twins (`rotary_embedding_torch`, `KVCache.set_kv_buffer`) and the unfused Triton
kernels. Without a GPU the kernels run in Triton's interpreter at tiny shapes."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402
from test_triton_attention import make_batch, make_env, new_requests  # noqa: E402

from ostinato.attention.base import Rope  # noqa: E402
from ostinato.attention.forward_batch import ForwardMode  # noqa: E402
from ostinato.attention.triton_ops import rope_store_kv, store_kv  # noqa: E402
from ostinato.layers import triton_ops  # noqa: E402
from ostinato.layers.rotary import rotary_embedding_torch  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
EPS = 1e-6
MAX_POS = 4096
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def llama3_table(head_dim: int) -> torch.Tensor:
    """The model's own fp32 cos/sin table for Llama-3's scaled rope."""
    import transformers

    from ostinato.layers.rotary import RotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
    return RotaryEmbedding(config, head_dim, MAX_POS).cos_sin.to(DEVICE)


def setup(page: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, cache_dtype: torch.dtype,
          qk_norm: bool, seed: int, mode: ForwardMode, decode_prefix: tuple[int, ...] = (0, 13, 40, 7, 29)):
    """A pool full of random bytes, a batch whose new tokens got scattered slots, pre-rope q/k/v as strided views
    of one qkv tensor, positions all over the table, and (Qwen3) q/k norm weights."""
    env = make_env(page, heads, kv_heads, dim, dtype=dtype, device=DEVICE, seed=seed, cache_dtype=cache_dtype,
                   slots=512, max_ctx=128)
    if cache_dtype in FP8:
        env.cache.set_scales({0: (0.37, 1.9)})
    gen = env.gen
    for buf in env.cache.get_store_buffer(0):  # never zeros: a write to a wrong slot must show
        if buf.dtype == torch.uint8:
            buf.copy_(torch.randint(0, 120, buf.shape, generator=gen, device=DEVICE, dtype=torch.uint8))
        else:
            buf.copy_(torch.randn(buf.shape, generator=gen, device=DEVICE))
    if mode is ForwardMode.DECODE:
        prefix, new = list(decode_prefix), [1] * len(decode_prefix)
    else:
        prefix, new = [0, 9, 21], [6, 3, 11]
    rows = new_requests(env, [0] * len(prefix))
    for r, p in zip(rows, prefix, strict=True):  # the prefixes' slots exist but keep their random bytes
        if p:
            env.kv.extend(r, 0, p)
    batch = make_batch(env, mode, rows, prefix, new)
    t = batch.num_tokens
    positions = torch.randint(0, MAX_POS, (t,), generator=gen, device=DEVICE)
    positions[0] = 0
    q_size, kv_size = heads * dim, kv_heads * dim
    qkv = (torch.randn(t, q_size + 2 * kv_size, generator=gen, device=DEVICE) * 2).to(dtype)
    q = qkv[:, :q_size].view(t, heads, dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, kv_heads, dim)
    v = qkv[:, q_size + kv_size :].view(t, kv_heads, dim)
    norm = (None, None)
    if qk_norm:
        norm = tuple((torch.randn(dim, generator=gen, device=DEVICE) * 0.1 + 1).to(dtype) for _ in range(2))
    return env, batch, positions, qkv, (q, k, v), norm


def fused(env, batch, positions, qkv_views, norm, table) -> torch.Tensor:
    q, k, v = qkv_views
    k_buf, v_buf = env.cache.get_store_buffer(0)
    return rope_store_kv(positions, q, k, v, table, k_buf, v_buf, batch.out_cache_loc, *norm, EPS, env.tri.kv_fp8,
                         env.cache.k_scale(0), env.cache.v_scale(0))


CASES = [  # page, heads, kv_heads, dim, model dtype, cache dtype, qk_norm, mode
    (1, 4, 2, 16, torch.float32, torch.float32, False, ForwardMode.DECODE),
    (16, 8, 2, 32, torch.float32, torch.float32, True, ForwardMode.DECODE),
    (16, 4, 2, 16, torch.float16, torch.float16, True, ForwardMode.DECODE),
    (1, 4, 1, 16, torch.float32, torch.float8_e4m3fn, False, ForwardMode.DECODE),
    (16, 4, 2, 16, torch.float16, torch.float8_e4m3fn, True, ForwardMode.DECODE),
    (16, 6, 2, 16, torch.float32, torch.float8_e5m2, True, ForwardMode.EXTEND),
    (1, 4, 4, 16, torch.float32, torch.float16, False, ForwardMode.EXTEND),
]


cuda = pytest.mark.skipif(not GPU, reason="needs CUDA")
CUDA_CASES = [  # the models' shapes in bf16: Llama-3.2-1B (bf16 and fp8 caches), Qwen3-0.6B (q/k norm)
    pytest.param(16, 32, 8, 64, torch.bfloat16, torch.bfloat16, False, ForwardMode.DECODE, marks=cuda),
    pytest.param(1, 32, 8, 64, torch.bfloat16, torch.float8_e4m3fn, False, ForwardMode.EXTEND, marks=cuda),
    pytest.param(1, 16, 8, 128, torch.bfloat16, torch.bfloat16, True, ForwardMode.DECODE, marks=cuda),
    pytest.param(16, 16, 8, 128, torch.bfloat16, torch.float8_e4m3fn, True, ForwardMode.EXTEND, marks=cuda),
]


@pytest.mark.parametrize(("page", "heads", "kv_heads", "dim", "dtype", "cache_dtype", "qk_norm", "mode"),
                         CASES + CUDA_CASES)
def test_fused_equals_rotary_then_store(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, mode):
    seed = page + heads * 7 + dim + (cache_dtype in FP8) * 100 + qk_norm * 1000
    env, batch, positions, qkv, (q, k, v), norm = setup(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm,
                                                        seed, mode)
    table = llama3_table(dim)
    loc = batch.out_cache_loc
    qkv_before = qkv.clone()
    before = [b.clone() for b in env.cache.get_store_buffer(0)]

    q_out = fused(env, batch, positions, (q, k, v), norm, table)
    after_fused = [b.clone() for b in env.cache.get_store_buffer(0)]
    assert torch.equal(qkv, qkv_before)  # its inputs are read only
    assert q_out.shape == q.shape and q_out.dtype == dtype

    # the torch twin: rotary in place on copies, then the cache's indexed writes
    for buf, b in zip(env.cache.get_store_buffer(0), before, strict=True):
        buf.copy_(b)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_torch(positions, q_ref, k_ref, table, dim, *norm, EPS)
    env.cache.set_kv_buffer(0, loc, k_ref, v)
    after_ref = [b.clone() for b in env.cache.get_store_buffer(0)]
    torch.testing.assert_close(q_out, q_ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])

    # every slot of the pool but the written ones, by slot number (a grouped fp8 view's other rows alias them)
    numbers = env.cache.layout.numbers(torch.arange(env.cache.size, device=DEVICE))
    others = numbers[~torch.isin(numbers, loc)]
    for got, ref, orig in zip(after_fused, after_ref, before, strict=True):
        assert torch.equal(got[others], orig[others])  # every other slot untouched
        assert not torch.equal(got[loc], orig[loc])
        if cache_dtype in FP8:  # the same bytes but where the two rotations differ by an ulp at a rounding tie
            a, b = got[loc], ref[loc]
            differ = (a != b) & ~((a & 0x7F == 0) & (b & 0x7F == 0))  # -0.0 against +0.0 (a GPU conversion)
            assert differ.float().mean() < 0.02
            # at most one fp8 step apart as values (codes of tiny values across zero differ in the sign bit)
            fa, fb = a.view(cache_dtype).float(), b.view(cache_dtype).float()
            step = 0.125 if cache_dtype == torch.float8_e4m3fn else 0.25
            assert ((fa - fb).abs() <= step * torch.maximum(fa.abs(), fb.abs()) + 2**-6).all()
        else:
            torch.testing.assert_close(got[loc], ref[loc], atol=TOL[cache_dtype][0], rtol=TOL[cache_dtype][1])

    # the unfused Triton kernels (rotary in place, then store_kv): the same bits
    for buf, b in zip(env.cache.get_store_buffer(0), before, strict=True):
        buf.copy_(b)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    triton_ops.rotary_embedding_(positions, q2, k2, table, dim, *norm, EPS)
    k_buf, v_buf = env.cache.get_store_buffer(0)
    store_kv(k_buf, v_buf, loc, k2, v2, env.tri.kv_fp8, env.cache.k_scale(0), env.cache.v_scale(0))
    assert torch.equal(q_out, q2)
    for got, ref in zip(after_fused, env.cache.get_store_buffer(0), strict=True):
        assert torch.equal(got, ref)


X_RMS_CASES = [  # page, heads, kv_heads, dim, model dtype, cache dtype, qk_norm, mode, hidden
    (1, 4, 2, 16, torch.float32, torch.float32, False, ForwardMode.DECODE, 48),
    (16, 4, 2, 16, torch.float16, torch.float16, True, ForwardMode.DECODE, 64),
    (16, 6, 2, 16, torch.float16, torch.float8_e4m3fn, False, ForwardMode.EXTEND, 40),
    pytest.param(1, 32, 8, 64, torch.bfloat16, torch.bfloat16, False, ForwardMode.DECODE, 2048, marks=cuda),
    pytest.param(1, 16, 8, 128, torch.bfloat16, torch.bfloat16, True, ForwardMode.DECODE, 1024, marks=cuda),
]


def residual_rows(t: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A residual stream's rows, of very different scales (the inverse RMS varies row to row)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    scale = torch.rand(t, 1, generator=gen, device=DEVICE) * 20 + 0.05
    return (torch.randn(t, hidden, generator=gen, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize(("page", "heads", "kv_heads", "dim", "dtype", "cache_dtype", "qk_norm", "mode", "hidden"),
                         X_RMS_CASES)
def test_fused_with_deferred_input_norm(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, mode, hidden):
    """rope_store_kv with `x_rms` (the layer's input norm deferred: q, k, v scaled by each row's inverse RMS of
    the residual stream first) against the torch twin's scale (`scale_by_inv_rms`) then rope_store_kv. The scale's
    fp32 sum is taken in another order, so an element may round the other way: within the dtype's rounding."""
    from ostinato.layers.norm import scale_by_inv_rms

    seed = page + heads + dim + hidden
    env, batch, positions, qkv, (q, k, v), norm = setup(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm,
                                                        seed, mode)
    x = residual_rows(q.shape[0], hidden, dtype, seed)
    table = llama3_table(dim)
    loc = batch.out_cache_loc
    k_buf, v_buf = env.cache.get_store_buffer(0)
    before = [b.clone() for b in (k_buf, v_buf)]
    args = (env.tri.kv_fp8, env.cache.k_scale(0), env.cache.v_scale(0))
    got = rope_store_kv(positions, q, k, v, table, k_buf, v_buf, loc, *norm, EPS, *args, x_rms=x, x_rms_eps=EPS)
    kv_got = [b.clone() for b in (k_buf, v_buf)]
    for buf, b in zip((k_buf, v_buf), before, strict=True):
        buf.copy_(b)
    qs, ks, vs = scale_by_inv_rms(x, EPS, q, k, v)
    want = rope_store_kv(positions, qs, ks, vs, table, k_buf, v_buf, loc, *norm, EPS, *args)
    assert not torch.equal(qs, q)  # the scale did something
    tol = TOL[dtype][0]
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)
    for a, b in zip(kv_got, (k_buf, v_buf), strict=True):
        if cache_dtype in FP8:  # at most one fp8 step apart where the scaled value's rounding went the other way
            fa, fb = a.view(cache_dtype).float(), b.view(cache_dtype).float()
            assert ((fa - fb).abs() <= 0.125 * torch.maximum(fa.abs(), fb.abs()) + 2**-6).all()
        else:
            torch.testing.assert_close(a, b, atol=tol * b[loc].abs().max().item(), rtol=0)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_backend_fuses_and_matches_torch_backend(mode):
    """The wiring: TritonAttentionBackend.forward with a Rope (fused) against the torch backend's rotary then
    store, and against its own unfused path."""
    env, batch, positions, qkv, (q, k, v), norm = setup(4, 4, 2, 16, torch.float32, torch.float32, True, 5, mode)
    table = llama3_table(16)
    rope = Rope(positions, table, *norm, EPS)
    s, t = env.spec, batch.num_tokens
    before = [b.clone() for b in env.cache.get_store_buffer(0)]

    def run(backend, fuse: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for buf, b in zip(env.cache.get_store_buffer(0), before, strict=True):
            buf.copy_(b)
        backend.fuse_rope_store = fuse
        backend.init_forward_metadata(batch)
        x = qkv.clone()  # the unfused paths rotate q and k in place
        qs, ks = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        out = backend.forward(x[:, :qs], x[:, qs : qs + ks], x[:, qs + ks :], s, batch, rope)
        return out.view(t, s.num_heads, s.head_dim), [b.clone() for b in env.cache.get_store_buffer(0)]

    out_fused, kv_fused = run(env.tri, True)
    out_unfused, kv_unfused = run(env.tri, False)
    out_ref, kv_ref = run(env.ref, False)
    torch.testing.assert_close(out_fused, out_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(out_fused, out_unfused, atol=1e-5, rtol=0)
    for a, b, c in zip(kv_fused, kv_unfused, kv_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


DECODE_ROPE_CASES = [  # page, heads, kv_heads, dim, model dtype, cache dtype, qk_norm, combined in stage 1
    (1, 4, 2, 16, torch.float32, torch.float32, False, False),
    (4, 8, 2, 32, torch.float32, torch.float32, True, True),
    (4, 4, 2, 16, torch.float16, torch.float16, True, False),
    (1, 4, 1, 16, torch.float16, torch.float8_e4m3fn, False, True),
    (4, 6, 2, 16, torch.float32, torch.float8_e5m2, True, False),
    pytest.param(1, 32, 8, 64, torch.bfloat16, torch.bfloat16, False, False, marks=cuda),  # Llama-3.2-1B
    pytest.param(16, 32, 8, 64, torch.bfloat16, torch.float8_e4m3fn, False, True, marks=cuda),
    pytest.param(1, 16, 8, 128, torch.bfloat16, torch.bfloat16, True, True, marks=cuda),  # Qwen3-0.6B
    pytest.param(1, 16, 8, 128, torch.bfloat16, torch.float8_e4m3fn, True, False, marks=cuda),
]


@pytest.mark.parametrize(("page", "heads", "kv_heads", "dim", "dtype", "cache_dtype", "qk_norm", "combine"),
                         DECODE_ROPE_CASES)
def test_decode_stage1_rope_store_equals_rope_store_kernel(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm,
                                                           combine):
    """rope_attend (stage 1 rotates q and stores the new K/V) against rope_store_kv then the decode kernel: the
    same output and cache, bit for bit in the interpreter (on the GPU to the dtype's rounding). Seq lens 1 to 80
    with at most 4 splits, so at 80 the new token's split is not the last one (that one is empty), and the torch
    backend as the reference."""
    check_rope_attend(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, combine)


@pytest.mark.parametrize(("page", "heads", "kv_heads", "dim", "dtype", "cache_dtype", "qk_norm", "combine"), [
    (4, 8, 2, 32, torch.float32, torch.float32, True, True),
    (1, 4, 1, 16, torch.float16, torch.float8_e4m3fn, False, True),
    pytest.param(1, 32, 8, 64, torch.bfloat16, torch.bfloat16, False, True, marks=cuda),
    pytest.param(1, 16, 8, 128, torch.bfloat16, torch.float8_e4m3fn, True, False, marks=cuda)])
def test_decode_stage1_rope_store_with_folded_rows(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, combine):
    """The same with stage 1's rows folded over the keys (every settings entry with `fold`): each query head is
    rotated once per chunk, and the new token's K/V stored once."""
    check_rope_attend(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, combine, fold=True)


@pytest.mark.parametrize(("page", "heads", "kv_heads", "dim", "dtype", "cache_dtype", "qk_norm", "combine", "hidden"),
                         [(1, 4, 2, 16, torch.float32, torch.float32, False, True, 48),
                          (4, 8, 2, 32, torch.float16, torch.float16, True, False, 64),
                          (1, 4, 1, 16, torch.float16, torch.float8_e4m3fn, False, True, 40),
                          pytest.param(1, 32, 8, 64, torch.bfloat16, torch.bfloat16, False, True, 2048, marks=cuda),
                          pytest.param(1, 16, 8, 128, torch.bfloat16, torch.bfloat16, True, True, 1024, marks=cuda)])
def test_decode_stage1_rope_store_with_deferred_input_norm(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm,
                                                          combine, hidden):
    """The same with the layer's input norm deferred (Rope.x_rms): stage 1 scales q and the new K/V by the row's
    inverse RMS as rope_store_kv does; the torch backend's reference scales them in torch first."""
    check_rope_attend(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, combine, x_rms_cols=hidden)


def check_rope_attend(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, combine, fold=False, x_rms_cols=0):
    seed = page + heads + dim + (cache_dtype in FP8) * 100 + qk_norm * 1000 + combine + x_rms_cols
    env, batch, positions, qkv, (q, k, v), norm = setup(page, heads, kv_heads, dim, dtype, cache_dtype, qk_norm, seed,
                                                        ForwardMode.DECODE, decode_prefix=(0, 13, 79, 7, 40))
    x = residual_rows(q.shape[0], x_rms_cols, dtype, seed) if x_rms_cols else None
    if fold:
        env.tri.decode_table = {bs: e | dict(fold=True) for bs, e in env.tri.decode_table.items()}
    env.tri.max_kv_splits = 4
    env.tri.decode_rope_max_bs = 8
    env.tri.combine_min_bs = 1 if combine else 10**9
    env.tri.fuse_rope_store = True
    rope = Rope(positions, llama3_table(dim), *norm, EPS, x, EPS)
    s = env.spec
    qs, ks = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    before = [b.clone() for b in env.cache.get_store_buffer(0)]

    def run(fn):
        for buf, b in zip(env.cache.get_store_buffer(0), before, strict=True):
            buf.copy_(b)
        env.tri.init_forward_metadata(batch)
        x = qkv.clone()
        out = fn(x[:, :qs], x[:, qs : qs + ks], x[:, qs + ks :])
        assert torch.equal(x, qkv)  # the inputs are read only
        return out, [b.clone() for b in env.cache.get_store_buffer(0)]

    got, kv_got = run(lambda q, k, v: env.tri.rope_attend(q, k, v, s, batch, rope))
    want, kv_want = run(lambda q, k, v: env.tri.forward(q, k, v, s, batch, rope))
    assert env.tri.num_kv_splits.tolist() == [1, 1, 4, 1, 3]
    assert not env.tri.decode_counters.any()
    if not GPU:  # the interpreter computes both the same way
        assert torch.equal(got, want)
        for a, b in zip(kv_got, kv_want, strict=True):
            assert torch.equal(a, b)
    else:  # compiled, the q/k norm's sum and fp32 contractions may differ between the two kernels' layouts
        torch.testing.assert_close(got, want, atol=TOL[dtype][0] * want.abs().max().item(), rtol=0)
        for a, b in zip(kv_got, kv_want, strict=True):
            if cache_dtype in FP8:  # at most one fp8 step apart, rarely (a rounding tie decided the other way)
                assert (a != b).float().mean() < 0.02
                fa, fb = a.view(cache_dtype).float(), b.view(cache_dtype).float()
                step = 0.125 if cache_dtype == torch.float8_e4m3fn else 0.25
                assert ((fa - fb).abs() <= step * torch.maximum(fa.abs(), fb.abs()) + 2**-6).all()
            else:
                torch.testing.assert_close(a, b, atol=TOL[cache_dtype][0], rtol=TOL[cache_dtype][1])
    if cache_dtype in FP8:  # random cache bytes make scores of hundreds: a softmax the fp16 dots' rounding moves
        return  # (the fp8 kernels' accuracy: test_fp8_kv.py, test_fp8_decode_variants.py)
    env.ref.init_forward_metadata(batch)
    ref, _ = run(lambda q, k, v: env.ref.forward(q, k, v, s, batch, rope))
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=0)


def test_rope_attend_declines_what_it_does_not_fuse():
    """None (the caller stores, then attends) for extend steps, batches over decode_rope_max_bs, and with the
    fused store off."""
    env, batch, positions, qkv, (q, k, v), norm = setup(1, 4, 2, 16, torch.float32, torch.float32, False, 9,
                                                        ForwardMode.DECODE)
    rope, s = Rope(positions, llama3_table(16), *norm, EPS), env.spec
    env.tri.fuse_rope_store = True
    env.tri.init_forward_metadata(batch)
    env.tri.decode_rope_max_bs = 4  # the batch has 5 rows
    assert env.tri.rope_attend(q.flatten(1), k.flatten(1), v.flatten(1), s, batch, rope) is None
    env.tri.decode_rope_max_bs = None  # the cap by head dim: 4 for a dim (16) the table does not name
    assert env.tri.rope_attend(q.flatten(1), k.flatten(1), v.flatten(1), s, batch, rope) is None
    env.tri.decode_rope_max_bs_by_dim = {16: 8}
    assert env.tri.rope_attend(q.flatten(1), k.flatten(1), v.flatten(1), s, batch, rope) is not None
    env.tri.decode_rope_max_bs = 8
    env.tri.fuse_rope_store = False
    assert env.tri.rope_attend(q.flatten(1), k.flatten(1), v.flatten(1), s, batch, rope) is None
    ext = setup(1, 4, 2, 16, torch.float32, torch.float32, False, 9, ForwardMode.EXTEND)
    env.tri.fuse_rope_store = True
    assert env.tri.rope_attend(q.flatten(1), k.flatten(1), v.flatten(1), s, ext[1], rope) is None
    assert env.ref.rope_attend(q.flatten(1), k.flatten(1), v.flatten(1), s, batch, rope) is None


# ---------------------------------------------------------------- the engine: greedy tokens fused vs unfused
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_engine_greedy_tokens_equal_fused_and_unfused(model, request, tmp_path):
    """The Triton backend (the interpreter on a CPU), 3 prompts: greedy tokens with the fused rotary + store, and
    with decode's rotary + store inside the decode kernel, equal the unfused path's, eagerly and (Qwen3) through
    decode graphs (the CPU stand-in re-runs the captured step)."""
    import json

    from ostinato import LLM
    from ostinato.graphs.decode import DecodeGraphRunner
    from ostinato.sampling_params import SamplingParams

    if model == "tiny-llama":  # tests/tiny_llama.py: seeded HF weights
        path, kw = request.getfixturevalue("tiny_llama_path"), {}
    else:  # Qwen3's q/k norm, dummy weights
        path = tmp_path / "qwen3.json"
        path.write_text(json.dumps(TINY_QWEN3))
        path, kw = str(path), {"load_format": "dummy"}
    llm = LLM(path, device=DEVICE, dtype="float32", attention_backend="triton", max_total_tokens=1024,
              page_size=4, max_running_requests=4, cuda_graph_bs=[4], extend_cuda_graph_max_tokens=0,
              disable_cuda_graph=True, disable_radix_cache=True,  # eager until the graphs are attached
              sampler_warm_up="temperature", **kw)
    runner = llm.engine.runner
    backend = runner.backend
    calls = []
    fused_call = backend.rope_store_kv
    backend.rope_store_kv = lambda *a: calls.append(a[0]) or fused_call(*a)
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=gen).tolist()} for n in (3, 9, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    in_stage1 = []
    rope_attend = backend.rope_attend
    backend.rope_attend = lambda *a: (lambda out: in_stage1.append(out is not None) or out)(rope_attend(*a))

    backend.fuse_rope_store = False
    unfused = tokens()
    assert not calls and not any(in_stage1)
    backend.fuse_rope_store, backend.decode_rope_max_bs = True, 0
    fused = tokens()
    assert len(calls) == 2 * 4  # every layer of every step (1 extend + 3 decodes) took the fused kernel
    assert fused == unfused
    calls.clear()
    in_stage1.clear()
    backend.decode_rope_max_bs = 4
    assert tokens() == unfused  # decode steps of 3 rows: rotary and the store in the decode kernel
    assert len(calls) == 2 and in_stage1.count(True) == 2 * 3
    if model == "tiny-qwen3":  # and through decode graphs captured fused (on a CPU, the stand-in; one model is enough)
        runner.graph_runner = DecodeGraphRunner(runner)
        assert tokens() == unfused
    llm.engine.check_memory_leak()
    llm.shutdown()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_engine_greedy_tokens_with_the_input_norm_deferred(model, request, tmp_path, monkeypatch):
    """Each layer's input norm deferred (layers/norm_linear.defers_input_norm, forced here at every step and on the
    CPU, where the Triton backend runs in the interpreter): the previous layer's down adds the residual, qkv projects
    the bare stream, and the rotary + KV store (prefill) and stage 1 (decode) scale q, k and v by the row's inverse
    RMS. Greedy tokens equal the norm's own launch's, and top logprobs agree to fp32 rounding."""
    import json

    from ostinato import LLM
    from ostinato.layers import norm_linear
    from ostinato.models import llama
    from ostinato.sampling_params import SamplingParams

    if model == "tiny-llama":
        path, kw = request.getfixturevalue("tiny_llama_path"), {}
    else:
        path = tmp_path / "qwen3.json"
        path.write_text(json.dumps(TINY_QWEN3))
        path, kw = str(path), {"load_format": "dummy"}
    llm = LLM(path, device=DEVICE, dtype="float32", attention_backend="triton", max_total_tokens=1024, page_size=4,
              max_running_requests=4, extend_cuda_graph_max_tokens=0, disable_cuda_graph=True,
              disable_radix_cache=True, sampler_warm_up="temperature", **kw)
    backend = llm.engine.runner.backend
    backend.fuse_rope_store, backend.decode_rope_max_bs = True, 4
    seen = []
    monkeypatch.setattr(llama, "down_add_residual", lambda *a: seen.append(1) or norm_linear.down_add_residual(*a))
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=gen).tolist()} for n in (7, 4, 11)]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)

    def run():
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]

    want_tokens, want_lp = run()
    assert not seen
    monkeypatch.setattr(llama, "defers_input_norm", lambda x, *a: True)
    got_tokens, got_lp = run()
    assert len(seen) == 2 * 5  # every layer (2) of every step (1 prefill + 4 decodes)
    assert got_tokens == want_tokens
    for g, w in zip(got_lp, want_lp, strict=True):
        for gs, ws in zip(g, w, strict=True):
            assert gs.keys() == ws.keys()
            for t in gs:
                assert abs(gs[t].logprob - ws[t].logprob) < 1e-4
    llm.engine.check_memory_leak()
    llm.shutdown()
