"""SmolLM2 (fp32 compute, torch backend) with an fp8 KV cache against the fp32 cache, teacher-forced; and
greedy tokens with page_size 16 against page_size 1."""

import pytest
import torch
from conftest import CHAT_PROMPTS

from ostinato import LLM, SamplingParams
from ostinato.attention.forward_batch import ForwardBatch, ForwardMode
from ostinato.attention.op import forward_context

NEW = 64


def engine(**kw) -> LLM:
    return LLM(dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=16, **kw)


@pytest.fixture(scope="module")
def teacher():
    """The page-1 fp32-cache engine and its greedy continuations of the 16 chat prompts."""
    llm = engine()
    outs = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    return llm, [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, seqs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Logits predicting each of the NEW continuation tokens, every sequence prefilled whole in one extend
    step (its own K/V stored in the cache and read back, as decode would)."""
    r = llm.engine.runner
    rows, locs, ids, pos, lens = [], [], [], [], []
    for prompt, out in seqs:
        full = list(prompt) + list(out)
        row = r.req_to_token_pool.alloc()
        locs.append(r.kv_manager.extend(row, 0, len(full)))
        rows.append(row)
        ids += full
        pos += range(len(full))
        lens.append(len(full))
    ends = torch.tensor(lens).cumsum(0)
    want = torch.cat([torch.arange(e - NEW - 1, e - 1) for e in ends.tolist()])
    batch = ForwardBatch(ForwardMode.EXTEND, len(rows), torch.tensor(ids), torch.tensor(pos), torch.tensor(rows),
                         torch.tensor(lens), torch.cat(locs), want, lens, [0] * len(rows), lens)
    try:
        with forward_context(r.backend, batch, r.model.attention_specs):
            r.backend.init_forward_metadata(batch)
            hidden = r.model(batch.input_ids, batch.positions)
        return r.model.compute_logits(hidden[want])
    finally:
        for row, n in zip(rows, lens, strict=True):
            r.kv_manager.release(row, n)


def test_fp8_kv_agrees_with_fp32_kv(teacher):
    llm, seqs = teacher
    ref = teacher_forced_logits(llm, seqs)
    fp8 = engine(kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.runner.kv_cache.k_buffer[0].dtype == torch.uint8
    got = teacher_forced_logits(fp8, seqs)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    diff = (ref - got).abs().max().item()
    print(f"\nfp8_e4m3 KV vs fp32 KV, teacher-forced top-1 over {ref.shape[0]} tokens: {agree:.2%} agree, "
          f"max |logit diff| {diff:.3f}")
    assert ref.shape[0] == 16 * NEW
    assert agree >= 0.97, (agree, diff)


def test_page_size_16_gives_page_size_1_tokens(teacher):
    _, seqs = teacher
    paged = engine(page_size=16)
    outs = paged.generate([{"prompt_token_ids": p} for p, _ in seqs[:8]],
                          SamplingParams(temperature=0.0, max_tokens=NEW // 2, ignore_eos=True), use_tqdm=False)
    for (_, want), o in zip(seqs, outs, strict=False):
        assert o.outputs[0].token_ids == list(want[: NEW // 2])
