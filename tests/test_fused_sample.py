"""The fused sampling kernel (runner/fused_sample.py) draws exactly what the torch sampler draws.

Without a GPU the kernel runs in Triton's interpreter at small vocabularies; with one, at real ones too.
"""

import math
import os
import shutil

if shutil.which("nvidia-smi") is None:  # must be set before the kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the fused sampler is a Triton kernel")

from ostinato.runner.sampler import SamplingTensors, padded_vocab, sample, sample_fused, sample_torch  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
VOCABS = [700, 2048 + 37] + ([128_256, 151_936] if GPU else [])


def _params(gen: torch.Generator, b: int, min_p: bool, cut: bool) -> list[SamplingParams]:
    out = []
    for i in range(b):
        if i % 4 == 0:
            out.append(SamplingParams(temperature=0.0))
            continue
        t = 0.3 + 1.2 * torch.rand(1, generator=gen).item()
        kw = {"min_p": 0.05 * (i % 3)} if min_p else {}
        if cut:  # top_k alone, top_p alone, both, and neither
            kw["top_k"] = [1, 5, 50, -1][i % 4] if i % 3 else -1
            kw["top_p"] = [1.0, 0.3, 0.9, 0.97][i % 4] if i % 2 else 1.0
        out.append(SamplingParams(temperature=t, **kw))
    return out


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("min_p", [False, True])
@pytest.mark.parametrize("cut", [False, True])
def test_fused_equals_torch_sampler(vocab, min_p, cut):
    if cut and not GPU and vocab > 2048:
        pytest.skip("the interpreter runs the cut search slowly: one multi-split vocabulary is enough on the CPU")
    gen = torch.Generator().manual_seed(vocab + 2 * min_p + cut)
    b = 16
    params = _params(gen, b, min_p, cut)
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=gen).tolist()
    steps = torch.randint(0, 5000, (b,), generator=gen).tolist()
    # a logits buffer as the decode graph keeps it: padded to whole argmax chunks with -inf columns
    logits = torch.full((b, padded_vocab(vocab)), float("-inf"))
    logits[:, :vocab] = torch.randn(b, vocab, generator=gen) * 2.5
    logits = logits.to(DEVICE)
    t = SamplingTensors.from_params(params, seeds, steps, vocab, DEVICE)
    assert t.fused_ok
    # on CUDA `sample` itself picks the kernel
    fused = (sample if GPU else sample_fused)(logits[:, :vocab], t)
    reference = sample_torch(logits[:, :vocab], t)
    assert torch.equal(fused.cpu(), reference.cpu())
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    assert torch.equal(fused.cpu()[greedy], logits[greedy, :vocab].argmax(-1).cpu())
    assert fused.max().item() < vocab


@pytest.mark.parametrize("b", [5, 12])  # under GATHER_MIN_BATCH: eight passes; from it: the gather and the resolve
@pytest.mark.parametrize("min_p", [False, True])
def test_one_launch_search_draws_what_the_torch_sampler_draws(b, min_p, monkeypatch):
    """top_p's search and the draw under the cut as one launch (`_top_p_search_kernel`: the passes, the resolve and
    the draw with the row's programs waiting for each other between them), against the torch sampler. On the CPU
    with one split a row (the interpreter runs a launch's programs one after another, and a row's one program never
    waits for another); on a GPU at the real vocabularies too, where it is the default."""
    from ostinato.runner import fused_sample

    monkeypatch.setattr(fused_sample, "PERSISTENT", "1")
    taken = []
    real = fused_sample._persistent_search
    monkeypatch.setattr(fused_sample, "_persistent_search", lambda *a: taken.append(real(*a)) or taken[-1])
    for vocab in [700] + ([151_936] if GPU else []):
        gen = torch.Generator().manual_seed(vocab + b + min_p)
        params = _params(gen, b, min_p, True)
        seeds = torch.randint(-(2**62), 2**62, (b,), generator=gen).tolist()
        steps = torch.randint(0, 5000, (b,), generator=gen).tolist()
        logits = (torch.randn(b, vocab, generator=gen) * 2.5).to(DEVICE)
        t = SamplingTensors.from_params(params, seeds, steps, vocab, DEVICE)
        assert torch.equal(sample_fused(logits, t).cpu(), sample_torch(logits, t).cpu()), vocab
    assert taken and all(taken), taken


def test_one_launch_where_one_filter_searches_a_small_batch_whose_splits_fit(monkeypatch):
    """`_persistent_search`'s rule (the GPU's decision, with the device's SM count stubbed): by default at most
    PERSISTENT_MAX_BATCH rows, no more splits than the SMs the process may use (an MPS client's share counted), and
    not top_p's search passes beside top_k (top_k alone, top_p alone, or both with every top_p row's top_k small);
    "0" never, "1" wherever the splits fit; on the CPU only when forced, one split a row."""
    import types

    from ostinato.runner import fused_sample

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(fused_sample, "PERSISTENT", "auto")  # the default, whatever the run forces
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    rule = fused_sample._persistent_search
    cap = fused_sample.PERSISTENT_MAX_BATCH
    one = [(False, True, True), (True, False, False), (True, True, False)]  # (top_k, top_p, top_p's search passes)
    for f in one:
        assert rule(cuda, 63, 1, *f) and rule(cuda, 16, cap, *f)
        assert not rule(cuda, 16, cap + 1, *f) and not rule(cuda, 133, 1, *f)
    assert not rule(cuda, 63, 1, True, True, True) and not rule(cuda, 63, 1, False, False, False)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")  # 33 SMs
    assert not rule(cuda, 63, 1, *one[0]) and all(rule(cuda, 16, cap, *f) for f in one)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "most")  # unreadable: the one launch stays off
    assert not rule(cuda, 16, cap, *one[0])
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    assert not any(rule(cpu, 1, 1, *f) for f in one)
    monkeypatch.setattr(fused_sample, "PERSISTENT", "1")
    assert rule(cuda, 16, 256, True, True, True) and all(rule(cuda, 16, 256, *f) for f in one)
    assert not rule(cuda, 133, 1, *one[0]) and not rule(cpu, 2, 4, *one[0])
    assert all(rule(cpu, 1, 4, *f) for f in one)
    assert not rule(cuda, 16, 4, False, False, False)  # no filter: nothing to search
    monkeypatch.setattr(fused_sample, "PERSISTENT", "0")
    assert not any(rule(cuda, 63, 1, *f) for f in one)


