"""Sampling in a few Triton kernels with a fixed grid and no sort: temperature, min_p, top_k, top_p, greedy.

It draws what `sampler.sample_torch` draws: Gumbel-max over logits / temperature with the same counter-based
noise (`hash_uniform`'s hash, computed in uint32 arithmetic), after the same min_p filter; greedy rows take the
first index of the maximum. (Exactly so in Triton's interpreter. Compiled for CUDA, Triton's fp32 `/` is
div.full.f32, up to 2 ulp from torch's, and the noise's logarithms are the hardware's approximate log2
(`triton_ops/gumbel.py`: within 4e-6 of float64's noise), so a draw decided within that can differ.) A step reads the
logits once (twice with min_p: the row maximum first) instead of the eager path's ~25 elementwise passes over
[B, V]. top_k and top_p become one logit cut per row, found without sorting, each pass spread over the row's
splits: the same cut `sample_torch` reads off its sorted row. top_k's is a select over the floats' order keys,
histogram passes narrowing a key range (`_top_k_pass_kernel`): the first counts eighths of a binade down from the
row maximum, and once the range holds at most TOP_K_GATHER columns one pass copies them out and one program per row
finishes over those (`_top_k_resolve_kernel`), so most rows are read twice. top_p's is a 16-way search over the
order keys weighted by softmax mass (`_top_p_pass_kernel`; from 8 rows, its fifth pass gathers its range for
`_cut_resolve_kernel` likewise); a row with top_k too gets it from the keys its top_k keeps, copied out in one pass
(`_kept_top_p_kernel`). The search runs only for rows that need it: the row's unrestricted draw is taken
first, and where it survives the row's top_k / top_p (one counting pass, `_accept_part_kernel`) it is the draw
under the cut too; one program per row then lists the rows that need their cut (`_verdict_kernel`), and the
search's launches run over that list (their programs past its end exit at once); where top_p is a small batch's one
filter, top_p's search and the draw under the cut are one launch whose programs wait for each other between passes
(`_top_p_search_kernel`). Fixed grids, no host sync: capturable in a CUDA graph.

Import this module only for CUDA tensors or under TRITON_INTERPRET=1 (Triton fixes the choice between
the GPU and its CPU interpreter when the kernel is decorated).
"""

import os

import torch
import triton
import triton.language as tl

from ostinato.device_info import usable_sms
from ostinato.layers.sampling_ops import KEPT_TOP_K, CutPhases
from ostinato.layers.triton_ops.argmax import pick_rows
from ostinato.layers.triton_ops.gumbel import gumbel_perturbed, row_key


@triton.jit
def _program_row_split(Order, CHECKED: tl.constexpr):
    """(row, split, whether the program has a row) of a program of a (row, split) launch: program (row, split), or
    with CHECKED program (split, i) on the i-th row of `_verdict_kernel`'s list (Order: its count, then its rows), the
    splits of a listed row side by side; a program past the count has none and exits after that one read."""
    if CHECKED:
        i = tl.program_id(1)
        listed = i < tl.load(Order)
        return tl.load(Order + 1 + i, mask=listed, other=0).to(tl.int64), tl.program_id(0), listed
    else:
        return tl.program_id(0).to(tl.int64), tl.program_id(1), True


@triton.jit
def _program_row(Order, CHECKED: tl.constexpr):
    """(row, whether the program has a row) of a program of a one-program-a-row launch: program row, or with CHECKED
    program i on the i-th row of `_verdict_kernel`'s list."""
    i = tl.program_id(0)
    if CHECKED:
        listed = i < tl.load(Order)
        return tl.load(Order + 1 + i, mask=listed, other=0).to(tl.int64), listed
    else:
        return i.to(tl.int64), True


@triton.jit(do_not_specialize=["split_len", "num_splits"])  # kernels per batch size: one per SPLITS_POW2 only
def _split_max_kernel(Logits, stride_l, Temps, Out, vocab_size, split_len, num_splits, greedy_eps,
                      BLOCK: tl.constexpr):
    """Out[row, split] = max of logits / temperature over the split's columns."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(Temps + row)
    div = tl.where(temp < greedy_eps, 1.0, temp)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_size)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(Logits + row * stride_l + offs, mask=offs < hi, other=float("-inf")) / div)
    tl.store(Out + row * num_splits + split, tl.max(m, axis=0))


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _split_sample_kernel(Logits, stride_l, Temps, MinPs, SplitMax, Cuts, Seeds, Steps, OutVal, OutIdx, vocab_size,
                         split_len, num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, HAS_CUT: tl.constexpr,
                         BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, Order=None, CHECKED: tl.constexpr = False,
                         MaxOut=None, STORE_MAX: tl.constexpr = False, OutVal2=None, OutIdx2=None,
                         KEEP_SECOND: tl.constexpr = False):
    """Per (row, split): the best Gumbel-perturbed logit among the split's allowed columns and its first index.
    Greedy rows use no noise and no filter (their best is the argmax). CHECKED (the draw under the cuts, after
    the unrestricted one): only the rows that need their cut (grid (splits, B) over `_verdict_kernel`'s list), the
    others' bests left as they are.
    STORE_MAX (no min_p, no cut): also MaxOut[row, split] = the split's max of logits / temperature, as
    `_split_max_kernel` takes it. KEEP_SECOND (the unrestricted draw): also each split's second best, in (value
    descending, index ascending) order, into OutVal2 / OutIdx2."""
    row, split, listed = _program_row_split(Order, CHECKED)
    if listed == 0:
        return
    cut = float("-inf")
    if HAS_CUT:
        cut = tl.load(Cuts + row)
    _split_draw(row, split, Logits, stride_l, Temps, MinPs, SplitMax, cut, Seeds, Steps, OutVal, OutIdx, vocab_size,
                split_len, num_splits, greedy_eps, HAS_MIN_P, HAS_CUT, BLOCK, SPLITS_POW2, MaxOut, STORE_MAX, OutVal2,
                OutIdx2, KEEP_SECOND)


@triton.jit
def _split_draw(row, split, Logits, stride_l, Temps, MinPs, SplitMax, cut, Seeds, Steps, OutVal, OutIdx, vocab_size,
                split_len, num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, HAS_CUT: tl.constexpr, BLOCK: tl.constexpr,
                SPLITS_POW2: tl.constexpr, MaxOut=None, STORE_MAX: tl.constexpr = False, OutVal2=None, OutIdx2=None,
                KEEP_SECOND: tl.constexpr = False):
    """`_split_sample_kernel`'s draw for (row, split), under `cut` (a logit / temperature) where HAS_CUT."""
    temp = tl.load(Temps + row)
    greedy = temp < greedy_eps
    div = tl.where(greedy, 1.0, temp)
    key = row_key(Seeds, Steps, row)
    log_min_p = float("-inf")
    x_max = 0.0
    if HAS_MIN_P:
        s = tl.arange(0, SPLITS_POW2)
        x_max = tl.max(tl.load(SplitMax + row * num_splits + s, mask=s < num_splits, other=float("-inf")), axis=0)
        log_min_p = tl.where(greedy, float("-inf"), tl.log(tl.load(MinPs + row)))  # greedy rows: no filter
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_size)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    second_val = tl.full([BLOCK], float("-inf"), tl.float32)
    second_idx = tl.full([BLOCK], 2147483647, tl.int32)
    x_top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < hi
        x = tl.load(Logits + row * stride_l + offs, mask=valid, other=float("-inf")) / div
        if STORE_MAX:
            x_top = tl.maximum(x_top, x)
        if HAS_MIN_P:
            x = tl.where((x - x_max) >= log_min_p, x, float("-inf"))
        if HAS_CUT:
            x = tl.where(x >= cut, x, float("-inf"))  # greedy rows' cut is -inf
        val = tl.where(greedy, x, gumbel_perturbed(x, offs, key))
        val = tl.where(valid, val, float("-inf"))
        # strictly greater keeps the earliest index per lane; lanes are merged below with ties to the lowest
        take = val > best_val
        if KEEP_SECOND:  # a lane's columns come in index order: its second is the best of those its best beat or passed
            runner_up = ~take & (val > second_val)
            second_val = tl.where(take, best_val, tl.where(runner_up, val, second_val))
            second_idx = tl.where(take, best_idx, tl.where(runner_up, offs, second_idx))
        best_val = tl.where(take, val, best_val)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(OutVal + row * num_splits + split, top)
    tl.store(OutIdx + row * num_splits + split, tl.where(idx == 2147483647, lo, idx).to(tl.int64))
    if KEEP_SECOND:  # the split's second: the best lane's second beside every other lane's best
        own = best_idx == idx
        val2 = tl.where(own, second_val, best_val)
        top2 = tl.max(val2, axis=0)
        idx2 = tl.min(tl.where(val2 == top2, tl.where(own, second_idx, best_idx), 2147483647), axis=0)
        tl.store(OutVal2 + row * num_splits + split, top2)
        tl.store(OutIdx2 + row * num_splits + split, tl.where(idx2 == 2147483647, lo, idx2).to(tl.int64))
    if STORE_MAX:
        tl.store(MaxOut + row * num_splits + split, tl.max(x_top, axis=0))


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the floats' order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """_order_key's inverse: the fp32 whose order key (int32) is `key`."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


# top_p's cut search runs over many programs per row: a row's splits each sum the softmax mass at or above the
# candidates of a pass, and every program of the next pass sums those in split order (so all agree, bit for bit)
# and narrows the key range itself. Eight 16-way passes narrow the 2**32 keys to one (16**8 = 2**32).
PASSES = 8
_PASSES = tl.constexpr(PASSES)

# A search that gathers (batches of GATHER_MIN_BATCH rows and more): its pass GATHER_PASS also writes out its key
# range's columns, in column order, up to GATHER_CAP a split, and one program per row (`_cut_resolve_kernel`) runs
# the search's last narrowings over those keys alone, where the passes would read the whole row again each time.
# top_p's cut lies in the row's body, where an eighth of a binade can hold thousands, so it gathers at pass 4
# (2**16 keys). A row with more columns in a split's range than GATHER_CAP (a row of ties, say) is left to the
# passes.
GATHER_PASS = 4
_GATHER_PASS = tl.constexpr(GATHER_PASS)


@triton.jit
def _candidates(lo, hi, NWAY: tl.constexpr):
    """NWAY order keys from lo to hi (the first is lo, for which the predicate holds)."""
    step = (hi - lo + NWAY - 1) // NWAY
    return tl.minimum(lo + tl.arange(0, NWAY).to(tl.int64) * step, hi)


@triton.jit
def _narrow(lo, hi, acc, goal, NWAY: tl.constexpr):
    """One step of the search for the largest order key whose predicate holds (the predicate holds at lo and
    fails from some key on: the count, or the softmax mass, of the row's x with key >= c reaches goal), given
    acc, each candidate's count or mass: lo moves to the last candidate that reaches goal, hi below the next
    one. A finished range (hi <= lo) stays."""
    j = tl.arange(0, NWAY)
    cand = _candidates(lo, hi, NWAY)
    ok = (acc >= goal) | (j == 0)
    best = tl.max(tl.where(ok, j, 0), axis=0)
    new_lo = tl.max(tl.where(j == best, cand, -(2**62)), axis=0)
    nxt = tl.min(tl.where(j == best + 1, cand, 2**62), axis=0)
    new_hi = tl.where(best == NWAY - 1, hi, tl.minimum(hi, nxt - 1))
    live = hi > lo
    return tl.where(live, new_lo, lo), tl.where(live, new_hi, hi)


@triton.jit
def _kept_keys(row_ptr, offs, valid, div, x_max, log_min_p, floor_key, HAS_MIN_P: tl.constexpr):
    """(x, key(x), kept) of a block of the row: x = logits / div, -inf where min_p drops it; kept: valid and
    key(x) >= floor_key. Without min_p, x_max is not read."""
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")) / div
    if HAS_MIN_P:
        x = tl.where((x - x_max) >= log_min_p, x, float("-inf"))
    key = _order_key(x)
    return x, key, (key >= floor_key) & valid


@triton.jit
def _gather_block(Gathered, key, kept, w, lo, hi, n, above, GATHER_CAP: tl.constexpr):
    """The gather pass's share of a block (see GATHER_PASS): the kept columns with key in lo .. hi go to
    Gathered[n ..] in column order (those past GATHER_CAP are counted, not stored), and w (the column's mass) of
    those above hi is added to `above`. -> (n, above)."""
    inside = kept & (key >= lo) & (key <= hi)
    pos = n + tl.cumsum(inside.to(tl.int32), axis=0) - 1
    tl.store(Gathered + pos, key, mask=inside & (pos < GATHER_CAP))
    return n + tl.sum(inside.to(tl.int32), axis=0), above + tl.sum(tl.where(kept & (key > hi), w, 0.0), axis=0)


