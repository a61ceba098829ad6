"""The penalize kernel (layers/triton_ops/penalize.py) against its torch twin (layers/sampling_ops.penalize):
the same penalized logits, read from a penalty state by row. Without a GPU the kernel runs in Triton's
interpreter."""

import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before the kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="a Triton kernel")

from ostinato.layers.sampling_ops import penalize  # noqa: E402
from ostinato.layers.triton_ops.penalize import penalize_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("repetition", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 2 * 2048 + 101])
def test_kernel_equals_torch_twin(repetition, dtype, vocab):
    g = torch.Generator().manual_seed(vocab + repetition)
    b, num_rows = 6, 9
    # logits inside a wider buffer (a graph's padded output): the row stride is not the vocabulary
    logits = (torch.randn(b, vocab + 24, generator=g) * 4).to(dtype)[:, :vocab]
    counts = torch.randint(0, 4, (num_rows, vocab), generator=g, dtype=torch.int32)
    counts[torch.rand(num_rows, vocab, generator=g) < 0.7] = 0  # most tokens unseen
    in_prompt = torch.rand(num_rows, vocab, generator=g) < 0.2
    rows = torch.tensor([3, 0, 8, 3, 5, 1])  # any slots, one twice
    frequency = torch.tensor([0.0, 0.7, -1.5, 2.0, 0.3, 0.0])
    presence = torch.tensor([0.5, 0.0, 1.0, -2.0, 0.2, 0.0])
    rep = torch.tensor([1.3, 1.0, 0.6, 2.0, 1.1, 1.0]) if repetition else None
    ref = penalize(logits, counts, rows, frequency, presence, rep, in_prompt if repetition else None)
    d = DEVICE
    got = penalize_rows(logits.to(d), counts.to(d), rows.to(d), frequency.to(d), presence.to(d),
                        None if rep is None else rep.to(d), in_prompt.to(d) if repetition else None).cpu()
    assert got.dtype == torch.float32 and got.shape == (b, vocab)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ref, logits.float())  # the penalties changed something


def test_twin_without_rows_reads_row_b():
    g = torch.Generator().manual_seed(1)
    logits, counts = torch.randn(3, 50, generator=g), torch.randint(0, 3, (3, 50), generator=g)
    f, p = torch.tensor([0.2, 0.4, 0.0]), torch.tensor([1.0, 0.0, -0.5])
    assert torch.equal(penalize(logits, counts, None, f, p), penalize(logits, counts, torch.arange(3), f, p))


def test_warm_up_changes_no_state():
    """PenaltyState.warm_up (start-up on CUDA: the kernel's variants compiled, the state's ops launched once) runs
    (here in the interpreter without a GPU) and leaves an allocated state's rows as they were."""
    from types import SimpleNamespace

    from ostinato.runner.penalties import PenaltyState
    from ostinato.sampling_params import SamplingParams

    state = PenaltyState(num_slots=3, vocab_size=70, device=torch.device(DEVICE))
    req = SimpleNamespace(req_pool_idx=2, params=SamplingParams(repetition_penalty=1.2), output_token_ids=[5, 5, 9],
                          prompt_token_ids=[1, 69])
    state.reset_rows([req])
    counts, marks = state.counts.clone(), state.in_prompt.clone()
    state.warm_up([128, 70])
    assert torch.equal(state.counts, counts) and torch.equal(state.in_prompt, marks)
    assert state.counts[2, 5].item() == 2 and state.counts[2, 9].item() == 1 and state.in_prompt[2, 69].item()
