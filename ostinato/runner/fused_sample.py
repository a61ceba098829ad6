"""One Triton kernel for the common sampling case: temperature, min_p and greedy rows, no sort.

It draws exactly what `sampler.sample` draws: Gumbel-max over logits / temperature with the same
counter-based noise (`hash_uniform`'s hash, computed in uint32 arithmetic), after the same min_p filter;
greedy rows take the first index of the maximum. One program per row streams the row once (twice with
min_p: the row maximum first), so a step costs one read of the logits instead of the eager path's ~25
elementwise passes over [B, V]. top_k / top_p rows need a threshold over the sorted row and stay on the
torch path. Fixed grid, no host sync: it can run inside a CUDA graph.

Import this module only for CUDA tensors or under TRITON_INTERPRET=1 (Triton fixes the choice between
the GPU and its CPU interpreter when the kernel is decorated).
"""

import torch
import triton
import triton.language as tl

_MUL = 0x045D9F3B


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * _MUL
    x = ((x >> 16) ^ x) * _MUL
    return (x >> 16) ^ x


@triton.jit
def _fused_sample_kernel(Logits, stride_l, Temps, MinPs, Seeds, Steps, Out, vocab_size,
                         greedy_eps, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride_l
    temp = tl.load(Temps + row)
    greedy = temp < greedy_eps
    inv_div = tl.where(greedy, 1.0, temp)
    offs0 = tl.arange(0, BLOCK)

    # the row key, as hash_uniform: mix(mix(seed_lo ^ c) ^ seed_hi), then mix(key ^ step_lo)
    seed = tl.load(Seeds + row)
    step = tl.load(Steps + row)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(_mix32(seed_lo ^ 0x3C6EF372) ^ seed_hi)
    key = _mix32(key ^ (step & 0xFFFFFFFF).to(tl.uint32))

    log_min_p = float("-inf")
    x_max = float("inf")
    if HAS_MIN_P:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + offs0
            x = tl.load(base + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32) / inv_div
            m = tl.maximum(m, x)
        x_max = tl.max(m, axis=0)
        log_min_p = tl.where(greedy, float("-inf"), tl.log(tl.load(MinPs + row)))  # greedy rows: no filter

    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + offs0
        valid = offs < vocab_size
        x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) / inv_div
        if HAS_MIN_P:
            x = tl.where((x - x_max) >= log_min_p, x, float("-inf"))
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
    tl.store(Out + row, tl.where(idx == 2147483647, 0, idx).to(tl.int64))


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor | None,
                 seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int, greedy_eps: float) -> torch.Tensor:
    """int64 [B] token ids from float32 logits [B, >= vocab_size] (last dim contiguous); columns past
    `vocab_size` are ignored. `min_ps` None: no row filters by min_p."""
    b = logits.shape[0]
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    _fused_sample_kernel[(b,)](
        logits, logits.stride(0), temperatures, min_ps if min_ps is not None else temperatures, seeds, steps, out,
        vocab_size, greedy_eps, HAS_MIN_P=min_ps is not None, BLOCK=2048, num_warps=8,
    )
    return out
