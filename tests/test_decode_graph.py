"""DecodeGraphRunner bookkeeping on the CPU through the Graph stand-in (replay re-runs the captured step
over the same static buffers)."""

import json

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.attention.forward_batch import ForwardMode
from ostinato.engine.request import PENDING_TOKEN, Request
from ostinato.engine.scheduler import ScheduledBatch
from ostinato.graphs.decode import PAD_SLOT, DecodeGraphRunner, capture_batch_sizes, default_cuda_graph_max_bs

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@pytest.fixture
def tiny_llm(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return LLM(str(path), load_format="dummy", device="cpu", max_total_tokens=2048, page_size=4,
               max_running_requests=8, cuda_graph_bs=[1, 2, 4, 8], disable_radix_cache=True)


def decode_batch(runner, seqs):
    """Prefill `seqs`, then schedule one decode step for all; returns (ScheduledBatch, requests)."""
    reqs = []
    for i, seq in enumerate(seqs):
        r = Request(str(i), seq, SamplingParams(), seed=0)
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        reqs.append(r)
    kv = runner.kv_manager
    n = [len(s) - 1 for s in seqs]
    locs = [kv.extend(r.req_pool_idx, 0, k) for r, k in zip(reqs, n, strict=True)]
    for r, k in zip(reqs, n, strict=True):
        r.kv_len = k
    runner.forward(runner.prepare(ScheduledBatch(ForwardMode.EXTEND, reqs, [0] * len(reqs), n, torch.cat(locs),
                                                 [True] * len(reqs))))
    prefix = [r.kv_len for r in reqs]
    locs = [kv.extend(r.req_pool_idx, r.kv_len, r.kv_len + 1) for r in reqs]
    for r in reqs:
        r.kv_len += 1
    return ScheduledBatch(ForwardMode.DECODE, reqs, prefix, [1] * len(reqs), torch.cat(locs), [True] * len(reqs)), reqs


def release(runner, reqs):
    for r in reqs:
        runner.kv_manager.release(r.req_pool_idx, r.kv_len)
    runner.kv_manager.check_all_free()


def test_batch_size_lists():
    assert capture_batch_sizes(None, 32, 256) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(None, 256, 256)[-3:] == [224, 240, 256]
    assert capture_batch_sizes(None, 256, 20) == [1, 2, 4, 8, 16]  # filtered by max_running_requests
    assert capture_batch_sizes([8, 1, 3], 999, 256) == [1, 3, 8]
    assert default_cuda_graph_max_bs(80 * 2**30) == 256 and default_cuda_graph_max_bs(16 * 2**30) == 8


def test_replay_equals_eager_with_padding(tiny_llm):
    runner = tiny_llm.engine.runner
    graphs = DecodeGraphRunner(runner)
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.padded_size(3) == 4 and graphs.padded_size(5) == 8
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    sched, reqs = decode_batch(runner, seqs)
    batch = runner.prepare(sched)
    assert graphs.can_run(batch)
    k0, v0 = (b.clone() for b in runner.kv_cache.get_kv_buffer(0))
    eager = runner.forward(batch).clone()  # graph_runner not attached: eager
    kv_after_eager = [b.clone() for b in runner.kv_cache.get_kv_buffer(0)]
    for buf, orig in zip(runner.kv_cache.get_kv_buffer(0), (k0, v0), strict=True):
        buf.copy_(orig)
    replayed = graphs.replay(batch).clone()
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    # the real rows wrote the same K/V; the padded row wrote only to the sink slot
    for after_replay, after_eager in zip(runner.kv_cache.get_kv_buffer(0), kv_after_eager, strict=True):
        torch.testing.assert_close(after_replay[PAD_SLOT + 1 :], after_eager[PAD_SLOT + 1 :])
    release(runner, reqs)


def test_poisoned_padding_never_changes_real_rows(tiny_llm, monkeypatch):
    runner = tiny_llm.engine.runner
    graphs = DecodeGraphRunner(runner)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (12, 40, 7, 25, 3)]  # bs 5 -> 8
    sched, reqs = decode_batch(runner, seqs)
    batch = runner.prepare(sched)
    clean = graphs.replay(batch).clone()
    real_kv = [b[1:].clone() for b in runner.kv_cache.get_kv_buffer(1)]

    fill = graphs._fill_padding

    def poisoned_fill(start, stop):
        fill(start, stop)  # the padding contract (sink slot, seq_len fill) holds; the tokens are garbage
        graphs.input_ids[start:stop] = torch.randint(0, 256, (stop - start,), generator=gen)
        graphs.positions[start:stop] = torch.randint(0, 200, (stop - start,), generator=gen)
        for buf in runner.kv_cache.get_kv_buffer(1):
            buf[PAD_SLOT].normal_(0, 1e4, generator=gen)

    monkeypatch.setattr(graphs, "_fill_padding", poisoned_fill)
    poisoned = graphs.replay(batch).clone()
    torch.testing.assert_close(poisoned, clean)
    for before, buf in zip(real_kv, runner.kv_cache.get_kv_buffer(1), strict=True):
        torch.testing.assert_close(buf[1:], before)
    release(runner, reqs)


