"""The layers' Triton kernels against their torch twins, and the twins against float64 references of HF's
formulas.

Without a GPU the kernels run in Triton's interpreter on CPU tensors at small shapes, in fp32 and fp16
(the interpreter rounds fp32 -> bf16 by truncation, so bf16 is checked on the GPU only). With a GPU the
same small cases run on it, plus real model shapes in bf16 and fp32, torch.compile and CUDA-graph replay.
The Triton path is called directly (`triton_ops`), never through the layers' `is_cuda` switch.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402
import transformers  # noqa: E402

from ostinato.layers import triton_ops  # noqa: E402
from ostinato.layers.activation import silu_and_mul, silu_and_mul_torch  # noqa: E402
from ostinato.layers.norm import fused_add_rms_norm, fused_add_rms_norm_torch, rms_norm_torch  # noqa: E402
from ostinato.layers.rotary import RotaryEmbedding, rotary_embedding_, rotary_embedding_torch  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
cuda = pytest.mark.skipif(not GPU, reason="needs CUDA")
EPS = 1e-6
SMALL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])
# kernel vs twin (same rounding points; reduction order and rsqrt ulps differ), and both vs float64
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
REF_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
# rotary rounds like HF (products and their sum each in the model dtype): where the two products cancel, the
# error is relative to them, not to the result
ROTARY_REF_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 4e-3), torch.bfloat16: (5e-2, 2e-2)}


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale + shift).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> None:
    torch.testing.assert_close(got.double(), want.double(), atol=tol[0], rtol=tol[1])


# ---------------------------------------------------------------- float64 references of HF's formulas
def rms_norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rotary_ref(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, w: torch.Tensor | None):
    """HF's apply_rotary_pos_emb (q * cos + rotate_half(q) * sin) on [T, H, D] in float64."""
    x = x.double() if w is None else rms_norm_ref(x, w)
    c, s = cos_sin.double()[positions][:, None, :].chunk(2, dim=-1)
    cos, sin = torch.cat([c, c], -1), torch.cat([s, s], -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


# ---------------------------------------------------------------- checks shared by small and real shapes
def check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x = randn(gen, num_tokens, hidden, dtype=dtype, scale=3.0)
    w = randn(gen, hidden, dtype=dtype, scale=0.1, shift=1.0)
    got, want = triton_ops.rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, want, TOL[dtype])
    close(want, rms_norm_ref(x, w), REF_TOL[dtype])


def check_fused_add_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x = randn(gen, num_tokens, hidden, dtype=dtype)
    residual = randn(gen, num_tokens, hidden, dtype=dtype, scale=4.0)
    w = randn(gen, hidden, dtype=dtype, scale=0.1, shift=1.0)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, w, EPS)
    want_out, want_residual = fused_add_rms_norm_torch(x, residual, w, EPS)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # out of place
    assert torch.equal(new_residual, want_residual)  # one add rounded to the dtype on both sides
    close(out, want_out, TOL[dtype])
    close(want_out, rms_norm_ref(residual.double() + x.double(), w), REF_TOL[dtype])


