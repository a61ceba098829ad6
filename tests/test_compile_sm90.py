"""The sampling kernels compile for sm_90 (Hopper) on a CPU (`benchmarks/compile_sampling_sm90.py`, in a process
without TRITON_INTERPRET): the CPU suite runs them in Triton's interpreter, which checks no types, so an error only
the compiler meets (a loop-carried variable whose type changes, say) would otherwise first show on a GPU."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_sampling_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's NVIDIA backend has no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_sampling_sm90.py")], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("ok ") == result.stdout.count("\n")  # every case compiled
