"""A decoder layer's MLP at one row as one CUDA kernel (mlp_bs1.cu), and its torch twin. Opt-in
(`--decode-mlp-kernel`): on the H200 it is level with the layers' own kernels for Llama-3.2-1B and slower for
Qwen3-0.6B (docs/gpu-notes.md, fifty-seventh session).

At one decode row the MLP is a read of its weights (Llama-3.2-1B: 100 MB a layer, 24 us at an H200's copy rate),
yet the layer's Triton kernels spend about 29.5 us from gate_up's start to the next layer's qkv (docs/gpu-notes.md,
fortieth session): two launches, each with its ramp and its PDL hand-off, and down cannot read a weight before
gate_up's last row is done. Here each block streams its rows of W_gu and of W_down^T through a shared-memory ring
from its first instruction (layers/cuda_ops/ring.cuh, shared with the decode megakernel) and multiplies its own
activations by its rows of W_down^T at once (split-K), adding the partial into fp32 sums by atomics, so no block
waits for another; the last block to finish rounds the sum into y. One launch inside the engine's chain of PDL
launches: it replaces add + norm + gate_up + silu_and_mul and down at one row (models/llama.py's DecoderLayer).
What keeps it from winning (the fifty-seventh session's probes, Llama-3.2-1B): the ring streams at about the rate
the Triton kernels do, the consumers' reading of the tiles costs about 3.4 us a layer over the ring alone, and the
last block's sum about 1.5.

Its costs: a transposed copy of each layer's down weight (Llama-3.2-1B: 537 MB; Qwen3-0.6B: 176 MB), nvcc at
start-up (the build is cached), and sums that meet in the order blocks finish (y varies with timing at fp32's
rounding, before its one rounding to bf16). `reference` is the kernel's arithmetic in torch: the CPU tests check
it against the unfused layer, the GPU tests the kernel against it.
"""

import ctypes
import functools
from pathlib import Path

import torch

from ostinato.layers.cuda_ops.build import build
from ostinato.layers.cuda_ops.ring import MAX_SLOTS, SLOT_BYTES, WARPS, rows_per_tile, share, smem_optin

SOURCE = Path(__file__).with_name("mlp_bs1.cu")
# the kernel's own limits (ost_mlp_bs1_limits checks them, with ring.py's)
ROWS_MAX, PART_MAX, HIDDEN_MAX, MAX_COPIES = 512, 1024, 4096, 8
# launch settings (a benchmark may change SETTINGS before the kernels are made): ring slots a block; whether the next
# kernel's blocks may be placed from this one's start (else as its blocks end); the fp32 accumulators the blocks'
# partials of y spread over; blocks an SM (the grid is the SMs times this); probe: timing-probe flags
# (PROBE_NO_FINISH, PROBE_RING_ONLY: y is void). Two blocks an SM of 4 slots, 4 accumulators: the fastest of the
# forms timed on the H200 (docs/gpu-notes.md, fifty-seventh session)
DEFAULT_SETTINGS = {"slots": 4, "trigger": True, "copies": 4, "blocks_per_sm": 2, "probe": 0}
SETTINGS = dict(DEFAULT_SETTINGS)
TRIGGER, PROBE_NO_FINISH, PROBE_RING_ONLY = 1, 2, 4  # the kernel's flags


@functools.cache
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(SOURCE, "the one-row MLP kernel")))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.ost_mlp_bs1_launch.argtypes = [*[p] * 8, i, i, i, i, i, i, ctypes.c_float, p]
    lib.ost_mlp_bs1_launch.restype = i
    lib.ost_mlp_bs1_smem_bytes.argtypes = [i, i, i, i]
    lib.ost_mlp_bs1_error_string.restype = ctypes.c_char_p
    lib.ost_mlp_bs1_error_string.argtypes = [i]
    built = tuple(lib.ost_mlp_bs1_limits(k) for k in range(7))
    assert built == (SLOT_BYTES, MAX_SLOTS, ROWS_MAX, PART_MAX, HIDDEN_MAX, WARPS, MAX_COPIES), built
    return lib


