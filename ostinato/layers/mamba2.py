"""The Mamba2 mixer between in_proj and out_proj, as one custom op `ostinato::mamba_mixer`.

The op takes the in_proj output zxbcdt [T, I + conv_dim + H] (gate z, conv input xBC, dt) and returns
the gated RMSNorm of the SSM output [T, I]. It reads and updates the layer's conv and SSM state of each
request in place, at the request's Mamba slot (`ForwardBatch.mamba_slots`):
- EXTEND (a prefill chunk): the causal conv continues from the stored last `kernel - 1` inputs, and the
  chunked SSD scan starts from the stored state, so a prompt cut into chunks gives what one pass gives;
- DECODE: one conv-state shift and one state update per request, batched, no data-dependent shape
  (capturable; padded rows of a graph point at the sink slot).
Like `ostinato::attention`, the op is opaque to torch.compile (eager calls run its function directly).
Piecewise graphs register it as a split op (graphs/compile_backend.py) and either split at it (it then runs
eagerly between the pieces, on the real rows) or, with eager pieces, capture it inside them: the step's layout
then comes from tables at fixed addresses (`mamba_tables.py`) and the extend kernels launch at the tables'
bounds.

On the CPU everything runs in torch (the chunked scan here is the reference). On CUDA an extend runs the varlen
conv and the chunked SSD scan in Triton (`triton_ops/conv_extend.py`, `ssd_scan.py`), a decode the conv step
and the single-step update (`conv_step.py`, `ssm_scan.py`), both the gated norm (`gated_rms_norm.py`).
The SSD scan's launches are parallel over the batch's chunks of 256 tokens (see ssd_scan.py).
`OSTINATO_SSM_PREFILL` forces a path for comparison: `ssd-torchconv` (the torch gather conv, then `ssd`),
`serial` (the torch gather conv and the token-serial scan kernel: the path before the SSD kernels).
The SSM math is in float32 whatever the model dtype, as transformers' `torch_forward` does it.
"""

import os

import numpy as np
import torch
import torch.nn.functional as F

from ostinato.layers.mamba_tables import MambaStepTables, step_tables

MAMBA_OP_NAME = "ostinato::mamba_mixer"
SSD_CHUNK = 256  # the Triton SSD kernels' chunk length (= triton_ops.ssd_scan.CHUNK; the torch reference takes
# the config's)


