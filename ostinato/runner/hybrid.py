"""Sizing of the Mamba state pool of hybrid models, done before the KV pool gets the rest of the memory."""

import logging

import torch
from torch import nn
from transformers import PretrainedConfig

from ostinato.mem.mamba_pool import MambaPool

logger = logging.getLogger(__name__)

# The SSM state is a running sum over the whole sequence: kept in float32 whatever the model dtype (as
# SGLang's default), so long decodes do not drift. The conv state is a window of inputs: model dtype.
MAMBA_SSM_DTYPE = torch.float32
# on the GPU, Mamba states may take at most this share of the memory left for pools after the weights
MAMBA_MAX_SHARE = 0.5


def is_hybrid(model: nn.Module) -> bool:
    return getattr(model, "num_mamba_layers", 0) > 0


def make_mamba_pool(model: nn.Module, config: PretrainedConfig, max_running_requests: int, dtype: torch.dtype,
                    device: torch.device, mem_fraction_static: float) -> MambaPool:
    """A MambaPool for up to `max_running_requests` requests, fewer on the GPU when their states would take more
    than MAMBA_MAX_SHARE of the memory left; binds its layers' views into the model. Logs how many fit."""
    from ostinato.models.granite_hybrid import mamba_shape

    shape = mamba_shape(config)
    per_slot = MambaPool.bytes_per_slot(**shape, conv_dtype=dtype, ssm_dtype=MAMBA_SSM_DTYPE)
    slots = max_running_requests
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = (total * mem_fraction_static - (total - free)) * MAMBA_MAX_SHARE
        fit = int(budget // per_slot) - 1  # the sink slot
        if fit < 1:
            raise ValueError(f"mem_fraction_static={mem_fraction_static} leaves no room for one request's Mamba "
                             f"state ({per_slot / 2**20:.1f} MiB)")
        slots = min(slots, fit)
    pool = MambaPool(slots, **shape, conv_dtype=dtype, ssm_dtype=MAMBA_SSM_DTYPE, device=device)
    model.bind_mamba_pool(pool)
    logger.info("Mamba state pool: %d requests' states fit (%d layers, %.2f MiB per request, %.2f GiB); "
                "prefix caching is off for hybrid models (no state snapshots yet)",
                slots, shape["num_layers"], per_slot / 2**20, pool.bytes() / 2**30)
    return pool
