"""benchmarks/fused_mlp_bs1.py's one-kernel MLP (an experiment timed in the step): its sum equals the engine's
chain (residual add, RMSNorm with its weight folded into gate_up, silu_and_mul, down) in float64, in Triton's
interpreter, for both of its forms."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
os.environ.setdefault("TRITON_INTERPRET", "1")
from fused_mlp_bs1 import fused_mlp  # noqa: E402


@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("hidden,inter,bj", [(256, 96, 32), (512, 64, 16)])
def test_fused_mlp_equals_the_chain(resident, hidden, inter, bj):
    g = torch.Generator().manual_seed(hidden + inter + resident)
    x = torch.randn(1, hidden, generator=g).to(torch.bfloat16)
    residual = torch.randn(1, hidden, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    acc = torch.randn(hidden, generator=g)  # the kernel adds into it
    zero = torch.randn(hidden, generator=g)
    start = acc.clone()

    new_residual = fused_mlp(x, residual, 1e-6, gate_up, down, acc, zero, bj=bj, resident=resident)

    h = (x.float() + residual.float()).to(torch.bfloat16)
    torch.testing.assert_close(new_residual, h, atol=0, rtol=8e-3)  # the interpreter's bf16 rounding: an ulp
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean() + 1e-6)
    gu = normed @ gate_up.double().T
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    want = start.double() + (act @ down.double().T)[0]
    # the kernel rounds gate, up and the activation to bf16 as the engine does: a few bf16 ulps of each term
    torch.testing.assert_close(acc.double(), want, atol=3e-2, rtol=2e-2)
    assert not torch.allclose(acc, start)
    assert torch.equal(zero, torch.zeros_like(zero))
