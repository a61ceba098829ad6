"""wide_linear (x @ W^T with W's rows on the MMA's M side, 5-64 rows) plain, gated and gated after a deferred
RMSNorm, against float64 references and against the ops the engine ran before it (cuBLAS, silu_and_mul).

Without a GPU the kernel runs in Triton's interpreter at small shapes in fp16 (the interpreter has no bf16
tl.dot); with one, the same cases, the models' shapes in bf16 and a CUDA-graph replay.
"""

import re

import pytest

pytest.importorskip("triton", reason="the Triton kernel (or its CPU interpreter, conftest.py) needs triton")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ostinato.layers.activation import silu_and_mul_torch  # noqa: E402
from ostinato.layers.triton_ops.wide_gemm import WideConfig, config_for, supports, wide_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
cuda = pytest.mark.skipif(not GPU, reason="needs CUDA")
EPS = 1e-6


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def reference(x: torch.Tensor, w: torch.Tensor, gated: bool, norm: bool) -> torch.Tensor:
    """float64: x @ W^T; gated: silu(gate) * up, gate and up first scaled by x's rows' inverse RMS where `norm`."""
    y = x.double() @ w.double().T
    if not gated:
        return y
    if norm:
        y = y * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def engine_before(x: torch.Tensor, w: torch.Tensor, gated: bool, norm: bool) -> torch.Tensor:
    """What the engine ran at these rows before: the projection in the dtype, then silu_and_mul (its torch twin
    rounds as the kernel does)."""
    y = F.linear(x.float(), w.float()).to(x.dtype)
    return silu_and_mul_torch(y, norm=(x, EPS) if norm else None) if gated else y


