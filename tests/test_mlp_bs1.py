"""The one-row MLP kernel's logic (layers/cuda_ops/mlp_bs1.py): its torch twin against the layer's unfused MLP, its
split-K over any number of blocks, what it supports, and the engine flag. The kernel itself is checked against the
twin on the GPU (tests/test_mlp_bs1_gpu.py)."""

import pytest
import torch
from torch import nn

from ostinato.layers.cuda_ops import mlp_bs1, ring
from ostinato.layers.norm import RMSNorm
from ostinato.layers.norm_linear import fold_norm_weight, norm_gate_up_silu


def layer_mlp(hidden: int, inter: int, seed: int):
    """A post-attention norm (its weight away from ones, then folded) and the MLP's two projections, bf16."""
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5).to(torch.bfloat16)
    gate_up = nn.Linear(hidden, 2 * inter, bias=False).to(torch.bfloat16)
    down = nn.Linear(inter, hidden, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=g))
        gate_up.weight.copy_(torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5)
        down.weight.copy_(torch.randn(hidden, inter, generator=g) * inter**-0.5)
    fold_norm_weight(norm, gate_up)
    return norm, gate_up, down


def row(hidden: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@pytest.mark.parametrize(("hidden", "inter", "grid"), [(256, 768, 7), (512, 1000, 132), (128, 96, 132)])
def test_twin_is_the_layers_mlp(hidden, inter, grid):
    """The twin's (y, h) against the layer's own CPU path (norm_gate_up_silu, then down): h bit for bit, y to bf16's
    rounding (the twin keeps the normalised row in fp32 where the unfused norm rounds it), on inputs it was not
    tuned on; and against a float64 evaluation of the same map."""
    for seed in range(3):
        norm, gate_up, down = layer_mlp(hidden, inter, seed)
        x, residual = row(hidden, 10 + seed), row(hidden, 20 + seed, 4.0)
        act, h_layer = norm_gate_up_silu(norm, gate_up, x, residual)
        y_layer = down(act)
        y, h = mlp_bs1.reference(x[0], residual[0], gate_up.weight, down.weight.t().contiguous(), norm.eps, grid)
        assert torch.equal(h, h_layer[0])
        scale = y_layer.float().abs().max()
        assert (y.float() - y_layer[0].float()).abs().max() <= 0.03 * scale
        h64 = h.double()
        n = h64 * torch.rsqrt(h64.square().mean() + norm.eps)
        gu = gate_up.weight.double() @ n
        y64 = down.weight.double() @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:])
        assert (y.double() - y64).abs().max() <= 0.03 * y64.abs().max()
        assert (y.double() - y64).abs().mean() <= 0.004 * y64.abs().max()


def test_split_k_over_any_grid_is_one_product():
    """Every block's rows (share) cover the intermediate once, so the sum of the blocks' partials is down's product
    whatever the grid, to fp32's order of summation."""
    for inter, grid in [(1000, 132), (96, 132), (8192, 132), (3072, 7)]:
        rows = [ring.share(inter, b, grid) for b in range(grid)]
        assert rows[0][0] == 0 and rows[-1][1] == inter
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(rows, rows[1:], strict=False))
    norm, gate_up, down = layer_mlp(256, 768, 5)
    x, residual = row(256, 1), row(256, 2)
    ys = [mlp_bs1.reference(x[0], residual[0], gate_up.weight, down.weight.t().contiguous(), norm.eps, g)[0]
          for g in (1, 5, 132)]
    for y in ys[1:]:
        assert (y.float() - ys[0].float()).abs().max() <= 0.01 * ys[0].float().abs().max()


def test_what_the_kernel_supports():
    def weights(hidden, inter, dtype=torch.bfloat16):
        return torch.empty(2 * inter, hidden, dtype=dtype), torch.empty(hidden, inter, dtype=dtype)

    assert mlp_bs1.unsupported_reason(*weights(2048, 8192), 132) is None  # Llama-3.2-1B
    assert mlp_bs1.unsupported_reason(*weights(1024, 3072), 132) is None  # Qwen3-0.6B
    assert mlp_bs1.unsupported_reason(*weights(4096, 12288), 132) is None  # Qwen3-8B
    assert "hidden size 4160" in mlp_bs1.unsupported_reason(*weights(4160, 8192), 132)
    assert "hidden size 1000" in mlp_bs1.unsupported_reason(*weights(1000, 3072), 132)
    assert "bf16" in mlp_bs1.unsupported_reason(*weights(1024, 3072, torch.float16), 132)
    assert "at most 512 rows" in mlp_bs1.unsupported_reason(*weights(1024, 3072), 5)
    assert "grid of 0" in mlp_bs1.unsupported_reason(*weights(1024, 3072), 0)
    gate_up, down = weights(1024, 3072)
    assert "[2I, H]" in mlp_bs1.unsupported_reason(gate_up[:-2], down, 132)
    assert [ring.rows_per_tile(k) for k in (1024, 2048, 4096)] == [8, 4, 2]


def test_the_flag_is_checked_and_on_fails_where_the_kernel_cannot_run(tiny_llama_path):
    """--decode-mlp-kernel: a value outside auto / on / off names the field; "on" on the CPU stops the start-up with
    the reason; "auto" there starts with the layers' own MLP."""
    from ostinato import LLM
    from ostinato.config import EngineArgs

    with pytest.raises(ValueError, match="decode_mlp_kernel"):
        EngineArgs(decode_mlp_kernel="sometimes")
    with pytest.raises(ValueError, match="--decode-mlp-kernel on: .*CUDA"):
        LLM(tiny_llama_path, device="cpu", decode_mlp_kernel="on", max_total_tokens=256)
    with LLM(tiny_llama_path, device="cpu", decode_mlp_kernel="auto", max_total_tokens=256) as llm:
        assert not llm.engine.runner.one_row_mlp
        assert all(layer.mlp.one_row is None for layer in llm.engine.runner.model.layers)

