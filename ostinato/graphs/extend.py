"""Small extend (prefill) steps captured once per token count and replayed.

Eagerly, an extend step launches ~200 kernels whose host cost (~7 ms for Llama-1B) dwarfs the GPU work of
a short prompt (~1.5 ms for 128 tokens), so TTFT and the steps that admit new requests while others
decode are bound by launches. A captured step replays them all in one go.

Captured sizes are token counts (16 to 256 by powers of two, then every 256 up to
`extend_cuda_graph_max_tokens`); a batch of T tokens
from at most `max_reqs` requests is padded up to the next size. Padded tokens (id 0, position 0) write
their K/V to slot 0, the pool's reserved sink, and belong to no request; padded requests have no new
tokens. The attention kernel runs a fixed grid sized for the captured token count over a block table
whose unused entries exit at once, so no launch depends on the batch's shape.

Hybrid (Mamba) models: the mixer reads the step's layout from tables at fixed addresses (layers/mamba_tables.py),
refilled before every capture and replay, where the padded tokens are one more request, on the sink Mamba slot.
Their steps hold at most `mamba_tables.GRAPH_MAX_REQS` requests.
"""

import bisect
import logging

import torch

from ostinato.attention.forward_batch import ForwardBatch, ForwardMode
from ostinato.attention.op import forward_context
from ostinato.graphs.decode import PAD_SLOT, SEQ_LEN_FILL_VALUE
from ostinato.graphs.graph import Graph, capture_graphs
from ostinato.graphs.protocol import GraphHost
from ostinato.layers.mamba2 import SSD_CHUNK
from ostinato.layers.mamba_tables import GRAPH_MAX_REQS, MambaStepTables
from ostinato.mem.mamba_pool import SINK_SLOT

logger = logging.getLogger(__name__)

MAX_REQS = 64  # most requests in one captured extend (bigger batches are rarely launch-bound)


def extend_token_sizes(max_tokens: int) -> list[int]:
    """Ascending token counts to capture: powers of two from 16 to 256, then every 256 (padding stays under
    256 tokens where a step's GPU work starts to outweigh its launches), and `max_tokens` itself."""
    sizes = {n for n in (16, 32, 64, 128) if n < max_tokens} | set(range(256, max_tokens, 256)) | {max_tokens}
    return sorted(sizes)


class ExtendGraphRunner:
    def __init__(self, runner: GraphHost, max_tokens: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.token_sizes = extend_token_sizes(max_tokens)
        self.max_tokens = self.token_sizes[-1]
        self.max_reqs = min(runner.max_running_requests, MAX_REQS, self.max_tokens)
        self.mamba_tables: MambaStepTables | None = None
        if runner.mamba_pool is not None:
            self.max_reqs = min(self.max_reqs, GRAPH_MAX_REQS)
            self.mamba_tables = MambaStepTables(self.max_tokens, self.max_reqs + 1, SSD_CHUNK, self.device)

        # Static inputs, written before every replay; columns past the batch hold the padding values.
        n, r, dev = self.max_tokens, self.max_reqs, self.device
        self.tokens = torch.zeros(3, n, dtype=torch.int64, device=dev)  # input ids, positions, KV slots
        self.input_ids, self.positions, self.out_cache_loc = self.tokens
        self.token_pad = torch.tensor([0, 0, PAD_SLOT], dtype=torch.int64, device=dev)[:, None]
        self.reqs = torch.zeros(3, r, dtype=torch.int64, device=dev)  # request rows, seq lens, logits rows
        self.req_pool_indices, self.seq_lens, self.logits_indices = self.reqs
        self.req_pad = torch.tensor([0, SEQ_LEN_FILL_VALUE, 0], dtype=torch.int64, device=dev)[:, None]
        self.vocab_size = runner.vocab_size
        self.logits = torch.zeros(r, runner.vocab_size, dtype=torch.float32, device=dev)  # static output
        runner.backend.init_extend_graph_state(self.max_reqs, self.max_tokens)

        self.graphs: dict[int, Graph] = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.capture()

    def _batch(self, num_tokens: int, prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=self.max_reqs, input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens], req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens, out_cache_loc=self.out_cache_loc[:num_tokens],
            logits_indices=self.logits_indices, seq_lens_cpu=[], extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens, mamba_tables=self.mamba_tables,
            mamba_slots=None if self.mamba_tables is None else self.mamba_tables.slots,
        )

    def _fill_mamba_tables(self, extend_lens: list[int], slots: torch.Tensor, num_tokens: int) -> None:
        if self.mamba_tables is not None:  # before the step's kernels run, outside any capture
            self.mamba_tables.fill(extend_lens, slots, num_tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        model, backend = self.runner.model, self.runner.backend

        def make_step(num_tokens: int):
            # captured over one request holding every token; replays run any batch through the same grid
            self.tokens[:, :num_tokens] = self.token_pad
            self.reqs[:] = self.req_pad
            batch = self._batch(num_tokens, [0], [num_tokens])
            backend.init_forward_metadata_extend_graph(batch, num_tokens)
            self._fill_mamba_tables([num_tokens], torch.full((1,), SINK_SLOT, device=self.device), num_tokens)

            def step() -> None:
                with forward_context(backend, batch, model.attention_specs):
                    hidden = model(batch.input_ids, batch.positions)
                model.compute_logits(hidden[batch.logits_indices], out=self.logits)

            return step

        self.graphs, self.capture_seconds, self.graph_memory_bytes = capture_graphs(
            self.device, list(reversed(self.token_sizes)), make_step, "Capturing extend graphs",
            keep_gc=self.runner.args.enable_cudagraph_gc)
        logger.info("captured extend graphs for up to %d requests at %s tokens in %.1f s, graph memory %.2f GiB",
                    self.max_reqs, self.token_sizes, self.capture_seconds, self.graph_memory_bytes / 2**30)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is ForwardMode.EXTEND and batch.num_tokens <= self.max_tokens
                and batch.batch_size <= self.max_reqs)

    def padded_size(self, num_tokens: int) -> int:
        return self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] at each request's last token: a view of the static output, valid until the
        next replay."""
        t, bs = batch.num_tokens, batch.batch_size
        padded = self.padded_size(t)
        self.input_ids[:t] = batch.input_ids
        self.positions[:t] = batch.positions
        self.out_cache_loc[:t] = batch.out_cache_loc
        self.tokens[:, t:padded] = self.token_pad
        self.req_pool_indices[:bs] = batch.req_pool_indices
        self.seq_lens[:bs] = batch.seq_lens
        self.logits_indices[:bs] = batch.logits_indices
        self.reqs[:, bs:] = self.req_pad
        static = self._batch(padded, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)
        self.runner.backend.init_forward_metadata_extend_graph(static, padded)
        self._fill_mamba_tables(batch.extend_seq_lens_cpu, batch.mamba_slots, padded)
        self.graphs[padded].replay()
        return self.logits[:bs]