def check_silu_and_mul(num_tokens: int, intermediate: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x = randn(gen, num_tokens, 2 * intermediate, dtype=dtype, scale=3.0)
    got, want = triton_ops.silu_and_mul(x), silu_and_mul_torch(x)
    assert got.shape == (num_tokens, intermediate) and got.dtype == dtype
    close(got, want, TOL[dtype])
    close(want, silu_and_mul_ref(x), REF_TOL[dtype])


def check_silu_and_mul_norm(num_tokens: int, intermediate: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
    """The deferred-norm form: gate and up scaled by the inverse RMS of h's rows first, against the torch twin
    and against float64 (silu(s * gate) * s * up, s = rsqrt(mean(h^2) + eps))."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x = randn(gen, num_tokens, 2 * intermediate, dtype=dtype, scale=30.0)  # a projection of an unnormalised row
    h = randn(gen, num_tokens, hidden, dtype=dtype, scale=7.0, shift=0.5)
    got, want = triton_ops.silu_and_mul(x, (h, EPS)), silu_and_mul_torch(x, (h, EPS))
    assert got.shape == (num_tokens, intermediate) and got.dtype == dtype
    close(got, want, TOL[dtype])
    inv = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + EPS)
    gate, up = x.double().chunk(2, dim=-1)
    # gate and up are rounded to the dtype after the scale: twice the plain form's error
    close(want, silu_and_mul_ref(torch.cat([gate * inv, up * inv], -1)), tuple(2 * t for t in REF_TOL[dtype]))
    assert not torch.equal(got, triton_ops.silu_and_mul(x))  # the scale was applied


_tables: dict[tuple[int, int], torch.Tensor] = {}


def cos_sin_table(head_dim: int, max_positions: int) -> torch.Tensor:
    """The model's own table (llama3-scaled rope), fp32 [max_positions, head_dim]."""
    key = (head_dim, max_positions)
    if key not in _tables:
        config = transformers.LlamaConfig(
            hidden_size=head_dim * 4, num_attention_heads=4, rope_theta=500000.0, max_position_embeddings=131072,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
        )
        _tables[key] = RotaryEmbedding(config, head_dim, max_positions).cos_sin.to(DEVICE)
    return _tables[key]


def check_rotary(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, qk_norm: bool,
                 max_positions: int, seed: int) -> None:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    table = cos_sin_table(head_dim, max_positions)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen, device=DEVICE)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn(gen, num_tokens, q_size + 2 * kv_size, dtype=dtype, scale=2.0)
    weights = (randn(gen, head_dim, dtype=dtype, scale=0.1, shift=1.0),
               randn(gen, head_dim, dtype=dtype, scale=0.1, shift=1.0)) if qk_norm else (None, None)
    before, twin = qkv.clone(), qkv.clone()

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # strided, as the model passes them
        q = t[:, :q_size].view(num_tokens, heads, head_dim)
        k = t[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim)
        return q, k

    q, k = views(qkv)
    assert not q.is_contiguous() or num_tokens == 1
    triton_ops.rotary_embedding_(positions, q, k, table, head_dim, *weights, EPS)
    rotary_embedding_torch(positions, *views(twin), table, head_dim, *weights, EPS)
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])  # v untouched
    close(qkv, twin, TOL[dtype])
    q0, k0 = views(before)
    q1, k1 = views(twin)
    close(q1, rotary_ref(q0, table, positions, weights[0]), ROTARY_REF_TOL[dtype])
    close(k1, rotary_ref(k0, table, positions, weights[1]), ROTARY_REF_TOL[dtype])


# ---------------------------------------------------------------- small shapes (interpreter on the CPU)
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (3, 48)])
def test_rms_norm_small(num_tokens, hidden, dtype):
    check_rms_norm(num_tokens, hidden, dtype, seed=hidden)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (3, 48)])
def test_fused_add_rms_norm_small(num_tokens, hidden, dtype):
    check_fused_add_rms_norm(num_tokens, hidden, dtype, seed=hidden + 1)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 64), (3, 40)])
def test_silu_and_mul_small(num_tokens, intermediate, dtype):
    check_silu_and_mul(num_tokens, intermediate, dtype, seed=intermediate)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("num_tokens,intermediate,hidden", [(1, 64, 32), (3, 40, 48)])  # 48: a masked h block
def test_silu_and_mul_norm_small(num_tokens, intermediate, hidden, dtype):
    check_silu_and_mul_norm(num_tokens, intermediate, hidden, dtype, seed=hidden)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 3, 24)])  # 24: half 12, a masked block
def test_rotary_small(heads, kv_heads, head_dim, qk_norm, dtype):
    check_rotary(5, heads, kv_heads, head_dim, dtype, qk_norm, max_positions=64, seed=head_dim)


