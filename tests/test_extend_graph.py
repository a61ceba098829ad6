"""ExtendGraphRunner on the CPU: the Triton backend in Triton's interpreter, the Graph stand-in re-running the
captured step over the static buffers. Replays of padded extend batches must match eager extends."""

import json
import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402
from batch_helpers import extend_batch  # noqa: E402
from test_decode_graph import TINY as DECODE_TINY  # noqa: E402
from test_decode_graph import generate_eager_then_graphed, release  # noqa: E402

from ostinato import LLM  # noqa: E402
from ostinato.attention.triton_ops.extend_attention import extend_block_table, max_extend_blocks  # noqa: E402
from ostinato.graphs.decode import PAD_SLOT  # noqa: E402
from ostinato.graphs.extend import ExtendGraphRunner, extend_token_sizes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the graphs are captured for real
TINY = {**DECODE_TINY, "max_position_embeddings": 512}


@pytest.fixture
def tiny_llm(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    llm = LLM(str(path), load_format="dummy", device=DEVICE, dtype="float32", attention_backend="triton",
              max_total_tokens=4096, page_size=4, max_running_requests=8, extend_cuda_graph_max_tokens=0,
              disable_radix_cache=True,  # the graphed rerun must compute the same extends as the eager run
              sampler_warm_up="temperature")
    assert llm.engine.runner.extend_graph_runner is None  # every forward is eager unless a test attaches one
    return llm


def test_sizes_and_block_table():
    assert extend_token_sizes(100) == [16, 32, 64, 100]
    assert extend_token_sizes(64) == [16, 32, 64]
    assert extend_token_sizes(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    reqs, m0s = extend_block_table([3, 130, 64], 64, pad_to=8)
    assert reqs == [0, 1, 1, 1, 2, -1, -1, -1] and m0s == [0, 0, 64, 128, 0, 0, 0, 0]
    assert max_extend_blocks(197, 3, 64) >= 5  # the table above fits the bound for its token count
    with pytest.raises(AssertionError):
        extend_block_table([3, 130, 64], 64, pad_to=4)


@pytest.mark.parametrize("prefix_lens", [[0, 0, 0], [5, 0, 17]])
def test_replay_equals_eager(tiny_llm, prefix_lens):
    runner = tiny_llm.engine.runner
    graphs = ExtendGraphRunner(runner, max_tokens=64)
    assert sorted(graphs.graphs) == [16, 32, 64]
    gen = torch.Generator().manual_seed(sum(prefix_lens))
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 30, 20)]
    sched, reqs = extend_batch(runner, prompts, prefix_lens)
    batch = runner.prepare(sched)
    assert graphs.can_run(batch) and graphs.padded_size(batch.num_tokens) in (32, 64)
    kv_before = [b.clone() for b in runner.kv_cache.get_kv_buffer(1)]
    eager = runner.forward(batch).clone()  # no extend graph runner attached: eager
    kv_after_eager = [b.clone() for b in runner.kv_cache.get_kv_buffer(1)]
    for buf, orig in zip(runner.kv_cache.get_kv_buffer(1), kv_before, strict=True):
        buf.copy_(orig)
    # poison what padding touches: the sink slot and the static buffers past the batch
    poison = torch.Generator(device=DEVICE).manual_seed(7)
    for buf in runner.kv_cache.get_kv_buffer(1):
        buf[PAD_SLOT].normal_(0, 1e4, generator=poison)
    graphs.tokens.random_(0, 200, generator=poison)
    replayed = graphs.replay(batch).clone()
    assert replayed.shape == eager.shape == (3, 256)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    for after_replay, after_eager in zip(runner.kv_cache.get_kv_buffer(1), kv_after_eager, strict=True):
        torch.testing.assert_close(after_replay[PAD_SLOT + 1 :], after_eager[PAD_SLOT + 1 :])
    release(runner, reqs)


def test_replay_reads_static_buffers(tiny_llm):
    runner = tiny_llm.engine.runner
    graphs = ExtendGraphRunner(runner, max_tokens=32)
    sched, reqs = extend_batch(runner, [[5, 6, 7, 8, 9], [10, 11, 12]], [0, 0])
    first = graphs.replay(runner.prepare(sched)).clone()
    graphs.input_ids[4] = (graphs.input_ids[4] + 1) % 256  # the first request's last token, gone stale
    graphs.graphs[16].replay()
    assert not torch.allclose(graphs.logits[0], first[0])
    torch.testing.assert_close(graphs.logits[1], first[1])
    release(runner, reqs)


def test_generate_through_extend_graphs_equals_eager(tiny_llm):
    def attach(runner):
        runner.extend_graph_runner = ExtendGraphRunner(runner, max_tokens=48)  # sizes 16, 32, 48
        return runner.extend_graph_runner

    # short prompts: in Triton's interpreter every captured size and replay costs time in proportion to it
    eager, graphed, replayed = generate_eager_then_graphed(tiny_llm, attach, max_tokens=6, lens=(5, 11, 3, 17, 2, 9))
    assert graphed == eager
    assert [b.num_tokens for b in replayed] == [47]  # the one extend (all six prompts) went through the graph