def test_stand_in_replays_from_static_buffers(tiny_llm):
    """A runner that forgot to copy an input would be caught: replay reads only the static buffers."""
    runner = tiny_llm.engine.runner
    graphs = DecodeGraphRunner(runner)
    seqs = [[5, 6, 7, 8], [9, 10, 11]]
    sched, reqs = decode_batch(runner, seqs)
    batch = runner.prepare(sched)
    first = graphs.replay(batch).clone()
    assert torch.equal(graphs.token_ids[:2], first.argmax(-1))  # the greedy tokens come out of the replay too
    graphs.input_ids[0] = (graphs.input_ids[0] + 1) % 256  # what a stale buffer would hold
    graphs.graphs[2].replay()
    v = graphs.vocab_size
    assert not torch.allclose(graphs.logits[0, :v], first[0])
    torch.testing.assert_close(graphs.logits[1, :v], first[1])
    release(runner, reqs)


def test_prepare_loads_inputs_into_the_static_block(tiny_llm):
    """With a graph runner attached, `prepare` writes a decode batch's inputs straight into the graph's static
    block, its padding columns' values included (one host-to-device copy, none in replay); the replay equals one
    from inputs prepared apart and copied in by replay."""
    runner = tiny_llm.engine.runner
    assert runner.graph_runner is None
    graphs = DecodeGraphRunner(runner)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (11, 26, 8)]  # bs 3 -> 4
    sched, reqs = decode_batch(runner, seqs)
    apart = runner.prepare(sched)
    assert apart.decode_ints.data_ptr() != graphs.ints.data_ptr()
    expected = graphs.replay(apart).clone()
    graphs.ints.random_(0, 100, generator=gen)  # stale values in every column
    runner.graph_runner = graphs
    try:
        loaded = runner.prepare(sched)
    finally:
        runner.graph_runner = None
    assert loaded.decode_ints.data_ptr() == graphs.ints.data_ptr()
    assert torch.equal(loaded.decode_ints, apart.decode_ints)
    assert torch.equal(loaded.logits_indices, apart.logits_indices)
    # the sampler graphs' step indices ride along, in place: each request's output length
    assert apart.sample_steps is None and loaded.sample_steps.data_ptr() == graphs.sample_steps.data_ptr()
    assert loaded.sample_steps.tolist() == [len(r.output_token_ids) for r in reqs]
    assert torch.equal(graphs.ints[:, 3:], graphs.pad_column.expand(5, graphs.max_bs - 3))
    torch.testing.assert_close(graphs.replay(loaded), expected)
    release(runner, reqs)


def generate_eager_then_graphed(llm, attach, max_tokens, lens=(5, 33, 18, 60, 2, 41), sp=None):
    """Tokens of random prompts of `lens` tokens (greedy, or by `sp`: SamplingParams or a list a prompt), eagerly,
    then with the graph runner `attach(runner)` returns (after setting it on the runner); also the batches that
    runner replayed. Leaves no KV behind."""
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,)).tolist()} for n in lens]
    sp = sp or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    graphs = attach(llm.engine.runner)
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda b: replayed.append(b) or replay(b)
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.engine.check_memory_leak()
    return eager, graphed, replayed


def test_generate_through_graphs_equals_eager(tiny_llm):
    def attach(runner):
        runner.graph_runner = DecodeGraphRunner(runner)
        return runner.graph_runner

    eager, graphed, replayed = generate_eager_then_graphed(tiny_llm, attach, max_tokens=20)
    assert graphed == eager
    sizes = [b.batch_size for b in replayed]
    assert sizes and max(sizes) == 6  # decode batches went through the graphs (6 pads to 8)


