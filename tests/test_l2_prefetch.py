"""The decode GEMVs' L2 prefetch of the next weight (layers/triton_ops/l2_prefetch.py). The prefetch instructions are
PTX, which Triton's interpreter cannot run: on the CPU the partition of the lines over the grid, the recorded order of
weights and the links are tested; on a GPU, that a linked GEMV and a decode step with the prefetch give the bits they
give without it."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ostinato.layers.triton_ops import l2_prefetch  # noqa: E402
from ostinato.layers.triton_ops.skinny_gemm import skinny_linear  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@triton.jit
def _shares_kernel(Out, lines):
    first, count = l2_prefetch.share(lines, tl.program_id(0), tl.num_programs(0))
    tl.store(Out + tl.program_id(0) * 2, first)
    tl.store(Out + tl.program_id(0) * 2 + 1, count)


@pytest.mark.parametrize("lines,programs", [(1, 1), (7, 3), (100, 132), (12_288, 96), (65_536, 512), (5, 9)])
def test_shares_cover_every_line_once(lines, programs):
    out = torch.full((programs, 2), -1, dtype=torch.int32, device=DEVICE)
    _shares_kernel[(programs,)](out, lines)
    covered = torch.zeros(lines, dtype=torch.int32)
    for first, count in out.cpu().tolist():
        assert count >= 0
        covered[first : first + count] += 1
    assert covered.eq(1).all(), "a line prefetched twice or never"


def test_record_then_link_points_each_weight_at_the_next():
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16) for n, k in [(64, 96), (48, 64), (200, 48)]]
    x = torch.randn(1, 96, generator=gen).to(DEVICE, torch.bfloat16)
    with l2_prefetch.record() as seen:
        h = x
        for w in weights:
            h = skinny_linear(h, w)  # the interpreter on the CPU
    l2_prefetch.note(weights[0])  # after the block: not recorded
    assert [w.data_ptr() for w in seen] == [w.data_ptr() for w in weights]
    with l2_prefetch.linked(seen, max_bytes=8192) as links:
        assert links == 2
        nxt, numel = l2_prefetch.next_for(weights[0])
        assert nxt is weights[1] and numel == 48 * 64  # 6144 bytes: all of it, whole 128-byte lines
        nxt, numel = l2_prefetch.next_for(weights[1])
        assert nxt is weights[2] and numel == 8192 // 2  # capped at max_bytes
        assert l2_prefetch.next_for(weights[2]) is None  # the last one prefetches nothing
    assert l2_prefetch.next_for(weights[0]) is None, "links outlive the capture"


def test_link_rounds_down_to_whole_lines():
    a, b = torch.empty(8, 8, dtype=torch.bfloat16), torch.empty(3, 33, dtype=torch.bfloat16)  # b: 198 bytes
    with l2_prefetch.linked([a, b], max_bytes=1 << 20):
        assert l2_prefetch.next_for(a)[1] == 64  # one line of 64 bf16 elements
    with l2_prefetch.linked([a, b[:1, :10]], max_bytes=1 << 20) as links:  # 20 bytes: under a line
        assert links == 0


@pytest.mark.skipif(not GPU, reason="needs CUDA (the prefetch is PTX)")
@pytest.mark.parametrize("mode", [l2_prefetch.BULK, l2_prefetch.LINES])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 1024), (2, 1024, 3072), (8, 2048, 2048)])
def test_linked_gemv_gives_the_bits_without(m, n, k, mode, monkeypatch):
    monkeypatch.setattr(l2_prefetch, "MODE", mode)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k**0.5
    nxt = torch.randn(3 << 20, generator=gen, device="cuda", dtype=torch.bfloat16)
    plain = skinny_linear(x, w)
    with l2_prefetch.linked([w, nxt], max_bytes=4 << 20):
        linked = skinny_linear(x, w)
    torch.cuda.synchronize()
    assert torch.equal(plain, linked)


@pytest.mark.skipif(not (GPU and torch.cuda.get_device_capability()[0] >= 9), reason="needs a Hopper GPU")
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-0.6b"])
def test_decode_with_l2_prefetch_gives_the_bits_without(model):
    from ostinato import LLM, SamplingParams

    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 30_000, (int(n),), generator=gen).tolist()} for n in (5, 130, 47)]
    runs = []
    for mb in (0, 16):
        llm = LLM(model, load_format="dummy", max_total_tokens=20_000, max_running_requests=4, cuda_graph_bs=[1, 2, 4],
                  disable_radix_cache=True, decode_l2_prefetch_mb=mb)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
                                use_tqdm=False)
            outs += llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                             logprobs=2), use_tqdm=False)  # bs 1
        finally:
            llm.shutdown()
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert runs[0] == runs[1]