@triton.jit
def _mass_at_or_above(row_ptr, col_lo, col_hi, div, x_max, log_min_p, floor_key, cand, HAS_MIN_P: tl.constexpr,
                      NWAY: tl.constexpr, BLOCK: tl.constexpr, lo=0, hi=0, Gathered=None,
                      GATHER_CAP: tl.constexpr = 0):
    """For each int32 order key of `cand` [NWAY], the softmax mass exp(x - x_max) of columns col_lo .. col_hi of the
    row whose x = logits / div, kept by min_p and by key(x) >= floor_key, has key(x) >= the candidate; with
    GATHER_CAP, also `_gather_block`'s (count, above) of the range lo .. hi. Each candidate adds the block's
    weights at or above it (a histogram takes no weights). A candidate's sum depends on it alone, not on the
    others: the acceptance check (`_accept_part_kernel`) gets the search's sums, bit for bit."""
    acc = tl.zeros([NWAY, BLOCK], tl.float32)  # summed over the block's lanes once, after the loop
    n = tl.zeros([], tl.int32)
    above = tl.zeros([], tl.float32)
    for start in range(col_lo, col_hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, key, kept = _kept_keys(row_ptr, offs, offs < col_hi, div, x_max, log_min_p, floor_key, HAS_MIN_P)
        w = tl.where(kept, tl.exp(x - x_max), 0.0)
        acc += tl.where(key[None, :] >= cand[:, None], w[None, :], 0.0)
        if GATHER_CAP:
            n, above = _gather_block(Gathered, key, kept, w, lo, hi, n, above, GATHER_CAP)
    if GATHER_CAP:
        return tl.sum(acc, axis=1), n, above
    else:
        return tl.sum(acc, axis=1)


_NEG_INF_KEY = tl.constexpr(-2139095041)  # _order_key(-inf)
_POS_INF_KEY = tl.constexpr(2139095040)  # _order_key(+inf)


@triton.jit
def _row_setup(Temps, MinPs, SplitMax, row, num_splits, greedy_eps, HAS_MIN_P: tl.constexpr,
               SPLITS_POW2: tl.constexpr):
    """(temperature, whether the row samples, the max of logits / temperature, log min_p) of a row."""
    temp = tl.load(Temps + row)
    s = tl.arange(0, SPLITS_POW2)
    x_max = tl.max(tl.load(SplitMax + row * num_splits + s, mask=s < num_splits, other=float("-inf")), axis=0)
    log_min_p = float("-inf")
    if HAS_MIN_P:
        log_min_p = tl.log(tl.load(MinPs + row))
    return temp, temp >= greedy_eps, x_max, log_min_p


@triton.jit
def _shared_load(ptr, mask=None, other=None, CG: tl.constexpr = False):
    """A load of what other programs wrote; CG (in `_top_p_search_kernel`, where they wrote it in the same launch):
    from L2 (".cg"), past this SM's L1, which may hold an earlier pass's lines."""
    if CG:
        return tl.load(ptr, mask=mask, other=other, cache_modifier=".cg")
    else:
        return tl.load(ptr, mask=mask, other=other)


@triton.jit
def _summed(Part, slot, row, b, num_splits, NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr, CG: tl.constexpr = False):
    """The previous pass's counts of a row, summed over its splits in order. CG: read from L2 (`_shared_load`)."""
    s = tl.arange(0, SPLITS_POW2)
    j = tl.arange(0, NWAY)
    part = _shared_load(Part + ((slot * b + row) * num_splits + s[:, None]) * NWAY + j[None, :],
                        mask=(s < num_splits)[:, None], other=0.0, CG=CG)
    return tl.sum(part, axis=0)


@triton.jit
def _last_range(State, Part, slot, row, b, num_splits, goal, NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr,
                CG: tl.constexpr = False):
    """The key range after the pass that wrote `slot`: its range narrowed by its counts."""
    lo = _shared_load(State + (row * 2 + slot) * 2, CG=CG)
    hi = _shared_load(State + (row * 2 + slot) * 2 + 1, CG=CG)
    return _narrow(lo, hi, _summed(Part, slot, row, b, num_splits, NWAY, SPLITS_POW2, CG), goal, NWAY)


@triton.jit
def _search_cut(State, Part, Resolved, row, b, num_splits, goal, NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr,
                GATHER_CAP: tl.constexpr, CG: tl.constexpr = False):
    """top_p's cut (an order key): the resolver's where it finished the row (`_cut_resolve`; Resolved [B, 2]:
    [whether it did, its cut]), else the last pass's range narrowed by its masses."""
    cut, _ = _last_range(State, Part, (_PASSES - 1) % 2, row, b, num_splits, goal, NWAY, SPLITS_POW2, CG)
    if GATHER_CAP:
        if _shared_load(Resolved + row * 2, CG=CG) != 0:
            cut = _shared_load(Resolved + row * 2 + 1, CG=CG)
    return cut


# top_k's cut is a select over the kept columns' order keys (as uint32, `_radix_key`), in passes over the row's
# splits (`_top_k_pass_kernel`): each histograms the keys in the row's current range into a few bins, summed over the
# splits by atomic adds (int32 counts: exact in any order), and every program of the next pass picks the bin that
# holds the k-th largest key (`_pick_bin`). Pass 0 counts aligned blocks of 2**20 keys (an eighth of a binade)
# downward from the row maximum's block: 63 of them, and one for every key below. Each later pass splits its block
# 32 ways (a 32-bin histogram costs a few warp ballots a column; 256 bins cost ten times that), so four reach one key.
# A row whose k-th key lies below that window (k near the vocabulary's size, say) is searched over the keys below it
# instead, a byte a pass. Once a range holds at most TOP_K_GATHER columns the next pass copies their keys out
# instead of counting them, and one program per row finishes over those alone (`_top_k_resolve_kernel`); the passes
# after it exit. With logits spread as a model's, the k-th value's eighth of a binade holds tens to hundreds of a
# row's columns: most rows are read twice, one histogram and one gather.
TOP_K_PASSES = 5
_TOP_K_PASSES = tl.constexpr(TOP_K_PASSES)
TOP_K_GATHER = 2048  # a row's gathered keys at most
_TOP_K_GATHER = tl.constexpr(TOP_K_GATHER)
_BLOCK_BITS = tl.constexpr(20)  # pass 0's blocks: 2**20 keys
_WINDOW = tl.constexpr(64)  # pass 0's bins: 63 blocks down from the maximum's, and every key below them
_HIST = tl.constexpr(256)  # Hist's slots a (pass, row): the widest histogram's bins


@triton.jit
def _radix_key(key):
    """An int32 order key as uint32 in the same order (the sign bit flipped)."""
    return (key ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _pick_bin(hist, goal):
    """Of a histogram [_HIST] whose bin 0 holds the highest keys (bins past the pass's own are empty), the bin holding
    the goal-th largest key: (bin, goal's rank within the bin, the bin's count). A row holding fewer than goal
    keys gets the last bin."""
    j = tl.arange(0, _HIST)
    cum = tl.cumsum(hist, axis=0)
    best = tl.min(tl.where(cum >= goal, j, _HIST - 1), axis=0)
    in_bin = tl.sum(tl.where(j == best, hist, 0), axis=0)
    higher = tl.sum(tl.where(j == best, cum, 0), axis=0) - in_bin
    return best, goal - higher, in_bin


@triton.jit
def _digit_bits(wide):
    """Bits a pass after pass 0 splits the range by: 5 in the window, 8 below it."""
    return tl.where(wide, 8, 5)


@triton.jit
def _column_bins(u, top_block, prefix, w, wide, floor_u, FIRST: tl.constexpr):
    """(in range, bin) of keys u [BLOCK], the row's range being (prefix, w, wide, floor_u): the keys whose bits above
    the lowest w equal prefix (below the window, wide: also under floor_u). Bins count down from the range's top.
    FIRST (pass 0, any range): the block of 2**20 keys counted down from top_block (the maximum's, int32), the last
    bin taking every key below."""
    if FIRST:
        below = top_block - (u >> _BLOCK_BITS).to(tl.int32)
        return u == u, tl.minimum(tl.maximum(below, 0), _WINDOW - 1)
    else:
        bits = _digit_bits(wide)
        shift = tl.cast(w - bits, tl.uint32)
        inside = ((u >> shift) >> tl.cast(bits, tl.uint32)) == prefix.to(tl.uint32)
        inside = tl.where(wide, inside & (u < floor_u), inside)
        top = (1 << bits) - 1
        return inside, (top - ((u >> shift) & tl.cast(top, tl.uint32)).to(tl.int32))


@triton.jit
def _descend(prefix, w, wide, floor_u, bin, pass_idx, top_block):
    """The row's range after picking `bin` at pass pass_idx: (prefix, w, wide, floor_u)."""
    first = pass_idx == 0
    bits = _digit_bits(wide)
    new_wide = first & (bin == _WINDOW - 1) | (~first & wide)
    window_prefix = tl.where(bin == _WINDOW - 1, 0, top_block - bin).to(tl.int64)
    prefix = tl.where(first, window_prefix, (prefix << bits) + ((1 << bits) - 1 - bin))
    w = tl.where(first, tl.where(new_wide, 32, _BLOCK_BITS), w - bits)
    window_floor = tl.minimum(tl.maximum((top_block - (_WINDOW - 2)).to(tl.int64) << _BLOCK_BITS, 0), 4294967295)
    floor_u = tl.where(first, window_floor.to(tl.uint32), floor_u)
    return prefix, w, new_wide, floor_u


@triton.jit
def _top_k_row(Temps, MinPs, TopKs, SplitMax, row, num_splits, vocab_size, greedy_eps, HAS_MIN_P: tl.constexpr,
               SPLITS_POW2: tl.constexpr):
    """(temperature, max of logits / temperature, log min_p, k, whether the row's select runs, the maximum's block
    of 2**20 keys) of a row: it runs for a sampling row with k under the vocabulary."""
    temp, samples, x_max, log_min_p = _row_setup(Temps, MinPs, SplitMax, row, num_splits, greedy_eps, HAS_MIN_P,
                                                 SPLITS_POW2)
    top_k = tl.load(TopKs + row)
    active = samples & (top_k < vocab_size)
    top_block = (_radix_key(_order_key(x_max)) >> _BLOCK_BITS).to(tl.int32)
    return temp, x_max, log_min_p, top_k, active, top_block


@triton.jit
def _top_k_state(State, Hist, row, b, pass_idx, top_k, top_block, FIRST: tl.constexpr, CG: tl.constexpr = False):
    """A row's top_k select state for pass pass_idx: (prefix, w, wide, floor_u: the range, as `_column_bins` reads
    it; goal: the k-th largest key's rank in it; n: its count; gather_at: the pass that gathers it, the first whose
    range holds at most TOP_K_GATHER columns, 0 while none, -1 where the row keeps fewer than k columns and nothing
    is cut). Pass 0's (FIRST) is the whole row; a later pass's is the last pass's (State slot (pass_idx - 1) % 2,
    stored by its split 0) narrowed by that pass's histogram, once all its programs have added to it. CG:
    `_shared_load`'s."""
    if FIRST:
        zero = tl.zeros([], tl.int32)
        return top_block.to(tl.int64), zero + 32, zero != 0, zero.to(tl.uint32), top_k.to(tl.int32), zero, zero
    last = State + (((pass_idx + 1) % 2) * b + row) * 8
    prefix = _shared_load(last, CG=CG)
    w = _shared_load(last + 1, CG=CG).to(tl.int32)
    wide = _shared_load(last + 2, CG=CG) != 0
    floor_u = _shared_load(last + 3, CG=CG).to(tl.uint32)
    goal = _shared_load(last + 4, CG=CG).to(tl.int32)
    n = _shared_load(last + 5, CG=CG).to(tl.int32)
    gather_at = _shared_load(last + 6, CG=CG).to(tl.int32)
    walk = gather_at == 0
    hist = _shared_load(Hist + ((pass_idx - 1) * b + row) * _HIST + tl.arange(0, _HIST), CG=CG)
    bin, rank, count = _pick_bin(hist, goal)
    new_prefix, new_w, new_wide, new_floor = _descend(prefix, w, wide, floor_u, bin, pass_idx - 1, top_block)
    short = walk & (pass_idx == 1) & (tl.sum(hist, axis=0) < goal)
    prefix = tl.where(walk, new_prefix, prefix)
    w = tl.where(walk, new_w, w)
    wide = tl.where(walk, new_wide, wide)
    floor_u = tl.where(walk, new_floor, floor_u)
    goal = tl.where(walk, rank, goal)
    n = tl.where(walk, count, n)
    gather_at = tl.where(walk & (n <= _TOP_K_GATHER) & (pass_idx < _TOP_K_PASSES), pass_idx, gather_at)
    gather_at = tl.where(short, -1, gather_at)
    return prefix, w, wide, floor_u, goal, n, gather_at


@triton.jit
def _count_bins(row_ptr, lo_col, hi_col, temp, x_max, log_min_p, top_block, prefix, w, wide, floor_u,
                HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, FIRST: tl.constexpr):
    """A split's histogram [NBINS] of the kept columns in the row's range, by `_column_bins`."""
    hist = tl.zeros([NBINS], tl.int32)
    for start in range(lo_col, hi_col, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        _, key, kept = _kept_keys(row_ptr, offs, offs < hi_col, temp, x_max, log_min_p, _NEG_INF_KEY, HAS_MIN_P)
        inside, bin = _column_bins(_radix_key(key), top_block, prefix, w, wide, floor_u, FIRST)
        hist += tl.histogram(bin, NBINS, mask=kept & inside)
    return hist


@triton.jit(do_not_specialize=["pass_idx", "split_len", "num_splits", "b"])
def _top_k_pass_kernel(Logits, stride_l, Temps, MinPs, TopKs, TopPs, SplitMax, State, Hist, Dense, Cursor, vocab_size,
                       split_len, num_splits, b, pass_idx, greedy_eps, HAS_MIN_P: tl.constexpr,
                       BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, FIRST: tl.constexpr, Order=None,
                       CHECKED: tl.constexpr = False):
    """Pass `pass_idx` of top_k's select (`_top_k_pass`) for (row, split). CHECKED: only the rows that need their cut
    (grid (splits, B) over `_verdict_kernel`'s list)."""
    row, split, listed = _program_row_split(Order, CHECKED)
    if listed:
        _top_k_pass(row, split, Logits, stride_l, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, Cursor,
                    vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_MIN_P, BLOCK, SPLITS_POW2, FIRST)


@triton.jit
def _top_k_pass(row, split, Logits, stride_l, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, Cursor, vocab_size,
                split_len, num_splits, b, pass_idx, greedy_eps, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
                SPLITS_POW2: tl.constexpr, FIRST: tl.constexpr, CG: tl.constexpr = False):
    """Pass `pass_idx` of top_k's select for (row, split): histogram the keys in the row's range into
    Hist[pass_idx, row] (atomic adds), or, the pass after the range's count fell to TOP_K_GATHER, copy those keys to
    Dense[row] (as uint32 keys, in no fixed order; Cursor[row] counts them). Hist and Cursor start at zero; split 0
    stores the row's state (`_top_k_state`) at State slot pass_idx % 2. FIRST: pass_idx is 0. After a row's gather
    its programs do nothing else but split 0 copying its state to the slot, before reading the row's inputs or
    histogram. CG: `_shared_load`'s, for the state and histogram other programs wrote."""
    if FIRST:
        _top_k_count_or_gather(row, split, Logits, stride_l, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense,
                               Cursor, vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_MIN_P, BLOCK,
                               SPLITS_POW2, FIRST, CG)
    else:
        last = State + (((pass_idx + 1) % 2) * b + row) * 8
        # (an inactive row's slot holds anything; it is never read)
        if _shared_load(last + 6, CG=CG) != 0:  # gathered at an earlier pass (or cut nothing): split 0 hands it on
            if split == 0:
                i = tl.arange(0, 8)
                tl.store(State + ((pass_idx % 2) * b + row) * 8 + i, _shared_load(last + i, CG=CG))
        else:
            _top_k_count_or_gather(row, split, Logits, stride_l, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense,
                                   Cursor, vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_MIN_P,
                                   BLOCK, SPLITS_POW2, FIRST, CG)


@triton.jit
def _top_k_count_or_gather(row, split, Logits, stride_l, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, Cursor,
                           vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_MIN_P: tl.constexpr,
                           BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, FIRST: tl.constexpr, CG: tl.constexpr):
    """`_top_k_pass`'s work for a row not yet gathered."""
    temp, x_max, log_min_p, top_k, active, top_block = _top_k_row(Temps, MinPs, TopKs, SplitMax, row, num_splits,
                                                                  vocab_size, greedy_eps, HAS_MIN_P, SPLITS_POW2)
    if active:
        prefix, w, wide, floor_u, goal, n, gather_at = _top_k_state(State, Hist, row, b, pass_idx, top_k, top_block,
                                                                    FIRST, CG)
        if split == 0:
            slot = State + ((pass_idx % 2) * b + row) * 8
            tl.store(slot, prefix)
            tl.store(slot + 1, w.to(tl.int64))
            tl.store(slot + 2, wide.to(tl.int64))
            tl.store(slot + 3, floor_u.to(tl.int64))
            tl.store(slot + 4, goal.to(tl.int64))
            tl.store(slot + 5, n.to(tl.int64))
            tl.store(slot + 6, gather_at.to(tl.int64))
        gathers = (gather_at > 0) & (gather_at == pass_idx)
        if (gather_at == 0) | gathers:
            lo_col = split * split_len
            hi_col = tl.minimum(lo_col + split_len, vocab_size)
            row_ptr = Logits + row * stride_l
            out = Hist + (pass_idx * b + row) * _HIST
            if gathers:  # copy the range's keys out
                dense = Dense + row * _TOP_K_GATHER
                for start in range(lo_col, hi_col, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    _, key, kept = _kept_keys(row_ptr, offs, offs < hi_col, temp, x_max, log_min_p, _NEG_INF_KEY,
                                              HAS_MIN_P)
                    u = _radix_key(key)
                    inside, _ = _column_bins(u, top_block, prefix, w, wide, floor_u, False)
                    inside = inside & kept
                    count = tl.sum(inside.to(tl.int32), axis=0)
                    if count > 0:
                        pos = tl.atomic_add(Cursor + row, count) + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                        tl.store(dense + pos, u.to(tl.int32, bitcast=True), mask=inside)
            elif FIRST:
                window = _count_bins(row_ptr, lo_col, hi_col, temp, x_max, log_min_p, top_block, prefix, w, wide,
                                     floor_u, HAS_MIN_P, BLOCK, _WINDOW, True)
                tl.atomic_add(out + tl.arange(0, _WINDOW), window, mask=window > 0)
            elif wide:
                by_byte = _count_bins(row_ptr, lo_col, hi_col, temp, x_max, log_min_p, top_block, prefix, w, wide,
                                      floor_u, HAS_MIN_P, BLOCK, 256, False)
                tl.atomic_add(out + tl.arange(0, 256), by_byte, mask=by_byte > 0)
            else:
                by_five = _count_bins(row_ptr, lo_col, hi_col, temp, x_max, log_min_p, top_block, prefix, w, wide,
                                      floor_u, HAS_MIN_P, BLOCK, 32, False)
                tl.atomic_add(out + tl.arange(0, 32), by_five, mask=by_five > 0)


_PAIR_KEYS = tl.constexpr(256)  # gathered keys the resolve ranks pairwise (more: its radix rounds)
_PAIR_CHUNK = tl.constexpr(32)


@triton.jit
def _ranked(keys, n, goal, CG: tl.constexpr = False):
    """The goal-th largest (1-based, ties counted) of the n <= _PAIR_KEYS uint32 keys at `keys` (int32 storage), as
    int64: the largest key with at least goal keys at or above it, found in one sweep of pairwise compares where
    the radix rounds take four histograms one after another. CG: `_shared_load`'s."""
    i = tl.arange(0, _PAIR_KEYS)
    mine = _shared_load(keys + i, mask=i < n, other=0, CG=CG).to(tl.uint32, bitcast=True)
    at_or_above = tl.zeros([_PAIR_KEYS], tl.int32)
    for start in range(0, n, _PAIR_CHUNK):
        j = start + tl.arange(0, _PAIR_CHUNK)
        theirs = _shared_load(keys + j, mask=j < n, other=0, CG=CG).to(tl.uint32, bitcast=True)
        at_or_above += tl.sum(((j < n)[None, :] & (theirs[None, :] >= mine[:, None])).to(tl.int32), axis=1)
    return tl.max(tl.where((i < n) & (at_or_above >= goal), mine, 0), axis=0).to(tl.int64)


@triton.jit(do_not_specialize=["num_splits", "b"])
def _top_k_resolve_kernel(Temps, MinPs, TopKs, TopPs, SplitMax, State, Hist, Dense, CutK, vocab_size, num_splits, b,
                          greedy_eps, HAS_MIN_P: tl.constexpr, SPLITS_POW2: tl.constexpr, BLOCK: tl.constexpr,
                          Order=None, CHECKED: tl.constexpr = False):
    """CutK[row]: top_k's cut, the order key of the row's k-th largest kept x (_NEG_INF_KEY where nothing is cut):
    the select's passes, finished over the keys a pass gathered where one did (by their ranks where at most
    _PAIR_KEYS were). CHECKED: only the rows that need their cut (`_verdict_kernel`'s list); the others' are left
    unset."""
    row, listed = _program_row(Order, CHECKED)
    if listed:
        tl.store(CutK + row, _top_k_resolve(row, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, vocab_size,
                                            num_splits, b, _TOP_K_PASSES, greedy_eps, HAS_MIN_P, SPLITS_POW2, BLOCK))


@triton.jit
def _top_k_resolve(row, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, vocab_size, num_splits, b, final_pass,
                   greedy_eps, HAS_MIN_P: tl.constexpr, SPLITS_POW2: tl.constexpr, BLOCK: tl.constexpr,
                   CG: tl.constexpr = False):
    """`_top_k_resolve_kernel`'s cut of a row, from the state after pass final_pass - 1 (its State slot and
    histogram; the passes after a row's gather, which only hand the state on, may be left out). CG:
    `_shared_load`'s."""
    temp, x_max, log_min_p, top_k, active, top_block = _top_k_row(Temps, MinPs, TopKs, SplitMax, row, num_splits,
                                                                  vocab_size, greedy_eps, HAS_MIN_P, SPLITS_POW2)
    cut = tl.full([], _NEG_INF_KEY, tl.int64)
    if active:
        prefix, w, wide, floor_u, goal, n, gather_at = _top_k_state(State, Hist, row, b, final_pass, top_k,
                                                                    top_block, False, CG)
        dense = Dense + row * _TOP_K_GATHER
        if (gather_at > 0) & (n <= _PAIR_KEYS):  # the goal-th largest of a few gathered keys by their ranks
            prefix = _ranked(dense, n, goal, CG)
        elif gather_at > 0:  # the rest of the select over the gathered keys (n of them) alone
            for p in range(gather_at, _TOP_K_PASSES):
                hist = tl.zeros([_HIST], tl.int32)
                for start in range(0, n, BLOCK):
                    i = start + tl.arange(0, BLOCK)
                    u = _shared_load(dense + i, mask=i < n, other=0, CG=CG).to(tl.uint32, bitcast=True)
                    inside, bin = _column_bins(u, top_block, prefix, w, wide, floor_u, False)
                    hist += tl.histogram(bin, _HIST, mask=inside & (i < n))
                bin, goal, _ = _pick_bin(hist, goal)
                prefix, w, wide, floor_u = _descend(prefix, w, wide, floor_u, bin, p, top_block)
        cut = tl.where(gather_at < 0, cut, prefix - 2147483648)
    return cut


# The acceptance pass's mass lanes a (row, split): the candidates it sums (the floor, j1's key and key + 1, j2's
# two), padded to a power of two. Each lane's sum is the one a search lane would take for its candidate; 16 lanes,
# as the search has, cost top_p's acceptance three times top_k's (docs/gpu-notes.md, forty-ninth session).
MASS_LANES = 8
_MASS_LANES = tl.constexpr(MASS_LANES)


# Rejection first (FlashInfer's sort-free sampling does the same): the row's unrestricted Gumbel-max draw j* is also
# its draw under top_k / top_p whenever j* survives them, since the same noise picks the maximum of a subset that
# holds it. j* survives top_k iff fewer than k kept columns have a larger order key, and top_p iff the mass above
# its key is under the goal (the search's cut is the largest key whose mass at or above reaches the goal). Those
# are one pass over the row, where a search takes several; the search and the restricted draw then run only for
# the rows whose j* failed (every launch stays in the graph: accepted rows' programs exit at once).


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _accept_part_kernel(Logits, stride_l, Temps, MinPs, SplitMax, Vals, Idx, Mass, Count, vocab_size, split_len,
                        num_splits, greedy_eps, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                        BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, Order=None, Vals2=None, Idx2=None,
                        Count2=None, Second=None, SECOND: tl.constexpr = False):
    """Per (row, split) of a sampling row, from the unrestricted draw's split bests (Vals, Idx): the count of
    kept columns whose key exceeds key(x[j*]) (HAS_K), and the masses at or above the keys [floor, key(x[j*]),
    key(x[j*]) + 1, ...] as the top_p search sums them (HAS_P). SECOND: the same for the row's second best draw j2
    (`_row_candidates`, from the splits' seconds Vals2 / Idx2) into Count2 and Mass's lanes 3 and 4 (its key, its
    key + 1), and Second[row] = whether the row has a second (split 0 stores it). Program (0, 0) zeroes Order[0],
    the count of `_verdict_kernel`'s list."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if (row == 0) & (split == 0):
        tl.store(Order, 0)
    temp, samples, x_max, log_min_p = _row_setup(Temps, MinPs, SplitMax, row, num_splits, greedy_eps, HAS_MIN_P,
                                                 SPLITS_POW2)
    if samples:
        best, second, second_val, second_split = _row_candidates(Vals, Idx, Vals2, Idx2, row, num_splits,
                                                                 SPLITS_POW2, SECOND)
        key_j = _order_key(tl.load(Logits + row * stride_l + best) / temp)
        key_j2 = key_j
        if SECOND:
            has_second = second_val > float("-inf")
            key_j2 = tl.where(has_second, _order_key(tl.load(Logits + row * stride_l + second) / temp), key_j)
            if split == 0:
                tl.store(Second + row, has_second.to(tl.int32))
        lo_col = split * split_len
        hi_col = tl.minimum(lo_col + split_len, vocab_size)
        row_ptr = Logits + row * stride_l
        if HAS_K:
            n = tl.zeros([BLOCK], tl.int32)
            n2 = tl.zeros([BLOCK], tl.int32)
            for start in range(lo_col, hi_col, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                _, key, kept = _kept_keys(row_ptr, offs, offs < hi_col, temp, x_max, log_min_p, _NEG_INF_KEY,
                                          HAS_MIN_P)
                n += (kept & (key > key_j)).to(tl.int32)
                if SECOND:
                    n2 += (kept & (key > key_j2)).to(tl.int32)
            tl.store(Count + row * num_splits + split, tl.sum(n, axis=0))
            if SECOND:
                tl.store(Count2 + row * num_splits + split, tl.sum(n2, axis=0))
        if HAS_P:
            j = tl.arange(0, _MASS_LANES)
            cand = tl.where(j == 0, _NEG_INF_KEY, tl.where(j == 1, key_j, key_j + 1))
            if SECOND:
                cand = tl.where(j == 3, key_j2, tl.where(j == 4, key_j2 + 1, cand))
            mass = _mass_at_or_above(row_ptr, lo_col, hi_col, temp, x_max, log_min_p, _NEG_INF_KEY, cand,
                                     HAS_MIN_P, _MASS_LANES, BLOCK)
            tl.store(Mass + (row * num_splits + split) * _MASS_LANES + j, mass)


@triton.jit
def _row_candidates(Vals, Idx, Vals2, Idx2, row, num_splits, SPLITS_POW2: tl.constexpr, SECOND: tl.constexpr):
    """(j1, j2, j2's perturbed value (-inf: the row has no second), j2's split) of a row: its unrestricted draw j1
    (pick_rows' choice over the splits' bests) and, with SECOND, its second best in (value descending, index
    ascending) order, from the splits' bests with j1's split's second in place of j1."""
    s = tl.arange(0, SPLITS_POW2)
    live = s < num_splits
    vals = tl.load(Vals + row * num_splits + s, mask=live, other=float("-inf"))
    idx = tl.load(Idx + row * num_splits + s, mask=live, other=2**62)
    top = tl.max(vals, axis=0)
    j1 = tl.min(tl.where(vals == top, idx, 2**62), axis=0)
    j2 = j1
    top2 = tl.full([], float("-inf"), tl.float32)
    s2 = tl.zeros([], tl.int32)
    if SECOND:
        own = idx == j1
        vals2 = tl.where(own, tl.load(Vals2 + row * num_splits + s, mask=live, other=float("-inf")), vals)
        idx2 = tl.where(own, tl.load(Idx2 + row * num_splits + s, mask=live, other=2**62), idx)
        top2 = tl.max(vals2, axis=0)
        j2 = tl.min(tl.where(vals2 == top2, idx2, 2**62), axis=0)
        s2 = tl.min(tl.where((vals2 == top2) & (idx2 == j2), s, SPLITS_POW2), axis=0)
    return j1, j2, top2, s2


@triton.jit
def _draw_checks(Mass, Count, row, b, num_splits, top_k, top_p, vocab_size, HAS_K: tl.constexpr,
                 HAS_P: tl.constexpr, SPLITS_POW2: tl.constexpr, Count2, Second, SECOND: tl.constexpr):
    """(whether j1 is kept by the row's top_k and top_p, whether j2 decides the row) of a sampling row, from the
    acceptance pass's sums. j1 is kept iff fewer than k kept columns have a larger key and the mass above its key is
    under top_p x the mass top_k keeps; with both filters that mass is taken as the mass at or above j1's key, at
    most top_k's: accepting on it is safe, refusing is not exact. The restricted draw is the first column in
    (perturbed value, index) order that the filters keep, so j2 decides the row when j1 is certainly out (its
    top_k count fails; or, where the row has no top_k, its exact top_p check) and j2 is kept (the same checks)."""
    ok = top_p == top_p  # a true scalar
    ok2 = ok
    out = ~ok
    k_on = ~ok
    if HAS_K:
        k_on = top_k < vocab_size
        s = tl.arange(0, SPLITS_POW2)
        above = tl.sum(tl.load(Count + row * num_splits + s, mask=s < num_splits, other=0), axis=0)
        ok = ok & (~k_on | (above < top_k))
        if SECOND:
            out = out | (k_on & (above >= top_k))
            above2 = tl.sum(tl.load(Count2 + row * num_splits + s, mask=s < num_splits, other=0), axis=0)
            ok2 = ok2 & (~k_on | (above2 < top_k))
    if HAS_P:
        j = tl.arange(0, _MASS_LANES)
        mass = _summed(Mass, 0, row, b, num_splits, _MASS_LANES, SPLITS_POW2)
        total = tl.sum(tl.where(j == 0, mass, 0.0), axis=0)  # every kept column's, as the search's goal sums it
        base = tl.where(k_on, tl.sum(tl.where(j == 1, mass, 0.0), axis=0), total)
        p_ok = (top_p >= 1.0) | (tl.sum(tl.where(j == 2, mass, 0.0), axis=0) < top_p * base)
        ok = ok & p_ok
        if SECOND:
            out = out | (~k_on & ~p_ok)
            base2 = tl.where(k_on, tl.sum(tl.where(j == 3, mass, 0.0), axis=0), total)
            ok2 = ok2 & ((top_p >= 1.0) | (tl.sum(tl.where(j == 4, mass, 0.0), axis=0) < top_p * base2))
    if SECOND:
        ok2 = ok2 & (tl.load(Second + row) != 0)
    return ok, ok2 & out  # (without SECOND `out` stays false)


@triton.jit(do_not_specialize=["num_splits", "b"])
def _verdict_kernel(Temps, TopKs, TopPs, Mass, Count, Order, vocab_size, num_splits, b, greedy_eps,
                    HAS_K: tl.constexpr, HAS_P: tl.constexpr, SPLITS_POW2: tl.constexpr, Count2=None, Second=None,
                    SECOND: tl.constexpr = False, Vals=None, Idx=None, Vals2=None, Idx2=None, Bar=None,
                    ZERO_BAR: tl.constexpr = False):
    """The list of rows that need their cut: sampling rows whose unrestricted draw j1 fails their top_k / top_p and
    whose second best does not decide them (`_draw_checks`). Order[0] counts them (zeroed by the acceptance pass)
    and Order[1:] holds them, in no fixed order (atomic adds). Every later kernel of the step runs its program i on
    the list's i-th row, and a program past the count exits after that one read:
    - a program that took its row's verdict from the acceptance sums itself cost 1-3 us more a launch, even where
      no row was searched;
    - programs indexed by row put the searched rows' long programs among the empty ones (at 256 rows of peaked
      logits, top_p's passes took 312 us with those sums and 419 us with a flag a row); the list's come first.
    (docs/gpu-notes.md, fiftieth session.) Greedy rows' sums were never written: their checks are read
    unconditionally (every load at once, none waiting on the temperature's) and masked. SECOND: a row whose second
    best draw decides it gets that draw as its split bests (-inf but in its split), which the pick reads, since the
    draw under the cut leaves it as it is. ZERO_BAR: also zeroes the row's barrier count (`_top_p_search_kernel`)."""
    row = tl.program_id(0).to(tl.int64)
    if ZERO_BAR:
        tl.store(Bar + row, 0)
    samples = tl.load(Temps + row) >= greedy_eps
    ok, ok2 = _draw_checks(Mass, Count, row, b, num_splits, tl.load(TopKs + row), tl.load(TopPs + row), vocab_size,
                           HAS_K, HAS_P, SPLITS_POW2, Count2, Second, SECOND)
    if SECOND:
        _, j2, v2, s2 = _row_candidates(Vals, Idx, Vals2, Idx2, row, num_splits, SPLITS_POW2, SECOND)
        if samples & ok2 & ~ok:
            s = tl.arange(0, SPLITS_POW2)
            tl.store(Vals + row * num_splits + s, tl.where(s == s2, v2, float("-inf")), mask=s < num_splits)
            tl.store(Idx + row * num_splits + s2, j2)
    if samples & ~ok & ~ok2:
        tl.store(Order + 1 + tl.atomic_add(Order, 1), row.to(tl.int32))


@triton.jit(do_not_specialize=["pass_idx", "split_len", "num_splits", "b"])
def _top_p_pass_kernel(Logits, stride_l, Temps, MinPs, TopKs, TopPs, SplitMax, State, Part, Goal, CutK, vocab_size,
                       split_len, num_splits, b, pass_idx, greedy_eps, HAS_K: tl.constexpr, HAS_MIN_P: tl.constexpr,
                       NWAY: tl.constexpr, BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, Order=None,
                       CHECKED: tl.constexpr = False, Gathered=None, GathN=None, Above=None, Resolved=None,
                       GATHER_CAP: tl.constexpr = 0, IS_GATHER: tl.constexpr = False):
    """One pass of top_p's cut search for (row, split) (`_top_p_pass`). CHECKED: only the rows that need their cut
    (grid (splits, B) over `_verdict_kernel`'s list)."""
    row, split, listed = _program_row_split(Order, CHECKED)
    if listed == 0:
        return
    _top_p_pass(row, split, Logits, stride_l, Temps, MinPs, TopPs, SplitMax, State, Part, Goal, CutK, vocab_size,
                split_len, num_splits, b, pass_idx, greedy_eps, HAS_K, HAS_MIN_P, NWAY, BLOCK, SPLITS_POW2, Gathered,
                GathN, Above, Resolved, GATHER_CAP, IS_GATHER)


@triton.jit
def _top_p_pass(row, split, Logits, stride_l, Temps, MinPs, TopPs, SplitMax, State, Part, Goal, CutK, vocab_size,
                split_len, num_splits, b, pass_idx, greedy_eps, HAS_K: tl.constexpr, HAS_MIN_P: tl.constexpr,
                NWAY: tl.constexpr, BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, Gathered, GathN, Above, Resolved,
                GATHER_CAP: tl.constexpr, IS_GATHER: tl.constexpr, CG: tl.constexpr = False):
    """Pass `pass_idx` of top_p's cut search for (row, split): the largest key at or above which the softmax mass
    reaches top_p x the mass top_k keeps. A pass takes its key range from the last one (State and Part at slot
    (pass_idx - 1) % 2; pass 0 starts at [floor, key(row max)]), stores it at slot pass_idx % 2 (split 0) and its
    masses beside it. The floor is top_k's cut (CutK, from `_top_k_resolve_kernel`; without top_k pass 0 stores
    -inf's key there); the goal needs the mass above that floor, which is pass 0's sum for its first candidate (the
    floor itself), so pass 1 sums it and stores the goal in Goal. GATHER_CAP: the search gathers (see
    GATHER_PASS); IS_GATHER: this is its GATHER_PASS, which also gathers its range's columns; the passes after it
    skip the rows the resolver finished. CG: `_shared_load`'s."""
    temp, samples, x_max, log_min_p = _row_setup(Temps, MinPs, SplitMax, row, num_splits, greedy_eps, HAS_MIN_P,
                                                 SPLITS_POW2)
    top_p = tl.load(TopPs + row)
    active = samples & (top_p < 1.0)
    if HAS_K:
        floor_key = tl.load(CutK + row)
    else:
        floor_key = tl.full([], _NEG_INF_KEY, tl.int64)
        if (pass_idx == 0) & (split == 0):  # every searched row's: the finish reads it for rows without top_p too
            tl.store(CutK + row, floor_key)
    goal = 0.0
    if pass_idx == 1:
        goal = top_p * tl.sum(tl.where(tl.arange(0, NWAY) == 0, _summed(Part, 0, row, b, num_splits, NWAY,
                                                                            SPLITS_POW2, CG), 0.0), axis=0)
        if split == 0:
            tl.store(Goal + row, goal)
    elif pass_idx > 1:
        goal = _shared_load(Goal + row, CG=CG)
    if GATHER_CAP:
        if pass_idx > _GATHER_PASS:  # rows the resolver finished
            active = active & (_shared_load(Resolved + row * 2, CG=CG) == 0)
    if active:
        if pass_idx == 0:
            lo = floor_key
            hi = _order_key(x_max).to(tl.int64)
        else:
            lo, hi = _last_range(State, Part, (pass_idx - 1) % 2, row, b, num_splits, goal, NWAY, SPLITS_POW2, CG)
        slot = pass_idx % 2
        if split == 0:
            tl.store(State + (row * 2 + slot) * 2, lo)
            tl.store(State + (row * 2 + slot) * 2 + 1, hi)
        lo_col = split * split_len
        row_ptr = Logits + row * stride_l
        hi_col = tl.minimum(lo_col + split_len, vocab_size)
        cand = _candidates(lo, hi, NWAY).to(tl.int32)  # keys are int32; the candidates lie between two of them
        if IS_GATHER:
            part = row * num_splits + split
            acc, n, above = _mass_at_or_above(row_ptr, lo_col, hi_col, temp, x_max, log_min_p,
                                              floor_key.to(tl.int32), cand, HAS_MIN_P, NWAY, BLOCK, lo, hi,
                                              Gathered + part * GATHER_CAP, GATHER_CAP)
            tl.store(GathN + part, n)
            tl.store(Above + part, above)
        else:
            acc = _mass_at_or_above(row_ptr, lo_col, hi_col, temp, x_max, log_min_p, floor_key.to(tl.int32), cand,
                                    HAS_MIN_P, NWAY, BLOCK)
        tl.store(Part + ((slot * b + row) * num_splits + split) * NWAY + tl.arange(0, NWAY), acc)


@triton.jit(do_not_specialize=["num_splits"])
def _cut_resolve_kernel(Temps, MinPs, TopKs, TopPs, SplitMax, State, Goal, Gathered, GathN, Above, Resolved, Dense,
                        num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, NWAY: tl.constexpr,
                        SPLITS_POW2: tl.constexpr, GATHER_CAP: tl.constexpr, RESOLVE_BLOCK: tl.constexpr, Order=None,
                        CHECKED: tl.constexpr = False):
    """A row's top_p search finished from its gathered keys (`_cut_resolve`). CHECKED: only the rows that need their
    cut (`_verdict_kernel`'s list)."""
    row, listed = _program_row(Order, CHECKED)
    if listed == 0:
        return
    _cut_resolve(row, Temps, MinPs, TopPs, SplitMax, State, Goal, Gathered, GathN, Above, Resolved, Dense, num_splits,
                 greedy_eps, HAS_MIN_P, NWAY, SPLITS_POW2, GATHER_CAP, RESOLVE_BLOCK)


@triton.jit
def _cut_resolve(row, Temps, MinPs, TopPs, SplitMax, State, Goal, Gathered, GathN, Above, Resolved, Dense, num_splits,
                 greedy_eps, HAS_MIN_P: tl.constexpr, NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr,
                 GATHER_CAP: tl.constexpr, RESOLVE_BLOCK: tl.constexpr, CG: tl.constexpr = False):
    """A row's top_p search finished from its gathered keys: the narrowings of the passes after GATHER_PASS and the
    finish, with each candidate's mass = the columns' above the gathered range (summed by the gather pass, split by
    split) + the gathered columns' at or above it. Stores Resolved[row] = [1, cut], or [0, -] where a split had
    more columns in range than it could hold. CG: `_shared_load`'s."""
    temp, samples, x_max, log_min_p = _row_setup(Temps, MinPs, SplitMax, row, num_splits, greedy_eps, HAS_MIN_P,
                                                 SPLITS_POW2)
    active = samples & (tl.load(TopPs + row) < 1.0)
    goal = _shared_load(Goal + row, CG=CG)
    out = Resolved + row * 2
    if active:
        s = tl.arange(0, SPLITS_POW2)
        n = _shared_load(GathN + row * num_splits + s, mask=s < num_splits, other=0, CG=CG)
        fits = tl.max(n, axis=0) <= GATHER_CAP
        tl.store(out, fits.to(tl.int64))
        if fits:
            # the splits' keys side by side in Dense[row, :total] (split order, then column order), so the
            # narrowings read as many keys as were gathered, not GATHER_CAP a split
            c = tl.arange(0, GATHER_CAP)
            held = (s < num_splits)[:, None] & (c[None, :] < n[:, None])
            keys = _shared_load(Gathered + (row * num_splits + s[:, None]) * GATHER_CAP + c[None, :], mask=held,
                                CG=CG)
            dense = Dense + row * (SPLITS_POW2 * GATHER_CAP)
            tl.store(dense + (tl.cumsum(n, axis=0) - n)[:, None] + c[None, :], keys, mask=held)
            tl.debug_barrier()  # the block's stores before its loads below
            total = tl.sum(n, axis=0)
            above = tl.sum(_shared_load(Above + row * num_splits + s, mask=s < num_splits, other=0.0, CG=CG),
                           axis=0)
            lo = _shared_load(State + (row * 2 + _GATHER_PASS % 2) * 2, CG=CG)
            hi = _shared_load(State + (row * 2 + _GATHER_PASS % 2) * 2 + 1, CG=CG)
            for _ in tl.static_range(_PASSES - _GATHER_PASS):
                cand = _candidates(lo, hi, NWAY).to(tl.int32)
                acc = tl.zeros([NWAY, RESOLVE_BLOCK], tl.float32)
                for start in range(0, total, RESOLVE_BLOCK):
                    i = start + tl.arange(0, RESOLVE_BLOCK)
                    key = tl.load(dense + i, mask=i < total, other=0)
                    w = tl.where(i < total, tl.exp(_key_value(key) - x_max), 0.0)
                    acc += tl.where(key[None, :] >= cand[:, None], w[None, :], 0.0)
                lo, hi = _narrow(lo, hi, above + tl.sum(acc, axis=1), goal, NWAY)
            tl.store(out + 1, lo)


# top_p over what top_k keeps: a row with both filters keeps at most its k highest columns and the columns tied
# with the k-th, so once top_k's cut is known one pass copies out the keys above the cut, fewer than k, and counts
# the ties (`_kept_gather_kernel`), and one program per row finds top_p's cut among those (`_kept_top_p_kernel`), where
# the search's eight passes would read the whole row again each time (at 32 rows of Llama-3.2-1B's vocabulary with
# top_k 50 and top_p 0.9, 98-168 us of the sampler's 193-282: docs/gpu-notes.md, forty-ninth session). The ties all
# weigh what the cut's key weighs, which goes into the goal (the mass top_k keeps); every candidate of the search
# but the first lies above the cut, and the first always holds (`_narrow`), so no candidate's mass needs them:
# exact however many there are. The keys land in the row's buffer in no fixed order (one atomic cursor a row), so
# their masses are summed in fixed point (_KEPT_SCALE: int64, exact in any order) and the cut does not depend on
# which split stored first. Rows with top_p and no top_k, or a top_k above KEPT_CAP, go on a second list, which the
# search's passes run over as before; where the sampler says no row of the batch is such (`fused_sample`'s third cut
# phase), those launches are left out.
KEPT_CAP = KEPT_TOP_K
_KEPT_SCALE = tl.constexpr(1099511627776.0)  # 2**40: a column's mass exp(x - x_max) <= 1 in fixed point


@triton.jit
def _kept_row(TopKs, TopPs, row, samples, vocab_size, KEPT_CAP: tl.constexpr):
    """(whether the row's top_p cut is searched, whether it is found over its kept keys) of a row."""
    top_k = tl.load(TopKs + row)
    searched = samples & (tl.load(TopPs + row) < 1.0)
    return searched, searched & (top_k < vocab_size) & (top_k <= KEPT_CAP)


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _kept_gather_kernel(Logits, stride_l, Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, Cursor, Ties,
                        vocab_size, split_len, num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
                        SPLITS_POW2: tl.constexpr, KEPT_CAP: tl.constexpr, Order=None, CHECKED: tl.constexpr = False):
    """For (row, split) of a row whose top_p cut is found over its kept keys (`_kept_row`): the order keys of the
    split's columns that min_p keeps and that lie above top_k's cut (CutK[row]) go to Kept[row, Cursor[row] ..], and
    the columns at the cut itself are counted into Ties[row] (none where the cut is -inf's key: top_k cut nothing).
    Cursor and Ties start at zero. CHECKED: only the rows that need their cut (`_verdict_kernel`'s list)."""
    row, split, listed = _program_row_split(Order, CHECKED)
    if listed:
        _kept_gather(row, split, Logits, stride_l, Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, Cursor, Ties,
                     vocab_size, split_len, num_splits, greedy_eps, HAS_MIN_P, BLOCK, SPLITS_POW2, KEPT_CAP)


@triton.jit
def _kept_gather(row, split, Logits, stride_l, Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, Cursor, Ties,
                 vocab_size, split_len, num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
                 SPLITS_POW2: tl.constexpr, KEPT_CAP: tl.constexpr, CG: tl.constexpr = False):
    """`_kept_gather_kernel`'s work for (row, split). CG: `_shared_load`'s, for top_k's cut."""
    temp, samples, x_max, log_min_p = _row_setup(Temps, MinPs, SplitMax, row, num_splits, greedy_eps, HAS_MIN_P,
                                                 SPLITS_POW2)
    searched, found = _kept_row(TopKs, TopPs, row, samples, vocab_size, KEPT_CAP)  # (`_` would be loop-carried)
    if found:
        cut = _shared_load(CutK + row, CG=CG).to(tl.int32)
        lo_col = split * split_len
        hi_col = tl.minimum(lo_col + split_len, vocab_size)
        row_ptr = Logits + row * stride_l
        ties = tl.zeros([BLOCK], tl.int32)
        for start in range(lo_col, hi_col, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            _, key, kept = _kept_keys(row_ptr, offs, offs < hi_col, temp, x_max, log_min_p, cut, HAS_MIN_P)
            above = kept & (key > cut)  # (min_p's dropped columns are -inf, whose key is the lowest cut)
            ties += (kept & (key == cut) & (cut > _NEG_INF_KEY)).to(tl.int32)
            count = tl.sum(above.to(tl.int32), axis=0)
            if count > 0:  # fewer than k in all: top_k's cut is the k-th largest
                pos = tl.atomic_add(Cursor + row, count) + tl.cumsum(above.to(tl.int32), axis=0) - 1
                tl.store(Kept + row * KEPT_CAP + pos, key, mask=above & (pos < KEPT_CAP))
        tied = tl.sum(ties, axis=0)
        if tied > 0:
            tl.atomic_add(Ties + row, tied)


@triton.jit
def _kept_mass(key, x_max):
    """A kept key's softmax mass exp(x - x_max) in fixed point (int64, 2**40 for 1): sums of it are exact in any
    order."""
    return (tl.exp(_key_value(key) - x_max) * _KEPT_SCALE).to(tl.int64)


_KEPT_PAIR_CHUNK = tl.constexpr(16)  # (int64 masses: a chunk of 32 took a four-warp program to 168 registers)


@triton.jit
def _kept_top_p_ranked(keys, total, cut, x_max, top_p, tie_mass, CG: tl.constexpr = False):
    """`_kept_top_p_kernel`'s cut where at most _PAIR_KEYS keys lie above top_k's cut: the largest key whose mass at
    or above it (the kept keys', exact in fixed point) reaches the goal, or top_k's cut where none does. The
    narrowings find the same key (the mass at or above a key changes only at the keys), in eight passes one after
    another where this takes one sweep of pairwise compares. CG: `_shared_load`'s."""
    i = tl.arange(0, _PAIR_KEYS)
    mine = _shared_load(keys + i, mask=i < total, other=_NEG_INF_KEY, CG=CG)
    goal = top_p * (tl.sum(tl.where(i < total, _kept_mass(mine, x_max), 0), axis=0) + tie_mass).to(tl.float64)
    at_or_above = tl.zeros([_PAIR_KEYS], tl.int64)
    for start in range(0, total, _KEPT_PAIR_CHUNK):
        j = start + tl.arange(0, _KEPT_PAIR_CHUNK)
        theirs = _shared_load(keys + j, mask=j < total, other=_NEG_INF_KEY, CG=CG)
        w = tl.where(j < total, _kept_mass(theirs, x_max), 0)
        at_or_above += tl.sum(tl.where(theirs[None, :] >= mine[:, None], w[None, :], 0), axis=1)
    reach = (i < total) & (at_or_above.to(tl.float64) >= goal)
    return tl.maximum(cut, tl.max(tl.where(reach, mine, _NEG_INF_KEY), axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["num_splits"])
def _kept_top_p_kernel(Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, Cursor, Ties, PCut, Order2, vocab_size,
                       num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr,
                       KEPT_CAP: tl.constexpr, RESOLVE_BLOCK: tl.constexpr, Order=None, CHECKED: tl.constexpr = False):
    """A row's top_p cut from what `_kept_gather_kernel` found: the search's narrowings over [top_k's cut, key(row
    max)] (`_narrow`), each candidate's mass summed over the keys above the cut, the goal over those and the ties.
    PCut[row] = [1, cut] for a row found so (`_kept_row`), else [0, -]; a row whose top_p cut is searched but not
    found so is added to Order2 (its count zeroed beforehand), the list the search's passes then run over. CHECKED:
    only the rows that need their cut (`_verdict_kernel`'s list)."""
    row, listed = _program_row(Order, CHECKED)
    if listed:
        _kept_top_p(row, Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, Cursor, Ties, PCut, Order2, vocab_size,
                    num_splits, greedy_eps, HAS_MIN_P, NWAY, SPLITS_POW2, KEPT_CAP, RESOLVE_BLOCK)


@triton.jit
def _kept_top_p(row, Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, Cursor, Ties, PCut, Order2, vocab_size,
                num_splits, greedy_eps, HAS_MIN_P: tl.constexpr, NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr,
                KEPT_CAP: tl.constexpr, RESOLVE_BLOCK: tl.constexpr, CG: tl.constexpr = False):
    """`_kept_top_p_kernel`'s work for a row. CG: `_shared_load`'s, for what the gather and top_k's resolve wrote."""
    temp, samples, x_max, log_min_p = _row_setup(Temps, MinPs, SplitMax, row, num_splits, greedy_eps, HAS_MIN_P,
                                                 SPLITS_POW2)
    searched, found = _kept_row(TopKs, TopPs, row, samples, vocab_size, KEPT_CAP)
    total = _shared_load(Cursor + row, CG=CG)
    found = found & (total <= KEPT_CAP)  # (always: fewer than k keys lie above the k-th largest)
    if found:
        keys = Kept + row * KEPT_CAP
        cut = _shared_load(CutK + row, CG=CG)
        tie_mass = _shared_load(Ties + row, CG=CG).to(tl.int64) * _kept_mass(cut.to(tl.int32), x_max)
        top_p = tl.load(TopPs + row).to(tl.float64)
        if total <= _PAIR_KEYS:  # a few keys: the cut by each key's mass at or above it, in one sweep
            lo = _kept_top_p_ranked(keys, total, cut, x_max, top_p, tie_mass, CG)
        else:
            whole = tl.zeros([RESOLVE_BLOCK], tl.int64)
            for start in range(0, total, RESOLVE_BLOCK):
                i = start + tl.arange(0, RESOLVE_BLOCK)
                whole += _kept_mass(_shared_load(keys + i, mask=i < total, other=_NEG_INF_KEY, CG=CG), x_max)
            goal = top_p * (tl.sum(whole, axis=0) + tie_mass).to(tl.float64)
            lo = cut
            hi = _order_key(x_max).to(tl.int64)
            for _ in tl.static_range(_PASSES):
                cand = _candidates(lo, hi, NWAY).to(tl.int32)
                acc = tl.zeros([NWAY, RESOLVE_BLOCK], tl.int64)
                for start in range(0, total, RESOLVE_BLOCK):
                    i = start + tl.arange(0, RESOLVE_BLOCK)
                    key = _shared_load(keys + i, mask=i < total, other=_NEG_INF_KEY, CG=CG)
                    acc += tl.where(key[None, :] >= cand[:, None], _kept_mass(key, x_max)[None, :], 0)
                lo, hi = _narrow(lo, hi, tl.sum(acc, axis=1).to(tl.float64), goal, NWAY)
        tl.store(PCut + row * 2 + 1, lo)
    tl.store(PCut + row * 2, found.to(tl.int64))
    if searched & ~found:
        tl.store(Order2 + 1 + tl.atomic_add(Order2, 1), row.to(tl.int32))


@triton.jit(do_not_specialize=["num_splits", "b"])
def _cut_finish_kernel(Temps, TopPs, State, Part, Goal, CutK, Cuts, num_splits, b, greedy_eps, HAS_P: tl.constexpr,
                       NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr, Resolved=None, GATHER_CAP: tl.constexpr = 0,
                       Order=None, CHECKED: tl.constexpr = False, PCut=None, KEPT: tl.constexpr = False):
    """Cuts[row] (`_row_cut`). CHECKED: only the rows that need their cut (`_verdict_kernel`'s list); the others' are
    left unset. KEPT: top_p's cut of the rows `_kept_top_p_kernel` found is in PCut."""
    row, listed = _program_row(Order, CHECKED)
    if listed == 0:
        return
    tl.store(Cuts + row, _row_cut(row, Temps, TopPs, State, Part, Goal, CutK, num_splits, b, greedy_eps, HAS_P, NWAY,
                                  SPLITS_POW2, Resolved, GATHER_CAP, PCut=PCut, KEPT=KEPT))


@triton.jit
def _row_cut(row, Temps, TopPs, State, Part, Goal, CutK, num_splits, b, greedy_eps, HAS_P: tl.constexpr,
             NWAY: tl.constexpr, SPLITS_POW2: tl.constexpr, Resolved, GATHER_CAP: tl.constexpr,
             CG: tl.constexpr = False, PCut=None, KEPT: tl.constexpr = False):
    """The logit / temperature below which top_k and top_p drop a token (-inf: they drop none), the value
    `sampler.sample_torch` reads off its sorted row: top_k's k-th largest value, then top_p's first sorted value at
    which the renormalized mass reaches top_p. CG: `_shared_load`'s. KEPT: PCut holds top_p's cut where
    `_kept_top_p_kernel` found it."""
    samples = tl.load(Temps + row) >= greedy_eps
    top_p = tl.load(TopPs + row)
    cut = tl.full([], _NEG_INF_KEY, tl.int64)
    if samples:  # top_k's cut (-inf's key without top_k), or top_p's above it
        cut = _shared_load(CutK + row, CG=CG)
        if HAS_P:
            if top_p < 1.0:
                searched = True
                if KEPT:
                    if _shared_load(PCut + row * 2, CG=CG) != 0:
                        cut = _shared_load(PCut + row * 2 + 1, CG=CG)
                        searched = False
                if searched:
                    cut = _search_cut(State, Part, Resolved, row, b, num_splits, _shared_load(Goal + row, CG=CG),
                                      NWAY, SPLITS_POW2, GATHER_CAP, CG)
    return _key_value(cut.to(tl.int32))


@triton.jit
def _row_barrier(Bar, passed, num_splits):
    """The programs of one row (its splits) wait here for each other, between two steps of `_top_p_search_kernel`:
    each adds one to the row's count Bar (after all its threads' stores, with release order), then one thread polls
    it (acquire order) until every split has added its (passed + 1)-th. Needs a row's programs resident at once:
    each SM holds one (178-255 registers a thread: one at most), a row has no more splits than the GPU has SMs
    (`_persistent_search`), and the programs of the rows listed before it, which the GPU places first, never wait
    for a later row's. -> passed + 1"""
    tl.debug_barrier()
    tl.atomic_add(Bar, 1, sem="release", scope="gpu")
    goal = num_splits * (passed + 1)
    seen = tl.atomic_add(Bar, 0, sem="acquire", scope="gpu")
    while seen < goal:
        seen = tl.atomic_add(Bar, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    return passed + 1


@triton.jit(do_not_specialize=["split_len", "num_splits", "b", "passes"])
def _top_p_search_kernel(Logits, stride_l, Temps, MinPs, TopPs, SplitMax, State, Part, Goal, CutK, Seeds, Steps,
                         OutVal, OutIdx, Bar, Order, vocab_size, split_len, num_splits, b, passes, greedy_eps,
                         HAS_K: tl.constexpr, HAS_MIN_P: tl.constexpr, NWAY: tl.constexpr, BLOCK: tl.constexpr,
                         DRAW_BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, Gathered=None, GathN=None, Above=None,
                         Resolved=None, Dense=None, GATHER_CAP: tl.constexpr = 0, RESOLVE_BLOCK: tl.constexpr = 256):
    """top_p's whole cut search and the draw under the cut in one launch, over `_verdict_kernel`'s list (grid
    (splits, B), a listed row's splits side by side): each listed row's programs run the passes (`_top_p_pass`), the
    resolve (split 0, `_cut_resolve`) and the passes after it (where the resolve did not finish the row) one after
    another, waiting for each other at the row's barrier (`_row_barrier`; Bar[row] zeroed by `_verdict_kernel`)
    where separate launches would wait for the last one to end. Then each takes the row's cut (`_row_cut`) and draws
    its split under it. A step that lists no row costs one launch of programs that read the count and exit, where the
    separate launches cost ten or eleven (docs/gpu-notes.md, fifty-first session). Reads of what the row's other
    programs wrote go to L2 (`_shared_load`)."""
    row, split, listed = _program_row_split(Order, True)
    if listed == 0:
        return
    bar = Bar + row
    passed = 0
    for pass_idx in range(0, passes):  # PASSES, a runtime bound: one copy of a pass's code (two with the gather)
        if GATHER_CAP:
            if pass_idx == _GATHER_PASS:
                _top_p_pass(row, split, Logits, stride_l, Temps, MinPs, TopPs, SplitMax, State, Part, Goal, CutK,
                            vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_K, HAS_MIN_P, NWAY, BLOCK,
                            SPLITS_POW2, Gathered, GathN, Above, Resolved, GATHER_CAP, True, True)
                passed = _row_barrier(bar, passed, num_splits)
                if split == 0:
                    _cut_resolve(row, Temps, MinPs, TopPs, SplitMax, State, Goal, Gathered, GathN, Above, Resolved,
                                 Dense, num_splits, greedy_eps, HAS_MIN_P, NWAY, SPLITS_POW2, GATHER_CAP,
                                 RESOLVE_BLOCK, True)
                passed = _row_barrier(bar, passed, num_splits)
            else:
                run = pass_idx < _GATHER_PASS
                if pass_idx > _GATHER_PASS:  # where the resolve did not finish the row (the same for all its programs)
                    run = _shared_load(Resolved + row * 2, CG=True) == 0
                if run:
                    _top_p_pass(row, split, Logits, stride_l, Temps, MinPs, TopPs, SplitMax, State, Part, Goal, CutK,
                                vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_K, HAS_MIN_P, NWAY,
                                BLOCK, SPLITS_POW2, Gathered, GathN, Above, Resolved, GATHER_CAP, False, True)
                    passed = _row_barrier(bar, passed, num_splits)
        else:
            _top_p_pass(row, split, Logits, stride_l, Temps, MinPs, TopPs, SplitMax, State, Part, Goal, CutK,
                        vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_K, HAS_MIN_P, NWAY, BLOCK,
                        SPLITS_POW2, Gathered, GathN, Above, Resolved, GATHER_CAP, False, True)
            passed = _row_barrier(bar, passed, num_splits)
    cut = _row_cut(row, Temps, TopPs, State, Part, Goal, CutK, num_splits, b, greedy_eps, True, NWAY, SPLITS_POW2,
                   Resolved, GATHER_CAP, True)
    _split_draw(row, split, Logits, stride_l, Temps, MinPs, SplitMax, cut, Seeds, Steps, OutVal, OutIdx, vocab_size,
                split_len, num_splits, greedy_eps, HAS_MIN_P, True, DRAW_BLOCK, SPLITS_POW2)


@triton.jit(do_not_specialize=["split_len", "num_splits", "b"])
def _top_k_search_kernel(Logits, stride_l, Temps, MinPs, TopKs, TopPs, SplitMax, State, Hist, Dense, Cursor, CutK,
                         Seeds, Steps, OutVal, OutIdx, Bar, Order, vocab_size, split_len, num_splits, b, greedy_eps,
                         HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr, RESOLVE_BLOCK: tl.constexpr,
                         DRAW_BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr, Kept=None, KeptCursor=None, Ties=None,
                         PCut=None, Order2=None, KEPT_P: tl.constexpr = False, KEPT_CAP: tl.constexpr = 0,
                         NWAY: tl.constexpr = 16, KEPT_BLOCK: tl.constexpr = 128):
    """top_k's whole select and the draw under its cut in one launch, over `_verdict_kernel`'s list (grid (splits,
    B), a listed row's splits side by side), as `_top_p_search_kernel` does top_p's: each listed row's programs run
    the passes (`_top_k_pass`) up to the one that gathers the row's range (the later ones, which would only hand the
    state on, are left out), split 0 the resolve (`_top_k_resolve`, into CutK), then each takes the row's cut and
    draws its split under it, waiting for each other at the row's barrier (`_row_barrier`; Bar[row] zeroed by
    `_verdict_kernel`) between steps. Hist and Cursor start at zero, as for the separate launches. KEPT_P (a batch
    whose every top_p row has a top_k of at most KEPT_CAP): after the resolve, top_p's cut over what top_k keeps,
    `_kept_gather` by every program then `_kept_top_p` by split 0 over KEPT_BLOCK keys at a time (KeptCursor and
    Ties zeroed; Order2 is unread)."""
    row, split, listed = _program_row_split(Order, True)
    if listed:
        bar = Bar + row
        _top_k_pass(row, split, Logits, stride_l, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, Cursor,
                    vocab_size, split_len, num_splits, b, 0, greedy_eps, HAS_MIN_P, BLOCK, SPLITS_POW2, True, True)
        passed = _row_barrier(bar, 0, num_splits)
        pass_idx = tl.full([], 1, tl.int32)
        more = pass_idx < _TOP_K_PASSES  # pass 0 never gathers
        while more:  # the same for all of the row's programs: they read one state
            _top_k_pass(row, split, Logits, stride_l, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, Cursor,
                        vocab_size, split_len, num_splits, b, pass_idx, greedy_eps, HAS_MIN_P, BLOCK, SPLITS_POW2,
                        False, True)
            passed = _row_barrier(bar, passed, num_splits)
            gather_at = _shared_load(State + ((pass_idx % 2) * b + row) * 8 + 6, CG=True)
            pass_idx += 1
            more = (gather_at == 0) & (pass_idx < _TOP_K_PASSES)
        if split == 0:  # pass_idx: the pass after the last one run, whose state and histogram the resolve reads
            tl.store(CutK + row, _top_k_resolve(row, Temps, MinPs, TopKs, SplitMax, State, Hist, Dense, vocab_size,
                                                num_splits, b, pass_idx, greedy_eps, HAS_MIN_P, SPLITS_POW2,
                                                RESOLVE_BLOCK, True))
        passed = _row_barrier(bar, passed, num_splits)
        cut = _shared_load(CutK + row, CG=True)
        if KEPT_P:
            _kept_gather(row, split, Logits, stride_l, Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, KeptCursor,
                         Ties, vocab_size, split_len, num_splits, greedy_eps, HAS_MIN_P, BLOCK, SPLITS_POW2, KEPT_CAP,
                         True)
            passed = _row_barrier(bar, passed, num_splits)
            if split == 0:
                _kept_top_p(row, Temps, MinPs, TopKs, TopPs, SplitMax, CutK, Kept, KeptCursor, Ties, PCut, Order2,
                            vocab_size, num_splits, greedy_eps, HAS_MIN_P, NWAY, SPLITS_POW2, KEPT_CAP, KEPT_BLOCK,
                            True)
            passed = _row_barrier(bar, passed, num_splits)
            if _shared_load(PCut + row * 2, CG=True) != 0:  # a row with top_p: its cut, above top_k's
                cut = _shared_load(PCut + row * 2 + 1, CG=True)
        cut = _key_value(cut.to(tl.int32))  # (a listed row samples: no greedy row's cut to leave at -inf)
        _split_draw(row, split, Logits, stride_l, Temps, MinPs, SplitMax, cut, Seeds, Steps, OutVal, OutIdx,
                    vocab_size, split_len, num_splits, greedy_eps, HAS_MIN_P, True, DRAW_BLOCK, SPLITS_POW2)


_BLOCK = 2048
REJECTION_FIRST = os.environ.get("OSTINATO_SAMPLER_REJECTION", "1") != "0"  # "0": every row searched (for A/B runs)
# rejection first also checks each row's second best draw (`_draw_checks`): "1" always, "0" never, by default
# ("auto") where the batch has top_p and no top_k (`_second_best_pays`)
SECOND_BEST = os.environ.get("OSTINATO_SAMPLER_SECOND", "auto")
if SECOND_BEST not in ("0", "1", "auto"):
    raise ValueError(f"OSTINATO_SAMPLER_SECOND must be 0, 1 or auto, got {SECOND_BEST!r}")
# the cut search and its draw as one launch (`_persistent_search`): "auto" (on CUDA), "0" never, "1" (for tests)
PERSISTENT = os.environ.get("OSTINATO_SAMPLER_PERSISTENT", "auto")
if PERSISTENT not in ("0", "1", "auto"):
    raise ValueError(f"OSTINATO_SAMPLER_PERSISTENT must be 0, 1 or auto, got {PERSISTENT!r}")
PERSISTENT_MAX_BATCH = 32
# a register cap for the one launch (OSTINATO_SAMPLER_PERSISTENT_MAXNREG, for A/B runs; unset: none): it compiles to
# 178-255 registers a thread, one program an SM; at 128 it fits two, spilling about 110 bytes where it gathers
_MAXNREG = os.environ.get("OSTINATO_SAMPLER_PERSISTENT_MAXNREG", "")
if _MAXNREG and not (_MAXNREG.isdigit() and 24 <= int(_MAXNREG) <= 255):
    raise ValueError(f"OSTINATO_SAMPLER_PERSISTENT_MAXNREG must be a register count of 24-255, got {_MAXNREG!r}")
_PERSISTENT_REGS = {"maxnreg": int(_MAXNREG)} if _MAXNREG else {}
_SEARCH_BLOCK = 1024
_SEARCH_WARPS = 8
_RESOLVE_BLOCK = 32 * _SEARCH_WARPS
_RADIX_BLOCK = 2048
_RADIX_WARPS = 4
_NWAY = 16
_TARGET_PROGRAMS = 512  # a few waves over an H100/H200's 132 SMs


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor | None,
                 top_ks: torch.Tensor | None, top_ps: torch.Tensor | None, seeds: torch.Tensor, steps: torch.Tensor,
                 vocab_size: int, greedy_eps: float, cut_phases: tuple[bool, ...] = (True, True),
                 out: torch.Tensor | None = None,
                 scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """int64 [B] token ids from float32 logits [B, >= vocab_size] (last dim contiguous); columns past
    `vocab_size` are ignored. `min_ps` None: no row filters by min_p; `top_ks` / `top_ps` None: no row has
    top_k / top_p (else both are given: int64 [B] with vocab_size for none, float32 [B] with 1.0 for none),
    and `cut_phases` (a `CutPhases`, or a pair of its first fields) says whether any row has top_k, top_p (a search
    with no row is skipped), and whether any top_p row lacks a top_k of at most KEPT_CAP (where none does, top_p's
    search passes are left out: every top_p cut comes from its row's kept keys; given a pair, they stay in). With
    them the unrestricted draw comes first, then one pass that checks it against each row's top_k / top_p and one
    that lists the rows whose draw failed, then the cut search over that list (TOP_K_PASSES and PASSES launches over
    (split, list entry) programs, a resolve and a finish over one program per entry; with both filters, top_p's
    passes run only over the rows the kept keys did not settle), then their draw under the cut.

    Each row is cut into splits so a small batch still spreads over the GPU: one program per (row, split)
    finds its split's best, and a last argmax over the splits (ordered by column, so ties keep the first
    index) picks the token. min_p and the cut searches need each row's maximum: with min_p a first pass takes it,
    else the unrestricted draw does.
    The ids go into `out` when given; with `scatter` = (dest, index) that last kernel also stores
    dest[index[b]] = row b's id (the next-token buffer, by request row).
    """
    b = logits.shape[0]
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(b, dtype=torch.int64, device=logits.device) if out is None else out
    if b == 0:
        return out
    split_len, num_splits = split_plan(b, vocab_size)
    grid = (b, num_splits)
    dev = logits.device
    pow2 = triton.next_power_of_2(num_splits)
    min_p_arg = min_ps if min_ps is not None else temperatures  # unread without min_p
    vals = torch.empty(b, num_splits, dtype=torch.float32, device=dev)
    idx = torch.empty(b, num_splits, dtype=torch.int64, device=dev)
    sample_args = (logits, logits.stride(0), temperatures, min_p_arg)
    sample_meta = dict(HAS_MIN_P=min_ps is not None, BLOCK=_BLOCK, SPLITS_POW2=pow2, num_warps=8)
    draw_args = (seeds, steps, vals, idx, vocab_size, split_len, num_splits, greedy_eps)
    has_k, has_p, p_search = _phases(cut_phases)
    if top_ks is None or not REJECTION_FIRST:
        split_max = _split_max(logits, temperatures, min_ps, top_ks is not None and (has_k or has_p), vocab_size,
                               greedy_eps, split_len, num_splits)
        cuts = split_max if top_ks is None else _cuts(logits, temperatures, min_ps, top_ks, top_ps, split_max,
                                                      vocab_size, greedy_eps, cut_phases, split_len, num_splits)
        _split_sample_kernel[grid](*sample_args, split_max, cuts, *draw_args, HAS_CUT=top_ks is not None,
                                   **sample_meta)
        return pick_rows(vals, idx, out, scatter)
    # rejection first (see _accept_part_kernel): the unrestricted draw, the check of each row's j*, then the cut
    # search and the draw under the cuts for the rows whose j* failed
    second_best = _second_best_pays(has_k, has_p)
    # the check's parts, each only where its search runs (else `vals`, unread)
    mass = torch.empty(b, num_splits, MASS_LANES, dtype=torch.float32, device=dev) if has_p else vals
    count = torch.empty(b, num_splits, dtype=torch.int32, device=dev) if has_k else vals
    # the second best draw's: the splits' seconds, its top_k count, whether the row has one
    vals2, idx2 = (torch.empty_like(vals), torch.empty_like(idx)) if second_best else (vals, idx)
    count2 = torch.empty(b, num_splits, dtype=torch.int32, device=dev) if has_k and second_best else vals
    second = torch.empty(b, dtype=torch.int32, device=dev) if second_best else vals
    second_args = dict(Count2=count2, Second=second, SECOND=second_best)
    order = torch.empty(b + 1, dtype=torch.int32, device=dev)  # the rows that need their cut (_verdict_kernel)
    # the row maximum (min_p and the searches need it): with min_p a pass of its own, else taken by the first draw
    split_max = _split_max(logits, temperatures, min_ps, False, vocab_size, greedy_eps, split_len, num_splits)
    _split_sample_kernel[grid](*sample_args, split_max, split_max, *draw_args, HAS_CUT=False, MaxOut=split_max,
                               STORE_MAX=min_ps is None, KEEP_SECOND=second_best, OutVal2=vals2, OutIdx2=idx2,
                               **sample_meta)
    _accept_part_kernel[grid](logits, logits.stride(0), temperatures, min_p_arg, split_max, vals, idx, mass, count,
                              vocab_size, split_len, num_splits, greedy_eps, HAS_K=has_k, HAS_P=has_p,
                              HAS_MIN_P=min_ps is not None, BLOCK=_SEARCH_BLOCK, SPLITS_POW2=pow2,
                              num_warps=_SEARCH_WARPS, Order=order, Vals2=vals2, Idx2=idx2, **second_args)
    persistent = _persistent_search(dev, num_splits, b, has_k, has_p, p_search)
    bar = torch.empty(b, dtype=torch.int32, device=dev) if persistent else order  # (unread without it)
    _verdict_kernel[(b,)](temperatures, top_ks, top_ps, mass, count, order, vocab_size, num_splits, b, greedy_eps,
                          HAS_K=has_k, HAS_P=has_p, SPLITS_POW2=pow2, Vals=vals, Idx=idx, Vals2=vals2, Idx2=idx2,
                          num_warps=1, Bar=bar, ZERO_BAR=persistent, **second_args)
    check = dict(Order=order, CHECKED=True)
    if persistent and not p_search:  # top_k's select (top_p's cut over its kept keys) and the draw in one launch
        hist, cursor, dense, select = _top_k_buffers(b, dev)
        kept = {}
        if has_p:
            order2, kept_cursor, ties, keys, pcut = _kept_buffers(b, dev)
            kept = dict(Kept=keys, KeptCursor=kept_cursor, Ties=ties, PCut=pcut, Order2=order2, KEPT_P=True,
                        KEPT_CAP=KEPT_CAP)
        _top_k_search_kernel[(num_splits, b)](
            logits, logits.stride(0), temperatures, min_p_arg, top_ks, top_ps, split_max, select, hist, dense, cursor,
            torch.empty(b, dtype=torch.int64, device=dev), seeds, steps, vals, idx, bar, order, vocab_size, split_len,
            num_splits, b, greedy_eps, HAS_MIN_P=min_ps is not None, BLOCK=_RADIX_BLOCK,
            RESOLVE_BLOCK=_SEARCH_BLOCK, DRAW_BLOCK=_BLOCK, SPLITS_POW2=pow2, num_warps=_RADIX_WARPS, **kept)
        return pick_rows(vals, idx, out, scatter)
    if persistent:  # top_k's search (its own launches), then top_p's and the draw under the cut in one
        row_args, meta = _search_inputs(temperatures, min_ps, top_ks, top_ps, split_max, num_splits, check)
        cut_k = _top_k_cut(logits, row_args, meta, has_k, vocab_size, greedy_eps, split_len, num_splits,
                           (num_splits, b))
        state, part, goal, gather, dense, cap = _top_p_buffers(b, num_splits, dev)
        _top_p_search_kernel[(num_splits, b)](
            logits, logits.stride(0), temperatures, min_p_arg, top_ps, split_max, state, part, goal, cut_k, seeds,
            steps, vals, idx, bar, order, vocab_size, split_len, num_splits, b, PASSES, greedy_eps, HAS_K=has_k,
            HAS_MIN_P=min_ps is not None, NWAY=_NWAY, BLOCK=_SEARCH_BLOCK, DRAW_BLOCK=_BLOCK, SPLITS_POW2=pow2,
            **gather, Dense=dense, GATHER_CAP=cap, RESOLVE_BLOCK=_RESOLVE_BLOCK, num_warps=_SEARCH_WARPS,
            **_PERSISTENT_REGS)
        return pick_rows(vals, idx, out, scatter)
    cuts = _cuts(logits, temperatures, min_ps, top_ks, top_ps, split_max, vocab_size, greedy_eps, cut_phases,
                 split_len, num_splits, check)
    _split_sample_kernel[(num_splits, b)](*sample_args, split_max, cuts, *draw_args, HAS_CUT=True, **check,
                                          **sample_meta)
    return pick_rows(vals, idx, out, scatter)


def _second_best_pays(has_k: bool, has_p: bool) -> bool:
    """Whether rejection first also checks each row's second best draw. It pays where top_p is the only filter:
    j2's mass check then is exact and decides most rows whose j1 is cut, so their search is skipped. Where the
    batch has top_k it cost more than it saved on the H200 (the draw keeping every row's second, a second count in
    the check's pass): with top_k 200 at 256 rows, at 32 rows of flat logits, and with top_k 50 and top_p 0.9
    (docs/gpu-notes.md, forty-eighth session)."""
    if SECOND_BEST in ("0", "1"):
        return SECOND_BEST == "1"
    return has_p and not has_k


def _phases(cut_phases: tuple[bool, ...]) -> tuple[bool, bool, bool]:
    """(some row has top_k, some row has top_p, top_p's search passes run) from `fused_sample`'s cut_phases, a
    `CutPhases` or a pair of its first two fields."""
    phases = CutPhases(*cut_phases)
    return phases.top_k, phases.top_p, phases.top_p and phases.top_p_search


def _split_max(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor | None, search: bool,
               vocab_size: int, greedy_eps: float, split_len: int, num_splits: int) -> torch.Tensor:
    """Each split's max of logits / temperature, float32 [B, splits]: taken with min_p or a cut search (they need
    the row's: top_p's mass and top_k's first window start from it), else left unwritten."""
    b = logits.shape[0]
    split_max = torch.empty(b, num_splits, dtype=torch.float32, device=logits.device)
    if min_ps is not None or search:
        _split_max_kernel[(b, num_splits)](logits, logits.stride(0), temperatures, split_max, vocab_size, split_len,
                                           num_splits, greedy_eps, BLOCK=_BLOCK, num_warps=8)
    return split_max


def _persistent_search(device: torch.device, num_splits: int, batch: int, has_k: bool, has_p: bool,
                       p_search: bool) -> bool:
    """Whether rejection first runs the cut search and the draw under the cut as one launch: top_k's
    (`_top_k_search_kernel`) where the batch has top_k and no top_p row needs top_p's search passes (p_search: a
    top_p row without a top_k of at most KEPT_CAP), with top_p's cut over the kept keys inside it; else top_p's
    (`_top_p_search_kernel`, top_k's select before it in its own launches). OSTINATO_SAMPLER_PERSISTENT "0":
    never, "1": always, and in Triton's interpreter, which runs a launch's programs one after another, with one
    split a row, whose one program never waits for another. By default ("auto", on CUDA) where the batch has at
    most PERSISTENT_MAX_BATCH rows, except with top_p's search passes beside top_k's: there most steps list few
    rows or none, and one launch gained (H200, Llama-3.2-1B's vocabulary: top_p 0.9 at bs 1 24 -> 15 us, bs 32 47
    -> 33, fifty-first session; top_k 50 on flat rows 40 -> 31 and 83 -> 69, sixtieth); top_p's kernel with
    top_k's filter in it lost where many rows are searched (top_k 50 with top_p 0.9: bs 32 169 -> 218 us),
    likely as its programs run one an SM (docs/gpu-notes.md)."""
    if PERSISTENT == "0" or not (has_k or has_p):
        return False
    if device.type != "cuda":
        return PERSISTENT == "1" and num_splits == 1
    if num_splits > usable_sms(device):
        return False  # a row's programs, one an SM, could not all be resident (`_row_barrier`)
    return PERSISTENT == "1" or (batch <= PERSISTENT_MAX_BATCH and not (has_k and p_search))


def _search_inputs(temperatures: torch.Tensor, min_ps: torch.Tensor | None, top_ks: torch.Tensor,
                   top_ps: torch.Tensor, split_max: torch.Tensor, num_splits: int,
                   check: dict | None) -> tuple[tuple, dict]:
    """(the per-row inputs every search kernel takes first, their shared launch settings)."""
    min_p_arg = min_ps if min_ps is not None else temperatures  # unread without min_p
    meta = dict(HAS_MIN_P=min_ps is not None, SPLITS_POW2=triton.next_power_of_2(num_splits),
                num_warps=_SEARCH_WARPS, **(check or {}))
    return (temperatures, min_p_arg, top_ks, top_ps, split_max), meta


def _top_k_cut(logits: torch.Tensor, row_args: tuple, meta: dict, has_k: bool, vocab_size: int, greedy_eps: float,
               split_len: int, num_splits: int, grid: tuple[int, int]) -> torch.Tensor:
    """top_k's cut a row, int64 order keys [B] (the floor of top_p's search): with `has_k` top_k's select,
    TOP_K_PASSES histogram passes over `grid` and one resolve per row; without, left for top_p's pass 0 to fill."""
    b = logits.shape[0]
    dev = logits.device
    cut_k = torch.empty(b, dtype=torch.int64, device=dev)
    if not has_k:
        return cut_k
    hist, cursor, dense, select = _top_k_buffers(b, dev)
    for pass_idx in range(TOP_K_PASSES):
        _top_k_pass_kernel[grid](logits, logits.stride(0), *row_args, select, hist, dense, cursor, vocab_size,
                                 split_len, num_splits, b, pass_idx, greedy_eps, BLOCK=_RADIX_BLOCK,
                                 FIRST=pass_idx == 0, **(meta | dict(num_warps=_RADIX_WARPS)))
    _top_k_resolve_kernel[(b,)](*row_args, select, hist, dense, cut_k, vocab_size, num_splits, b, greedy_eps,
                                BLOCK=_SEARCH_BLOCK, **meta)
    return cut_k


def _top_k_buffers(b: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """top_k's select buffers: (Hist and Cursor, zeroed; Dense, the gathered keys; State, by pass parity)."""
    counts = torch.zeros(TOP_K_PASSES * b * 256 + b, dtype=torch.int32, device=dev)  # Hist, then Cursor
    dense = torch.empty(b, TOP_K_GATHER, dtype=torch.int32, device=dev)
    return counts[:-b], counts[-b:], dense, torch.empty(2, b, 8, dtype=torch.int64, device=dev)


def _kept_buffers(b: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """top_p over what top_k keeps: (the leftovers' list, a cursor a row and a tie count a row, zeroed; the kept keys;
    PCut). The first three share one buffer, each part 16-byte aligned, as Triton specializes a pointer on that (an
    unaligned one would compile every kernel that takes it again)."""
    at = -(-(b + 1) // 4) * 4
    span = -(-b // 4) * 4
    counts = torch.zeros(at + 2 * span, dtype=torch.int32, device=dev)
    keys = torch.empty(b, KEPT_CAP, dtype=torch.int32, device=dev)
    return (counts[:b + 1], counts[at:at + b], counts[at + span:at + span + b], keys,
            torch.empty(b, 2, dtype=torch.int64, device=dev))


def _top_p_buffers(b: int, num_splits: int, dev: torch.device, gathers: bool = True) -> tuple:
    """top_p's search state: (State: (lo, hi) of the last two passes, Part: their masses, Goal: top_p x the mass
    above top_k's cut, the gather pass's buffers, the resolve's keys side by side, the gather capacity); the last
    three none or 0 where the batch does not gather (or not `gathers`)."""
    pow2 = triton.next_power_of_2(num_splits)
    state = torch.empty(b, 2, 2, dtype=torch.int64, device=dev)
    part = torch.empty(2, b, num_splits, _NWAY, dtype=torch.float32, device=dev)
    goal = torch.empty(b, dtype=torch.float32, device=dev)
    cap = gather_cap(b, num_splits) if gathers else 0
    gather, dense = {}, None
    if cap:
        gather = dict(Gathered=torch.empty(b, num_splits, cap, dtype=torch.int32, device=dev),
                      GathN=torch.empty(b, num_splits, dtype=torch.int32, device=dev),
                      Above=torch.empty(b, num_splits, dtype=torch.float32, device=dev),
                      Resolved=torch.empty(b, 2, dtype=torch.int64, device=dev))
        dense = torch.empty(b, pow2 * cap, dtype=torch.int32, device=dev)
    return state, part, goal, gather, dense, cap


def _cuts(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor | None, top_ks: torch.Tensor,
          top_ps: torch.Tensor, split_max: torch.Tensor, vocab_size: int, greedy_eps: float,
          cut_phases: tuple[bool, ...], split_len: int, num_splits: int, check: dict | None = None) -> torch.Tensor:
    """The cut search's launches: each row's cut, float32 [B]. `check` (Order, `_verdict_kernel`'s list, with
    CHECKED): only the listed rows are searched (grids over (split, list entry)); the others' cuts are left unset."""
    b = logits.shape[0]
    grid = (num_splits, b) if check else (b, num_splits)
    dev = logits.device
    pow2 = triton.next_power_of_2(num_splits)
    has_k, has_p, p_search = _phases(cut_phases)
    row_args, meta = _search_inputs(temperatures, min_ps, top_ks, top_ps, split_max, num_splits, check)
    cut_k = _top_k_cut(logits, row_args, meta, has_k, vocab_size, greedy_eps, split_len, num_splits, grid)
    state, part, goal, gather, dense, cap = _top_p_buffers(b, num_splits, dev, gathers=has_p)
    kept = {}
    search, search_grid = meta, grid  # the passes' rows: every listed row, or the kept keys' leftovers
    if has_k and has_p:  # top_p over what top_k keeps first (KEPT_CAP)
        order2, cursor, ties, keys, pcut = _kept_buffers(b, dev)
        _kept_gather_kernel[grid](logits, logits.stride(0), *row_args, cut_k, keys, cursor, ties, vocab_size,
                                  split_len, num_splits, greedy_eps, BLOCK=_SEARCH_BLOCK, KEPT_CAP=KEPT_CAP, **meta)
        _kept_top_p_kernel[(b,)](*row_args, cut_k, keys, cursor, ties, pcut, order2, vocab_size, num_splits,
                                 greedy_eps, NWAY=_NWAY, KEPT_CAP=KEPT_CAP, RESOLVE_BLOCK=_RESOLVE_BLOCK, **meta)
        kept = dict(PCut=pcut, KEPT=True)
        search, search_grid = meta | dict(Order=order2, CHECKED=True), (num_splits, b)
    if has_p and (p_search or not kept):
        args = (logits, logits.stride(0), *row_args, state, part, goal, cut_k, vocab_size, split_len, num_splits, b)
        for pass_idx in range(PASSES):
            _top_p_pass_kernel[search_grid](*args, pass_idx, greedy_eps, HAS_K=has_k, BLOCK=_SEARCH_BLOCK, NWAY=_NWAY,
                                            **search, **gather, GATHER_CAP=cap,
                                            IS_GATHER=bool(cap) and pass_idx == GATHER_PASS)
            if cap and pass_idx == GATHER_PASS:
                _cut_resolve_kernel[(b,)](*row_args, state, goal, gather["Gathered"], gather["GathN"],
                                          gather["Above"], gather["Resolved"], dense, num_splits, greedy_eps,
                                          GATHER_CAP=cap, RESOLVE_BLOCK=_RESOLVE_BLOCK, NWAY=_NWAY, **search)
    cuts = torch.empty(b, dtype=torch.float32, device=dev)
    _cut_finish_kernel[(b,)](temperatures, top_ps, state, part, goal, cut_k, cuts, num_splits, b, greedy_eps,
                             HAS_P=has_p, NWAY=_NWAY, SPLITS_POW2=pow2, Resolved=gather.get("Resolved"),
                             GATHER_CAP=cap, num_warps=1, **(check or {}), **kept)
    return cuts


def _gather_min_batch() -> int:
    """The smallest batch whose top_p searches gather (OSTINATO_SAMPLER_GATHER_MIN_BATCH, default 8): smaller batches
    read the row eight times, as one program per row resolving its keys has less parallelism than a pass there."""
    value = os.environ.get("OSTINATO_SAMPLER_GATHER_MIN_BATCH", "8")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OSTINATO_SAMPLER_GATHER_MIN_BATCH must be a batch size >= 1, got {value!r}")
    return int(value)


GATHER_MIN_BATCH = _gather_min_batch()
_GATHER_KEYS = 2048  # a row's gathered keys at most, over its splits; at least 64 a split


def gather_cap(batch: int, num_splits: int) -> int:
    """Columns a split's gather pass can hold (a power of two), or 0 where the batch's searches do not gather."""
    if batch < GATHER_MIN_BATCH:
        return 0
    return max(64, _GATHER_KEYS // triton.next_power_of_2(num_splits))


def row_cuts(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor | None, top_ks: torch.Tensor,
             top_ps: torch.Tensor, vocab_size: int, greedy_eps: float,
             cut_phases: tuple[bool, ...] = (True, True)) -> torch.Tensor:
    """The threshold fused_sample applies to each row's logits / temperature (-inf: it cuts nothing), float32 [B],
    every row searched (no acceptance check): the search's result alone, for tests. Arguments as fused_sample's."""
    plan = split_plan(logits.shape[0], vocab_size)
    has_k, has_p, _ = _phases(cut_phases)
    split_max = _split_max(logits, temperatures, min_ps, has_k or has_p, vocab_size, greedy_eps, *plan)
    return _cuts(logits, temperatures, min_ps, top_ks, top_ps, split_max, vocab_size, greedy_eps, cut_phases, *plan)


def split_plan(batch: int, vocab_size: int) -> tuple[int, int]:
    """(split_len, num_splits) of a batch's rows: enough splits for ~_TARGET_PROGRAMS programs, whole blocks each."""
    num_splits = max(1, min(triton.cdiv(vocab_size, _BLOCK), triton.cdiv(_TARGET_PROGRAMS, batch)))
    split_len = triton.cdiv(triton.cdiv(vocab_size, num_splits), _BLOCK) * _BLOCK
    return split_len, triton.cdiv(vocab_size, split_len)


def warm_up_batches(max_batch: int, vocab_size: int) -> list[int]:
    """The smallest batch size of each set of kernels `fused_sample` compiles, up to max_batch: one per power of two
    of its split count (SPLITS_POW2) and, within it, per top_p gather capacity (none below GATHER_MIN_BATCH rows)
    and on each side of PERSISTENT_MAX_BATCH (where top_p alone moves from one launch to the separate ones).
    Running these once compiles every kernel a serving engine would otherwise compile mid-stream as its batch
    changes (each a stall of all running requests: 0.1-0.3 s a kernel on an H200, seconds for a top_k search)."""
    seen: dict[tuple[int, int, bool], int] = {}
    for b in range(1, max_batch + 1):
        num_splits = split_plan(b, vocab_size)[1]
        key = (triton.next_power_of_2(num_splits), gather_cap(b, num_splits), b <= PERSISTENT_MAX_BATCH)
        seen.setdefault(key, b)
    return sorted(seen.values())


# (min_p, top_k, top_p) of each set of kernels a step may need: temperature alone, and each filter combination
WARM_UP_FILTERS = [(min_p, k, p) for min_p in (False, True) for k, p in ((False, False), (True, False),
                                                                          (False, True), (True, True))]


def warm_up_cases(max_batch: int, vocab_size: int, filters: bool = True,
                  row_strides: tuple[int, ...] = ()) -> list[tuple[int, int, tuple[bool, bool, bool] | None]]:
    """(batch, logits row stride, filter set) of each launch `warm_up` makes, in its order: at each of
    `warm_up_batches`, each row stride (`vocab_size` and `row_strides`), each of WARM_UP_FILTERS (temperature only
    unless `filters`) drawn through a scatter as the sampler graphs draw, then None: a plain draw as an eager step
    makes it."""
    sets = WARM_UP_FILTERS if filters else WARM_UP_FILTERS[:1]
    return [(b, stride, f) for b in warm_up_batches(max_batch, vocab_size)
            for stride in sorted({vocab_size, *row_strides}) for f in (*sets, None)]


def warm_up(max_batch: int, vocab_size: int, device: torch.device, filters: bool = True,
            row_strides: tuple[int, ...] = (), part: tuple[int, int] = (0, 1)) -> None:
    """Run `fused_sample` once for each of `warm_up_cases` (over logits rows `row_strides` apart too: a decode
    graph's padded buffer, as Triton specializes on a stride's alignment), compiling every kernel a serving step
    could need. part (i, n): only cases i, i + n, i + 2n, ..., so n processes can share the compiles
    (`warm_up_workers`)."""
    for b, stride, flt in warm_up_cases(max_batch, vocab_size, filters, row_strides)[part[0]::part[1]]:
        gen = torch.Generator(device=device).manual_seed(b)
        logits = torch.randn(b, stride, device=device, generator=gen)[:, :vocab_size]
        ones = torch.ones(b, device=device)
        zeros = torch.zeros(b, dtype=torch.int64, device=device)
        if flt is None:  # an eager step's
            fused_sample(logits, ones, None, None, None, zeros, zeros, vocab_size, greedy_eps=1e-5)
            continue
        min_p, has_k, has_p = flt
        cut = has_k or has_p
        top_ks = torch.full((b,), max(1, vocab_size // 2), dtype=torch.int64, device=device) if cut else None
        top_ps = torch.full((b,), 0.5, device=device) if cut else None
        scatter = (torch.empty(b, dtype=torch.int64, device=device), torch.arange(b, device=device))
        # with both filters, also as a batch whose every top_p row has a small top_k (top_p's search passes left out)
        for phases in [CutPhases(has_k, has_p)] + [CutPhases(True, True, False)] * (has_k and has_p):
            fused_sample(logits, ones, ones * 0.01 if min_p else None, top_ks, top_ps, zeros, zeros, vocab_size,
                         greedy_eps=1e-5, cut_phases=phases, out=torch.empty_like(zeros),
                         scatter=scatter)  # (no row greedy)