def test_custom_op_registrations():
    """Schemas (declared mutations), fake kernels and tracing of the custom ops (used under torch.compile)."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    x = randn(gen, 2, 32, dtype=torch.float32)
    w = randn(gen, 32, dtype=torch.float32)
    torch.library.opcheck(triton_ops.rms_norm_op, (x, w, EPS))
    torch.library.opcheck(triton_ops.fused_add_rms_norm_op, (x, x.clone(), w, EPS))
    torch.library.opcheck(triton_ops.silu_and_mul_op, (x,))
    qkv = randn(gen, 2, 4 * 16, dtype=torch.float32)
    positions = torch.tensor([3, 0], device=DEVICE)
    args = (positions, qkv[:, :32].view(2, 2, 16), qkv[:, 32:48].view(2, 1, 16), cos_sin_table(16, 8), 16)
    torch.library.opcheck(triton_ops.rotary_embedding_op, args)
    torch.library.opcheck(triton_ops.rotary_embedding_op, (*args, w[:16], w[16:], EPS))


def test_empty_batch():
    x = torch.empty(0, 32, device=DEVICE)
    assert triton_ops.rms_norm(x, torch.ones(32, device=DEVICE), EPS).shape == (0, 32)
    assert triton_ops.silu_and_mul(x).shape == (0, 16)
    triton_ops.rotary_embedding_(torch.empty(0, dtype=torch.int64, device=DEVICE), x.view(0, 2, 16),
                                 x.view(0, 2, 16), cos_sin_table(16, 8), 16)


# ---------------------------------------------------------------- real shapes on the GPU
REAL_DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 7, 256]


@cuda
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", REAL_DTYPES)
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_norms_real(hidden, dtype, num_tokens):
    check_rms_norm(num_tokens, hidden, dtype, seed=num_tokens)
    check_fused_add_rms_norm(num_tokens, hidden, dtype, seed=num_tokens)


@cuda
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", REAL_DTYPES)
@pytest.mark.parametrize("intermediate", [8192, 11008])  # 11008: a partial last block
def test_silu_and_mul_real(intermediate, dtype, num_tokens):
    check_silu_and_mul(num_tokens, intermediate, dtype, seed=num_tokens)
    check_silu_and_mul_norm(num_tokens, intermediate, 2048, dtype, seed=num_tokens)


@cuda
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", REAL_DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (32, 8, 128), (16, 8, 128)])
def test_rotary_real(heads, kv_heads, head_dim, qk_norm, dtype, num_tokens):
    check_rotary(num_tokens, heads, kv_heads, head_dim, dtype, qk_norm, max_positions=32768, seed=num_tokens)


@cuda
def test_compile_and_cuda_graph():
    """The ops under torch.compile(fullgraph) and inside a captured CUDA graph equal eager."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    hidden, heads, kv_heads, head_dim, inter, n = 2048, 32, 8, 64, 8192, 4
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    table = cos_sin_table(head_dim, 32768)
    w = randn(gen, hidden, dtype=torch.bfloat16, scale=0.1, shift=1.0)
    qw = randn(gen, head_dim, dtype=torch.bfloat16, scale=0.1, shift=1.0)

    def step(x, residual, positions, qkv, gate_up):
        out, residual = fused_add_rms_norm(x, residual, w, EPS)
        q = qkv[:, :q_size].view(n, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim)
        rotary_embedding_(positions, q, k, table, head_dim, qw, qw, EPS)
        return out, residual, silu_and_mul(gate_up)

    def inputs():
        return (randn(gen, n, hidden, dtype=torch.bfloat16), randn(gen, n, hidden, dtype=torch.bfloat16),
                torch.randint(0, 32768, (n,), generator=gen, device=DEVICE),
                randn(gen, n, q_size + 2 * kv_size, dtype=torch.bfloat16),
                randn(gen, n, 2 * inter, dtype=torch.bfloat16))

    with torch.inference_mode():
        args = inputs()
        eager_args = [a.clone() for a in args]
        eager = step(*eager_args)
        compiled_args = [a.clone() for a in args]
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(*compiled_args)
        for got, want in zip([*compiled, compiled_args[3]], [*eager, eager_args[3]], strict=True):
            assert torch.equal(got, want)

        static = [a.clone() for a in args]
        step(*static)  # warm up (compiles the kernels) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step(*static)
        fresh = inputs()
        for buf, a in zip(static, fresh, strict=True):
            buf.copy_(a)
        graph.replay()
        want_args = [a.clone() for a in fresh]
        want = step(*want_args)
        for got, ref in zip([*outs, static[3]], [*want, want_args[3]], strict=True):
            assert torch.equal(got, ref)
