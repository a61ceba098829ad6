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


@pytest.mark.parametrize("group", [2, 4])
def test_a_slot_box_holds_its_group_of_k_tiles(group):
    """A ring slot is one TMA box of `group` tiles ([group * BLOCK_N, BLOCK_K] rows from the slot's descriptor row),
    read by the compute warps as [group, BLOCK_N, BLOCK_K]: box u must be W_g's block (r, c + u), and the slots,
    expanded, must be the tile order the kernels' index math walks."""
    block_n, block_k, programs = 16, 32, 5  # K tiles 8, 16, 8, 12: every group divides them
    _, w_size, _, rows = chain_meta(2, torch.device("cpu"), SMOKE_LAYER)
    w = torch.randn(w_size, generator=torch.Generator().manual_seed(group)).to(torch.bfloat16)
    w_tiled = gluon_chain.tiled_weights(w, rows, block_n, block_k)
    plan = gluon_chain.plan_for(rows, block_n, block_k, torch.device("cpu"))
    view = w_tiled.view(-1, block_k)
    slots = gluon_chain.slot_schedule(plan, programs, group)
    for seq, tiles in zip(slots, gluon_chain.tile_schedule(plan, programs), strict=True):
        assert [(g, r, c + u, row + u) for g, r, c, row in seq for u in range(group)] == tiles
        for g, r, c, row in seq:
            n, k, wo, _, _ = rows[g]
            box = view[row * block_n : (row + group) * block_n].view(group, block_n, block_k)
            w_g = w[wo : wo + n * k].view(n, k)[r * block_n : (r + 1) * block_n]
            for u in range(group):
                assert torch.equal(box[u], w_g[:, (c + u) * block_k : (c + u + 1) * block_k])


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


def test_trace_report_reads_the_stamps():
    """A made-up trace of 3 programs and 3 GEMVs (ns): program 2 has no tile of GEMV 1. Each GEMV g >= 1 starts
    for everyone when the last program is done with g - 1; its figures are computed here by hand."""
    done = [[1000, 5000, 9000], [1400, 5600, 9800], [1200, 0, 9400]]  # stage 3; 0: no tile
    trace = torch.zeros(3, 3, gluon_chain.TRACE_POINTS.value, dtype=torch.int64)
    for p in range(3):
        for g in range(3):
            if done[p][g]:
                past = 1400 + 700 * p if g == 1 else 5600 + 500 * p if g == 2 else 100  # stage 1
                # the loader reached the GEMV 3 us before x was stored and issued its last box 0.4 us before
                trace[p, g] = torch.tensor([past - 50, past, past + 900, done[p][g], past - 2100, past + 500])
    report = gluon_chain.trace_report(trace)
    # last done: 1400, 5600, 9800 -> periods 4.2, 4.2 us
    assert report["period"] == pytest.approx(4.2)
    # GEMV 1: first past 1400 (-0 after 1400), last past 2100 (p 1); GEMV 2: 5600 / 6600 after 5600
    assert report["notice_first"] == pytest.approx(0.0)
    assert report["notice_last"] == pytest.approx((0.7 + 1.0) / 2)
    assert report["x"] == pytest.approx(0.9)
    # tiles after x: GEMV 1 p0 5000-2300, p1 5600-3000 -> mean 2.65, slowest 2.7; GEMV 2 p0 9000-6500,
    # p1 9800-7000, p2 9400-7500 -> mean 2.4, slowest 2.8
    assert report["tiles"] == pytest.approx((2.65 + 2.4) / 2)
    assert report["tiles_slowest"] == pytest.approx((2.7 + 2.8) / 2)
    assert report["loader_ahead"] == pytest.approx(0.4)
    assert report["loader_span"] == pytest.approx(2.6)


@pytest.mark.parametrize("tag", [1, 0x7FFF, 0x8000, 0xFFFF])
def test_tagged_words_keep_value_and_tag(tag):
    """The TAGS kernel's word: a bf16's bits low, the run's tag high (tags at and past 0x8000 make the word
    negative: the tag must still read back whole, and the sign of the value must not leak into it)."""
    x = (torch.randn(257, generator=torch.Generator().manual_seed(tag)) * 3).to(torch.bfloat16)
    x[:3] = torch.tensor([-0.0, float("-inf"), -1e-30])
    values, tags = gluon_chain.untagged(gluon_chain.tagged(x, tag))
    assert torch.equal(values.view(torch.int16), x.view(torch.int16))
    assert bool((tags == tag).all())


@pytest.mark.parametrize("spec,message", [
    ("16x256x6x3", "K tiles a slot must be a power of two"),
    ("16x256x6x8", "divides every K / BLOCK_K"),  # Qwen3-0.6B's K = 1024 has 4 tiles of 256
    ("128x256x6x4", "at most 256 a side"),
])
def test_bad_tiles_are_refused_by_name(spec, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_gluon_gemv_chain.py", "--tiles", spec, "--compile-only"])
    with pytest.raises(SystemExit):
        gluon_chain.main()
    err = capsys.readouterr().err
    assert spec in err and message in err


@pytest.mark.parametrize("argv,message", [
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--per-sm", "1", "0"], "--per-sm must be >= 1, got 1 0"),
    (["--warps", "-4"], "--warps must be >= 1, got -4"),
])
def test_bad_counts_are_refused_by_name(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_gluon_gemv_chain.py", *argv, "--compile-only"])
    with pytest.raises(SystemExit):
        gluon_chain.main()
    assert message in capsys.readouterr().err
