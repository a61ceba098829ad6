import math

import pytest
import torch
import triton
import triton.language as tl

from ostinato.layers.gumbel import hash_uniform
from ostinato.layers.sampling_ops import KEPT_TOP_K
from ostinato.layers.triton_ops.gumbel import log_neg_log
from ostinato.runner.sampler import ARGMAX_CHUNK, SamplingTensors, chunked_argmax, padded_vocab, sample
from ostinato.sampling_params import SamplingParams

# the CPU runs the torch sampler; CUDA runs the fused kernels (runner/fused_sample.py) through the same tests
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def run(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]
) -> torch.Tensor:
    t = SamplingTensors.from_params(params, seeds, steps, logits.shape[-1], logits.device)
    return sample(logits, t)


@triton.jit
def _noise_kernel(U, Out, n, BLOCK: tl.constexpr):
    """Out = log(-log(U)) by the Triton kernels' formula."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + offs, log_neg_log(tl.load(U + offs, mask=offs < n, other=0.5)), mask=offs < n)


def rand_logits(b: int, v: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax():
    logits = rand_logits(16, 3000, 0)
    out = run(logits, [SamplingParams(temperature=0.0)] * 16, list(range(16)), [5] * 16)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))
    # ties go to the lowest index, like torch.argmax
    tied = torch.zeros(2, 10)
    tied[:, 3] = tied[:, 7] = 1.0
    assert run(tied, [SamplingParams(temperature=0.0)] * 2, [0, 1], [0, 0]).tolist() == [3, 3]


@pytest.mark.parametrize("vocab,block", [(1, 64), (1000, 64), (3 * 64 + 17, 64), (128_256, 2048)])
def test_triton_argmax_matches_torch(vocab, block):
    """The CUDA argmax kernels (`triton_ops/argmax.py`; Triton's interpreter on the CPU) against torch.argmax:
    many ties across and within chunks (the first maximum wins), a maximum in the last, partial chunk, -inf
    padding, rows of a wider buffer, into a given output."""
    from ostinato.layers.triton_ops.argmax import argmax_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(vocab)
    b = 6
    logits = torch.randint(-6, 7, (b, vocab), generator=gen).float()
    logits[1] = torch.randn(vocab, generator=gen)
    logits[2, -1] = 100.0
    logits[3, : vocab // 2] = float("-inf")
    wide = torch.full((b, vocab + 37), float("-inf"))
    wide[:, :vocab] = logits
    wide = wide.to(device)
    out = torch.full((b + 2,), -1, dtype=torch.int64, device=device)
    got = argmax_rows(wide[:, :vocab], out=out[1 : b + 1], block=block)
    assert got.data_ptr() == out[1:].data_ptr()
    assert torch.equal(out[1 : b + 1].cpu(), logits.argmax(-1)) and out[0] == -1 and out[-1] == -1
    assert torch.equal(argmax_rows(wide, block=block).cpu(), logits.argmax(-1))  # -inf padding columns
    # scattered as a decode graph stores its tokens: dest[index[b]] = row b's argmax, the twin alike
    index = torch.randperm(2 * b, generator=gen)[:b]
    for dest, run_argmax in ((torch.full((2 * b,), -7, device=device), lambda d: argmax_rows(
            wide, block=block, scatter=(d, index.to(device)))), (torch.full((2 * b,), -7), lambda d: chunked_argmax(
            wide.cpu(), scatter=(d, index)))):
        got = run_argmax(dest)
        want = torch.full((2 * b,), -7)
        want[index] = logits.argmax(-1)
        assert torch.equal(got.cpu(), logits.argmax(-1)) and torch.equal(dest.cpu(), want)


@pytest.mark.parametrize("vocab", [1, ARGMAX_CHUNK, 3 * ARGMAX_CHUNK + 17, 151_936])
def test_chunked_argmax_matches_torch(vocab):
    gen = torch.Generator().manual_seed(vocab)
    b = 5
    # small integers: many ties, across chunks and within them; the first maximum must win, as torch's
    logits = torch.randint(-6, 7, (b, vocab), generator=gen).float()
    logits[1] = torch.randn(vocab, generator=gen)
    logits[2, -1] = 100.0  # the maximum in the last, partly padded chunk
    padded = torch.full((b, padded_vocab(vocab)), float("-inf"))
    padded[:, :vocab] = logits
    assert padded.shape[1] % ARGMAX_CHUNK == 0
    assert torch.equal(chunked_argmax(padded), logits.argmax(-1))
    # unpadded (an extend step's logits, the sampler's greedy rows): the tail past the last whole chunk is a
    # chunk of its own; also as a strided view of wider rows
    assert torch.equal(chunked_argmax(logits), logits.argmax(-1))
    wide = torch.randn(b, vocab + 5, generator=gen)
    wide[:, :vocab] = logits
    assert torch.equal(chunked_argmax(wide[:, :vocab]), logits.argmax(-1))


@pytest.mark.parametrize("vocab,block", [(1000, 64), (3 * 64 + 17, 64), (128_256, 2048)])
def test_decode_graph_draw_is_the_samplers_plain_draw(vocab, block):
    """The decode graph's draw (`triton_ops/argmax.draw_rows`; Triton's interpreter on the CPU, and its torch twin
    `sampling_ops.chunked_draw`) gives every row the token the sampler gives a temperature-only row (`sample`, the
    torch reference) and greedy rows their argmax: temperatures low to high, near-flat rows where the noise decides,
    seeds past 32 bits and negative, -inf padding columns never drawn, rows of a wider buffer, into a given output
    and scattered to the rows' slots."""
    from ostinato.layers.sampling_ops import chunked_draw
    from ostinato.layers.triton_ops.argmax import draw_rows
    from ostinato.sampling_params import GREEDY_EPS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(vocab + block)
    temps = [0.0, 0.3, 1.0, 1.7, 0.0, 0.6, 2.5, 0.05]
    b = len(temps)
    logits = torch.randn(b, vocab, generator=gen) * torch.tensor([4.0, 0.05, 2.0, 0.1, 1.0, 3.0, 0.02, 8.0])[:, None]
    logits[4, : vocab // 3] = float("-inf")
    params = [SamplingParams(temperature=t) for t in temps]
    seeds = [-(2**62) + 977 * i if i % 2 else 2**40 + i for i in range(b)]
    steps = torch.randint(0, 2**33, (b,), generator=gen).tolist()
    t = SamplingTensors.from_params(params, seeds, steps, vocab, "cpu")
    want = sample(logits, t)
    assert 2 < len(set(want.tolist())) and not torch.equal(want, logits.argmax(-1)), "the noise decides some rows"
    wide = torch.full((b, vocab + 29), float("-inf"))
    wide[:, :vocab] = logits
    index = torch.randperm(2 * b, generator=gen)[:b]
    expect_dest = torch.full((2 * b,), -7)
    expect_dest[index] = want
    twin_out, twin_dest = torch.full((b + 1,), -1), torch.full((2 * b,), -7)
    chunked_draw(wide, t.temperatures, t.seeds, t.steps, GREEDY_EPS, twin_out[1:], scatter=(twin_dest, index))
    assert torch.equal(twin_out[1:], want) and twin_out[0] == -1 and torch.equal(twin_dest, expect_dest)
    dev_out = torch.full((b + 1,), -1, dtype=torch.int64, device=device)
    dev_dest = torch.full((2 * b,), -7, dtype=torch.int64, device=device)
    draw_rows(wide.to(device), t.temperatures.to(device), t.seeds.to(device), t.steps.to(device), GREEDY_EPS,
              dev_out[1:], block=block, scatter=(dev_dest, index.to(device)))
    assert torch.equal(dev_out[1:].cpu(), want) and dev_out[0] == -1 and torch.equal(dev_dest.cpu(), expect_dest)


def test_precomputed_argmax_is_used_only_for_greedy_rows():
    logits = rand_logits(4, 3000, 3, scale=1.0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    t = SamplingTensors.from_params(params, [0, 1, 2, 3], [0] * 4, 3000, "cpu")
    marker = torch.tensor([7, 7, 7, 7])  # not the argmax: shows which rows took the precomputed ids
    out = sample(logits, t, marker)
    assert out[0::2].tolist() == [7, 7]
    assert torch.equal(out[1::2], sample(logits, t)[1::2])


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = rand_logits(12, 3000, 1, scale=1.0)
    params = [
        SamplingParams(temperature=0.0)
        if i % 2 == 0
        else SamplingParams(temperature=1.5, top_k=100, top_p=0.9, min_p=0.01)
        for i in range(12)
    ]
    out = run(logits, params, list(range(12)), [0] * 12)
    assert torch.equal(out[::2], logits[::2].argmax(-1))
    assert not torch.equal(out[1::2], logits[1::2].argmax(-1))  # high-entropy rows do sample


def test_low_precision_logits():
    logits = rand_logits(6, 500, 2).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.7, top_p=0.95)] * 6
    ref = run(logits.float(), params, list(range(6)), [3] * 6)
    assert torch.equal(run(logits, params, list(range(6)), [3] * 6), ref)


