"""Decode steps captured once per batch size and replayed (seed 002).

Static buffers are allocated once at the largest size; each captured size reads the first `bs` rows.
A batch is padded up to the nearest captured size: padded rows decode a dummy token of the request
table's sink row (seq_len fill value 1), which reads one cached key and writes its K/V to slot 0, the
pool's reserved sink, so real rows and real KV are never touched. Sizes are captured largest first, so
smaller graphs reuse the memory of larger ones in the process-wide pool.

The step is the whole decode step on the device, the bookkeeping included: it records each row's new
KV slot in req_to_token and resolves pending inputs (NextTokenBuffer.begin_decode_, one kernel), and its
last kernels pick each row's token and store it in the next-token buffer: the argmax, or for a row given a
temperature (`load_draw`) the sampler's plain Gumbel-max draw. A greedy or temperature-only step then needs
no stream operation outside the graph but the input copies and the tokens' copy to the host; min_p, top_k,
top_p and penalties are drawn after it by a sampler graph (graphs/sample.py), over this graph's argmax.
"""

import bisect
import logging
import time

import numpy as np
import torch

from ostinato.attention.forward_batch import ForwardBatch, ForwardMode
from ostinato.attention.op import forward_context
from ostinato.graphs.compile import recompile_limit_for
from ostinato.graphs.graph import Graph, capture_graphs
from ostinato.graphs.protocol import GraphHost
from ostinato.layers.sampling_ops import chunked_draw, padded_vocab
from ostinato.sampling_params import GREEDY_EPS

logger = logging.getLogger(__name__)

SEQ_LEN_FILL_VALUE = 1  # what padded rows' seq_lens hold: one key to read, never an empty softmax
PAD_SLOT = 0  # the reserved sink slot padded rows write their K/V to


def default_cuda_graph_max_bs(gpu_memory_bytes: int | None) -> int:
    """Larger GPUs run larger decode batches, so capture up to a larger size (SGLang's rule of thumb)."""
    if gpu_memory_bytes is None:
        return 8
    gib = gpu_memory_bytes / 2**30
    return 8 if gib < 20 else 80 if gib < 35 else 160 if gib < 60 else 256


def capture_batch_sizes(cuda_graph_bs: list[int] | None, cuda_graph_max_bs: int,
                        max_running_requests: int) -> list[int]:
    """Ascending sizes to capture: given explicitly, or 1, 2, 4, 8 then every 8 (every 16 past 160)."""
    if cuda_graph_bs:
        sizes = set(cuda_graph_bs)
    else:
        sizes = {1, 2, 4} | set(range(8, min(cuda_graph_max_bs, 160) + 1, 8))
        sizes |= set(range(176, cuda_graph_max_bs + 1, 16))
        sizes = {s for s in sizes if s <= cuda_graph_max_bs} | {cuda_graph_max_bs}
    sizes = sorted(s for s in sizes if s <= max_running_requests)
    return sizes or [min(max_running_requests, cuda_graph_max_bs)]


