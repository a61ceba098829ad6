"""bench_gluon_gemv.py's index math on a CPU (Gluon has no interpreter; the kernel itself runs only on a GPU):
each program's (row tile, K tile) order, which its loader and compute warps both walk, covers every tile once,
a row tile's K tiles on one program in order, and computes what torch computes."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

gluon_gemv = pytest.importorskip("bench_gluon_gemv", exc_type=ImportError)


@pytest.mark.parametrize("n,k,programs,block_n,block_k", [(96, 256, 4, 16, 64), (64, 512, 5, 8, 128),
                                                           (128, 128, 200, 16, 32)])
def test_tile_order_covers_every_tile_once_and_computes_the_gemv(n, k, programs, block_n, block_k):
    order = gluon_gemv.tile_order(n // block_n, k // block_k, programs)
    tiles = [t for seq in order for t in seq]
    assert sorted(tiles) == [(r, c) for r in range(n // block_n) for c in range(k // block_k)]
    for seq in order:  # each row tile's K tiles together and in order: the compute warps' sum runs along K
        rows = [r for r, _ in seq]
        assert rows == sorted(rows)
        for r in set(rows):
            assert [c for rr, c in seq if rr == r] == list(range(k // block_k))
    gen = torch.Generator().manual_seed(n + programs)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    x = torch.randn(k, generator=gen).to(torch.bfloat16)
    got, _ = gluon_gemv.emulate_gemv(w, x, programs, block_n, block_k)
    torch.testing.assert_close(got.float(), (w.double() @ x.double()).float(), atol=2e-2, rtol=1e-2)


def test_x_chunks_hold_the_widest_k():
    assert gluon_gemv.x_chunks(8192, 256) == 32
    assert gluon_gemv.x_chunks(3072, 256) == 16  # 12 chunks, rounded up to a power of two
    assert gluon_gemv.x_chunks(256, 256) == 1


@pytest.mark.parametrize("gated,prenorm", [(False, False), (True, True), (False, True)])
def test_emulated_kernel_matches_the_engines_one_row_ops(gated, prenorm):
    """The emulation (the kernel's arithmetic, tile by tile) computes what the engine's op it would stand in for
    computes: skinny_norm_linear (residual added, norm folded, gated: silu_and_mul) or skinny_linear, here in
    Triton's interpreter, to a bf16 rounding."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the engine's ops run in Triton's interpreter here")
    from ostinato.layers.triton_ops import skinny_gemm

    n, k, eps = 64, 512, 1e-5
    gen = torch.Generator().manual_seed(11 + gated + 2 * prenorm)
    w = (torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, k, generator=gen).to(torch.bfloat16) if prenorm else None
    got, new_residual = gluon_gemv.emulate_gemv(w, x[0], 3, 16, 128, gated=gated, eps=eps if prenorm else None,
                                                residual=None if residual is None else residual[0])
    if prenorm:
        want, want_residual = skinny_gemm.skinny_norm_linear(x, w, eps, residual, gated=gated)
        torch.testing.assert_close(new_residual, want_residual[0], atol=0, rtol=8e-3)  # the interpreter's rounding
    elif gated:
        want = skinny_gemm.skinny_gate_up_silu(x, w)
    else:
        want = skinny_gemm.skinny_linear(x, w)
    torch.testing.assert_close(got.float(), want[0].float(), atol=2e-2, rtol=2e-2)
    assert got.abs().max() > 0.1  # not a vacuous match


def test_patched_engine_leaves_what_the_kernel_does_not_take_to_its_own_launch():
    """--step's patch (GLUON_GEMV) sends only CUDA one-row launches the resident GEMV does not take to the Gluon
    kernel: a CPU call still runs the engine's kernel, with the engine's signature."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the engine's kernel runs in Triton's interpreter here")
    from ostinato.layers.triton_ops import skinny_gemm

    saved = skinny_gemm._launch
    for bad in ("16:256:65536", "16:256:big:1", "0:256:65536:1"):
        with pytest.raises(ValueError, match="GLUON_GEMV"):
            gluon_gemv.patch_engine(bad)
    assert skinny_gemm._launch is saved
    try:
        gluon_gemv.patch_engine("16:256:65536:1")
        assert skinny_gemm._launch is not saved
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
        w = (torch.randn(64, 256, generator=gen) / 16).to(torch.bfloat16)
        got = skinny_gemm.skinny_linear(x, w)
        res = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
        normed, new_res = skinny_gemm.skinny_norm_linear(x, torch.cat([w, w]), 1e-5, res, gated=True)
    finally:
        skinny_gemm._launch = saved
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, atol=2e-2, rtol=2e-2)
    assert normed.shape == (1, 64) and new_res.shape == (1, 256)
