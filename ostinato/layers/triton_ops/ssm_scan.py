"""The Mamba2 SSM recurrence in one Triton kernel, for both the prefill scan and the decode step.

One program per (request, head, block of head_dim rows) keeps its [BLOCK_P, N] slice of the state in
registers (float32), reads it from the request's MambaPool slot, walks the request's tokens in order
(`state = exp(dt * A) * state + dt * x B^T`, `y = state C + D x`) and writes the state back. Decode is the
one-token case with the request index as the token index (no offsets tensor: capturable). The twin is
`ssd_scan` / `ssm_step` in `layers/mamba2.py` (the torch path and the test oracle).
"""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def _ssm_scan_kernel(x_ptr, dt_ptr, b_ptr, c_ptr, y_ptr, state_ptr, slot_ptr, cu_ptr, a_ptr, d_ptr, dtb_ptr,
                     dt_min, dt_max, stride_x, stride_dt, stride_b, stride_c, stride_y,
                     stride_s_slot, stride_s_h, stride_s_p,
                     HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_N: tl.constexpr, DECODE: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    if DECODE:
        start = r
        end = r + 1
    else:
        start = tl.load(cu_ptr + r)
        end = tl.load(cu_ptr + r + 1)
    slot = tl.load(slot_ptr + r)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    s_ptrs = state_ptr + slot * stride_s_slot + h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :]
    s_mask = mask_p[:, None] & mask_n[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    a = -tl.exp(tl.load(a_ptr + h).to(tl.float32))  # A = -exp(A_log)
    d = tl.load(d_ptr + h).to(tl.float32)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    g = h // HEADS_PER_GROUP
    for t in range(start, end):
        dt = tl.load(dt_ptr + t * stride_dt + h).to(tl.float32) + dtb
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))  # softplus, torch's threshold
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + t * stride_x + h * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + t * stride_b + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + t * stride_c + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(state * cv[None, :], axis=1) + d * x
        tl.store(y_ptr + t * stride_y + h * P + offs_p, y, mask=mask_p)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
             slots: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float,
             dt_max: float, num_heads: int, head_dim: int, groups: int, cu_seqlens: torch.Tensor | None = None
             ) -> torch.Tensor:
    """x [T, H*P], dt [T, H] (raw, before bias and softplus), B/C [T, G*N] (row-strided views are fine) ->
    y [T, H*P] float32 with the D skip; `state` [slots, H, P, N] is updated in place at `slots` [R].
    `cu_seqlens` [R+1] (int) splits the T tokens into R requests; None: decode, one token per request."""
    T = x.shape[0]
    N = state.shape[-1]
    assert state.stride(-1) == 1 and x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    y = torch.empty(T, num_heads * head_dim, dtype=torch.float32, device=x.device)
    R = T if cu_seqlens is None else cu_seqlens.shape[0] - 1
    block_p = min(16, triton.next_power_of_2(head_dim))
    grid = (R, num_heads, triton.cdiv(head_dim, block_p))
    pdl = pdl_enabled(x)
    _ssm_scan_kernel[grid](
        x, dt, B, C, y, state, slots, slots if cu_seqlens is None else cu_seqlens, A_log, D, dt_bias,
        float(dt_min), float(dt_max), x.stride(0), dt.stride(0), B.stride(0), C.stride(0), y.stride(0),
        state.stride(0), state.stride(1), state.stride(2),
        HEADS_PER_GROUP=num_heads // groups, P=head_dim, N=N, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
        DECODE=cu_seqlens is None, PDL=pdl, launch_pdl=pdl,
    )
    return y
