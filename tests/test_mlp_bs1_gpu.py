"""The one-row MLP kernel on the GPU (Hopper, nvcc): against its torch twin at the benchmark models' shapes and odd
ones, launch after launch (its scratch left zero), replayed from a CUDA graph, and in the engine with the flag on
and off."""

import pytest
import torch
import transformers

from ostinato.layers.cuda_ops import mlp_bs1
from ostinato.layers.cuda_ops.build import nvcc_path

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or nvcc_path() is None,
    reason="needs a Hopper GPU and nvcc")


def weights(hidden: int, inter: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).to(torch.bfloat16)
    down = (torch.randn(hidden, inter, device="cuda", generator=g) * inter**-0.5).to(torch.bfloat16)
    return gate_up, down


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    scale = want.float().abs().max().item()
    d = (got.float() - want.float()).abs()
    return d.max().item() / scale, d.mean().item() / scale


@pytest.mark.parametrize(("hidden", "inter", "grid", "copies"), [
    (2048, 8192, None, 1), (2048, 8192, None, 4), (1024, 3072, None, 8), (512, 1000, None, 3), (512, 1000, 7, 4),
    (4096, 2048, None, 2), (256, 96, None, 4)])
def test_kernel_computes_what_its_twin_does(hidden, inter, grid, copies):
    grid = grid or torch.cuda.get_device_properties(0).multi_processor_count
    gate_up, down = weights(hidden, inter, hidden + inter)
    scratch = mlp_bs1.MlpScratch(hidden, torch.device("cuda"))
    kernel = mlp_bs1.MlpBs1(gate_up, down, 1e-5, scratch, grid, copies=copies)
    for seed in range(3):  # launch after launch on the same scratch
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(1, hidden, device="cuda", generator=g).to(torch.bfloat16)
        residual = (4 * torch.randn(1, hidden, device="cuda", generator=g)).to(torch.bfloat16)
        y, h = kernel(x, residual)
        want_y, want_h = mlp_bs1.reference(x[0], residual[0], gate_up, kernel.down_t, 1e-5, kernel.grid)
        assert torch.equal(h[0], want_h)
        worst, mean = close(y[0], want_y)
        assert worst < 0.02 and mean < 0.002, (seed, worst, mean)
        torch.cuda.synchronize()
        assert not scratch.acc.any() and not scratch.count.any()  # left zero for the next launch


def test_graph_replay_equals_eager_launches():
    """Captured with the launches around it (PDL inside the graph), replayed on new inputs: the eager launch's
    outputs to fp32's order of summation."""
    hidden, inter = 2048, 8192
    gate_up, down = weights(hidden, inter, 1)
    kernel = mlp_bs1.MlpBs1(gate_up, down, 1e-5, mlp_bs1.MlpScratch(hidden, torch.device("cuda")),
                            torch.cuda.get_device_properties(0).multi_processor_count, copies=4)
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    residual = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel(x * 2, residual)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = x * 2  # a kernel before and after the launch, as in a layer
        y, h = kernel(a, residual)
        out = y.float() + 1
    for seed in range(3):
        x.copy_(torch.randn(1, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        want_y, want_h = kernel(x * 2, residual)
        assert torch.equal(h, want_h)
        worst, mean = close(out - 1, want_y.float())
        assert worst < 0.01 and mean < 0.001, (seed, worst, mean)


def test_engine_logprobs_with_and_without(tmp_path):
    """A random Llama of Llama-3.2-1B's MLP widths through LLM.generate, greedy with top-5 logprobs, one request at a
    time: each decode step's logprobs with the kernel equal those of the layers' kernels to bf16's rounding."""
    from engine_logprobs import assert_logprobs_agree, greedy_logprobs, save_random_checkpoint

    from ostinato import LLM

    save_random_checkpoint(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM, hidden_size=2048,
                           intermediate_size=8192, num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=8)
    outs = {}
    for mode in ("off", "on"):
        with LLM(str(tmp_path), dtype="bfloat16", decode_mlp_kernel=mode, max_running_requests=1, max_total_tokens=4096,
                 sampler_warm_up="temperature") as llm:
            runner = llm.engine.runner
            assert runner.one_row_mlp == (mode == "on")
            assert all((layer.mlp.one_row is not None) == (mode == "on") for layer in runner.model.layers)
            outs[mode] = greedy_logprobs(llm)
    assert_logprobs_agree(outs["off"], outs["on"])
