"""GPU correctness at real shapes (dummy weights, bf16): graph replay vs eager, poisoned padding, and
logits vs transformers. Skipped without CUDA; run on the lent GPU with `pytest tests/test_gpu.py`."""

import contextlib
import dataclasses

import pytest
import torch
import transformers

from ostinato import LLM, SamplingParams
from ostinato.graphs.decode import PAD_SLOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=["llama-3.2-1b", "qwen3-0.6b"])
def gpu_llm(request):
    # no prefix cache: these tests repeat prompts and compare runs that must form identical batches
    llm = LLM(request.param, load_format="dummy", max_total_tokens=200_000, max_running_requests=64,
              cuda_graph_bs=[1, 2, 4, 8, 16, 32, 48, 64], disable_radix_cache=True, sampler_warm_up="temperature")
    yield llm
    del llm
    torch.cuda.empty_cache()


@contextlib.contextmanager
def _swapped(obj, name: str, value):
    """`obj.name` set to `value` inside the block, and back after it."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our fused q/k/v and gate/up weights split back into HF names."""
    out = {}
    for name, p in model.named_parameters():
        if "qkv_proj" in name:
            attn = model.layers[int(name.split(".")[1])].self_attn
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split([attn.q_size, attn.kv_size, attn.kv_size]),
                               strict=True):
                out["model." + name.replace("qkv_proj", part)] = t
        elif "gate_up_proj" in name:
            for part, t in zip(("gate_proj", "up_proj"), p.chunk(2), strict=True):
                out["model." + name.replace("gate_up_proj", part)] = t
        elif name.startswith("lm_head"):
            out[name] = p
        else:
            out["model." + name] = p
    return out


def test_replay_gives_the_eager_tokens(gpu_llm):
    from test_decode_graph import decode_batch, release

    runner = gpu_llm.engine.runner
    graphs = runner.graph_runner
    gen = torch.Generator().manual_seed(0)
    for bs in (1, 3, 32, 50):
        seqs = [torch.randint(0, runner.vocab_size, (int(n),), generator=gen).tolist()
                for n in torch.randint(2, 600, (bs,), generator=gen)]
        runner.graph_runner = None
        sched, reqs = decode_batch(runner, seqs)
        batch = runner.prepare(sched)
        eager = runner.forward(batch).clone()
        runner.graph_runner = graphs
        replayed = graphs.replay(batch).clone()
        assert torch.equal(eager.argmax(-1), replayed.argmax(-1)), f"bs {bs}: tokens differ"
        assert torch.equal(graphs.token_ids[:bs], replayed.argmax(-1)), f"bs {bs}: the graph's argmax differs"
        torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
        release(runner, reqs)


def test_extend_replay_matches_eager(gpu_llm):
    from test_decode_graph import release
    from test_extend_graph import extend_batch

    runner = gpu_llm.engine.runner
    graphs = runner.extend_graph_runner
    assert graphs is not None and graphs.max_tokens == 2048
    gen = torch.Generator().manual_seed(2)
    for lens, prefix in (([128], [0]), ([7, 300, 45], [0, 200, 0]), ([1000, 600, 33, 400], [0, 0, 64, 0])):
        prompts = [torch.randint(0, runner.vocab_size, (n + p,), generator=gen).tolist()
                   for n, p in zip(lens, prefix, strict=True)]
        sched, reqs = extend_batch(runner, prompts, prefix)
        batch = runner.prepare(sched)
        assert graphs.can_run(batch)
        k_before = runner.kv_cache.get_kv_buffer(3)[0].clone()
        runner.extend_graph_runner = None
        eager = runner.forward(batch).clone()
        k_eager = runner.kv_cache.get_kv_buffer(3)[0].clone()
        runner.kv_cache.get_kv_buffer(3)[0].copy_(k_before)
        runner.extend_graph_runner = graphs
        replayed = graphs.replay(batch).clone()
        assert torch.equal(eager.argmax(-1), replayed.argmax(-1)), f"{lens}: tokens differ"
        torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(runner.kv_cache.get_kv_buffer(3)[0][PAD_SLOT + 1 :], k_eager[PAD_SLOT + 1 :],
                                   atol=2e-2, rtol=2e-2)
        release(runner, reqs)


