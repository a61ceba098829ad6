"""bench_kv_stream.py in Triton's interpreter: each stream setting's sum of the split's K / V words must equal
torch's over the same slots (the script asserts it), for the fp8 pool's slot groups (pages of 1 and of 128) and a
bf16 pool; and a malformed setting is an argparse error naming the spec and what it wants."""

import argparse
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the benchmark's kernel is Triton")
BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_kv_stream.py")


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", OSTINATO_PDL="0")
    return subprocess.run([sys.executable, BENCH, *args], env=env, capture_output=True, text=True, timeout=300)


def test_stream_sums_match_torch_in_the_interpreter():
    done = run("--smoke")
    assert done.returncode == 0, done.stderr[-2000:]
    for setting in ("fp8:32:1:4 ", "fp8:32:1:2:128", "bf16:64:1:2"):
        assert setting in done.stdout
    assert done.stdout.count("entry") == 2  # the decode kernel ran beside them, on each pool


def test_malformed_setting_is_an_argparse_error():
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        import bench_kv_stream
    finally:
        sys.path.pop(0)
    assert bench_kv_stream.parse_setting("fp8:32:1:4:128")["page"] == 128
    for bad, why in [("fp8:32:1", "want kv:block_n:warps:splits[:page]"), ("int8:32:1:4", "want"),
                     ("fp8:48:1:4", "block_n 16-128"), ("bf16:32:1:4:16", "page 1 or 128")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
            bench_kv_stream.parse_setting(bad)
