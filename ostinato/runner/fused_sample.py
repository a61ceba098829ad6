"""Sampling in a few Triton kernels with a fixed grid and no sort: temperature, min_p, top_k, top_p, greedy.

It draws exactly what `sampler.sample_torch` draws: Gumbel-max over logits / temperature with the same
counter-based noise (`hash_uniform`'s hash, computed in uint32 arithmetic), after the same min_p filter;
greedy rows take the first index of the maximum. A step reads the logits once (twice with min_p: the row
maximum first) instead of the eager path's ~25 elementwise passes over [B, V]. top_k and top_p become one
logit cut per row, found without sorting by a 16-way search over the floats' order (`_threshold_kernel`):
the same cut `sample_torch` reads off its sorted row. Fixed grids, no host sync: capturable in a CUDA graph.

Import this module only for CUDA tensors or under TRITON_INTERPRET=1 (Triton fixes the choice between
the GPU and its CPU interpreter when the kernel is decorated).
"""

import torch
import triton
import triton.language as tl

_MUL = tl.constexpr(0x045D9F3B)


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * _MUL
    x = ((x >> 16) ^ x) * _MUL
    return (x >> 16) ^ x


@triton.jit
def _row_key(Seeds, Steps, row):
    """The row's noise key, as hash_uniform: mix(mix(mix(seed_lo ^ c) ^ seed_hi) ^ step_lo)."""
    seed = tl.load(Seeds + row)
    step = tl.load(Steps + row)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(_mix32(seed_lo ^ 0x3C6EF372) ^ seed_hi)
    return _mix32(key ^ (step & 0xFFFFFFFF).to(tl.uint32))