def test_poisoned_padding_never_changes_real_rows(gpu_llm):
    from test_decode_graph import decode_batch, release

    runner = gpu_llm.engine.runner
    graphs = runner.graph_runner
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (12, 400, 7, 2500, 3)]
    sched, reqs = decode_batch(runner, seqs)
    batch = runner.prepare(sched)
    clean = graphs.replay(batch).clone()
    fill = graphs._fill_padding

    def poisoned(start, stop):
        fill(start, stop)
        graphs.input_ids[start:stop] = torch.randint(0, runner.vocab_size, (stop - start,), device="cuda")
        graphs.positions[start:stop] = torch.randint(0, 4000, (stop - start,), device="cuda")
        for layer in range(runner.kv_cache.layer_num):
            for buf in runner.kv_cache.get_kv_buffer(layer):
                buf[PAD_SLOT].normal_(0, 100.0)

    graphs._fill_padding = poisoned
    try:
        torch.testing.assert_close(graphs.replay(batch), clean, atol=0, rtol=0)
    finally:
        graphs._fill_padding = fill
    release(runner, reqs)


def test_logits_match_transformers_teacher_forced(gpu_llm):
    """bf16 against transformers: our error to HF's fp32 logits must be no larger than HF's own bf16 error
    (random weights compound rounding through the layers, so a fixed threshold would test the weights)."""
    from test_models import teacher_forced_logits

    runner = gpu_llm.engine.runner
    weights = hf_state_dict(runner.model)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(runner.config, dtype=torch.bfloat16).eval()
        hf32 = transformers.AutoModelForCausalLM.from_config(runner.config, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    hf32.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, runner.vocab_size, (300,), generator=gen).tolist() for _ in range(3)]
    ours = teacher_forced_logits(runner, seqs, [280, 280, 280])  # chunked extend, then 19 decode steps (graphs)
    agree, hf_agree = [], []
    with torch.no_grad():
        for seq, got in zip(seqs, ours, strict=True):
            ids = torch.tensor([seq], device="cuda")
            ref = hf(ids).logits[0, 279:299].float()
            ref32 = hf32(ids).logits[0, 279:299].float()
            ours_err = ((got - ref32).norm() / ref32.norm()).item()
            hf_err = ((ref - ref32).norm() / ref32.norm()).item()
            agree += (got.argmax(-1) == ref32.argmax(-1)).tolist()
            hf_agree += (ref.argmax(-1) == ref32.argmax(-1)).tolist()
            print(f"\n{runner.config.architectures[0]}: error vs HF fp32 {ours_err:.2e} (HF bf16: {hf_err:.2e}), "
                  f"top-1 agreement {sum(agree[-20:]) / 20:.2f} (HF bf16: {sum(hf_agree[-20:]) / 20:.2f})")
            assert ours_err <= 1.25 * hf_err + 1e-3
    # random weights give near-flat logits, so some top-1s are near ties that any bf16 rounding flips:
    # over the 60 positions ours must agree with fp32 about as often as transformers' bf16 does
    ours_rate, hf_rate = sum(agree) / len(agree), sum(hf_agree) / len(hf_agree)
    assert ours_rate >= min(0.9, hf_rate) - 0.05, (ours_rate, hf_rate)


def test_generate_with_graphs_equals_eager(gpu_llm):
    runner = gpu_llm.engine.runner
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, runner.vocab_size, (int(n),), generator=gen).tolist()}
               for n in torch.randint(5, 300, (24,), generator=gen)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    graphed = [o.outputs[0].token_ids for o in gpu_llm.generate(prompts, sp, use_tqdm=False)]
    with _swapped(runner, "graph_runner", None):
        eager = [o.outputs[0].token_ids for o in gpu_llm.generate(prompts, sp, use_tqdm=False)]
    assert graphed == eager


