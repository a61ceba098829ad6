"""Tensor parallelism on the CPU: --tp-size 2 over gloo gives the same greedy tokens as --tp-size 1, each rank
holds its shard only, and a killed worker ends the run with a clear error (engine/tp_workers.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ostinato import LLM, SamplingParams

# a small pool and short chunks: chunked prefill, prefix-cache hits and retraction all happen
ENGINE = {"dtype": "float32", "max_total_tokens": 192, "chunked_prefill_size": 32, "max_running_requests": 8,
          "device": "cpu"}


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(5, 900, (40,), generator=g).tolist()  # a prefix longer than a chunk, cached once
    prompts = []
    for i in range(8):
        own = torch.randint(5, 900, (3 + 9 * i,), generator=g).tolist()
        prompts.append({"prompt_token_ids": (shared if i % 2 else []) + own})
    return prompts


def _run(model: str, tp: int, penalties: bool = False, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, tp_size=tp, **{**ENGINE, **kw})
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # every third request with penalties (counted on each rank's device, set from the plan at extend steps)
    penalized = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=0.7,
                               frequency_penalty=0.4, repetition_penalty=1.3)
    params = [penalized if penalties and i % 3 == 1 else greedy for i in range(len(_prompts()))]
    out = llm.generate(_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in out], llm


def _sharded_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)


def _check_same_tokens_and_shards(model: str, tp2_kw: dict | None = None, **kw) -> list[int]:
    ref, llm1 = _run(model, 1, **kw)
    full, kv_full = _sharded_numel(llm1.engine.runner.model), llm1.engine.runner.kv_cache.bytes()
    assert llm1.engine.scheduler.num_retractions > 0
    llm1.max_total_tokens = llm1.engine.runner.max_total_tokens
    llm1.shutdown()
    got, llm2 = _run(model, 2, **kw, **(tp2_kw or {}))
    try:
        assert llm2.engine.scheduler.num_retractions > 0
        assert llm2.engine.scheduler.cache.hit_tokens > 0
        assert got == ref
        procs = llm2.engine.tp.procs
        assert all(p.is_alive() for p in procs)
        runner = llm2.engine.runner
        # rank 0 holds half of every split layer (replicated KV heads excepted), never the whole model
        shard = _sharded_numel(runner.model)
        kv_share = runner.kv_heads / runner.config.num_key_value_heads
        assert shard <= full * max(0.5, kv_share) + 1024, (shard, full)
        assert runner.max_total_tokens == llm1.max_total_tokens and runner.kv_cache.bytes() == kv_full * kv_share
        pw = runner.piecewise_graph_runner
        splits = [r.num_split_calls for r in pw.backend.splits] if pw is not None else []
    finally:
        llm2.shutdown()
    assert all(not p.is_alive() for p in procs)
    return splits


def test_tp2_matches_tp1_on_tiny_llama(tiny_llama_path):
    """4 query heads and 2 KV heads: each rank holds 2 and 1; safetensors weights sliced as they load."""
    _check_same_tokens_and_shards(tiny_llama_path)


@pytest.fixture(scope="module")
def one_kv_head_qwen3(tmp_path_factory) -> str:
    """Qwen3 (q/k norm), 1 KV head (replicated on both ranks), tied embeddings, an odd vocabulary (padded)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1001, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }
    path = tmp_path_factory.mktemp("qwen3-1kv") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_tp2_matches_tp1_with_replicated_kv_head(one_kv_head_qwen3):
    """Dummy weights are drawn at the full shape and sliced, so the tp-2 model is the tp-1 model. At tp 2 the
    extends replay from piecewise graphs (the CPU stand-in), split at the all-reduces as well as at attention. Some
    requests have penalties: each rank counts their tokens itself."""
    piecewise = {"enable_piecewise_cuda_graph": True, "piecewise_cuda_graph_tokens": [32]}
    splits = _check_same_tokens_and_shards(one_kv_head_qwen3, piecewise, load_format="dummy", seed=3,
                                           enable_mixed_chunk=True, penalties=True)
    assert splits and splits[0] == 2 + 2 * 2 + 1  # per layer attention, o and down; the embedding


def test_tp_size_that_does_not_divide_the_heads_is_a_clear_error(one_kv_head_qwen3):
    with pytest.raises(ValueError, match="tp_size must divide num_attention_heads"):
        LLM(one_kv_head_qwen3, load_format="dummy", tp_size=3, **ENGINE)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    from ostinato import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], load_format="dummy", tp_size=2, dtype="float32", max_total_tokens=4096,
                  device=sys.argv[2])
        worker = llm.engine.tp.procs[0].pid
        print("WORKER", worker, flush=True)
        threading.Timer(1.0, os.kill, (worker, signal.SIGKILL)).start()
        try:
            for _ in range(30):  # long enough that the kill comes mid-run, on a GPU too
                llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4,
                             SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
        except RuntimeError as e:
            print("RAISED", e, flush=True)
            sys.exit(3)
        print("FINISHED", flush=True)
""")


def _run_kill_script(tmp_path, model: str, device: str) -> subprocess.CompletedProcess:
    script = tmp_path / "kill_worker.py"
    script.write_text(KILL_SCRIPT)
    return subprocess.run([sys.executable, str(script), model, device], capture_output=True, text=True,
                          timeout=90, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_killing_a_worker_ends_the_run_with_a_clear_error(one_kv_head_qwen3, tmp_path):
    proc = _run_kill_script(tmp_path, one_kv_head_qwen3, "cpu")
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    assert "RAISED tensor-parallel worker rank 1" in proc.stdout and "died" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]
    worker = int(proc.stdout.split("WORKER")[1].split()[0])
    with pytest.raises(ProcessLookupError):  # reaped: no orphan left
        os.kill(worker, 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_matches_tp1_on_two_gpus(one_kv_head_qwen3):
    """NCCL and the one-shot all-reduce over symmetric memory (every all-reduce here is small), the all-reduce
    and all-gather captured inside the decode and extend graphs; fp32 so the split sums cannot flip a greedy
    pick. Dummy weights (the GPU machine has no SmolLM2 for the tiny Llama). One TP engine per process: a second
    could find the first's NCCL teardown left behind."""
    from ostinato.distributed.parallel_state import one_shot_all_reduce

    kw = {"device": "cuda", "cuda_graph_bs": [1, 2, 4, 8], "load_format": "dummy", "seed": 3}
    ref, llm1 = _run(one_kv_head_qwen3, 1, **kw)
    llm1.shutdown()
    got, llm2 = _run(one_kv_head_qwen3, 2, **kw)
    try:
        assert llm2.engine.runner.graph_runner is not None and llm2.engine.scheduler.num_retractions > 0
        one_shot = one_shot_all_reduce()  # rank 0's, in this process
        # captured in the decode graphs (a captured call counts once, at capture) and run by the extends
        assert one_shot is not None and one_shot.calls > 0
        assert got == ref
    finally:
        llm2.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_killing_a_worker_on_gpus_ends_the_process(one_kv_head_qwen3, tmp_path):
    """NCCL: rank 0's stream waits forever on the dead peer, so the process exits (status 1) with the error
    logged, or raises it first (status 3); either way within seconds, and no worker is left."""
    proc = _run_kill_script(tmp_path, one_kv_head_qwen3, "cuda")
    assert proc.returncode in (1, 3), proc.stdout + proc.stderr[-3000:]
    assert "tensor-parallel worker rank 1" in proc.stdout + proc.stderr
    worker = int(proc.stdout.split("WORKER")[1].split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)
