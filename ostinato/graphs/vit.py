"""Vision-encoder graphs (seed 000): a tower's blocks and mergers captured per padded patch count and replayed.

What a replay reads, all in buffers allocated before its capture and rewritten before every replay:
- per key: the patch embeddings x [P, hidden], `cu_seqlens` and (Qwen2.5-VL) `cu_window_seqlens` as int32
  buffers of P / merge^2 + 2 entries (every segment holds at least one merged unit, so no segmentation of P
  patches needs more), and the outputs: merged tokens [P / merge^2, out] and Qwen3-VL's deepstack features;
- shared by all keys: the rotary cos/sin workspace [2, cap, head_dim], grown by doubling (O(log) regrowths).
  A graph keeps the workspace it was captured over alive, so a regrowth never leaves a graph reading freed
  memory; graphs captured later use the new one.
Everything else a block allocates comes from the process's one graph pool.

Keys and metadata. SGLang keys on the patch count and bakes `cu_seqlens` into the capture, so two batches with
the same total and other image splits replay the first one's segments (wrong attention). Here the key is the
padded patch count only, and the real `cu_seqlens` / window `cu_window_seqlens` are copied into the key's
buffers before every replay: the varlen attention kernel's launch depends on the row count alone, never on
the segment boundaries, so the graph is right for any split. Keying on the segmentation instead would be
correct too, but distinct image-size combinations are unbounded while padded totals are few, so a captured
graph is hit far more often. The batch is padded to the key with zero rows that form one more segment
(attending only among themselves; merged and sliced off), `output_indices` undoes Qwen2.5-VL's window order
after the replay, and the outputs are copied out, since the next replay overwrites them.

Padding: patch counts round up to a multiple of 64 below 2048 patches, then of 1/32 of the count's power of
two (at most ~3% wasted work, where a batch is compute-bound); batches above `max_patches` run eagerly. vLLM's
token budgets (powers of two, images packed into the smallest that fits) bound the graph count harder, but pad
by up to half (a quarter on average): below ~1k patches, where launches dominate, that is free, above it the
wasted matmuls would make a replay slower than eager. Fine keys cost more captures; the byte cap bounds their
memory and capture-on-second-sight keeps one-off sizes from paying for them.

Bounded memory: each key is charged its static buffers plus what its capture added to the shared pool; past
`max_bytes` the least recently used keys are evicted (memory a capture took stays in the pool and is reused
by the next captures, so the pool does not grow past the cap plus one key). The cap is set aside when the KV
pool is sized.

First sight: a new key runs eagerly and is only remembered; its second sight captures it (the capture costs
about two eager passes, logged per key) and every later one replays. One-off sizes never pay for a capture.
"""

import gc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ostinato.graphs.graph import Graph, capture_stream, warm_up_stream

logger = logging.getLogger(__name__)

SEEN_KEYS = 1024  # how many keys seen once are remembered (oldest forgotten first)


