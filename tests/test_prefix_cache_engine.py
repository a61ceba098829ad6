"""Prefix caching on a tiny Llama with SmolLM2's tokenizer (fp32, CPU): greedy outputs with the cache equal
those without it, through shared system prompts, multi-turn chats, eviction, retraction and aborts in the middle
of shared prefixes; afterwards every KV slot is free or held, unlocked, by the tree."""

import contextlib

import pytest

from ostinato import LLM, SamplingParams
from ostinato.engine.prefix_cache import PrefixCache

SYSTEMS = [
    "You are a helpful assistant who answers in one short sentence.",
    "You are a pirate. Always answer like a pirate would, with lots of arrr.",
    "You are a careful math tutor. Explain each step of the reasoning briefly and clearly.",
]
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name a fruit.", "How do birds fly?",
             "What is two plus two?", "Tell me a joke.", "What is rain?", "Who wrote Hamlet?",
             "What is a cat?", "Describe the moon.", "What is music?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    """Overrides conftest's SmolLM2 `llm` with the tiny Llama at the same settings (its leak check applies)."""
    return LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=1024, chunked_prefill_size=48,
               page_size=4, max_running_requests=16, disable_radix_cache=True)


@contextlib.contextmanager
def cache_mode(llm, enabled: bool):
    """The shared engine with a fresh prefix cache on or off (its own cache restored, emptied, after)."""
    sched = llm.engine.scheduler
    own = sched.cache
    if own.tree is not None:
        own.tree.evict(1 << 30)  # start from an empty tree: every page free
    sched.cache = PrefixCache(sched.kv, enabled=enabled)
    try:
        yield sched.cache
    finally:
        assert not llm.engine.has_unfinished()
        llm.engine.check_memory_leak()
        if sched.cache.tree is not None:
            sched.cache.tree.evict(1 << 30)
        sched.cache = own


def workload(llm) -> tuple[dict, int]:
    """Outputs (token ids by name) of: 32 requests over three system prompts, 4 chats of 3 turns whose prompts
    reuse the whole earlier turns, and requests aborted in the middle of a shared prefix's prefill."""
    tok = llm.get_tokenizer()
    out = {}
    shared = [{"prompt_token_ids": tok.encode(SYSTEMS[i % 3] + " " + QUESTIONS[i % len(QUESTIONS)])}
              for i in range(32)]
    for i, r in enumerate(llm.generate(shared, GREEDY, use_tqdm=False)):
        out[f"shared-{i}"] = r.outputs[0].token_ids
    chats = [tok.encode(SYSTEMS[i % 3] + " User: " + QUESTIONS[i]) for i in range(4)]
    hits = 0
    for turn in range(3):
        res = llm.generate([{"prompt_token_ids": c} for c in chats], GREEDY, use_tqdm=False)
        for i, r in enumerate(res):
            out[f"chat-{i}-{turn}"] = r.outputs[0].token_ids
            hits += r.num_cached_tokens or 0
            chats[i] = chats[i] + r.outputs[0].token_ids + tok.encode(f" User: tell me more about turn {turn}.")
    # pressure: distinct prompts whose outputs outgrow the 1024-token pool after admission (retraction),
    # while the tree holds the earlier stages' tokens (eviction)
    distinct = [{"prompt_token_ids": tok.encode(f"Request {i}. " + " ".join(QUESTIONS[i:] + QUESTIONS[:i]) * 2)}
                for i in range(10)]
    for i, r in enumerate(llm.generate(distinct, GREEDY, use_tqdm=False)):
        out[f"distinct-{i}"] = r.outputs[0].token_ids
    engine = llm.engine
    long_system = tok.encode(" ".join(SYSTEMS) * 2)
    for i in range(6):
        engine.add_request(f"ab-{i}", long_system + tok.encode(QUESTIONS[i]), GREEDY)
    for step in range(400):
        for o in engine.step():
            if o.rid.startswith("ab-") and o.rid not in ("ab-1", "ab-4"):
                out.setdefault(o.rid, []).extend(o.new_token_ids)
        if step == 2:  # chunks of 48: both are still prefilling the shared system prompt
            engine.abort("ab-1")
            engine.abort("ab-4")
        if not engine.has_unfinished():
            break
    return out, hits


def test_outputs_with_prefix_cache_equal_outputs_without(llm):
    sched = llm.engine.scheduler
    with cache_mode(llm, enabled=False):
        ref, _ = workload(llm)
    retractions = sched.num_retractions
    with cache_mode(llm, enabled=True) as cache:
        got, chat_hits = workload(llm)
        assert sched.num_retractions > retractions, "the pool was sized to force retraction"
        assert cache.tree.num_evicted > 0, "the pool was sized to force eviction"
        assert cache.hit_tokens > 0 and chat_hits > 0
        assert cache.tree.total_size() > 0
    assert got.keys() == ref.keys()
    bad = [k for k in ref if got[k] != ref[k]]
    assert not bad, f"outputs differ with the prefix cache: {bad}"


def test_full_prompt_hit_recomputes_the_last_token(llm):
    """A prompt cached whole still computes its last token (logits need it); num_cached_tokens reports it."""
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog again and again.")
    with cache_mode(llm, enabled=True):
        first = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
        second = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    page = llm.engine.runner.kv_manager.page_size
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens == (len(ids) - 1) // page * page > 0


def test_reset_prefix_cache_empties_the_tree(llm):
    """reset_prefix_cache drops every cached prefix: the next run of the same prompt hits nothing, gives the same
    tokens, and every page is free again; while a request is unfinished it refuses and drops nothing."""
    ids = llm.get_tokenizer().encode("A reset cache forgets every prompt it has seen so far, and starts over.")
    with cache_mode(llm, enabled=True):
        first = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
        cache = llm.engine.scheduler.cache
        assert cache.evictable_tokens() > 0
        llm.engine.add_request("pending", ids, GREEDY)
        assert llm.reset_prefix_cache() is False and cache.evictable_tokens() > 0
        llm.engine.abort("pending")
        assert llm.reset_prefix_cache() is True and cache.evictable_tokens() == 0
        alloc = llm.engine.runner.kv_manager.allocator
        assert alloc.available_pages() == alloc.num_pages - 1
        again = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_schedule_policy_flag(policy):
    from ostinato.config import EngineArgs

    assert EngineArgs(schedule_policy=policy).schedule_policy == policy
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineArgs(schedule_policy="random")
