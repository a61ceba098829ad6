"""The one-launch decode step on the GPU (Hopper, nvcc): the kernel against its torch twin step by step and at long
contexts, graph replay against eager launches, and the engine's greedy tokens with it on and off."""

import pytest
import torch
import transformers

from ostinato.layers.cuda_ops.build import nvcc_path
from ostinato.megakernel import reference
from ostinato.megakernel.weights import model_layers, model_shape
from ostinato.mem.kv_cache import MHATokenToKVPool
from ostinato.models.llama import LlamaForCausalLM, Qwen3ForCausalLM

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or nvcc_path() is None,
    reason="needs a Hopper GPU and nvcc")

SLOTS = 4096
SHAPES = {  # the two benchmark models' layer shapes, fewer layers and a small vocabulary
    "qwen3": (Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=3, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=SLOTS, tie_word_embeddings=True)),
    "llama": (LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=512, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=SLOTS, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
}


def setup(family: str, seed: int = 0):
    from ostinato.loader import dummy_init_
    from ostinato.megakernel.decode_bs1 import DecodeBs1Megakernel

    cls, config = SHAPES[family]
    dev = torch.device("cuda")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with dev:
            model = cls(config, SLOTS).eval()
    finally:
        torch.set_default_dtype(default)
    model.to(dev)  # as the engine does: tables some rope types build on the CPU (llama3's) follow the parameters
    dummy_init_(model, seed)
    with torch.no_grad():  # norms further from 1 than the dummy's, so that each one's use shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.after_load()
    s = model_shape(model)
    kv = MHATokenToKVPool(SLOTS, torch.bfloat16, s.kv_heads, s.head_dim, s.num_layers, dev)
    for layer in range(s.num_layers):
        for buf in kv.get_kv_buffer(layer):
            buf.normal_()
    return model, kv, DecodeBs1Megakernel(model, kv, dev)


def step_inputs(t: int, slots: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """positions, seq_lens, req_rows, out_loc for token t of request row 1, its slots recorded in the table."""
    table[1, : t + 1] = slots[: t + 1].to(torch.int32)
    dev = table.device
    return (torch.tensor([t], device=dev), torch.tensor([t + 1], device=dev), torch.tensor([1], device=dev),
            slots[t : t + 1].clone())


def run_twin(model, mk, kv_twin, x_in, t, slots):
    s = model_shape(model)
    return reference.decode_step(s, model_layers(model), x_in[0], t, slots[:t], int(slots[t]),
                                 [k for k, _ in kv_twin], [v for _, v in kv_twin], mk.cos_sin, mk.splits)


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    scale = want.float().abs().max().item()
    d = (got.float() - want.float()).abs()
    return d.max().item() / scale, d.mean().item() / scale


@pytest.mark.parametrize("family", list(SHAPES))
def test_kernel_decodes_what_its_twin_does(family):
    """From an empty request, 80 steps: each step's residual stream and the stored K/V match the twin's (same bf16
    weights, float32 torch), to the rounding of sums taken in another order."""
    model, kv, mk = setup(family)
    s = model_shape(model)
    gen = torch.Generator(device="cuda").manual_seed(1)
    slots = torch.randperm(SLOTS - 1, device="cuda", generator=gen)[:80] + 1
    ids = torch.randint(0, 512, (80,), device="cuda", generator=gen)
    table = torch.zeros(2, SLOTS, dtype=torch.int32, device="cuda")
    kv_twin = [tuple(b.clone() for b in kv.get_kv_buffer(i)) for i in range(s.num_layers)]
    worst = (0.0, 0.0)
    for t in range(80):
        x_in = model.embed_tokens(ids[t : t + 1])
        out = mk(x_in, *step_inputs(t, slots, table), table).clone()
        want = run_twin(model, mk, kv_twin, x_in, t, slots)
        err = close(out[0], want)
        worst = max(worst[0], err[0]), max(worst[1], err[1])
    assert worst[0] < 0.02 and worst[1] < 0.002, worst
    for i in range(s.num_layers):
        for got, want in zip(kv.get_kv_buffer(i), kv_twin[i], strict=True):
            err = close(got[slots], want[slots])
            assert err[0] < 0.02 and err[1] < 0.002, (i, err)


@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("context", [200, 700, 3000])
def test_kernel_at_long_contexts(family, context):
    """A request whose first context - 1 keys are random K/V already in the cache (every split in use at 3,000)."""
    model, kv, mk = setup(family, seed=2)
    s = model_shape(model)
    gen = torch.Generator(device="cuda").manual_seed(context)
    slots = torch.randperm(SLOTS - 1, device="cuda", generator=gen)[:context] + 1
    table = torch.zeros(2, SLOTS, dtype=torch.int32, device="cuda")
    kv_twin = [tuple(b.clone() for b in kv.get_kv_buffer(i)) for i in range(s.num_layers)]
    for t in (context - 2, context - 1):
        x_in = model.embed_tokens(torch.randint(0, 512, (1,), device="cuda", generator=gen))
        out = mk(x_in, *step_inputs(t, slots, table), table).clone()
        err = close(out[0], run_twin(model, mk, kv_twin, x_in, t, slots))
        assert err[0] < 0.02 and err[1] < 0.002, (t, err)


def test_graph_replay_equals_eager_launches():
    """The step captured in a CUDA graph and replayed gives the eager launch's result, with eager launches and
    replays interleaved (the counters' epochs carry across both). Not bit for bit: DOWN's partials meet in the
    residual stream by fp32 atomics in the order blocks finish, so two launches differ by fp32 rounding (at most an
    ulp of x_out's bf16 here and there)."""
    model, kv, mk = setup("qwen3", seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    slots = torch.randperm(SLOTS - 1, device="cuda", generator=gen)[:40] + 1
    table = torch.zeros(2, SLOTS, dtype=torch.int32, device="cuda")
    x_in = torch.empty(1, 1024, dtype=torch.bfloat16, device="cuda")
    ins = [t.clone() for t in step_inputs(0, slots, table)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mk(x_in, *ins, table)  # warm-up launch off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mk(x_in, *ins, table)
    for t in range(30):
        x_in.copy_(model.embed_tokens(torch.randint(0, 512, (1,), device="cuda", generator=gen)))
        for buf, new in zip(ins, step_inputs(t, slots, table), strict=True):
            buf.copy_(new)
        eager = mk(x_in, *ins, table).clone()
        graph.replay()
        err = close(captured[0], eager[0])
        assert err[0] < 0.01 and err[1] < 0.001, (t, err)


def test_engine_logprobs_with_and_without(tmp_path):
    """A random Qwen3 of the benchmark's layer shape through LLM.generate, greedy with top-5 logprobs, one request at
    a time: each decode step's logprobs with the one-launch step equal those of the layers' kernels to bf16's
    rounding."""
    from engine_logprobs import assert_logprobs_agree, greedy_logprobs, save_random_checkpoint

    from ostinato import LLM

    save_random_checkpoint(tmp_path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, hidden_size=1024,
                           intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128)
    outs = {}
    for mode in ("off", "on"):
        with LLM(str(tmp_path), dtype="bfloat16", decode_megakernel=mode, max_running_requests=1, max_total_tokens=4096,
                 sampler_warm_up="temperature") as llm:
            assert (llm.engine.runner.decode_megakernel is not None) == (mode == "on")
            outs[mode] = greedy_logprobs(llm)
    assert_logprobs_agree(outs["off"], outs["on"])
