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


def fp8_decode_reference(q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, req_to_token: torch.Tensor,
                         seq_lens: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """float64 decode attention of q [bs, H, D] over the dequantized fp8 K/V [slots, Hkv, D] each request's
    `req_to_token` row names (scaled by the layer's k/v scale): [bs, H, D]."""
    bs, heads, dim = q.shape
    group = heads // k8.shape[1]
    ref = torch.empty(bs, heads, dim, dtype=torch.float64)
    for b in range(bs):
        slots = req_to_token[b, : seq_lens[b]].long()
        kk = k8[slots].double().repeat_interleave(group, 1) * k_scale.double()
        vv = v8[slots].double().repeat_interleave(group, 1) * v_scale.double()
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), kk) * dim**-0.5, -1)
        ref[b] = torch.einsum("hn,nhd->hd", w, vv)
    return ref
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
    tiny = 0.05 * 2.0**-9 if dtype == torch.float8_e4m3fn else 0.05 * 2.0**-16  # subnormal step x scale
    top = torch.finfo(dtype).max * 3.0  # v beyond max * v_scale saturates

    def check_round_trip() -> None:
        kr, vr = pool.read_kv(1, loc, torch.float32)
        assert torch.all((kr - k).abs() <= REL[dtype] * k.abs() + tiny)
        assert vr[0, 0, 0] == top
        vv, vrr = v.flatten()[1:].clamp(-top, top), vr.flatten()[1:]
        assert torch.all((vrr - vv).abs() <= REL[dtype] * vv.abs() + 3.0 * 2.0**-9)

    check_round_trip()  # the torch reference (pool.set_kv_buffer)
    ref_k, ref_v = pool.k_buffer[1].clone(), pool.v_buffer[1].clone()
    # the fused Triton store (on CUDA when there is one: Triton runs CPU tensors only in its interpreter)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kb, vb = torch.zeros_like(pool.k_buffer[1], device=dev), torch.zeros_like(pool.v_buffer[1], device=dev)
    store_kv(kb, vb, loc.to(dev), k.to(dev), v.to(dev), dtype, pool.k_scale(1).to(dev), pool.v_scale(1).to(dev))
    pool.k_buffer[1].copy_(kb.cpu())
    pool.v_buffer[1].copy_(vb.cpu())
    check_round_trip()
    if dev == "cpu":  # the interpreter rounds as torch does: the same bytes
        assert torch.equal(kb, ref_k) and torch.equal(vb, ref_v)
    else:  # the GPU's conversion may break a tie the other way (a byte apart) or give -0.0 as +0.0, rarely
        for got, ref in ((kb.cpu(), ref_k), (vb.cpu(), ref_v)):
            differ = (got != ref) & ~((got & 0x7F == 0) & (ref & 0x7F == 0))
            assert differ.float().mean() < 0.01
            assert not differ.any() or (got.int() - ref.int())[differ].abs().max() <= 1


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


# ---------------------------------------------------------------- CUDA at model shapes
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dtype", FP8)
def test_cuda_fp8_kernels_with_scales(page, dtype):
    from test_triton_attention import cuda_env, decode_step

    env = cuda_env(page, "llama-3.2-1b", seed=3, slots=16 * 4096, max_reqs=8, cache_dtype=dtype)
    env.cache.set_scales({0: (0.3, 1.7)})
    prefix, new = [0, 700, 3000], [300, 129, 1]
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.EXTEND, rows, prefix, new)
    q, k, v = qkv(env, sum(new))
    check(env, batch, run_triton(env, batch, q, k, v), q, atol=2e-2)
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    batch, (q, k, v) = decode_step(env, rows, lens)
    check(env, batch, run_triton(env, batch, q, k, v), q, atol=2e-2)


@cuda
def test_cuda_engine_fp8_and_pages_give_graph_equal_tokens():
    """Dummy Llama-3.2-1B, greedy: fp8 KV through the decode and extend graphs gives the eager engine's tokens,
    and page_size 16 gives page_size 1's."""
    import gc

    from ostinato import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 128000, (int(n),), generator=gen).tolist()}
               for n in torch.randint(5, 300, (12,), generator=gen)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for name, kw in {"fp8-graph": {}, "fp8-eager": {"disable_cuda_graph": True},
                     "fp8-page16": {"page_size": 16}, "bf16": {"kv_cache_dtype": "auto"},
                     "bf16-page16": {"kv_cache_dtype": "auto", "page_size": 16}}.items():
        args = {"kv_cache_dtype": "fp8_e4m3", "max_total_tokens": 65536, "cuda_graph_max_bs": 16,
                "sampler_warm_up": "temperature"} | kw
        with LLM("llama-3.2-1b", load_format="dummy", **args) as llm:
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        gc.collect()
    assert tokens["fp8-graph"] == tokens["fp8-eager"]
    assert tokens["fp8-page16"] == tokens["fp8-graph"]
    assert tokens["bf16-page16"] == tokens["bf16"]


def test_decode_fp16_dot_matches_the_reference():
    """The decode kernel's fp16 dots on an fp8 cache against float64 attention over the same dequantized bytes,
    with the default dots (in q's dtype) beside it: both within bf16-level error. Queries are bf16 on CUDA and
    fp16 in Triton's CPU interpreter, whose bf16 dots are wrong (|out| ~ 2e8 on this input)."""
    from ostinato.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention

    gen = torch.Generator().manual_seed(4)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bs, heads, kv_heads, dim, ctx = 3, 4, 2, 16, 40
    k8 = (torch.randn(bs * ctx + 1, kv_heads, dim, generator=gen) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(bs * ctx + 1, kv_heads, dim, generator=gen) * 2).to(torch.float8_e4m3fn)
    q_dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    q = torch.randn(bs, heads, dim, generator=gen).to(q_dtype)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.25])
    req_to_token = (torch.randperm(bs * ctx, generator=gen) + 1).view(bs, ctx).to(torch.int32)
    seq_lens = torch.tensor([ctx, 17, 1], dtype=torch.int32)
    ref = fp8_decode_reference(q, k8, v8, req_to_token, seq_lens, k_scale, v_scale)
    for fp16_dot in (False, True):
        splits = torch.empty(bs, dtype=torch.int32, device=dev)
        compute_num_kv_splits(seq_lens.to(dev), splits, 16, 2)
        out = torch.empty(bs, heads, dim, dtype=q_dtype, device=dev)
        decode_attention(q.to(dev), k8.view(torch.uint8).to(dev), v8.view(torch.uint8).to(dev), out,
                         req_to_token.to(dev), torch.arange(bs, device=dev), seq_lens.to(dev), splits,
                         torch.empty(bs, heads, 2, dim, device=dev), torch.empty(bs, heads, 2, device=dev),
                         dim**-0.5, block_n=16, kv_fp8=torch.float8_e4m3fn, k_scale=k_scale.to(dev),
                         v_scale=v_scale.to(dev), fp16_dot=fp16_dot)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err < 2e-2 * ref.abs().max().item(), (fp16_dot, err)
