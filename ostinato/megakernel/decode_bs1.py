"""The host side of the one-launch decode step (decode_bs1.cu): its pointer table, scratch and counters, and the
launch a captured decode graph of one request records in place of the layers' ~12 launches a layer."""

import math

import torch

from ostinato.device_info import usable_sms
from ostinato.layers.cuda_ops.ring import MAX_SLOTS, SLOT_BYTES, smem_optin
from ostinato.megakernel.build import TRACE_SLOTS, library
from ostinato.megakernel.weights import (
    GATE_MAX,
    PART_MAX,
    Shape,
    model_layers,
    model_shape,
    unsupported_reason,
)

COUNT_STRIDE = 32  # the kernel's kCountStride: counters a layer
MAX_H_COPIES = 8  # the kernel's kMaxHCopies
H_COPIES = 4  # copies of the residual stream DOWN's atomics spread over: 1, 2, 4 and 8 timed, 4 kept
# (docs/gpu-notes.md, fifty-sixth session)
MAX_SPLITS = 16


def scratch_floats(s: Shape) -> int:
    """Floats of a block's input-vector buffer: the widest GEMV input (hidden for QKV and GU, q_size for O; DOWN
    stages none), or attention's scratch (q, new K and V, and every warp's state for the KV head's query heads)."""
    attn = (s.group + 2) * s.head_dim + 8 * s.group * (s.head_dim + 2)
    return -(-max(s.hidden, s.q_size, attn) // 4) * 4


class DecodeBs1Megakernel:
    """One request's pass through every decoder layer as one persistent kernel, a block an SM: x_in (the token's
    embedding, [1, hidden] bf16) -> the residual stream after the last layer ([1, hidden] bf16, `x_out`, for the
    final norm), storing the token's K/V in each layer's cache. Inputs are the decode graph's static buffers."""

    def __init__(self, model, kv_cache, device: torch.device, grid: int | None = None, splits: int | None = None,
                 slots: int | None = None, pdl: bool = True, h_copies: int = H_COPIES) -> None:
        if device.type == "cuda" and device.index is None:  # tensors report their index: compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        self._layers = model_layers(model)  # the tensors the kernel's table points into
        on_device = [t for lw in self._layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        if any(t.device != device for t in on_device + kv_cache.k_buffer + kv_cache.v_buffer):
            raise ValueError(f"decode megakernel: the weights and KV cache must be on {device}")
        grid = grid or usable_sms(device)
        reason = unsupported_reason(model, kv_cache, grid)
        if reason is not None:
            raise ValueError(f"decode megakernel: {reason}")
        s = self.shape = model_shape(model)
        self.grid, self.pdl, self.device = grid, pdl, device
        self.splits = splits or max(1, min(MAX_SPLITS, grid // s.kv_heads))
        if s.kv_heads * self.splits > grid:
            raise ValueError(f"decode megakernel: {s.kv_heads} KV heads x {self.splits} splits over {grid} blocks")
        # [positions, head dim]: cos halves, sin halves
        self.cos_sin = model.rotary.cos_sin.to(device=device, dtype=torch.float32).contiguous()
        if not 1 <= h_copies <= MAX_H_COPIES:
            raise ValueError(f"decode megakernel: {h_copies} copies of the residual stream (1 to {MAX_H_COPIES})")
        self.h_copies = h_copies
        self.lib = library()
        built = (self.lib.ost_decode_bs1_slot_bytes(), self.lib.ost_decode_bs1_rows_max(),
                 self.lib.ost_decode_bs1_part_max(), self.lib.ost_decode_bs1_count_stride(),
                 self.lib.ost_decode_bs1_max_slots(), self.lib.ost_decode_bs1_trace_slots(),
                 self.lib.ost_decode_bs1_max_h_copies())
        # the kernel's constants, as this module and weights.py assume them
        assert built == (SLOT_BYTES, GATE_MAX, PART_MAX, COUNT_STRIDE, MAX_SLOTS, TRACE_SLOTS, MAX_H_COPIES), built
        self.xs_floats = scratch_floats(s)
        optin = smem_optin(device)
        fit = (optin - 1024 - self.lib.ost_decode_bs1_smem_bytes(0, self.xs_floats)) // SLOT_BYTES
        self.slots = min(MAX_SLOTS, fit) if slots is None else slots
        if not 2 <= self.slots <= min(MAX_SLOTS, fit):
            raise ValueError(f"decode megakernel: {self.slots} weight slots (2 to {min(MAX_SLOTS, fit)} fit)")

        def ptr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        # DOWN reads W_down^T [inter, hidden] (a block's act rows times the same rows, split-K): a copy of each
        # layer's down weight, the step's one extra memory (Llama-3.2-1B: 537 MB, Qwen3-0.6B: 176 MB)
        self._down_t = [lw.down.t().contiguous() for lw in self._layers]
        rows = [[ptr(lw.qkv), ptr(lw.o), ptr(lw.gate_up), ptr(down_t), ptr(lw.qkv_bias), ptr(lw.q_norm),
                 ptr(lw.k_norm), kv_cache.k_buffer[i].data_ptr(), kv_cache.v_buffer[i].data_ptr()]
                for i, (lw, down_t) in enumerate(zip(self._layers, self._down_t, strict=True))]
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        # the residual stream as the sum of h_copies rows: block b's DOWN adds into row b % h_copies, so fewer
        # blocks' atomics meet on each address
        self.h = torch.empty(h_copies, s.hidden, **f32)
        self.qkv = torch.empty(s.q_size + 2 * s.kv_size, **f32)
        self.attn = torch.empty(s.q_size, **f32)
        self.h_mid = torch.empty(s.hidden, **f32)
        self.part = torch.empty(s.kv_heads * self.splits * s.group * (s.head_dim + 2), **f32)
        # counts only grow (the kernel compares them to (epoch + 1) x target); zero once, here
        self.counters = torch.zeros(s.num_layers * COUNT_STRIDE + 2, dtype=torch.int32, device=device)
        self.x_out = torch.empty(1, s.hidden, dtype=torch.bfloat16, device=device)
        self.scale_log2 = s.head_dim**-0.5 * math.log2(math.e)
        self.trace: torch.Tensor | None = None  # set to an int64 [grid, layers, TRACE_SLOTS] buffer to time phases
        self.flags = 0  # build.NO_WAITS, build.RING_ONLY: timing probes (the outputs are void)

    def __call__(self, x_in: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor,
                 out_loc: torch.Tensor, req_to_token: torch.Tensor) -> torch.Tensor:
        """Launches the step on the current stream; returns `x_out`. positions, seq_lens, req_rows, out_loc: int64
        [1] (seq_lens counts the new token); req_to_token: int32 [rows, max context], contiguous rows."""
        s = self.shape
        if x_in.shape != (1, s.hidden) or x_in.dtype != torch.bfloat16 or not x_in.is_contiguous():
            raise ValueError(f"decode megakernel: x_in must be contiguous bf16 [1, {s.hidden}], got "
                             f"{x_in.dtype} {tuple(x_in.shape)}")
        for name, t in (("positions", positions), ("seq_lens", seq_lens), ("req_rows", req_rows),
                        ("out_loc", out_loc)):
            if t.dtype != torch.int64 or t.numel() < 1:
                raise ValueError(f"decode megakernel: {name} must be int64 with one entry a request")
        if req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
            raise ValueError("decode megakernel: req_to_token must be int32 with contiguous rows")
        if any(t.device != self.device for t in (x_in, positions, seq_lens, req_rows, out_loc, req_to_token)):
            raise ValueError(f"decode megakernel: every input must be on {self.device}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        err = self.lib.ost_decode_bs1_launch(
            self.table.data_ptr(), s.num_layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.inter, self.splits,
            self.slots, self.h_copies, self.grid, self.xs_floats, s.eps, s.qk_eps, self.scale_log2,
            x_in.data_ptr(), self.x_out.data_ptr(), positions.data_ptr(), seq_lens.data_ptr(), req_rows.data_ptr(),
            out_loc.data_ptr(), req_to_token.data_ptr(), req_to_token.stride(0), self.cos_sin.data_ptr(),
            self.h.data_ptr(), self.qkv.data_ptr(), self.attn.data_ptr(), self.h_mid.data_ptr(), self.part.data_ptr(),
            self.counters.data_ptr(), 0 if self.trace is None else self.trace.data_ptr(), self.flags, int(self.pdl),
            stream)
        if err:
            raise RuntimeError(f"decode megakernel launch: {self.lib.ost_error_string(err).decode()}")
        return self.x_out
