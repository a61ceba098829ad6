"""The Mamba2 decode conv step in one Triton kernel: per request, read its stored last K-1 inputs at its
MambaPool slot, convolve them with the new input, apply silu, and shift the new input into the stored window.
The twin is `causal_conv_step` in `layers/mamba2.py` (gather, cat, multiply-sum, silu, index_copy_ there)."""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def _conv_step_kernel(x_ptr, state_ptr, slot_ptr, w_ptr, b_ptr, out_ptr, D, stride_x, stride_out,
                      stride_s_slot, stride_s_d, HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr = False):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    slot = tl.load(slot_ptr + r)
    s_base = state_ptr + slot * stride_s_slot + offs * stride_s_d
    x = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0)
    # window = [state[0], ..., state[K-2], x]; out = sum_k window[k] * w[:, k]
    acc = x.to(tl.float32) * tl.load(w_ptr + offs * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(s_base, mask=mask, other=0.0)
    for k in tl.static_range(K - 1):
        cur = prev
        if k + 1 < K - 1:
            prev = tl.load(s_base + k + 1, mask=mask, other=0.0)
        else:
            prev = x.to(cur.dtype)
        acc += cur.to(tl.float32) * tl.load(w_ptr + offs * K + k, mask=mask, other=0.0).to(tl.float32)
        tl.store(s_base + k, prev, mask=mask)  # shift left: the window minus its oldest input
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + r * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [b, D] (row-strided view fine), conv_state [slots, D, K-1] updated in place at `slots` [b], weight
    [D, K] -> silu(conv) [b, D] in weight's dtype."""
    b, D = x.shape
    K = weight.shape[1]
    assert x.stride(-1) == 1 and conv_state.stride(-1) == 1 and weight.is_contiguous() and K >= 2
    out = torch.empty(b, D, dtype=weight.dtype, device=x.device)
    block = 256
    pdl = pdl_enabled(x)
    _conv_step_kernel[(b, triton.cdiv(D, block))](
        x, conv_state, slots, weight, weight if bias is None else bias, out, D, x.stride(0), out.stride(0),
        conv_state.stride(0), conv_state.stride(1), HAS_BIAS=bias is not None, K=K, BLOCK_D=block,
        PDL=pdl, launch_pdl=pdl,
    )
    return out
