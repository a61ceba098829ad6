"""bench_gluon_gemv_chain.py's host side and index math on a CPU (Gluon has no interpreter; the kernel itself runs
only on a GPU): the tiled weights, the plan, and each program's tile order, which the loader and compute warps both
walk, cover every row tile of every GEMV once and compute the chain torch computes."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

gluon_chain = pytest.importorskip("bench_gluon_gemv_chain", exc_type=ImportError)
from bench_persistent_gemv import SMOKE_LAYER, chain_meta, reference  # noqa: E402


@pytest.mark.parametrize("programs,block_n,block_k", [(3, 16, 128), (7, 32, 64), (64, 16, 128)])
def test_schedule_covers_every_tile_once_and_computes_the_chain(programs, block_n, block_k):
    _, w_size, a_size, rows = chain_meta(2, torch.device("cpu"), SMOKE_LAYER)
    gen = torch.Generator().manual_seed(programs)
    w = (torch.randn(w_size, generator=gen) * 0.05).to(torch.bfloat16)
    a = torch.zeros(a_size, dtype=torch.bfloat16)
    a[: SMOKE_LAYER[0][1]] = torch.randn(SMOKE_LAYER[0][1], generator=gen).to(torch.bfloat16)
    w_tiled = gluon_chain.tiled_weights(w, rows, block_n, block_k)
    plan = gluon_chain.plan_for(rows, block_n, block_k, torch.device("cpu"))

    seen = {}
    for pid, seq in enumerate(gluon_chain.tile_schedule(plan, programs)):
        gemvs = [g for g, *_ in seq]
        assert gemvs == sorted(gemvs), "a program takes its tiles GEMV by GEMV, as the compute warps wait"
        for g, r, c, tile in seq:
            assert (g, r, c) not in seen
            seen[g, r, c] = pid
            n, k, wo, _, _ = rows[g]
            # the descriptor's rows of this tile are W_g's block (r, c)
            block = w[wo : wo + n * k].view(n, k)[r * block_n : (r + 1) * block_n, c * block_k : (c + 1) * block_k]
            assert torch.equal(w_tiled.view(-1, block_k)[tile * block_n : (tile + 1) * block_n], block)
    expected = {(g, r, c) for g, (n, k, *_) in enumerate(rows)
                for r in range(n // block_n) for c in range(k // block_k)}
    assert set(seen) == expected
    for g, (n, k, *_) in enumerate(rows):  # a row tile's K tiles all on one program
        for r in range(n // block_n):
            assert len({seen[g, r, c] for c in range(k // block_k)}) == 1

    got = gluon_chain.emulate_chain(w_tiled, plan, a, programs, block_n, block_k)
    ref = reference(w, a, rows)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < 2e-2, err


def test_row_tiles_are_dealt_round_robin_in_chain_order():
    """Row tile r of GEMV g goes to program (order_g + r) % programs: consecutive tiles of the chain, across GEMV
    boundaries, on consecutive programs, so a program with no tile in a small GEMV loads its next one early."""
    rows = [(64, 32, 0, 0, 32), (32, 64, 2048, 32, 96)]  # (N, K, W offset, in, out): 4 and 2 row tiles of 16
    plan = gluon_chain.plan_for(rows, 16, 32, torch.device("cpu"))
    owners = {(g, r): pid for pid, seq in enumerate(gluon_chain.tile_schedule(plan, 3)) for g, r, _, _ in seq}
    assert [owners[0, r] for r in range(4)] == [0, 1, 2, 0]
    assert [owners[1, r] for r in range(2)] == [1, 2]


def test_shapes_that_do_not_tile_are_refused():
    with pytest.raises(ValueError, match="K = 384 must be a multiple of BLOCK_K 256"):
        gluon_chain.tiled_weights(torch.zeros(256 * 384, dtype=torch.bfloat16), [(256, 384, 0, 0, 0)], 16, 256)
