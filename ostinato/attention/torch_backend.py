"""Reference attention in plain PyTorch over the paged cache: the CPU backend and the test oracle."""

import torch
import torch.nn.functional as F

from ostinato.attention.base import AttentionBackend, AttentionSpec
from ostinato.attention.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    graph_mode = False

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.graph_mode = False
        rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices]
        max_len = max(batch.seq_lens_cpu)
        self.kv_slots = rows[:, :max_len].to(torch.int64)  # [bs, max_len]
        arange = torch.arange(max_len, device=rows.device)
        self.kv_valid = arange[None, :] < batch.seq_lens[:, None]  # [bs, max_len]

    # In graph mode the gather spans the whole request row (a fixed shape), and the slots and mask are
    # recomputed from the static buffers inside the captured region.
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.graph_arange = torch.arange(self.req_to_token_pool.max_context_len,
                                         device=self.req_to_token_pool.req_to_token.device)

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.graph_mode = True
        self.graph_req_pool_indices, self.graph_seq_lens = req_pool_indices, seq_lens

    def init_forward_metadata_replay(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.init_forward_metadata_capture(bs, req_pool_indices, seq_lens)

    def _gather(self, layer: AttentionSpec, slots: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at `slots` in `dtype` (an fp8 cache is dequantized on the fly: no full-precision copy of it)."""
        return self.kv_cache.read_kv(layer.layer_id, slots, dtype)

    def forward_extend(self, q: torch.Tensor, layer: AttentionSpec, batch: ForwardBatch,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        start = 0
        for i, (prefix, n) in enumerate(zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu,
                                            strict=True)):
            total = prefix + n
            k, v = self._gather(layer, self.kv_slots[i, :total], q.dtype)  # [total, Hkv, D]
            qi = q[start : start + n].transpose(0, 1)  # [H, n, D]
            # query j sits at position prefix + j and sees keys 0..prefix + j
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            o = F.scaled_dot_product_attention(
                qi, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                scale=layer.scaling, enable_gqa=True,
            )
            out[start : start + n] = o.transpose(0, 1)
            start += n
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        if self.graph_mode:
            slots = self.req_to_token_pool.req_to_token[self.graph_req_pool_indices].to(torch.int64)
            valid = self.graph_arange[None, :] < self.graph_seq_lens[:, None]
        else:
            slots, valid = self.kv_slots, self.kv_valid
        k, v = self._gather(layer, slots, q.dtype)  # [bs, L, Hkv, D]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [bs, H, 1, D]
            k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=layer.scaling, enable_gqa=True,
        )
        return o[:, :, 0, :]
