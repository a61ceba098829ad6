"""The collectives of a tensor-parallel forward, as custom ops: opaque to torch.compile (so the piecewise
backend can split at the all-reduce, graphs/compile_backend.py) and captured inside CUDA graphs (NCCL
records its kernels into the graph being captured, and so does the one-shot all-reduce).

The all-reduce takes the one-shot kernel over symmetric memory for messages up to its threshold when it was
set up (CUDA, `--disable-custom-all-reduce` not given: distributed/custom_all_reduce.py), NCCL above it, and
gloo on the CPU."""

import torch
import torch.distributed as dist

from ostinato.distributed.parallel_state import one_shot_all_reduce, tp_group, tp_size


def all_reduce_impl(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in a new tensor (the row-parallel layers' partial outputs)."""
    one_shot = one_shot_all_reduce()
    if one_shot is not None and one_shot.eligible(x):  # decided by size and dtype: alike on every rank
        return one_shot(x)
    out = x.clone()
    dist.all_reduce(out, group=tp_group())
    return out


all_reduce_op = torch.library.custom_op("ostinato::all_reduce", all_reduce_impl, mutates_args=())


@all_reduce_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def all_gather_impl(x: torch.Tensor) -> torch.Tensor:
    """[n, k] shards -> [n, k * tp_size], rank r's shard in columns [r*k, (r+1)*k) (vocab-parallel logits)."""
    x = x.contiguous()
    size = tp_size()
    out = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x, group=tp_group())
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), x, group=tp_group())
    return out.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


all_gather_op = torch.library.custom_op("ostinato::all_gather", all_gather_impl, mutates_args=())


@all_gather_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * tp_size()))


# eager calls skip the ops' dispatch (tens of microseconds of host time each); torch.compile sees the opaque ops
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return (all_reduce_op if torch.compiler.is_compiling() else all_reduce_impl)(x)


def all_gather(x: torch.Tensor) -> torch.Tensor:
    return (all_gather_op if torch.compiler.is_compiling() else all_gather_impl)(x)
