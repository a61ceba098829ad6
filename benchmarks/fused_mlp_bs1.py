"""An experiment, not an engine path: a decoder layer's MLP at one decode row as ONE kernel (gate_up, the
activation and down), the down projection summed across programs with atomic adds.

Each program owns BJ columns of the intermediate: it adds the residual to o_proj's output (the post-attention
norm's input, its weight folded into gate_up as the engine folds it), takes the row's inverse RMS, projects its
BJ gate and up rows, applies silu_and_mul (rounded as the engine rounds it), and multiplies that by its BJ columns
of down, adding the [H] partial into an fp32 accumulator (`tl.atomic_add`). One kernel boundary a layer fewer,
and the activation never goes to memory; the sum's order is not fixed (not bit-reproducible), and the next layer
would have to read fp32. In a step (the `fused` wrapper below) the next layer reads a bf16 row no kernel writes:
timing only, the numerics of the step are wrong. The kernel's own numerics are checked on the CPU
(tests/test_fused_mlp_bs1.py).

Weights stream through a K loop after the PDL wait (the skinny GEMV's form, its first lines asked of L2 before the
wait), or, with RESIDENT, each program's whole slice is loaded into registers before the wait (resident_gemv.py's
form: only where it fits); `early` lets the next kernel's programs be placed before the wait, as that form does.

MLP=fused:BJ:WARPS[:resident][:early] python benchmarks/fused_mlp_bs1.py <bench_decode.py's arguments>
(MLP unset: the engine's path, the same wrapper, for A/B in turns.)
"""

import os
import runpy
import sys

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.l2_prefetch import prefetch_rows
from ostinato.layers.triton_ops.silu_and_mul import silu_mul_rounded


