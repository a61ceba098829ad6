"""A Mamba extend step's layout in device tables at fixed addresses, for steps captured in CUDA graphs.

An eager extend builds its index tables per batch and sizes its launch grids by the batch's requests and SSD
chunks. A captured step cannot: its kernels were recorded once per token count. So the piecewise runner keeps
one set of tables here, refills them before every capture and replay, and the mixer launches grids sized for
the most requests and chunks a step of that many tokens can have (`bounds`); programs past the real counts
(`counts`, on the device) exit at once. A step padded to a captured size gets one more request, the padding,
on the sink slot: every row then belongs to some request, and no kernel needs a row mask.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from ostinato.mem.mamba_pool import SINK_SLOT

# the most requests in a captured Mamba step (the padding request not counted): the grids are sized for the
# bound, and a small one keeps the programs that exit at once few (at 257, Granite-4.0-H-1B's 2,048-token prefill
# took 2.5 ms longer); steps with more requests run eagerly
GRAPH_MAX_REQS = 16


def step_bounds(num_tokens: int, max_reqs: int, chunk: int) -> tuple[int, int]:
    """The most requests and SSD chunks a step of `num_tokens` tokens can have: every request has a token, and
    a request of n tokens has ceil(n / chunk) chunks (<= n / chunk + 1)."""
    reqs = min(num_tokens, max_reqs)
    return reqs, -(-num_tokens // chunk) + reqs


def step_tables(extend_lens: list[int], chunk: int) -> dict[str, np.ndarray]:
    """Host int32 tables of requests back to back: cu [R+1] (first token of each), chunk_req / chunk_start [C]
    (each chunk's request and first token), chunk_cu [R+1] (each request's first chunk)."""
    lens = np.asarray(extend_lens, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    chunks = -(-lens // chunk)
    chunk_cu = np.concatenate([[0], np.cumsum(chunks)])
    chunk_req = np.repeat(np.arange(len(lens)), chunks)
    chunk_start = cu[chunk_req] + (np.arange(int(chunk_cu[-1])) - chunk_cu[chunk_req]) * chunk
    return {"cu": cu, "chunk_req": chunk_req, "chunk_start": chunk_start, "chunk_cu": chunk_cu}


@dataclass
class MambaStepTables:
    """Tables for steps of up to `max_tokens` tokens and `max_reqs` requests (the padding request included)."""

    max_tokens: int
    max_reqs: int
    chunk: int
    device: torch.device
    views: dict[str, torch.Tensor] = field(init=False)
    slots: torch.Tensor = field(init=False)  # [max_reqs] int64: each request's Mamba slot
    counts: torch.Tensor = field(init=False)  # [2] int32: requests, chunks of the step filled last
    num_reqs: int = field(init=False, default=0)  # the same counts on the host (the CPU path reads these)
    num_chunks: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        max_chunks = step_bounds(self.max_tokens, self.max_reqs, self.chunk)[1]
        sizes = {"cu": self.max_reqs + 1, "chunk_req": max_chunks, "chunk_start": max_chunks,
                 "chunk_cu": self.max_reqs + 1, "counts": 2}
        # each view starts 16-byte aligned (Triton specializes on pointer alignment: one variant for every step)
        offsets, total = {}, 0
        for name, n in sizes.items():
            offsets[name], total = total, total + -(-n // 4) * 4
        self.buf = torch.zeros(total, dtype=torch.int32, device=self.device)
        self.host = np.zeros(total, dtype=np.int32)
        self.offsets = offsets
        self.views = {name: self.buf[offsets[name] : offsets[name] + n] for name, n in sizes.items()}
        self.counts = self.views.pop("counts")
        self.slots = torch.full((self.max_reqs,), SINK_SLOT, dtype=torch.int64, device=self.device)

    def bounds(self, num_tokens: int) -> tuple[int, int]:
        return step_bounds(num_tokens, self.max_reqs, self.chunk)

    def lens(self) -> list[int]:
        """Each request's tokens in the step filled last, the padding request included (host)."""
        cu = self.host[self.offsets["cu"] : self.offsets["cu"] + self.num_reqs + 1]
        return np.diff(cu).tolist()

    def fill(self, extend_lens: list[int], slots: torch.Tensor, padded_tokens: int) -> None:
        """The layout of a step of requests with `extend_lens` tokens at Mamba `slots` (device, [R]), padded to
        `padded_tokens` by one more request on the sink slot. Runs before a capture or replay, outside it."""
        real = sum(extend_lens)
        lens = list(extend_lens) + ([padded_tokens - real] if padded_tokens > real else [])
        if len(lens) > self.max_reqs or padded_tokens > self.max_tokens:
            raise ValueError(f"a step of {len(lens)} requests and {padded_tokens} tokens is past the Mamba step "
                             f"tables' {self.max_reqs} requests and {self.max_tokens} tokens")
        tables = step_tables(lens, self.chunk)
        host = self.host
        for name, values in tables.items():
            host[self.offsets[name] : self.offsets[name] + len(values)] = values
        self.num_reqs, self.num_chunks = len(lens), len(tables["chunk_req"])
        host[self.offsets["counts"] : self.offsets["counts"] + 2] = (self.num_reqs, self.num_chunks)
        src = torch.from_numpy(host.copy())  # a copy per step: an earlier step's copy may still be in flight
        self.buf.copy_(src.pin_memory() if self.buf.is_cuda else src, non_blocking=True)
        self.slots[: len(extend_lens)].copy_(slots)
        self.slots[len(extend_lens) :].fill_(SINK_SLOT)  # the padding request, and rows no kernel reads
