"""Our Llama / Qwen2 / Qwen3 against HF transformers, teacher-forced, fp32, through the paged cache."""

import pytest
import torch
import transformers

from ostinato.attention.forward_batch import ForwardMode
from ostinato.config import EngineArgs
from ostinato.engine.request import Request
from ostinato.engine.scheduler import ScheduledBatch
from ostinato.loader import load_model_source
from ostinato.runner.model_runner import ModelRunner
from ostinato.sampling_params import SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6)
CONFIGS = {
    "llama3-rope": transformers.LlamaConfig(
        **TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}, rope_theta=500000.0, tie_word_embeddings=True),
    "qwen2": transformers.Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen3": transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
}
ARCH = {"llama3-rope": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM}


def make_hf(name, tmp_path):
    torch.manual_seed(0)
    model = ARCH[name](CONFIGS[name]).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb so they are tested
        for pname, p in model.named_parameters():
            if "norm" in pname or "bias" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


def teacher_forced_logits(runner, seqs, prefill_lens):
    """Prefill each sequence's first `prefill_lens[i]` tokens in one extend batch (in two chunks), then
    decode the rest one token at a time; return logits for positions prefill_len-1 .. len-2."""
    reqs = []
    for i, seq in enumerate(seqs):
        req = Request(str(i), seq, SamplingParams(), seed=0)
        req.req_pool_idx = runner.req_to_token_pool.alloc()
        reqs.append(req)
    kv = runner.kv_manager
    logits = [[] for _ in seqs]

    def step(mode, new_lens):
        prefix = [r.kv_len for r in reqs]
        locs = [kv.extend(r.req_pool_idx, r.kv_len, r.kv_len + n) for r, n in zip(reqs, new_lens, strict=True)]
        for r, n in zip(reqs, new_lens, strict=True):
            r.kv_len += n
        sched = ScheduledBatch(mode, reqs, prefix, new_lens, torch.cat(locs), [True] * len(reqs))
        return runner.forward(runner.prepare(sched))

    half = [n // 2 for n in prefill_lens]
    step(ForwardMode.EXTEND, half)
    out = step(ForwardMode.EXTEND, [n - h for n, h in zip(prefill_lens, half, strict=True)])
    for i in range(len(seqs)):
        logits[i].append(out[i].clone())
    for _ in range(len(seqs[0]) - 1 - prefill_lens[0]):
        out = step(ForwardMode.DECODE, [1] * len(seqs))
        for i in range(len(seqs)):
            logits[i].append(out[i].clone())  # graph replay returns views of a static buffer
    for r in reqs:
        kv.release(r.req_pool_idx, r.kv_len)
    kv.check_all_free()
    return [torch.stack(x) for x in logits]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("page_size", [1, 8])
def test_teacher_forced_logits_match_transformers(name, page_size, tmp_path):
    hf = make_hf(name, tmp_path)
    args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=1024, page_size=page_size)
    runner = ModelRunner(args, load_model_source(args.model))
    # the (perturbed) norm weights now live in qkv_proj and gate_up_proj (layers/norm_linear.fold_norm_weight)
    for layer in runner.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            assert norm.weight_folded and torch.equal(norm.weight, torch.ones_like(norm.weight))
    gen = torch.Generator().manual_seed(1)
    total = 128  # past the llama3 original_max_position_embeddings (64), so the scaled bands matter
    seqs = [torch.randint(0, 256, (total,), generator=gen).tolist() for _ in range(3)]
    prefill = [70, 81, 90]
    # decode steps must line up: trim each sequence so all have the same number of decode tokens
    seqs = [s[: p + 10 + 1] for s, p in zip(seqs, prefill, strict=True)]
    ours = teacher_forced_logits(runner, seqs, prefill)
    with torch.no_grad():
        for seq, p, got in zip(seqs, prefill, ours, strict=True):
            ref = hf(torch.tensor([seq])).logits[0, p - 1 : len(seq) - 1]
            err = (got - ref).abs().max().item()
            assert err < 1e-4, f"{name}: max abs logit diff {err}"