@pytest.mark.parametrize("min_p", [False, True])
@pytest.mark.parametrize("top_p", [False, True])
def test_one_launch_top_k_select_draws_what_the_torch_sampler_draws(min_p, top_p, monkeypatch):
    """top_k's select and the draw under its cut as one launch (`_top_k_search_kernel`: the passes up to the row's
    gather, the resolve, the draw, the row's programs waiting for each other between them), against the torch
    sampler, with one split a row on the CPU (the interpreter runs a launch's programs one after another). The rows
    reach every way the select ends: rows whose range is gathered after pass 0 and resolved by ranks (flat, k 5) or
    by radix rounds (k 300 within a block of 600 values: more than _PAIR_KEYS keys gathered); a row whose k-th
    value lies in a block of 3,000 close values (k 100), gathered only at pass 2; one whose k-th value is tied
    3,000 times, never gathered, so every pass runs and the resolve reads the last histogram; min_p keeping fewer
    than k columns (nothing cut); and peaked rows whose first draw is kept (not searched). With top_p on the first
    five rows, top_p's cut over what top_k keeps follows in the same launch: ranked where at most _PAIR_KEYS keys
    lie above top_k's cut (with 3,000 ties at it in one row), narrowed where more do (k 300 and 2,000)."""
    from ostinato.runner import fused_sample

    vocab = 6007
    monkeypatch.setattr(fused_sample, "PERSISTENT", "1")
    monkeypatch.setattr(fused_sample, "split_plan", lambda batch, v: (-(-v // 2048) * 2048, 1))
    launched = []
    real = fused_sample._top_k_search_kernel
    monkeypatch.setattr(fused_sample, "_top_k_search_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    gen = torch.Generator().manual_seed(61 + min_p)
    flat = torch.randn(2, vocab, generator=gen) * 0.3
    flat[1] = 0.9 * torch.rand(vocab, generator=gen)
    flat[1, torch.randperm(vocab, generator=gen)[:600]] = 1.0 + torch.rand(600, generator=gen) / 10  # one block
    close = torch.randn(vocab, generator=gen) - 4.0
    close[torch.randperm(vocab, generator=gen)[:3000]] = 1.0 + torch.rand(3000, generator=gen) / 16  # one block
    tied = 1.0 + 0.4 * torch.rand(vocab, generator=gen)  # mass enough below the cut for the first draw to fall there
    tied[torch.randperm(vocab, generator=gen)[:3000]] = 1.5
    tied[:10] = 2.0
    peaked = torch.randn(2, vocab, generator=gen) * 3
    logits = torch.cat([flat, close[None], tied[None], flat[:1], peaked]).contiguous()
    ks = [5, 300, 100, 30, 2000, 50, 3]
    mins = [0.0, 0.01, 0.0, 0.0, 0.97, 0.05, 0.0] if min_p else [0.0] * len(ks)
    ps = [0.9, 0.5, 0.95, 0.8, 0.3, 1.0, 1.0] if top_p else [1.0] * len(ks)
    params = [SamplingParams(temperature=0.7, top_k=k, min_p=m, top_p=p) for k, m, p in zip(ks, mins, ps, strict=True)]
    free = [SamplingParams(temperature=0.7, min_p=m) for m in mins]
    b = len(params)
    logits = logits.to(DEVICE)
    steps = [7] * b

    def searched(seeds: list[int]) -> torch.Tensor:  # the rows whose unrestricted draw top_k cuts
        draw = [sample_torch(logits, SamplingTensors.from_params(p, seeds, steps, vocab, DEVICE)) for p in (params,
                                                                                                           free)]
        return (draw[0] != draw[1]).cpu()

    tries = torch.stack([searched([1000 * j + i for i in range(b)]) for j in range(8)])
    wanted = torch.tensor([True] * 5 + [False] * 2)  # each row's first seed searched (rows 0-4) or kept (5, 6)
    seeds = [1000 * int((tries[:, i] == wanted[i]).int().argmax()) + i for i in range(b)]
    assert torch.equal(searched(seeds)[:4], wanted[:4]) and not searched(seeds)[5:].any(), tries
    t = SamplingTensors.from_params(params, seeds, steps, vocab, DEVICE)
    assert (t.need_top_k, t.need_top_p, t.need_top_p_search) == (True, top_p, False)
    assert torch.equal(sample_fused(logits, t).cpu(), sample_torch(logits, t).cpu())
    assert launched == [(1, b)]


@pytest.mark.skipif(GPU, reason="denormal logits (a GPU may flush them); the GPU runs the one launch at real splits")
def test_one_launch_search_runs_the_passes_after_an_overfull_gather(monkeypatch):
    """Rows whose top_p cut is a block of 3,000 tied columns (0.0): the gathered range holds more columns than the
    gather keeps (2,048 at one split a row), so the resolve leaves the row and the passes after the gather finish it,
    inside the one launch. Just below the block, 1,000 columns of negative denormals, whose order keys (-2 to -1001)
    lie inside the gathered range: a search that stopped at the gather would keep them. Flat weights, the first
    draw checked alone (no second best), so the rows whose draw falls below the block are searched; against the
    torch sampler."""
    from ostinato.runner import fused_sample

    vocab, b = 4101, 32
    monkeypatch.setattr(fused_sample, "PERSISTENT", "1")
    monkeypatch.setattr(fused_sample, "SECOND_BEST", "0")
    monkeypatch.setattr(fused_sample, "split_plan", lambda batch, v: (-(-v // 2048) * 2048, 1))
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(4))
    row = torch.zeros(vocab)
    row[order[:100]] = 1e-3  # above the block
    row[order[100:1100]] = -torch.arange(1, 1001).to(torch.int32).view(torch.float32)  # -denormals: keys -2 .. -1001
    row[order[1100]] = -1e-3
    logits = row.expand(b, vocab).contiguous().to(DEVICE)
    seeds, steps = [13 * i + 1 for i in range(b)], [7] * b
    t = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_p=0.5)] * b, seeds, steps, vocab, DEVICE)
    free = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * b, seeds, steps, vocab, DEVICE)
    want = sample_torch(logits, t).cpu()
    searched = want != sample_torch(logits, free).cpu()
    assert searched.any() and not searched.all(), searched
    assert (row[want] >= 0.0).all()  # the cut is the block's value
    assert torch.equal(sample_fused(logits, t).cpu(), want)


@pytest.mark.parametrize("kinds", ["top_k", "top_p", "both"])
def test_cut_search_over_many_splits(kinds, search_form):
    """The cut search spread over a row's splits (5 here): batches with top_k rows only, top_p rows only (a
    search with no row is skipped), and both, against the torch sampler."""
    vocab, b = 4 * 2048 + 11, 3
    gen = torch.Generator().manual_seed(len(kinds))
    kw = {"top_k": [dict(top_k=k) for k in (1, 7, 300)], "top_p": [dict(top_p=p) for p in (0.2, 0.8, 0.99)],
          "both": [dict(top_k=40, top_p=0.5), dict(top_k=2, top_p=0.99), dict(top_k=500, top_p=0.9)]}[kinds]
    params = [SamplingParams(temperature=0.5 + 0.4 * i, **kw[i]) for i in range(b)]
    logits = (torch.randn(b, vocab, generator=gen) * 3).to(DEVICE)
    t = SamplingTensors.from_params(params, [11, 22, 33], [5, 6, 7], vocab, DEVICE)
    assert (t.need_top_k, t.need_top_p) == {"top_k": (True, False), "top_p": (False, True), "both": (True, True)}[kinds]
    assert t.fused_args()[6][2] == (kinds == "top_p")  # "both": every top_p row's cut from its kept keys
    assert torch.equal(sample_fused(logits, t).cpu(), sample_torch(logits, t).cpu())


@pytest.mark.parametrize("kinds", ["top_k", "top_p", "both"])
def test_unrestricted_draw_kept_or_searched(kinds, monkeypatch, search_form):
    """Rejection first: a row whose unrestricted Gumbel-max draw survives its top_k / top_p keeps it, the others
    are searched and drawn again under the cut. One batch holds both kinds of row: peaked rows whose draw survives,
    flat rows with a small top_k or top_p whose draw does not, and rows of a few tied values (the k-th value tied
    with the draw's). Both kinds occur, and every row draws what the torch sampler draws."""
    vocab, b = 2 * 2048 + 21, 9
    gen = torch.Generator().manual_seed(len(kinds) + 100)
    logits = torch.randn(b, vocab, generator=gen)
    logits[0:3, 17] += 14.0  # peaked: the draw is column 17, inside any cut
    logits[3:6] *= 0.05  # flat: the draw is anywhere
    logits[6:9] = torch.randint(0, 3, (3, vocab), generator=gen).float()  # three values, ~a third of the row each
    cut = {"top_k": [dict(top_k=k) for k in (5, 1, 40, 3, 2, 8, 300, 2000, vocab // 2)],
           "top_p": [dict(top_p=p) for p in (0.9, 0.5, 0.99, 0.01, 0.02, 0.05, 0.3, 0.6, 0.95)],
           "both": [dict(top_k=k, top_p=p) for k, p in ((5, 0.9), (50, 0.5), (2, 0.99), (3, 0.9), (100, 0.01),
                                                        (9, 0.5), (300, 0.5), (2000, 0.4), (vocab // 2, 0.9))]}[kinds]
    temps = [0.6 + 0.1 * (i % 4) for i in range(b)]
    seeds, steps = [7 * i + 1 for i in range(b)], [3 + i for i in range(b)]
    t = SamplingTensors.from_params([SamplingParams(temperature=temps[i], **cut[i]) for i in range(b)], seeds, steps,
                                    vocab, DEVICE)
    free = SamplingTensors.from_params([SamplingParams(temperature=x) for x in temps], seeds, steps, vocab, DEVICE)
    logits = logits.to(DEVICE)
    want = sample_torch(logits, t).cpu()
    kept = want == sample_torch(logits, free).cpu()  # the unrestricted draw survived the cuts
    assert kept.any() and not kept.all(), kept
    assert torch.equal(sample_fused(logits, t).cpu(), want)
    # the rows whose draw survived never read a cut: with every cut poisoned they draw the same
    from ostinato.runner import fused_sample

    monkeypatch.setattr(fused_sample, "PERSISTENT", "0")  # the search's launches, whose cuts are poisoned below
    real = fused_sample._cuts
    monkeypatch.setattr(fused_sample, "_cuts", lambda *a, **kw: torch.full_like(real(*a, **kw), float("nan")))
    assert torch.equal(sample_fused(logits, t).cpu()[kept], want[kept])


@pytest.mark.parametrize("kinds, layout", [("top_k", "splits"), ("top_p", "splits"), ("both", "splits"),
                                            ("top_p", "lanes")])
def test_second_best_draw_decides_a_row_whose_first_is_cut(kinds, layout, monkeypatch):
    """Rejection first also checks each row's second best draw: where the unrestricted draw j1 is certainly outside
    the row's top_k / top_p and the second j2 is inside, j2 is the draw under the cut (the same noise), with no
    search. Rows built from the noise itself (rows 0-3): all logits 0 but j2's, a little above, and j1's, a little
    below, so the filters keep j2 first and drop j1 (top_k 1, or top_p 0.5, or both), and the perturbed order still
    puts j1 first and j2 second; j2 in j1's split and in another ("splits"), or, with one split a row, in j1's
    lane of the kernel's block and in another ("lanes": a lane's second best). Beside them rows whose j1 stands
    (4, 5), rows that need the search (6, 7), and a row (8) whose j1 is kept but, with top_k and top_p both, fails
    the safe check (mass 0.88 above it, 0.95 at or above it, top_p 0.9 of top_k 3's 1.0): its j2 (the row's top logit)
    passes, yet the row must be searched. Every row draws what the torch sampler draws; with every cut poisoned the
    rows that j1 or j2 decide still do, and without the second's check (OSTINATO_SAMPLER_SECOND=0)
    the j2 rows do not."""
    from ostinato.layers.gumbel import hash_uniform, log_neg_log_
    from ostinato.runner import fused_sample

    monkeypatch.setattr(fused_sample, "SECOND_BEST", "1")  # (by default only where top_p is the one filter)
    vocab, b = 2 * 2048 + 21, 9
    if layout == "lanes":
        monkeypatch.setattr(fused_sample, "_TARGET_PROGRAMS", 1)
    split_len, num_splits = fused_sample.split_plan(b, vocab)
    assert (num_splits > 1) == (layout == "splits")
    block = fused_sample._BLOCK

    def part(column: int) -> int:
        """The column's split, or with one split a row its lane of the kernel's block."""
        return column // split_len if layout == "splits" else column % block
    temp = 0.7

    def noise(seed: int) -> torch.Tensor:
        return -log_neg_log_(hash_uniform(torch.tensor([seed]), torch.tensor([11]), torch.arange(vocab))[0])

    def seed_where(start: int, ok) -> tuple[int, list[int], list[float]]:
        seed = start
        while True:
            seed += 1
            top = noise(seed).topk(3)
            if ok(top.indices.tolist(), top.values.tolist()):
                return seed, top.indices.tolist(), top.values.tolist()

    cut = {"top_k": dict(top_k=1), "top_p": dict(top_p=0.5), "both": dict(top_k=1, top_p=0.9)}[kinds]
    tight = {"top_k": dict(top_k=1), "top_p": dict(top_p=0.01), "both": dict(top_k=1, top_p=0.9)}[kinds]
    safe = {"top_k": dict(top_k=3), "top_p": dict(top_p=0.9), "both": dict(top_k=3, top_p=0.9)}[kinds]
    gen = torch.Generator().manual_seed(len(kinds) + 200)
    logits = torch.randn(b, vocab, generator=gen) * 0.05  # rows 6, 7: flat, tight cuts: searched
    logits[4:6, 99] += 14.0  # peaked: j1 = 99, inside any cut
    seeds = [500 + row for row in range(b)]
    for row in range(4):  # two rows with j2 in j1's split, two with j2 in another
        seeds[row], (j1, j2, _), (g1, g2, g3) = seed_where(1000 + 10_000 * row, lambda i, v, row=row: (
            (part(i[0]) == part(i[1])) == (row < 2) and v[0] - v[1] > 1e-2 and v[1] - v[2] > 1e-2))
        logits[row] = 0.0
        logits[row, j2] = (g1 - g2) / 4 * temp
        logits[row, j1] = -(g1 - g2) / 4 * temp
    seeds[8], (j1, j2, c), (g1, g2, _) = seed_where(5000, lambda i, v: v[0] - v[1] > 2.8)
    logits[8] = -30.0 * temp
    logits[8, j2], logits[8, j1], logits[8, c] = 0.0, math.log(0.07 / 0.88) * temp, math.log(0.05 / 0.88) * temp
    params = [SamplingParams(temperature=temp, **(cut if row < 4 else tight if row in (6, 7) else safe))
              for row in range(b)]
    steps = [11] * b
    t = SamplingTensors.from_params(params, seeds, steps, vocab, DEVICE)
    free = SamplingTensors.from_params([SamplingParams(temperature=temp)] * b, seeds, steps, vocab, DEVICE)
    logits = logits.to(DEVICE)
    want = sample_torch(logits, t).cpu()
    first = want == sample_torch(logits, free).cpu()  # j1 stands
    assert first[4:6].all() and first[8] and not first[:4].any() and not first[6:8].all()
    assert torch.equal(sample_fused(logits, t).cpu(), want)
    monkeypatch.setattr(fused_sample, "PERSISTENT", "0")  # the search's launches, whose cuts are poisoned below
    real = fused_sample._cuts
    monkeypatch.setattr(fused_sample, "_cuts", lambda *a, **kw: torch.full_like(real(*a, **kw), float("nan")))
    decided = torch.tensor([True] * 6 + [False, False, kinds != "both"])  # by j1 or j2 without a search
    assert torch.equal(sample_fused(logits, t).cpu()[decided], want[decided])
    monkeypatch.setattr(fused_sample, "SECOND_BEST", "0")
    alone = sample_fused(logits, t).cpu()
    assert torch.equal(alone[4:6], want[4:6]) and not torch.equal(alone[:4], want[:4])
    monkeypatch.setattr(fused_sample, "SECOND_BEST", "auto")  # the default: the check where top_p is the one filter
    assert torch.equal(sample_fused(logits, t).cpu()[:4], want[:4]) == (kinds == "top_p")


def _snapped(sorted_row: torch.Tensor, cut: torch.Tensor) -> float:
    """The row's value nearest the kernel's cut, where within its rounding: compiled, Triton's fp32 `/` is div.full
    (<= 2 ulp), so the kernel's x may sit an ulp or two from torch's."""
    if not cut.isfinite():
        return cut.item()
    near = (sorted_row - cut).abs().argmin()
    close = (sorted_row[near] - cut).abs() <= (5e-7 if GPU else 0.0) * cut.abs()
    return sorted_row[near].item() if close else cut.item()


@pytest.fixture(params=["gather", "passes"])
def search_form(request, monkeypatch):
    """top_p searches that gather their range's columns after GATHER_PASS (fused_sample.gather_cap), or that run
    every pass over the rows, whatever the batch size."""
    from ostinato.runner import fused_sample

    monkeypatch.setattr(fused_sample, "GATHER_MIN_BATCH", 1 if request.param == "gather" else 10**9)
    return request.param


@pytest.mark.parametrize("vocab", [3 * 2048 + 5] + ([151_936] if GPU else []))
def test_cuts_are_the_sorted_rows_thresholds(vocab, search_form):
    """The cut itself, each row's threshold on logits / temperature, not just the token drawn under it: top_k's
    is the k-th largest value exactly; top_p's (after min_p and top_k) holds at least top_p of the renormalized
    mass at and above it, and less strictly above it (float64, to fp32 summation's rounding). Rows with ties, a
    few distinct values only, a cut far below the row's maximum, and rows of adjacent floats (consecutive order
    keys, so the search's last passes split ranges of a few keys, with columns just past a range's end)."""
    from ostinato.runner.fused_sample import row_cuts, split_plan

    gen = torch.Generator().manual_seed(vocab)
    ks = [1, 7, 300, 2000, vocab, 50, vocab, 40, 37, vocab, 12, 203, 999]
    ps = [1.0, 1.0, 1.0, 1.0, 0.3, 1.0, 0.9, 0.95, 1.0, 0.5] + [1.0] * 3
    min_ps = [0.0] * 7 + [0.01] + [0.0] * 5
    b = len(ks)
    logits = torch.randn(b, vocab, generator=gen) * 3
    logits[5] = torch.randint(0, 6, (vocab,), generator=gen).float()  # a few values, many ties
    logits[3] *= 30  # a wide row: the k-th largest far below the maximum
    one = torch.tensor(1.0).view(torch.int32)
    for r in range(8, b):  # 1.0 and the next vocab - 1 floats up, shuffled
        logits[r] = (one + torch.randperm(vocab, generator=gen).to(torch.int32)).view(torch.float32)
    temps = torch.tensor([0.6, 1.0, 0.7, 1.3, 0.5, 1.0, 0.8, 1.1] + [1.0] * 5)
    assert split_plan(b, vocab)[1] > 1
    args = [t.to(DEVICE) for t in (logits, temps)]
    cuts = row_cuts(*args, torch.tensor(min_ps, device=DEVICE), torch.tensor(ks, device=DEVICE),
                    torch.tensor(ps, device=DEVICE), vocab, 1e-5).cpu()
    x = logits / temps[:, None]
    x = x.masked_fill(x - x.amax(-1, keepdim=True) < torch.tensor(min_ps).log()[:, None], float("-inf"))
    s = x.sort(-1, descending=True).values
    for r in range(b):
        kth = s[r, ks[r] - 1].item() if ks[r] < vocab else float("-inf")
        cut = _snapped(s[r], cuts[r])
        if ps[r] == 1.0:
            assert cut == kth, (r, cuts[r].item(), kth)
            continue
        xr = x[r][x[r] >= kth].double()
        mass = (xr - xr.max()).exp()
        at_or_above, above = mass[xr >= cut].sum(), mass[xr > cut].sum()
        goal = ps[r] * mass.sum()
        assert at_or_above >= goal * (1 - 1e-5) and above < goal * (1 + 1e-5), (r, at_or_above, above, goal)
    # top_k alone and no min_p: the search starts from +inf's key (no row maximum is taken)
    alone = row_cuts(*args, None, torch.tensor(ks, device=DEVICE), torch.ones(b, device=DEVICE), vocab, 1e-5,
                     (True, False)).cpu()
    s = (logits / temps[:, None]).sort(-1, descending=True).values
    for r in range(b):
        kth = s[r, ks[r] - 1].item() if ks[r] < vocab else float("-inf")
        assert _snapped(s[r], alone[r]) == kth, (r, alone[r].item(), kth)


def _passes_after_read_other_logits(monkeypatch, fused_sample, name: str, arg: int, last: int,
                                    gathered: int | str) -> None:
    """Replace fused_sample's pass kernel `name` by one whose passes after `last` (the pass index is its positional
    argument `arg`) read the logits negated: a row whose search those passes still work on gets another cut. Its
    first pass fills the gather buffer (positional or keyword argument `gathered`) with -1 first, so no keys are
    found there from an earlier call (CUDA's caching allocator hands the same memory back)."""
    launch = getattr(fused_sample, name)

    class LaterPassesMisread:
        def __getitem__(self, grid):
            def run(*a, **kw):
                if a[arg] == 0:
                    (kw[gathered] if isinstance(gathered, str) else a[gathered]).fill_(-1)
                if a[arg] > last:
                    a = (-a[0],) + a[1:]
                launch[grid](*a, **kw)
            return run

    monkeypatch.setattr(fused_sample, name, LaterPassesMisread())


def test_top_k_select_finishes_from_gathered_keys(monkeypatch):
    """top_k's select copies a row's range out once it holds at most TOP_K_GATHER columns, and the resolver finishes
    over those keys: the passes after that gather do not read the row. Ordinary rows gather at pass 1 (pass 0's
    blocks are an eighth of a binade); a row with 3,000 distinct values in its cut's block at pass 2; a row whose
    k-th value lies more than eight binades below its maximum (searched a byte a pass below pass 0's window) at
    pass 2; a row with 3,000 columns tied at its cut never (every pass counts it). Each cut is exact; with the
    passes after `last` reading other logits, exactly the rows finished by `last` keep theirs."""
    from ostinato.runner import fused_sample

    vocab, b = 2 * 2048 + 21, 5
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(b, vocab, generator=gen) * 2
    logits[2:4] -= 20.0
    logits[2, :3000] = 4.0 + 0.5 * torch.rand(3000, generator=gen)  # [4, 4.5): one block of 2**20 keys
    logits[3, :3000] = 1.2345  # 3,000 ties at the cut (every byte of its key nonzero)
    logits[4] = torch.randn(vocab, generator=gen)
    logits[4, 0] = 1000.0  # the k-th value (~2.7) is ~8.5 binades below the maximum
    ks = [5, 300, 1500, 5, 300]
    temps = torch.tensor([0.7, 1.0, 1.0, 1.0, 1.0])
    args = (logits.to(DEVICE), temps.to(DEVICE), None, torch.tensor(ks, device=DEVICE), torch.ones(b, device=DEVICE),
            vocab, 1e-5, (True, False))
    full = fused_sample.row_cuts(*args).cpu()
    x = logits / temps[:, None]
    kth = torch.stack([x[r].sort(descending=True).values[ks[r] - 1] for r in range(b)])
    assert torch.equal(full, kth) if not GPU else torch.allclose(full, kth, rtol=1e-6), (full, kth)
    needs = torch.tensor([1, 1, 2, 4, 2])  # the last pass each row needs
    for last in (1, 2):
        with monkeypatch.context() as m:
            _passes_after_read_other_logits(m, fused_sample, "_top_k_pass_kernel", 15, last, 9)
            short = fused_sample.row_cuts(*args).cpu()
        assert torch.equal(short == full, needs <= last), (last, short, full)


def test_top_k_resolve_ranks_a_few_gathered_keys_with_ties():
    """Where a row's gathered range holds at most _PAIR_KEYS keys, the resolve takes the k-th largest by pairwise
    ranks: exact against the sorted rows when the k-th value is tied with columns above and below it in rank, when
    the whole range is one value, and when it is the range's first or last key."""
    from ostinato.runner.fused_sample import row_cuts

    gen = torch.Generator().manual_seed(11)
    vocab, b = 2 * 2048 + 9, 5
    logits = torch.randn(b, vocab, generator=gen)
    logits[0, :40] = 3.3  # ties spanning ranks 21-60 (k 30)
    logits[1, :25] = 3.3  # the k-th the first of its ties
    logits[2, 100:160] = 2.9  # the k-th the last of its ties
    logits[3, :] = logits[3].clamp(max=1.0)
    logits[3, :12] = 3.75  # the range is one value only
    logits[4] = torch.randn(vocab, generator=gen) * 0.25 + 2.0  # a dense row
    logits[0, 40:60] = 4.0
    logits[2, 200:220] = 3.6
    ks = torch.tensor([30, 1, 80, 12, 7])
    cuts = row_cuts(logits.to(DEVICE), torch.ones(b, device=DEVICE), None, ks.to(DEVICE), torch.ones(b, device=DEVICE),
                    vocab, 1e-5, (True, False)).cpu()
    s = logits.sort(-1, descending=True).values
    assert torch.equal(cuts, s[torch.arange(b), ks - 1]), (cuts, s[torch.arange(b), ks - 1])


@pytest.mark.parametrize("with_min_p", [False, True])
def test_top_k_select_at_the_edges_of_the_key_space(with_min_p):
    """top_k's cut on rows the window below the maximum does not hold or that sit elsewhere in the key space: k just
    under the vocabulary, a narrow row of negative values, masked (-inf) columns at the cut, a wide row with a deep
    negative cut, a maximum of 1e30 (every other key far below the window), and (with min_p) more k than min_p
    keeps, where the cut is -inf. Exact against the sorted rows."""
    from ostinato.runner.fused_sample import row_cuts

    gen = torch.Generator().manual_seed(1)
    vocab, b = 3000, 6
    logits = torch.randn(b, vocab, generator=gen) * 2
    logits[1] = torch.randn(vocab, generator=gen) * 0.01 - 50
    logits[2, :100] = float("-inf")
    logits[3] = torch.randn(vocab, generator=gen) * 30
    logits[4, 0] = 1e30
    logits[5] = -logits[5].abs() - 1e-30
    ks = torch.tensor([2999, 1500, 2950, 2000, 10, 2000])
    temps = torch.tensor([0.7, 1.0, 1.0, 0.5, 1.0, 1.0])
    min_ps = torch.tensor([0.0] * 5 + [0.3]) if with_min_p else None
    cuts = row_cuts(logits.to(DEVICE), temps.to(DEVICE), None if min_ps is None else min_ps.to(DEVICE),
                    ks.to(DEVICE), torch.ones(b, device=DEVICE), vocab, 1e-5, (True, False)).cpu()
    x = logits / temps[:, None]
    if with_min_p:
        x = x.masked_fill(x - x.amax(-1, keepdim=True) < min_ps.log()[:, None], float("-inf"))
    s = x.sort(-1, descending=True).values
    for r in range(b):
        assert _snapped(s[r], cuts[r]) == s[r, ks[r] - 1].item(), (r, cuts[r].item(), s[r, ks[r] - 1].item())
    assert (cuts[5] == float("-inf")) == with_min_p


@pytest.mark.parametrize("kinds", ["top_p", "both"])
def test_top_p_resolver_finishes_rows_from_their_gathered_keys(kinds, monkeypatch):
    """A gathering top_p search (at fused_sample.GATHER_PASS) finishes ordinary rows from their gathered keys alone:
    with the passes after the gather reading other logits, their cuts are still the sorted rows' thresholds. A row
    of three values (a third of the row tied at its cut: more than a split holds) is left to those passes: then its
    cut is wrong, and right with the true logits. With top_k too every row's cut comes from its kept keys (the
    tied row's too, its ties counted), so none is left to the passes."""
    from ostinato.runner import fused_sample

    monkeypatch.setattr(fused_sample, "GATHER_MIN_BATCH", 1)
    vocab, b = 2 * 2048 + 21, 4
    gen = torch.Generator().manual_seed(7 + len(kinds))
    logits = torch.randn(b, vocab, generator=gen) * 2
    logits[3] = torch.randint(0, 3, (vocab,), generator=gen).float() * 0.5
    ks = {"top_p": [vocab] * 4, "both": [700, 40, 2000, 2000]}[kinds]
    ps = {"top_p": [0.9, 0.3, 0.99, 0.5], "both": [0.8, 0.95, 0.2, 0.5]}[kinds]
    temps = torch.tensor([0.7, 1.0, 0.5, 1.0])
    args = [t.to(DEVICE) for t in (logits, temps)]
    phases = (kinds != "top_p", True)
    ks_t, ps_t = torch.tensor(ks, device=DEVICE), torch.tensor(ps, device=DEVICE)
    full = fused_sample.row_cuts(*args, None, ks_t, ps_t, vocab, 1e-5, phases).cpu()
    _passes_after_read_other_logits(monkeypatch, fused_sample, "_top_p_pass_kernel", 15, fused_sample.GATHER_PASS,
                                    "Gathered")
    short = fused_sample.row_cuts(*args, None, ks_t, ps_t, vocab, 1e-5, phases).cpu()
    assert torch.equal(short[:3], full[:3]), (short, full)
    x = (logits / temps[:, None]).double()
    for r in range(b):
        kth = x[r].sort(descending=True).values[ks[r] - 1].item() if ks[r] < vocab else float("-inf")
        kept = x[r][x[r] >= kth]
        mass = (kept - kept.max()).exp()
        at_or_above, above = mass[kept >= full[r].item()].sum(), mass[kept > full[r].item()].sum()
        assert at_or_above >= ps[r] * mass.sum() * (1 - 1e-5) and above < ps[r] * mass.sum() * (1 + 1e-5), r
    assert (short[3] != full[3]) == (kinds == "top_p")  # the tied row needed the passes, without top_k


@pytest.mark.parametrize("kept_cap", [2048, 48])
def test_top_p_over_top_k_keep_is_found_from_the_kept_keys(kept_cap, monkeypatch):
    """With top_k and top_p in the batch, a row with both and k at most fused_sample.KEPT_CAP gets top_p's cut from
    the keys above its top_k cut, copied out in one pass, and a count of the columns tied at the cut: with every pass
    of top_p's search reading other logits, those rows' cuts are still the sorted rows' thresholds (float64), the
    same as the full search's within a float's rounding. That holds for a row whose k-th value is tied across ~3,000
    columns, a row whose top columns sit side by side in one split, and one where min_p keeps fewer than k (nothing
    cut). Rows with top_p alone or a k above the cap (2,500; with a cap of 48, 50 and 300 too) go by the passes:
    wrong with the misread passes, right with the true ones."""
    from ostinato.runner import fused_sample

    monkeypatch.setattr(fused_sample, "KEPT_CAP", kept_cap)
    monkeypatch.setattr(fused_sample, "GATHER_MIN_BATCH", 1)
    vocab = 3 * 2048 + 5
    gen = torch.Generator().manual_seed(11)
    ks = [50, 5, 300, vocab, 2500, 40, 20, 12]
    ps = [0.9, 0.5, 0.95, 0.8, 0.9, 0.7, 0.6, 1.0]
    min_ps = [0.0] * 6 + [0.5, 0.0]  # row 6: min_p keeps fewer than its k
    b = len(ks)
    logits = torch.randn(b, vocab, generator=gen) * 2.5
    logits[5] = torch.randint(0, 2, (vocab,), generator=gen).float() * 0.7  # ~3,000 columns tied at the 40th value
    logits[5, :30] += 1.0 + torch.rand(30, generator=gen)  # (30 distinct ones above them)
    logits[1, :40] += 9.0  # the top columns side by side in the first split
    temps = torch.tensor([0.6, 1.0, 0.8, 1.0, 1.2, 1.0, 0.9, 0.7])
    args = [t.to(DEVICE) for t in (logits, temps)] + [torch.tensor(min_ps, device=DEVICE),
                                                       torch.tensor(ks, device=DEVICE), torch.tensor(ps, device=DEVICE)]
    full = fused_sample.row_cuts(*args, vocab, 1e-5).cpu()
    by_kept = [k < vocab and p < 1.0 and k <= kept_cap for k, p in zip(ks, ps, strict=True)]
    assert [r for r in range(b) if by_kept[r]] == ([0, 1, 2, 5, 6] if kept_cap == 2048 else [1, 5, 6])
    _passes_after_read_other_logits(monkeypatch, fused_sample, "_top_p_pass_kernel", 15, -1, "Gathered")
    misread = fused_sample.row_cuts(*args, vocab, 1e-5).cpu()
    x = logits / temps[:, None]
    x = x.masked_fill(x - x.amax(-1, keepdim=True) < torch.tensor(min_ps).log()[:, None], float("-inf"))
    s = x.sort(-1, descending=True).values
    for r in range(b):
        kth = s[r, ks[r] - 1].item() if ks[r] < vocab else float("-inf")
        xr = x[r][x[r] >= kth].double()
        mass = (xr - xr.max()).exp()
        for cut in (full[r], misread[r]) if by_kept[r] else (full[r],):
            cut = _snapped(s[r], cut)
            if ps[r] == 1.0:
                assert cut == kth, r
                continue
            at_or_above, above = mass[xr >= cut].sum(), mass[xr > cut].sum()
            assert at_or_above >= ps[r] * mass.sum() * (1 - 1e-5) and above < ps[r] * mass.sum() * (1 + 1e-5), r
        if by_kept[r]:
            assert _snapped(s[r], misread[r]) == _snapped(s[r], full[r]), r
        elif ps[r] < 1.0:
            assert misread[r] != full[r], r  # the passes found it
    assert full[5].item() == torch.tensor(0.7).item()  # the tied value: top_p 0.7 of the mass reaches into the ties


def test_no_search_passes_where_every_top_p_row_has_a_small_top_k(monkeypatch):
    """fused_sample's third cut phase false (no top_p row without a top_k of at most KEPT_CAP, which
    `SamplingTensors` works out from the requests): top_p's search passes are not launched at all, and the cuts and
    the draws are those with the passes in."""
    from ostinato.runner import fused_sample

    launched = []
    launch = fused_sample._top_p_pass_kernel

    class Counted:
        def __getitem__(self, grid):
            launched.append(grid)
            return launch[grid]

    monkeypatch.setattr(fused_sample, "_top_p_pass_kernel", Counted())
    vocab, b = 2 * 2048 + 21, 6
    gen = torch.Generator().manual_seed(13)
    logits = (torch.randn(b, vocab, generator=gen) * 2).to(DEVICE)
    temps = torch.tensor([0.7, 1.0, 0.0, 1.2, 0.9, 1.0], device=DEVICE)  # row 2 greedy
    ks = torch.tensor([50, 7, 20, vocab, 300, 2048], device=DEVICE)  # row 3: neither filter
    ps = torch.tensor([0.9, 0.5, 0.95, 1.0, 0.8, 0.99], device=DEVICE)
    cuts = {phases: fused_sample.row_cuts(logits, temps, None, ks, ps, vocab, 1e-5, phases).cpu()
            for phases in ((True, True, True), (True, True, False))}
    assert len(launched) == fused_sample.PASSES  # the first call's only
    assert torch.equal(cuts[(True, True, True)], cuts[(True, True, False)])
    seeds = torch.arange(b, device=DEVICE) * 7
    steps = torch.full((b,), 3, device=DEVICE)
    drawn = [fused_sample.fused_sample(logits, temps, None, ks, ps, seeds, steps, vocab, 1e-5, phases).cpu()
             for phases in ((True, True), (True, True, False))]
    assert torch.equal(drawn[0], drawn[1])


def test_kept_path_buffers_are_aligned_at_any_batch(monkeypatch):
    """Triton specializes a kernel on whether each pointer is 16-byte aligned: a buffer sliced at a batch-dependent
    offset would compile the kernels that take it again at some batch sizes, mid-serving, after the warm-up (the
    GPU test test_sampler_warm_up_all_leaves_nothing_to_compile counts compiles). Every tensor the kept path and the
    passes after it are given is aligned, at batch sizes 1 to 6."""
    from ostinato.runner import fused_sample

    seen = []

    def watch(name):
        launch = getattr(fused_sample, name)

        class Watched:
            def __getitem__(self, grid):
                def run(*a, **kw):
                    seen.extend((name, t.data_ptr() % 16) for t in (*a, *kw.values()) if isinstance(t, torch.Tensor))
                    launch[grid](*a, **kw)
                return run

        monkeypatch.setattr(fused_sample, name, Watched())

    for name in ("_kept_gather_kernel", "_kept_top_p_kernel", "_top_p_pass_kernel", "_cut_finish_kernel"):
        watch(name)
    vocab = 700
    gen = torch.Generator().manual_seed(5)
    for b in range(1, 7):
        logits = (torch.randn(b, vocab, generator=gen) * 2).to(DEVICE)
        fused_sample.row_cuts(logits, torch.ones(b, device=DEVICE), None, torch.full((b,), 9, device=DEVICE),
                              torch.full((b,), 0.8, device=DEVICE), vocab, 1e-5)
    assert {n for n, _ in seen} == {"_kept_gather_kernel", "_kept_top_p_kernel", "_top_p_pass_kernel",
                                    "_cut_finish_kernel"}
    assert all(off == 0 for _, off in seen), [x for x in seen if x[1]]


def test_search_runs_over_the_verdicts_list_in_any_order(search_form):
    """With rejection first the search's launches run over `_verdict_kernel`'s list of the rows that need their cut
    (program i on its i-th row, splits side by side), which atomic adds fill in no fixed order on a GPU (the
    interpreter's programs run in row order). Given a list out of row order, with a stale row past its count, the
    listed rows get the cuts a search of every row gives, and the others' are left as they were."""
    from ostinato.runner import fused_sample

    vocab, b = 2 * 2048 + 21, 6
    gen = torch.Generator().manual_seed(31)
    logits = (torch.randn(b, vocab, generator=gen) * 2).to(DEVICE)
    temps = torch.tensor([0.7, 1.0, 0.5, 0.9, 1.2, 0.6], device=DEVICE)
    ks = torch.tensor([700, vocab, 40, 2000, 5, vocab], device=DEVICE)
    ps = torch.tensor([0.8, 0.3, 1.0, 0.5, 0.9, 0.95], device=DEVICE)
    full = fused_sample.row_cuts(logits, temps, None, ks, ps, vocab, 1e-5).cpu()
    plan = fused_sample.split_plan(b, vocab)
    split_max = fused_sample._split_max(logits, temps, None, True, vocab, 1e-5, *plan)
    listed = [4, 1, 5, 0]
    order = torch.tensor([len(listed), *listed, 2], dtype=torch.int32, device=DEVICE)  # row 2: stale, past the count
    real = fused_sample.torch.empty

    def unset(*shape, **kw):  # every buffer starts as NaN / -1, so a row the search skips shows as one
        out = real(*shape, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_sample.torch, "empty", unset)
        cuts = fused_sample._cuts(logits, temps, None, ks, ps, split_max, vocab, 1e-5, (True, True), *plan,
                                  dict(Order=order, CHECKED=True)).cpu()
    assert torch.equal(cuts[listed], full[listed]), (cuts, full)
    assert cuts[[2, 3]].isnan().all(), cuts  # not listed: the finish left them unset
    assert full[listed].isfinite().all()


def test_all_greedy_steps_skip_the_kernels():
    t = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 2, [1, 2], [0, 0], 1000, DEVICE)
    assert not t.fused_ok


@pytest.mark.parametrize("vocab", [700, 49_152, 100_352, 151_936])
def test_warm_up_compiles_each_kernel_class_once(vocab):
    """The engine's start-up warm-up (`fused_sample.warm_up_batches`) takes the smallest batch size of every kernel
    class up to the largest batch (a power of two of the split count, a top_p gather capacity, and whether top_p
    alone runs as one launch): every batch size then finds its kernels compiled."""
    import triton

    from ostinato.runner.fused_sample import PERSISTENT_MAX_BATCH, gather_cap, split_plan, warm_up_batches

    def key(b):
        n = split_plan(b, vocab)[1]
        return triton.next_power_of_2(n), gather_cap(b, n), b <= PERSISTENT_MAX_BATCH

    classes = {b: key(b) for b in range(1, 301)}
    batches = warm_up_batches(300, vocab)
    assert sorted({classes[b] for b in batches}) == sorted(set(classes.values()))
    assert len(batches) == len(set(classes.values()))
    assert all(classes[x] != classes[b] for b in batches for x in range(1, b))  # the first of its class
    # the gather starts inside a split class at GATHER_MIN_BATCH rows: its own entry there; and the separate top_p
    # launches past PERSISTENT_MAX_BATCH rows, whose kernels the batches up to it do not compile
    assert any(classes[b][1] == 0 for b in batches) and any(classes[b][1] > 0 for b in batches)
    assert PERSISTENT_MAX_BATCH + 1 in batches
    for b in (1, 7, 64, 300):  # the plan covers the vocabulary in whole blocks
        split_len, n = split_plan(b, vocab)
        assert split_len % 2048 == 0 and (n - 1) * split_len < vocab <= n * split_len


def _compiled_kernels() -> int:
    """Kernel variants Triton has compiled so far for the sampler's kernels (all devices)."""
    from ostinato.layers.triton_ops import argmax
    from ostinato.runner import fused_sample

    fns = [getattr(mod, n) for mod in (fused_sample, argmax) for n in dir(mod) if n.endswith("_kernel")]
    return sum(len(cache[0]) for fn in fns for cache in fn.device_caches.values())


@pytest.mark.skipif(not GPU, reason="counts Triton's compiled kernels (the interpreter compiles none)")
def test_warm_up_leaves_nothing_to_compile():
    """After `warm_up(..., filters=True)`, steps of any batch size up to the largest, with any filters, in graphs
    (a scatter) or eagerly, compile no kernel: none is compiled mid-serving."""
    from ostinato.runner.fused_sample import fused_sample, warm_up

    vocab, max_batch = 5_000 + 37, 40
    warm_up(max_batch, vocab, torch.device(DEVICE), row_strides=(padded_vocab(vocab),))
    before = _compiled_kernels()
    gen = torch.Generator(device="cpu").manual_seed(0)
    for b in range(1, max_batch + 1):
        for min_p, cut in ((False, False), (True, False), (False, True), (True, True), (False, "top_p"),
                           (False, "top_k"), (True, "top_k"), (False, "both"), (True, "both")):
            # top_p alone, top_k alone, or both with every top_p row's top_k small: one launch up to
            # PERSISTENT_MAX_BATCH rows, the separate launches past it
            alone = {"top_p": dict(top_p=0.9), "top_k": dict(top_k=50), "both": dict(top_k=20, top_p=0.95)}.get(cut, {})
            alone |= dict(min_p=0.05) if min_p and cut != "top_p" else {}
            params = [SamplingParams(temperature=0.7, **alone)] * b if isinstance(cut, str) else _params(gen, b,
                                                                                                        min_p, cut)
            t = SamplingTensors.from_params(params, list(range(b)), [0] * b, vocab, DEVICE)
            if not t.fused_ok:  # every row greedy: the kernels do not run
                continue
            padded = torch.randn(b, padded_vocab(vocab), generator=gen).to(DEVICE)
            scatter = (torch.empty(b, dtype=torch.int64, device=DEVICE), torch.arange(b, device=DEVICE))
            for logits, sc in ((padded[:, :vocab].contiguous(), None), (padded[:, :vocab], scatter)):
                fused_sample(logits, *t.fused_args()[:6], vocab, 1e-5, t.fused_args()[6], scatter=sc)
    torch.cuda.synchronize()
    assert _compiled_kernels() == before


def test_warm_up_runs():
    """The warm-up itself (on the CPU through the interpreter, at a small vocabulary)."""
    from ostinato.runner.fused_sample import warm_up

    warm_up(3, 700, torch.device(DEVICE))


def test_sampler_warm_up_arg():
    """--sampler-warm-up takes none, temperature or all (the default); anything else is refused by name."""
    import argparse

    from ostinato.config import EngineArgs

    assert EngineArgs().sampler_warm_up == "all"
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--sampler-warm-up", "temperature"]).sampler_warm_up == "temperature"
    with pytest.raises(ValueError, match="sampler_warm_up must be one of none, temperature, all"):
        EngineArgs(sampler_warm_up="filters")
