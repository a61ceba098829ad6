"""The Mamba2 prefill scan as a chunked SSD ("state space duality") Triton kernel, varlen over a batch.

Each request's tokens are cut into chunks of CHUNK tokens (not walked a token at a time, as `ssm_scan`'s prefill
form does); the state [P, N] of each head is float32, read from and written back to the request's MambaPool
slot. Per chunk, with a = cumsum(dt * A) the log-decay from the chunk start through each token:
- y_l = sum_{s<=l} (C_l . B_s) exp(a_l - a_s) dt_s x_s   (intra-chunk: two matmuls, a masked [L, L] form)
      + exp(a_l) C_l . state                            (the incoming state: one matmul)
      + D x_l;
- state <- exp(a_end) state + sum_s exp(a_end - a_s) dt_s x_s B_s^T   (one matmul).
Two forms: `ssd_chunk_scan` (fused: one program per request, head and block of rows walks the chunks with
the state in registers) and `ssd_chunk_scan_2pass` (the carry alone first, storing each chunk's incoming
state, then every chunk's outputs in parallel: for few long requests, which leave the fused form's grid small).
Chunks start at each request's first token, so a chunked prefill (which resumes from the stored state) gives
what one pass gives, up to rounding. Every exponent is <= 0: no overflow. Only the chunk-to-chunk carry is
sequential: CHUNK times fewer dependent steps than the token loop.

The dots run on tensor cores: C.B^T in the activations' dtype (bf16 products are exact, the sums float32;
Triton's CPU interpreter gets bf16 dots wrong, so there it takes float32 copies), the others on float32
operands at `DOT_PRECISION` (tf32 by default: each product has one operand rounded to 10 mantissa bits, 8x
finer than the bf16 rounding of the activations; OSTINATO_SSD_PRECISION=ieee for float32).
The twin and test oracle is `ssd_scan` in `layers/mamba2.py`.
"""

import os

import torch
import triton
import triton.language as tl

# the float32-operand dots on the GPU: tf32 (default), ieee (float32 FMAs)
# (tf32x3 is refused: on an H200 with triton 3.6 these kernels hit an illegal memory access with it)
DOT_PRECISION = os.environ.get("OSTINATO_SSD_PRECISION", "tf32")
if DOT_PRECISION not in ("tf32", "ieee"):
    raise ValueError(f"OSTINATO_SSD_PRECISION={DOT_PRECISION!r}: one of tf32, ieee")
CHUNK = 64  # = layers.mamba2.SSD_CHUNK, whose chunk table the two-pass form takes
STATE_PROGRAMS_WITH_COUNTS = 4  # a captured step's state pass: programs per head and tile, striding over requests


@triton.jit
def _chunk_dt(dt_ptr, t, mask_t, stride_dt, h, dtb, a, dt_min, dt_max, CHUNK: tl.constexpr):
    """A chunk's discretized dt [L] (0 past the request's end: no decay, no input), a = cumsum(dt * A) [L]
    (non-increasing) and its last value a_end (padded tokens repeat the last real one)."""
    dt = tl.load(dt_ptr + t * stride_dt + h, mask=mask_t, other=0.0).to(tl.float32) + dtb
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))  # softplus, torch's threshold
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(mask_t, dt, 0.0)
    acum = tl.cumsum(dt * a, axis=0)
    a_end = tl.sum(tl.where(tl.arange(0, CHUNK) == CHUNK - 1, acum, 0.0), axis=0)
    return dt, acum, a_end


@triton.jit
def _chunk_intra(cm, bm, xf, dt, acum, CHUNK: tl.constexpr, PRECISION: tl.constexpr, NATIVE_CB: tl.constexpr):
    """The intra-chunk output [L, BLOCK_P]: sum_{s<=l} (C_l.B_s) exp(a_l - a_s) dt_s x_s."""
    offs_l = tl.arange(0, CHUNK)
    if NATIVE_CB:  # bf16/fp16 operands: exact products, float32 sums
        cb = tl.dot(cm, tl.trans(bm))  # [L, L] float32
    else:
        cb = tl.dot(cm.to(tl.float32), tl.trans(bm.to(tl.float32)), input_precision=PRECISION)
    causal = offs_l[:, None] >= offs_l[None, :]
    decay = tl.where(causal, tl.exp(tl.minimum(acum[:, None] - acum[None, :], 0.0)), 0.0)
    return tl.dot(cb * decay * dt[None, :], xf, input_precision=PRECISION)


