"""Presence/frequency penalties and logprobs: the batched sampler against straightforward per-row
references on a toy vocabulary, and the engine's output against teacher-forced logits (transformers)."""

import functools
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from ostinato import SamplingParams
from ostinato.runner.penalties import PenaltyState
from ostinato.runner.sampler import SamplingTensors, adjust_logits, compute_logprobs, sample_batch, token_counts

V = 11


def ref_penalize(logits: list[float], outputs: list[int], presence: float, frequency: float) -> list[float]:
    counts = Counter(outputs)
    return [x - frequency * counts[t] - (presence if counts[t] else 0.0) for t, x in enumerate(logits)]


def toy_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, V, generator=g) * 2
    outputs = [[1, 1, 3], [], [0, 10, 10, 10, 2, 1], [4], [7, 7]]
    params = [
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=1.0),
        SamplingParams(temperature=0, frequency_penalty=2.0),
        SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=0.3),
        SamplingParams(temperature=0),  # no penalty in a penalized batch
        SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=-2.0),
    ]
    return logits, outputs, params


def tensors(params, outputs, **kw):
    return SamplingTensors.from_params(params, list(range(len(params))), [len(o) for o in outputs], V, "cpu",
                                       output_token_ids=outputs, **kw)


def test_token_counts_match_counter():
    outputs = [[1, 1, 3], [], [10, 10, 0]]
    counts = token_counts(outputs, V)
    assert counts.shape == (3, V)
    for row, out in zip(counts.tolist(), outputs, strict=True):
        assert row == [float(Counter(out)[t]) for t in range(V)]


def test_penalties_match_reference():
    logits, outputs, params = toy_batch()
    got = adjust_logits(logits, tensors(params, outputs))
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        ref = ref_penalize(logits[i].tolist(), out, p.presence_penalty, p.frequency_penalty)
        assert got[i].tolist() == pytest.approx(ref, abs=1e-6)
    # greedy sampling picks the argmax of the penalized logits
    ids = sample_batch(logits, tensors(params, outputs)).token_ids
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        ref = ref_penalize(logits[i].tolist(), out, p.presence_penalty, p.frequency_penalty)
        assert ids[i] == max(range(V), key=lambda t: ref[t])


def ref_repetition(logits: list[float], prompt: list[int], outputs: list[int], penalty: float) -> list[float]:
    seen = set(prompt) | set(outputs)
    return [(x / penalty if x > 0 else x * penalty) if t in seen else x for t, x in enumerate(logits)]


def test_repetition_penalty_matches_reference():
    logits, outputs, _ = toy_batch(2)
    prompts = [[2, 3], [5, 1], [], [9, 9, 4], [0]]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0, repetition_penalty=0.8, presence_penalty=0.5),
        SamplingParams(temperature=0),  # none in a batch that has them
        SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.4),
        SamplingParams(temperature=0, repetition_penalty=1.1, frequency_penalty=-0.3),
    ]
    t = tensors(params, outputs, prompt_token_ids=prompts)
    got = adjust_logits(logits, t)
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        ref = ref_repetition(logits[i].tolist(), prompts[i], out, p.repetition_penalty)
        ref = ref_penalize(ref, out, p.presence_penalty, p.frequency_penalty)
        assert got[i].tolist() == pytest.approx(ref, abs=1e-6)
        assert got[i].tolist() != pytest.approx(logits[i].tolist(), abs=1e-6) or p == SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tensors(params, outputs)


