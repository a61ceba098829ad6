"""Batched, seed-reproducible sampling on the device.

Randomness is counter-based: the uniform for (seed, step, token id) is an integer hash computed with
tensor ops, so a request's tokens depend only on its own seed, the index of the token being sampled and
its logits, not on the batch it shares or on when it was scheduled (a retracted and recomputed request
draws the same tokens). Sampling is Gumbel-max over the filtered logits, with each token's noise keyed by
its original id. `sample` has no per-request Python loop and no device->host sync, so it can be captured
in a CUDA graph. Eager, its ~25 elementwise passes over [B, V] cost ~1.2 ms at B=64, V=152k on an H100;
torch.compile fuses them (~0.1 ms). Penalties (presence/frequency/repetition) are applied to the logits
by the caller before `sample`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ostinato.graphs.sample import PenaltyRows
from ostinato.layers.gumbel import gumbel_argmax
from ostinato.layers.sampling_ops import (  # noqa: F401
    ARGMAX_CHUNK,
    KEPT_TOP_K,
    CutPhases,
    chunked_argmax,
    padded_vocab,
    penalize,
)
from ostinato.sampling_params import GREEDY_EPS, SamplingParams

_MIN_SEED, _SPAN_SEED = -(2**63), 2**64


# penalty state already on the device, asked for with whether some row has a repetition penalty: (counts [R, V],
# prompt marks [R, V] or None, each row's R index [B]) (PenaltyState.rows)
PenaltyRowsFor = Callable[[bool], tuple[Tensor, Tensor | None, Tensor]]


@dataclass
class SamplingTensors:
    """Per-step sampling inputs on the target device; the bool flags are host-side and skip unused work."""

    # the six per-row tensors are None when every row is greedy: an all-greedy step copies nothing to the device
    temperatures: Tensor | None  # float32 [B]; rows below GREEDY_EPS are greedy
    top_ks: Tensor | None  # int64 [B], vocab_size when disabled
    top_ps: Tensor | None  # float32 [B]
    min_ps: Tensor | None  # float32 [B]
    seeds: Tensor | None  # int64 [B]
    steps: Tensor | None  # int64 [B]: index of the output token being sampled
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    sort_width: int  # the top_k/top_p filters look at this many highest logits per row (vocab_size: all)
    # penalties: None when no row of the batch has one
    presence_penalties: Tensor | None = None  # float32 [B]
    frequency_penalties: Tensor | None = None  # float32 [B]
    # occurrences of each token in a row's output so far, [B, V] or, with `count_rows`, [R, V] read at row
    # count_rows[b] for batch row b (the engine's penalty state, by request slot: runner/penalties.py)
    output_counts: Tensor | None = None
    count_rows: Tensor | None = None  # int64 [B]
    # repetition penalties: None when no row of the batch has one
    repetition_penalties: Tensor | None = None  # float32 [B]
    prompt_mask: Tensor | None = None  # bool, the tokens of the row's prompt: rows as output_counts'
    # logprobs: per row, how many top alternatives to return (None: no logprobs for the row); None when no row asks
    num_logprobs: list[int | None] | None = None
    # logit_bias, flattened over the rows that have one: (row, token id, bias); None when no row has one
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None
    # structured outputs: each row's allowed tokens (int32 [B, ceil(V / 32)], runner/grammar_mask.py; all for an
    # unconstrained row); None when no row is constrained
    token_bitmask: Tensor | None = None
    # some sampled row has top_p without a top_k of at most KEPT_TOP_K: the fused kernels' top_p search passes run
    # (else every top_p row's cut comes from the keys its top_k keeps, runner/fused_sample.py)
    need_top_p_search: bool = True

    @property
    def fused_ok(self) -> bool:
        """Whether the fused kernels (runner/fused_sample.py) draw this step: some row samples."""
        return not self.all_greedy

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes the logits (penalties, logit_bias, structured outputs)."""
        return self.output_counts is not None or self.logit_bias is not None or self.token_bitmask is not None

    @property
    def graph_drawable(self) -> bool:
        """Whether a sampler graph can draw this step (graphs/sample.py): nothing adjusts its logits but penalties,
        and no row asks for logprobs of penalized logits (the graph keeps those to itself)."""
        if self.logit_bias is not None or self.token_bitmask is not None:
            return False
        return not self.penalized or self.num_logprobs is None

    @property
    def plain_draw(self) -> bool:
        """Some row samples, with a temperature and nothing else (no min_p, top_k, top_p, penalty, bias or grammar):
        the draw a decode graph makes itself (graphs/decode.py `load_draw`), as OpenAI's and vLLM's defaults
        sample."""
        return (self.fused_ok and not (self.need_min_p or self.need_top_k or self.need_top_p)
                and not self.adjusts_logits)

    def graph_penalties(self) -> PenaltyRows | None:
        """The sampler graph's per-row penalties (None: no row has one)."""
        if not self.penalized:
            return None
        return PenaltyRows(self.frequency_penalties, self.presence_penalties, self.repetition_penalties)

    @property
    def penalized(self) -> bool:
        """Some row has a presence, frequency or repetition penalty (`output_counts` is then set)."""
        return self.output_counts is not None

    def fused_args(self) -> tuple:
        """The fused kernels' per-row inputs after the logits: (temperatures, min_ps or None, top_ks and top_ps
        or None, seeds, steps, (whether some row has top_k, top_p, and a top_p row needs the search passes));
        needs `fused_ok`."""
        cut = self.need_top_k or self.need_top_p
        return (self.temperatures, self.min_ps if self.need_min_p else None, self.top_ks if cut else None,
                self.top_ps if cut else None, self.seeds, self.steps,
                CutPhases(self.need_top_k, self.need_top_p, self.need_top_p_search))

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        steps: list[int],
        vocab_size: int,
        device: torch.device | str,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        grammars: Sequence[Any] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        penalty_rows: PenaltyRowsFor | None = None,
    ) -> SamplingTensors:
        """When a row has a penalty: each row's generated tokens so far (`output_token_ids`) and, with a
        repetition penalty, its prompt (`prompt_token_ids`), or those already counted on the device
        (`penalty_rows`, called only when some row has a penalty, with whether one has a repetition penalty: counts
        [R, V], bool prompt marks [R, V] or None, and the row of each, int64 [B]; the engine's runner/penalties.py).
        `grammars`: per row, the xgrammar matcher of a request with structured outputs, else None."""
        device = torch.device(device)
        # a list a field, then numpy or C-level any/count/max: a generator over 256 rows costs ~15 us
        temps = [p.temperature for p in params]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        repeats = repetition.count(1.0) < len(repetition)
        penalized = repeats or any(presence) or any(frequency)
        sampled = max(temps, default=0.0) >= GREEDY_EPS  # some row is not greedy (SamplingParams.is_greedy)
        need_top_k = need_top_p = need_min_p = need_top_p_search = False
        sort_width = vocab_size
        if sampled:
            temp, top_k, top_p, min_p = np.array(
                [temps, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                dtype=np.float64)
            rand = temp >= GREEDY_EPS
            has_k = (top_k >= 1) & (top_k < vocab_size)
            top_ks = np.where(has_k, top_k, vocab_size)
            need_top_k = bool((rand & has_k).any())
            need_top_p = bool((rand & (top_p < 1.0)).any())
            need_top_p_search = bool((rand & (top_p < 1.0) & ~(has_k & (top_k <= KEPT_TOP_K))).any())
            need_min_p = bool((rand & (min_p > 0.0)).any())
            # a row with top_k only needs its k highest logits; a top_p row without top_k needs them all
            widths = top_ks[rand & (has_k | (top_p < 1.0))]
            sort_width = int(widths.max()) if widths.size else vocab_size

        def put(data: list, dtype: torch.dtype) -> Tensor:
            return _put(data, dtype, device)

        counts = prompt_mask = count_rows = None
        if penalized and penalty_rows is not None:
            counts, prompt_mask, count_rows = penalty_rows(repeats)
            if repeats and prompt_mask is None:
                raise ValueError("penalty_rows: a repetition penalty needs the rows' prompt marks")
        elif penalized:
            if output_token_ids is None:
                raise ValueError("output_token_ids: needed for presence/frequency/repetition penalties")
            counts = token_counts(output_token_ids, vocab_size, put)
            if repeats:
                if prompt_token_ids is None:
                    raise ValueError("prompt_token_ids: needed for repetition penalties")
                prompt_mask = token_counts(prompt_token_ids, vocab_size, put) > 0
        bitmask = None
        if grammars is not None:
            from ostinato.runner.grammar_mask import fill_bitmask

            bitmask = fill_bitmask(grammars, vocab_size).to(device, non_blocking=True)
        logprobs = [p.logprobs for p in params]
        # the per-row columns the step uses, in one copy: sampling (some row samples), penalties (some row has one)
        ints = [top_ks, _int64_seeds(seeds), steps] if sampled else []
        floats = ([temp, top_p, min_p] if sampled else []) + ([presence, frequency, repetition] if penalized else [])
        cols = _put_columns(ints, floats, device) if floats else []
        top_ks_t, seeds_t, steps_t, temps_t, top_ps_t, min_ps_t = cols[:6] if sampled else [None] * 6
        presence_t, frequency_t, repetition_t = cols[-3:] if penalized else [None] * 3
        return cls(
            temperatures=temps_t,
            top_ks=top_ks_t,
            top_ps=top_ps_t,
            min_ps=min_ps_t,
            seeds=seeds_t,
            steps=steps_t,
            all_greedy=not sampled,
            need_top_k=need_top_k,
            need_top_p=need_top_p,
            need_min_p=need_min_p,
            sort_width=sort_width,
            presence_penalties=presence_t,
            frequency_penalties=frequency_t,
            output_counts=counts,
            count_rows=count_rows,
            repetition_penalties=repetition_t if repeats else None,
            prompt_mask=prompt_mask,
            num_logprobs=logprobs if logprobs.count(None) < len(logprobs) else None,
            logit_bias=bias_entries(params, put),
            token_bitmask=bitmask,
            need_top_p_search=need_top_p_search,
        )

    def with_steps(self, steps: list[int]) -> SamplingTensors:
        """These inputs for another step of the same rows: only the index of the token being sampled changes."""
        return dataclasses.replace(self, steps=_put(steps, torch.int64, self.steps.device))


_NP = {torch.int64: np.int64, torch.float32: np.float32}


def _put(data: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on `device` (numpy builds it 3x faster than torch.tensor). To CUDA through pinned
    memory, as ModelRunner._to_device (a copy from pageable memory waits for the stream's queued work). Measured
    level with a pageable copy at T=0.6, bs 1 and 32 (`bench_generate.py --host-copies pinned pageable`): the host
    had 0.2-0.6 ms of slack a step there anyway."""
    host = torch.from_numpy(np.array(data, dtype=_NP[dtype]))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _int64_seeds(seeds: list[int]) -> np.ndarray:
    """Any Python ints as their two's-complement int64 (only the low 64 bits matter to the hash)."""
    try:
        return np.array(seeds, dtype=np.int64)
    except OverflowError:
        return np.array([(s - _MIN_SEED) % _SPAN_SEED + _MIN_SEED for s in seeds], dtype=np.int64)


def _put_columns(ints: list, floats: list, device: torch.device) -> list[Tensor]:
    """Columns of one length B (lists or arrays) as device tensors [B], int64 `ints` then float32 `floats`, in that
    order, through one pinned host buffer and one copy (a sampled step's inputs were six of each: with the numpy
    passes, 256 rows at T=0.6 took 306-344 us of an H200 host's time, now 192-198; bench_sampling_inputs.py). Each
    column starts 16-byte aligned: Triton specializes kernels on pointer alignment, and a column whose alignment
    changed with B would compile another variant mid-serving."""
    b = len((ints or floats)[0])
    width = -(-b // 4) * 4  # 4 float32s or 2 int64s to 16 bytes
    split = 8 * width * len(ints)
    host = torch.empty(split + 4 * width * len(floats), dtype=torch.uint8, pin_memory=device.type == "cuda")
    block = host.numpy()
    int_rows = block[:split].view(np.int64).reshape(len(ints), width)
    float_rows = block[split:].view(np.float32).reshape(len(floats), width)
    for rows, cols in ((int_rows, ints), (float_rows, floats)):
        for row, col in zip(rows, cols, strict=True):
            row[:b] = col
    dev = host.to(device, non_blocking=True)
    int_cols = dev[:split].view(torch.int64).view(len(ints), width)[:, :b]
    float_cols = dev[split:].view(torch.float32).view(len(floats), width)[:, :b]
    return list(int_cols.unbind()) + list(float_cols.unbind())


def bias_entries(params: list[SamplingParams], put) -> tuple[Tensor, Tensor, Tensor] | None:
    """The batch's logit_bias as three flat tensors (row, token id, bias), or None when no row has one."""
    per_row = [p.logit_bias for p in params]
    if not any(per_row):  # (a pass in C: a generator over 256 rows costs ~15 us a step)
        return None
    entries = [(row, token, bias) for row, b in enumerate(per_row) if b for token, bias in b.items()]
    rows, tokens, biases = zip(*entries, strict=True)
    return put(list(rows), torch.int64), put(list(tokens), torch.int64), put(list(biases), torch.float32)


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, put=None) -> Tensor:
    """float32 [B, V]: how often each token id occurs in each row, by one scatter_add on the device.

    Rows are right-padded with the id `vocab_size`, which lands in an extra column that is dropped.
    """
    width = max((len(row) for row in token_ids), default=0)
    padded = [list(row) + [vocab_size] * (width - len(row)) for row in token_ids] if width else []
    ids = put(padded, torch.int64) if put is not None else torch.tensor(padded, dtype=torch.int64)
    ids = ids.reshape(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def adjust_logits(logits: Tensor, t: SamplingTensors) -> Tensor:
    """The logits sampled from, in fp32: the penalties (`sampling_ops.penalize`: repetition over the prompt and the
    output, then presence and frequency over the output), then the logit_bias entries added, then the structured
    outputs' masks. `logits` itself is never written (it can be a graph's output buffer): with none of these, it
    is returned as is."""
    x = logits
    if t.output_counts is not None:
        x = penalize(logits, t.output_counts, t.count_rows, t.frequency_penalties, t.presence_penalties,
                     t.repetition_penalties, t.prompt_mask)
    elif t.logit_bias is not None or t.token_bitmask is not None:
        x = logits.float().clone()
    if t.logit_bias is not None:
        rows, tokens, biases = t.logit_bias
        x.index_put_((rows, tokens), biases, accumulate=True)
    if t.token_bitmask is not None:
        from ostinato.runner.grammar_mask import apply_bitmask

        apply_bitmask(x, t.token_bitmask)
    return x


# per sampled token: (its logprob, its rank in the vocabulary (1 = most likely), top-k ids, top-k logprobs)
TokenLogprobs = tuple[float, int, list[int], list[float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # per row; None when no row asked for logprobs
    # per row, the logprobs of the prompt tokens its new positions predicted (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[list[TokenLogprobs]] | None = None


def compute_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """log_softmax of `logits` [B, V]: the logprob of `token_ids` [B], its rank (1-based; ties rank
    first), and the `k` highest logprobs with their ids ([B, k] each)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    if k == 0:
        return chosen[:, 0], ranks, token_ids.new_zeros(lp.shape[0], 0), lp.new_zeros(lp.shape[0], 0)
    top = lp.topk(k, dim=-1)
    return chosen[:, 0], ranks, top.indices, top.values


def warm_up_logprobs(vocab_size: int, device: torch.device) -> None:
    """Launch `compute_logprobs`' ops once at a few batch sizes and k (torch picks a top-k kernel by size), so that
    the first request asking for logprobs does not load them mid-serving (CUDA loads a kernel at its first launch:
    that step took 157 ms against 1.2, Llama-3.2-1B bs 32, H200)."""
    for b in (1, 8, 64):
        logits = torch.randn(b, vocab_size, device=device)
        for k in (0, 1, 5, 20):
            compute_logprobs(logits, torch.zeros(b, dtype=torch.int64, device=device), k)


@dataclass
class SampledTensors:
    """A step's sampled ids (and logprob tensors) on their way to the host. `copy_to_host` queues the copies
    into pinned memory behind the step's kernels and returns at once; `result` waits for them. In between,
    the engine schedules and launches the next step while the GPU works (overlap scheduling)."""

    ids: Tensor  # int64 [B]
    logprobs: tuple[Tensor, Tensor, Tensor, Tensor] | None  # chosen, ranks, top ids, top logprobs
    num_logprobs: list[int | None] | None
    # some row has structured outputs: the next step's mask needs this one's tokens on the host, so the engine
    # reads it back at once (penalties count on the device: runner.penalties)
    constrained: bool
    done: torch.cuda.Event | None = None  # recorded after the copies (CUDA only)
    # prompt logprobs (chosen, ranks, top ids, top logprobs) over the step's prompt-logprob positions, in batch
    # order; prompt_lp_counts[i]: how many are row i's
    prompt_logprobs: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    prompt_lp_counts: list[int] | None = None

    def copy_to_host(self, stream: torch.cuda.Stream | None = None) -> SampledTensors:
        """Copies, not views: `ids` can be a graph's static argmax, which the next replay overwrites.

        With `stream` (CUDA), the copies run there, after everything the current stream has queued so far, so that
        the current stream's next work (the next step's input copies) need not queue behind them. The caller then
        makes the current stream wait for `done` before it overwrites what was copied (the next forward)."""
        if self.ids.device.type != "cuda":
            self._map(Tensor.clone)
            return self
        main = torch.cuda.current_stream(self.ids.device)
        side = stream or main
        side.wait_stream(main)

        def host(t: Tensor) -> Tensor:
            t.record_stream(side)  # a temporary's memory is not handed out again before the copy has read it
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        with torch.cuda.stream(side):
            self._map(host)
            self.done = torch.cuda.Event()
            self.done.record(side)
        return self

    def _map(self, fn: Callable[[Tensor], Tensor]) -> None:
        """`fn` over every tensor bound for the host."""
        self.ids = fn(self.ids)
        if self.logprobs is not None:
            self.logprobs = tuple(fn(t) for t in self.logprobs)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = tuple(fn(t) for t in self.prompt_logprobs)

    def result(self) -> SamplerOutput:
        if self.done is not None:
            self.done.synchronize()
        prompt = self._prompt_result()
        if self.logprobs is None:
            return SamplerOutput(self.ids.tolist(), prompt_logprobs=prompt)
        ids_l = self.ids.tolist()
        chosen_l, ranks_l, top_ids_l, top_lps_l = (t.tolist() for t in self.logprobs)
        logprobs: list[TokenLogprobs | None] = [
            None if n is None else (chosen_l[i], ranks_l[i], top_ids_l[i][:n], top_lps_l[i][:n])
            for i, n in enumerate(self.num_logprobs)
        ]
        return SamplerOutput(ids_l, logprobs, prompt)

    def _prompt_result(self) -> list[list[TokenLogprobs]] | None:
        if self.prompt_logprobs is None:
            return None
        entries = list(zip(*(t.tolist() for t in self.prompt_logprobs), strict=True))
        out, start = [], 0
        for n in self.prompt_lp_counts:
            out.append(entries[start : start + n])
            start += n
        return out


def sample_tensors(logits: Tensor, t: SamplingTensors, argmax: Tensor | None = None,
                   drawn: Tensor | None = None) -> SampledTensors:
    """`adjust_logits`, `sample`, then the requested logprobs, all on the device (no sync).
    `argmax`: the logits' argmax when already computed (a decode graph computes it); unused when the logits
    were adjusted. `drawn`: the ids when already sampled (a sampler graph draws them; no adjusted logits)."""
    if drawn is not None:  # a sampler graph drew them, from its own penalized logits where the step has penalties
        assert t.graph_drawable, "a drawn step has no bias or grammar, nor logprobs of penalized logits"
        x = logits
    else:
        x = adjust_logits(logits, t)
    ids = drawn if drawn is not None else sample(x, t, argmax if x is logits else None)
    constrained = t.token_bitmask is not None
    if t.num_logprobs is None:
        return SampledTensors(ids, None, None, constrained)
    k = max(n for n in t.num_logprobs if n is not None)
    return SampledTensors(ids, compute_logprobs(x, ids, k), t.num_logprobs, constrained)


def sample_batch(logits: Tensor, t: SamplingTensors, argmax: Tensor | None = None) -> SamplerOutput:
    """`sample_tensors`, waited for: the token ids and logprobs as Python lists."""
    return sample_tensors(logits, t, argmax).copy_to_host().result()


def sample(logits: Tensor, t: SamplingTensors, argmax: Tensor | None = None) -> Tensor:
    """Token ids, int64 [B], from logits [B, V]: `sample_torch`'s draw. On CUDA a step with sampled rows runs
    as a few fused kernels that draw the same tokens (tests/test_fused_sample.py
    checks the two agree, on the CPU through Triton's interpreter)."""
    if t.fused_ok and logits.is_cuda:
        return sample_fused(logits, t)
    return sample_torch(logits, t, argmax)


def sample_fused(logits: Tensor, t: SamplingTensors) -> Tensor:
    """`sample` through the fused Triton kernels; needs `t.fused_ok`."""
    x = logits if logits.dtype == torch.float32 and logits.stride(-1) == 1 else logits.float().contiguous()
    return fused_draw(x, *t.fused_args())


def fused_draw(logits: Tensor, temperatures: Tensor, min_ps: Tensor | None, top_ks: Tensor | None,
               top_ps: Tensor | None, seeds: Tensor, steps: Tensor, cut_phases: tuple[bool, ...],
               out: Tensor | None = None, scatter: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`fused_sample.fused_sample` with all of `logits`' columns as the vocabulary (float32, last dim contiguous);
    the other arguments as `SamplingTensors.fused_args` gives them (`out`, `scatter`: fused_sample's)."""
    from ostinato.runner.fused_sample import fused_sample

    return fused_sample(logits, temperatures, min_ps, top_ks, top_ps, seeds, steps, logits.shape[-1], GREEDY_EPS,
                        cut_phases=cut_phases, out=out, scatter=scatter)


TOP_P_HEAD = 256  # off CUDA, a top_p row's cut is looked for among its 256 highest logits first (then x8)


def _sorted_head(x: Tensor, t: SamplingTensors, lse: Tensor | None) -> Tensor:
    """Each row's highest values of x, descending, as many as every row's cut needs (`lse`: each row's logsumexp,
    given with top_p). Some row with top_p and no top_k needs the whole row sorted in the worst case; off CUDA the
    first 256, 2,048, ... are tried first, taken once they hold top_p of the mass of every such row (a full sort of
    32 rows of 49k logits takes ~50 ms on a CPU, their top 256 ~2 ms). A top_k row needs its k highest
    (t.sort_width covers them)."""
    v, w = x.shape[-1], t.sort_width
    if w < v or x.is_cuda:
        return x.topk(w, dim=-1).values if w < v else x.sort(dim=-1, descending=True).values
    # sampled rows with top_p and no top_k: their mass, summed as the caller sums it, must reach top_p
    needs_all = (t.top_ks >= v) & (t.top_ps < 1.0) & (t.temperatures >= GREEDY_EPS)
    probe = max(TOP_P_HEAD, _max_top_k(t, v))
    while probe < v:
        s = x.topk(probe, dim=-1).values
        if not bool((needs_all & ((s - lse).exp().cumsum(dim=-1)[:, -1] < t.top_ps)).any()):
            return s
        probe *= 8
    return x.sort(dim=-1, descending=True).values


def _max_top_k(t: SamplingTensors, vocab_size: int) -> int:
    """The largest top_k of the rows that have one (0: none)."""
    if not t.need_top_k:
        return 0
    ks = t.top_ks[t.top_ks < vocab_size]
    return int(ks.max()) if ks.numel() else 0


def sample_torch(logits: Tensor, t: SamplingTensors, argmax: Tensor | None = None) -> Tensor:
    """Token ids, int64 [B], from logits [B, V] (any float dtype; computed in fp32).

    Greedy rows take the argmax. Other rows: logits / temperature, then keep the tokens allowed by min_p
    (p >= min_p * p_max) and top_k, then top_p on that set's renormalized distribution (the smallest
    run of the highest-probability tokens reaching top_p; the top token always stays), and sample from
    the renormalized rest. min_p and top_k don't depend on renormalization; top_p is applied last, as in
    vLLM. top_k and top_p become a per-row logit threshold, so tokens tied with the last kept one stay.
    """
    greedy = chunked_argmax(logits) if argmax is None else argmax
    if t.all_greedy:
        return greedy
    is_greedy = t.temperatures < GREEDY_EPS
    x = logits.float() / torch.where(is_greedy, 1.0, t.temperatures)[:, None]
    if t.need_min_p:
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p); min_p = 0 gives -inf and removes nothing
        x = x.masked_fill(x - x.amax(dim=-1, keepdim=True) < t.min_ps.log()[:, None], float("-inf"))
    if t.need_top_k or t.need_top_p:
        v = x.shape[-1]
        # the mass top_p measures: over the row, or for a top_k row over its k highest (all in s)
        lse = x.logsumexp(dim=-1, keepdim=True) if t.need_top_p else None
        s = _sorted_head(x, t, lse)
        w = s.shape[-1]
        cut = torch.full_like(s[:, :1], float("-inf"))
        if t.need_top_k:
            kth = s.gather(1, t.top_ks.clamp(max=w)[:, None] - 1)
            cut = torch.where(t.top_ks[:, None] < v, kth, cut)
            s = s.masked_fill(s < cut, float("-inf"))
        if t.need_top_p:
            if t.need_top_k:  # a top_k row's mass is over what its k keep
                lse = torch.where(t.top_ks[:, None] < v, s.logsumexp(dim=-1, keepdim=True), lse)
            cums = (s - lse).exp().cumsum(dim=-1)
            # keep token i while the tokens before it sum to < top_p: up to the first reaching it
            last = torch.searchsorted(cums, t.top_ps[:, None]).clamp(max=w - 1)
            # rows with top_p == 1 keep all (an fp32 cumsum can reach 1.0 before the tail)
            cut_p = torch.where(t.top_ps[:, None] < 1.0, s.gather(1, last), float("-inf"))
            cut = torch.maximum(cut, cut_p)
        x = x.masked_fill(x < cut, float("-inf"))
    sampled = gumbel_argmax(x, t.seeds, t.steps)  # a sample of softmax(x)
    return torch.where(is_greedy, greedy, sampled)
