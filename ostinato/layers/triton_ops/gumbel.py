"""The Gumbel noise's hash in Triton, bit for bit `layers/gumbel.py`'s (uint32 arithmetic): shared by the fused
sampler (runner/fused_sample.py) and the decode graph's draw (argmax.py)."""

import triton
import triton.language as tl

_MUL = tl.constexpr(0x045D9F3B)


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
def gumbel_perturbed(x, offs, key):
    """x - log(-log(u)), u the hash's uniform in (0, 1) for columns `offs` under the row's `key`."""
    h = mix32(mix32(offs.to(tl.uint32)) ^ key)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    return x - tl.log(-tl.log(u))