def test_reproducible_across_batch_composition():
    v = 2000
    logits = rand_logits(8, v, 3, scale=1.0)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.05),
        SamplingParams(temperature=1.3, top_k=500, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=1),
    ]
    seeds = [11, 22, 33, 44, 55, 66, 77, 2**64 - 1]
    steps = [0, 1, 2, 3, 100, 5, 6, 7]
    full = run(logits, params, seeds, steps)
    # each row alone (different need_* flags, so different code paths)
    for i in range(8):
        assert run(logits[i : i + 1], [params[i]], [seeds[i]], [steps[i]]).item() == full[i].item()
    # without the top_p-only row the filters look at the 500 highest logits instead of sorting all
    sub = [0, 1, 3, 4, 5, 6, 7]
    t = SamplingTensors.from_params(
        [params[i] for i in sub], [seeds[i] for i in sub], [steps[i] for i in sub], v, "cpu"
    )
    assert t.sort_width == 500
    assert torch.equal(sample(logits[sub], t), full[sub])
    # reversed and shuffled orders
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(4)).tolist()
    out = run(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm], [steps[i] for i in perm])
    assert out.tolist() == [full[i].item() for i in perm]
    # inside a bigger batch with unrelated rows
    other = rand_logits(5, v, 5)
    big = run(
        torch.cat([other, logits]), [SamplingParams(top_k=3)] * 5 + params, [1] * 5 + seeds, [9] * 5 + steps
    )
    assert torch.equal(big[5:], full)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_at_the_cutoff_are_kept(device):
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, -1.0]], device=device).expand(4000, 6).contiguous()
    n = logits.shape[0]
    out = run(logits, [SamplingParams(top_k=2)] * n, [5] * n, list(range(n)))
    assert set(out.tolist()) == {0, 2, 3}
    # softmax: the top token has ~0.52, so top_p = 0.6 needs one of the tied 2.0s, and keeps both
    out = run(logits, [SamplingParams(top_p=0.6)] * n, [5] * n, list(range(n)))
    assert set(out.tolist()) == {0, 2, 3}


