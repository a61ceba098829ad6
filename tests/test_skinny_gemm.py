"""skinny_linear (decode-sized x @ W^T) against a float64 reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors at small shapes, in fp16 only: the
interpreter has no bf16 tl.dot (it multiplies the raw bit patterns) and rounds fp32 -> bf16 by truncation,
so bf16 is checked on the GPU. With a GPU the same small cases run on it, plus the model's shapes in bf16
and fp16 and a CUDA-graph replay.
"""

import os
import re
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from ostinato.layers.triton_ops.skinny_gemm import (  # noqa: E402
    MAX_M,
    SkinnyConfig,
    config_for,
    skinny_linear,
    skinny_linear_op,
    supports,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
cuda = pytest.mark.skipif(not GPU, reason="needs CUDA")
SMALL_DTYPES = [torch.float16] + ([torch.bfloat16] if GPU else [])
# products are exact in fp32 and summed in fp32, so the error is the output's rounding: half an ulp
# (2^-11 fp16, 2^-8 bf16) of the value, plus fp32 summation error next to zero
TOL = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 8e-3)}
REAL_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # (N, K)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = reference(x, w)
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, atol=TOL[x.dtype][0], rtol=TOL[x.dtype][1])
    # fp32 accumulation rounds to the nearest value of the dtype almost everywhere: a bf16/fp16 accumulator
    # or a lost K tile would not
    assert (got == want.to(x.dtype)).double().mean() > 0.95


def run_case(m: int, n: int, k: int, dtype: torch.dtype, seed: int, config: SkinnyConfig | None = None) -> None:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x, w = randn(gen, m, k, dtype=dtype), randn(gen, n, k, dtype=dtype)
    check(skinny_linear(x, w, config=config), x, w)


# ---------------------------------------------------------------- small shapes (interpreter on the CPU)
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])  # FMA kernel up to 4, tl.dot above
# N not a multiple of BLOCK_N; K = 200: only the masked tail tile; K = 50: W rows not 16-byte aligned
@pytest.mark.parametrize("n,k", [(37, 64), (24, 200), (19, 50)])
def test_small(m, n, k, dtype):
    run_case(m, n, k, dtype, seed=m * 1000 + n + k)


# BLOCK_K below K: several full K tiles through the pipeline, then the masked tail (200 = 6 * 32 + 8)
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("m,config", [
    (1, SkinnyConfig(1, 4, 32, False, 4, 3)),
    (3, SkinnyConfig(4, 8, 64, False, 4, 2)),
    (2, SkinnyConfig(2, 16, 16, False, 2, 1)),
    (7, SkinnyConfig(16, 16, 32, True, 4, 3)),
    (16, SkinnyConfig(16, 32, 64, True, 4, 4)),
])
@pytest.mark.parametrize("k", [200, 256])
def test_small_k_tiles(m, config, k, dtype):
    run_case(m, 45, k, dtype, seed=m + k, config=config)


def test_strided_x_and_out():
    """Rows of x and of out may be strided (slices of wider buffers); out is written in place."""
    gen = torch.Generator(DEVICE).manual_seed(7)
    for m, start in ((1, 16), (6, 16), (3, 1)):  # start 1: x not 16-byte aligned
        xs = randn(gen, m, 100, dtype=torch.float16)
        w = randn(gen, 30, 64, dtype=torch.float16)
        out_buf = torch.full((m, 50), 3.0, dtype=torch.float16, device=DEVICE)
        x, out = xs[:, start : start + 64], out_buf[:, 10:40]
        assert skinny_linear(x, w, out=out) is out
        check(out, x, w)
        assert (out_buf[:, :10] == 3.0).all() and (out_buf[:, 40:] == 3.0).all()


def test_empty():
    w = torch.ones(8, 32, dtype=torch.float16, device=DEVICE)
    assert skinny_linear(torch.empty(0, 32, dtype=torch.float16, device=DEVICE), w).shape == (0, 8)


