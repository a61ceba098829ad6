"""bench_persistent_gemv.py's chain kernel in Triton's interpreter: each GEMV as its own launch (a grid barrier
cannot open there: programs run one after another) against the chain in torch. The barrier and the L2 prefetch
run only on a GPU, where the benchmark compares the whole chain's output with the same reference."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the benchmark's kernel is Triton")
BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def test_chain_kernel_arithmetic_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, os.path.join(BENCH, "bench_persistent_gemv.py"), "--smoke"], check=True,
                          env=env, capture_output=True, text=True, timeout=300)
    assert "max relative difference against torch" in done.stdout


def test_time_variants_checks_each_variant_and_writes_its_report(tmp_path, monkeypatch, capsys):
    """time_variants' bookkeeping on a CPU (the GPU's timing and device name stubbed): each variant runs after the
    reset, its output is compared with the reference, and the report holds every row and the `extra` keys."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_persistent_gemv as bench

    monkeypatch.setattr(bench, "graph_us", lambda fn: 10.0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "stub")
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    ref = torch.tensor([1.0, -2.0, 4.0])
    state = {"out": torch.zeros(3)}

    def reset():
        state["out"] = torch.zeros(3)

    def right():
        state["out"] = ref.clone()

    def off():
        state["out"] = ref + torch.tensor([0.0, 0.0, 1.0])

    out = tmp_path / "report.json"
    bench.time_variants([("right", right), ("off", off)], reset, lambda name: state["out"], ref, 2_000_000, 4,
                        str(out), extra={"traces": {"x": 1}})
    report = json.loads(out.read_text())
    assert report["traces"] == {"x": 1} and report["device"] == "stub"
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["right"]["rel_err"] == 0.0 and rows["off"]["rel_err"] == pytest.approx(0.25)
    assert rows["right"]["TBps"] == pytest.approx(0.2) and rows["right"]["us_per_gemv"] == pytest.approx(2.5)
    assert "off" in capsys.readouterr().out
