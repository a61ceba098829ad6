"""Benchmark helpers that patch the engine before a run: bench_decode.py's `--decode-entry` (the decode-kernel
settings a pass runs with, patched into the backend's tables before the engine is built, and restored by the
benchmark after), its `--gemm-tiles` (the GEMMs' tile rule at 5-32 rows) and bound_decode_launches.py (launches
replaced by no-ops, for an upper bound)."""

import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import patch_decode_tables, patch_gemm_tiles  # noqa: E402

from ostinato.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from ostinato.attention.triton_ops.decode_attention import table_entry  # noqa: E402
from ostinato.layers.triton_ops import skinny_gemm, wide_gemm  # noqa: E402


def test_patch_changes_the_entry_a_batch_size_takes_in_every_table():
    saved = copy.deepcopy(TritonAttentionBackend.decode_tables)
    try:
        patch_decode_tables("table")
        assert TritonAttentionBackend.decode_tables == saved
        patch_decode_tables("32:min_tokens_per_split=512,variant='fp16';2:num_warps=2")
        for key, table in TritonAttentionBackend.decode_tables.items():
            before = saved[key]
            assert table_entry(table, 32) == table_entry(before, 32) | dict(min_tokens_per_split=512, variant="fp16")
            assert table_entry(table, 17) == table[32]  # 17-32 rows take the entry keyed 32
            assert table[2] == table_entry(before, 2) | dict(num_warps=2)  # keyed 2 now: bs 2 takes it
            assert table_entry(table, 2) == table[2]
            for bs in (1, 4, 8, 64, 128, 256):  # the others unchanged
                if bs in before:
                    assert table[bs] == before[bs]
        with pytest.raises(ValueError, match="power of two"):
            patch_decode_tables("24:num_warps=2")
    finally:
        TritonAttentionBackend.decode_tables = saved


def test_launch_bound_replaces_the_norm_and_the_activation_with_no_launch():
    """benchmarks/bound_decode_launches.py: the patched ops return their inputs (a view), computing nothing."""
    import torch
    from bound_decode_launches import skip_launches

    import ostinato.layers.norm as norm
    import ostinato.layers.norm_linear as norm_linear

    saved = norm.fused_add_rms_norm, norm_linear.silu_and_mul
    try:
        skip_launches("norm,silu")
        x, r = torch.randn(3, 8), torch.randn(3, 8)
        out, res = norm.fused_add_rms_norm(x, r, torch.ones(8), 1e-6)
        assert out is x and res is r
        act = norm_linear.silu_and_mul(x, norm=(r, 1e-6))
        assert act.data_ptr() == x.data_ptr() and act.shape == (3, 4)
    finally:
        norm.fused_add_rms_norm, norm_linear.silu_and_mul = saved


def test_gemm_tiles_change_the_named_kind_at_its_rows_only():
    rules, prenorm = (wide_gemm.config_for, skinny_gemm.config_for), skinny_gemm.prenorm_config
    try:
        patch_gemm_tiles("gated:block_n=32,num_stages=3;skinny:block_k=256")
        assert wide_gemm.config_for(32, 3072, 1024, gated=True) == rules[0](32, 3072, 1024, True)._replace(
            block_n=32, num_stages=3)
        assert wide_gemm.config_for(32, 4096, 1024) == rules[0](32, 4096, 1024)  # plain: not named
        assert wide_gemm.config_for(48, 3072, 1024, gated=True) == rules[0](48, 3072, 1024, True)  # > 32 rows
        assert skinny_gemm.config_for(16, 1024, 3072) == rules[1](16, 1024, 3072)._replace(block_k=256)
        assert skinny_gemm.config_for(4, 1024, 3072) == rules[1](4, 1024, 3072)  # the FMA form: not named
        patch_gemm_tiles("fma_gated:block_k=1024,num_stages=4;fma:block_n=8")
        assert skinny_gemm.config_for(1, 8192, 2048, gated=True) == rules[1](1, 8192, 2048, gated=True)._replace(
            block_k=1024, num_stages=4)
        assert skinny_gemm.config_for(4, 2048, 8192) == rules[1](4, 2048, 8192)._replace(block_n=8)
        assert skinny_gemm.config_for(5, 2048, 8192) == rules[1](5, 2048, 8192)  # past the FMA form's rows
        assert skinny_gemm.config_for(1, 8192, 2048, gated=False) == rules[1](1, 8192, 2048)._replace(block_n=8)
        # the folded norm's tiles: the change after prenorm_config's widening, which still sees the tree's rule
        assert skinny_gemm.prenorm_config(1, 8192, 2048, gated=True) == prenorm(1, 8192, 2048, gated=True)._replace(
            block_k=1024, num_stages=4)
        assert skinny_gemm.config_for is not rules[1]
        patch_gemm_tiles("rule")
        assert (wide_gemm.config_for, skinny_gemm.config_for) == rules and skinny_gemm.prenorm_config is prenorm
        for bad in ("gate:block_n=32", "plain", "skinny:block_k=two", "fma:block_m=2"):
            with pytest.raises(ValueError):
                patch_gemm_tiles(bad)
    finally:
        (wide_gemm.config_for, skinny_gemm.config_for), skinny_gemm.prenorm_config = rules, prenorm