def unsupported_reason(gate_up: torch.Tensor, down: torch.Tensor, grid: int) -> str | None:
    """Why the kernel cannot take these weights (gate_up [2I, H], down [H, I]) over `grid` blocks; None if it can."""
    if gate_up.dim() != 2 or down.dim() != 2 or gate_up.shape[0] != 2 * down.shape[1] \
            or gate_up.shape[1] != down.shape[0]:
        return f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not [2I, H] and [H, I]"
    hidden, inter = down.shape
    if grid < 1:
        return f"a grid of {grid} blocks"
    if any(w.dtype != torch.bfloat16 or not w.is_contiguous() or w.data_ptr() % 16 for w in (gate_up, down)):
        return "weights must be contiguous, 16-byte aligned bf16"
    if hidden % 64 or hidden > HIDDEN_MAX:
        return f"hidden size {hidden} (a multiple of 64, at most {HIDDEN_MAX})"
    if -(-inter // grid) > ROWS_MAX:
        return f"intermediate size {inter} over {grid} blocks (at most {ROWS_MAX} rows a block)"
    if -(-inter // grid) * (WARPS // rows_per_tile(hidden)) > PART_MAX:
        return f"intermediate size {inter} over {grid} blocks (at most {PART_MAX} row x part sums a block)"
    return None


def reference(x: torch.Tensor, residual: torch.Tensor, gate_up: torch.Tensor, down_t: torch.Tensor, eps: float,
              grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in torch: (y, h) for one row x, residual [H] (bf16), gate_up [2I, H] (the norm's
    weight folded in) and down_t = down^T [I, H]. float32 sums; h, gate, up, silu(gate) and act rounded to bf16; y
    the sum of the blocks' split-K partials (block order here, finishing order in the kernel), rounded once."""
    bf16, f32 = torch.bfloat16, torch.float32
    h = (x.to(f32) + residual.to(f32)).to(bf16)
    hf = h.to(f32)
    scale = torch.rsqrt(hf.square().mean() + eps)
    inter = down_t.shape[0]
    gate = ((gate_up[:inter].to(f32) @ hf) * scale).to(bf16).to(f32)
    up = ((gate_up[inter:].to(f32) @ hf) * scale).to(bf16).to(f32)
    act = ((gate * torch.sigmoid(gate)).to(bf16).to(f32) * up).to(bf16).to(f32)
    acc = torch.zeros(down_t.shape[1], dtype=f32, device=x.device)
    for b in range(grid):
        r0, r1 = share(inter, b, grid)
        acc += act[r0:r1] @ down_t[r0:r1].to(f32)
    return acc.to(bf16), h


class MlpScratch:
    """The fp32 sums and the finished-block count the kernel launches of one model share (zero between launches:
    each launch's last block leaves them so). Launches on one stream never overlap, so one set serves every layer."""

    def __init__(self, hidden: int, device: torch.device) -> None:
        self.acc = torch.zeros(MAX_COPIES, hidden, dtype=torch.float32, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)


class MlpBs1:
    """One layer's MLP at one row: (y, h) = (down(silu_and_mul(gate_up(rms_norm(x + residual)))), x + residual),
    as the layer's unfused kernels compute them (module doc). Holds W_down^T."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, eps: float, scratch: MlpScratch, grid: int,
                 slots: int | None = None, trigger: bool | None = None, copies: int | None = None) -> None:
        grid *= SETTINGS["blocks_per_sm"]
        reason = unsupported_reason(gate_up, down, grid)
        if reason is not None:
            raise ValueError(f"one-row MLP kernel: {reason}")
        self.lib = library()
        self.hidden, self.inter = down.shape
        self.gate_up, self.down_t = gate_up, down.t().contiguous()
        self.eps, self.scratch, self.grid = eps, scratch, grid
        self.trigger = SETTINGS["trigger"] if trigger is None else trigger
        slots = SETTINGS["slots"] if slots is None else slots
        self.copies = SETTINGS["copies"] if copies is None else copies
        if not 1 <= self.copies <= MAX_COPIES:
            raise ValueError(f"one-row MLP kernel: {self.copies} accumulators (1 to {MAX_COPIES})")
        optin = smem_optin(gate_up.device)
        per_sm = getattr(torch.cuda.get_device_properties(gate_up.device), "shared_memory_per_multiprocessor",
                         optin + 1024)
        room = min(optin, per_sm // SETTINGS["blocks_per_sm"] - 1024)  # each block of an SM with its reserved 1 KB
        fit = (room - self.lib.ost_mlp_bs1_smem_bytes(0, self.hidden, self.inter, grid)) // SLOT_BYTES
        self.slots = min(MAX_SLOTS, fit) if slots is None else slots
        if not 2 <= self.slots <= min(MAX_SLOTS, fit):
            raise ValueError(f"one-row MLP kernel: {self.slots} weight slots (2 to {min(MAX_SLOTS, fit)} fit)")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (o_proj's output) and residual: contiguous bf16 [1, H] on the weights' device. Launches on the current
        stream (graph capture records it)."""
        for name, t in (("x", x), ("residual", residual)):
            if t.shape != (1, self.hidden) or t.dtype != torch.bfloat16 or not t.is_contiguous() \
                    or t.device != self.gate_up.device:
                raise ValueError(f"one-row MLP kernel: {name} must be contiguous bf16 [1, {self.hidden}] on "
                                 f"{self.gate_up.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        y, h = torch.empty_like(x), torch.empty_like(x)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        err = self.lib.ost_mlp_bs1_launch(
            x.data_ptr(), residual.data_ptr(), h.data_ptr(), y.data_ptr(), self.gate_up.data_ptr(),
            self.down_t.data_ptr(), self.scratch.acc.data_ptr(), self.scratch.count.data_ptr(), self.hidden,
            self.inter, self.slots, self.grid, (TRIGGER if self.trigger else 0) | SETTINGS["probe"], self.copies,
            self.eps, stream)
        if err:
            raise RuntimeError(f"one-row MLP kernel launch: {self.lib.ost_mlp_bs1_error_string(err).decode()}")
        return y, h
