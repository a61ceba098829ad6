"""bench_persistent_gemv.py's chain kernel in Triton's interpreter: each GEMV as its own launch (a grid barrier
cannot open there: programs run one after another) against the chain in torch. The barrier and the L2 prefetch
run only on a GPU, where the benchmark compares the whole chain's output with the same reference."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the benchmark's kernel is Triton")
BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def test_chain_kernel_arithmetic_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, os.path.join(BENCH, "bench_persistent_gemv.py"), "--smoke"], check=True,
                          env=env, capture_output=True, text=True, timeout=300)
    assert "max relative difference against torch" in done.stdout
