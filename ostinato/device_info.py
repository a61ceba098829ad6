"""Facts about the CUDA device this process runs kernels on, shared by every layer."""

import os

import torch


def usable_sms(device: torch.device) -> int:
    """The SMs this process's kernels may use: the device's, scaled by an MPS client's
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE. (A share the MPS daemon sets without that variable is not seen: a kernel
    whose blocks must all be resident at once, sized by this count, would hang under one; such kernels have a switch
    to turn them off.)"""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if not share:
        return sms
    try:
        return int(sms * float(share) / 100)
    except ValueError:  # a share we cannot read: count none, so such kernels stay off
        return 0
