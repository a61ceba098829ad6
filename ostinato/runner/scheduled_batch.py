"""What the scheduler (engine/, a layer up) hands the model runner for one step."""

from dataclasses import dataclass
from typing import Protocol

import torch

from ostinato.attention.forward_batch import ForwardMode
from ostinato.sampling_params import SamplingParams


class ScheduledRequest(Protocol):
    """The parts of an engine Request the runner reads."""

    params: SamplingParams
    seed: int
    output_token_ids: list[int]
    req_pool_idx: int | None
    num_pending: int

    @property
    def all_token_ids(self) -> list[int]: ...

    def token_at(self, i: int) -> int: ...


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list  # list[ScheduledRequest]: the engine's Requests (a list is invariant, so not annotated as such)
    prefix_lens: list[int]  # KV already cached per request
    extend_lens: list[int]  # tokens computed this pass per request
    out_cache_loc: torch.Tensor  # slots for the new tokens, in batch order
    sample_mask: list[bool]  # whether the pass reaches the request's last token (so it samples the next)
    # EXTEND with prompt logprobs: per request, the prompt tokens its new positions predict ([] for most), and
    # the most top alternatives any of them asks for; None when no request of the step wants them
    prompt_lp_targets: list[list[int]] | None = None
    prompt_lp_k: int = 0
