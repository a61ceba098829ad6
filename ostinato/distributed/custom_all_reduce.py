"""The one-shot all-reduce for small (latency-bound) messages, over peer-to-peer device memory.

Each rank holds one symmetric buffer (`torch.distributed._symmetric_memory`: the same allocation mapped into
every peer's address space). One kernel (`torch.ops.symm_mem.one_shot_all_reduce_copy_out`) copies this rank's
input into its buffer, barriers with the peers through signal pads, loads every peer's buffer over NVLink and
sums them in rank order, then barriers again (no rank overwrites its buffer while a peer still reads it). It
is one launch against NCCL's protocol, and it is a plain kernel over fixed addresses, so it is captured in
CUDA graphs like any other. NVLink multicast (the multimem ops) is never used, and its set-up is switched off.

Which messages take it is decided by `use_one_shot`, from the size in bytes and the dtype only: the same on
every rank, so all ranks always enter the same collective. `ONE_SHOT_MAX_BYTES` is the table of crossovers
per tensor-parallel size, from benchmarks/bench_allreduce.py.
"""

import logging
import os
import warnings

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Largest message (bytes) the one-shot all-reduce takes, per tp_size; larger ones go through NCCL. A size absent
# here (or 0) never uses it. Crossovers inside a CUDA graph (the decode step), from
# `benchmarks/bench_allreduce.py` ("recommended_max_bytes"). TP 2 on two H200s (bf16, in a graph): one-shot
# 6.6-14.7 us against NCCL's 7.5-15.4 us up to 1 MiB, 21.4 against 28.6 us at 2 MiB, 35.2 against 34.4 at 4 MiB
# (benchmarks/results/allreduce-h200x2.json). TP 4 and 8 are not measured (no such machine was lent): their
# values scale TP 2's by the peers each rank reads.
ONE_SHOT_MAX_BYTES: dict[int, int] = {2: 2 << 20, 4: 512 << 10, 8: 256 << 10}

# the dtypes the kernel is built for (torch's symm_mem one-shot dispatches float32 and bfloat16 only)
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)


def one_shot_max_bytes(tp_size: int, table: dict[int, int] | None = None) -> int:
    """The one-shot threshold for `tp_size` ranks (0: never)."""
    return (ONE_SHOT_MAX_BYTES if table is None else table).get(tp_size, 0)


def use_one_shot(nbytes: int, dtype: torch.dtype, max_bytes: int) -> bool:
    """Whether a message goes through the one-shot all-reduce: a dtype the kernel has, a size it can split into
    4-byte words, and at most the threshold. Depends on nothing that may differ between ranks."""
    return dtype in ONE_SHOT_DTYPES and 0 < nbytes <= max_bytes and nbytes % 4 == 0


def symm_mem_ops_available() -> bool:
    """Whether this torch has the symmetric-memory one-shot all-reduce (a CUDA build since about 2.8)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")


class OneShotAllReduce:
    """The symmetric buffer of one process group and the one-shot all-reduce over it (CUDA only).

    Construction is a collective (every rank, in the same order, before any graph capture): it allocates the
    buffer and exchanges its handles with the peers. `__call__` then launches one kernel and allocates only its
    output, so it is safe inside CUDA graph capture.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        # rendezvous would otherwise create an NVLink multicast object when the GPUs support it: never wanted
        # here (only the one-shot kernel runs, over unicast peer loads), and it must stay off on these machines
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and getattr(enable, "__deprecated__", None) is None:
            enable(group.group_name)  # torch < 2.11: the group's store must be registered first
        self.group_name = group.group_name
        self.max_bytes = max_bytes = -(-max_bytes // 16) * 16  # viewable as any dtype, 16-byte aligned
        self.device = device
        self.calls = 0  # Python-side calls (a captured call counts once, at capture)
        with torch.cuda.device(device):
            # one allocation of its own (never split): the kernel indexes every peer's buffer from its base
            self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if self.handle is None:
            raise RuntimeError("symmetric-memory rendezvous returned no handle")
        # the fused form copies the input into the buffer inside the kernel; older torch: a copy, then the op
        self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    def eligible(self, x: torch.Tensor) -> bool:
        return use_one_shot(x.numel() * x.element_size(), x.dtype, self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in a new tensor (`eligible(x)` must hold)."""
        self.calls += 1
        flat = x.reshape(-1)
        if not flat.is_contiguous() or (flat.storage_offset() * flat.element_size()) % 16:
            flat = flat.clone()  # the kernel wants the input as aligned as the buffer (offset 0)
        buf = self.buffer.view(x.dtype)[: flat.numel()]
        out = torch.empty_like(flat)
        if self._copy_out is not None:
            self._copy_out(buf, flat, "sum", self.group_name, out)
        else:
            buf.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.group_name, out)
        return out.view(x.shape)

    def self_test(self, rank: int, size: int) -> bool:
        """One eager call on known values (the first use must be eager, before any capture): rank r sends
        r + 1 + i / 1024 at index i, so the sum is exact in float32."""
        n = min(self.max_bytes // 4, 4096)
        i = torch.arange(n, device=self.device, dtype=torch.float32)
        got = self(rank + 1 + i / 1024)
        want = size * (size + 1) / 2 + size * i / 1024
        return bool(torch.equal(got, want))


def create_one_shot(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup, device: torch.device, rank: int,
                    size: int, max_bytes: int | None = None) -> OneShotAllReduce | None:
    """The one-shot all-reduce of a CUDA group, or None (then NCCL takes every message) when the table has no
    threshold for `size`, this torch lacks the ops, a GPU cannot load from a peer's memory, or the set-up or
    its self-test fails on any rank. Every rank reaches the same answer (agreed over `cpu_group`), so none
    waits in a rendezvous or a collective that another skipped."""
    max_bytes = one_shot_max_bytes(size) if max_bytes is None else max_bytes
    if device.type != "cuda" or max_bytes <= 0:
        return None
    devices = [None] * size
    dist.all_gather_object(devices, device.index, group=cpu_group)
    ok = symm_mem_ops_available() and all(d == device.index or torch.cuda.can_device_access_peer(device.index, d)
                                          for d in devices)
    if not _all_agree(ok, cpu_group, "symmetric-memory ops or peer access missing"):
        return None
    comm, why = None, ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            comm = OneShotAllReduce(group, device, max_bytes)
    except Exception as e:  # noqa: BLE001  (any failure: NCCL takes over)
        why = f"set-up failed on rank {rank}: {type(e).__name__}: {e}"
    if not _all_agree(comm is not None, cpu_group, why or "set-up failed on another rank"):
        return None
    try:
        ok, why = comm.self_test(rank, size), "its self-test gave a wrong sum"
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"its self-test failed on rank {rank}: {type(e).__name__}: {e}"
    if not _all_agree(ok, cpu_group, why):
        return None
    logger.info("tensor parallel: one-shot all-reduce over symmetric memory for messages up to %d KiB "
                "(NCCL above)", max_bytes >> 10)
    return comm


def _all_agree(ok: bool, cpu_group: dist.ProcessGroup, why: str) -> bool:
    """Whether `ok` holds on every rank (a collective over the gloo group); logs why not."""
    t = torch.tensor([int(bool(ok))], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
    if not t.item():
        logger.warning("tensor parallel: one-shot all-reduce off, NCCL takes every message (%s)",
                       "on another rank" if ok else why)
    return bool(t.item())
