"""tests/interpreter_speedup.py: with the interpreter's repeated language patches skipped, kernels that call jit
helpers (ours and the standard library's) still compute what torch computes, and a kernel that fails mid-run leaves
the next one patched properly."""

import os

import pytest
import torch
import triton
import triton.language as tl

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _row_sums_kernel(X, Out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)  # tl.zeros is a jit function of the standard library
    for c in range(0, n_cols, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        acc += _scaled(tl.load(X + row * n_cols + offs, mask=offs < n_cols, other=0.0), 2.0)
    tl.store(Out + row, tl.sum(acc, 0))


@triton.jit
def _bad_helper(x):
    return tl.reshape(x, [4])  # 8 elements into 4: the interpreter raises


@triton.jit
def _failing_kernel(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, 4), _bad_helper(tl.load(X + tl.arange(0, BLOCK))))


def row_sums(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _row_sums_kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=16)
    return out


@interpreted
def test_helpers_still_compute_and_a_failed_kernel_leaves_no_state():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "skips_repeats", False), "conftest installs the shim"
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(row_sums(x), 2 * x.sum(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="reshape|shape|numel|size"):
        _failing_kernel[(1,)](torch.randn(8), BLOCK=8)
    y = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(row_sums(y), 2 * y.sum(1), rtol=1e-5, atol=1e-5)