def run_case(m: int, n: int, k: int, dtype: torch.dtype, gated: bool, norm: bool, seed: int,
             config: WideConfig | None = None) -> None:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    # x unnormalised as the residual stream is (rows of RMS 3), W scaled so outputs are O(1)
    x = randn(gen, m, k, dtype=dtype, scale=3.0)
    w = randn(gen, 2 * n if gated else n, k, dtype=dtype, scale=(1.0 if norm else 1 / 3) / k**0.5)
    got = wide_linear(x, w, gated=gated, norm_eps=EPS if norm else None, config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    want = reference(x, w, gated, norm)
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    # the output's rounding (gated: gate, up, silu and the product each rounded once, and the norm's scale)
    tol = (4 if gated else 1) * ulp
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    before = engine_before(x, w, gated, norm)
    # the same roundings in the same order as the ops it replaces: apart by one rounding step at most, here and there
    assert ((got.double() - before.double()).abs() <= tol * (1 + before.double().abs())).all()
    assert (got == before).float().mean() > 0.9


SMALL = [  # (m, n, k): N past the tile (clamped rows), several K tiles, M at both paddings
    (5, 96, 128), (8, 200, 192), (17, 72, 256), (32, 130, 64), (40, 70, 128),
]


@pytest.mark.parametrize("m,n,k", SMALL)
@pytest.mark.parametrize("gated,norm", [(False, False), (True, False), (True, True)])
def test_small(m, n, k, gated, norm):
    run_case(m, n, k, torch.float16, gated, norm, seed=m * 1000 + n + k,
             config=WideConfig(max(16, 1 << (m - 1).bit_length()), 64, 64, 4, 2))


@pytest.mark.parametrize("config", [WideConfig(32, 32, 128, 4, 3), WideConfig(32, 128, 64, 4, 2),
                                    WideConfig(64, 32, 128, 4, 4)])  # the last: config_for's, 33-64 rows, few programs
def test_small_tiles(config):
    run_case(12, 150, 256, torch.float16, True, True, seed=3, config=config)


def test_config_invariants():
    """Every config the rule picks fits what the kernel needs: M padded to the MMA's N side (>= 16), K tiles that
    divide the models' K, at least one program an SM where the width allows."""
    for m in (5, 8, 16, 17, 32, 33, 64):
        for n, k, gated in ((3072, 2048, False), (8192, 2048, True), (4096, 1024, False), (3072, 1024, True)):
            cfg = config_for(m, n, k, gated)
            assert cfg.m_pad >= max(m, 16) and k % cfg.block_k == 0 and cfg.block_n >= 32
            assert -(-n // cfg.block_n) >= 48


def test_bad_inputs_raise():
    x, w = torch.randn(8, 100).half(), torch.randn(256, 100).half()
    with pytest.raises(ValueError, match=re.escape("x.shape[1] (K = 100)")):
        wide_linear(x, w)
    with pytest.raises(ValueError, match="norm_eps needs gated=True"):
        wide_linear(x[:, :64], w[:, :64], norm_eps=1e-6)
    with pytest.raises(ValueError, match=re.escape("x.shape[0] (M = 65)")):
        wide_linear(torch.randn(65, 64).half(), w[:, :64])
    with pytest.raises(ValueError, match=re.escape("weight.shape[1] (128)")):
        wide_linear(x[:, :64], torch.randn(256, 128).half())
    with pytest.raises(ValueError, match=re.escape("weight.shape[0] (2I = 255)")):
        wide_linear(x[:, :64], torch.randn(255, 64).half(), gated=True)


def test_supports_needs_cuda_and_rows():
    x, w = torch.randn(8, 64).half(), torch.randn(256, 64).half()
    assert not supports(x, w)  # the CPU path is the interpreter, for tests only
    if GPU:
        xc, wc = x.cuda(), w.cuda()
        assert supports(xc, wc) and supports(xc, wc, gated=True)
        assert not supports(xc[:4], wc) and not supports(torch.randn(65, 64).half().cuda(), wc)
        assert not supports(torch.randn(8, 96).half().cuda(), torch.randn(256, 96).half().cuda())  # K % 64


@cuda
@pytest.mark.parametrize("m", [5, 8, 16, 24, 32, 48, 64])
@pytest.mark.parametrize("n,k,gated", [(3072, 2048, False), (8192, 2048, True), (4096, 1024, False),
                                       (3072, 1024, True), (6448, 1536, False)])
def test_real(m, n, k, gated):
    """The models' wide shapes (Llama-3.2-1B's and Qwen3-0.6B's qkv and gate_up, Granite-4.0-H-1B's in_proj) in
    bf16 at the rule's tiles."""
    run_case(m, n, k, torch.bfloat16, gated, gated, seed=m + n)


@cuda
def test_cuda_graph():
    """A captured call replays to the eager result on new inputs copied into its buffers."""
    gen = torch.Generator(DEVICE).manual_seed(11)
    x = randn(gen, 20, 1024, dtype=torch.bfloat16, scale=3.0)
    w = randn(gen, 2 * 3072, 1024, dtype=torch.bfloat16, scale=1 / 32)
    wide_linear(x, w, gated=True, norm_eps=EPS)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = wide_linear(x, w, gated=True, norm_eps=EPS)
    x.copy_(randn(gen, 20, 1024, dtype=torch.bfloat16, scale=3.0))
    graph.replay()
    torch.testing.assert_close(y, wide_linear(x, w, gated=True, norm_eps=EPS), atol=0, rtol=0)


@cuda
def test_linear_routes_wide_shapes(monkeypatch):
    """layers/linear.py sends wide weights (N > K) at 5-64 rows here, plain and gated, and nothing else;
    OSTINATO_WIDE_GEMM=0 (WIDE_GEMM False) sends none."""
    from ostinato.layers import linear

    gen = torch.Generator(DEVICE).manual_seed(5)
    w = randn(gen, 3072, 1024, dtype=torch.bfloat16, scale=1 / 32)
    for m, wide in ((4, False), (5, True), (64, True), (65, False)):
        x = randn(gen, m, 1024, dtype=torch.bfloat16)
        y = linear.try_wide(x, w)
        assert (y is not None) == wide
        if wide:
            assert torch.equal(linear.cuda_linear(x, w), y)
            assert torch.equal(linear.cuda_gate_up_silu(x, w), wide_linear(x, w, gated=True))
    x = randn(gen, 8, 1024, dtype=torch.bfloat16)
    assert linear.try_wide(x, randn(gen, 1024, 1024, dtype=torch.bfloat16)) is None  # N <= K: the skinny kernel's
    monkeypatch.setattr(linear, "WIDE_GEMM", False)
    assert linear.try_wide(x, w) is None
