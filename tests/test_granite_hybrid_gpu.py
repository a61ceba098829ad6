"""Granite-4.0-H on the GPU (dummy granite-4.0-h-1b, bf16): decode-graph and extend-graph replays give exactly the
eager tokens (padded rows write their Mamba state to the sink slot), and a prompt prefilled in chunks decodes as one
prefilled at once. Skipped without CUDA: `pytest tests/test_granite_hybrid_gpu.py`."""

import pytest
import torch

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def granite():
    llm = LLM("granite-4.0-h-1b", load_format="dummy", max_total_tokens=100_000, max_running_requests=32,
              cuda_graph_bs=[1, 2, 4, 8, 16, 32], sampler_warm_up="temperature")
    yield llm
    del llm
    torch.cuda.empty_cache()


def _prompts(vocab: int, n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, vocab, (int(k),), generator=gen).tolist()}
            for k in torch.randint(5, 400, (n,), generator=gen)]


@pytest.mark.parametrize("n", [1, 5, 24])  # 5 and 24 pad up to 8 and 32: padded rows hit the sink slot
def test_graph_replay_gives_the_eager_tokens(granite, n):
    runner = granite.engine.runner
    assert runner.graph_runner is not None and runner.mamba_pool is not None
    prompts = _prompts(runner.vocab_size, n, seed=n)
    graphed, eager = _with_and_without(granite, "graph_runner", prompts, max_tokens=32)
    assert graphed == eager
    granite.engine.check_memory_leak()


def _with_and_without(granite, graphs_attr: str, prompts: list[dict], max_tokens: int) -> tuple[list, list]:
    """Greedy tokens of `prompts` with the runner's `graphs_attr` graph runner, then with it detached (eager)."""
    runner = granite.engine.runner
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    graphs = getattr(runner, graphs_attr)
    try:
        for attached in (graphs, None):
            setattr(runner, graphs_attr, attached)
            runs.append([o.outputs[0].token_ids for o in granite.generate(prompts, sp, use_tqdm=False)])
    finally:
        setattr(runner, graphs_attr, graphs)
    return runs[0], runs[1]


def test_extend_graph_gives_the_eager_tokens(granite, monkeypatch):
    """Prefills replayed from the full extend graph (the mixer reading the step's tables; the padding is one more
    request, on the sink slot) give the tokens eager prefills give."""
    runner = granite.engine.runner
    graphs = runner.extend_graph_runner
    assert graphs is not None and graphs.mamba_tables is not None
    replays = []
    monkeypatch.setattr(graphs, "replay", lambda batch, replay=graphs.replay: replays.append(batch) or replay(batch))
    graphed, eager = _with_and_without(granite, "extend_graph_runner", _prompts(runner.vocab_size, 4, seed=11),
                                       max_tokens=8)
    assert len(replays) == 1 and replays[0].batch_size == 4  # the graphed run's one prefill step
    assert graphed == eager
    granite.engine.check_memory_leak()


def test_mixed_steps_replay_piecewise_graphs(monkeypatch):
    """With --enable-mixed-chunk a hybrid captures piecewise graphs beside the full extend graph, and its mixed steps
    (a prefill chunk beside decoding rows, which the full graph cannot take) replay from them."""
    llm = LLM("granite-4.0-h-1b", load_format="dummy", max_total_tokens=100_000, max_running_requests=32,
              cuda_graph_bs=[1, 2, 4, 8], enable_mixed_chunk=True, chunked_prefill_size=512,
              piecewise_cuda_graph_tokens=[256, 512], sampler_warm_up="temperature")
    try:
        runner = llm.engine.runner
        assert runner.piecewise_graph_runner is not None and runner.extend_graph_runner is not None
        replays, pieces = [], runner.piecewise_graph_runner
        monkeypatch.setattr(pieces, "replay", lambda batch, run=pieces.replay: replays.append(batch) or run(batch))
        prompts = _prompts(runner.vocab_size, 4, seed=3)
        prompts[-1]["prompt_token_ids"] = (prompts[-1]["prompt_token_ids"] * 20)[:1500]  # three chunks
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        assert replays, "no mixed step replayed piecewise"
        llm.engine.check_memory_leak()
    finally:
        llm.shutdown()


