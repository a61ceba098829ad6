"""skinny_linear (decode-sized x @ W^T) and skinny_gate_up_silu (silu_and_mul of it, fused) against
float64 references and against each other.

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

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from ostinato.layers.activation import silu_and_mul, silu_and_mul_torch  # noqa: E402
from ostinato.layers.triton_ops.skinny_gemm import (  # noqa: E402
    MAX_M,
    SkinnyConfig,
    config_for,
    skinny_gate_up_silu,
    skinny_gate_up_silu_op,
    skinny_linear,
    skinny_linear_op,
    supports,
    supports_gate_up,
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


def captured(fn) -> "torch.cuda.CUDAGraph":
    """`fn` run once (Triton compiles outside the capture), then captured into a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_case(m: int, n: int, k: int, dtype: torch.dtype, seed: int, config: SkinnyConfig | None = None) -> None:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x, w = randn(gen, m, k, dtype=dtype), randn(gen, n, k, dtype=dtype)
    check(skinny_linear(x, w, config=config), x, w)


# ---------------------------------------------------------------- small shapes (interpreter on the CPU)
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 32])  # FMA kernel up to 4, tl.dot above (x padded to 32 past 16)
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
    (24, SkinnyConfig(32, 16, 64, True, 4, 4)),
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


def _bad_inputs(gated: bool = False) -> list[tuple[str, dict]]:
    h = torch.float16
    x, w = torch.randn(2, 32).to(h), torch.randn(8, 32).to(h)
    n = 4 if gated else 8  # out's width
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
        ("out.dtype", dict(x=x, weight=w, out=torch.empty(2, n))),
        ("out.device", dict(x=x, weight=w, out=torch.empty(2, n, dtype=h, device="meta"))),
        ("out.stride(1)", dict(x=x, weight=w, out=torch.empty(n, 2, dtype=h).T)),
    ] + ([("weight.shape[0]", dict(x=x, weight=torch.randn(7, 32).to(h)))] if gated else [])


@pytest.mark.parametrize("field,kwargs", _bad_inputs(), ids=[f for f, _ in _bad_inputs()])
def test_bad_inputs_raise(field, kwargs):
    with pytest.raises(ValueError, match=re.escape(field)):
        skinny_linear(**kwargs)


@pytest.mark.parametrize("field,kwargs", [
    ("add.shape", dict(add=torch.randn(2, 4).half())),
    ("add.dtype", dict(add=torch.randn(2, 8))),
    ("add.stride(1)", dict(add=torch.randn(8, 2).half().T)),
])
def test_add_bad_inputs_raise(field, kwargs):
    x, w = torch.randn(2, 32).half(), torch.randn(8, 32).half()
    with pytest.raises(ValueError, match=re.escape(field)):
        skinny_linear(x, w, **kwargs)


@pytest.mark.parametrize("m", [3, 8, 20])  # the FMA form; the tensor-core form with x padded to 16, to 32
def test_add_epilogue(m):
    """skinny_linear(..., add=r) adds r in the epilogue: the bits of skinny_linear(x, w) + r (the output rounded
    to the dtype, then the sum), in one launch."""
    gen = torch.Generator(DEVICE).manual_seed(m)
    x, w = randn(gen, m, 96, dtype=torch.float16), randn(gen, 40, 96, dtype=torch.float16)
    r = randn(gen, m, 40, dtype=torch.float16) * 8
    got = skinny_linear(x, w, add=r)
    assert torch.equal(got, skinny_linear(x, w) + r)
    torch.testing.assert_close(got.double(), reference(x, w) + r.double(), atol=3e-2, rtol=2e-3)


@pytest.mark.parametrize("field,kwargs", _bad_inputs(gated=True), ids=[f for f, _ in _bad_inputs(gated=True)])
def test_gate_up_bad_inputs_raise(field, kwargs):
    with pytest.raises(ValueError, match=re.escape(field)):
        skinny_gate_up_silu(**kwargs)


def test_supports_needs_cuda():
    x, w = torch.randn(2, 32).half(), torch.randn(8, 32).half()
    assert not supports(x, w) and not supports_gate_up(x, w)  # the CPU path is the interpreter, for tests only


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