# ---------------------------------------------------------------------------- torch reference pieces
def causal_conv_extend(xbc: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens xbc [n, D] after its stored inputs conv_state [D, K-1]: silu(conv) [n, D] and the
    new conv state [D, K-1] (the last K-1 inputs, old ones included when n < K-1)."""
    full = torch.cat([conv_state.to(weight.dtype), xbc.t().to(weight.dtype)], dim=-1)  # [D, K-1+n]
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=full.shape[0])[0]  # [D, n]
    return F.silu(out).t(), full[:, full.shape[1] - conv_state.shape[1]:]


def extend_conv_indices(extend_lens: list[int], kernel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host int64 indices for `causal_conv_varlen` over requests of `extend_lens` tokens: rows of
    cat([stored inputs of every request (R * (K-1) rows), the batch's new inputs (T rows)]).
    Returns (taps [T, K]: the K inputs each token's conv reads, new_state [R, K-1]: each request's last K-1
    inputs, cu_seqlens [R+1])."""
    R, k1 = len(extend_lens), kernel - 1
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    cu = torch.zeros(R + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    req = torch.repeat_interleave(torch.arange(R), lens)  # [T]: request of each token
    pos = torch.arange(int(cu[-1])) - cu[req]  # [T]: position within its request

    def rows(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:  # input at position p (< 0: stored) of request r
        return torch.where(p >= 0, R * k1 + cu[r] + p, r * k1 + k1 + p)

    taps = torch.arange(-k1, 1)
    return rows(req[:, None], pos[:, None] + taps), rows(torch.arange(R)[:, None], lens[:, None] + taps[:-1]), cu


def causal_conv_varlen(xbc: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, taps: torch.Tensor,
                       new_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The causal conv of a whole extend batch at once: xbc [T, D] (requests back to back), the stored inputs
    conv_state [slots, D, K-1] at `slots` [R]; indices from `extend_conv_indices` (on xbc's device). Returns
    silu(conv) [T, D] and writes each request's last K-1 inputs back to its slot."""
    R = slots.shape[0]
    stored = conv_state[slots].to(weight.dtype).transpose(1, 2).reshape(R * (weight.shape[1] - 1), -1)
    rows = torch.cat([stored, xbc.to(weight.dtype)])
    out = (rows[taps] * weight.t()).sum(1)  # [T, K, D] windows times the taps
    if bias is not None:
        out = out + bias
    conv_state.index_copy_(0, slots, rows[new_state].transpose(1, 2).to(conv_state.dtype))
    return F.silu(out)


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [B, D], conv_state [B, D, K-1] -> (silu(conv) [B, D], new state [B, D, K-1])."""
    window = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=-1)  # [B, D, K]
    out = (window * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, :, 1:]


def ssd_chunk_table(extend_lens: list[int], chunk: int = SSD_CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host int32 chunk metadata of a batch for the SSD kernels: each chunk's request [C] and first token [C],
    and each request's first chunk [R+1] (from `mamba_tables.step_tables`, which a captured step's tables use)."""
    return _int32(step_tables(extend_lens, chunk), "chunk_req", "chunk_start", "chunk_cu")


def ssd_workspace_bytes(chunks: int, num_heads: int, head_dim: int, state_size: int, groups: int,
                        chunk: int = SSD_CHUNK) -> int:
    """GPU bytes the SSD kernels' workspace takes for a step of `chunks` chunks (at most): each chunk's own
    state (float32) and incoming state (float32, or 16-bit: counted at 4 bytes), C . B^T per group (float32),
    dt and its cumsum (float32)."""
    return chunks * (2 * num_heads * head_dim * state_size * 4 + groups * chunk * chunk * 4 + 2 * num_heads * chunk * 4)


def _int32(tables: dict[str, np.ndarray], *names: str) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(tables[name].astype(np.int32)) for name in names)


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_min, dt_max)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of one request, float32. x [n, H, P], dt [n, H] (discretized), A [H] (negative),
    B/C [n, H, N] (per head), state [H, P, N] at the start. Returns y [n, H, P] (without the D skip) and the
    state after the last token. Within a chunk the scan is a masked quadratic form; across chunks the state
    is carried sequentially."""
    n = x.shape[0]
    pad = (-n) % chunk
    x, dt, B, C = (F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    c = x.shape[0] // chunk
    x, dt, B, C = (t.reshape(c, chunk, *t.shape[1:]) for t in (x, dt, B, C))
    a = torch.cumsum(dt * A.float(), dim=1)  # [c, L, H]: log-decay from the chunk start through each token
    xdt = x * dt[..., None]  # [c, L, H, P]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    seg = (a[:, :, None, :] - a[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    scores = torch.einsum("clhn,cshn->clsh", C, B) * torch.exp(seg)  # [c, l, s, H]
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    to_end = torch.exp(a[:, -1:, :] - a)  # decay from each token to its chunk's end
    chunk_states = torch.einsum("clhn,clhp->chpn", B * to_end[..., None], xdt)  # [c, H, P, N], from zero
    state = state.float()
    starts = []
    for i in range(c):
        starts.append(state)
        state = torch.exp(a[i, -1])[:, None, None] * state + chunk_states[i]
    y = y + torch.einsum("clhn,chpn->clhp", C, torch.stack(starts)) * torch.exp(a)[..., None]
    return y.reshape(c * chunk, *y.shape[2:])[:n], state


def ssm_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, float32: x [b, H, P], dt [b, H], B/C [b, H, N], state [b, H, P, N] ->
    (y [b, H, P] without the D skip, new state)."""
    dA = torch.exp(dt * A.float())[:, :, None, None]
    state = state.float() * dA + (dt[..., None] * x.float())[..., None] * B.float()[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", state, C.float()), state


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm(y * silu(z)) over each of `groups` groups of channels (transformers' RMSNormGated)."""
    h = y.float() * F.silu(z.float())
    h = h.view(*h.shape[:-1], groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(*y.shape).to(dtype)


def _heads(t: torch.Tensor, heads: int, groups: int, state_size: int) -> torch.Tensor:
    """B or C [T, G*N] -> [T, H, N], each group shared by H/G consecutive heads."""
    return t.view(t.shape[0], groups, state_size).repeat_interleave(heads // groups, dim=1)


# ---------------------------------------------------------------------------- the op
_index_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _extend_indices(extend_lens: list[int], kernel: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """`extend_conv_indices` on the device, made once per batch (every Mamba layer of a forward reuses them),
    with cu_seqlens in int32 and the SSD kernels' chunk table: (taps, new_rows, cu, chunk_req, chunk_start,
    chunk_cu)."""
    key = (tuple(extend_lens), kernel, device)
    if key not in _index_cache:
        _index_cache.clear()  # one batch at a time
        taps, new_rows, _ = extend_conv_indices(extend_lens, kernel)
        tables = step_tables(extend_lens, SSD_CHUNK)
        host = (taps, new_rows, *_int32(tables, "cu", "chunk_req", "chunk_start", "chunk_cu"))
        if device.type == "cuda":
            _index_cache[key] = tuple(t.pin_memory().to(device, non_blocking=True) for t in host)
        else:
            _index_cache[key] = host
    return _index_cache[key]


_SSM_PREFILL = ("ssd", "ssd-torchconv", "serial", "torch")
DEFAULT_SSM_PREFILL = "ssd"  # the chunked SSD kernels (bench_ssd_scan.py times them against `serial`)


def _batch():
    from ostinato.attention.op import current_batch  # lazily: attention sits beside layers

    return current_batch()


def mamba_mixer_forward(zxbcdt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                        conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                        A_log: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor, num_heads: int, head_dim: int,
                        groups: int, state_size: int, chunk: int, eps: float, dt_min: float, dt_max: float,
                        slots: torch.Tensor, extend_lens: list[int] | None, use_triton: bool = False,
                        tables: MambaStepTables | None = None) -> torch.Tensor:
    """The mixer over a batch: `extend_lens` per request for an extend, None for a decode (one token each).
    `use_triton`: the SSM recurrence, the decode conv step and the gated norm run in Triton kernels.
    `tables` (an extend only): a captured step's layout (layers/mamba_tables.py), which then replaces
    `extend_lens` and `slots`: Triton launches at the tables' bounds, or on the CPU the same requests (the
    padding one included) through the torch path."""
    if tables is not None and extend_lens is not None and not use_triton:
        extend_lens, slots, tables = tables.lens(), tables.slots[: tables.num_reqs], None
    inter = num_heads * head_dim
    z, xbc, dt = zxbcdt.split([inter, conv_state.shape[1], num_heads], dim=-1)
    gn = groups * state_size
    heads = (num_heads, groups, state_size)
    if extend_lens is None and use_triton:
        from ostinato.layers.triton_ops.conv_step import conv_step  # lazily: see triton_ops' docstring
        from ostinato.layers.triton_ops.ssm_scan import ssm_scan

        x, Bm, Cm = conv_step(xbc, conv_state, slots, conv_weight, conv_bias).split([inter, gn, gn], dim=-1)
        y = ssm_scan(x, dt, Bm, Cm, ssm_state, slots, A_log, D, dt_bias, dt_min, dt_max, num_heads, head_dim, groups)
    elif extend_lens is None:
        conv_out, new_conv = causal_conv_step(xbc, conv_state[slots], conv_weight, conv_bias)
        conv_state.index_copy_(0, slots, new_conv.to(conv_state.dtype))
        x, Bm, Cm = conv_out.split([inter, gn, gn], dim=-1)
        x = x.reshape(x.shape[0], num_heads, head_dim)
        y, new_state = ssm_step(x, discretize_dt(dt, dt_bias, dt_min, dt_max), -torch.exp(A_log.float()),
                                _heads(Bm, *heads), _heads(Cm, *heads), ssm_state[slots])
        ssm_state.index_copy_(0, slots, new_state.to(ssm_state.dtype))
        y = y + D.float()[:, None] * x.float()
    elif tables is not None:  # a captured step: the tables' device layout, grids at their bounds
        from ostinato.layers.triton_ops.conv_extend import conv_extend
        from ostinato.layers.triton_ops.ssd_scan import ssd_chunk_scan

        reqs, chunks = tables.bounds(zxbcdt.shape[0])
        v, step_slots = tables.views, tables.slots[:reqs]
        cu = v["cu"][: reqs + 1]
        conv_out = conv_extend(xbc, conv_state, step_slots, cu, conv_weight, conv_bias, counts=tables.counts)
        x, Bm, Cm = conv_out.split([inter, gn, gn], dim=-1)
        y = ssd_chunk_scan(x, dt, Bm, Cm, ssm_state, step_slots, A_log, D, dt_bias, dt_min, dt_max, num_heads,
                           head_dim, groups, cu, (v["chunk_req"][:chunks], v["chunk_start"][:chunks],
                                                  v["chunk_cu"][: reqs + 1]),
                           chunk=SSD_CHUNK, counts=tables.counts, out_dtype=x.dtype)
    else:
        taps, new_rows, cu, *chunks = _extend_indices(extend_lens, conv_weight.shape[1], zxbcdt.device)
        kernels = os.environ.get("OSTINATO_SSM_PREFILL", DEFAULT_SSM_PREFILL) if use_triton else "torch"
        if kernels not in _SSM_PREFILL:
            raise ValueError(f"OSTINATO_SSM_PREFILL={kernels!r}: one of {', '.join(_SSM_PREFILL)}")
        if kernels in ("ssd-torchconv", "serial", "torch"):  # the torch gather conv: the reference, the older path
            conv_out = causal_conv_varlen(xbc, conv_state, slots, taps, new_rows, conv_weight, conv_bias)
        else:  # one Triton launch for the whole batch, and a small one per request (its window)
            from ostinato.layers.triton_ops.conv_extend import conv_extend  # lazily: see triton_ops' docstring

            conv_out = conv_extend(xbc, conv_state, slots, cu, conv_weight, conv_bias)
        x, Bm, Cm = conv_out.split([inter, gn, gn], dim=-1)
        scan_args = (x, dt, Bm, Cm, ssm_state, slots, A_log, D, dt_bias, dt_min, dt_max, num_heads, head_dim, groups,
                     cu)
        if kernels == "serial":  # the older token-serial scan kernel
            from ostinato.layers.triton_ops.ssm_scan import ssm_scan

            y = ssm_scan(*scan_args)
        elif kernels != "torch":
            from ostinato.layers.triton_ops.ssd_scan import ssd_chunk_scan

            y = ssd_chunk_scan(*scan_args, chunks, chunk=SSD_CHUNK, out_dtype=x.dtype)
        else:  # the reference: the chunked scan, request by request
            A = -torch.exp(A_log.float())
            ys, start = [], 0
            for i, n in enumerate(extend_lens):
                s = slots[i : i + 1]  # a 1-element index tensor: no device->host read of the slot
                xi = x[start : start + n].reshape(n, num_heads, head_dim)
                y, new_state = ssd_scan(xi, discretize_dt(dt[start : start + n], dt_bias, dt_min, dt_max), A,
                                        _heads(Bm[start : start + n], *heads), _heads(Cm[start : start + n], *heads),
                                        ssm_state[s][0], chunk)
                ssm_state.index_copy_(0, s, new_state[None].to(ssm_state.dtype))
                ys.append(y + D.float()[:, None] * xi.float())
                start += n
            y = torch.cat(ys)
    if use_triton:
        from ostinato.layers.triton_ops import gated_rms_norm as triton_norm

        return triton_norm.gated_rms_norm(y, z, norm_weight, groups, eps, zxbcdt.dtype)
    return gated_rms_norm(y.reshape(y.shape[0], inter), z, norm_weight, groups, eps, zxbcdt.dtype)


def mamba_mixer_impl(zxbcdt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                     conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                     A_log: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor, num_heads: int, head_dim: int,
                     groups: int, state_size: int, chunk: int, eps: float, dt_min: float,
                     dt_max: float) -> torch.Tensor:
    """zxbcdt [T, I + conv_dim + H] -> [T, I]; conv_state [slots, conv_dim, K-1] and ssm_state
    [slots, H, P, N] are this layer's views of the MambaPool, updated at the batch's Mamba slots."""
    from ostinato.attention.forward_batch import ForwardMode

    batch = _batch()
    if batch.mamba_slots is None:
        raise RuntimeError("ostinato::mamba_mixer needs ForwardBatch.mamba_slots (set by ModelRunner.forward)")
    extend_lens = None if batch.mode is ForwardMode.DECODE else batch.extend_seq_lens_cpu
    tables = None if extend_lens is None else batch.mamba_tables
    padded = zxbcdt.shape[0]
    real = padded if extend_lens is None or tables is not None else sum(extend_lens)
    # a piecewise-graph step pads its tokens to a captured size. With step tables (the mixer captured inside the
    # pieces) the padding is one more request, on the sink slot; without them (the mixer a split op between the
    # pieces) the padding belongs to no request, so the mixer runs on the real rows only and the padded rows'
    # output is zeros (never read, see graphs/piecewise)
    out = mamba_mixer_forward(zxbcdt[:real], conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                              norm_weight, num_heads, head_dim, groups, state_size, chunk, eps, dt_min, dt_max,
                              batch.mamba_slots, extend_lens, use_triton=zxbcdt.is_cuda, tables=tables)
    return out if real == padded else F.pad(out, (0, 0, 0, padded - real))


mamba_mixer_op = torch.library.custom_op(MAMBA_OP_NAME, mamba_mixer_impl, mutates_args=("conv_state", "ssm_state"))


@mamba_mixer_op.register_fake
def _(zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, num_heads, head_dim,
      groups, state_size, chunk, eps, dt_min, dt_max):
    return zxbcdt.new_empty(zxbcdt.shape[0], num_heads * head_dim)


def mamba_mixer(*args) -> torch.Tensor:
    """`ostinato::mamba_mixer` (its arguments as mamba_mixer_impl's): the opaque op under torch.compile, its function
    called directly otherwise (no dispatch)."""
    return (mamba_mixer_op if torch.compiler.is_compiling() else mamba_mixer_impl)(*args)
