"""Builds decode_bs1.cu (layers/cuda_ops/build.py) and binds its C entry points with ctypes."""

import ctypes
import functools
from pathlib import Path

from ostinato.layers.cuda_ops.build import build as build_source

SOURCE = Path(__file__).with_name("decode_bs1.cu")

_P, _I, _F, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong
LAUNCH_ARGTYPES = [_P, *[_I] * 11, _F, _F, _F, *[_P] * 7, _LL, *[_P] * 8, _I, _I, _P]
TRACE_SLOTS = 24  # the kernel's kTraceSlots
NO_WAITS = 1  # the kernel's kNoWaits flag
RING_ONLY = 2  # its kRingOnly flag


def build(nvcc: str | None = None) -> Path:
    """The library's path, compiling it first where the cache lacks this source's build."""
    return build_source(SOURCE, "the one-launch decode step", nvcc)


@functools.cache
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    lib.ost_decode_bs1_launch.argtypes = LAUNCH_ARGTYPES
    lib.ost_decode_bs1_launch.restype = ctypes.c_int
    lib.ost_decode_bs1_smem_bytes.argtypes = [_I, _I]
    lib.ost_error_string.restype = ctypes.c_char_p
    lib.ost_error_string.argtypes = [_I]
    return lib