def test_prefetch_lines(monkeypatch):
    """Lines of each W row asked of L2 before the PDL wait: the first K tiles of the form's count, in 128-byte
    lines, a power of two; none when the count is 0."""
    from ostinato.layers.triton_ops import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "PREFETCH_TILES", (2, 1))
    fma, dot = config_for(1, 2048, 2048), config_for(32, 2048, 2048)
    assert skinny_gemm.prefetch_lines(fma, 2) == triton.next_power_of_2(2 * fma.block_k * 2 // 128)
    assert skinny_gemm.prefetch_lines(dot, 2) == triton.next_power_of_2(dot.block_k * 2 // 128)
    assert skinny_gemm.prefetch_lines(SkinnyConfig(1, 4, 16, False, 4, 3), 2) == 1  # a tile under a line
    monkeypatch.setattr(skinny_gemm, "PREFETCH_TILES", (0, 0))
    assert skinny_gemm.prefetch_lines(fma, 2) == 0 == skinny_gemm.prefetch_lines(dot, 2)
    for value, tiles in (("2,1", (2, 1)), ("3", (3, 3)), ("0", (0, 0))):
        monkeypatch.setenv("OSTINATO_GEMV_PREFETCH_TILES", value)
        assert skinny_gemm._prefetch_tiles() == tiles
    for bad in ("x", "1,2,3", "-1", ""):
        monkeypatch.setenv("OSTINATO_GEMV_PREFETCH_TILES", bad)
        with pytest.raises(ValueError, match="OSTINATO_GEMV_PREFETCH_TILES"):
            skinny_gemm._prefetch_tiles()


# ---------------------------------------------------------------- real shapes on the GPU
@cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8, 32])
def test_prefetch_changes_no_bits(monkeypatch, m):
    """The L2 prefetch before the PDL wait (Hopper) leaves every output bit as it was, plain, gated and pre-norm."""
    from ostinato.layers.triton_ops import skinny_gemm

    gen = torch.Generator("cuda").manual_seed(m)
    x, w = randn(gen, m, 2048, dtype=torch.bfloat16), randn(gen, 4096, 2048, dtype=torch.bfloat16)
    r = randn(gen, m, 2048, dtype=torch.bfloat16)

    def outputs():
        outs = [skinny_linear(x, w), skinny_linear(x, w[:2048], add=r)]
        if m <= 4:
            outs.append(skinny_gate_up_silu(x, w))
        if m <= 2:
            outs += list(skinny_gemm.skinny_norm_linear(x, w, 1e-6, r))
        return outs

    with torch.inference_mode():
        monkeypatch.setattr(skinny_gemm, "PREFETCH_TILES", (0, 0))
        plain = outputs()
        monkeypatch.setattr(skinny_gemm, "PREFETCH_TILES", (4, 2))
        for a, b in zip(outputs(), plain, strict=True):
            assert torch.equal(a, b)
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
            graph = captured(lambda x=x, w=w, out=out: skinny_linear(x, w, out=out))
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

    assert prefers_skinny(1, 2048, 2048) and prefers_skinny(32, 2048, 8192) and prefers_skinny(4, 3072, 2048)
    assert prefers_skinny(16, 3072, 2048) and not prefers_skinny(17, 3072, 2048) and not prefers_skinny(33, 2048, 2048)
    assert not prefers_skinny(1, 16384, 2048)  # gate_up
    assert prefers_skinny(16, 6448, 1536) and not prefers_skinny(17, 6448, 1536)  # Granite-4.0-H-1B's in_proj
    assert prefers_skinny(16, 4096, 1024) and not prefers_skinny(17, 4096, 1024)  # Qwen3-0.6B's qkv
    assert prefers_skinny(32, 2048, 2048) and prefers_skinny(17, 1024, 3072)  # o / down shapes up to 32 rows
    assert not prefers_skinny(32, 3072, 2048) and not prefers_skinny(24, 6144, 1024)
    assert not prefers_skinny(MAX_M + 1, 2048, 2048)


@cuda
@pytest.mark.parametrize("m,n,k,skinny", [(1, 2048, 2048, True), (3, 2048, 8192, True), (8, 3072, 2048, False),
                                          (32, 1024, 3072, True), (32, 3072, 2048, False)])
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


