"""The sampler graphs (graphs/sample.py): replays draw what the torch sampler draws, step after step and batch
after batch, reading the decode graph's logits buffer; padded rows draw greedily; on CUDA the replayed draws
follow the reference distribution. Without a GPU the kernels run in Triton's interpreter and the graph is the
CPU stand-in (which re-runs the step over the same static buffers)."""

import functools
import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the fused sampler is Triton kernels")

from test_sampler import CHI2_CRIT_001, ref_probs  # noqa: E402

from ostinato.graphs.graph import capture_stream, warmed_capture  # noqa: E402
from ostinato.graphs.sample import SampleGraphRunner, SampleKey  # noqa: E402
from ostinato.runner.sampler import SamplingTensors, fused_draw, padded_vocab, sample_torch  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


pytestmark = pytest.mark.usefixtures("own_graph_pool")  # conftest: a new graph pool for each test


def _buffer(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A decode graph's logits buffer: padded to whole argmax chunks with -inf columns."""
    logits = torch.full((n, padded_vocab(vocab)), float("-inf"))
    logits[:, :vocab] = torch.randn(n, vocab, generator=gen) * 2.5
    return logits.to(DEVICE)


def _refill(logits: torch.Tensor, vocab: int, gen: torch.Generator) -> None:
    """New logits in place, as the next decode replay writes them."""
    logits[:, :vocab] = (torch.randn(logits.shape[0], vocab, generator=gen) * 2.5).to(DEVICE)


def test_replays_draw_what_the_torch_sampler_draws():
    vocab, n = 700, 8
    gen = torch.Generator().manual_seed(0)
    logits = _buffer(n, vocab, gen)
    # the next-token buffer (one row per request slot, the last the sink) and the decode graph's request rows
    tokens = torch.full((n + 1,), -7, dtype=torch.int64, device=DEVICE)
    rows = torch.full((n,), n, dtype=torch.int64, device=DEVICE)
    steps_block = torch.full((n,), -5, dtype=torch.int64, device=DEVICE)  # the decode graphs' step row
    runner = SampleGraphRunner(logits, vocab, fused_draw, store=(tokens, rows), steps=steps_block)
    batches = [  # (params, padded size): cuts and min_p, temperature alone, then the first kind with new values
        # and a padded row (the last batch's fourth row sampled at temperature 1.5: padding must reset it)
        ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
          SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02), SamplingParams(temperature=1.5)], 4),
        ([SamplingParams(temperature=0.9), SamplingParams(temperature=0.4)], 2),
        ([SamplingParams(temperature=1.1, top_k=40, top_p=0.9), SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.6, min_p=0.1)], 4),
    ]
    for i, (params, padded) in enumerate(batches):
        seeds = [17 * i + j for j in range(len(params))]
        t = SamplingTensors.from_params(params, seeds, [3, 9, 4, 8][: len(params)], vocab, DEVICE)
        slots = torch.randperm(n, generator=gen)[: len(params)]
        rows[: len(params)] = slots.to(DEVICE)
        rows[len(params) :] = n  # padded rows: the sink
        for step in range(3):  # the batch's tensors are loaded once; only the steps change, and the logits
            if step:
                _refill(logits, vocab, gen)
                t = t.with_steps([5 + step, 11 * step, step, 2 * step][: len(params)])
            args = t.fused_args()
            if step == 2:  # the steps already in the static buffer, as the decode graphs' copy leaves them
                steps_block[: len(params)] = t.steps
                steps_block[len(params) :] = 0
                args = (*args[:5], steps_block[: len(params)], args[6])
            drawn = runner.replay(padded, *args).clone()
            expect = sample_torch(logits[: len(params), :vocab], t)
            assert torch.equal(drawn.cpu(), expect.cpu()), (i, step)
            assert torch.equal(tokens[slots.to(DEVICE)].cpu(), expect.cpu()), "stored by request slot"
            tokens[:n] = -7
            padding = runner.ids[len(params) : padded].cpu()
            assert torch.equal(padding, logits[len(params) : padded, :vocab].argmax(-1).cpu()), "padded rows: greedy"
    # (the third batch's one top_p row has top_k 40: its cut from the kept keys, no search passes)
    assert set(runner.graphs) == {SampleKey(4, True, True, True), SampleKey(2, False, False, False),
                                  SampleKey(4, True, True, True, top_p_kept=True)}