def test_custom_op_registration():
    """Schema and fake kernel of the op that torch.compile sees."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    torch.library.opcheck(skinny_linear_op, (randn(gen, 3, 32, dtype=torch.float16),
                                             randn(gen, 20, 32, dtype=torch.float16)))


def _bad_inputs() -> list[tuple[str, dict]]:
    h = torch.float16
    x, w = torch.randn(2, 32).to(h), torch.randn(8, 32).to(h)
    return [
        ("x.dim()", dict(x=x[None], weight=w)),
        ("weight.dim()", dict(x=x, weight=w[None])),
        ("weight.shape[1]", dict(x=x, weight=torch.randn(8, 16).to(h))),
        ("x.shape[0]", dict(x=torch.randn(MAX_M + 1, 32).to(h), weight=w)),
        ("x.dtype", dict(x=x.float(), weight=w.float())),
        ("weight.dtype", dict(x=x, weight=w.bfloat16())),
        ("weight.device", dict(x=x, weight=w.to("meta"))),
        ("x.stride(1)", dict(x=torch.randn(32, 2).to(h).T, weight=w)),
        ("weight.stride()", dict(x=x, weight=torch.randn(32, 8).to(h).T)),
        ("out.shape", dict(x=x, weight=w, out=torch.empty(8, 2, dtype=h))),
        ("out.dtype", dict(x=x, weight=w, out=torch.empty(2, 8))),
        ("out.device", dict(x=x, weight=w, out=torch.empty(2, 8, dtype=h, device="meta"))),
        ("out.stride(1)", dict(x=x, weight=w, out=torch.empty(8, 2, dtype=h).T)),
    ]


@pytest.mark.parametrize("field,kwargs", _bad_inputs(), ids=[f for f, _ in _bad_inputs()])
def test_bad_inputs_raise(field, kwargs):
    with pytest.raises(ValueError, match=re.escape(field)):
        skinny_linear(**kwargs)


def test_supports_needs_cuda():
    x, w = torch.randn(2, 32).half(), torch.randn(8, 32).half()
    assert not supports(x, w)  # the CPU path is the interpreter, for tests only


@pytest.mark.parametrize("m", range(1, MAX_M + 1))
@pytest.mark.parametrize("n,k", [*REAL_SHAPES, (37, 200), (1, 8)])
def test_config_invariants(m, n, k):
    """What the kernels need of a config, and the register budget of the FMA accumulator."""
    cfg = config_for(m, n, k)
    assert cfg.m_pad >= m and cfg.use_dot == (m > 4)
    for size in (cfg.m_pad, cfg.block_n, cfg.block_k, cfg.num_warps):
        assert size == triton.next_power_of_2(size)
    if cfg.use_dot:
        assert min(cfg.m_pad, cfg.block_n, cfg.block_k) >= 16
    else:
        assert cfg.m_pad * cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= 64
    assert cfg.num_stages >= 2 and cfg.block_k <= max(16, triton.next_power_of_2(k))
    if (n, k) in REAL_SHAPES:
        assert triton.cdiv(n, cfg.block_n) >= 128  # every SM has work
        # x tiles of 128 elements get a scalar shared-memory layout for W (Triton 3.9)
        assert cfg.use_dot or cfg.m_pad * cfg.block_k >= 256


# ---------------------------------------------------------------- real shapes on the GPU
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
@pytest.mark.parametrize("n,k", REAL_SHAPES)
def test_real(n, k, m, dtype):
    run_case(m, n, k, dtype, seed=m)


@cuda
def test_supports_cuda():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    assert supports(x, w) and supports(x[:1], w) and supports(torch.randn(4, 80, device="cuda").bfloat16()[:, :64], w)
    assert not supports(torch.randn(MAX_M + 1, 64, device="cuda").bfloat16(), w)
    assert not supports(x.float(), w.float()) and not supports(x.half(), w) and not supports(x[:0], w)
    assert not supports(x, w.T.contiguous().T) and not supports(x.cpu(), w)


@cuda
def test_cuda_graph():
    """One capture per shape replays on fresh inputs, equal to eager (no atomics: the same bits)."""
    gen = torch.Generator("cuda").manual_seed(0)
    with torch.inference_mode():
        for m in (1, 8):
            x = randn(gen, m, 2048, dtype=torch.bfloat16)
            w = randn(gen, 3072, 2048, dtype=torch.bfloat16)
            out = torch.empty(m, 3072, dtype=torch.bfloat16, device="cuda")
            skinny_linear(x, w, out=out)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                skinny_linear(x, w, out=out)
            x.copy_(randn(gen, m, 2048, dtype=torch.bfloat16))
            w.copy_(randn(gen, 3072, 2048, dtype=torch.bfloat16))
            graph.replay()
            assert torch.equal(out, skinny_linear(x, w))
            check(out, x, w)


@cuda
def test_compile():
    gen = torch.Generator("cuda").manual_seed(1)
    x, w = randn(gen, 4, 2048, dtype=torch.bfloat16), randn(gen, 2048, 2048, dtype=torch.bfloat16)
    with torch.inference_mode():
        compiled = torch.compile(lambda a, b: skinny_linear(a, b), fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x, w), skinny_linear(x, w))


# ---------------------------------------------------------------- the model's Linear layer
def test_linear_routes_by_shape():
    from ostinato.layers.linear import prefers_skinny

    assert prefers_skinny(1, 2048, 2048) and prefers_skinny(16, 2048, 8192) and prefers_skinny(4, 3072, 2048)
    assert not prefers_skinny(8, 3072, 2048) and not prefers_skinny(1, 16384, 2048)
    assert not prefers_skinny(MAX_M + 1, 2048, 2048)


@cuda
@pytest.mark.parametrize("m,n,k,skinny", [(1, 2048, 2048, True), (3, 2048, 8192, True), (8, 3072, 2048, False)])
def test_linear_matches_torch(monkeypatch, m, n, k, skinny):
    from ostinato.layers import linear
    from ostinato.layers.triton_ops import skinny_gemm

    calls = []
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, w: calls.append(1) or skinny_linear(x, w))
    gen = torch.Generator("cuda").manual_seed(m)
    layer = linear.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer.weight.data = randn(gen, n, k, dtype=torch.bfloat16)
    x = randn(gen, m, k, dtype=torch.bfloat16)
    check(layer(x), x, layer.weight)
    assert bool(calls) == skinny
