"""Structured outputs, prompt logprobs and logit_bias through the engine on CUDA, with decode graphs and overlap
scheduling on (the defaults there): the grammar masks are filled on the host and applied to the logits on the
device, prompt logprobs come from eager steps beside graphed ones, and biases ride in the fused sampler's inputs.

The GPU machines have no real checkpoint, so the model is a tiny random Llama saved with a byte-level BPE
tokenizer trained offline here (every byte is a token, so JSON and regexes are expressible). The reference for
prompt logprobs is transformers' float32 model on the CPU."""

import json
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CORPUS = ["the cat sat on the mat", '{"name": "Ada", "age": 36}', "yes no maybe", "(01) 234-5678",
          "apple banana cherry", "one two three four five six seven eight nine ten"] * 20


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny-bpe-llama"))
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(model_path):
    from ostinato import LLM

    return LLM(model_path, dtype="float32", device="cuda", max_total_tokens=4096, max_running_requests=16,
               cuda_graph_bs=[1, 2, 4, 8, 16], sampler_warm_up="temperature")


def test_structured_outputs_hold_on_cuda(llm):
    pytest.importorskip("xgrammar")  # (the GPU machines have it only where its wheel is carried)
    from ostinato import SamplingParams
    from ostinato.sampling_params import StructuredOutputsParams as S

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    phone = r"\(0[1-9]\) [0-9]{3}-[0-9]{4}"
    prompts = ["the cat", "yes", "apple", "one two", "the mat", "nine ten"]
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=S(choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=0.9, seed=3, max_tokens=24, structured_outputs=S(regex=phone)),
        # a random model left free to emit whitespace in JSON can spend all its tokens on it
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=S(json=schema, disable_any_whitespace=True)),
        SamplingParams(temperature=0.7, seed=1, max_tokens=64,
                       structured_outputs=S(json=schema, disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=12),  # unconstrained, beside the others
        SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=8,
                       structured_outputs=S(choice=["apple", "banana", "cherry"])),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    first = [o.outputs[0] for o in outs]
    assert first[0].text in ("yes", "no", "maybe") and first[0].finish_reason == "stop"
    assert re.fullmatch(phone, first[1].text) and first[1].finish_reason == "stop", first[1].text
    for o in first[2:4]:
        assert o.finish_reason == "stop", o.text
        obj = json.loads(o.text, strict=False)  # xgrammar's JSON strings admit control characters
        assert set(obj) == {"name", "age"} and 0 <= obj["age"] <= 99 and len(obj["name"]) <= 8
    alone = llm.generate([prompts[4]], params[4], use_tqdm=False)[0].outputs[0]
    assert first[4].token_ids == alone.token_ids  # the masks of other rows leave an unconstrained row alone
    assert all(c.text in ("apple", "banana", "cherry") for c in outs[5].outputs)
    assert not llm.engine.has_unfinished()


def test_prompt_logprobs_on_cuda_match_transformers(llm, model_path):
    import transformers

    from ostinato import SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 37, 120)]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    # a decoding request beside them, so prompt-logprob steps mix with graphed decode steps
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}] + [{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=40)] + [params] * 3, use_tqdm=False)
    worst = 0.0
    for ids, out in zip(prompts, outs[1:], strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            entry = out.prompt_logprobs[i]
            assert ids[i] in entry and len(entry) >= 2
            for t, lp in entry.items():
                worst = max(worst, abs(lp.logprob - ref[i - 1, t].item()))
    assert worst < 2e-3, worst  # float32 both sides; the GPU's GEMMs may use tf32-free cuBLAS sums in another order


def test_logit_bias_forces_and_bans_on_cuda(llm):
    from ostinato import SamplingParams

    plain = llm.generate(["the cat sat"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    banned = plain.outputs[0].token_ids[0]
    forced = 123 if banned != 123 else 124
    outs = llm.generate(["the cat sat"] * 3, [
        SamplingParams(temperature=0, max_tokens=6, logit_bias={banned: -100.0}),
        SamplingParams(temperature=0.8, seed=4, max_tokens=6, logit_bias={forced: 100.0}),
        SamplingParams(temperature=0, max_tokens=6),
    ], use_tqdm=False)
    assert banned not in outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == [forced] * 6
    assert outs[2].outputs[0].token_ids == plain.outputs[0].token_ids


def test_penalties_on_cuda_match_transformers(llm, model_path):
    """Presence, frequency and repetition penalties counted on the device (runner/penalties.py) and applied by the
    penalize kernel, in graphed decode steps under overlap scheduling, beside an unpenalized request: each greedy
    token is the argmax of transformers' teacher-forced logits after the same penalties (up to a near-tie)."""
    import transformers
    from transformers import RepetitionPenaltyLogitsProcessor

    from ostinato import SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    pen = [dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.5),
           dict(frequency_penalty=1.2, repetition_penalty=0.8)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **p) for p in pen]
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}] + [{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] + params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for prompt, p, out, unpenalized in zip(prompts, pen, outs[1:], plain, strict=True):
        got = out.outputs[0].token_ids
        assert got != unpenalized.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1]
        counts = torch.zeros(logits.shape[-1])
        for i, t in enumerate(got):
            x = RepetitionPenaltyLogitsProcessor(p["repetition_penalty"])(torch.tensor([prompt + got[:i]]),
                                                                          logits[i : i + 1].clone())[0]
            x = x - p["frequency_penalty"] * counts - p.get("presence_penalty", 0.0) * (counts > 0).float()
            assert x[t] >= x.max() - 2e-3, f"token {i}"
            counts[t] += 1
    assert not llm.engine.has_unfinished()


def test_sampler_warm_up_all_leaves_nothing_to_compile(model_path):
    """With --sampler-warm-up all, requests with every filter at every batch size compile no sampler kernel while
    they run (each such compile stalls every running request: seconds for a top_k search)."""
    from test_fused_sample import _compiled_kernels

    from ostinato import LLM, SamplingParams

    llm = LLM(model_path, dtype="float32", device="cuda", max_total_tokens=4096, max_running_requests=16,
              cuda_graph_bs=[1, 2, 4, 8, 16], sampler_warm_up="all")
    before = _compiled_kernels()
    filters = [dict(), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1, top_k=20, top_p=0.9), dict(min_p=0.05)]
    for n in (1, 3, 8, 13, 16):
        for f in filters:
            llm.generate(["the cat"] * n, SamplingParams(temperature=0.8, max_tokens=4, seed=1, **f), use_tqdm=False)
    assert _compiled_kernels() == before
    getattr(llm, "shutdown", lambda: None)()
