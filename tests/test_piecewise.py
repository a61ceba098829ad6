"""Piecewise graphs on the CPU: the torch.compile split, and replays through the Graph stand-in (which re-runs
each captured piece over the same static buffers) against eager forwards of the same batches."""

import json

import pytest
import torch
import torch._dynamo
from batch_helpers import extend_batch

from ostinato import LLM
from ostinato.graphs.compile_backend import piece_signature
from ostinato.graphs.decode import PAD_SLOT
from ostinato.graphs.piecewise import PiecewiseGraphRunner, non_owning_alias, piecewise_token_sizes, weak_ref

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("pw") / "tiny.json"
    path.write_text(json.dumps(TINY))
    torch._dynamo.reset()
    return LLM(str(path), load_format="dummy", device="cpu", dtype="float32", attention_backend="torch",
               max_total_tokens=4096, page_size=4, max_running_requests=8)


@pytest.fixture(scope="module")
def graphs(tiny_llm):
    return PiecewiseGraphRunner(tiny_llm.engine.runner, max_tokens=96, sizes=[8, 24, 64, 96], compiler="eager")


def release(runner, reqs):
    for r in reqs:
        runner.kv_manager.release(r.req_pool_idx, r.kv_len)
    runner.kv_manager.check_all_free()


def poison(graphs, gen):
    """Garbage in every static buffer: whatever a replay does not write must not matter."""
    with torch.inference_mode():
        graphs.tokens.copy_(torch.randint(1, 200, graphs.tokens.shape, generator=gen))
        for piece in graphs.pieces:
            for buf in piece.static_bufs.values():
                buf.copy_(torch.randn(buf.shape, generator=gen) * 1e3)
        if graphs.attn_out is not None:
            graphs.attn_out.copy_(torch.randn(graphs.attn_out.shape, generator=gen) * 1e3)


def test_sizes():
    assert piecewise_token_sizes(100) == [4, 8, 16, 32, 64, 100]
    assert piecewise_token_sizes(1024) == [4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]
    assert piecewise_token_sizes(64, [64, 3, 500]) == [3, 64]


def test_split_gives_one_piece_more_than_attention_calls(graphs):
    split = graphs.backend.splits[0]
    assert split.num_split_calls == TINY["num_hidden_layers"]
    assert graphs.num_pieces == TINY["num_hidden_layers"] + 1
    # each piece after the first reads one attention output (from the runner's fixed buffer: see below)
    assert [len(split.volatile_args[n]) for n in split.piece_names] == [0, 1, 1, 1]
    # the middle layers' pieces are one function of their arguments (weights included): compiled once, and
    # the replays below check that sharing it gives each layer its own result
    assert graphs.backend.num_compiled == 3
    runnables = [p.runnable for p in graphs.pieces]
    assert runnables[1] is runnables[2] and len({id(r) for r in runnables}) == 3
    assert all(sorted(p.entries) == [8, 24, 64, 96] for p in graphs.pieces)


def test_store_inside_pieces_attention_between_them(graphs):
    """Rotary and the K/V store are captured inside the pieces; only the attention runs between them, as a plain
    call of its function (no dispatcher), writing into the runner's buffer that the next piece reads in place."""
    from ostinato.attention.op import attention_impl

    split = graphs.backend.splits[0]
    pieces = [p.runnable for p in graphs.pieces]  # eager compiler: the FX pieces themselves
    between = [getattr(split.module, n.target) for n in split.module.graph.nodes
               if n.op == "call_module" and n.target not in split.piece_names]
    stores = [n for p in pieces for n in p.graph.nodes if n.target is torch.ops.ostinato.rope_store.default]
    assert len(stores) == TINY["num_hidden_layers"]
    calls = [n.target for sub in between for n in sub.graph.nodes if n.op == "call_function"]
    assert calls.count(attention_impl) == len(between) == TINY["num_hidden_layers"]
    assert not any(isinstance(t, torch._ops.OpOverload) for t in calls)
    assert graphs.attn_out is not None and graphs.attn_out.shape == (96, 64)
    for piece in graphs.pieces:  # no static copy of an attention output: the captured argument is attn_out itself
        assert not piece.static_bufs
        for entry in piece.entries.values():
            for static in entry.static.values():
                assert static.untyped_storage().data_ptr() == graphs.attn_out.untyped_storage().data_ptr()
                assert static.shape[0] == entry.num_tokens


@pytest.mark.parametrize("lens,prefix_lens", [([9, 30, 20], [0, 0, 0]), ([13, 1, 40, 7], [5, 0, 17, 3]),
                                              ([61, 1, 1, 1, 1], [0, 30, 12, 7, 44])])