@triton.jit
def _ssd_chunk_scan_kernel(x_ptr, dt_ptr, b_ptr, c_ptr, y_ptr, state_ptr, slot_ptr, cu_ptr, a_ptr, d_ptr, dtb_ptr,
                           dt_min, dt_max, stride_x, stride_dt, stride_b, stride_c, stride_y,
                           stride_s_slot, stride_s_h, stride_s_p,
                           HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                           NATIVE_CB: tl.constexpr):
    """Fused: one program per (request, head, row block) walks the request's chunks in order."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    start = tl.load(cu_ptr + r)
    end = tl.load(cu_ptr + r + 1)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, CHUNK)
    mask_p = offs_p < P
    mask_n = offs_n < N
    s_ptrs = state_ptr + slot * stride_s_slot + h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :]
    s_mask = mask_p[:, None] & mask_n[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    a = -tl.exp(tl.load(a_ptr + h).to(tl.float32))  # A = -exp(A_log)
    d = tl.load(d_ptr + h).to(tl.float32)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    g = h // HEADS_PER_GROUP
    for c0 in range(start, end, CHUNK):
        t = c0 + offs_l
        mask_t = t < end
        dt, acum, a_end = _chunk_dt(dt_ptr, t, mask_t, stride_dt, h, dtb, a, dt_min, dt_max, CHUNK)
        x = tl.load(x_ptr + t[:, None] * stride_x + h * P + offs_p[None, :], mask=mask_t[:, None] & mask_p[None, :],
                    other=0.0)  # [L, BLOCK_P]
        bm = tl.load(b_ptr + t[:, None] * stride_b + g * N + offs_n[None, :], mask=mask_t[:, None] & mask_n[None, :],
                     other=0.0)  # [L, BLOCK_N]
        cm = tl.load(c_ptr + t[:, None] * stride_c + g * N + offs_n[None, :], mask=mask_t[:, None] & mask_n[None, :],
                     other=0.0)
        xf = x.to(tl.float32)
        # the incoming state decayed to each token, then the carry (the old state dies here: this order spills
        # less, ptxas for sm_90), then the intra-chunk part
        y = tl.dot(cm.to(tl.float32), tl.trans(state), input_precision=PRECISION) * tl.exp(acum)[:, None]
        xw = xf * (dt * tl.exp(a_end - acum))[:, None]  # each token's input decayed to the chunk's end
        state = state * tl.exp(a_end) + tl.dot(tl.trans(xw), bm.to(tl.float32), input_precision=PRECISION)
        y += _chunk_intra(cm, bm, xf, dt, acum, CHUNK, PRECISION, NATIVE_CB)
        y += d * xf
        tl.store(y_ptr + t[:, None] * stride_y + h * P + offs_p[None, :], y, mask=mask_t[:, None] & mask_p[None, :])
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


@triton.jit
def _ssd_states_kernel(x_ptr, dt_ptr, b_ptr, ws_ptr, state_ptr, slot_ptr, cu_ptr, chunk_cu_ptr, a_ptr, dtb_ptr,
                       counts_ptr, dt_min, dt_max, stride_x, stride_dt, stride_b, stride_s_slot, stride_s_h,
                       stride_s_p, H: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                       HAS_COUNTS: tl.constexpr):
    """Two-pass, pass 1: one program per (request, head, row block, column block) carries the state through the
    request's chunks (one matmul each) and stores each chunk's incoming state in the workspace ws
    [chunks, H, P, N] (float32); the final state goes back to the slot. With HAS_COUNTS (a captured step's
    tables) the grid's first dimension may be smaller than the request count on the device: a program then
    takes every grid-th request."""
    num_reqs = tl.num_programs(0)
    if HAS_COUNTS:
        num_reqs = tl.load(counts_ptr)
    h = tl.program_id(1)
    pb = tl.program_id(2) // tl.cdiv(N, BLOCK_N)
    nb = tl.program_id(2) % tl.cdiv(N, BLOCK_N)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, CHUNK)
    mask_p = offs_p < P
    mask_n = offs_n < N
    s_mask = mask_p[:, None] & mask_n[None, :]
    ws_ptrs = ws_ptr + h * (P * N) + offs_p[:, None] * N + offs_n[None, :]
    a = -tl.exp(tl.load(a_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    g = h // HEADS_PER_GROUP
    for r in range(tl.program_id(0), num_reqs, tl.num_programs(0)):
        start = tl.load(cu_ptr + r)
        end = tl.load(cu_ptr + r + 1)
        k = tl.load(chunk_cu_ptr + r).to(tl.int64)  # the request's first chunk in ws
        slot = tl.load(slot_ptr + r).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_s_slot + h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :]
        state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        for c0 in range(start, end, CHUNK):
            tl.store(ws_ptrs + k * (H * P * N), state, mask=s_mask)
            t = c0 + offs_l
            mask_t = t < end
            dt, acum, a_end = _chunk_dt(dt_ptr, t, mask_t, stride_dt, h, dtb, a, dt_min, dt_max, CHUNK)
            x = tl.load(x_ptr + t[:, None] * stride_x + h * P + offs_p[None, :],
                        mask=mask_t[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
            bm = tl.load(b_ptr + t[:, None] * stride_b + g * N + offs_n[None, :],
                         mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            xw = x * (dt * tl.exp(a_end - acum))[:, None]
            state = state * tl.exp(a_end) + tl.dot(tl.trans(xw), bm, input_precision=PRECISION)
            k += 1
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


@triton.jit
def _ssd_outputs_kernel(x_ptr, dt_ptr, b_ptr, c_ptr, y_ptr, ws_ptr, cu_ptr, chunk_req_ptr, chunk_start_ptr, a_ptr,
                        d_ptr, dtb_ptr, counts_ptr, dt_min, dt_max, stride_x, stride_dt, stride_b, stride_c, stride_y,
                        H: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                        NATIVE_CB: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """Two-pass, pass 2: one program per (chunk, head, row block), all independent: the intra-chunk output plus
    the chunk's incoming state (from pass 1) decayed to each token, plus D x."""
    k = tl.program_id(0)
    if HAS_COUNTS:  # a grid sized for the most chunks (a captured step): the real count is counts[1]
        if k >= tl.load(counts_ptr + 1):
            return
    h = tl.program_id(1)
    pb = tl.program_id(2)
    r = tl.load(chunk_req_ptr + k)
    c0 = tl.load(chunk_start_ptr + k)
    end = tl.load(cu_ptr + r + 1)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    t = c0 + tl.arange(0, CHUNK)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_t = t < end
    a = -tl.exp(tl.load(a_ptr + h).to(tl.float32))
    d = tl.load(d_ptr + h).to(tl.float32)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    g = h // HEADS_PER_GROUP
    dt, acum, a_end = _chunk_dt(dt_ptr, t, mask_t, stride_dt, h, dtb, a, dt_min, dt_max, CHUNK)
    x = tl.load(x_ptr + t[:, None] * stride_x + h * P + offs_p[None, :], mask=mask_t[:, None] & mask_p[None, :],
                other=0.0)
    bm = tl.load(b_ptr + t[:, None] * stride_b + g * N + offs_n[None, :], mask=mask_t[:, None] & mask_n[None, :],
                 other=0.0)
    cm = tl.load(c_ptr + t[:, None] * stride_c + g * N + offs_n[None, :], mask=mask_t[:, None] & mask_n[None, :],
                 other=0.0)
    xf = x.to(tl.float32)
    y = _chunk_intra(cm, bm, xf, dt, acum, CHUNK, PRECISION, NATIVE_CB)
    s_in = tl.load(ws_ptr + k.to(tl.int64) * (H * P * N) + h * (P * N) + offs_p[:, None] * N + offs_n[None, :],
                   mask=mask_p[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_P, BLOCK_N]
    y += tl.dot(cm.to(tl.float32), tl.trans(s_in), input_precision=PRECISION) * tl.exp(acum)[:, None]
    y += d * xf
    tl.store(y_ptr + t[:, None] * stride_y + h * P + offs_p[None, :], y, mask=mask_t[:, None] & mask_p[None, :])


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
                   slots: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float,
                   dt_max: float, num_heads: int, head_dim: int, groups: int, cu_seqlens: torch.Tensor,
                   chunk: int = CHUNK, block_p: int | None = None, num_warps: int = 8,
                   num_stages: int | None = None) -> torch.Tensor:
    """The prefill scan: x [T, H*P], dt [T, H] (raw, before bias and softplus), B/C [T, G*N] (row-strided views
    are fine), `cu_seqlens` [R+1] (int) splitting the T tokens into R requests -> y [T, H*P] float32 with the
    D skip; `state` [slots, H, P, N] is read and updated in place at `slots` [R]. Same contract as `ssm_scan`.
    chunk / block_p / num_warps / num_stages: tuning knobs (benchmarks/bench_ssd_scan.py sweeps them)."""
    T = x.shape[0]
    N = state.shape[-1]
    assert state.stride(-1) == 1 and x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    assert chunk >= 16 and chunk & (chunk - 1) == 0, "chunk: a power of two >= 16 (tl.dot's minimum)"
    y = torch.empty(T, num_heads * head_dim, dtype=torch.float32, device=x.device)
    R = cu_seqlens.shape[0] - 1
    if block_p is None:  # 32 rows: 96 programs for one request at granite-1b's 48 heads x 64
        block_p = 32
    block_p = max(16, min(block_p, triton.next_power_of_2(head_dim)))
    grid = (R, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_chunk_scan_kernel[grid](
        x, dt, B, C, y, state, slots, cu_seqlens, A_log, D, dt_bias,
        float(dt_min), float(dt_max), x.stride(0), dt.stride(0), B.stride(0), C.stride(0), y.stride(0),
        state.stride(0), state.stride(1), state.stride(2),
        HEADS_PER_GROUP=num_heads // groups, P=head_dim, N=N, BLOCK_P=block_p,
        BLOCK_N=max(16, triton.next_power_of_2(N)), CHUNK=chunk, PRECISION=DOT_PRECISION,
        NATIVE_CB=B.dtype in (torch.bfloat16, torch.float16) and os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return y


def ssd_chunk_scan_2pass(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
                         slots: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                         dt_min: float, dt_max: float, num_heads: int, head_dim: int, groups: int,
                         cu_seqlens: torch.Tensor, chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         chunk: int = CHUNK, block_p: int = 64, num_warps: int = 4,
                         state_block: tuple[int, int] = (32, 32), state_warps: int = 4,
                         counts: torch.Tensor | None = None) -> torch.Tensor:
    """`ssd_chunk_scan` in two launches, for few long requests (where one program per request and head leaves
    most of the GPU idle): pass 1 carries the state through each request's chunks, the only sequential part
    (one matmul per chunk, parallel over [state_block] tiles of the state), storing each chunk's incoming state
    in a float32 workspace [chunks, H, P, N] (50 MB for 2,048 tokens at granite-1b's shape); pass 2 computes
    every chunk's outputs in parallel, per [chunk, head, block_p rows]. `chunks`:
    `layers.mamba2.ssd_chunk_table(extend_lens, chunk)` on the device. Defaults: the state pass's tiles have no
    register spills in ptxas for sm_90 at granite-1b's shape (P 64, N 128); pass 2 at 4 warps rather than 8 took
    the two passes from 181 to 138 us at 2,048 tokens and from 76 to 55 at 512 (H200, bench_ssd_scan.py's sweep).
    `counts` (int32 device: requests, chunks): the tables are a captured step's (layers/mamba_tables.py), sized
    for the most requests and chunks, and the grids skip what lies past the real counts."""
    T = x.shape[0]
    N = state.shape[-1]
    assert state.stride(-1) == 1 and x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    assert chunk >= 16 and chunk & (chunk - 1) == 0, "chunk: a power of two >= 16 (tl.dot's minimum)"
    chunk_req, chunk_start, chunk_cu = chunks
    y = torch.empty(T, num_heads * head_dim, dtype=torch.float32, device=x.device)
    ws = torch.empty(chunk_req.shape[0], num_heads, head_dim, N, dtype=torch.float32, device=x.device)
    R = cu_seqlens.shape[0] - 1
    sp = max(16, min(state_block[0], triton.next_power_of_2(head_dim)))
    sn = max(16, min(state_block[1], triton.next_power_of_2(N)))
    common = dict(H=num_heads, HEADS_PER_GROUP=num_heads // groups, P=head_dim, N=N, CHUNK=chunk,
                  PRECISION=DOT_PRECISION)
    counts_arg = cu_seqlens if counts is None else counts  # any pointer: read only with counts
    # with counts, R is only a bound: a few programs per head and tile stride over the real requests instead of
    # one each, most of which would exit at once (6,500 such programs cost Granite's 2,048-token prefill 0.5 ms)
    req_programs = R if counts is None else min(R, STATE_PROGRAMS_WITH_COUNTS)
    _ssd_states_kernel[(req_programs, num_heads, triton.cdiv(head_dim, sp) * triton.cdiv(N, sn))](
        x, dt, B, ws, state, slots, cu_seqlens, chunk_cu, A_log, dt_bias, counts_arg, float(dt_min), float(dt_max),
        x.stride(0), dt.stride(0), B.stride(0), state.stride(0), state.stride(1), state.stride(2),
        BLOCK_P=sp, BLOCK_N=sn, num_warps=state_warps, HAS_COUNTS=counts is not None, **common,
    )
    if chunk_req.shape[0]:
        block_p = max(16, min(block_p, triton.next_power_of_2(head_dim)))
        _ssd_outputs_kernel[(chunk_req.shape[0], num_heads, triton.cdiv(head_dim, block_p))](
            x, dt, B, C, y, ws, cu_seqlens, chunk_req, chunk_start, A_log, D, dt_bias, counts_arg, float(dt_min),
            float(dt_max), x.stride(0), dt.stride(0), B.stride(0), C.stride(0), y.stride(0),
            BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(N)), num_warps=num_warps,
            HAS_COUNTS=counts is not None, **common,
            NATIVE_CB=B.dtype in (torch.bfloat16, torch.float16) and os.environ.get("TRITON_INTERPRET") != "1",
        )
    return y
