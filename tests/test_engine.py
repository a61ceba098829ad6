"""Engine behaviour on SmolLM2 (CPU): stops, seeds, abort, bad input."""

import json

import pytest

from ostinato import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def chat(llm, text, params=GREEDY):
    return llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0].outputs[0]


def test_stop_string_across_tokens_is_excluded(llm):
    full = chat(llm, "Write a short poem about the sea.", SamplingParams(temperature=0.0, max_tokens=40))
    assert len(full.text) > 20
    stop = full.text[10:16]  # six characters: usually spans a token boundary
    out = chat(llm, "Write a short poem about the sea.",
               SamplingParams(temperature=0.0, max_tokens=40, stop=[stop, "zzzz-never"]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_stop_token_ids_and_length(llm):
    full = chat(llm, "Why is the sky blue?", SamplingParams(temperature=0.0, max_tokens=20))
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_id = full.token_ids[7]
    first = full.token_ids.index(stop_id)
    out = chat(llm, "Why is the sky blue?", SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: first + 1]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_path):
    """The tiny Llama (conftest) at the session `llm`'s settings: for properties of the engine, not the model."""
    return LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=1024, chunked_prefill_size=48,
               page_size=4, max_running_requests=16, disable_radix_cache=True)


def test_seeded_sampling_is_reproducible_across_batches_and_retraction(tiny_llm):
    llm = tiny_llm
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=32, seed=1234, ignore_eos=True)
    alone = chat(llm, "Tell me a story about a dragon.", sp).token_ids
    # same request inside a crowd big enough to force retraction, at a different batch position
    crowd = [[{"role": "user", "content": f"Count to {i} slowly and explain."}] for i in range(12)]
    crowd.insert(5, [{"role": "user", "content": "Tell me a story about a dragon."}])
    before = llm.engine.scheduler.num_retractions
    params = [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)] * 13
    params[5] = sp
    outs = llm.chat(crowd, params, use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > before
    assert outs[5].outputs[0].token_ids == alone
    other = chat(llm, "Tell me a story about a dragon.",
                 SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=32, seed=99, ignore_eos=True))
    assert other.token_ids != alone
    assert not llm.engine.has_unfinished()
    llm.engine.check_memory_leak()


def test_n_samples_with_seed(llm):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = llm.generate("The best thing about mornings is", sp, use_tqdm=False)[0]
    b = llm.generate("The best thing about mornings is", sp, use_tqdm=False)[0]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_abort_mid_decode_frees_kv_and_others_finish(llm):
    engine = llm.engine
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"abort-{i}", tok.encode(f"Request number {i} says hello"), sp)
    finished = {}
    for step in range(200):
        for out in engine.step():
            if out.finish_reason:
                finished[out.rid] = out.finish_reason
        if step == 5:
            engine.abort("abort-2")
            engine.abort("abort-2")  # twice is harmless
        if not engine.has_unfinished():
            break
    assert finished == {"abort-0": "length", "abort-1": "length", "abort-2": "abort", "abort-3": "length"}


def test_abort_waiting_request(llm):
    engine = llm.engine
    engine.add_request("waiting-1", [1, 2, 3], GREEDY)
    engine.abort("waiting-1")
    assert [o.finish_reason for o in engine.step()] == ["abort"]


BAD_INPUTS = [
    ("", GREEDY, "prompt"),
    ({"prompt_token_ids": []}, GREEDY, "prompt"),
    ("hello", SamplingParams(max_tokens=10**6), "max_tokens"),
    ({"prompt_token_ids": [1, 49152]}, GREEDY, "prompt_token_ids"),
    ({"prompt_token_ids": [-1]}, GREEDY, "prompt_token_ids"),
    ("hello \ud800", GREEDY, "prompt: not valid Unicode"),  # a lone surrogate: no tokenizer takes it
    ({"prompt": "x\udc00"}, GREEDY, "prompt: not valid Unicode"),
    ("hello", SamplingParams(max_tokens=2, logit_bias={49152: 5.0}), "logit_bias: token id 49152 is outside"),
]


@pytest.mark.parametrize("prompt,params,field", BAD_INPUTS)
def test_bad_input_names_the_field_and_changes_nothing(llm, prompt, params, field):
    good = {"prompt_token_ids": [1, 2, 3, 4]}
    free_before = llm.engine.runner.allocator.available_pages()
    with pytest.raises(ValueError, match=field):
        llm.generate([good, prompt], params, use_tqdm=False)  # the good one is not queued either
    assert not llm.engine.has_unfinished()
    assert llm.engine.runner.allocator.available_pages() == free_before
    still = SamplingParams(temperature=0.0, max_tokens=2)  # the engine still serves (a short run says so)
    assert llm.generate(good, still, use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(min_p=1.5), "min_p"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_path_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM("/no/such/model")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["FooForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128}))
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="page_size"):
        LLM(str(tmp_path), load_format="dummy", page_size=0)


@pytest.mark.parametrize("messages,fragment", [
    ([], "messages: must not be empty"),
    ("hello", "messages: expected a list"),
    ([{"role": "user"}], "messages[0].content: missing"),
    ([{"content": "hi"}], "messages[0].role: missing"),
    ([{"role": "banana", "content": "hi"}], "messages[0].role: unknown role 'banana'"),
    ([{"role": "user", "content": 5}], "messages[0].content: expected a string"),
    ([[{"role": "user", "content": "hi"}], []], "messages[1]: must not be empty"),
    ([{"role": "user", "content": "a\ud800"}], "messages[0].content: not valid Unicode"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], "messages[0].content[0].text: not valid"),
])
def test_chat_bad_messages_raise_value_error(llm, messages, fragment):
    with pytest.raises(ValueError) as e:
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert fragment in str(e.value)


def test_generate_prompts_of_the_wrong_type(llm):
    for bad in (5, None, b"hi"):
        with pytest.raises(ValueError, match="prompts: expected a prompt"):
            llm.generate(bad, GREEDY, use_tqdm=False)


def test_generate_sampling_params_of_the_wrong_type(llm):
    with pytest.raises(ValueError, match=r"sampling_params: expected a SamplingParams .* got dict"):
        llm.generate(["hi"], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: expected"):
        llm.generate(["hi"], [{"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature must be finite"):
        llm.generate(["hi"], SamplingParams(temperature=float("inf")), use_tqdm=False)


def test_logit_bias_through_the_engine(llm):
    """logit_bias in a batch beside requests without one: a banned token never comes (greedy picks the runner-up
    each step), a forced one always does, and the unbiased request gives its usual tokens."""
    prompt = {"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    banned = sorted(set(plain[:8]))
    ban = SamplingParams(temperature=0.0, max_tokens=24, logit_bias={t: -100.0 for t in banned})
    force = SamplingParams(temperature=0.7, max_tokens=8, seed=3, logit_bias={1234: 100.0})
    outs = llm.generate([prompt, prompt, prompt], [ban, force, GREEDY], use_tqdm=False)
    assert not set(outs[0].outputs[0].token_ids) & set(banned), (banned, outs[0].outputs[0].token_ids)
    assert outs[1].outputs[0].token_ids == [1234] * 8
    assert outs[2].outputs[0].token_ids == plain