def test_replay_equals_eager(tiny_llm, graphs, lens, prefix_lens):
    runner = tiny_llm.engine.runner
    gen = torch.Generator().manual_seed(sum(lens) + len(prefix_lens))
    prompts = [torch.randint(0, 256, (p + n,), generator=gen).tolist() for p, n in zip(prefix_lens, lens,
                                                                                        strict=True)]
    sched, reqs = extend_batch(runner, prompts, prefix_lens)
    batch = runner.prepare(sched)
    assert graphs.can_run(batch) and graphs.padded_size(batch.num_tokens) > batch.num_tokens  # it pads
    eager = runner.forward(batch).clone()
    kv_eager = [b.clone() for b in runner.kv_cache.get_kv_buffer(2)]
    runner.kv_cache.get_kv_buffer(2)[0][batch.out_cache_loc] = float("nan")  # the replay must rewrite it
    for _ in range(2):  # a second replay over the same buffers, poisoned again
        poison(graphs, gen)
        logits = graphs.replay(batch)
        torch.testing.assert_close(logits, eager, rtol=0, atol=0)
    kv = runner.kv_cache.get_kv_buffer(2)
    for a, b in zip(kv, kv_eager, strict=True):
        torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=0)  # padded tokens wrote only the sink slot 0
    assert (graphs.out_cache_loc[batch.num_tokens: graphs.padded_size(batch.num_tokens)] == PAD_SLOT).all()
    assert len(graphs.backend.splits) == 1  # no batch made dynamo trace the forward again
    release(runner, reqs)


def test_output_buffer_of_another_shape_or_dtype_is_left_alone(tiny_llm):
    """Attention writes into the forward context's buffer only where it fits the layer: otherwise a fresh output."""
    from ostinato.attention.op import forward_context

    runner = tiny_llm.engine.runner
    sched, reqs = extend_batch(runner, [list(range(5, 25)), list(range(40, 47))], [0, 0])
    batch = runner.prepare(sched)
    ref = runner.forward(batch).clone()
    for buf in (torch.full((64, 64), float("nan"), dtype=torch.float64), torch.full((64, 32), float("nan"))):
        with torch.inference_mode(), forward_context(runner.backend, batch, runner.model.attention_specs, buf):
            runner.backend.init_forward_metadata(batch)
            logits = runner.model.compute_logits(runner.model(batch.input_ids, batch.positions)[batch.logits_indices])
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)
        assert torch.isnan(buf).all()
    release(runner, reqs)


def test_past_the_range_runs_eagerly(tiny_llm, graphs):
    runner = tiny_llm.engine.runner
    sched, reqs = extend_batch(runner, [list(range(100)), list(range(3))], [0, 0])
    batch = runner.prepare(sched)
    assert not graphs.can_run(batch)
    eager = runner.forward(batch)
    runner.piecewise_graph_runner = graphs
    try:
        assert runner.extend_path(batch) == "eager"  # no graph has 103 tokens
        torch.testing.assert_close(runner.forward(batch), eager, rtol=0, atol=0)
        small, small_reqs = extend_batch(runner, [list(range(50))], [0])
        assert runner.extend_path(runner.prepare(small)) == "piecewise"
    finally:
        runner.piecewise_graph_runner = None
    release(runner, reqs + small_reqs)


def test_weak_ref():
    t = torch.randn(3)
    assert weak_ref(t) is t  # the CPU stand-in holds piece outputs strongly
    base = torch.randn(5, 8)
    view = base[1:, 2:6]
    alias = non_owning_alias(view)  # what a CUDA piece output becomes
    assert alias.data_ptr() == view.data_ptr() and alias.stride() == view.stride()
    base.add_(1)
    assert torch.equal(alias, view)  # sees every later write to the memory


def test_piece_signature():
    def f(x, w):
        return torch.relu(x @ w) * 0.5

    def g(a, weight_of_another_layer):  # the same function under other names
        return torch.relu(a @ weight_of_another_layer) * 0.5

    def h(x, w):  # another constant
        return torch.relu(x @ w) * 0.25

    sig = [piece_signature(torch.fx.symbolic_trace(fn)) for fn in (f, g, h)]
    assert sig[0] == sig[1] != sig[2]
    holds_weight = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))  # reads its own parameters: never shared
    assert piece_signature(holds_weight) is None


def test_inductor_path_compiles_each_distinct_piece_once(tiny_llm, monkeypatch):
    """The inductor compiler gets each distinct piece once, with fake arguments whose token dimension is symbolic
    (a nested torch.compile per piece had silently run the pieces eagerly). compile_fx is replaced by a recorder
    that runs the graph it is given, so this stays fast; the GPU tests run inductor itself."""
    import torch._inductor.compile_fx as inductor

    seen = []

    def fake_compile_fx(gm, example_inputs):
        seen.append([tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)])
        return lambda *args: gm(*args)

    monkeypatch.setattr(inductor, "compile_fx", fake_compile_fx)
    runner = tiny_llm.engine.runner
    torch._dynamo.reset()
    graphs = PiecewiseGraphRunner(runner, max_tokens=32, sizes=[8, 32], compiler="inductor")
    assert graphs.backend.num_compiled == len(seen) == 3
    hidden = TINY["hidden_size"]
    token_dims = [shape[0] for shapes in seen for shape in shapes if len(shape) == 2 and shape[1] == hidden]
    assert any(isinstance(d, torch.SymInt) for d in token_dims)  # compiled for any token count, not one
    gen = torch.Generator().manual_seed(7)
    sched, reqs = extend_batch(runner, [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17)], [0, 0])
    batch = runner.prepare(sched)
    eager = runner.forward(batch).clone()
    poison(graphs, gen)
    torch.testing.assert_close(graphs.replay(batch), eager, rtol=0, atol=0)
    release(runner, reqs)