# ---------------------------------------------------------------- skinny_gate_up_silu
# gate and up are rounded to the dtype and the product is too, as in silu_and_mul: about two half-ulps of the
# output, more where silu is steep next to its rounded gate; x is scaled so that gate and up are O(1)
GATE_UP_TOL = {torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3.2e-2)}
MANTISSA = {torch.float16: 10, torch.bfloat16: 7}


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's ulp in want's dtype (subnormal spacing next to zero)."""
    finfo = torch.finfo(want.dtype)
    _, exp = torch.frexp(want.float())
    ulp = torch.ldexp(torch.ones_like(exp, dtype=torch.float64), exp - 1 - MANTISSA[want.dtype])
    ulp = torch.where(want.abs() < finfo.smallest_normal, finfo.smallest_normal * finfo.eps, ulp)
    return (got.double() - want.double()).abs() / ulp


def gate_up_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_inputs(m: int, i: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return randn(gen, m, k, dtype=torch.float32).mul(k**-0.5).to(dtype), randn(gen, 2 * i, k, dtype=dtype)


def check_gate_up(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, unfused: torch.Tensor) -> None:
    """Against the float64 reference, and against `unfused` (silu_and_mul of skinny_linear): the same fp32
    sums rounded to the dtype, then the same silu and product roundings, so the same bits, up to the exp: the
    unfused silu's exp (torch's on the CPU, Triton's on the GPU) may differ from the kernel's by an fp32 ulp,
    which moves the rounded silu by one ulp of the dtype when it sits on a rounding boundary (about 1 in 2^13
    on the CPU; never on the GPU, where both are Triton's tl.exp)."""
    want = gate_up_reference(x, w)
    assert got.shape == want.shape == unfused.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, atol=GATE_UP_TOL[x.dtype][0], rtol=GATE_UP_TOL[x.dtype][1])
    assert ulps(got, unfused).max() <= 1
    assert (got == unfused).double().mean() >= 0.99


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 32])  # FMA kernel up to 4, tl.dot above (x padded to 32 past 16)
# I not a multiple of BLOCK_N; K = 200: the masked tail tile only; K = 50: rows not 16-byte aligned
@pytest.mark.parametrize("i,k", [(37, 200), (19, 50)])
def test_gate_up_small(m, i, k):
    x, w = gate_up_inputs(m, i, k, torch.float16, seed=m * 1000 + i + k)
    # the default configs sum in the same order (config_for(gated=True) is skinny_linear's on W, block_n halved)
    check_gate_up(skinny_gate_up_silu(x, w), x, w, silu_and_mul_torch(skinny_linear(x, w)))


# several full K tiles through the pipeline, then the masked tail (200 = 6 * 32 + 8); I = 45 not a multiple
# of BLOCK_N
@pytest.mark.parametrize("m,config", [
    (1, SkinnyConfig(1, 4, 32, False, 4, 3)),
    (3, SkinnyConfig(4, 8, 64, False, 4, 2)),
    (4, SkinnyConfig(4, 2, 16, False, 2, 1)),
    (7, SkinnyConfig(16, 16, 32, True, 4, 3)),
])
def test_gate_up_k_tiles(m, config):
    x, w = gate_up_inputs(m, 45, 200, torch.float16, seed=m)
    # block_k sets the summation order: the same config gives skinny_linear the same sums
    check_gate_up(skinny_gate_up_silu(x, w, config=config), x, w,
                  silu_and_mul_torch(skinny_linear(x, w, config=config)))


def test_gate_up_strided_x_and_out():
    for m, start in ((1, 16), (6, 16), (3, 1)):  # start 1: x not 16-byte aligned
        xs, w = gate_up_inputs(m, 15, 100, torch.float16, seed=m)
        out_buf = torch.full((m, 50), 3.0, dtype=torch.float16, device=DEVICE)
        x, out = xs[:, start : start + 64], out_buf[:, 10:25]
        w = w[:, :64].contiguous()
        assert skinny_gate_up_silu(x, w, out=out) is out
        check_gate_up(out, x, w, silu_and_mul_torch(skinny_linear(x, w)))
        assert (out_buf[:, :10] == 3.0).all() and (out_buf[:, 25:] == 3.0).all()


def test_gate_up_empty():
    h = torch.float16
    w = torch.ones(8, 32, dtype=h, device=DEVICE)
    assert skinny_gate_up_silu(torch.empty(0, 32, dtype=h, device=DEVICE), w).shape == (0, 4)
    y = skinny_gate_up_silu(torch.empty(2, 0, dtype=h, device=DEVICE), torch.empty(8, 0, dtype=h, device=DEVICE))
    assert y.shape == (2, 4) and (y == 0).all()


