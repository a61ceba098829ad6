"""benchmarks/profile_step_boundary.py's reading of a trace: a step boundary runs from the first argmax kernel after a
forward (the decode graph's) to the next forward's first GEMV, the sampler graph's own argmax kernel inside it."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from profile_step_boundary import boundaries, step_spans  # noqa: E402


def _event(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur}


def test_a_sampled_step_is_one_boundary_from_the_decode_graphs_argmax():
    events = [
        _event("_skinny_fma_kernel", 0.0, 90.0),  # a forward
        _event("_rows_argmax_kernel", 100.0, 2.0),  # the decode graph's argmax: the boundary starts at 102
        _event("_split_sample_kernel", 105.0, 3.0),
        _event("_rows_argmax_kernel", 110.0, 2.0),  # the sampler graph's pick_rows: inside the boundary
        _event("Memcpy HtoD (Pinned -> Device)", 115.0, 2.0),
        _event("_begin_decode_kernel", 120.0, 2.0),
        _event("_skinny_fma_kernel", 130.0, 90.0),  # the next forward
        _event("_rows_argmax_kernel", 230.0, 2.0),  # a greedy step: the next boundary
        _event("_skinny_dot_kernel", 240.0, 50.0),
    ]
    (length, seq, first), (greedy, greedy_seq, second) = boundaries(events)
    assert length == 28.0 and [name for name, _, _ in seq][:2] == ["_split_sample_kernel", "_rows_argmax_kernel"]
    assert greedy == 8.0 and greedy_seq == []
    assert (first, second) == (6, 8)  # the next forwards' first GEMVs
    # from one forward's first GEMV to the next: 130 us with the GPU busy 101 (the forward, the argmax and the
    # sampled step's boundary kernels), then 110 with 92 (a greedy step's forward and argmax)
    periods, busy = step_spans(events, [0, first, second])
    assert periods == [130.0, 110.0] and busy == [90.0 + 2.0 + 3.0 + 2.0 + 2.0 + 2.0, 92.0]
    overlapping = [_event("_skinny_fma_kernel", 0.0, 50.0), _event("Memcpy DtoH", 40.0, 20.0),
                   _event("_skinny_fma_kernel", 100.0, 10.0)]
    assert step_spans(overlapping, [0, 2]) == ([100.0], [60.0])  # 0-50 and 40-60 cover 60 us, not 70


def test_a_bs32_forward_starts_at_its_wide_gemm():
    """At 5-64 rows the first weight read is the wide GEMM (qkv), and at one row a resident GEMV may start a
    forward: both end a boundary."""
    events = [
        _event("_wide_kernel", 0.0, 90.0),
        _event("_rows_argmax_kernel", 100.0, 2.0),
        _event("_begin_decode_kernel", 110.0, 2.0),
        _event("_wide_kernel", 130.0, 90.0),
        _event("_rows_argmax_kernel", 230.0, 2.0),
        _event("_resident_gemv_kernel", 250.0, 5.0),
    ]
    (a, seq, _), (b, _, _) = boundaries(events)
    assert a == 28.0 and [name for name, _, _ in seq] == ["_begin_decode_kernel"]
    assert b == 18.0
