"""What a graph runner needs from the model runner. The model runner (runner/, a layer up) builds the graph
runners and satisfies this structurally, so graphs/ never imports runner/."""

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ostinato.attention.base import AttentionBackend
from ostinato.config import EngineArgs
from ostinato.mem.req_to_token_pool import ReqToTokenPool


class TokenResolver(Protocol):
    tokens: torch.Tensor  # int64 [slots + 1]: each request slot's last sampled token

    def begin_decode_(self, input_ids: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                      out_cache_loc: torch.Tensor, req_to_token: torch.Tensor) -> None:
        """Replace in-flight (pending) input ids in place by their request slot's last sampled token, and record
        each row's new KV slot in req_to_token."""


class GraphHost(Protocol):
    args: EngineArgs
    device: torch.device
    dtype: torch.dtype  # the model's activations
    model: Any  # a models/ CausalLM: forward(ids, positions), compute_logits(hidden, out=), attention_specs
    compiled_forward: Callable[..., torch.Tensor]  # model.forward, or its torch.compile
    backend: AttentionBackend
    next_tokens: TokenResolver
    vocab_size: int
    max_running_requests: int
    req_to_token_pool: ReqToTokenPool
    mamba_pool: Any  # a mem/ MambaPool for hybrid models (their padded rows read its sink slot), else None
    # the one-launch decode step of one request (megakernel/decode_bs1.py), or None: (x_in, positions, seq_lens,
    # req_rows, out_loc, req_to_token) -> the residual stream after the last layer
    decode_megakernel: Any