def padded_patches(n: int, granularity: int | None = None) -> int:
    """The key of a batch of n patches: n rounded up to `granularity`, or by default to 64 below 2048 patches and
    to 1/32 of n's power of two above (64 divides both, and every merge^2 of 1, 4, 16)."""
    g = granularity or max(64, (1 << (n.bit_length() - 1)) // 32)
    return -(-n // g) * g


@dataclass
class _Entry:
    graph: Graph
    x: torch.Tensor  # [P, hidden]
    rotary: torch.Tensor  # the cos/sin workspace [2, cap, head_dim] captured over (kept alive)
    cu: torch.Tensor  # int32 [P / unit + 2]
    cu_window: torch.Tensor | None
    merged: torch.Tensor  # [P / unit, out_hidden]
    deepstack: torch.Tensor | None  # [layers, P / unit, out_hidden]
    bytes: int
    capture_ms: float


@dataclass
class VitGraphStats:
    replays: int = 0
    eager: int = 0  # batches run eagerly: first sights, too large, or over the cap
    captures: int = 0
    evictions: int = 0
    capture_ms: dict = field(default_factory=dict)  # key -> ms of its last capture
    graph_bytes: dict = field(default_factory=dict)  # key -> bytes charged to it


class VitGraphRunner:
    def __init__(self, tower: torch.nn.Module, device: torch.device, max_bytes: int, max_patches: int,
                 granularity: int | None = None, capture_on_sight: int = 2, keep_gc: bool = False) -> None:
        self.tower = tower
        self.device = device
        self.max_bytes = max_bytes
        self.max_patches = max_patches
        self.granularity = granularity
        self.capture_on_sight = capture_on_sight
        self.keep_gc = keep_gc
        self.unit = tower.merge**2
        if granularity is not None and granularity % self.unit:
            raise ValueError(f"granularity must be a multiple of merge^2 = {self.unit}, got {granularity}")
        self.windowed = hasattr(tower, "window_index")
        self.head_dim = tower.cfg.hidden_size // tower.cfg.num_heads
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self.seen: OrderedDict[int, int] = OrderedDict()  # key -> sightings, for keys not captured
        self.rotary: torch.Tensor | None = None
        self.stats = VitGraphStats()

    @property
    def graph_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    # ------------------------------------------------------------------ entry point
    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grids: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What `tower(pixels, grids)` returns, from a graph when this batch's key has one (or earns one now)."""
        tower = self.tower
        batch = tower.prepare(pixels.to(tower.patch_embed.proj.weight.dtype), grids)
        n = batch.x.shape[0]
        key = padded_patches(n, self.granularity)
        entry = self.entries.get(key)
        if entry is None and key <= self.max_patches and self._sighted(key):
            entry = self._capture(key)
        if entry is None:
            self.stats.eager += 1
            return tower.run(batch)
        self.entries.move_to_end(key)
        self._fill(entry, batch)
        entry.graph.replay()
        self.stats.replays += 1
        rows = n // self.unit
        deepstack = None if entry.deepstack is None else entry.deepstack[:, :rows]
        return tower.finish(batch, entry.merged[:rows], deepstack, copy=True)  # the next replay overwrites them

    def _sighted(self, key: int) -> bool:
        """Count a sighting of an uncaptured key; True once it has been seen `capture_on_sight` times."""
        count = self.seen.pop(key, 0) + 1
        if count >= self.capture_on_sight:
            return True
        self.seen[key] = count
        while len(self.seen) > SEEN_KEYS:
            self.seen.popitem(last=False)
        return False

    # ------------------------------------------------------------------ replay
    def _cu(self, cu: list[int], buf: torch.Tensor) -> None:
        """cu, then the padding segment [n, P) and empty segments [P, P), into buf in one transfer."""
        key = (buf.shape[0] - 2) * self.unit
        host = torch.tensor(cu + [key] * (buf.shape[0] - len(cu)), dtype=torch.int32, pin_memory=buf.is_cuda)
        buf.copy_(host, non_blocking=True)

    def _fill(self, e: _Entry, batch) -> None:
        n = batch.x.shape[0]
        e.x[:n].copy_(batch.x)
        e.x[n:].zero_()  # padding rows: finite, so masked keys add exact zeros
        e.rotary[0, :n].copy_(batch.cos)
        e.rotary[1, :n].copy_(batch.sin)
        self._cu(batch.cu_seqlens, e.cu)
        if e.cu_window is not None:
            self._cu(batch.cu_window_seqlens, e.cu_window)

    # ------------------------------------------------------------------ capture
    def _rotary_ws(self, rows: int) -> torch.Tensor:
        """The cos/sin workspace, at least `rows` long: grown by doubling (zero-filled, so never NaN)."""
        if self.rotary is None or self.rotary.shape[1] < rows:
            cap = rows if self.rotary is None else max(2 * self.rotary.shape[1], rows)
            self.rotary = torch.zeros(2, cap, self.head_dim, dtype=torch.float32, device=self.device)
        return self.rotary

    def _capture(self, key: int) -> _Entry | None:
        tower, dev, cuda = self.tower, self.device, self.device.type == "cuda"
        start = time.perf_counter()
        cfg = tower.cfg
        rows = key // self.unit
        out_hidden = cfg.out_hidden_size
        rotary = self._rotary_ws(key)
        x = torch.zeros(key, cfg.hidden_size, dtype=tower.patch_embed.proj.weight.dtype, device=dev)
        cu = torch.tensor([0] + [key] * (rows + 1), dtype=torch.int32, device=dev)  # one segment; refilled per replay
        cu_window = cu.clone() if self.windowed else None
        merged = torch.empty(rows, out_hidden, dtype=x.dtype, device=dev)
        layers = len(getattr(tower, "deepstack_indexes", ()))
        deepstack = torch.empty(layers, rows, out_hidden, dtype=x.dtype, device=dev) if layers else None
        static = sum(t.numel() * t.element_size() for t in (x, cu, merged) + tuple(
            t for t in (cu_window, deepstack) if t is not None))
        cos, sin = rotary[0, :key], rotary[1, :key]

        def step() -> None:
            out, deep = tower.run_blocks(x, cos, sin, cu, cu_window)
            merged.copy_(out)
            if deepstack is not None:
                deepstack.copy_(deep)

        graph = Graph(dev)
        gc_was_enabled = gc.isenabled()
        if not self.keep_gc:
            gc.disable()  # no collection mid-capture (no gc.collect here: it would stall serving)
        try:
            if cuda:
                with warm_up_stream(dev, mid_serving=True):  # captured as images arrive
                    step()  # warm-up outside the capture: Triton compiles, cuBLAS workspaces
                reserved = torch.cuda.memory_reserved(dev)
                graph.capture(step, capture_stream(dev))
                torch.cuda.synchronize(dev)
                pool = max(0, torch.cuda.memory_reserved(dev) - reserved)
            else:
                graph.capture(step)
                pool = 0
        finally:
            if gc_was_enabled and not self.keep_gc:
                gc.enable()
        ms = (time.perf_counter() - start) * 1e3
        entry = _Entry(graph, x, rotary, cu, cu_window, merged, deepstack, static + pool, ms)
        self.stats.captures += 1
        self.stats.capture_ms[key] = round(ms, 2)
        self.stats.graph_bytes[key] = entry.bytes
        logger.info("captured a vision-encoder graph for %d patches in %.1f ms, %.1f MiB", key, ms, entry.bytes / 2**20)
        if entry.bytes > self.max_bytes:  # alone over the cap: never again for this size or larger
            logger.warning("a vision graph of %d patches takes %.0f MiB, over the cap of %.0f MiB: batches of %d "
                           "patches or more now run eagerly", key, entry.bytes / 2**20, self.max_bytes / 2**20, key)
            self.max_patches = key - 1
            return None
        self.entries[key] = entry
        while self.graph_bytes > self.max_bytes:
            self._evict()
        return entry

    def _evict(self) -> None:
        key, _ = self.entries.popitem(last=False)
        self.seen[key] = self.capture_on_sight - 1  # it was used: its next sight captures it again
        self.stats.evictions += 1
        self.stats.graph_bytes.pop(key, None)
        logger.info("evicted the vision-encoder graph for %d patches (least recently used)", key)