def test_overlap_schedule_equals_waiting_for_every_step(gpu_llm):
    """On the GPU the next step really is launched before the last one's tokens reach the host: the pending
    inputs must come from the device buffer, never from stale host state. Requests end by length only, so
    both runs form the same batches (a stop seen late would keep a request one wasted step longer, which
    changes batch sizes and so bf16 GEMM rounding); stops under overlap are checked on their own."""
    engine = gpu_llm.engine
    gen = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(0, engine.runner.vocab_size, (int(n),), generator=gen).tolist()}
               for n in torch.randint(5, 300, (24,), generator=gen)]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_k=50, max_tokens=30 + i, seed=i, logprobs=2, ignore_eos=True)
              for i in range(len(prompts))]
    overlapped = gpu_llm.generate(prompts, params, use_tqdm=False)
    with _swapped(engine, "args", dataclasses.replace(engine.args, disable_overlap_schedule=True)):
        waited = gpu_llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(overlapped, waited, strict=True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i}"
    stops = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[o.outputs[0].token_ids[10 + i % 9]])
             for i, o in enumerate(overlapped)]
    stopped = gpu_llm.generate(prompts, stops, use_tqdm=False)
    for out, sp in zip(stopped, stops, strict=True):
        ids = out.outputs[0].token_ids
        if out.outputs[0].finish_reason == "stop":
            assert ids[-1] == sp.stop_token_ids[0] and sp.stop_token_ids[0] not in ids[:-1]
        else:
            assert len(ids) == 40 and sp.stop_token_ids[0] not in ids
    assert any(o.outputs[0].finish_reason == "stop" for o in stopped)
    engine.check_memory_leak()


def test_decode_graph_draws_temperature_only_steps(gpu_llm, monkeypatch):
    """Temperature-only decode steps (greedy rows beside, logprobs on some rows) are drawn inside the decode graph:
    no sampler graph replays. Their tokens and logprobs equal the sampler graph's draws from the same graph's logits
    (`SamplingTensors.plain_draw` off: the graph takes the argmax and the sampler graph draws after it), with the
    batch shrinking as its requests finish."""
    from ostinato.runner.sampler import SamplingTensors

    runner = gpu_llm.engine.runner
    sampler_graphs = runner.sample_graph_runner
    gen = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(0, runner.vocab_size, (int(n),), generator=gen).tolist()}
               for n in torch.randint(5, 200, (20,), generator=gen)]
    params = [SamplingParams(temperature=0.3 + 0.1 * i, seed=i, max_tokens=4 + i, ignore_eos=True,
                             logprobs=2 if i % 5 == 1 else None) if i % 4 else
              SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    replays = []
    replay = sampler_graphs.replay
    monkeypatch.setattr(sampler_graphs, "replay", lambda *a, **k: replays.append(a[0]) or replay(*a, **k))
    in_graph = gpu_llm.generate(prompts, params, use_tqdm=False)
    assert replays == []
    monkeypatch.setattr(SamplingTensors, "plain_draw", property(lambda self: False))
    after_graph = gpu_llm.generate(prompts, params, use_tqdm=False)
    assert len(set(replays)) > 3, "the sampler graphs drew the steps, at several batch sizes"
    for i, (a, b) in enumerate(zip(in_graph, after_graph, strict=True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i}"
        assert a.outputs[0].logprobs == b.outputs[0].logprobs, f"request {i}"
    gpu_llm.engine.check_memory_leak()


def test_sampler_graphs_draw_what_eager_sampling_draws(gpu_llm):
    """Sampled decode steps replayed from the sampler graphs (graphs/sample.py) against the same kernels launched
    eagerly: temperature, top_k, top_p, min_p and logprobs mixed, requests finishing at different steps (so the
    batch shrinks and its sampling inputs are reloaded), equal token for token."""
    runner = gpu_llm.engine.runner
    assert runner.sample_graph_runner is not None
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, runner.vocab_size, (int(n),), generator=gen).tolist()}
               for n in torch.randint(5, 300, (24,), generator=gen)]
    params = [SamplingParams(temperature=0.4 + 0.05 * i, top_k=[0, 20, 200][i % 3], top_p=[1.0, 0.9][i % 2],
                             min_p=0.02 if i % 5 == 0 else 0.0, seed=i, max_tokens=12 + i, ignore_eos=True,
                             logprobs=2 if i % 7 == 0 else None) if i % 4 else
              SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True) for i in range(len(prompts))]
    runner.sample_graph_runner.graphs.clear()
    graphed = gpu_llm.generate(prompts, params, use_tqdm=False)
    keys = set(runner.sample_graph_runner.graphs)
    assert any(k.top_k and k.top_p and k.min_p for k in keys) and len({k.batch_size for k in keys}) > 3, keys
    with _swapped(runner, "sample_graph_runner", None):
        eager = gpu_llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i}"
        assert a.outputs[0].logprobs == b.outputs[0].logprobs, f"request {i}"
