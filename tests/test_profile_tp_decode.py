"""The TP decode profile's analysis (benchmarks/profile_tp_decode.py) on a hand-made chrome trace: kernel names
as CUDA, cuBLAS, NCCL, torch's symm_mem and our Triton kernels name them; steps cut at graph replays."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_tp_decode as prof  # noqa: E402


@pytest.mark.parametrize("name, category", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(c10::BFloat16**, ...)",
     "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "other_comm"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)", "gemm"),
    ("_skinny_dot_kernel", "gemm"),
    ("_decode_stage1_kernel", "attention"),
    ("_store_kv_kernel", "attention"),
    ("_rms_norm_kernel", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>", "other"),
])
def test_kernel_category(name, category):
    assert prof.kernel_category(name) == category


def _k(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, "device": 0}}


def test_analyze_splits_steps_at_graph_replays():
    """Three replays (correlations 10, 20, 30) 100 us apart; each step: a broadcast and a copy launched
    eagerly before the replay, then in the graph a GEMM, attention, an all-reduce, a norm and the gather."""
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5,
               "args": {"correlation": c}} for c in (10, 20, 30)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 50, "args": {}})
    for i, c in enumerate((10, 20, 30)):
        t = 1000 + 100 * i
        events += [
            _k("ncclDevKernel_Broadcast_RING_LL", t - 20, 8, c - 1),  # eager, before the replay: counts to the
            _k("Memcpy HtoD (Pinned -> Device)", t - 10, 2, c - 2, cat="gpu_memcpy"),  # previous step's window
            _k("nvjet_tst_64x8", t, 30, c),
            _k("_decode_stage1_kernel", t + 30, 10, c),
            _k("_decode_stage2_kernel", t + 40, 5, c),
            _k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", t + 50, 12, c),
            _k("_rms_norm_kernel", t + 62, 3, c),
            _k("ncclDevKernel_AllGather_RING_LL", t + 70, 4, c),
            _k("other GPU's kernel", t + 1, 50, c) | {"args": {"correlation": c, "device": 1}},
        ]
    out = prof.analyze({"traceEvents": events}, device=0)
    assert out["steps"] == 2
    assert out["step_ms"] == pytest.approx(0.100) and out["graph_ms"] == pytest.approx(0.074)
    assert out["gemm_ms"] == pytest.approx(0.030) and out["attention_ms"] == pytest.approx(0.015)
    assert out["all_reduce_ms"] == pytest.approx(0.012) and out["all_gather_ms"] == pytest.approx(0.004)
    assert out["other_comm_ms"] == pytest.approx(0.008) and out["other_ms"] == pytest.approx(0.005)
    # busy: 30 + 15 + 12 + 3 + 4 + 8 + 2 = 74 of 100 us
    assert out["busy_ms"] == pytest.approx(0.074) and out["gaps_ms"] == pytest.approx(0.026)
    # idle in the graph's span [0, 74): 45..50 and 65..70 (10 us); after it: 74..80, 88..90, 92..100 (16 us)
    assert out["graph_gaps_ms"] == pytest.approx(0.010) and out["outside_gaps_ms"] == pytest.approx(0.016)
    assert out["graph_kernels_per_step"] == 6 and out["kernels_per_step"] == 8
    assert out["top_kernels"][0]["name"] == "nvjet_tst_64x8" and out["top_kernels"][0]["category"] == "gemm"
    assert out["top_kernels"][0]["ms_per_step"] == pytest.approx(0.030)


def test_analyze_falls_back_to_the_whole_window():
    """Kernels that do not carry their graph launch's correlation id: the window over the number of launches."""
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5,
               "args": {"correlation": c}} for c in (10, 20)]
    events += [_k("nvjet_tst", 1000, 30, 0), _k("ncclDevKernel_AllReduce_Sum", 1040, 10, 0),
               _k("nvjet_tst", 1100, 30, 0), _k("_rms_norm_kernel", 1190, 10, 0)]
    out = prof.analyze({"traceEvents": events}, device=0)
    assert out["split"] == "aggregate" and out["steps"] == 2
    assert out["step_ms"] == pytest.approx(0.100) and out["gemm_ms"] == pytest.approx(0.030)
    assert out["all_reduce_ms"] == pytest.approx(0.005) and out["gaps_ms"] == pytest.approx(0.060)


def test_analyze_needs_two_replays():
    with pytest.raises(ValueError, match="graph replays"):
        prof.analyze({"traceEvents": [_k("nvjet", 0, 1, 5)]})
