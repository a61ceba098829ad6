"""Tensor-parallel linear layers and the vocab-parallel embedding (Megatron's split).

Column-parallel layers (q/k/v, gate/up) hold a slice of the output rows and need no communication;
row-parallel ones (o, down) hold a slice of the input columns and all-reduce their partial outputs; the
embedding and the LM head hold a slice of the vocabulary. At tp_size 1 every layer is the plain one.

Weights are loaded from the checkpoint's full tensors, one at a time: each parameter has a
`weight_loader(param, full_tensor, shard_id)` that copies in only this rank's slice, and under tp_size > 1 a
`full_shape` and `load_full(param, full_tensor)` (fused layouts, e.g. [q; k; v]) for dummy weights drawn at
the full shape, so a dummy model is the same at every tp_size.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.distributed.comm import all_gather, all_reduce
from ostinato.distributed.parallel_state import divide, first_kv_head, kv_heads_per_rank, tp_rank, tp_size
from ostinato.layers.linear import Linear
from ostinato.layers.sampling_ops import padded_vocab


def _attach(param: nn.Parameter, loader, full_shape: tuple[int, ...] | None = None, load_full=None) -> None:
    param.weight_loader = loader
    if tp_size() > 1 and full_shape is not None:
        param.full_shape, param.load_full = full_shape, load_full


def _copy_rows(param: torch.Tensor, dst_start: int, src: torch.Tensor) -> None:
    param.data[dst_start : dst_start + src.shape[0]].copy_(src)


class QKVParallelLinear(Linear):
    """Fused [q; k; v] projection of this rank's heads: num_heads / tp query heads, and its KV heads
    (split, or one replicated head when there are fewer KV heads than ranks)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp_size(), "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads)
        self.first_kv_head = first_kv_head(num_kv_heads)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden, q + 2 * kv, bias=bias)
        self.sizes = [q, kv, kv]
        full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        for p in self.parameters():
            _attach(p, self.weight_loader, (sum(full), *p.shape[1:]),
                    lambda param, t: [self.weight_loader(param, part, i) for i, part in enumerate(t.split(full))])

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        """`full`: the checkpoint's q (shard 0), k (1) or v (2) tensor, all heads."""
        d = self.head_dim
        first_head = tp_rank() * self.num_heads if shard_id == 0 else self.first_kv_head
        rows = self.sizes[shard_id]
        _copy_rows(param, sum(self.sizes[:shard_id]), full[first_head * d : first_head * d + rows])


class MergedColumnParallelLinear(Linear):
    """Fused [gate; up]: this rank's 1/tp of each."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        self.shard = divide(intermediate, tp_size(), "intermediate_size")
        super().__init__(hidden, 2 * self.shard, bias=False)
        _attach(self.weight, self.weight_loader, (2 * intermediate, hidden),
                lambda param, t: [self.weight_loader(param, part, i) for i, part in enumerate(t.chunk(2))])

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        n = self.shard
        _copy_rows(param, shard_id * n, full[tp_rank() * n : (tp_rank() + 1) * n])


class RowParallelLinear(Linear):
    """This rank's 1/tp of the input columns; the partial outputs are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int) -> None:
        self.shard = divide(in_features, tp_size(), "the row-parallel input size")
        super().__init__(self.shard, out_features, bias=False)
        _attach(self.weight, self.weight_loader, (out_features, in_features),
                lambda param, t: self.weight_loader(param, t))

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int | None = None) -> None:
        n = self.shard
        param.data.copy_(full[:, tp_rank() * n : (tp_rank() + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return all_reduce(out) if tp_size() > 1 else out


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first id, rows) of this rank's vocabulary slice; the vocabulary is padded to a multiple of tp_size."""
    rows = -(-vocab_size // tp_size())
    return tp_rank() * rows, rows


def _load_vocab_rows(param: nn.Parameter, full: torch.Tensor, shard_id: int | None = None) -> None:
    start, rows = vocab_shard(full.shape[0])
    part = full[start : start + rows]
    param.data[: part.shape[0]].copy_(part)
    param.data[part.shape[0] :].zero_()  # padding rows: never looked up, their logits sliced off


class VocabParallelEmbedding(nn.Embedding):
    """This rank's slice of the vocabulary; an id outside it reads zeros, and the all-reduce sums the slices."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        self.start, rows = vocab_shard(vocab_size)
        super().__init__(rows, hidden)
        _attach(self.weight, _load_vocab_rows, (vocab_size, hidden), _load_vocab_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(nn.Linear):
    """The output projection's slice of the vocabulary (its logits are gathered by `gather_logits`)."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__(hidden, vocab_shard(vocab_size)[1], bias=False)
        _attach(self.weight, _load_vocab_rows, (vocab_size, hidden), _load_vocab_rows)


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's logits slice -> the full [n, vocab_size] logits, on every rank (each samples the same)."""
    return all_gather(local)[:, :vocab_size] if tp_size() > 1 else local


def float_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [n, vocab_size] = hidden @ weight^T (this rank's vocabulary rows), gathered over the ranks;
    `out` (float32 [n, vocab_size], rows may be strided) is written in place.

    On CUDA at tp_size 1 with 16-bit inputs, cuBLAS writes its float32 sums straight into the float32 output:
    no 16-bit logits and no widening copy of them (bs 256, Qwen3's 152k vocabulary: 250 -> 139 us a step on an
    H200). Those logits are the unrounded sums, where transformers rounds them to the model dtype first. Without
    `out` they get the row stride of a decode graph's logits buffer (`padded_vocab`), so that eager steps and
    replays hand cuBLAS the same layout."""
    if hidden.is_cuda and tp_size() == 1 and hidden.dtype in (torch.bfloat16, torch.float16):
        if out is None:
            out = torch.empty(hidden.shape[0], padded_vocab(vocab_size), dtype=torch.float32,
                              device=hidden.device)[:, :vocab_size]
        return torch.mm(hidden, weight[:vocab_size].t(), out_dtype=torch.float32, out=out)
    logits = gather_logits(F.linear(hidden, weight), vocab_size)
    return logits.float() if out is None else out.copy_(logits)