def penalized_request(slot: int, params: SamplingParams, outputs: list[int], prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(req_pool_idx=slot, params=params, output_token_ids=outputs, prompt_token_ids=prompt)


def test_penalty_state_rows_follow_resets_and_counted_draws():
    """The device counts (runner.penalties) equal counts from the host's lists: set at a request's extend, then
    grown by each step's draws (the sink row takes dropped rows' tokens); a slot's next request starts afresh."""
    state = PenaltyState(num_slots=4, vocab_size=V, device=torch.device("cpu"))
    a = penalized_request(1, SamplingParams(presence_penalty=1.0), [3, 3, 7], [1])
    b = penalized_request(2, SamplingParams(repetition_penalty=1.2), [], [4, 4, 9])
    state.reset_rows([a, b])
    assert state.in_prompt is not None
    state.count_(torch.tensor([1, 2, 4, 4]), torch.tensor([7, 0, 5, 5]))  # slot 4: the sink
    assert state.counts[[1, 2]].tolist() == token_counts([[3, 3, 7, 7], [0]], V).tolist()
    assert state.in_prompt[[1, 2]].tolist() == (token_counts([[], [4, 4, 9]], V) > 0).tolist()  # a: no repetition
    c = penalized_request(1, SamplingParams(repetition_penalty=0.9), [2], [6, 10])  # slot 1's next request
    state.reset_rows([c])
    assert state.counts[[1, 2]].tolist() == token_counts([[2], [0]], V).tolist()
    assert state.in_prompt[[1, 2]].tolist() == (token_counts([[6, 10], [4, 4, 9]], V) > 0).tolist()
    # the sampler reads the rows in place: a batch of slots 2, 1 is penalized as its own lists give
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4)) * 3
    params = [SamplingParams(temperature=0, repetition_penalty=1.4, presence_penalty=0.3), c.params]
    on_device = SamplingTensors.from_params(params, [0, 1], [1, 1], V, "cpu",
                                            penalty_rows=functools.partial(state.rows, torch.tensor([2, 1])))
    from_lists = tensors(params, [[0], [2]], prompt_token_ids=[[4, 4, 9], [6, 10]])
    assert torch.equal(adjust_logits(logits, on_device), adjust_logits(logits, from_lists))
    # the KV pool is sized with the tables' bytes set aside: what they take once made
    assert PenaltyState.bytes_for(4, V) == state.counts.nbytes + state.in_prompt.nbytes


def test_penalties_skipped_when_unused_and_needed_when_used():
    logits, outputs, _ = toy_batch()
    plain = [SamplingParams(temperature=0)] * 5
    t = SamplingTensors.from_params(plain, list(range(5)), [0] * 5, V, "cpu")
    assert t.output_counts is None and adjust_logits(logits, t) is logits
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingTensors.from_params([SamplingParams(presence_penalty=1.0)], [0], [0], V, "cpu")


def test_logprobs_match_reference():
    logits, outputs, params = toy_batch(1)
    params = [SamplingParams(temperature=t, logprobs=k, frequency_penalty=0.7, seed=3)
              for t, k in zip([0, 0.8, 1.5, 0, 1.0], [0, 3, None, 5, 11], strict=True)]
    out = sample_batch(logits, tensors(params, outputs))
    for i, (p, o) in enumerate(zip(params, outputs, strict=True)):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        ref = ref_penalize(logits[i].tolist(), o, 0.0, 0.7)
        norm = math.log(sum(math.exp(x) for x in ref))
        ref_lp = [x - norm for x in ref]  # before temperature, whatever the temperature
        chosen, rank, top_ids, top_lps = lp
        tok = out.token_ids[i]
        assert chosen == pytest.approx(ref_lp[tok], abs=1e-5)
        assert rank == 1 + sum(x > ref_lp[tok] for x in ref_lp)
        order = sorted(range(V), key=lambda t: -ref_lp[t])[: p.logprobs]
        assert top_ids == order
        assert top_lps == pytest.approx([ref_lp[t] for t in order], abs=1e-5)


def test_compute_logprobs_k0():
    x = torch.randn(3, V)
    chosen, ranks, ids, vals = compute_logprobs(x, x.argmax(-1), 0)
    assert ids.shape == (3, 0) and vals.shape == (3, 0) and ranks.tolist() == [1, 1, 1]
    assert torch.allclose(chosen, torch.log_softmax(x, -1).max(-1).values)


# ---------------------------------------------------------------------------- engine, against teacher forcing
@pytest.fixture
def smollm(llm):
    return llm