def test_penalized_replays_draw_and_count_as_the_eager_step():
    """A penalized step replayed from a sampler graph: the logits penalized by request row from the penalty state,
    the draw, and the drawn ids counted into the state, as the eager step does them (`sample_tensors` and
    `PenaltyState.count_`); capturing counts nothing (its runs count into the sink row), and padded rows count into
    the sink row only."""
    from types import SimpleNamespace

    from ostinato.runner.penalties import PenaltyState
    from ostinato.runner.sampler import sample_tensors

    vocab, slots = 700, 6  # request slots 0-5; row 6 is the sink
    gen = torch.Generator().manual_seed(5)
    logits = _buffer(4, vocab, gen)
    tokens = torch.full((slots + 1,), -7, dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([4, 1, 2, slots], device=DEVICE)  # the decode graph's request rows; the padded row: sink
    graphed, eager = (PenaltyState(slots, vocab, torch.device(DEVICE)) for _ in range(2))
    reqs = [SimpleNamespace(req_pool_idx=4, output_token_ids=[5, 5, 9], prompt_token_ids=[1, 2],
                            params=SamplingParams(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.4)),
            SimpleNamespace(req_pool_idx=1, output_token_ids=[3], prompt_token_ids=[7, 7, 8],
                            params=SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.2)),
            SimpleNamespace(req_pool_idx=2, output_token_ids=[], prompt_token_ids=[11],
                            params=SamplingParams(temperature=1.1, top_k=20, presence_penalty=1.0))]
    for state in (graphed, eager):
        state.reset_rows(reqs)
    runner = SampleGraphRunner(logits, vocab, fused_draw, store=(tokens, rows), penalties=graphed)
    params = [r.params for r in reqs]
    # the engine's tensors: the rows read in place by slot, made once for the batch, the steps moving
    make = [SamplingTensors.from_params(params, [3, 4, 5], [3, 1, 0], vocab, DEVICE,
                                        penalty_rows=functools.partial(state.rows, rows[:3]))
            for state in (graphed, eager)]
    for step in range(3):
        if step:
            _refill(logits, vocab, gen)
        t_graph, t_eager = (t.with_steps([3 + step, 1 + step, step]) for t in make)
        assert t_graph.graph_drawable
        drawn = runner.replay(4, *t_graph.fused_args(), penalties=t_graph.graph_penalties()).clone()
        expect = sample_tensors(logits[:3, :vocab], t_eager).ids
        eager.count_(rows[:3], expect)
        assert torch.equal(drawn.cpu(), expect.cpu()), step
        assert torch.equal(tokens[rows[:3]].cpu(), expect.cpu()), "stored by request slot"
        assert torch.equal(graphed.counts[:slots].cpu(), eager.counts[:slots].cpu()), step
    # the sink row: the padded row's three draws, and 4 for each of the capture's runs (every row counts there)
    assert int(graphed.counts[slots].sum()) % 4 == 3
    assert set(runner.graphs) == {SampleKey(4, False, True, False, True, True)}
    # logprobs of penalized logits, a bias or a grammar: drawn eagerly
    with_logprobs = SamplingTensors.from_params([*params[:2], SamplingParams(temperature=1.0, logprobs=2,
                                                                               presence_penalty=0.5)],
                                                [3, 4, 5], [0, 0, 0], vocab, DEVICE,
                                                penalty_rows=functools.partial(graphed.rows, rows[:3]))
    assert not with_logprobs.graph_drawable


@pytest.mark.skipif(not GPU, reason="many replays: the interpreter is too slow for a distribution")
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.8, 5, 0.8, 0.05),
                                                               (1.5, 6, 0.9, 0.1), (1.0, 3, 1.0, 0.0)])
def test_replayed_draws_follow_the_reference_distribution(temperature, top_k, top_p, min_p):
    """test_sampler's chi-square test, with the draws taken from graph replays: 2,000 rows x 10 steps."""
    v, rows, steps = 8, 2000, 10
    row_logits = torch.tensor([1.2, -0.3, 0.5, 2.0, 0.1, -1.0, 0.8, 1.6])
    q = ref_probs(row_logits, temperature, top_k, top_p, min_p)
    logits = torch.full((rows, padded_vocab(v)), float("-inf"))
    logits[:, :v] = row_logits
    runner = SampleGraphRunner(logits.to(DEVICE), v, fused_draw)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * rows
    t = SamplingTensors.from_params(params, [1234] * rows, list(range(rows)), v, DEVICE)
    draws = []
    for s in range(steps):
        t = t.with_steps([s * rows + r for r in range(rows)])
        draws.append(runner.replay(rows, *t.fused_args()).cpu().clone())
    assert len(runner.graphs) == 1
    counts = torch.bincount(torch.cat(draws), minlength=v).double()
    allowed = q > 0
    assert counts[~allowed].sum() == 0, "sampled a token the filters remove"
    expected = q[allowed] * rows * steps
    chi2 = ((counts[allowed] - expected) ** 2 / expected).sum().item()
    df = int(allowed.sum()) - 1
    assert df == 0 or chi2 < CHI2_CRIT_001[df], (chi2, counts.tolist(), expected.tolist())


@pytest.mark.skipif(not GPU, reason="CUDA streams")
@pytest.mark.parametrize("mid_serving", [False, True])
def test_warm_up_stream_of_a_capture(mid_serving):
    """Start-up captures warm up on the capture stream; mid-serving ones (the sampler graphs, vision graphs) on
    the current stream, since kernels run on a second stream once serving began slowed every later decode
    replay (graph.warm_up_stream). The capture itself is on the capture stream either way."""
    device = torch.device("cuda")
    x = torch.ones(64, device=device)
    streams = []

    def step() -> None:
        streams.append(torch.cuda.current_stream(device))
        x.add_(1.0)

    graph = warmed_capture(device, step, free_memory=False, mid_serving=mid_serving)
    warm = torch.cuda.current_stream(device) if mid_serving else capture_stream(device)
    assert streams == [warm, warm, capture_stream(device)]
    assert x[0].item() == 3.0  # two warm-ups ran; the capture only recorded
    graph.replay()
    assert x[0].item() == 4.0
