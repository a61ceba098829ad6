"""float_logits (layers/parallel_linear.py): float32 logits of the LM head, written in place into a row-strided
buffer. On the CPU the path is F.linear then a cast; on CUDA with 16-bit inputs cuBLAS writes float32 sums, which
must be the float32 product of the 16-bit inputs (not rounded to 16 bits)."""

import pytest
import torch
import torch.nn.functional as F

from ostinato.layers.parallel_linear import float_logits
from ostinato.layers.sampling_ops import padded_vocab

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_logits_in_place_and_allocated(device, dtype):
    gen = torch.Generator(device).manual_seed(0)
    vocab, hidden = 3000, 64
    h = torch.randn(5, hidden, generator=gen, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, device=device) * 0.1).to(dtype)
    exact = h.double() @ w.double().T
    buf = torch.full((5, padded_vocab(vocab)), float("-inf"), device=device)
    out = float_logits(h, w, vocab, out=buf[:, :vocab])
    assert out.data_ptr() == buf.data_ptr() and torch.isinf(buf[:, vocab:]).all()  # written in place, pad kept
    fresh = float_logits(h, w, vocab)
    assert fresh.dtype == torch.float32 and fresh.shape == (5, vocab) and torch.equal(fresh, out)
    if device == "cuda" and dtype == torch.bfloat16:
        # the float32 sums, closer to the exact product than the bf16-rounded logits are
        torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=1e-5)
        rounded = F.linear(h, w).double()
        assert (out.double() - exact).abs().max() < (rounded - exact).abs().max()
    else:
        assert torch.equal(out, F.linear(h, w).float())
