"""The fp8 decode kernel's variants (decode_attention.FP8_DECODE_VARIANTS, with and without whole_blocks) against
float64 attention over the same dequantized bytes: e4m3 and e5m2, scales other than 1, subnormal bytes, pages
of 1, 4 and 16 (Triton's interpreter on a CPU; the same at a model's head shape on CUDA). The settings table's
lookup by batch size."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_fp8_kv import fp8_decode_reference  # noqa: E402

from ostinato.attention.triton_ops.decode_attention import (  # noqa: E402
    FP8_DECODE_VARIANTS,
    compute_num_kv_splits,
    decode_attention,
    decode_kwargs,
    fold_applies,
    table_entry,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# q quantized to e4m3 per row: scores off by up to e4m3's relative spacing (2**-3 at worst), which the softmax
# turns into output errors of several % (qk8 is measured, never picked as a default)
QK8_BOUND = 2.0**-3
# the "cpu" cases run in Triton's interpreter; a CUDA machine compiles for the GPU, which cannot read CPU tensors
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter only (CPU tensors); the CUDA cases cover the GPU")


def paged_table(bs: int, ctx: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """req_to_token for requests of `ctx` slots on shuffled pages (page 0 left out: the sink)."""
    pages_per_req = -(-ctx // page)
    order = torch.randperm(bs * pages_per_req, generator=gen) + 1
    slots = order.view(bs, pages_per_req, 1) * page + torch.arange(page)
    return slots.view(bs, -1)[:, :ctx].to(torch.int32).contiguous()


def run_variants(dtype, page, variants, dev, bs=3, heads=4, kv_heads=2, dim=16, ctx=40, block_n=16, seed=0):
    """Max |out - ref| / max |ref| per (variant, whole_blocks), on one random problem."""
    gen = torch.Generator().manual_seed(seed)
    req_to_token = paged_table(bs, ctx, page, gen)
    num_slots = int(req_to_token.max()) + page
    k8 = (torch.randn(num_slots, kv_heads, dim, generator=gen) * 2).to(dtype)
    v8 = (torch.randn(num_slots, kv_heads, dim, generator=gen) * 2).to(dtype)
    kb, vb = k8.view(torch.uint8).clone(), v8.view(torch.uint8).clone()
    tiny = (torch.arange(kv_heads * dim) % 4 | torch.arange(kv_heads * dim) % 2 * 128).to(torch.uint8)
    for s in req_to_token[:, :3].flatten().tolist():  # subnormals (and zeros) of both signs, in both formats
        kb[s], vb[s] = tiny.view(kv_heads, dim), tiny.view(kv_heads, dim).flip(1)
    k8, v8 = kb.view(dtype), vb.view(dtype)
    q_dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # the interpreter's bf16 dots are wrong
    q = torch.randn(bs, heads, dim, generator=gen).to(q_dtype)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([3.0])
    seq_lens = torch.tensor([ctx, 17, 1][:bs], dtype=torch.int32)
    ref = fp8_decode_reference(q, k8, v8, req_to_token, seq_lens, k_scale, v_scale)
    errs = {}
    for name, whole in variants:
        splits = torch.empty(bs, dtype=torch.int32, device=dev)
        compute_num_kv_splits(seq_lens.to(dev), splits, 16, 2)
        out = torch.full((bs, heads, dim), float("nan"), dtype=q_dtype, device=dev)
        decode_attention(q.to(dev), kb.to(dev), vb.to(dev), out, req_to_token.to(dev), torch.arange(bs, device=dev),
                         seq_lens.to(dev), splits, torch.empty(bs, heads, 2, dim, device=dev),
                         torch.empty(bs, heads, 2, device=dev), dim**-0.5, block_n=block_n, page_size=page,
                         kv_fp8=dtype, k_scale=k_scale.to(dev), v_scale=v_scale.to(dev), whole_blocks=whole,
                         **FP8_DECODE_VARIANTS[name])
        errs[(name, whole)] = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    return errs


def check(errs: dict) -> None:
    for (name, whole), err in errs.items():
        bound = QK8_BOUND if name.startswith("qk8") else 1e-2  # fp16 / bf16 rounding of q and p
        assert err < bound, (name, whole, err)


@interpreted
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dtype", FP8)
def test_every_fp8_decode_variant_matches_float64(dtype, page):
    """Each variant once per (dtype, page), whole_blocks on for half of them (the other half in the other page)."""
    names = [n for n in FP8_DECODE_VARIANTS if n != "kv_group"]
    variants = [(n, (i + page) % 2 == 1) for i, n in enumerate(names)]
    check(run_variants(dtype, page, variants, "cpu", seed=page))
    # kv_group needs 16 query heads over KV heads in multiples of 16 // GROUP: 16 / 4 here (4 KV heads a program)
    check(run_variants(dtype, page, [("kv_group", page == 1)], "cpu", heads=16, kv_heads=4, seed=page))


@interpreted
def test_fp8_decode_variants_pages_of_four():
    """Blocks of several pages (block_n 16, pages of 4): one table read per page."""
    check(run_variants(torch.float8_e4m3fn, 4, [("fp16_vcvt", True), ("bits", False)], "cpu", seed=4))
    check(run_variants(torch.float8_e4m3fn, 4, [("kv_group", True)], "cpu", heads=16, kv_heads=4, seed=4))


def half_cache(bs: int, heads: int, kv_heads: int, dim: int, ctx: int, page: int, seed: int) -> tuple:
    """A paged fp16 cache of random K/V and random queries: (req_to_token, k, v, q)."""
    gen = torch.Generator().manual_seed(seed)
    req_to_token = paged_table(bs, ctx, page, gen)
    n = int(req_to_token.max()) + page
    k, v = torch.randn(n, kv_heads, dim, generator=gen).half(), torch.randn(n, kv_heads, dim, generator=gen).half()
    return req_to_token, k, v, torch.randn(bs, heads, dim, generator=gen).half()


@interpreted
def test_kv_group_on_a_bf16_cache():
    """kv_group applies to any cache: bf16 (fp16 in the interpreter) against float64 over the same values."""
    bs, heads, kv_heads, dim, ctx, page = 2, 16, 4, 16, 40, 4
    req_to_token, k, v, q = half_cache(bs, heads, kv_heads, dim, ctx, page, seed=9)
    seq_lens = torch.tensor([ctx, 23], dtype=torch.int32)
    outs = []
    for group in (False, True):
        splits = torch.empty(bs, dtype=torch.int32)
        compute_num_kv_splits(seq_lens, splits, 16, 2)
        out = torch.empty_like(q)
        decode_attention(q, k, v, out, req_to_token, torch.arange(bs), seq_lens, splits,
                         torch.empty(bs, heads, 2, dim), torch.empty(bs, heads, 2), dim**-0.5, block_n=16,
                         page_size=page, kv_group=group, whole_blocks=group)
        outs.append(out.double())
    ref = torch.empty(bs, heads, dim, dtype=torch.float64)
    for b in range(bs):
        slots = req_to_token[b, : seq_lens[b]].long()
        kk, vv = (x[slots].double().repeat_interleave(heads // kv_heads, 1) for x in (k, v))
        ref[b] = torch.einsum("hn,nhd->hd", torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), kk) * dim**-0.5,
                                                          -1), vv)
    for out in outs:
        assert (out - ref).abs().max() < 2e-3


@interpreted
@pytest.mark.parametrize(("group", "block_n", "cache", "page", "combine"), [
    (4, 64, torch.float8_e4m3fn, 1, False), (4, 32, torch.float16, 4, True), (2, 128, torch.float8_e5m2, 16, True),
    (8, 32, torch.float16, 1, False), (1, 128, torch.float8_e4m3fn, 4, True)])
def test_folded_rows_match_float64(group, block_n, cache, page, combine):
    """stage 1 with its rows folded over the keys (`fold`) against float64 attention over the same cache values,
    and against the unfolded kernel: contexts that end inside a block, inside a chunk, and before some chunks of
    their only block (those rows see no key), requests of one token, empty last splits, splits combined in stage 1
    or by stage 2."""
    gen = torch.Generator().manual_seed(group * 100 + block_n)
    bs, kv_heads, dim = 5, 2, 16
    heads, ctxs = group * kv_heads, [3 * block_n + 5, block_n // 2 + 1, 1, 2 * block_n, 9]
    req_to_token = paged_table(bs, max(ctxs), page, gen)
    n = int(req_to_token.max()) + page
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) * 2 for _ in range(2))
    if cache == torch.float16:
        kb, vb = k.half(), v.half()
        k8, v8, fp8, scales = kb, vb, None, (torch.tensor([1.0]), torch.tensor([1.0]))
    else:
        k8, v8 = k.to(cache), v.to(cache)
        kb, vb, fp8 = k8.view(torch.uint8), v8.view(torch.uint8), cache
        scales = (torch.tensor([0.5]), torch.tensor([3.0]))
    q = torch.randn(bs, heads, dim, generator=gen).half()
    seq_lens = torch.tensor(ctxs, dtype=torch.int32)
    ref = fp8_decode_reference(q, k8, v8, req_to_token, seq_lens, *scales)
    splits = torch.empty(bs, dtype=torch.int32)
    compute_num_kv_splits(seq_lens, splits, block_n, 4)  # 4 splits of 3 * block_n + 5 tokens: the last one empty
    outs = []
    for fold in (False, True):
        counters = torch.zeros(bs * kv_heads, dtype=torch.int32) if combine else None
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kb, vb, out, req_to_token, torch.arange(bs), seq_lens, splits,
                         torch.empty(bs, heads, 4, dim), torch.empty(bs, heads, 4), dim**-0.5, block_n=block_n,
                         page_size=page, kv_fp8=fp8, k_scale=scales[0], v_scale=scales[1], whole_blocks=True,
                         fp16_dot=fp8 is not None, fold=fold, counters=counters)
        assert counters is None or not counters.any()
        outs.append(out.double())
    for out in outs:  # fp16 q, p and output
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-3
    assert not torch.equal(outs[0], outs[1])  # the folded kernel ran: its sums come in another order
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3 * ref.abs().max().item(), rtol=0)


@interpreted
@pytest.mark.parametrize(("cache", "kv_group", "combine"), [
    (torch.float16, False, False), (torch.float16, False, True), (torch.float16, True, False),
    (torch.float8_e4m3fn, False, True), (torch.float8_e4m3fn, True, True)])
def test_splits_counted_in_the_kernels_equal_the_counted_tensor(cache, kv_group, combine):
    """num_kv_splits None (a captured decode step's form): stage 1, the kv-group kernel, the in-kernel combine and
    stage 2 count each request's splits from its length as compute_num_kv_splits does, clamped to the scratch's
    split capacity: the same output bit for bit as the counted tensor, over lengths the cap clamps, that end
    inside a split, and of one token."""
    bs, heads, kv_heads, dim, page, cap, min_tokens = 5, 16, 4, 16, 4, 3, 16
    ctxs = [40, 23, 1, 64, 17]
    req_to_token, k, v, q = half_cache(bs, heads, kv_heads, dim, max(ctxs), page, seed=11)
    fp8 = None if cache == torch.float16 else cache
    scales = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([3.0])) if fp8 is not None else {}
    if fp8 is not None:
        k, v = k.to(cache).view(torch.uint8), v.to(cache).view(torch.uint8)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32)
    counted = torch.empty(bs, dtype=torch.int32)
    compute_num_kv_splits(seq_lens, counted, min_tokens, cap)
    assert counted.tolist() == [3, 2, 1, 3, 2]
    outs = []
    for splits in (counted, None):
        counters = torch.zeros(bs * kv_heads, dtype=torch.int32) if combine else None
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k, v, out, req_to_token, torch.arange(bs), seq_lens, splits,
                         torch.full((bs, heads, cap, dim), float("nan")), torch.full((bs, heads, cap), float("nan")),
                         dim**-0.5, block_n=16, page_size=page, kv_fp8=fp8, kv_group=kv_group, whole_blocks=True,
                         fp16_dot=fp8 is not None, counters=counters, min_tokens_per_split=min_tokens, **scales)
        assert counters is None or not counters.any()
        outs.append(out)
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    # a rule that counts differently (one split each) changes the output: the count is what the kernels use
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, out, req_to_token, torch.arange(bs), seq_lens, None,
                     torch.full((bs, heads, cap, dim), float("nan")), torch.full((bs, heads, cap), float("nan")),
                     dim**-0.5, block_n=16, page_size=page, kv_fp8=fp8, kv_group=kv_group, whole_blocks=True,
                     fp16_dot=fp8 is not None, min_tokens_per_split=64, **scales)
    assert not torch.equal(out, outs[0])


def test_fold_applies_to_power_of_two_groups_with_whole_chunks():
    assert fold_applies(4, 64) and fold_applies(4, 32) and fold_applies(2, 128) and fold_applies(1, 128)
    assert not fold_applies(4, 16)  # 4 chunks of 4 keys
    assert not fold_applies(3, 64) and not fold_applies(16, 64)  # a group of 16 fills the rows already


def test_settings_table_lookup():
    table = {1: dict(variant="fp16", block_n=128), 32: dict(variant="fp16_vcvt", block_n=64, whole_blocks=True,
                                                             programs_per_sm=4, min_tokens_per_split=128)}
    assert table_entry(table, 1) is table[1] and table_entry(table, 16) is table[1]
    assert table_entry(table, 17) is table[32]  # 17 pads to 32: eager and graph passes agree
    assert table_entry(table, 300) is table[32]
    assert table_entry({4: table[1]}, 1) is table[1]  # below every key: the smallest
    assert decode_kwargs(table[32]) == dict(block_n=64, whole_blocks=True, fp16_dot=True, v_cvt=True)


@pytest.mark.parametrize("dtype", FP8)
def test_backend_uses_its_fp8_settings_table(dtype):
    """TritonAttentionBackend's decode reads its settings table: a non-default entry (variant, blocks, whole
    blocks, split knobs) through the backend gives the torch backend's output on the same fp8 cache."""
    from test_fp8_kv import fp8_env
    from test_triton_attention import check as check_backend
    from test_triton_attention import make_batch, new_requests, qkv, run_triton

    from ostinato.attention.forward_batch import ForwardMode

    env = fp8_env(4, dtype, seed=7)
    env.tri.decode_table = {1: dict(variant="bits", block_n=16, num_warps=1, num_stages=2,
                                    whole_blocks=True, programs_per_sm=8, min_tokens_per_split=16)}
    assert env.tri.kv_splits_cap(2) == 16 and env.tri._min_tokens_per_split(2) == 16
    prefix = [44, 8]
    rows = new_requests(env, prefix)
    batch = make_batch(env, ForwardMode.DECODE, rows, prefix, [1, 1])
    q, k, v = qkv(env, 2)
    check_backend(env, batch, run_triton(env, batch, q, k, v), q, atol=1e-4)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize(("dtype", "page"), [(torch.float8_e4m3fn, 1), (torch.float8_e4m3fn, 16),
                                           (torch.float8_e5m2, 16)])