def test_seeds_and_steps_give_different_streams():
    v, n = 1000, 200
    logits = rand_logits(1, v, 6, scale=0.5).expand(n, v)
    p = [SamplingParams()] * n
    a = run(logits, p, [1] * n, list(range(n)))
    b = run(logits, p, [2] * n, list(range(n)))
    a2 = run(logits, p, [1] * n, list(range(n)))
    assert torch.equal(a, a2)
    assert (a != b).float().mean() > 0.9  # near-uniform over 1000 tokens: collisions are rare
    assert len(set(a.tolist())) > 150  # steps vary the draw


def ref_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """The distribution from the definitions, float64, written independently of the sampler."""
    x = logits.double() / temperature
    p = torch.softmax(x, -1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    keep = [True] * len(p)
    for rank, i in enumerate(order):
        if top_k >= 1 and rank >= top_k:
            keep[i] = False
        if p[i] < min_p * p.max():
            keep[i] = False
    z = sum(p[i].item() for i in order if keep[i])
    cum = 0.0
    for i in order:
        if keep[i]:
            if cum >= top_p:
                keep[i] = False
            cum += p[i].item() / z
    q = p * torch.tensor(keep, dtype=torch.float64)
    return q / q.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (2.0, -1, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.0, 0, 0.7, 0.0),
        (1.0, 0, 1.0, 0.2),
        (0.8, 5, 0.8, 0.05),
        (1.5, 6, 0.9, 0.1),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_distribution_matches_reference(temperature, top_k, top_p, min_p, device):
    v, n = 8, 20000
    logits = torch.tensor([1.2, -0.3, 0.5, 2.0, 0.1, -1.0, 0.8, 1.6])
    q = ref_probs(logits, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    out = run(logits.expand(n, v).contiguous().to(device), [params] * n, [1234] * n, list(range(n))).cpu()
    counts = torch.bincount(out, minlength=v).double()
    allowed = q > 0
    assert counts[~allowed].sum() == 0, "sampled a token the filters remove"
    expected = q[allowed] * n
    assert expected.min() >= 5  # chi-square approximation holds
    chi2 = ((counts[allowed] - expected) ** 2 / expected).sum().item()
    df = int(allowed.sum()) - 1
    if df == 0:
        return
    assert chi2 < CHI2_CRIT_001[df], (chi2, counts.tolist(), expected.tolist())


def test_distribution_varying_seed():
    v, n = 8, 20000
    logits = torch.tensor([0.3, 1.1, -0.4, 0.9, 0.0, 1.7, -1.2, 0.6])
    q = ref_probs(logits, 1.0, 0, 1.0, 0.0)
    out = run(logits.expand(n, v).contiguous(), [SamplingParams()] * n, list(range(n)), [7] * n)
    counts = torch.bincount(out, minlength=v).double()
    chi2 = ((counts - q * n) ** 2 / (q * n)).sum().item()
    assert chi2 < CHI2_CRIT_001[7]


def test_hash_uniform_is_uniform():
    b, v = 64, 4096
    seeds = torch.arange(b, dtype=torch.int64) * 7919
    u = hash_uniform(seeds, torch.arange(b, dtype=torch.int64), torch.arange(v))
    assert u.shape == (b, v) and u.dtype == torch.float32
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs(u.var().item() - 1 / 12) < 0.001
    # Kolmogorov-Smirnov: sqrt(n) * D < 1.95 at p = 0.001
    x = u.flatten().double().sort().values
    n = x.numel()
    d = torch.maximum(torch.arange(1, n + 1) / n - x, x - torch.arange(n) / n).max().item()
    assert math.sqrt(n) * d < 1.95

    # neighbouring steps, tokens and seeds are uncorrelated
    def corr(a: torch.Tensor, c: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([a.flatten(), c.flatten()]))[0, 1].item()

    assert abs(corr(u[:-1], u[1:])) < 0.005
    assert abs(corr(u[:, :-1], u[:, 1:])) < 0.005
    u2 = hash_uniform(seeds + 1, torch.arange(b, dtype=torch.int64), torch.arange(v))
    assert abs(corr(u, u2)) < 0.005
    # noise is keyed by token id: a permuted id tensor permutes the noise
    perm = torch.randperm(v, generator=torch.Generator().manual_seed(0))
    up = hash_uniform(seeds, torch.arange(b, dtype=torch.int64), perm.expand(b, v))
    assert torch.equal(up, u[:, perm])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, v", [(1, 49_152), (5, 700), (37, 3_001), (9, 2**15 + 3)])
def test_gumbel_argmax_draws_what_the_hash_formula_draws(device, b, v, monkeypatch):
    """The sampler's Gumbel-max (`gumbel_argmax`: the noise made a block of rows at a time in int32, in place) draws
    what x - log(-log(hash_uniform(...))) draws, and its uniforms are hash_uniform's bit for bit: seeds past 32 bits
    and negative, steps past 2**32, blocks that split the batch unevenly."""
    import ostinato.layers.gumbel as gumbel

    monkeypatch.setattr(gumbel, "GUMBEL_CHUNK", 4 * v)  # 4 rows a block off CUDA
    gen = torch.Generator().manual_seed(b * v)
    seeds = torch.randint(-(2**63), 2**63 - 1, (b,), generator=gen, dtype=torch.int64).to(device)
    steps = torch.randint(0, 2**40, (b,), generator=gen, dtype=torch.int64).to(device)
    ref_u = hash_uniform(seeds, steps, torch.arange(v, device=device))
    keys = gumbel._as_int32(gumbel._mix32(gumbel._mix32(gumbel._mix32(
        (seeds & 0xFFFFFFFF) ^ 0x3C6EF372) ^ ((seeds >> 32) & 0xFFFFFFFF)) ^ (steps & 0xFFFFFFFF)))
    h = torch.empty(b, v, dtype=torch.int32, device=device)
    u = gumbel._uniforms_(torch.empty(b, v, device=device), h, torch.empty_like(h),
                               gumbel._id_hashes(v, torch.device(device)), keys)
    assert torch.equal(u, ref_u)
    for scale in (0.05, 3.0):  # near-flat rows: the noise decides
        x = (torch.randn(b, v, generator=gen) * scale).to(device)
        expect = (x - gumbel.log_neg_log_(ref_u.clone())).argmax(dim=-1)
        assert torch.equal(gumbel.gumbel_argmax(x, seeds, steps), expect)


def test_gumbel_noise_formula_is_log_neg_log_at_every_uniform():
    """The noise's formula (a series for -log(u) near u = 1, log2 elsewhere), in torch (`layers/gumbel.log_neg_log_`)
    and in Triton (`triton_ops/gumbel.log_neg_log`: the interpreter's log2 on the CPU, the hardware's approximate one
    compiled for CUDA), equals float64 log(-log(u)) at every one of the hash's 2**23 uniforms, the tails included
    (u = 2**-24, where -log(u) = 16.6, and u = 1 - 2**-24, where it is 2**-24): within 2e-6 (about an fp32 ulp of
    the largest values) on the CPU, 4e-6 compiled. A wrong series coefficient breaks it (1/3 -> 0.3 did); on a GPU
    so would the approximate log2 used near u = 1, whose absolute error (~2**-22) is there as large as -log(u)."""
    import ostinato.layers.gumbel as gumbel

    u = (torch.arange(2**23, dtype=torch.float32) + 0.5) * 2.0**-23
    ref = (-u.double().log()).log()
    torch_noise = gumbel.log_neg_log_(u.clone())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel_noise = torch.empty(u.numel(), device=device)
    block = 2**20 if device == "cpu" else 1024  # the interpreter's cost is per program, a compiled kernel's per lane
    _noise_kernel[(u.numel() // block,)](u.to(device), kernel_noise, u.numel(), BLOCK=block)
    for got, tol in ((torch_noise, 2e-6), (kernel_noise.cpu(), 2e-6 if device == "cpu" else 4e-6)):
        err = (got.double() - ref).abs()
        assert err.max().item() < tol, (err.max().item(), u[err.argmax()].item())


def test_top_p_cut_from_a_sorted_head_equals_the_full_sort(monkeypatch):
    """Off CUDA a top_p row's cut is looked for among its highest logits first, more of them until they hold top_p
    of its mass (`_sorted_head`): the draws equal a full sort's, for peaked rows (found among the first few, with no
    sort), flat ones (the whole row), top_k rows and rows with both, min_p beside them, and greedy rows with a
    top_p."""
    import ostinato.runner.sampler as sampler_mod

    b, v = 24, 3_000
    gen = torch.Generator().manual_seed(11)
    calls = []
    real_topk, real_sort = torch.Tensor.topk, torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "topk", lambda x, k, **kw: calls.append(k) or real_topk(x, k, **kw))
    monkeypatch.setattr(torch.Tensor, "sort", lambda x, **kw: calls.append("sort") or real_sort(x, **kw))
    for scales, top_ks in (([8.0, 0.2, 3.0, 1.0], [-1, 40, 700]), ([9.0], [-1, 30])):
        scale = torch.tensor(scales * (b // len(scales)))[:, None]  # peaked to flat rows
        logits = torch.randn(b, v, generator=gen) * scale
        params = [SamplingParams(temperature=0.0 if i % 7 == 0 else 0.5 + 0.1 * (i % 5),
                                 top_p=[0.5, 0.9, 0.99, 1.0][i % 4], top_k=top_ks[i % len(top_ks)] if i % 5 else -1,
                                 min_p=0.02 if i % 6 == 0 else 0.0) for i in range(b)]
        t = SamplingTensors.from_params(params, list(range(b)), [3] * b, v, "cpu")
        assert t.need_top_p and t.need_top_k and t.sort_width == v
        calls.clear()
        monkeypatch.setattr(sampler_mod, "TOP_P_HEAD", 16)
        head = sample(logits, t)
        assert calls[0] == max(top_ks), calls  # the largest top_k first
        if len(scales) == 1:
            assert "sort" not in calls, calls  # peaked rows: the cut within a head
        monkeypatch.setattr(sampler_mod, "TOP_P_HEAD", v)  # the full sort
        assert torch.equal(head, sample(logits, t))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda():
    logits = rand_logits(8, 5000, 8).cuda()
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=0),
    ] * 4
    t = SamplingTensors.from_params(params, list(range(8)), [0] * 8, 5000, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.cpu(), run(logits.cpu(), params, list(range(8)), [0] * 8))


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_is_added_before_sampling(device):
    """logit_bias: a row's draw equals the draw from its logits with the biases added by hand (greedy and
    sampled rows, same seeds), rows without one are untouched, the precomputed argmax is not used, and the
    logits tensor itself (a graph's output buffer) is left as it was."""
    from ostinato.runner.sampler import sample_tensors

    b, v = 6, 3000
    logits = rand_logits(b, v, 11).to(device)
    before = logits.clone()
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias={top[0]: -100.0}),  # the greedy pick banned
        SamplingParams(temperature=0.0, logit_bias={5: 100.0, top[1]: -3.5}),  # token 5 forced
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, logit_bias={17: 40.0, top[3]: -100.0}),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=1.0, logit_bias={top[5]: 2.5}),
    ]
    seeds, steps = [3, 1, 4, 1, 5, 9], [0, 2, 7, 1, 8, 2]
    t = SamplingTensors.from_params(params, seeds, steps, v, device)
    marker = torch.full((b,), 7, device=device)
    got = sample_tensors(logits, t, marker).ids
    biased = before.clone()
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            biased[row, token] += bias
    plain = [SamplingParams(**{**vars(p), "logit_bias": None}) for p in params]
    want = run(biased, plain, seeds, steps)
    assert torch.equal(got, want)
    assert got[0] != top[0] and got[1] == 5 and got[2] == top[2] and got[3] != top[3]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("rows", [1, 3, 6, 37])