def gated_case(m: int, k: int, inter: int, dtype: str, seed: int) -> tuple:
    """x [m, k], a gate_up W [2 * inter, k] (in the dtype, on the GPU if there is one) and silu(x W_gate^T) *
    (x W_up^T) in float32; skips where no kernel can run (no interpreter, no GPU)."""
    import torch

    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dev, getattr(torch, dtype))
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(dev, getattr(torch, dtype))
    gate, up = (x.float() @ w.float().T).split(inter, 1)
    return x, w, torch.nn.functional.silu(gate) * up


def test_gemm_tiles_reach_the_kernel_and_keep_its_sums():
    """The patched rule is what wide_linear launches with (a tile of 32 + 32 gate / up rows here), and the kernel
    still computes silu(x W_gate^T) * (x W_up^T) (Triton's interpreter on the CPU, in fp16: it has no bf16 dot)."""
    import torch

    x, w, want = gated_case(6, 128, 128, "float16", seed=3)
    rules = wide_gemm.config_for, skinny_gemm.config_for
    seen = []
    try:
        patch_gemm_tiles("gated:block_n=32,num_stages=2")
        patched = wide_gemm.config_for
        wide_gemm.config_for = lambda *a, **kw: seen.append(patched(*a, **kw)) or seen[-1]
        got = wide_gemm.wide_linear(x, w, gated=True)
    finally:
        patch_gemm_tiles("rule")
    assert (wide_gemm.config_for, skinny_gemm.config_for) == rules
    assert [c.block_n for c in seen] == [32]
    torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=4e-3, rtol=4e-3)


def test_fma_tiles_reach_the_kernel_and_keep_its_sums():
    """An fma_gated patch is what a 2-row gate_up launches with (one row would take the resident GEMV), plain and
    with the norm folded in, and the FMA kernel still computes silu(x W_gate^T) * (x W_up^T) (Triton's interpreter
    on the CPU, or the GPU)."""
    import torch

    x, w, want = gated_case(2, 256, 64, "bfloat16", seed=5)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + 1e-6)
    n_gate, n_up = (normed @ w.float().T).split(64, 1)
    want_normed = torch.nn.functional.silu(n_gate) * n_up
    rules, prenorm = (wide_gemm.config_for, skinny_gemm.config_for), skinny_gemm.prenorm_config
    seen = []
    try:
        patch_gemm_tiles("fma_gated:block_n=8,block_k=64,num_stages=2")
        launch = skinny_gemm._skinny_fma_kernel
        skinny_gemm._skinny_fma_kernel = Recorder(launch, seen)
        got = skinny_gemm.skinny_gate_up_silu(x, w)
        got_normed, _ = skinny_gemm.skinny_norm_linear(x, w, 1e-6, gated=True)
    finally:
        (wide_gemm.config_for, skinny_gemm.config_for), skinny_gemm.prenorm_config = rules, prenorm
        skinny_gemm._skinny_fma_kernel = launch
    assert seen == [(8, 64, 2)] * 2
    torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_normed.float().cpu(), want_normed.cpu(), atol=2e-2, rtol=2e-2)


class Recorder:
    """Stands in for a Triton kernel: records each launch's (BLOCK_N, BLOCK_K, NUM_STAGES), then launches."""

    def __init__(self, kernel, seen: list) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.seen.append((meta["BLOCK_N"], meta["BLOCK_K"], meta["NUM_STAGES"]))
            return self.kernel[grid](*args, **meta)
        return launch
