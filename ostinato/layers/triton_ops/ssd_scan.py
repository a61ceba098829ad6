"""The Mamba2 prefill scan as chunked SSD ("state space duality") Triton kernels, varlen over a batch.

Each request's tokens are cut into chunks of `chunk` tokens (256, the checkpoints' mamba_chunk_size); the state
[P, N] of each head is float32, read from and written back to the request's MambaPool slot. Per chunk, with
a = cumsum(dt * A) the log-decay from the chunk start through each token:
- y_l = sum_{s<=l} (C_l . B_s) exp(a_l - a_s) dt_s x_s   (intra-chunk: a masked [L, L] form)
      + exp(a_l) C_l . state_in                         (the state entering the chunk)
      + D x_l;
- state_out = exp(a_end) state_in + sum_s exp(a_end - a_s) dt_s x_s B_s^T.
Four launches, every one but the carry parallel over the batch's chunks (so one long prompt fills the GPU as
well as many short ones): (1) per chunk, side by side, the dt cumsum and C . B^T per group (shared by the
group's heads), (2) the state each chunk builds alone, (3) the carry through each request's chunks from its
stored state (elementwise: the only sequential part), (4) each chunk's outputs. Each waits on the one before
under PDL (layers/triton_ops/pdl.py), so launches overlap the previous kernel's tail. Chunks start at each
request's first token, so a chunked prefill (which resumes from the stored state) gives what one pass gives,
up to rounding. Every exponent is <= 0: no overflow.

The dots take 16-bit operands when the activations are 16-bit (float32 operands are rounded to them, as
mamba_ssm's kernels do), with float32 sums; float32 activations take float32 operands at `DOT_PRECISION`
(tf32 by default; OSTINATO_SSD_PRECISION=ieee for float32 FMAs, and OSTINATO_SSD_16BIT=0 puts 16-bit
activations there too). Triton's CPU interpreter gets 16-bit dots wrong, so there every dot is float32 FMAs.
The twin and test oracle is `ssd_scan` in `layers/mamba2.py`.
"""

import os

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled

# the float32-operand dots on the GPU: tf32 (default), ieee (float32 FMAs)
# (tf32x3 is refused: on an H200 with triton 3.6 an earlier form of these kernels hit an illegal memory access)
DOT_PRECISION = os.environ.get("OSTINATO_SSD_PRECISION", "tf32")
if DOT_PRECISION not in ("tf32", "ieee"):
    raise ValueError(f"OSTINATO_SSD_PRECISION={DOT_PRECISION!r}: one of tf32, ieee")
SIXTEEN_BIT_DOTS = os.environ.get("OSTINATO_SSD_16BIT", "1") == "1"
CHUNK = 256  # = layers.mamba2.SSD_CHUNK
CARRY_PROGRAMS_WITH_COUNTS = 4  # a captured step's carry: programs per state block, striding over requests


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, LOW: tl.constexpr):
    """a @ b, float32 sums. PRECISION "low": both operands rounded to LOW (the activations' 16-bit dtype, as
    mamba_ssm's kernels do); else float32 operands at that input precision (tf32, ieee)."""
    if PRECISION == "low":
        out = tl.dot(a.to(LOW), b.to(LOW))
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return out


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, LOW: tl.constexpr):
    """acc + a @ b as `_dot`, summed in acc's registers (no second accumulator beside it)."""
    if PRECISION == "low":
        out = tl.dot(a.to(LOW), b.to(LOW), acc=acc)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision=PRECISION)
    return out


@triton.jit
def _chunk_program(counts_ptr, HAS_COUNTS: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr = True):
    """After the PDL wait (layers/triton_ops/pdl.py: nothing read or written before it; WAIT=False leaves the
    wait to the caller), this program's chunk k (the grid's first axis) and whether k lies past the real chunk
    count: with HAS_COUNTS the grid is sized for the most chunks a captured step can have, and the step's count
    is counts[1] (on the device: a table filled before the step, not by an earlier kernel)."""
    if PDL:
        if WAIT:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    k = tl.program_id(0)
    past = k < 0
    if HAS_COUNTS:
        past = k >= tl.load(counts_ptr + 1)
    return k, past


