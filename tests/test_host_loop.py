"""The engine's per-step host shortcuts give what the general paths give: the page-1 decode slot allocation, and the
sampling inputs reused between decode steps of the same rows."""

import random
from types import SimpleNamespace

import torch
from batch_helpers import record_slots

from ostinato import LLM, SamplingParams
from ostinato.mem.kv_manager import KVManager
from ostinato.mem.req_to_token_pool import ReqToTokenPool
from ostinato.mem.token_allocator import TokenToKVPoolAllocator


def kv_manager() -> KVManager:
    return KVManager(ReqToTokenPool(6, 64, "cpu"), TokenToKVPoolAllocator(300, 1, "cpu"))


def test_page1_decode_slots_match_the_general_path():
    short, general = kv_manager(), kv_manager()
    rng = random.Random(3)
    rows = [short.req_pool.alloc() for _ in range(5)]
    assert [general.req_pool.alloc() for _ in range(5)] == rows  # the same rows and prompts in both
    lens = [rng.randint(1, 20) for _ in rows]
    for m in (short, general):
        assert m.extend_batch(rows, [0] * 5, lens) is not None
    for _ in range(4):
        picked = sorted(rng.sample(rows, 3))
        at = [lens[rows.index(r)] for r in picked]
        a = short.extend_decode(picked, at)
        record_slots(short, picked, at, a)
        b = general.extend_batch(picked, at, [n + 1 for n in at])
        assert torch.equal(a, b)
        for r in picked:
            lens[rows.index(r)] += 1
    assert torch.equal(short.req_pool.req_to_token, general.req_pool.req_to_token)
    assert short.allocator.available_pages() == general.allocator.available_pages()
    m = kv_manager()  # short of pages: nothing taken
    free = m.allocator.available_pages()
    assert m.extend_decode([m.req_pool.alloc() for _ in range(3)], [0, 0, 0]) is not None
    m.allocator.alloc_pages(m.allocator.available_pages())
    assert m.extend_decode([0, 1], [1, 1]) is None and m.allocator.available_pages() == 0
    assert free > 0


def req(params: SamplingParams, outputs: int, seed: int = 1):
    return SimpleNamespace(params=params, seed=seed, output_token_ids=[5] * outputs, grammar=None)


def test_sampling_inputs_reused_only_for_the_same_rows(tiny_llama_path):
    llm = LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=256)
    runner = llm.engine.runner
    hot = SamplingParams(temperature=0.7, top_p=0.9)
    rows = [req(hot, 3, seed=11), req(SamplingParams(temperature=0), 5), req(SamplingParams(temperature=1.0,
                                                                                             top_k=4), 1, seed=7)]
    first = runner._sampling_tensors(rows)
    for r in rows:
        r.output_token_ids.append(9)
    again = runner._sampling_tensors(list(rows))  # the same requests in the same order: only the steps move
    assert again.temperatures is first.temperatures and again.seeds is first.seeds
    assert again.steps.tolist() == [4, 6, 2] and first.steps.tolist() == [3, 5, 1]
    fresh = type(first).from_params([r.params for r in rows], [r.seed for r in rows],
                                    [len(r.output_token_ids) for r in rows], runner.vocab_size, runner.device)
    for name in ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "steps"):
        assert torch.equal(getattr(again, name), getattr(fresh, name)), name
    swapped = runner._sampling_tensors([rows[1], rows[0], rows[2]])  # another order: built anew
    assert swapped.temperatures is not first.temperatures
    assert swapped.temperatures.tolist() == [0.0, 0.699999988079071, 1.0]
    penalized = [SimpleNamespace(**vars(req(SamplingParams(temperature=0.5, presence_penalty=0.5), 2)),
                                 req_pool_idx=3, prompt_token_ids=[1, 2])]
    runner.penalties.reset_rows(penalized)  # (an extend step's prepare): the row counts the two 5s
    slots = torch.tensor([3])
    a = runner._sampling_tensors(penalized, slots=slots)
    assert a.count_rows is slots and a.output_counts[3, 5].item() == 2 and a.output_counts[3].sum().item() == 2
    runner.penalties.count_(slots, torch.tensor([7]))  # what the step's sampling adds on the device
    penalized[0].output_token_ids.append(7)
    later = torch.tensor([3])
    b = runner._sampling_tensors(penalized, slots=later)  # reused, reading this step's slots
    assert b.presence_penalties is a.presence_penalties and b.count_rows is later
    assert b.output_counts[3, 7].item() == 1
    greedy = [req(SamplingParams(temperature=0), 1)]
    assert runner._sampling_tensors(greedy) is runner._sampling_tensors(greedy)  # nothing depends on the step