@triton.jit(do_not_specialize=["split_len", "num_splits"])  # kernels per batch size: one per SPLITS_POW2 only
def _split_max_kernel(Logits, stride_l, Temps, Out, vocab_size, split_len, num_splits, greedy_eps,
                      BLOCK: tl.constexpr):
    """Out[row, split] = max of logits / temperature over the split's columns."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(Temps + row)
    div = tl.where(temp < greedy_eps, 1.0, temp)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_size)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(Logits + row * stride_l + offs, mask=offs < hi, other=float("-inf")) / div)
    tl.store(Out + row * num_splits + split, tl.max(m, axis=0))


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _split_sample_kernel(Logits, stride_l, Temps, MinPs, SplitMax, Cuts, Seeds, Steps, OutVal, OutIdx, vocab_size,
                         split_len, num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, HAS_CUT: tl.constexpr,
                         BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr):
    """Per (row, split): the best Gumbel-perturbed logit among the split's allowed columns and its first index.
    Greedy rows use no noise and no filter (their best is the argmax)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(Temps + row)
    greedy = temp < greedy_eps
    div = tl.where(greedy, 1.0, temp)
    key = _row_key(Seeds, Steps, row)
    log_min_p = float("-inf")
    x_max = 0.0
    if HAS_MIN_P:
        s = tl.arange(0, SPLITS_POW2)
        x_max = tl.max(tl.load(SplitMax + row * num_splits + s, mask=s < num_splits, other=float("-inf")), axis=0)
        log_min_p = tl.where(greedy, float("-inf"), tl.log(tl.load(MinPs + row)))  # greedy rows: no filter
    cut = float("-inf")
    if HAS_CUT:
        cut = tl.load(Cuts + row)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_size)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < hi
        x = tl.load(Logits + row * stride_l + offs, mask=valid, other=float("-inf")) / div
        if HAS_MIN_P:
            x = tl.where((x - x_max) >= log_min_p, x, float("-inf"))
        if HAS_CUT:
            x = tl.where(x >= cut, x, float("-inf"))  # greedy rows' cut is -inf
        h = _mix32(_mix32(offs.to(tl.uint32)) ^ key)
        u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        val = tl.where(greedy, x, x - tl.log(-tl.log(u)))
        val = tl.where(valid, val, float("-inf"))
        # strictly greater keeps the earliest index per lane; lanes are merged below with ties to the lowest
        take = val > best_val
        best_val = tl.where(take, val, best_val)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(OutVal + row * num_splits + split, top)
    tl.store(OutIdx + row * num_splits + split, tl.where(idx == 2147483647, lo, idx).to(tl.int64))


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the floats' order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _search_key(row_ptr, vocab_size, div, x_max, log_min_p, lo, hi, k, floor_key, mass_goal,
                TOP_P: tl.constexpr, NWAY: tl.constexpr, BLOCK: tl.constexpr):
    """The largest order key c in [lo, hi] whose predicate holds, for a predicate that holds at lo and fails
    from some key on: count(key(x) >= c) >= k (top_k), or the softmax mass of those x >= mass_goal (top_p),
    over the row's x = logits / div kept by min_p and by key(x) >= floor_key. Each pass over the row tests
    NWAY - 1 keys at once, so the 2**32 keys take 8 passes for NWAY = 16."""
    j = tl.arange(0, NWAY)
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while hi > lo:
        step = (hi - lo + NWAY - 1) // NWAY
        cand = tl.minimum(lo + j.to(tl.int64) * step, hi)  # cand[0] = lo holds already
        acc = tl.zeros([NWAY], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")) / div
            x = tl.where((x - x_max) >= log_min_p, x, float("-inf"))
            key = _order_key(x).to(tl.int64)
            kept = key >= floor_key
            if TOP_P:
                w = tl.where(kept, tl.exp(x - x_max), 0.0)
            else:
                w = tl.where(kept & (offs < vocab_size), 1.0, 0.0)
            acc += tl.sum(tl.where(key[None, :] >= cand[:, None], w[None, :], 0.0), axis=1)
        goal = mass_goal if TOP_P else k.to(tl.float32)
        ok = (acc >= goal) | (j == 0)
        best = tl.max(tl.where(ok, j, 0), axis=0)
        new_lo = tl.max(tl.where(j == best, cand, -(2**62)), axis=0)
        nxt = tl.min(tl.where(j == best + 1, cand, 2**62), axis=0)
        hi = tl.where(best == NWAY - 1, hi, tl.minimum(hi, nxt - 1))
        lo = new_lo
    return lo


_NEG_INF_KEY = tl.constexpr(-2139095041)  # _order_key(-inf)


@triton.jit
def _threshold_kernel(Logits, stride_l, Temps, MinPs, TopKs, TopPs, Cuts, vocab_size, greedy_eps,
                      HAS_MIN_P: tl.constexpr, NWAY: tl.constexpr, BLOCK: tl.constexpr):
    """Cuts[row]: the logit / temperature below which top_k and top_p drop a token (-inf: they drop none), the
    value `sampler.sample_torch` reads off its sorted row: top_k's k-th largest value, then top_p's first sorted
    value at which the renormalized mass reaches top_p."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_l
    temp = tl.load(Temps + row)
    top_k = tl.load(TopKs + row)
    top_p = tl.load(TopPs + row)
    cut = tl.full([], _NEG_INF_KEY, tl.int64)
    uses_cut = (top_k < vocab_size).to(tl.int32) + (top_p < 1.0).to(tl.int32)
    if (temp >= greedy_eps).to(tl.int32) * uses_cut > 0:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")) / temp)
        x_max = tl.max(m, axis=0)
        log_min_p = float("-inf")
        if HAS_MIN_P:
            log_min_p = tl.log(tl.load(MinPs + row))
        hi = _order_key(x_max).to(tl.int64)
        if top_k < vocab_size:
            cut = _search_key(row_ptr, vocab_size, temp, x_max, log_min_p, cut, hi, top_k, cut, 0.0,
                              TOP_P=False, NWAY=NWAY, BLOCK=BLOCK)
        if top_p < 1.0:
            z = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")) / temp
                x = tl.where((x - x_max) >= log_min_p, x, float("-inf"))
                z += tl.where(_order_key(x).to(tl.int64) >= cut, tl.exp(x - x_max), 0.0)
            cut = _search_key(row_ptr, vocab_size, temp, x_max, log_min_p, cut, hi, top_k, cut,
                              top_p * tl.sum(z, axis=0), TOP_P=True, NWAY=NWAY, BLOCK=BLOCK)
    bits = cut.to(tl.int32)
    bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    tl.store(Cuts + row, bits.to(tl.float32, bitcast=True))


_BLOCK = 2048
_SEARCH_BLOCK = 512
_TARGET_PROGRAMS = 512  # a few waves over an H100/H200's 132 SMs


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor | None,
                 top_ks: torch.Tensor | None, top_ps: torch.Tensor | None, seeds: torch.Tensor, steps: torch.Tensor,
                 vocab_size: int, greedy_eps: float) -> torch.Tensor:
    """int64 [B] token ids from float32 logits [B, >= vocab_size] (last dim contiguous); columns past
    `vocab_size` are ignored. `min_ps` None: no row filters by min_p; `top_ks` / `top_ps` None: no row has
    top_k / top_p (else both are given: int64 [B] with vocab_size for none, float32 [B] with 1.0 for none).
    With them, one program per row first finds the row's cut (`_threshold_kernel`).

    Each row is cut into splits so a small batch still spreads over the GPU: one program per (row, split)
    finds its split's best, and a last argmax over the splits (ordered by column, so ties keep the first
    index) picks the token. With min_p a first pass finds each split's maximum (the filter needs the row's).
    """
    b = logits.shape[0]
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    split_len, num_splits = split_plan(b, vocab_size)
    grid = (b, num_splits)
    dev = logits.device
    split_max = torch.empty(b, num_splits, dtype=torch.float32, device=dev)
    if min_ps is not None:
        _split_max_kernel[grid](logits, logits.stride(0), temperatures, split_max, vocab_size, split_len,
                                num_splits, greedy_eps, BLOCK=_BLOCK, num_warps=8)
    cuts = split_max
    if top_ks is not None:
        cuts = torch.empty(b, dtype=torch.float32, device=dev)
        _threshold_kernel[(b,)](logits, logits.stride(0), temperatures,
                                min_ps if min_ps is not None else temperatures, top_ks, top_ps, cuts, vocab_size,
                                greedy_eps, HAS_MIN_P=min_ps is not None, NWAY=16, BLOCK=_SEARCH_BLOCK,
                                num_warps=8)
    vals = torch.empty(b, num_splits, dtype=torch.float32, device=dev)
    idx = torch.empty(b, num_splits, dtype=torch.int64, device=dev)
    _split_sample_kernel[grid](
        logits, logits.stride(0), temperatures, min_ps if min_ps is not None else temperatures, split_max, cuts,
        seeds, steps, vals, idx, vocab_size, split_len, num_splits, greedy_eps, HAS_MIN_P=min_ps is not None,
        HAS_CUT=top_ks is not None, BLOCK=_BLOCK, SPLITS_POW2=triton.next_power_of_2(num_splits), num_warps=8,
    )
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0]


def split_plan(batch: int, vocab_size: int) -> tuple[int, int]:
    """(split_len, num_splits) of a batch's rows: enough splits for ~_TARGET_PROGRAMS programs, whole blocks each."""
    num_splits = max(1, min(triton.cdiv(vocab_size, _BLOCK), triton.cdiv(_TARGET_PROGRAMS, batch)))
    split_len = triton.cdiv(triton.cdiv(vocab_size, num_splits), _BLOCK) * _BLOCK
    return split_len, triton.cdiv(vocab_size, split_len)


def warm_up_batches(max_batch: int, vocab_size: int) -> list[int]:
    """The smallest batch size of each kernel `fused_sample` compiles (one per power of two of its split count),
    up to max_batch: running these once compiles every kernel a plain temperature draw needs, so a serving
    engine does not compile one mid-stream as its batch shrinks (~0.1-0.3 s each on an H200)."""
    seen: dict[int, int] = {}
    for b in range(1, max_batch + 1):
        seen.setdefault(triton.next_power_of_2(split_plan(b, vocab_size)[1]), b)
    return sorted(seen.values())


def warm_up(max_batch: int, vocab_size: int, device: torch.device) -> None:
    """Run `fused_sample` (temperature only) once at each of `warm_up_batches`."""
    for b in warm_up_batches(max_batch, vocab_size):
        gen = torch.Generator(device=device).manual_seed(b)
        logits = torch.randn(b, vocab_size, device=device, generator=gen)
        ones = torch.ones(b, device=device)
        zeros = torch.zeros(b, dtype=torch.int64, device=device)
        fused_sample(logits, ones, None, None, None, zeros, zeros, vocab_size, greedy_eps=1e-5)  # (no row greedy)