def test_chunked_prefill_continues_the_state(granite):
    """The same prompt, prefilled whole and cut into chunks (by a smaller chunk budget): same tokens."""
    runner = granite.engine.runner
    prompt = _prompts(runner.vocab_size, 1, seed=7)[0]
    prompt["prompt_token_ids"] = (prompt["prompt_token_ids"] * 8)[:1500]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    whole = granite.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    saved = granite.engine.scheduler.chunked_prefill_size
    granite.engine.scheduler.chunked_prefill_size = 333  # cuts mid-chunk of the 256-token SSD chunks
    try:
        cut = granite.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        granite.engine.scheduler.chunked_prefill_size = saved
    # bf16 activations: the two paths differ in rounding only; the first tokens must agree
    assert cut[:4] == whole[:4]


@pytest.mark.parametrize("precision", ["16bit", "tf32"])
@pytest.mark.parametrize("P", [64, 32])  # granite-4.0-h-1b's and -350m's head_dim (48 heads, state 128, 1 group)
@pytest.mark.parametrize("lens", [[2048], [300, 17, 1024, 1, 64, 129]])
def test_ssd_chunk_kernel_at_granite_shapes(P, lens, precision, monkeypatch):
    """The chunked SSD prefill kernels against the float32 torch `ssd_scan` (chunk 256, as the config says), bf16
    activations, nonzero initial states at scattered slots: outputs and final states; the dots on bf16 operands
    (the default) and on tf32 ones."""
    from ostinato.layers.mamba2 import SSD_CHUNK, _heads, discretize_dt, ssd_chunk_table, ssd_scan
    from ostinato.layers.triton_ops import ssd_scan as ssd_module

    monkeypatch.setattr(ssd_module, "SIXTEEN_BIT_DOTS", precision == "16bit")

    H, G, N, T = 48, 1, 128, sum(lens)
    g = torch.Generator().manual_seed(T + P)
    conv_out = torch.randn(T, H * P + 2 * G * N, generator=g).cuda().bfloat16()  # x, B, C: row-strided views
    x, B, C = conv_out.split([H * P, G * N, G * N], dim=-1)
    dt = torch.randn(T, H, generator=g).cuda().bfloat16()
    A_log = torch.log(torch.rand(H, generator=g) * 4 + 0.5).cuda()
    D = (1 + 0.2 * torch.randn(H, generator=g)).cuda()
    dt_bias = (torch.randn(H, generator=g) * 0.5 - 1).cuda()
    state = (0.5 * torch.randn(10, H, P, N, generator=g)).cuda()
    slots = torch.tensor([7, 2, 9, 1, 4, 3][: len(lens)], device="cuda")
    ref_ys, ref_states, start = [], [], 0
    for i, n in enumerate(lens):
        sl = slice(start, start + n)
        xi = x[sl].float().reshape(n, H, P)
        y, s = ssd_scan(xi, discretize_dt(dt[sl], dt_bias, 0.0, float("inf")), -torch.exp(A_log),
                        _heads(B[sl].float(), H, G, N), _heads(C[sl].float(), H, G, N), state[slots[i]], 256)
        ref_ys.append((y + D[:, None] * xi).reshape(n, H * P))
        ref_states.append(s)
        start += n
    ref_y, ref_s = torch.cat(ref_ys), torch.stack(ref_states)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    others = [s for s in range(10) if s not in slots.tolist()]
    untouched = state[others].clone()
    args = (x, dt, B, C, state, slots, A_log, D, dt_bias, 0.0, float("inf"), H, P, G, cu)
    y = ssd_module.ssd_chunk_scan(*args, tuple(t.cuda() for t in ssd_chunk_table(lens)), chunk=SSD_CHUNK)
    torch.cuda.synchronize()
    assert torch.equal(state[others], untouched)
    # the same bf16 inputs, float32 math in both; the kernels' dots round their float32 operands to bf16 (~4e-3
    # relative, as mamba_ssm's kernels do) or tf32 (~5e-4): a relative norm, and elementwise bounds scaled to the
    # values' spread (bf16 operands: a few of millions of entries were past 2e-2 on an H200)
    atol = 4e-2 if precision == "16bit" else 2e-2
    for got, ref in ((y, ref_y), (state[slots], ref_s)):
        assert ((got - ref).norm() / ref.norm()).item() < 5e-3
        torch.testing.assert_close(got, ref, atol=atol * ref.abs().mean().item(), rtol=2e-2)