def test_gate_up_custom_op_registration():
    x, w = gate_up_inputs(3, 10, 32, torch.float16, seed=0)
    torch.library.opcheck(skinny_gate_up_silu_op, (x, w))


@pytest.mark.parametrize("m", range(1, MAX_M + 1))
@pytest.mark.parametrize("i,k", [(8192, 2048), (4096, 2048), (2048, 2048), (37, 200), (1, 8)])
def test_gate_up_config(m, i, k):
    """A gated program reads 2 * block_n rows: the tiles of skinny_linear on W [2I, K] (FMA: block_n halved,
    the same block_k and so the same sums), the grid the same, the register budget the same."""
    cfg = config_for(m, i, k, gated=True)
    assert cfg.m_pad >= m and cfg.use_dot == (m > 4) and cfg.num_stages >= 2
    for size in (cfg.m_pad, cfg.block_n, cfg.block_k, cfg.num_warps):
        assert size == triton.next_power_of_2(size)
    plain = config_for(m, 2 * i, k)
    if cfg.use_dot:
        assert cfg.block_n == 16 and cfg.block_k >= 16
    else:
        assert cfg == plain._replace(block_n=plain.block_n // 2)
        assert 2 * cfg.m_pad * cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= 64
    if i >= 2048:
        assert triton.cdiv(i, cfg.block_n) >= 128  # every SM has work


@cuda
def test_supports_gate_up_cuda():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    assert supports_gate_up(x, w) and supports_gate_up(torch.randn(MAX_M, 64, device="cuda").bfloat16(), w)
    assert not supports_gate_up(x, w[:95]) and not supports_gate_up(x, w.T.contiguous().T)
    assert not supports_gate_up(torch.randn(MAX_M + 1, 64, device="cuda").bfloat16(), w)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_gate_up_real(m, dtype):
    """Llama-3.2-1B's gate_up (I = 8192, K = 2048) against silu_and_mul over cuBLAS (tolerance) and over
    skinny_linear (the same bits expected; at most an ulp asserted)."""
    x, w = gate_up_inputs(m, 8192, 2048, dtype, seed=m)
    got = skinny_gate_up_silu(x, w)
    torch.testing.assert_close(got, silu_and_mul(F.linear(x, w)), atol=GATE_UP_TOL[dtype][0],
                               rtol=GATE_UP_TOL[dtype][1])
    check_gate_up(got, x, w, silu_and_mul(skinny_linear(x, w)))


@cuda
def test_gate_up_cuda_graph():
    with torch.inference_mode():
        for m in (1, 4, 8):
            x, w = gate_up_inputs(m, 8192, 2048, torch.bfloat16, seed=m)
            out = torch.empty(m, 8192, dtype=torch.bfloat16, device="cuda")
            graph = captured(lambda x=x, w=w, out=out: skinny_gate_up_silu(x, w, out=out))
            x2, w2 = gate_up_inputs(m, 8192, 2048, torch.bfloat16, seed=m + 100)
            x.copy_(x2)
            w.copy_(w2)
            graph.replay()
            assert torch.equal(out, skinny_gate_up_silu(x, w))
            check_gate_up(out, x, w, silu_and_mul(skinny_linear(x, w)))


@cuda
def test_gate_up_compile():
    x, w = gate_up_inputs(4, 2048, 2048, torch.bfloat16, seed=1)
    with torch.inference_mode():
        compiled = torch.compile(lambda a, b: skinny_gate_up_silu(a, b), fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x, w), skinny_gate_up_silu(x, w))