@triton.jit
def _chunk_of(k, cu_ptr, chunk_req_ptr, chunk_start_ptr):
    """Chunk k's first token and its request's end."""
    r = tl.load(chunk_req_ptr + k)
    return tl.load(chunk_start_ptr + k), tl.load(cu_ptr + r + 1)


@triton.jit
def _chunk_cumsum(k, hb, c0, end, dt_ptr, dtc_ptr, acum_ptr, a_ptr, dtb_ptr, dt_min, dt_max, stride_dt,
                  H: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Chunk k, heads block hb: each token's discretized dt and a = cumsum(dt * A) from the chunk start, into
    [chunks, H, CHUNK] float32 (0 dt past the request's end, so a holds its last value there). Under PDL it
    reads dt (in_proj's, done when this grid starts) and computes before the wait; it stores after it."""
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, CHUNK)
    mask_h = offs_h < H
    mask_t = c0 + offs_l < end
    dt = tl.load(dt_ptr + (c0 + offs_l)[:, None] * stride_dt + offs_h[None, :],
                 mask=mask_t[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
    dt += tl.load(dtb_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))  # softplus, torch's threshold
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(mask_t[:, None], dt, 0.0)
    a = -tl.exp(tl.load(a_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32))  # A = -exp(A_log)
    acum = tl.cumsum(dt * a[None, :], axis=0)
    offs = k.to(tl.int64) * (H * CHUNK) + offs_h[None, :] * CHUNK + offs_l[:, None]
    if PDL:
        tl.extra.cuda.gdc_wait()
    tl.store(dtc_ptr + offs, dt, mask=mask_h[None, :])
    tl.store(acum_ptr + offs, acum, mask=mask_h[None, :])


@triton.jit
def _chunk_cb(k, g, mb, sb, c0, end, b_ptr, c_ptr, cb_ptr, stride_b, stride_c, G: tl.constexpr, N: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk k, group g, [BLOCK_M, BLOCK_M] block (mb, sb): C_l . B_s into cb [chunks, G, CHUNK, CHUNK] float32
    (products of 16-bit activations are exact, the sums float32). Blocks above the diagonal are never read and
    stay unwritten; nor are blocks of rows past the request's end (the outputs kernel skips those rows)."""
    if (sb <= mb) & (c0 + mb * BLOCK_M < end):
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_s = sb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        mask_m = c0 + offs_m < end
        mask_s = c0 + offs_s < end
        cm = tl.load(c_ptr + (c0 + offs_m)[:, None] * stride_c + g * N + offs_n[None, :],
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        bm = tl.load(b_ptr + (c0 + offs_s)[:, None] * stride_b + g * N + offs_n[None, :],
                     mask=mask_s[:, None] & mask_n[None, :], other=0.0)
        cb = _dot(cm, tl.trans(bm), PRECISION, c_ptr.dtype.element_ty)
        out = cb_ptr + (k.to(tl.int64) * G + g) * (CHUNK * CHUNK) + offs_m[:, None] * CHUNK + offs_s[None, :]
        tl.store(out, cb)


@triton.jit
def _ssd_prep_kernel(dt_ptr, dtc_ptr, acum_ptr, b_ptr, c_ptr, cb_ptr, cu_ptr, chunk_req_ptr, chunk_start_ptr, a_ptr,
                     dtb_ptr, counts_ptr, dt_min, dt_max, stride_dt, stride_b, stride_c, H: tl.constexpr,
                     G: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                     HAS_COUNTS: tl.constexpr, PDL: tl.constexpr = False):
    """Per chunk, two independent jobs side by side in one launch: programs [0, G * blocks^2) take C . B^T's
    blocks (`_chunk_cb`), the rest the dt cumsum of a block of heads (`_chunk_cumsum`, which waits late)."""
    k, past = _chunk_program(counts_ptr, HAS_COUNTS, PDL, WAIT=False)
    if past:
        return
    c0, end = _chunk_of(k, cu_ptr, chunk_req_ptr, chunk_start_ptr)
    nb: tl.constexpr = (CHUNK + BLOCK_M - 1) // BLOCK_M
    j = tl.program_id(1)
    if j < G * nb * nb:
        if PDL:  # B and C: the conv's
            tl.extra.cuda.gdc_wait()
        g = j // (nb * nb)
        _chunk_cb(k, g, j % (nb * nb) // nb, j % nb, c0, end, b_ptr, c_ptr, cb_ptr, stride_b, stride_c, G, N,
                  BLOCK_M, BLOCK_N, CHUNK, PRECISION)
    else:
        _chunk_cumsum(k, j - G * nb * nb, c0, end, dt_ptr, dtc_ptr, acum_ptr, a_ptr, dtb_ptr, dt_min, dt_max,
                      stride_dt, H, CHUNK, BLOCK_H, PDL)


@triton.jit
def _ssd_states_kernel(x_ptr, b_ptr, dtc_ptr, acum_ptr, ws_ptr, cu_ptr, chunk_req_ptr, chunk_start_ptr,
                       counts_ptr, stride_x, stride_b, H: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
                       P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_L: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                       HAS_COUNTS: tl.constexpr, PDL: tl.constexpr = False):
    """Per (chunk, head, state tile): the state the chunk alone builds from zero,
    sum_s exp(a_end - a_s) dt_s x_s B_s^T, into ws [chunks, H, P, N] float32. All chunks in parallel."""
    k, past = _chunk_program(counts_ptr, HAS_COUNTS, PDL)
    if past:
        return
    h = tl.program_id(1)
    pb = tl.program_id(2) // tl.cdiv(N, BLOCK_N)
    nb = tl.program_id(2) % tl.cdiv(N, BLOCK_N)
    c0, end = _chunk_of(k, cu_ptr, chunk_req_ptr, chunk_start_ptr)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    g = h // HEADS_PER_GROUP
    base = k.to(tl.int64) * (H * CHUNK) + h * CHUNK
    a_end = tl.load(acum_ptr + base + CHUNK - 1)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for l0 in range(0, tl.minimum(end - c0, CHUNK), BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        t = c0 + offs_l
        mask_t = t < end
        w = tl.load(dtc_ptr + base + offs_l) * tl.exp(a_end - tl.load(acum_ptr + base + offs_l))
        x = tl.load(x_ptr + t[:, None] * stride_x + h * P + offs_p[None, :], mask=mask_t[:, None] & mask_p[None, :],
                    other=0.0)
        bm = tl.load(b_ptr + t[:, None] * stride_b + g * N + offs_n[None, :], mask=mask_t[:, None] & mask_n[None, :],
                     other=0.0)
        acc += _dot(tl.trans(x.to(tl.float32) * w[:, None]), bm, PRECISION, x_ptr.dtype.element_ty)
    ws = ws_ptr + k.to(tl.int64) * (H * P * N) + h * (P * N) + offs_p[:, None] * N + offs_n[None, :]
    tl.store(ws, acc, mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def _ssd_carry_kernel(ws_ptr, win_ptr, acum_ptr, state_ptr, slot_ptr, chunk_cu_ptr, counts_ptr, stride_s_slot,
                      stride_s_h, stride_s_p, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr, HAS_COUNTS: tl.constexpr, PDL: tl.constexpr = False):
    """Per (request, block of state entries): the carry, the only sequential part and elementwise. Walks the
    request's chunks from its stored state, s <- exp(a_end) s + (the chunk's own state, from ws), storing the
    state entering each chunk in win (in the outputs kernel's dot operand dtype; win may be ws itself); the final
    state goes back to the slot. With HAS_COUNTS the grid's first dimension may be smaller than the request
    count (counts[0], on the device): a program then takes every grid-th request."""
    num_reqs = tl.num_programs(0)
    if HAS_COUNTS:
        num_reqs = tl.load(counts_ptr)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H * P * N
    h = offs // (P * N)
    p = offs // N % P
    n = offs % N
    for r in range(tl.program_id(0), num_reqs, tl.num_programs(0)):
        slot = tl.load(slot_ptr + r).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_s_slot + h * stride_s_h + p * stride_s_p + n
        s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)  # the last step's: read before the wait
        k1 = tl.load(chunk_cu_ptr + r + 1).to(tl.int64)
        k = tl.load(chunk_cu_ptr + r).to(tl.int64)
        # layers/triton_ops/pdl.py: ws (the states kernel's) and every write after the wait (a no-op after a
        # program's first request)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        own = tl.load(ws_ptr + k * (H * P * N) + offs, mask=mask, other=0.0)  # every request has a chunk
        while k < k1:
            # one chunk ahead (the last chunk reloads itself, unused): the loads do not wait on the carry
            nxt = tl.load(ws_ptr + tl.minimum(k + 1, k1 - 1) * (H * P * N) + offs, mask=mask, other=0.0)
            decay = tl.exp(tl.load(acum_ptr + k * (H * CHUNK) + h * CHUNK + CHUNK - 1, mask=mask, other=0.0))
            tl.store(win_ptr + k * (H * P * N) + offs, s.to(win_ptr.dtype.element_ty), mask=mask)
            s = decay * s + own
            own = nxt
            k += 1
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ssd_outputs_kernel(x_ptr, cb_ptr, c_ptr, y_ptr, dtc_ptr, acum_ptr, win_ptr, d_ptr, cu_ptr, chunk_req_ptr,
                        chunk_start_ptr, counts_ptr, stride_x, stride_c, stride_y, H: tl.constexpr,
                        HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                        PRECISION: tl.constexpr, HAS_COUNTS: tl.constexpr, PDL: tl.constexpr = False):
    """Per (chunk, head, block of BLOCK_M rows x BLOCK_P columns): the intra-chunk sum over the source blocks up
    to the diagonal (flash-attention style: cb_ms exp(a_m - a_s) dt_s x_s, with cb = C_m . B_s from the group's
    table), plus the incoming state (win, from the carry) decayed to each row, plus D x.
    Under PDL the wait comes after the intra-chunk sum, just before win is read: that sum reads only what the
    conv and the prep kernel wrote, and they completed before the carry (the kernel before this one) passed its
    own wait and let this grid launch. So the sum overlaps the carry."""
    k, past = _chunk_program(counts_ptr, HAS_COUNTS, PDL, WAIT=False)
    if past:
        return
    h = tl.program_id(1)
    mb = tl.program_id(2) // tl.cdiv(P, BLOCK_P)
    pb = tl.program_id(2) % tl.cdiv(P, BLOCK_P)
    c0, end = _chunk_of(k, cu_ptr, chunk_req_ptr, chunk_start_ptr)
    m0 = mb * BLOCK_M
    if c0 + m0 >= end:  # a tail chunk's rows past the request's end
        return
    low = x_ptr.dtype.element_ty
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    t_m = c0 + offs_m
    mask_m = t_m < end
    mask_p = offs_p < P
    mask_n = offs_n < N
    g = h // HEADS_PER_GROUP
    base = k.to(tl.int64) * (H * CHUNK) + h * CHUNK
    a_m = tl.load(acum_ptr + base + offs_m)
    cb_rows = cb_ptr + (k.to(tl.int64) * (H // HEADS_PER_GROUP) + g) * (CHUNK * CHUNK) + offs_m[:, None] * CHUNK
    # the dots compute y^T [BLOCK_P, BLOCK_M]: the state rows are the dots' M, a warpgroup's 64 for wgmma on Hopper
    # (y's rows as M, 32 of them, took mma.sync with every warp loading all of w: 3% slower for the whole scan)
    acc = tl.zeros([BLOCK_P, BLOCK_M], dtype=tl.float32)
    for s0 in range(0, m0 + BLOCK_M, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        t_s = c0 + offs_s
        mask_s = t_s < end
        # [BLOCK_M, BLOCK_S]: rows and columns past the end hold 0, entries above the diagonal garbage
        # (unwritten; the causal mask below drops them)
        cb = tl.load(cb_rows + offs_s[None, :])
        a_s = tl.load(acum_ptr + base + offs_s)
        w = cb * tl.exp(tl.minimum(a_m[:, None] - a_s[None, :], 0.0)) * tl.load(dtc_ptr + base + offs_s)[None, :]
        w = tl.where(offs_m[:, None] >= offs_s[None, :], w, 0.0)
        xst = tl.load(x_ptr + t_s[None, :] * stride_x + h * P + offs_p[:, None],
                      mask=mask_s[None, :] & mask_p[:, None], other=0.0)  # [BLOCK_P, BLOCK_S]
        acc = _dot_acc(xst, tl.trans(w), acc, PRECISION, low)
    xmt = tl.load(x_ptr + t_m[None, :] * stride_x + h * P + offs_p[:, None], mask=mask_m[None, :] & mask_p[:, None],
                  other=0.0)
    acc += tl.load(d_ptr + h).to(tl.float32) * xmt.to(tl.float32)
    cm = tl.load(c_ptr + t_m[:, None] * stride_c + g * N + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :],
                 other=0.0)  # [BLOCK_M, BLOCK_N]
    if PDL:  # the carry's win (and y may still be in use by it: no write before this)
        tl.extra.cuda.gdc_wait()
    s_in = tl.load(win_ptr + k.to(tl.int64) * (H * P * N) + h * (P * N) + offs_p[:, None] * N + offs_n[None, :],
                   mask=mask_p[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_P, BLOCK_N]
    acc += _dot(s_in, tl.trans(cm), PRECISION, low) * tl.exp(a_m)[None, :]
    tl.store(y_ptr + t_m[None, :] * stride_y + h * P + offs_p[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[None, :] & mask_p[:, None])


def dot_precision(dtype: torch.dtype) -> str:
    """The dots' operands (see the module doc): "low" (the activations' 16-bit dtype) or a float32 precision."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "ieee"
    return "low" if dtype in (torch.bfloat16, torch.float16) and SIXTEEN_BIT_DOTS else DOT_PRECISION


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
                   slots: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float,
                   dt_max: float, num_heads: int, head_dim: int, groups: int, cu_seqlens: torch.Tensor,
                   chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], chunk: int = CHUNK, block_m: int = 32,
                   block_s: int | None = None, block_p: int | None = None, block_l: int = 64,
                   state_block: tuple[int, int] = (64, 64), num_warps: int = 4, state_warps: int = 4,
                   carry_block: int = 1024,
                   counts: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The prefill scan: x [T, H*P], dt [T, H] (raw, before bias and softplus), B/C [T, G*N] (row-strided views
    are fine), `cu_seqlens` [R+1] (int32) splitting the T tokens into R requests, `chunks` the batch's chunk
    table (`layers.mamba2.ssd_chunk_table(extend_lens, chunk)` on the device) -> y [T, H*P] in `out_dtype` with
    the D skip; `state` [slots, H, P, N] is read and updated in place at `slots` [R]. Same contract as
    `ssm_scan`. `counts` (int32 device: requests, chunks): the tables are a captured step's
    (layers/mamba_tables.py), sized for the most requests and chunks, and the grids skip what lies past the real
    counts. block_m / block_s (the outputs' row and source blocks; block_s a multiple of block_m, at least it) /
    block_p / block_l / state_block / the warps / carry_block: tuning knobs
    (benchmarks/bench_ssd_scan.py --sweep); the defaults were the fastest at granite-1b's shape on an H200.
    Workspace: `layers.mamba2.ssd_workspace_bytes`."""
    T = x.shape[0]
    N = state.shape[-1]
    H, P = num_heads, head_dim
    assert state.stride(-1) == 1 and x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    assert chunk >= 16 and chunk & (chunk - 1) == 0, "chunk: a power of two >= 16 (tl.dot's minimum)"
    chunk_req, chunk_start, chunk_cu = chunks
    num_chunks, R = chunk_req.shape[0], cu_seqlens.shape[0] - 1
    dev = x.device
    y = torch.empty(T, H * P, dtype=out_dtype, device=dev)
    dtc = torch.empty(num_chunks, H, chunk, dtype=torch.float32, device=dev)
    acum = torch.empty_like(dtc)
    ws = torch.empty(num_chunks, H, P, N, dtype=torch.float32, device=dev)
    cb = torch.empty(num_chunks, groups, chunk, chunk, dtype=torch.float32, device=dev)
    counts_arg = cu_seqlens if counts is None else counts  # any pointer: read only with counts
    has_counts = counts is not None
    precision = dot_precision(x.dtype)
    pdl = pdl_enabled(x)
    bn = max(16, triton.next_power_of_2(N))
    if num_chunks:
        block_h = min(4, triton.next_power_of_2(H))  # small: a few chunks still make enough programs
        bm = min(block_m, chunk)
        cb_programs = groups * triton.cdiv(chunk, bm) ** 2
        _ssd_prep_kernel[(num_chunks, cb_programs + triton.cdiv(H, block_h))](
            dt, dtc, acum, B, C, cb, cu_seqlens, chunk_req, chunk_start, A_log, dt_bias, counts_arg, float(dt_min),
            float(dt_max), dt.stride(0), B.stride(0), C.stride(0), H=H, G=groups, N=N, CHUNK=chunk,
            BLOCK_H=block_h, BLOCK_M=bm, BLOCK_N=bn, PRECISION=precision, HAS_COUNTS=has_counts, PDL=pdl,
            launch_pdl=pdl)
        sp = max(16, min(state_block[0], triton.next_power_of_2(P)))
        sn = max(16, min(state_block[1], bn))
        _ssd_states_kernel[(num_chunks, H, triton.cdiv(P, sp) * triton.cdiv(N, sn))](
            x, B, dtc, acum, ws, cu_seqlens, chunk_req, chunk_start, counts_arg, x.stride(0), B.stride(0), H=H,
            HEADS_PER_GROUP=H // groups, P=P, N=N, BLOCK_P=sp, BLOCK_N=sn, BLOCK_L=min(block_l, chunk), CHUNK=chunk,
            PRECISION=precision, HAS_COUNTS=has_counts, num_warps=state_warps, PDL=pdl, launch_pdl=pdl)
    req_programs = R if counts is None else min(R, CARRY_PROGRAMS_WITH_COUNTS)
    # the states entering the chunks, in the outputs kernel's operand dtype (16-bit: half the bytes to read)
    win = ws if precision != "low" else torch.empty(ws.shape, dtype=x.dtype, device=dev)
    _ssd_carry_kernel[(req_programs, triton.cdiv(H * P * N, carry_block))](
        ws, win, acum, state, slots, chunk_cu, counts_arg, state.stride(0), state.stride(1), state.stride(2), H=H,
        P=P, N=N, CHUNK=chunk, BLOCK=carry_block, HAS_COUNTS=has_counts, PDL=pdl, launch_pdl=pdl)
    if num_chunks:
        bm = min(block_m, chunk)
        bs = max(bm, min(block_s or bm, chunk))
        bp = max(16, min(block_p or P, triton.next_power_of_2(P)))
        _ssd_outputs_kernel[(num_chunks, H, triton.cdiv(chunk, bm) * triton.cdiv(P, bp))](
            x, cb, C, y, dtc, acum, win, D, cu_seqlens, chunk_req, chunk_start, counts_arg, x.stride(0),
            C.stride(0), y.stride(0), H=H, HEADS_PER_GROUP=H // groups, P=P, N=N, BLOCK_M=bm, BLOCK_S=bs,
            BLOCK_P=bp, BLOCK_N=bn, CHUNK=chunk, PRECISION=precision, HAS_COUNTS=has_counts,
            num_warps=num_warps, PDL=pdl, launch_pdl=pdl)
    return y
