"""A decode step's sampling kernels, captured per (padded batch size, filters in use) and replayed.

Eagerly, the fused sampler is a Python launch per kernel: 3 at temperature alone, 12 with top_k, 21 with top_k
and top_p, which at small batches cost more host time than GPU time (H200, bs 1, top_k 200: 0.7 ms launched one by
one, 0.037 ms replayed; `benchmarks/bench_fused_sample.py`). Replayed, a step's sampling is one graph launch and a
copy of the step indices. The graphs read the decode graph's static logits, so they only follow a decode-graph
replay. Each is captured the first time its key is met, after two warm-up runs that compile its kernels (on the
current stream: `graph.warm_up_stream`).

With a penalty state (the engine's runner/penalties.PenaltyState), a step whose rows have presence, frequency or
repetition penalties replays too (and nothing else adjusts its logits): the graph penalizes the logits by request
row, draws from them, and adds the drawn ids to the state's counts, where eagerly those were about ten launches
(H200, Llama-3.2-1B bs 32: 177 us a step of GPU idle behind the host, under the profiler). Its warm-up runs count
into the state's sink row, so capturing a graph counts nothing twice.
"""

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ostinato.graphs.graph import Graph, warmed_capture
from ostinato.layers.sampling_ops import CutPhases, penalize

# (logits [B, V], temperatures, min_ps | None, top_ks | None, top_ps | None, seeds, steps, (has top_k, has top_p),
# out=int64 [B], scatter=(dest, index) | None) -> the token ids, written into `out` (and with `scatter`, also
# dest[index[b]] = row b's id); fixed grids and no host sync, so it can be captured
SampleFn = Callable[..., Tensor]


class SampleKey(NamedTuple):
    batch_size: int  # the decode graph's padded size
    min_p: bool
    top_k: bool
    top_p: bool
    penalties: bool = False  # presence / frequency penalties applied (and the draws counted)
    repetition: bool = False  # a repetition penalty too
    top_p_kept: bool = False  # every top_p row's cut from the keys its top_k keeps: no top_p search passes


class PenaltyRows(NamedTuple):
    """A batch's penalties ([bs] each; repetition None: no row has one), loaded with its other per-row inputs."""
    frequency: Tensor
    presence: Tensor
    repetition: Tensor | None


class PenaltyTables(Protocol):
    """The state the graphs read and grow (runner/penalties.PenaltyState): [slots + 1, V] tables by request row, the
    last the sink row."""
    counts: Tensor | None
    in_prompt: Tensor | None

    def count_(self, slots: Tensor, token_ids: Tensor) -> None: ...