def test_sampled_generate_through_graphs_equals_eager(tiny_llm, monkeypatch):
    """Seeded sampling gives the same tokens eagerly and through the decode graphs: a temperature-only batch (greedy
    rows beside) is drawn by the graph itself (`load_draw` given its temperatures: no sampler after it), and a batch
    where a row has top_k takes the graph's argmax and the sampler after it (given no temperatures)."""
    loads = []

    def attach(runner):
        runner.graph_runner = graphs = DecodeGraphRunner(runner)
        load = graphs.load_draw
        monkeypatch.setattr(graphs, "load_draw", lambda t, s: loads.append(t is not None) or load(t, s))
        return graphs

    temps = (0.8, 0.0, 1.3, 0.5, 0.0, 2.0)
    plain = [SamplingParams(temperature=t, seed=17 + i, max_tokens=12, ignore_eos=True) for i, t in enumerate(temps)]
    for params, drawn in ((plain, True), ([*plain[:5], SamplingParams(temperature=0.9, top_k=5, seed=3,
                                                                       max_tokens=12, ignore_eos=True)], False)):
        tiny_llm.engine.runner.graph_runner = None
        loads.clear()
        eager, graphed, replayed = generate_eager_then_graphed(tiny_llm, attach, max_tokens=12, sp=params)
        assert graphed == eager
        assert len(set(map(tuple, eager))) == len(eager) and replayed and loads and set(loads) == {drawn}


def test_disable_padding_runs_exact_sizes_only(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    llm = LLM(str(path), load_format="dummy", device="cpu", max_total_tokens=512, cuda_graph_bs=[1, 4],
              disable_cuda_graph_padding=True)
    graphs = DecodeGraphRunner(llm.engine.runner)
    sched, reqs = decode_batch(llm.engine.runner, [[1, 2, 3], [4, 5, 6], [7, 8]])
    batch = llm.engine.runner.prepare(sched)
    assert not graphs.can_run(batch)  # 3 is not captured and padding is off
    release(llm.engine.runner, reqs)


def test_replay_reads_pending_inputs_from_the_next_token_buffer(tiny_llm):
    """Overlap scheduling: a decode input still in flight is PENDING_TOKEN on the host; the graph reads it
    from the device buffer the previous step stored it in, and gives what the known token gives."""
    runner = tiny_llm.engine.runner
    graphs = DecodeGraphRunner(runner)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (14, 6, 21)]
    sched, reqs = decode_batch(runner, seqs)
    known = graphs.replay(runner.prepare(sched)).clone()
    for r in reqs[::2]:  # rows 0 and 2: their last token "in flight", stored on the device only
        runner.next_tokens.store_(torch.tensor([r.req_pool_idx]), torch.tensor([r.prompt_token_ids[-1]]))
        r.prompt_token_ids[-1] = PENDING_TOKEN
    batch = runner.prepare(sched)
    assert batch.input_ids.tolist().count(PENDING_TOKEN) == 2
    torch.testing.assert_close(graphs.replay(batch), known)
    release(runner, reqs)


def test_replay_records_new_slots_and_stores_greedy_tokens(tiny_llm):
    """The step does its own bookkeeping: it records each row's new KV slot in req_to_token (the scheduler
    leaves that to it: `extend_decode`) and stores each row's argmax in the next-token buffer.
    Its padded rows (3 requests replay the 4-row graph; request row 0 is live) write only the table's sink row."""
    runner = tiny_llm.engine.runner
    graphs = DecodeGraphRunner(runner)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 17, 4)]
    sched, reqs = decode_batch(runner, seqs)
    rows = [r.req_pool_idx for r in reqs]
    assert 0 in rows and graphs.padded_size(len(reqs)) == 4
    known = graphs.replay(runner.prepare(sched)).clone()
    table = runner.req_to_token_pool.req_to_token
    recorded = table.clone()
    table[rows, sched.prefix_lens] = 12345  # not recorded yet, as the scheduler now leaves a decode step's slots
    runner.next_tokens.tokens.fill_(-3)
    torch.testing.assert_close(graphs.replay(runner.prepare(sched)), known)
    assert torch.equal(table, recorded)  # the new slots back in place, nothing else in any row changed
    assert torch.equal(table[rows, sched.prefix_lens], sched.out_cache_loc.to(torch.int32))
    assert torch.equal(runner.next_tokens.tokens[rows], known.argmax(-1))
    release(runner, reqs)


def test_every_replay_begins_with_the_backends_graph_step(tiny_llm, monkeypatch):
    """The captured step calls the attention backend's begin_graph_step (metadata every layer reads, counted from the
    static buffers: a balancing decode entry's split counts) once, before its forward, so every replay redoes it."""
    runner = tiny_llm.engine.runner
    calls = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.backend, "begin_graph_step", lambda: calls.append("begin"))
    monkeypatch.setattr(runner.model, "forward", lambda *a, **k: (calls.append("forward"), forward(*a, **k))[1])
    graphs = DecodeGraphRunner(runner)
    sched, reqs = decode_batch(runner, [[5, 6, 7, 8], [9, 10, 11]])
    batch = runner.prepare(sched)
    calls.clear()
    graphs.replay(batch)
    graphs.replay(batch)
    assert calls == ["begin", "forward"] * 2
    release(runner, reqs)
