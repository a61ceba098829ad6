"""The step both attention kernels repeat: one block of keys read through `req_to_token`, folded into a
running (online) softmax. Inlined by Triton into each caller.

fp8 caches (KV_FP8 1: e4m3, 2: e5m2) arrive as uint8 and are bitcast here: the dot reads the 1-byte values
(exact in bf16/fp32), and the caller folds the per-layer scales in once, k_scale into the score scale and
v_scale into the output, rather than per element.

Ways to read an fp8 cache (constexpr switches, for the decode kernel's sweep; all default off):
- V_CVT: V is widened to fp16 in registers, in the layout it was loaded in (each thread a run of a token's
  head dims), by an inline-asm conversion marked impure so that Triton's pipeliner and layout passes cannot
  move it: V then goes to shared memory as fp16 and into the p.v dot's operand layout (keys along the
  reduction) by transposing matrix loads. Left to itself, Triton stages the 1-byte V in shared memory and
  reads it into that layout one byte per load (64 byte loads per thread per 32 keys at dim 64): sm_90 SASS of
  the one-warp, 32-key decode loop, 2,180 -> 1,580 instructions per 128 keys (bf16 KV: 1,404;
  `benchmarks/sass_decode_attention.py`). fp16 dots, CUDA only: the caller turns it off elsewhere, and the
  CPU runs the plain conversion, the same values.
- CVT_BITS: fp8 -> fp16 by bit manipulation (sign and exponent/mantissa moved into place, as Marlin-style
  dequantization does) instead of the conversion instruction; e4m3 comes out 2**-8 too small (the exponent
  biases differ by 8), a factor `bits_factor` the caller folds into its scales. Needs fp16 dots.
- QK_FP8: q arrives quantized to e4m3 (per row, the row scales folded into qk_scale by the caller) and
  q.k^T is an fp8 tensor-core dot on the stored bytes; p.v stays a 16-bit dot (fp16).
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores live in the log2 domain: callers scale q.k by softmax scale * LOG2E


def fp8_code(kv_fp8: torch.dtype | None, k_buf: torch.Tensor) -> int:
    """The kernels' KV_FP8 constant: 0 for a cache read as it is, 1 / 2 for e4m3 / e5m2 stored as uint8."""
    if kv_fp8 is None:
        return 0
    assert k_buf.dtype == torch.uint8, f"an fp8 cache is passed as its uint8 storage, got {k_buf.dtype}"
    return {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}[kv_fp8]


def page_arg(page_size: int, block_n: int) -> int:
    """The kernels' PAGE constant: the page size when a block holds whole pages or lies in one, else 1 (a
    table read per token, always right)."""
    if page_size > 1 and (block_n % page_size == 0 or page_size % block_n == 0):
        return page_size
    return 1


@triton.jit
def kv_from_store(x, KV_FP8: tl.constexpr):
    """Stored cache values -> numbers (before the layer's scale): fp8 caches are stored as uint8."""
    if KV_FP8 == 1:
        return x.to(tl.float8e4nv, bitcast=True)
    elif KV_FP8 == 2:
        return x.to(tl.float8e5, bitcast=True)
    else:
        return x


def bits_factor(kv_fp8_code: int) -> float:
    """What CVT_BITS values must be multiplied by: 2**(15 - 7) for e4m3 into fp16's exponent, 1 for e5m2 (the
    high byte of an fp16)."""
    return 256.0 if kv_fp8_code == 1 else 1.0


@triton.jit
def fp8_bits_to_fp16(x, KV_FP8: tl.constexpr):
    """Stored fp8 bytes (uint8) -> fp16 by moving bits: e5m2 is an fp16's high byte; e4m3's sign goes to bit 15
    and its exponent and mantissa 4 bits up, which keeps subnormals exact and leaves the value 2**-8 small."""
    x16 = x.to(tl.int16)  # zero-extends the unsigned byte
    if KV_FP8 == 2:
        bits = x16 << 8
    else:
        bits = ((x16 & 0x80) << 8) | ((x16 & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fp8_to_fp16_fixed(x, KV_FP8: tl.constexpr):
    """Stored fp8 bytes (uint8) -> fp16 by Hopper's paired conversion instruction, as an impure inline-asm op that
    stays where it is written (V_CVT in the module doc). Four bytes in one register give two fp16 pairs."""
    if KV_FP8 == 1:
        asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                             "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")
    else:
        asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                             "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }")
    return tl.inline_asm_elementwise(asm=asm, constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False,
                                     pack=4)


@triton.jit
def kv_to_dot(x, KV_FP8: tl.constexpr, CVT_BITS: tl.constexpr, dtype: tl.constexpr):
    """Stored cache values -> the dot's input type (fp8 caches: before the layer's scale, and with CVT_BITS
    before the bits factor)."""
    if KV_FP8 != 0 and CVT_BITS:
        return fp8_bits_to_fp16(x, KV_FP8).to(dtype)
    return kv_from_store(x, KV_FP8).to(dtype)


