"""The ITL-under-prefill-pressure benchmark's harness (benchmarks/bench_itl_prefill.py) on a tiny dummy model:
arrivals on schedule, ITL samples from the decoders only, the drain leaves no request or KV page behind (the
engine's idle leak check runs on the last step), for mixed chunk off and on. No timing is asserted."""

import argparse
import json
import os
import sys

import torch._dynamo

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_itl_prefill as bench  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def test_percentiles():
    p = bench.percentiles([0.001 * i for i in range(1, 1001)])  # 1..1000 ms, nearest rank
    assert [round(p[k], 6) for k in ("p50", "p99", "p99.9", "max", "mean")] == [501, 990, 999, 1000, 500.5]


def test_itl_bench_runs_both_variants(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    torch._dynamo.reset()
    args = argparse.Namespace(model=str(path), load_format="dummy", dtype="float32",
                              engine_args="--device cpu --attention-backend torch --max-total-tokens 4096 "
                                          "--max-running-requests 8 --chunked-prefill-size 32",
                              decoders=3, decoder_prompt_len=8, decode_len=[30, 60], prompt_len=70,
                              prompt_max_tokens=2, rate=4.0, duration=1.0, warmup=0.2, seed=0)
    rows = [bench.run_variant(args, name, flags) for name, flags in (("off", ""), ("on", "--enable-mixed-chunk"))]
    for row in rows:  # how many steps fit in the window depends on the machine's load: only what always holds
        assert 1 <= row["prompts_sent"] <= 4 and row["steps"]["counts"]["extend"] >= 1
        assert row["chunked_prefill_size"] == 32 and row["output_tok_s"] > 0
    off, on = rows
    # unmixed, prompts go first and may starve the decoders for the whole window (a slow machine); mixed, every
    # step carries the decoders' tokens, and the first one (a prompt arrives as the window opens) is mixed
    assert off["extend_paths"].get("mixed_steps", 0) == 0 and on["extend_paths"]["mixed_steps"] >= 1
    assert on["itl_samples"] > 0