def teacher_forced_logprobs(hf_model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax-free logits [len(out), V] predicting each output token from prompt + the outputs before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(out) - 1].float()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_engine_penalties_and_logprobs_vs_teacher_forcing(smollm, hf_model, temperature):
    llm = smollm
    tok = llm.get_tokenizer()
    prompt = tok.encode("List the days of the week, then list them again, and again:")
    kw = dict(temperature=temperature, seed=11, max_tokens=24, ignore_eos=True)
    pen = dict(frequency_penalty=2.0, presence_penalty=1.0)
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(logprobs=4, **pen, **kw),
                       use_tqdm=False)[0].outputs[0]
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    assert got.token_ids != plain.token_ids  # the penalties changed the continuation
    assert plain.logprobs is None and plain.cumulative_logprob is None

    logits = teacher_forced_logprobs(hf_model, prompt, got.token_ids)
    counts = torch.zeros(logits.shape[-1])
    total = 0.0
    for i, t in enumerate(got.token_ids):
        x = logits[i] - pen["frequency_penalty"] * counts - pen["presence_penalty"] * (counts > 0).float()
        ref = torch.log_softmax(x, -1)
        if temperature == 0.0:  # greedy: the argmax of the penalized logits (up to a near-tie)
            assert ref[t] >= ref.max() - 2e-3, f"token {i}"
        entry = got.logprobs[i]
        assert entry[t].logprob == pytest.approx(ref[t].item(), abs=2e-3)
        assert 1 + int((ref > ref[t] + 2e-3).sum()) <= entry[t].rank <= 1 + int((ref > ref[t] - 2e-3).sum())
        assert entry[t].decoded_token == tok.decode([t])
        top = sorted((lp for tid, lp in entry.items() if lp.rank <= 4), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3, 4]
        assert [lp.logprob for lp in top] == pytest.approx(ref.topk(4).values.tolist(), abs=2e-3)
        total += entry[t].logprob
        counts[t] += 1
    assert got.cumulative_logprob == pytest.approx(total, abs=1e-6)


@pytest.mark.parametrize("penalty,text", [(1.3, "Say it again and again: the cat sat on the mat, the cat sat on"),
                                          (0.7, "Name twenty different fruits, one per line:"),
                                          # longer than the fixture's 48-token chunks: the row is set at the chunk
                                          # that samples, the first one only passes through
                                          (1.2, "Here is a long list of colours, each said twice: red red, green "
                                                "green, blue blue, yellow yellow, purple purple, orange orange, "
                                                "black black, white white, grey grey, pink pink, brown brown, "
                                                "gold gold, silver silver, and then")])
def test_engine_repetition_penalty_vs_transformers(smollm, hf_model, penalty, text):
    """Greedy with a repetition penalty: each token is the argmax of the teacher-forced logits after transformers'
    own RepetitionPenaltyLogitsProcessor over the prompt and the tokens before it (up to a near-tie)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    tok = smollm.get_tokenizer()
    prompt = tok.encode(text)
    assert len(prompt) > 48 or penalty != 1.2
    kw = dict(temperature=0, max_tokens=20, ignore_eos=True)
    got = smollm.generate({"prompt_token_ids": prompt}, SamplingParams(repetition_penalty=penalty, **kw),
                          use_tqdm=False)[0].outputs[0].token_ids
    plain = smollm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    assert got != plain.token_ids  # the penalty changed the continuation
    logits = teacher_forced_logprobs(hf_model, prompt, got)
    process = RepetitionPenaltyLogitsProcessor(penalty)
    for i, t in enumerate(got):
        ref = process(torch.tensor([prompt + got[:i]]), logits[i : i + 1].clone())[0]
        assert ref[t] >= ref.max() - 2e-3, f"token {i}"


def test_penalized_steps_stay_overlapped(smollm):
    """A decode step with penalties leaves its tokens in flight while the next is scheduled (no read-back at once):
    the counts are on the device."""
    engine = smollm.engine
    params = SamplingParams(temperature=0.7, seed=5, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=12,
                            ignore_eos=True)
    engine.add_request("pen-0", [1, 2, 3, 4, 5], params)
    engine.add_request("pen-1", [6, 7, 8], params)
    in_flight, tokens = [], 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        in_flight.append(engine._in_flight is not None)
    assert tokens == 24 and sum(in_flight) >= 10
