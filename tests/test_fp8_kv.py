"""fp8 KV cache (stored as uint8, per-layer scales) and paged kernels: the store round-trips within fp8
precision, the Triton kernels (the interpreter on a CPU) read the 1-byte cache as the torch backend does,
page sizes 1 / 4 / 16 / 32 agree, checkpoint scale names are picked up."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_triton_attention import check, make_batch, make_env, new_requests, qkv, randn, run_triton  # noqa: E402

from ostinato.attention.forward_batch import ForwardMode  # noqa: E402
from ostinato.attention.triton_ops import store_kv  # noqa: E402
from ostinato.loader.kv_scales import KVScaleFilter  # noqa: E402
from ostinato.mem.kv_cache import MHATokenToKVPool  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# relative spacing of fp8 numbers: 3 mantissa bits (e4m3), 2 (e5m2); round to nearest: half of it
REL = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


@pytest.mark.parametrize("dtype", FP8)
def test_store_round_trips_within_fp8_precision(dtype):
    gen = torch.Generator().manual_seed(1)
    pool = MHATokenToKVPool(64, dtype, head_num=2, head_dim=16, layer_num=2, device="cpu")
    pool.set_scales({1: (0.05, 3.0)})
    assert pool.store_dtype == torch.uint8 and pool.k_buffer[1].dtype == torch.uint8
    k = torch.randn(20, 2, 16, generator=gen) * 4
    v = torch.randn(20, 2, 16, generator=gen) * 400
    v[0, 0, 0] = 1e7  # past max * v_scale: saturates, never inf / nan
    k[1, 0, :8] = torch.tensor([124.0, 100.0, 127.9, -0.0, 1e-4, -3e-3, 2**-10, 460.0]) * 0.05  # carries, ties
    loc = torch.randperm(63, generator=gen)[:20] + 1
    pool.set_kv_buffer(1, loc, k, v)
    kr, vr = pool.read_kv(1, loc, torch.float32)
    tiny = 0.05 * 2.0**-9 if dtype == torch.float8_e4m3fn else 0.05 * 2.0**-16  # subnormal step x scale
    assert torch.all((kr - k).abs() <= REL[dtype] * k.abs() + tiny)
    assert vr[0, 0, 0] == torch.finfo(dtype).max * 3.0
    top = torch.finfo(dtype).max * 3.0  # v beyond max * v_scale saturates
    vv, vrr = v.flatten()[1:].clamp(-top, top), vr.flatten()[1:]
    assert torch.all((vrr - vv).abs() <= REL[dtype] * vv.abs() + 3.0 * 2.0**-9)
    # the fused Triton store writes the same bytes as the torch reference
    kb, vb = torch.zeros_like(pool.k_buffer[1]), torch.zeros_like(pool.v_buffer[1])
    store_kv(kb, vb, loc, k, v, dtype, pool.k_scale(1), pool.v_scale(1))
    assert torch.equal(kb, pool.k_buffer[1]) and torch.equal(vb, pool.v_buffer[1])


def fp8_env(page: int, dtype: torch.dtype, seed: int):
    env = make_env(page, 4, 2, 16, seed=seed, cache_dtype=dtype)
    env.cache.set_scales({0: (0.5, 2.5)})
    return env


@pytest.mark.parametrize(("page", "dtype"), [(1, torch.float8_e4m3fn), (16, torch.float8_e4m3fn),
                                           (4, torch.float8_e5m2)])
def test_triton_kernels_on_fp8_cache_match_torch(page, dtype):
    """Triton store + decode + extend on a 1-byte cache with scales != 1 against the torch backend reading
    the same bytes (it dequantizes on the fly)."""
    env = fp8_env(page, dtype, seed=page)
    prefix, new = [0, 37], [21, 1]
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.EXTEND, rows, prefix, new)
    q, k, v = qkv(env, sum(new))
    out = run_triton(env, batch, q, k, v)
    assert torch.equal(env.cache.k_buffer[0][batch.out_cache_loc], env.cache.quantize(k, env.cache.k_scale(0)))
    check(env, batch, out, q, atol=1e-4)
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    batch = make_batch(env, ForwardMode.DECODE, rows, lens, [1] * 2)
    q, k, v = qkv(env, 2)
    check(env, batch, run_triton(env, batch, q, k, v), q, atol=1e-4)


@pytest.mark.parametrize("page", [4, 16, 32])
def test_paged_kernels_equal_page_one(page):
    """The same K/V and queries through pools of page `page` and of page 1: the same outputs (the kernels
    read one table entry per page, then consecutive slots)."""
    outs = []
    for p in (1, page):
        env = make_env(p, 4, 2, 16, seed=11)
        env.gen.manual_seed(5)
        rows = new_requests(env, [70, 3, 33])
        batch = make_batch(env, ForwardMode.DECODE, rows, [70, 3, 33], [1, 1, 1])
        q, k, v = qkv(env, 3)
        outs.append(run_triton(env, batch, q, k, v))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_checkpoint_kv_scale_names():
    t = torch.tensor
    weights = [
        ("model.layers.0.self_attn.k_scale", t(0.5)), ("model.layers.0.self_attn.v_scale", t([0.25])),
        ("model.layers.1.self_attn.kv_scale", t(2.0)),
        ("model.layers.2.self_attn.k_proj.output_scale", t(3.0)), ("model.layers.2.self_attn.attn.v_scale", t(4.0)),
        ("model.layers.3.self_attn.q_scale", t(9.0)), ("model.layers.0.self_attn.k_proj.weight", t([1.0])),
    ]
    f = KVScaleFilter(weights)
    assert [n for n, _ in f] == ["model.layers.0.self_attn.k_proj.weight"]
    assert f.layer_scales() == {0: (0.5, 0.25), 1: (2.0, 2.0), 2: (3.0, 4.0)}
    pool = MHATokenToKVPool(8, torch.float8_e4m3fn, 1, 4, 4, "cpu")
    pool.set_scales(f.layer_scales())
    assert pool.k_scale(2).item() == 3.0 and pool.v_scale(2).item() == 4.0 and pool.k_scale(3).item() == 1.0
    with pytest.raises(ValueError, match="layer 0"):
        pool.set_scales({0: (0.0, 1.0)})


def test_fp8_capacity_doubles():
    args = (8, 64, 16)
    assert MHATokenToKVPool.bytes_per_token(*args, torch.bfloat16) == \
        2 * MHATokenToKVPool.bytes_per_token(*args, torch.float8_e4m3fn)
    _ = randn  # (re-exported helper, unused here)