class DecodeGraphRunner:
    def __init__(self, runner: GraphHost) -> None:
        self.runner = runner
        args = runner.args
        self.device = runner.device
        self.disable_padding = args.disable_cuda_graph_padding
        gpu_mem = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        max_bs = args.cuda_graph_max_bs or default_cuda_graph_max_bs(gpu_mem)
        self.batch_sizes = capture_batch_sizes(args.cuda_graph_bs, max_bs, runner.max_running_requests)
        self.max_bs = self.batch_sizes[-1]
        self.compile_max_bs = args.torch_compile_max_bs if args.enable_torch_compile else 0

        # Static inputs, written in place before every replay; rows [bs:padded_bs] hold the padding values.
        # input_ids may hold PENDING_TOKEN: the graph resolves them from the runner's NextTokenBuffer.
        # One int64 block so one copy fills the per-request vectors (`load_inputs`); its last row, the index of
        # each row's sampled output token, is read by the sampler graphs, not by this one.
        n, dev = self.max_bs, self.device
        self.ints = torch.zeros(5, n, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.req_pool_indices, self.seq_lens, self.sample_steps = self.ints
        self.pad_column = torch.tensor([0, 0, runner.req_to_token_pool.sink_row, SEQ_LEN_FILL_VALUE, 0],
                                       dtype=torch.int64, device=dev)[:, None]
        self.ints[:] = self.pad_column
        self._pad_host = self.pad_column.cpu().numpy()
        self.out_cache_loc = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        # hybrid models: each row's Mamba state slot; padded rows use the pool's sink slot
        self.mamba_slots = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=dev) if runner.mamba_pool else None
        # What the step's draw reads: each row's temperature (below GREEDY_EPS: the argmax; padded rows 0) and
        # seed, loaded by `load_draw` when the batch's sampling inputs change; the step index is sample_steps.
        self.temperatures = torch.zeros(n, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=dev)
        self._draw_loaded: torch.Tensor | None = None  # the temperatures tensor now in the buffer (None: all 0)
        # Static outputs, written by every replay: float32 logits in a vocabulary padded to whole argmax
        # chunks (the padding columns stay -inf), and each row's token (the argmax, or the draw where loaded).
        self.vocab_size = runner.vocab_size
        self.logits = torch.full((n, padded_vocab(runner.vocab_size)), float("-inf"), dtype=torch.float32,
                                 device=dev)
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        runner.backend.init_cuda_graph_state(self.max_bs)

        self.graphs: dict[int, Graph] = {}
        self.capture_seconds = 0.0
        self.compile_seconds = 0.0
        self.graph_memory_bytes = 0
        self.capture()

    # ------------------------------------------------------------------ capture
    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], logits_indices=self.logits_indices[:bs], seq_lens_cpu=[],
            mamba_slots=None if self.mamba_slots is None else self.mamba_slots[:bs],
        )

    def _step_fn(self, bs: int):
        model = self.runner.model
        forward = self.runner.compiled_forward if bs <= self.compile_max_bs else model.forward
        batch = self._batch(bs)
        backend = self.runner.backend
        layers = model.attention_specs
        next_tokens = self.runner.next_tokens
        table = self.runner.req_to_token_pool.req_to_token

        megakernel = self.runner.decode_megakernel if bs == 1 else None

        def step() -> None:
            next_tokens.begin_decode_(batch.input_ids, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                                      table)
            backend.begin_graph_step()
            if megakernel is not None:  # every layer in one launch
                x = megakernel(model.embed_tokens(batch.input_ids), batch.positions, batch.seq_lens,
                               batch.req_pool_indices, batch.out_cache_loc, table)
                hidden = model.norm(x)
            else:
                with forward_context(backend, batch, layers):
                    hidden = forward(batch.input_ids, batch.positions)
            model.compute_logits(hidden, out=self.logits[:bs, : self.vocab_size])
            # the tokens stored here; ModelRunner.sample stores over them where a sampler graph draws others
            chunked_draw(self.logits[:bs], self.temperatures[:bs], self.seeds[:bs], self.sample_steps[:bs],
                         GREEDY_EPS, out=self.token_ids[:bs], scatter=(next_tokens.tokens, batch.req_pool_indices))

        return step

    @torch.inference_mode()
    def capture(self) -> None:
        compiled = [bs for bs in self.batch_sizes if bs <= self.compile_max_bs]

        def make_step(bs: int):
            self._fill_padding(0, bs)
            self.runner.backend.init_forward_metadata_capture(bs, self.req_pool_indices[:bs], self.seq_lens[:bs])
            step = self._step_fn(bs)
            if bs in compiled:  # compile now, outside the capture stream, and time it
                start = time.perf_counter()
                step()
                self.compile_seconds += time.perf_counter() - start
            return step

        with recompile_limit_for(len(compiled)):
            self.graphs, self.capture_seconds, self.graph_memory_bytes = capture_graphs(
                self.device, list(reversed(self.batch_sizes)), make_step, "Capturing decode graphs",
                keep_gc=self.runner.args.enable_cudagraph_gc)
        if compiled:
            logger.info("torch.compile of the decode step for %d batch sizes (%s) took %.1f s", len(compiled),
                        compiled, self.compile_seconds)
        logger.info("captured decode graphs for batch sizes %s in %.1f s (compile included), graph memory %.2f GiB",
                    self.batch_sizes, self.capture_seconds, self.graph_memory_bytes / 2**30)

    # ------------------------------------------------------------------ replay
    def can_run(self, batch: ForwardBatch) -> bool:
        if batch.mode is not ForwardMode.DECODE or batch.batch_size > self.max_bs:
            return False
        return not self.disable_padding or batch.batch_size in self.graphs

    def load_inputs(self, rows: list[list[int]]) -> torch.Tensor | None:
        """A decode batch's [input_ids, positions, req_pool_indices, seq_lens, sample_steps] rows written straight
        into the static block, the padding columns' values included, in one host-to-device copy (no copy inside
        `replay`); returns the block's [5, bs] view, or None where no graph takes the batch. Queued on the current
        stream, after whatever replay (of this graph or a sampler graph) still reads the block."""
        bs = len(rows[0])
        if bs > self.max_bs or (self.disable_padding and bs not in self.graphs):
            return None
        host = np.empty((5, self.max_bs), dtype=np.int64)
        host[:, bs:] = self._pad_host
        host[:, :bs] = rows
        block = torch.from_numpy(host)
        if self.device.type == "cuda":
            block = block.pin_memory()
        self.ints.copy_(block, non_blocking=True)
        return self.ints[:, :bs]

    def load_draw(self, temperatures: torch.Tensor | None, seeds: torch.Tensor | None) -> None:
        """What the next replays draw with: each row's temperature and seed ([bs] each, on the device; rows past bs
        are set greedy), or None: every row greedy. Loaded only when `temperatures` is another object than the
        one loaded last (a runner's sampling inputs keep theirs while the batch keeps its requests). Draws also
        read each row's step index, which `load_inputs` writes every step: a drawing replay needs it."""
        if temperatures is self._draw_loaded:
            return
        self.temperatures.zero_()
        if temperatures is not None:
            bs = temperatures.shape[0]
            self.temperatures[:bs] = temperatures
            self.seeds[:bs] = seeds
        self._draw_loaded = temperatures

    def padded_size(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def _fill_padding(self, start: int, stop: int) -> None:
        if stop > start:
            self.ints[:, start:stop] = self.pad_column
            self._fill_slot_padding(start, stop)

    def _fill_slot_padding(self, start: int, stop: int) -> None:
        if stop > start:
            self.out_cache_loc[start:stop].fill_(PAD_SLOT)
            if self.mamba_slots is not None:
                self.mamba_slots[start:stop].fill_(PAD_SLOT)  # the MambaPool's sink slot is 0 too

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] for a decode batch, a view of the static output (valid until the next replay);
        `self.token_ids[:bs]` then holds each row's token: the argmax, or the draw where `load_draw` gave the row a
        temperature."""
        bs = batch.batch_size
        padded = self.padded_size(bs)
        assert batch.decode_ints is not None, "decode batches come from ModelRunner.prepare"
        loaded = batch.decode_ints.data_ptr() == self.ints.data_ptr()  # by load_inputs, padding included
        if not loaded:
            assert self._draw_loaded is None, "a drawing replay reads its step indices from load_inputs' block"
            self.ints[:4, :bs] = batch.decode_ints
        self.out_cache_loc[:bs] = batch.out_cache_loc
        if self.mamba_slots is not None:
            self.mamba_slots[:bs] = batch.mamba_slots
        (self._fill_slot_padding if loaded else self._fill_padding)(bs, padded)
        self.runner.backend.init_forward_metadata_replay(padded, self.req_pool_indices[:padded],
                                                         self.seq_lens[:padded])
        self.graphs[padded].replay()
        return self.logits[:bs, : self.vocab_size]
