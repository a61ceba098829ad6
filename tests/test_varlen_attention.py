"""The varlen vision-attention kernel against the SDPA-per-segment reference, on random segmentations.

Without a GPU the kernel runs in Triton's interpreter at tiny shapes (float32 and float64); with one, the same
cases run on the GPU, plus bf16 at a vision tower's head sizes.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels (or their CPU interpreter) need triton")
import torch  # noqa: E402

from ostinato.layers.triton_ops.varlen_attention import varlen_attention  # noqa: E402
from ostinato.models.vision import vision_attention_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_cu(n: int, gen: torch.Generator, pad_to: int = 0) -> torch.Tensor:
    """A random segmentation of n rows (segments of 1..n rows, some empty), padded with n up to pad_to entries."""
    cuts = sorted(torch.randint(0, n + 1, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist())
    cu = [0, *cuts, n]
    cu += [n] * (pad_to - len(cu))
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def qkv(n: int, heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator):
    """q, k, v as strided views of one packed [n, 3, heads, dim] tensor, as the vision blocks pass them."""
    packed = torch.randn(n, 3, heads, dim, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    return packed.unbind(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,heads,dim", [(37, 2, 16), (50, 2, 20), (5, 1, 8)])
def test_matches_sdpa_per_segment(n, heads, dim, dtype):
    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 runs in the interpreter only")
    gen = torch.Generator().manual_seed(n * dim)
    for trial in range(2):
        q, k, v = qkv(n, heads, dim, dtype, gen)
        cu = random_cu(n, gen, pad_to=8 if trial else 0)
        ref = vision_attention_ref(q.cpu(), k.cpu(), v.cpu(), cu.cpu())
        out = varlen_attention(q, k, v, cu, block_m=16, block_n=16).flatten(1).cpu()
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert (out - ref).abs().max().item() < tol, (cu.tolist(), (out - ref).abs().max().item())


def test_rows_see_only_their_segment():
    """A row's output does not change, bit for bit, when other segments (and rows past them, attended by the same
    program) change: what makes a padded graph input safe."""
    gen = torch.Generator().manual_seed(1)
    n, heads, dim = 48, 2, 16
    q, k, v = (t.contiguous() for t in qkv(n, heads, dim, torch.float32, gen))
    cu = torch.tensor([0, 7, 30, 30, 40, 48], dtype=torch.int32, device=DEVICE)
    out = varlen_attention(q, k, v, cu, block_m=16, block_n=16)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[30:] = torch.randn(18, heads, dim, generator=gen).to(DEVICE) * 100
    out2 = varlen_attention(q2, k2, v2, cu, block_m=16, block_n=16)
    assert torch.equal(out[:30], out2[:30])
    # the same rows alone (the segmentation cut at 30): equal bit for bit as well
    alone = varlen_attention(q[:30], k[:30], v[:30], cu[:3].contiguous(), block_m=16, block_n=16)
    assert torch.equal(out[:30], alone)


def test_same_launch_any_segmentation():
    """One cu_seqlens buffer, rewritten in place between calls of the same shape: each call follows the buffer."""
    gen = torch.Generator().manual_seed(2)
    n, heads, dim = 40, 2, 16
    q, k, v = qkv(n, heads, dim, torch.float32, gen)
    buf = torch.empty(12, dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        buf.copy_(random_cu(n, gen, pad_to=12))
        out = varlen_attention(q, k, v, buf, block_m=16, block_n=16).flatten(1).cpu()
        ref = vision_attention_ref(q.cpu(), k.cpu(), v.cpu(), buf.cpu())
        assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim", [64, 80])
def test_bf16_tower_shapes(dim):
    gen = torch.Generator().manual_seed(dim)
    n, heads = 3000, 16
    q, k, v = qkv(n, heads, dim, torch.bfloat16, gen)
    cu = torch.tensor([0, 64, 1024, 1088, 2000, 2900, 3000], dtype=torch.int32, device=DEVICE)
    ref = vision_attention_ref(q.float(), k.float(), v.float(), cu)
    out = varlen_attention(q, k, v, cu).flatten(1).float()
    assert (out - ref).abs().max().item() < 2e-2