@cuda
@pytest.mark.parametrize("m,fused", [(1, True), (4, True), (8, False)])
def test_gate_up_silu_layer(monkeypatch, m, fused):
    from ostinato.layers import linear
    from ostinato.layers.activation import silu_and_mul
    from ostinato.layers.triton_ops import skinny_gemm

    calls = []
    real = skinny_gemm.skinny_gate_up_silu
    monkeypatch.setattr(skinny_gemm, "skinny_gate_up_silu", lambda x, w: calls.append(1) or real(x, w))
    gen = torch.Generator("cuda").manual_seed(m)
    layer = linear.Linear(2048, 2 * 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    layer.weight.data = randn(gen, 2 * 4096, 2048, dtype=torch.bfloat16)
    x = randn(gen, m, 2048, dtype=torch.bfloat16) * 2048**-0.5
    torch.testing.assert_close(linear.gate_up_silu(layer, x), silu_and_mul(layer(x)), atol=2e-2, rtol=3e-2)
    assert bool(calls) == fused


# ---------------------------------------------------------------- skinny_norm_linear (the RMSNorm folded in)
def prenorm_inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int, gated: bool = False):
    """x and residual O(1) (as a residual stream is), a norm weight around 1, W scaled so outputs are O(1)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x, residual = randn(gen, m, k, dtype=dtype), randn(gen, m, k, dtype=dtype)
    norm_w = (1 + 0.3 * randn(gen, k, dtype=torch.float32)).to(dtype)
    w = (randn(gen, (2 if gated else 1) * n, k, dtype=torch.float32) * k**-0.5).to(dtype)
    return x, residual, norm_w, w


def prenorm_reference(x, residual, norm_w, w, eps, gated):
    """float64 norm and projection of the row the kernel sees: x + residual rounded to the dtype."""
    s = (x if residual is None else (x.float() + residual.float()).to(x.dtype)).double()
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()
    y = h @ w.double().T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, s.to(x.dtype)


def folded(w: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    """W with the norm's weight multiplied into its columns, as norm_linear.fold_norm_weight leaves it."""
    return w * norm_w[None, :]


def check_prenorm(m, n, k, dtype, seed, gated, config=None, with_residual=True):
    from ostinato.layers.triton_ops.skinny_gemm import skinny_norm_linear

    x, residual, norm_w, w = prenorm_inputs(m, n, k, dtype, seed, gated)
    residual = residual if with_residual else None
    out, new_residual = skinny_norm_linear(x, folded(w, norm_w), 1e-6, residual, gated=gated, config=config)
    # the reference uses the folded weights too: the kernel is checked, the fold's rounding of W separately
    want, want_residual = prenorm_reference(x, residual, torch.ones_like(norm_w), folded(w, norm_w), 1e-6, gated)
    assert out.shape == want.shape and out.dtype == dtype
    # the normalised row stays fp32 (the unfused pair rounds it to the dtype): the output's rounding, plus the
    # gate's and up's for the gated form
    tol = GATE_UP_TOL[dtype] if gated else TOL[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol[0], rtol=tol[1])
    assert torch.equal(new_residual, want_residual)  # x + residual, rounded once, written by one program
    if not with_residual:
        assert new_residual is x
    return out


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
# K = 200: the masked tail tile only; K = 50: rows not 16-byte aligned
@pytest.mark.parametrize("n,k", [(37, 200), (19, 50)])
def test_prenorm_small(m, gated, with_residual, n, k):
    check_prenorm(m, n, k, torch.float16, seed=m * 100 + n + k, gated=gated, with_residual=with_residual)


# several full K tiles through the pipeline (the residual stored tile by tile), then the masked tail
@pytest.mark.parametrize("m,config", [
    (1, SkinnyConfig(1, 4, 32, False, 4, 3)),
    (2, SkinnyConfig(2, 8, 64, False, 4, 2)),
    (2, SkinnyConfig(4, 2, 16, False, 2, 1)),
])
@pytest.mark.parametrize("gated", [False, True])
def test_prenorm_k_tiles(m, config, gated):
    check_prenorm(m, 45, 200, torch.float16, seed=m, gated=gated, config=config)


def test_prenorm_matches_unfused_pair():
    """Against what the model ran before the fold: fused_add_rms_norm with its weight, then skinny_linear /
    skinny_gate_up_silu on the bare W. They differ by roundings only (of the normalised row, of W * norm_w):
    half the outputs the same bits or an ulp apart, none off by more than the fp16 rounding of an O(1) value."""
    from ostinato.layers.norm import fused_add_rms_norm_torch
    from ostinato.layers.triton_ops.skinny_gemm import skinny_norm_linear

    for gated in (False, True):
        x, residual, norm_w, w = prenorm_inputs(2, 40, 256, torch.float16, seed=5, gated=gated)
        h, new_residual = fused_add_rms_norm_torch(x, residual, norm_w, 1e-6)
        unfused = silu_and_mul_torch(skinny_linear(h, w)) if gated else skinny_linear(h, w)
        out, got_residual = skinny_norm_linear(x, folded(w, norm_w), 1e-6, residual, gated=gated)
        assert torch.equal(got_residual, new_residual)
        torch.testing.assert_close(out, unfused, atol=3e-3, rtol=3e-3)
        assert ulps(out, unfused).median() <= 1


