"""The tensor-parallel process group of this process: rank, size, and the groups collectives run on.

One group per process, set before the model is built (the layers read rank and size at construction) and
torn down with the engine. Without `init_tp` the process is rank 0 of 1 and no collective is ever issued.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

_state: dict = {"rank": 0, "size": 1, "group": None, "cpu_group": None, "one_shot": None}


def init_tp(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 600.0,
            custom_all_reduce: bool = False) -> None:
    """Join the group: NCCL for the model's collectives on CUDA, gloo on the CPU; a gloo group beside NCCL
    for host-side agreements (the KV pool size). With `custom_all_reduce` on CUDA, also set up the one-shot
    all-reduce for small messages (distributed/custom_all_reduce.py; every rank must pass the same value)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the symmetric-memory ops launch on the current device's stream
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                            timeout=timedelta(seconds=timeout_s), **kw)
    _state.update(rank=rank, size=size, group=dist.group.WORLD,
                  cpu_group=dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD)
    if custom_all_reduce and device.type == "cuda" and size > 1:
        from ostinato.distributed.custom_all_reduce import create_one_shot

        _state["one_shot"] = create_one_shot(_state["group"], _state["cpu_group"], device, rank, size)


def destroy_tp() -> None:
    """Leave the group; this process is rank 0 of 1 again at once, even if the teardown then hangs."""
    _state.update(rank=0, size=1, group=None, cpu_group=None, one_shot=None)
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    return _state["rank"]


def tp_size() -> int:
    return _state["size"]


def tp_group():
    return _state["group"]


def tp_cpu_group():
    """The gloo group beside NCCL (the group itself on the CPU): host-side agreements and barriers."""
    return _state["cpu_group"]


def one_shot_all_reduce():
    """The one-shot all-reduce (custom_all_reduce.OneShotAllReduce) of this group, or None: NCCL or gloo only."""
    return _state["one_shot"]


def set_one_shot_all_reduce(comm) -> None:
    """Install (or with None remove) the one-shot all-reduce: init_tp does; benchmarks and tests may."""
    _state["one_shot"] = comm


def divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"tp_size must divide {what} ({n}), got tp_size={parts}")
    return n // parts


def kv_heads_per_rank(num_kv_heads: int) -> int:
    """KV heads each rank holds: split, or (fewer KV heads than ranks) one head replicated on several ranks."""
    size = tp_size()
    if num_kv_heads >= size:
        return divide(num_kv_heads, size, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(f"tp_size must be a multiple of num_key_value_heads ({num_kv_heads}) when larger than it, "
                         f"got tp_size={size}")
    return 1


def first_kv_head(num_kv_heads: int) -> int:
    """The first KV head this rank holds (the query heads it holds read it, in GQA order)."""
    return tp_rank() * kv_heads_per_rank(num_kv_heads) if num_kv_heads >= tp_size() \
        else tp_rank() * num_kv_heads // tp_size()


def min_over_ranks(value: int) -> int:
    """The minimum of an int over the group (the KV pool must hold the same slots on every rank)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state["cpu_group"])
    return int(t.item())
