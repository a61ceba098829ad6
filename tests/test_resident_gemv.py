"""The one-row GEMV whose programs request their whole weight slice before the PDL wait (resident_gemv.py):
its tile rule, each form (plain, residual add, gated, pre-norm) against float64 at K a power of two and not,
skinny_gemm's choice of it at one row, and on the GPU graph replay against eager and against the FMA kernel.

Without a GPU the kernel runs in Triton's interpreter at small shapes in fp16 (see test_skinny_gemm.py)."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_skinny_gemm import (  # noqa: E402
    DEVICE,
    TOL,
    captured,
    cuda,
    folded,
    prenorm_inputs,
    prenorm_reference,
    randn,
)

from ostinato.layers.triton_ops import resident_gemv, skinny_gemm  # noqa: E402
from ostinato.layers.triton_ops.resident_gemv import ResidentConfig, config_for, k_parts, launch  # noqa: E402

GATE_TOL = (4e-3, 4e-3)  # fp16: gate and up rounded before silu, then the product (test_skinny_gemm's gate_up)


@pytest.mark.parametrize("k,parts", [(1, (1, 0)), (64, (64, 0)), (96, (64, 32)), (200, (128, 128)),
                                     (1000, (512, 512)), (3072, (2048, 1024)), (8192, (8192, 0))])
def test_k_parts(k, parts):
    k_a, k_b = k_parts(k)
    assert (k_a, k_b) == parts and k_a + k_b >= k and k_b <= k_a


def test_config_rule_takes_small_projections_only():
    # Qwen3-0.6B's four projections at one row fit (the experiment's shapes); Llama-3.2-1B's qkv and o fit, its
    # 67 MB gate_up and 34 MB down do not (their slices would not fit in registers)
    for n, k, gated in [(4096, 1024, False), (1024, 2048, False), (3072, 1024, True), (1024, 3072, False),
                        (3072, 2048, False), (2048, 2048, False)]:
        cfg = config_for(n, k, 2, 132, gated, per_sm=4, num_warps=4)
        assert cfg is not None, (n, k, gated)
        programs = -(-n // cfg.block_n)
        assert programs <= 4 * 132 and cfg.block_n & (cfg.block_n - 1) == 0
        assert cfg.block_n * (2 if gated else 1) * (cfg.k_a + cfg.k_b) * 2 <= resident_gemv.RESIDENT_BYTES * 32 * 4
        assert cfg.block_n == 1 or -(-n // (cfg.block_n // 2)) > 4 * 132  # the smallest tile under the bound
    for n, k, gated in [(8192, 2048, True), (2048, 8192, False)]:
        assert config_for(n, k, 2, 132, gated, per_sm=4, num_warps=4) is None
    assert config_for(1024, 1024, 2, 132, per_sm=0) is None  # switched off


@pytest.mark.parametrize("value", ["4", "x,4", "0,4", "4,3", "4,32", "4,4,5", "4,4,0", "4,4,1,1"])
def test_bad_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("OSTINATO_RESIDENT_GEMV", value)
    with pytest.raises(ValueError, match="OSTINATO_RESIDENT_GEMV"):
        resident_gemv._setting()


def test_setting(monkeypatch):
    monkeypatch.setenv("OSTINATO_RESIDENT_GEMV", "6,2")
    assert resident_gemv._setting() == (6, 2, 1)
    monkeypatch.setenv("OSTINATO_RESIDENT_GEMV", "6,2,3")
    assert resident_gemv._setting() == (6, 2, 3)
    monkeypatch.setenv("OSTINATO_RESIDENT_GEMV", "0")
    assert resident_gemv._setting()[0] == 0


def _cfg(n: int, k: int, block_n: int) -> ResidentConfig:
    return ResidentConfig(block_n, *k_parts(k), 4)


# N not a multiple of BLOCK_N (the last program's rows clamped, never stored); K = 64 one part, 96 and 200 two
# (200: the second part masked past K), 50: rows not 16-byte aligned
# m: rows of x, each against the slice held in registers (3 pads to 4)
@pytest.mark.parametrize("n,k,block_n", [(37, 64, 4), (24, 96, 8), (19, 200, 2), (40, 50, 16)])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_plain_and_add(n, k, block_n, with_add, m):
    gen = torch.Generator(DEVICE).manual_seed(n * k + block_n + m)
    x, w = randn(gen, m, k, dtype=torch.float16), randn(gen, n, k, dtype=torch.float16)
    add = randn(gen, m, n, dtype=torch.float16) * 4 if with_add else None
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
    launch(x, w, out, _cfg(n, k, block_n), add=add)
    want = x.double() @ w.double().T
    if with_add:  # rounded as torch's linear(x, W) + add: the projection rounded to the dtype first
        want = want.to(torch.float16).double() + add.double()
    torch.testing.assert_close(out.double(), want, atol=TOL[torch.float16][0] * (8 if with_add else 1),
                               rtol=TOL[torch.float16][1])


@pytest.mark.parametrize("n,k,block_n", [(37, 64, 4), (19, 200, 8)])
@pytest.mark.parametrize("m", [1, 4])
def test_gated(n, k, block_n, m):
    gen = torch.Generator(DEVICE).manual_seed(n + k + m)
    x = randn(gen, m, k, dtype=torch.float16)
    w = (randn(gen, 2 * n, k, dtype=torch.float32) * k**-0.5).to(torch.float16)
    out = torch.empty(m, n, dtype=torch.float16, device=DEVICE)
    launch(x, w, out, _cfg(n, k, block_n), gated=True)
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    torch.testing.assert_close(out.double(), F.silu(gate) * up, atol=GATE_TOL[0], rtol=GATE_TOL[1])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("n,k,block_n", [(37, 64, 4), (19, 200, 8), (24, 96, 2)])
@pytest.mark.parametrize("m", [1, 2])
def test_prenorm(gated, with_residual, n, k, block_n, m):
    x, residual, norm_w, w = prenorm_inputs(m, n, k, torch.float16, seed=n * k + m, gated=gated)
    residual = residual if with_residual else None
    out = torch.empty(m, n, dtype=torch.float16, device=DEVICE)
    residual_out = torch.full_like(x, float("nan")) if with_residual else None
    launch(x, folded(w, norm_w), out, _cfg(n, k, block_n), gated=gated, eps=1e-6, residual=residual,
           residual_out=residual_out)
    want, want_residual = prenorm_reference(x, residual, torch.ones_like(norm_w), folded(w, norm_w), 1e-6, gated)
    tol = GATE_TOL if gated else TOL[torch.float16]
    torch.testing.assert_close(out.double(), want, atol=tol[0], rtol=tol[1])
    if with_residual:  # x + residual rounded once, written whole by program 0
        assert torch.equal(residual_out, want_residual)


def test_skinny_entry_points_choose_it(monkeypatch):
    """skinny_gemm's entry points hand a call of up to MAX_ROWS rows (1 unless set) with no config to the resident
    kernel where its slice fits, the ungated pre-norm projection (qkv, whose output attention reads) with the next
    kernel let in only at its end; more rows, an explicit config, or a slice too big keep the skinny kernels."""
    calls = []
    monkeypatch.setattr(resident_gemv, "MAX_ROWS", 1)
    real = resident_gemv.launch
    monkeypatch.setattr(resident_gemv, "launch",
                        lambda *a, **kw: calls.append(kw.get("trigger_at_end", False)) or real(*a, **kw))
    gen = torch.Generator(DEVICE).manual_seed(0)
    w = randn(gen, 40, 96, dtype=torch.float16)
    skinny_gemm.skinny_linear(randn(gen, 1, 96, dtype=torch.float16), w)
    skinny_gemm.skinny_gate_up_silu(randn(gen, 1, 96, dtype=torch.float16), w)
    skinny_gemm.skinny_norm_linear(randn(gen, 1, 96, dtype=torch.float16), w, 1e-6, gated=True)
    skinny_gemm.skinny_norm_linear(randn(gen, 1, 96, dtype=torch.float16), w, 1e-6)
    assert calls == [False, False, False, True]
    skinny_gemm.skinny_linear(randn(gen, 2, 96, dtype=torch.float16), w)
    skinny_gemm.skinny_linear(randn(gen, 1, 96, dtype=torch.float16), w, config=skinny_gemm.config_for(1, 40, 96))
    monkeypatch.setattr(resident_gemv, "MAX_ROWS", 4)
    skinny_gemm.skinny_linear(randn(gen, 4, 96, dtype=torch.float16), w)
    assert len(calls) == 5
    skinny_gemm.skinny_linear(randn(gen, 5, 96, dtype=torch.float16), w)
    monkeypatch.setattr(resident_gemv, "RESIDENT_BYTES", 0)  # nothing fits
    skinny_gemm.skinny_linear(randn(gen, 1, 96, dtype=torch.float16), w)
    assert len(calls) == 5


# ---------------------------------------------------------------- GPU
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,gated", [(4096, 1024, False), (1024, 2048, False), (3072, 1024, True),
                                       (1024, 3072, False), (3072, 2048, False), (2048, 2048, False)])
def test_model_shapes_match_the_fma_kernel(dtype, n, k, gated):
    """Qwen3-0.6B's and Llama-3.2-1B's projections at one row, under PDL where the GPU has it: the FMA kernel's
    outputs to the dtype's rounding (different sum orders), and a graph replay gives eager's bits."""
    gen = torch.Generator(DEVICE).manual_seed(n + k)
    x = randn(gen, 1, k, dtype=dtype)
    w = (randn(gen, (2 if gated else 1) * n, k, dtype=torch.float32) * k**-0.5).to(dtype)
    add = None if gated else randn(gen, 1, n, dtype=dtype)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    cfg = resident_gemv.config_for_call(x, w, sms, gated)
    assert cfg is not None
    out = torch.empty(1, n, dtype=dtype, device=DEVICE)
    launch(x, w, out, cfg, gated=gated, add=add)
    fma = skinny_gemm.config_for(1, n, k, gated=gated)
    if gated:
        want = skinny_gemm.skinny_gate_up_silu(x, w, config=fma)
    else:
        want = skinny_gemm.skinny_linear(x, w, config=fma, add=add)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    eager = out.clone()
    out.fill_(float("nan"))
    graph = captured(lambda: launch(x, w, out, cfg, gated=gated, add=add))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