def test_prenorm_bad_inputs():
    from ostinato.layers.triton_ops.skinny_gemm import skinny_norm_linear

    x, residual, _, w = prenorm_inputs(2, 8, 32, torch.float16, seed=0)
    cases = [
        ({"x": torch.cat([x, x])[:3], "residual": None}, r"x.shape\[0\] \(M = 3\) must be at most 2"),
        ({"residual": residual[:1]}, r"residual.shape must equal x.shape"),
        ({"residual": residual.float()}, r"residual.dtype"),
        ({"config": SkinnyConfig(16, 16, 32, True, 4, 3)}, r"config.use_dot must be False"),
    ]
    for change, message in cases:
        kwargs = {"x": x, "weight": w, "eps": 1e-6, "residual": residual, **change}
        with pytest.raises(ValueError, match=message):
            skinny_norm_linear(**kwargs)


def test_fold_norm_weight():
    """The fold keeps the layer's map: norm then projection before and after agree to the weight's rounding."""
    from ostinato.layers.linear import Linear
    from ostinato.layers.norm import RMSNorm
    from ostinato.layers.norm_linear import fold_norm_weight, norm_linear

    gen = torch.Generator().manual_seed(3)
    norm, proj = RMSNorm(64, 1e-6), Linear(64, 48, bias=False)
    norm.weight.data = 1 + 0.3 * torch.randn(64, generator=gen)
    proj.weight.data = torch.randn(48, 64, generator=gen)
    x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    want, want_residual = norm_linear(norm, proj, x, residual)
    fold_norm_weight(norm, proj)
    assert norm.weight_folded and (norm.weight == 1).all()
    got, got_residual = norm_linear(norm, proj, x, residual)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_residual, want_residual)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2])
# Llama-3.2-1B's qkv and gate_up, Qwen3-0.6B's qkv, Granite-4.0-H-1B's in_proj and MLP gate_up
@pytest.mark.parametrize("n,k,gated", [(3072, 2048, False), (8192, 2048, True), (4096, 1024, False),
                                       (6448, 1536, False), (4096, 1536, True)])
def test_prenorm_real(m, dtype, n, k, gated):
    check_prenorm(m, n, k, dtype, seed=m + n, gated=gated)


@cuda
@pytest.mark.parametrize("m,gated", [(1, False), (2, True)])
def test_prenorm_cuda_graph(m, gated):
    from ostinato.layers.triton_ops.skinny_gemm import skinny_norm_linear

    with torch.inference_mode():
        x, residual, _, w = prenorm_inputs(m, 2048, 2048, torch.bfloat16, seed=m, gated=gated)
        outs = []
        graph = captured(lambda: outs.append(skinny_norm_linear(x, w, 1e-6, residual, gated=gated)))
        x2, r2, _, _ = prenorm_inputs(m, 2048, 2048, torch.bfloat16, seed=m + 100, gated=gated)
        x.copy_(x2)
        residual.copy_(r2)
        graph.replay()
        out, new_residual = outs[-1]
        want, want_residual = skinny_norm_linear(x, w, 1e-6, residual, gated=gated)
        assert torch.equal(out, want) and torch.equal(new_residual, want_residual)


@pytest.mark.parametrize("m", [5, 8, 20])
def test_deferred_norm_gate_up_silu(m):
    """The deferred post-attention norm's composition (norm_linear.deferred_norm_gate_up_silu: o_proj with the
    residual added in its epilogue, gate_up on the bare row, the activation scaling by the row's inverse RMS)
    against float64 o_proj + residual, RMSNorm, gate_up and silu_and_mul; on the CPU through Triton's
    interpreter (fp16), on CUDA in bf16."""
    from ostinato.layers.norm_linear import deferred_norm_gate_up_silu

    dtype = torch.bfloat16 if GPU else torch.float16
    a, residual, norm_w, gu_w = prenorm_inputs(m, 96, 64, dtype, seed=m, gated=True)
    o_w = randn(torch.Generator(DEVICE).manual_seed(-m), 64, 64, dtype=dtype) * 64**-0.5
    act, h = deferred_norm_gate_up_silu(o_w, a, residual, 1e-6, folded(gu_w, norm_w))
    assert torch.equal(h, skinny_linear(a, o_w) + residual)
    want, _ = prenorm_reference(h, None, norm_w, gu_w, 1e-6, gated=True)
    tol = 3e-2 if GPU else 5e-3  # the gate's and up's roundings after the scale, and W * norm_w's
    torch.testing.assert_close(act.double(), want, atol=tol, rtol=tol)