@triton.jit
def _fused_mlp_kernel(X, R, R_out, Wgu, Wd, Acc, Zero, zero_n, H, INTER, eps,
                      BJ: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, H_PAD: tl.constexpr,
                      RESIDENT: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                      EARLY_TRIGGER: tl.constexpr = False):
    pid = tl.program_id(0)
    j = pid * BJ + tl.arange(0, BJ)  # this program's intermediate columns (I % BJ == 0)
    cols = tl.arange(0, H_PAD)
    if RESIDENT:  # the whole slice in registers before the wait (weights are no kernel's output)
        wg = tl.load(Wgu + j[:, None] * H + cols[None, :])
        wu = tl.load(Wgu + (INTER + j)[:, None] * H + cols[None, :])
        wd = tl.load(Wd + cols[:, None] * INTER + j[None, :])
    elif PREFETCH:
        prefetch_rows(Wgu, j, H, H, 2)
        prefetch_rows(Wgu, INTER + j, H, H, 2)
    if PDL:
        if EARLY_TRIGGER:  # resident_gemv's order: the next kernel's programs placed while these loads fly
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # the next layer's accumulator, read by no kernel any more: zeroed in shares
    zoffs = pid * 256 + tl.arange(0, 256)
    tl.store(Zero + zoffs, tl.zeros([256], tl.float32), mask=zoffs < zero_n)
    cmask = cols < H
    h = (tl.load(X + cols, mask=cmask, other=0.0).to(tl.float32)
         + tl.load(R + cols, mask=cmask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
    tl.store(R_out + cols, h, mask=cmask & (cols * 0 + pid == 0))
    hf = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(hf * hf) / H + eps)
    if RESIDENT:
        g = tl.sum(wg.to(tl.float32) * hf[None, :], axis=1)
        u = tl.sum(wu.to(tl.float32) * hf[None, :], axis=1)
    else:
        g = tl.zeros([BJ], tl.float32)
        u = tl.zeros([BJ], tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            xk = (tl.load(X + kk).to(tl.float32) + tl.load(R + kk).to(tl.float32)).to(X.dtype.element_ty)
            xk = xk.to(tl.float32)
            g += tl.sum(tl.load(Wgu + j[:, None] * H + kk[None, :]).to(tl.float32) * xk[None, :], axis=1)
            u += tl.sum(tl.load(Wgu + (INTER + j)[:, None] * H + kk[None, :]).to(tl.float32) * xk[None, :], axis=1)
    act = silu_mul_rounded(g * inv_rms, u * inv_rms, X.dtype.element_ty).to(X.dtype.element_ty).to(tl.float32)
    if RESIDENT:
        tl.atomic_add(Acc + cols, tl.sum(wd.to(tl.float32) * act[None, :], axis=1), sem="relaxed")
    else:
        for n0 in range(0, H, BH):
            nn = n0 + tl.arange(0, BH)
            wdt = tl.load(Wd + nn[:, None] * INTER + j[None, :]).to(tl.float32)
            tl.atomic_add(Acc + nn, tl.sum(wdt * act[None, :], axis=1), sem="relaxed")
    if PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


def fused_mlp(x: torch.Tensor, residual: torch.Tensor, eps: float, gate_up: torch.Tensor, down: torch.Tensor,
              acc: torch.Tensor, zero: torch.Tensor, bj: int = 32, num_warps: int = 4,
              resident: bool = False, early_trigger: bool = False) -> torch.Tensor:
    """acc += down(silu_and_mul(gate_up(rms_norm(x + residual)))) for one row (acc fp32 [H], zeroed by the caller
    or by the launch before); returns x + residual (the new residual stream). `zero` (fp32) is set to 0 on the way.
    gate_up [2I, H] holds the norm's weight (folded); H a power of two, I a multiple of bj."""
    (m, hidden), inter = x.shape, down.shape[1]
    assert m == 1 and hidden & (hidden - 1) == 0 and inter % bj == 0
    residual_out = torch.empty_like(x)
    pdl = x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    grid = inter // bj
    assert zero.numel() <= grid * 256
    _fused_mlp_kernel[(grid,)](
        x, residual, residual_out, gate_up, down, acc, zero, zero.numel(), hidden, inter, eps,
        BJ=bj, BK=min(hidden, 256), BH=min(hidden, 256), H_PAD=hidden, RESIDENT=resident, PREFETCH=pdl,
        PDL=pdl, launch_pdl=pdl, num_warps=num_warps, EARLY_TRIGGER=early_trigger)
    return residual_out


def _patch_layers(bj: int, num_warps: int, resident: bool, early_trigger: bool) -> None:
    """DecoderLayer.forward at one row: the engine's attention, then fused_mlp into one of two fp32 accumulators
    (each launch zeroes the other); the layer returns a bf16 row no kernel writes (timing only)."""
    from ostinato.layers.norm_linear import norm_linear
    from ostinato.models import llama

    engine_forward = llama.DecoderLayer.forward
    state: dict = {}

    def forward(self, positions, x, residual):
        if x.shape[0] != 1 or residual is None:
            return engine_forward(self, positions, x, residual)
        attn = self.self_attn
        if "acc" not in state:
            state["acc"] = torch.zeros(2, x.shape[1], dtype=torch.float32, device=x.device)
            state["x"] = torch.randn_like(x) * 0.1
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, x, residual)
        a = attn.attend(positions, qkv)
        o = attn.o_proj(a)
        i = attn.layer_id % 2
        residual = fused_mlp(o, residual, self.post_attention_layernorm.eps, self.mlp.gate_up_proj.weight,
                             self.mlp.down_proj.weight, state["acc"][i], state["acc"][1 - i], bj, num_warps,
                             resident, early_trigger)
        return state["x"], residual

    llama.DecoderLayer.forward = forward


if __name__ == "__main__":
    spec = os.environ.get("MLP", "")
    if spec:
        kind, *fields = spec.split(":")
        if kind != "fused" or len(fields) < 2 or not all(f.isdigit() for f in fields[:2]) \
                or set(fields[2:]) - {"resident", "early"}:
            raise SystemExit(f"MLP must be fused:BJ:WARPS[:resident][:early], got {spec!r}")
        _patch_layers(int(fields[0]), int(fields[1]), "resident" in fields, "early" in fields)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.argv = [os.path.join(here, "bench_decode.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
