"""Overlap scheduling: the next step is scheduled and launched before the previous step's tokens are read
back. It must give exactly what waiting for every step gives (tokens, stops, logprobs, retraction, penalties)
and free all KV, including the KV of steps wasted on requests that stopped while they were in flight."""

import pytest
import torch
from conftest import CHAT_PROMPTS

from ostinato import LLM, SamplingParams
from ostinato.engine.request import PENDING_TOKEN, Request
from ostinato.runner.next_tokens import NextTokenBuffer


def test_pending_tokens_resolve_in_order_and_a_stop_drops_the_rest():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[42]), seed=0)
    for _ in range(3):
        req.add_pending()
    assert req.seq_len == 6 and req.token_at(4) == PENDING_TOKEN and req.can_sample_more
    req.resolve_pending(7)
    assert req.output_token_ids == [7, PENDING_TOKEN, PENDING_TOKEN] and req.finish_reason is None
    req.resolve_pending(42)  # a stop token: the step launched after it is dropped
    assert req.output_token_ids == [7, 42] and req.num_pending == 0
    assert req.finish_reason == "stop" and req.stop_reason == 42


def test_token_slice_equals_slicing_the_whole_sequence():
    req = Request("r", [5, 6, 7, 8], SamplingParams(max_tokens=10), seed=0)
    req.output_token_ids = [9, 10, 11]
    whole = req.all_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert req.token_slice(start, end) == whole[start:end], (start, end)


def test_max_tokens_counts_pending_outputs():
    req = Request("r", [1], SamplingParams(max_tokens=2), seed=0)
    req.add_pending()
    assert req.can_sample_more
    req.add_pending()
    assert not req.can_sample_more  # the scheduler launches no third step
    req.resolve_pending(5)
    req.resolve_pending(6)
    assert req.finish_reason == "length" and req.output_token_ids == [5, 6]


def test_next_token_buffer_resolves_only_pending_ids():
    gen = torch.Generator().manual_seed(3)
    buf = NextTokenBuffer(8, "cpu")
    slots = torch.randperm(8, generator=gen)[:5]
    sampled = torch.randint(0, 1000, (5,), generator=gen)
    buf.store_(slots, sampled)
    ids = torch.randint(0, 1000, (5,), generator=gen)
    pending = torch.tensor([True, False, True, True, False])
    ids[pending] = PENDING_TOKEN
    expect = torch.where(pending, sampled, ids)
    buf.resolve_(ids, slots)
    assert torch.equal(ids, expect)
    buf.store_(torch.tensor([buf.sink, buf.sink]), torch.tensor([1, 2]))  # the sink row absorbs non-samplers
    assert torch.equal(buf.tokens[slots], sampled)


@pytest.mark.parametrize("n", [1, 5, 300])
def test_begin_decode_kernel_equals_its_twin(n):
    """The decode step's bookkeeping (pending inputs resolved, new KV slots recorded) as one Triton launch (on
    the GPU, or through the interpreter on the CPU) against the torch ops CPU steps run: same ids, same table.
    Padded rows share the sink row, as a decode graph's do."""
    from ostinato.runner.next_tokens import launch_begin_decode

    gen = torch.Generator().manual_seed(n)
    rows, ctx = 400, 64
    buf = NextTokenBuffer(rows, "cpu")
    buf.tokens.copy_(torch.randint(0, 50_000, (rows + 1,), generator=gen))
    real = min(n, rows)
    slots = torch.cat([torch.randperm(rows, generator=gen)[: real - 1 if n > 1 else real],
                       torch.full((n - real + 1 if n > 1 else 0,), buf.sink)])  # the rest: padding, the sink row
    ids = torch.randint(0, 50_000, (n,), generator=gen)
    ids[torch.rand(n, generator=gen) < 0.5] = PENDING_TOKEN
    seq_lens = torch.randint(1, ctx + 1, (n,), generator=gen)
    seq_lens[slots == buf.sink] = 1
    loc = torch.randint(1, 10**6, (n,), generator=gen)
    loc[slots == buf.sink] = 0
    table = torch.randint(0, 10**6, (rows + 1, ctx), generator=gen, dtype=torch.int32)
    want_ids, want_table = ids.clone(), table.clone()
    buf.begin_decode_(want_ids, slots, seq_lens, loc, want_table)
    assert PENDING_TOKEN not in want_ids.tolist() and not torch.equal(want_table, table)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids, table = ids.to(dev), table.to(dev)
    launch_begin_decode(buf.tokens.to(dev), ids, slots.to(dev), seq_lens.to(dev), loc.to(dev), table)
    assert torch.equal(ids.cpu(), want_ids) and torch.equal(table.cpu(), want_table)


def test_tokens_arrive_one_step_later(llm):
    engine = llm.engine
    engine.add_request("late", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill's token is still in flight
    outs = engine.step()  # reads it back while the first decode runs
    assert [o.rid for o in outs] == ["late"] and len(outs[0].new_token_ids) == 1
    tokens = outs[0].new_token_ids
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 3


def small_pool_llm(path: str, **overlap) -> LLM:
    """The tiny Llama (conftest) in fp32 with a 640-token KV pool: 16 chats of 64-128 tokens each must retract."""
    return LLM(path, dtype="float32", device="cpu", max_total_tokens=640, chunked_prefill_size=48, page_size=4,
               max_running_requests=16, disable_radix_cache=True, **overlap)


@pytest.fixture(scope="module")
def overlap_llm(tiny_llama_path):
    return small_pool_llm(tiny_llama_path)


@pytest.fixture(scope="module")
def sync_llm(tiny_llama_path):
    return small_pool_llm(tiny_llama_path, disable_overlap_schedule=True)


def test_overlap_equals_waiting_for_every_step(overlap_llm, sync_llm):
    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    probe = sync_llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(probe):
        ids = out.outputs[0].token_ids
        kind = i % 4
        if kind == 0:  # greedy, stopped early by a token id that does occur
            params.append(SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[ids[20 + i % 9]]))
        elif kind == 1:  # seeded sampling with logprobs
            params.append(SamplingParams(temperature=0.8, top_p=0.9, max_tokens=112 + i, seed=i, logprobs=3,
                                         ignore_eos=True))
        elif kind == 2:  # penalties: these steps are read back at once
            params.append(SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                                         max_tokens=128, seed=100 + i, ignore_eos=True))
        else:  # a stop string (finished by the output processor, which aborts the request)
            text = out.outputs[0].text
            params.append(SamplingParams(temperature=0.0, max_tokens=64, stop=[text[len(text) // 2:][:6]]))
    results = {}
    for name, model in (("overlap", overlap_llm), ("sync", sync_llm)):
        before = model.engine.scheduler.num_retractions
        results[name] = model.chat(convs, params, use_tqdm=False)
        assert model.engine.scheduler.num_retractions > before, "the KV pool was meant to force retraction"
        model.engine.check_memory_leak()
    for a, b, p in zip(results["overlap"], results["sync"], params, strict=True):
        oa, ob = a.outputs[0], b.outputs[0]
        assert oa.token_ids == ob.token_ids
        assert (oa.finish_reason, oa.stop_reason) == (ob.finish_reason, ob.stop_reason)
        assert oa.text == ob.text
        if p.logprobs:
            for la, lb in zip(oa.logprobs, ob.logprobs, strict=True):
                assert la.keys() == lb.keys()
                for tok in la:
                    assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=1e-5)
    kinds = [r.outputs[0].finish_reason for r in results["overlap"]]
    assert "stop" in kinds and "length" in kinds
