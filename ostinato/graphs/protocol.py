"""What a graph runner needs from the model runner. The model runner (runner/, a layer up) builds the graph
runners and satisfies this structurally, so graphs/ never imports runner/."""

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ostinato.attention.base import AttentionBackend
from ostinato.config import EngineArgs
from ostinato.mem.req_to_token_pool import ReqToTokenPool


class TokenResolver(Protocol):
    def resolve_(self, input_ids: torch.Tensor, req_slots: torch.Tensor) -> None:
        """Replace in-flight (pending) input ids in place by their request slot's last sampled token."""


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
