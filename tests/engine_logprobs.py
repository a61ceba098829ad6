"""What the GPU tests of an opt-in decode kernel share: a random checkpoint of a benchmark model's layer shape with a
tokenizer built offline, and the check that each decode step's top logprobs with the kernel equal those without it
to bf16's rounding."""

import torch


def save_random_checkpoint(path, config_cls, model_cls, **dims) -> None:
    """A random-weight model of config_cls(**dims) and a small byte-level BPE tokenizer, saved under path."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the cat sat on the mat", "one two three four five"] * 10, vocab_size=300,
                            min_frequency=1, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    config = config_cls(vocab_size=len(tok), max_position_embeddings=2048, initializer_range=0.05,
                        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, **dims)
    torch.manual_seed(0)
    model_cls(config).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)


PROMPTS = [[5 + i, 17, 40 + 3 * i, 99, 7] * (1 + 20 * i) for i in range(4)]  # 5 to 305 tokens


def greedy_logprobs(llm) -> list:
    """Each prompt's completion (12 greedy tokens with their top-5 logprobs), one request at a time."""
    from ostinato import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def assert_logprobs_agree(off: list, on: list) -> None:
    """Each decode step's shared top-5 logprobs within 0.05, compared while the two runs' tokens agree (they part
    only at a near-tie), over at least 12 steps."""
    compared, worst = 0, 0.0
    for a_out, b_out in zip(off, on, strict=True):
        for step in range(1, len(a_out.token_ids)):  # step 0 is the prefill's
            if a_out.token_ids[:step] != b_out.token_ids[:step]:
                break
            a, b = a_out.logprobs[step], b_out.logprobs[step]
            shared = set(a) & set(b)
            assert len(shared) >= 4, (step, a, b)
            worst = max(worst, max(abs(a[t].logprob - b[t].logprob) for t in shared))
            compared += 1
    assert compared >= 12 and worst < 0.05, (compared, worst, off, on)