def test_cuda_fp8_decode_variants_at_model_heads(dtype, page):
    """Llama-3.2-1B's heads (32 / 8, dim 64), 64-key blocks, every variant, whole_blocks on for half."""
    variants = [(n, (i + page) % 2 == 1) for i, n in enumerate(FP8_DECODE_VARIANTS)]
    check(run_variants(dtype, page, variants, "cuda", heads=32, kv_heads=8, dim=64, ctx=700, block_n=64))


@pytest.mark.parametrize("kv_group", [False, True])
def test_splits_combined_by_the_last_program_equal_stage_2(kv_group):
    """With `counters` the last split program of each request and head group combines the splits (no stage-2
    launch): the same output as stage 2, at 1, 3 and 5 splits (one of them empty), and the counters all 0 after,
    so the next launch starts clean. On the GPU (programs really concurrent) and in Triton's interpreter."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bs, heads, kv_heads, dim, ctx, page = 3, 16, 4, 16, 70, 2
    req_to_token, k, v, q = half_cache(bs, heads, kv_heads, dim, ctx, page, seed=11)
    seq_lens = torch.tensor([ctx, 9, 33], dtype=torch.int32)
    splits = torch.tensor([5, 1, 3], dtype=torch.int32)  # 70 tokens in 5 splits of 16: the last one empty
    k, v, q, req_to_token, seq_lens, splits = (t.to(dev) for t in (k, v, q, req_to_token, seq_lens, splits))
    counters = torch.zeros(bs * kv_heads + 5, dtype=torch.int32, device=dev)
    outs = []
    for c in (None, counters, counters):  # twice with the counters: the second launch reuses them
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k, v, out, req_to_token, torch.arange(bs, device=dev), seq_lens, splits,
                         torch.empty(bs, heads, 6, dim, device=dev), torch.empty(bs, heads, 6, device=dev), dim**-0.5,
                         block_n=16, page_size=page, kv_group=kv_group, counters=c)
        outs.append(out.float())
    assert torch.equal(outs[1], outs[2])
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)  # fp16 output, sums in another order
    assert not counters.any()
