"""bench_decode_attention.py's --robust choice: one decode setting per batch size over several contexts."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the benchmark imports the Triton decode kernel")
BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCH)

import bench_decode_attention as bench  # noqa: E402


def row(cfg: dict, ctx: int, us: float, knobs: list, kv: str = "bf16") -> dict:
    return dict(bs=32, ctx=ctx, kv=kv, **cfg, split_knobs=knobs, us=us, rel_err=1e-3)


def cfg(block_n: int, variant: str = "bf16") -> dict:
    return dict(variant=variant, block_n=block_n, num_warps=1, num_stages=2, whole_blocks=True)


def test_robust_pick_is_the_least_geometric_mean_slowdown():
    """Block 32 is best at the short context and 2x off at the long one, block 128 the reverse; block 64 is 1.2x
    off at both: 64 wins. Split knobs that give the same split count share a timing; a tie prefers (2, 64)."""
    rows = [
        row(cfg(32), 128, 10.0, [[2, 64], [4, 64]]), row(cfg(32), 4096, 200.0, [[2, 64], [4, 64]]),
        row(cfg(64), 128, 12.0, [[4, 64], [2, 64]]), row(cfg(64), 4096, 120.0, [[4, 64], [2, 64]]),
        row(cfg(128), 128, 20.0, [[2, 64]]), row(cfg(128), 4096, 100.0, [[2, 64]]),
        # a setting timed at one context only is never picked
        row(cfg(16), 128, 1.0, [[2, 64]]),
    ]
    current = {("bf16", 32): dict(cfg(32), knobs=(2, 64))}
    tables, report = bench.robust_tables(rows, current)
    assert tables["bf16"][32] == dict(cfg(64), programs_per_sm=2, min_tokens_per_split=64)
    assert tables["fp8_e4m3"] == {}
    (r,) = report
    assert r["best_us"] == {128: 1.0, 4096: 100.0}
    assert r["pick_slowdown"] == pytest.approx((12.0 / 1.0 * 120.0 / 100.0) ** 0.5)
    assert r["current_slowdown"] == pytest.approx((10.0 * 2.0) ** 0.5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only (CPU tensors); "
                    "on a GPU the sweep itself is the check")
def test_robust_smoke_run(tmp_path):
    """The whole --robust path in Triton's interpreter: every (kv dtype, batch size) gets an entry."""
    out = tmp_path / "robust.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, os.path.join(BENCH, "bench_decode_attention.py"), "--smoke", "--heads", "8:2:32",
                    "--robust", "2,3", "16,48", "--out", str(out)], check=True, env=env, capture_output=True,
                   timeout=300)
    d = json.loads(out.read_text())
    assert d["heads"] == "8:2:32" and {r["ctx"] for r in d["all"]} == {16, 48}
    for kv in ("bf16", "fp8_e4m3"):
        assert set(d["tables"][kv]) == {"2", "3"}
    assert all(r["rel_err"] < 0.02 for r in d["all"])
