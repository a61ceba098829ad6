"""The Gumbel noise in Triton, the formula of `layers/gumbel.py` (the hash bit for bit, in uint32 arithmetic):
shared by the fused sampler (runner/fused_sample.py) and the decode graph's draw (argmax.py).

The noise's two logarithms are the draw's cost: Triton's `tl.log` is libdevice's accurate logf, about 25
instructions, and a column needs two. Compiled for CUDA they are the hardware's lg2.approx (libdevice's
fast_log2f, one MUFU op; absolute error about 2**-22 on its result), which halves the draw's instructions
(chunk kernel on sm_90: 1,504 -> 848 SASS instructions a thread, 16 columns). Under Triton's interpreter, which
cannot run libdevice, it is `tl.log2`; the torch twin (`layers/gumbel.log_neg_log_`) computes the same formula."""

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

_MUL = tl.constexpr(0x045D9F3B)
_LN2 = tl.constexpr(0.6931471805599453)
# Triton decides interpreter or compiler when a kernel is decorated (at import), so this is read once too
_HW_LOG2 = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


@triton.jit
def mix32(x):
    x = ((x >> 16) ^ x) * _MUL
    x = ((x >> 16) ^ x) * _MUL
    return (x >> 16) ^ x


@triton.jit
def row_key(Seeds, Steps, row):
    """The row's noise key, as hash_uniform: mix(mix(mix(seed_lo ^ c) ^ seed_hi) ^ step_lo)."""
    seed = tl.load(Seeds + row)
    step = tl.load(Steps + row)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = mix32(mix32(seed_lo ^ 0x3C6EF372) ^ seed_hi)
    return mix32(key ^ (step & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _log2(x):
    if _HW_LOG2:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def log_neg_log(u):
    """log(-log(u)) for u in (0, 1). -log(u) is a series in t = 1 - u (exact: u >= 1/2) where t < 1/16: there
    -log(u) can be as small as 2**-24, below the hardware log2's absolute error; the series' first dropped term is
    under 1e-8 of its sum. Elsewhere -log(u) >= 0.064, and both logarithms are log2's times ln 2."""
    t = 1.0 - u
    series = t * (1.0 + t * (0.5 + t * (0.3333333333333333 + t * (0.25 + t * (0.2 + t * 0.16666666666666666)))))
    e = tl.where(t < 0.0625, series, _log2(u) * -_LN2)
    return _log2(e) * _LN2


@triton.jit
def gumbel_perturbed(x, offs, key):
    """x - log(-log(u)), u the hash's uniform in (0, 1) for columns `offs` under the row's `key`."""
    h = mix32(mix32(offs.to(tl.uint32)) ^ key)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    return x - log_neg_log(u)