@triton.jit
def block_slots(req_row, n0, kv_end, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MASK_N: tl.constexpr = True,
                INT32: tl.constexpr = False):
    """KV slots of tokens n0 .. n0 + BLOCK_N of a request (0 past kv_end). n0 is a multiple of BLOCK_N.

    PAGE > 1 (pages of PAGE slots, each page's slots contiguous and page-aligned): one table read per page,
    the page's first slot, then consecutive slots; PAGE 1: one read per token. MASK_N False: the caller
    promises n0 + BLOCK_N <= kv_end (n_mask is then all true and nothing is masked). The slots are int64, or the
    table's int32 with INT32 (for offsets the caller knows fit 32 bits)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    if PAGE == 1:
        if MASK_N:
            slots = tl.load(req_row + offs_n, mask=n_mask, other=0)
        else:
            slots = tl.load(req_row + offs_n)
    elif PAGE >= BLOCK_N:  # the block lies in one page (PAGE is a multiple of BLOCK_N)
        slots = tl.load(req_row + n0) + (offs_n - n0)
        if MASK_N:
            slots = tl.where(n_mask, slots, 0)
    else:  # BLOCK_N // PAGE whole pages
        offs_p = n0 + tl.arange(0, BLOCK_N // PAGE) * PAGE
        if MASK_N:
            first = tl.load(req_row + offs_p, mask=offs_p < kv_end, other=0)
        else:
            first = tl.load(req_row + offs_p)
        slots = tl.reshape(first[:, None] + tl.arange(0, PAGE)[None, :], [BLOCK_N])
        if MASK_N:
            slots = tl.where(n_mask, slots, 0)
    if not INT32:
        slots = slots.to(tl.int64)
    return slots, offs_n, n_mask


@triton.jit
def load_tile(ptrs, row_mask, col_mask, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D load masked by row_mask[:, None] / col_mask[None, :] where asked (0 where masked)."""
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0)
    elif MASK_ROWS:
        return tl.load(ptrs, mask=row_mask[:, None], other=0)
    elif MASK_COLS:
        return tl.load(ptrs, mask=col_mask[None, :], other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def attend_kv_block(
    q, acc, m_i, l_i, n0, kv_end, q_pos,
    K_buf, V_buf, req_row,  # req_row: pointer to the request's row of req_to_token
    kv_head, stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    PAGE: tl.constexpr = 1, KV_FP8: tl.constexpr = 0,
    V_CVT: tl.constexpr = False, CVT_BITS: tl.constexpr = False, QK_FP8: tl.constexpr = False,
    MASK_N: tl.constexpr = True, MASK_D: tl.constexpr = True, OFFS32: tl.constexpr = False,
):
    """Keys n0 .. n0 + BLOCK_N (those < kv_end; with CAUSAL, also <= each row's q_pos) into (acc, m_i, l_i).

    Every row must see at least one key by its first block, so m_new stays finite from then on. With an fp8
    cache, qk_scale must include k_scale (and with CVT_BITS the bits factor) and acc comes out in units of
    v_scale (with CVT_BITS, v_scale / bits factor). The dots run in q's dtype (fp16 with QK_FP8, for p.v).
    MASK_N False: the block is whole (n0 + BLOCK_N <= kv_end), no key mask; MASK_D False: d_mask is all true.
    """
    slots, offs_n, n_mask = block_slots(req_row, n0, kv_end, BLOCK_N, PAGE, MASK_N, OFFS32)
    if OFFS32:
        k_off = slots[None, :] * stride_kbs + kv_head * stride_kbh + offs_d[:, None]
        v_off = slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :]
    else:
        k_off = slots[None, :] * stride_kbs + kv_head.to(tl.int64) * stride_kbh + offs_d[:, None]
        v_off = slots[:, None] * stride_vbs + kv_head.to(tl.int64) * stride_vbh + offs_d[None, :]
    k = load_tile(K_buf + k_off, d_mask, n_mask, MASK_D, MASK_N)  # [BLOCK_D, BLOCK_N]
    if QK_FP8:  # q is e4m3: an fp8 tensor-core dot on the stored bytes
        dot_dtype = tl.float16
        s = tl.dot(q, kv_from_store(k, KV_FP8), out_dtype=tl.float32) * qk_scale
    else:
        dot_dtype = q.dtype
        s = tl.dot(q, kv_to_dot(k, KV_FP8, CVT_BITS, dot_dtype), input_precision=PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    elif MASK_N:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_tile(V_buf + v_off, n_mask, d_mask, MASK_N, MASK_D)  # [BLOCK_N, BLOCK_D]
    if V_CVT:  # fp16 dots on CUDA (the caller's promise); see the module doc
        v = fp8_to_fp16_fixed(v, KV_FP8)
    else:
        v = kv_to_dot(v, KV_FP8, CVT_BITS, dot_dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i
