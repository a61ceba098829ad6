"""Benchmark helpers that patch the engine before a run: bench_decode.py's `--decode-entry` (the decode-kernel
settings a pass runs with, patched into the backend's tables before the engine is built, and restored by the
benchmark after) and bound_decode_launches.py (launches replaced by no-ops, for an upper bound)."""

import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import patch_decode_tables  # noqa: E402

from ostinato.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from ostinato.attention.triton_ops.decode_attention import table_entry  # noqa: E402


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
