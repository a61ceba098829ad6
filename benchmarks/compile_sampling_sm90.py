"""Compile the sampling kernels for sm_90 on a CPU: the fused sampler's (runner/fused_sample.py), at the settings a
captured step launches them with, and the decode graph's argmax and draw (layers/triton_ops/argmax.py). The errors
only a compiled kernel meets (Triton's interpreter runs the Python and checks no types: a loop-carried variable
whose type changes, say) show here, before a GPU call; `tests/test_compile_sm90.py` runs it in the CPU suite.

PYTHONPATH=/tmp/t36 python benchmarks/compile_sampling_sm90.py   # Triton 3.6 (the GPU image's) with its ptxas:
                                                                 # pip install --no-deps --target /tmp/t36 triton==3.6.0
"""

import sys

from sass_decode_attention import compile_sm90

import ostinato.layers.triton_ops.argmax as am
import ostinato.runner.fused_sample as fs

# pointer arguments (capitalized, or named *_ptr) by dtype; the rest are float32
I64 = {"Idx", "Idx2", "OutIdx", "OutIdx2", "State", "Resolved", "CutK", "PCut", "TopKs", "Seeds", "Steps", "seeds_ptr",
       "steps_ptr", "out_ptr", "dest_ptr", "index_ptr"}
I32 = {"Count", "Count2", "Second", "Order", "Order2", "Hist", "Dense", "Gathered", "GathN", "Cursor", "Kept", "Ties",
       "Bar", "KeptCursor", "idx_ptr"}
PLAIN_INTS = ("pass_idx", "passes", "b", "split_len", "num_splits", "vocab_size", "stride_l", "n_cols", "n_chunks")
ROW = dict(HAS_MIN_P=False, SPLITS_POW2=16, NWAY=16)
CHECK = dict(CHECKED=True)
CASES = [
    (fs._split_sample_kernel, dict(HAS_CUT=False, BLOCK=2048, STORE_MAX=True, KEEP_SECOND=True, **ROW)),
    (fs._split_sample_kernel, dict(HAS_CUT=True, BLOCK=2048, **CHECK, **ROW)),
    (fs._accept_part_kernel, dict(HAS_K=True, HAS_P=True, SECOND=True, BLOCK=1024, **ROW)),
    (fs._accept_part_kernel, dict(HAS_K=False, HAS_P=True, SECOND=True, BLOCK=1024, **ROW)),
    (fs._verdict_kernel, dict(HAS_K=True, HAS_P=True, SECOND=True, num_warps=1, **ROW)),
    (fs._verdict_kernel, dict(HAS_K=False, HAS_P=True, SECOND=False, num_warps=1, **ROW)),
    (fs._verdict_kernel, dict(HAS_K=False, HAS_P=True, SECOND=True, ZERO_BAR=True, num_warps=1, **ROW)),
    (fs._top_k_pass_kernel, dict(BLOCK=2048, FIRST=True, num_warps=4, **CHECK, **ROW)),
    (fs._top_k_pass_kernel, dict(BLOCK=2048, FIRST=False, num_warps=4, **CHECK, **ROW)),
    (fs._top_k_resolve_kernel, dict(BLOCK=1024, **CHECK, **ROW)),
    (fs._top_p_pass_kernel, dict(HAS_K=True, BLOCK=1024, GATHER_CAP=128, IS_GATHER=True, **CHECK, **ROW)),
    (fs._top_p_pass_kernel, dict(HAS_K=False, BLOCK=1024, **CHECK, **ROW)),
    (fs._cut_resolve_kernel, dict(GATHER_CAP=128, RESOLVE_BLOCK=256, **CHECK, **ROW)),
    (fs._cut_finish_kernel, dict(HAS_P=True, GATHER_CAP=128, num_warps=1, **CHECK, **ROW)),
    (fs._cut_finish_kernel, dict(HAS_P=True, num_warps=1, **ROW)),
    (fs._cut_finish_kernel, dict(HAS_P=True, GATHER_CAP=128, KEPT=True, num_warps=1, **CHECK, **ROW)),
    (fs._kept_gather_kernel, dict(BLOCK=1024, KEPT_CAP=2048, **CHECK, **ROW)),
    (fs._kept_top_p_kernel, dict(KEPT_CAP=2048, RESOLVE_BLOCK=256, **CHECK, **ROW)),
    (fs._top_p_search_kernel, dict(HAS_K=False, BLOCK=1024, DRAW_BLOCK=2048, GATHER_CAP=128, RESOLVE_BLOCK=256, **ROW)),
    (fs._top_p_search_kernel, dict(HAS_K=True, BLOCK=1024, DRAW_BLOCK=2048, **ROW)),
    (fs._top_k_search_kernel, dict(BLOCK=2048, RESOLVE_BLOCK=1024, DRAW_BLOCK=2048, num_warps=4, **ROW)),
    (fs._top_k_search_kernel, dict(BLOCK=2048, RESOLVE_BLOCK=1024, DRAW_BLOCK=2048, num_warps=4,
                                   **(ROW | dict(HAS_MIN_P=True)))),
    (fs._top_k_search_kernel, dict(BLOCK=2048, RESOLVE_BLOCK=1024, DRAW_BLOCK=2048, num_warps=4, KEPT_P=True,
                                   KEPT_CAP=2048, **ROW)),
    (am._chunk_best_kernel, dict(BLOCK=2048, DRAW=True, num_warps=4)),
    (am._chunk_best_kernel, dict(BLOCK=2048, DRAW=False, num_warps=4)),
    (am._rows_argmax_kernel, dict(BLOCK_C=128, SCATTER=True, num_warps=1)),
]


def compile_case(fn, settings: dict):
    """The kernel compiled for sm_90 with `settings` for its constexprs (their defaults elsewhere)."""
    consts = {p.name: settings.get(p.name, p.default) for p in fn.params if p.is_constexpr}
    ptrs = {p.name: "*i64" if p.name in I64 else "*i32" if p.name in I32 else "*fp32"
            for p in fn.params if not p.is_constexpr and (p.name[0].isupper() or p.name.endswith("_ptr"))}
    return compile_sm90(fn, consts, ptrs, floats=("greedy_eps",), plain_ints=PLAIN_INTS,
                        num_warps=settings.get("num_warps", 8))


def main() -> int:
    failed = 0
    for fn, settings in CASES:
        flags = {k: v for k, v in settings.items() if isinstance(v, bool) and v}
        try:
            compile_case(fn, settings)
            print(f"ok    {fn.fn.__name__} {sorted(flags)}")
        except Exception as e:  # noqa: BLE001 (every failure is reported, then the exit status)
            failed += 1
            print(f"FAIL  {fn.fn.__name__} {sorted(flags)}: {e!r}"[:600])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
