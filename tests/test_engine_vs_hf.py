"""Greedy SmolLM2 through LLM.generate against transformers, token for token, with chunked prefill and
retraction forced by a small KV pool."""

import torch
from conftest import CHAT_PROMPTS

from ostinato import SamplingParams

NEW_TOKENS = 48  # 16 chats of ~35 prompt tokens + 48 outputs: past the 1024-slot pool, so retraction happens


def test_greedy_matches_transformers_with_retraction(llm, hf_model):
    """Each of our greedy tokens is transformers' argmax given the same prefix (one teacher-forced HF forward
    per sequence, rather than HF's token-by-token generate): identical to HF's greedy output unless a
    position is a near-tie, where either pick is right."""
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    retractions_before = llm.engine.scheduler.num_retractions
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > retractions_before, "the KV pool was meant to force retraction"
    near_ties, exact = 0, 0
    for conv, out in zip(convs, outs, strict=True):
        ids = tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        assert out.prompt_token_ids == ids
        ours = out.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS and out.outputs[0].finish_reason == "length"
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1]
        ref = logits.argmax(-1).tolist()
        if ours == ref:
            exact += 1
            continue
        for i in (j for j, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b):
            gap = (logits[i, ref[i]] - logits[i, ours[i]]).item()
            assert gap < 1e-3, f"token {i} is not transformers' argmax and not a near-tie (gap {gap:.2e})"
        near_ties += 1
    print(f"\n{exact}/{len(convs)} identical to transformers' greedy, {near_ties} differ only at near-ties")
    assert exact >= len(convs) // 2


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.stop_reason is None  # ended by EOS, which is not in the text


def test_teacher_forced_logits(llm, hf_model):
    """Our logits at every position of prompt + continuation against transformers' (fp32)."""
    from test_models import teacher_forced_logits

    tok = llm.get_tokenizer()
    gen = torch.Generator().manual_seed(0)
    seqs = [tok.encode(f"{p} Let me answer carefully and in detail.") for p in CHAT_PROMPTS[:3]]
    extra = [torch.randint(0, 49152, (24,), generator=gen).tolist() for _ in seqs]
    seqs = [s + e for s, e in zip(seqs, extra, strict=True)]
    prefill = [len(s) - 20 for s in seqs]
    ours = teacher_forced_logits(llm.engine.runner, seqs, prefill)
    worst = 0.0
    with torch.no_grad():
        for seq, p, got in zip(seqs, prefill, ours, strict=True):
            ref = hf_model(torch.tensor([seq])).logits[0, p - 1 : len(seq) - 1]
            worst = max(worst, (got - ref).abs().max().item())
    print(f"\nteacher-forced max abs logit difference vs transformers: {worst:.2e}")
    assert worst < 1e-3