def bf16_linear(w: torch.Tensor) -> "torch.nn.Linear":
    """A bias-free CUDA bf16 Linear holding a copy of w [N, K]."""
    from ostinato.layers.linear import Linear

    layer = Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
    layer.weight.data = w.clone()
    return layer


def bf16_norm(w: torch.Tensor) -> "torch.nn.Module":
    """A CUDA bf16 RMSNorm (eps 1e-6) holding a copy of the weight w."""
    from ostinato.layers.norm import RMSNorm

    norm = RMSNorm(w.shape[0], 1e-6).cuda().to(torch.bfloat16)
    norm.weight.data = w.clone()
    return norm


@cuda
@pytest.mark.parametrize("m,defers", [(4, False), (5, True), (8, True), (32, True), (33, False)])
def test_attn_out_norm_gate_up_silu(monkeypatch, m, defers):
    """o_proj, the residual add, the post-attention norm and gate_up + silu (layers/norm_linear): at 5-32 rows
    without the norm's launch (o_proj's kernel adds the residual, silu_and_mul applies the norm's scale), else as
    o_proj then norm_gate_up_silu. Both within the dtype's rounding of float64 over the residual stream they
    return, and that stream within o_proj's rounding of float64; graph replay equals eager."""
    from ostinato.layers import norm_linear

    taken = []
    real = norm_linear._defers_norm
    monkeypatch.setattr(norm_linear, "_defers_norm", lambda *a: taken.append(real(*a)) or taken[-1])
    a, residual, norm_w, gu_w = prenorm_inputs(m, 4096, 2048, torch.bfloat16, seed=m, gated=True)
    o_w = randn(torch.Generator(DEVICE).manual_seed(-m), 2048, 2048, dtype=torch.bfloat16) * 2048**-0.5
    o_proj, norm, gate_up = bf16_linear(o_w), bf16_norm(norm_w), bf16_linear(gu_w)
    norm_linear.fold_norm_weight(norm, gate_up)
    with torch.inference_mode():
        out, h = norm_linear.attn_out_norm_gate_up_silu(o_proj, a, residual, norm, gate_up)
        assert taken == [defers]
        replayed = []
        graph = captured(lambda: replayed.append(norm_linear.attn_out_norm_gate_up_silu(o_proj, a, residual, norm,
                                                                                        gate_up)))
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(replayed[-1][0], out) and torch.equal(replayed[-1][1], h)
    torch.testing.assert_close(h.double(), reference(a, o_w) + residual.double(), atol=3e-2, rtol=1e-2)
    want, _ = prenorm_reference(h, None, norm_w, gu_w, 1e-6, gated=True)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)


@cuda
@pytest.mark.parametrize("m,fused", [(1, True), (2, True), (3, False)])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_linear_layers(monkeypatch, m, fused, gated):
    """layers/norm_linear after the fold: the fused kernel at <= 2 rows, the norm and the projection apart above;
    both within the dtype's rounding of the float64 reference, the residual stream exact; under torch.compile
    the same."""
    from ostinato.layers import norm_linear
    from ostinato.layers.triton_ops import skinny_gemm

    calls = []
    real = skinny_gemm.skinny_norm_linear
    monkeypatch.setattr(skinny_gemm, "skinny_norm_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fn = norm_linear.norm_gate_up_silu if gated else norm_linear.norm_linear
    x, residual, norm_w, w = prenorm_inputs(m, 2048, 2048, torch.bfloat16, seed=m, gated=gated)
    norm, proj = bf16_norm(norm_w), bf16_linear(w)
    norm_linear.fold_norm_weight(norm, proj)
    with torch.inference_mode():
        out, new_residual = fn(norm, proj, x, residual)
        assert bool(calls) == fused
        compiled = torch.compile(lambda a, b: fn(norm, proj, a, b), fullgraph=True, dynamic=False)
        out_c, res_c = compiled(x, residual)
    want, want_residual = prenorm_reference(x, residual, norm_w, w, 1e-6, gated)
    tol = (3e-2, 3e-2)  # bf16: the rounding of W * norm_w, and the unfused path's of the normalised row
    torch.testing.assert_close(out.double(), want, atol=tol[0], rtol=tol[1])
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out_c, out, atol=tol[0], rtol=tol[1])
    assert torch.equal(res_c, new_residual)