class SampleGraphRunner:
    def __init__(self, logits: Tensor, vocab_size: int, sample_fn: SampleFn,
                 store: tuple[Tensor, Tensor] | None = None, steps: Tensor | None = None,
                 penalties: PenaltyTables | None = None) -> None:
        """`logits`: the decode graph's static output [max_bs, >= vocab_size], float32, which every replay of
        this runner reads (rows past a batch's own hold the padded rows' logits: finite, and drawn greedily).
        `store`: (tokens, rows), the next-token buffer and the decode graph's static request rows [max_bs] (a
        padded row's: the buffer's sink); each replay also stores row i's drawn id at tokens[rows[i]], as the
        decode graph's argmax stores greedy ones. `steps`: a static [max_bs] buffer to read the step indices from
        (the decode graphs' block, which its copy fills with the inputs: `replay` is then given views of it and
        copies nothing), else one of the runner's own. `penalties` (with `store`): the penalty state that penalized
        steps read by request row (store's rows) and count their draws into."""
        self.device = logits.device
        self.store = store
        self.logits = logits[:, :vocab_size]
        self.sample_fn = sample_fn
        n = logits.shape[0]
        # Static inputs. Rows [bs:padded] hold a greedy row's values (temperature 0, no filter), so the padded
        # rows draw without noise or cuts; rows [0:bs] hold the batch's, loaded when its tensors change.
        # Padded rows are unpenalized (frequency, presence 0, repetition 1) and count into the sink row.
        self.floats = torch.zeros(6, n, dtype=torch.float32, device=self.device)
        self.temperatures, self.min_ps, self.top_ps, self.frequency, self.presence, self.repetition = self.floats
        self.ints = torch.zeros(3, n, dtype=torch.int64, device=self.device)
        self.top_ks, self.seeds, own_steps = self.ints
        self.steps = own_steps if steps is None else steps
        self.pad_floats = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0], device=self.device)[:, None]
        self.penalty_state = penalties if store is not None else None
        # whether a penalized graph's draws count into their request rows (true between captures) or the sink row
        # (false while a graph is warmed up and captured)
        self.counting = torch.zeros((), dtype=torch.bool, device=self.device)
        self.pad_ints = torch.tensor([vocab_size, 0, 0], device=self.device)[:, None]
        self.ids = torch.zeros(n, dtype=torch.int64, device=self.device)  # static output
        self.graphs: dict[SampleKey, Graph] = {}
        self._loaded: tuple[Tensor, int] | None = None  # the temperatures tensor and padded size now in the buffers

    def replay(self, padded: int, temperatures: Tensor, min_ps: Tensor | None, top_ks: Tensor | None,
               top_ps: Tensor | None, seeds: Tensor, steps: Tensor,
               cut_phases: tuple[bool, ...] = (False, False), penalties: PenaltyRows | None = None) -> Tensor:
        """Token ids [bs] (a view of the static output, valid until the next replay) for the batch whose
        sampling tensors are given ([bs] each; min_ps None: no row has min_p; top_ks / top_ps None: no row has
        either, else both given, vocab_size / 1.0 for none, and `cut_phases` says whether some row has top_k,
        top_p, and optionally whether some top_p row needs the search passes: `SamplingTensors.fused_args`),
        after the decode graph of size `padded` ran. `penalties`: the rows' penalties (the runner's penalty state
        holds their counts, and gets this step's draws added).

        A batch's tensors other than `steps` are loaded when their `temperatures` object changes: the runner's
        sampling inputs keep those objects for as long as the batch keeps its requests."""
        bs = temperatures.shape[0]
        if penalties is not None and self.penalty_state is None:
            raise ValueError("penalized steps need a runner made with a penalty state (and a store)")
        if self._loaded is None or self._loaded[0] is not temperatures or self._loaded[1] != padded:
            self._load(padded, temperatures, min_ps, top_ks, top_ps, seeds, penalties)
            self._loaded = (temperatures, padded)
        if steps.data_ptr() != self.steps.data_ptr():  # else a view of the static buffer, filled already
            self.steps[:bs].copy_(steps)
        phases = CutPhases(*cut_phases) if top_ks is not None else CutPhases(False, False)
        kept = phases.top_p and not phases.top_p_search
        return self._replay(SampleKey(padded, min_ps is not None, phases.top_k, phases.top_p, penalties is not None,
                                      penalties is not None and penalties.repetition is not None, kept))[:bs]

    def _replay(self, key: SampleKey) -> Tensor:
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(key)
        graph.replay()
        return self.ids[: key.batch_size]

    def _load(self, padded: int, temperatures: Tensor, min_ps: Tensor | None, top_ks: Tensor | None,
              top_ps: Tensor | None, seeds: Tensor, penalties: PenaltyRows | None) -> None:
        bs = temperatures.shape[0]
        self.floats[:, bs:padded] = self.pad_floats
        self.ints[:, bs:padded] = self.pad_ints
        self.temperatures[:bs].copy_(temperatures)
        self.seeds[:bs].copy_(seeds)
        if min_ps is not None:
            self.min_ps[:bs].copy_(min_ps)
        if top_ks is not None:
            self.top_ks[:bs].copy_(top_ks)
            self.top_ps[:bs].copy_(top_ps)
        if penalties is not None:
            self.frequency[:bs].copy_(penalties.frequency)
            self.presence[:bs].copy_(penalties.presence)
            if penalties.repetition is not None:
                self.repetition[:bs].copy_(penalties.repetition)

    def _step_fn(self, key: SampleKey) -> Callable[[], None]:
        n = key.batch_size
        cut = key.top_k or key.top_p

        scatter = None if self.store is None else (self.store[0], self.store[1][:n])

        state = self.penalty_state
        if key.penalties:  # the tables exist by now (made before a penalized batch's first step) and stay put
            rows, sink = self.store[1][:n], torch.tensor(state.counts.shape[0] - 1, device=self.device)
            in_prompt = state.in_prompt if key.repetition else None

        def step() -> None:
            logits = self.logits[:n]
            if key.penalties:
                logits = penalize(logits, state.counts, rows, self.frequency[:n], self.presence[:n],
                                  self.repetition[:n] if key.repetition else None, in_prompt)
            self.sample_fn(logits, self.temperatures[:n], self.min_ps[:n] if key.min_p else None,
                           self.top_ks[:n] if cut else None, self.top_ps[:n] if cut else None,
                           self.seeds[:n], self.steps[:n], CutPhases(key.top_k, key.top_p, not key.top_p_kept),
                           out=self.ids[:n], scatter=scatter)
            if key.penalties:
                state.count_(torch.where(self.counting, rows, sink), self.ids[:n])

        return step

    def _capture(self, key: SampleKey) -> Graph:
        # mid-serving: no emptying of the allocator's caches and no collection (free_memory=False), and the warm-up
        # on the current stream (graph.warm_up_stream). The warm-up runs (and, on the CPU, the stand-in's one run)
        # count into the sink row; replays count into the request rows.
        self.counting.fill_(False)
        graph = warmed_capture(self.device, self._step_fn(key), free_memory=False, mid_serving=True)
        self.counting.fill_(True)
        return graph