def test_sampling_inputs_match_each_rows_params(rows):
    """from_params' columns and flags (built a field at a time in numpy, the columns in one host buffer) against each
    row's own SamplingParams, on random mixed batches; every column 16-byte aligned at any batch size."""
    import random

    rng, v = random.Random(rows), 1000
    for trial in range(20):
        params = [SamplingParams(temperature=rng.choice([0.0, 1e-6, 0.6, 1.3]),
                                 top_k=rng.choice([-1, 0, 1, 50, v, v + 5]),
                                 top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.1]),
                                 presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                                 repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
                                 logprobs=rng.choice([None, None, 2])) for _ in range(rows)]
        seeds = [rng.choice([rng.getrandbits(40), -rng.getrandbits(63), 2**64 - rng.getrandbits(8)]) for _ in params]
        steps = [rng.randrange(5000) for _ in params]
        counts = [[rng.randrange(v) for _ in range(3)] for _ in params]
        t = SamplingTensors.from_params(params, seeds, steps, v, "cpu", output_token_ids=counts,
                                        prompt_token_ids=counts)
        rand = [p for p in params if not p.is_greedy]
        assert t.all_greedy == (not rand)
        assert t.need_top_k == any(1 <= p.top_k < v for p in rand)
        assert t.need_top_p == any(p.top_p < 1.0 for p in rand)
        # (the fused kernels' top_p search: a top_p row without a top_k of at most KEPT_TOP_K)
        assert t.need_top_p_search == any(p.top_p < 1.0 and not 1 <= p.top_k <= min(KEPT_TOP_K, v - 1) for p in rand)
        assert t.need_min_p == any(p.min_p > 0.0 for p in rand)
        widths = [p.top_k if 1 <= p.top_k < v else v for p in rand if 1 <= p.top_k < v or p.top_p < 1.0]
        assert t.sort_width == max(widths, default=v)
        assert t.num_logprobs == ([p.logprobs for p in params] if any(p.logprobs for p in params) else None)
        cols = {"temperatures": [p.temperature for p in params], "top_ps": [p.top_p for p in params],
                "min_ps": [p.min_p for p in params], "top_ks": [p.top_k if 1 <= p.top_k < v else v for p in params],
                "seeds": [(s + 2**63) % 2**64 - 2**63 for s in seeds], "steps": steps}
        for name, want in cols.items():
            got = getattr(t, name)
            assert (got is None) == (not rand), name
            if got is not None:
                assert got.dtype == (torch.int64 if name in ("top_ks", "seeds", "steps") else torch.float32)
                assert got.tolist() == torch.tensor(want, dtype=got.dtype).tolist(), (name, trial)
        penalized = any(p.has_penalties for p in params)
        repeated = any(p.repetition_penalty != 1.0 for p in params)
        assert (t.presence_penalties is None) == (not penalized) and (t.output_counts is None) == (not penalized)
        assert (t.repetition_penalties is None) == (not repeated)
        if penalized:
            assert t.presence_penalties.tolist() == [p.presence_penalty for p in params]
            assert t.frequency_penalties.tolist() == [p.frequency_penalty for p in params]
        if repeated:
            assert t.repetition_penalties.tolist() == pytest.approx([p.repetition_penalty for p in params])
        for name in (*cols, "presence_penalties", "frequency_penalties", "repetition_penalties"):
            col = getattr(t, name)
            assert col is None or (col.is_contiguous() and col.data_ptr() % 16 == 0), name
