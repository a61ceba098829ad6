"""Builds decode_bs1.cu with nvcc into a shared library (once per source and toolkit, cached on disk) and binds its
C entry points with ctypes. No torch C++ extension: the kernel takes raw device pointers and a stream."""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("decode_bs1.cu")
ARCH = "sm_90a"  # bulk copies and mbarrier transaction counts: Hopper
_FLAGS = ["-O3", "-lineinfo", "-std=c++17", f"-gencode=arch=compute_{ARCH[3:]},code={ARCH}", "--shared",
          "-Xcompiler", "-fPIC"]

_P, _I, _F, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong
LAUNCH_ARGTYPES = [_P, *[_I] * 11, _F, _F, _F, *[_P] * 7, _LL, *[_P] * 8, _I, _I, _P]
TRACE_SLOTS = 24  # the kernel's kTraceSlots
NO_WAITS = 1  # the kernel's kNoWaits flag
RING_ONLY = 2  # its kRingOnly flag


def nvcc_path() -> str | None:
    """nvcc from CUDA_HOME / CUDA_PATH, else the PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    root = os.environ.get("OSTINATO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ostinato")
    return Path(root) / "megakernel"


def build(nvcc: str | None = None) -> Path:
    """The library's path, compiling it first where the cache lacks this source's build."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise RuntimeError("the one-launch decode step needs nvcc (CUDA_HOME, CUDA_PATH or PATH) to build its kernel")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / f"decode_bs1-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([nvcc, *_FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed on {SOURCE.name}:\n{done.stderr[-4000:]}")
        tmp.replace(out)  # atomic: another process building the same key sees a whole file or none
    return out


@functools.cache
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    lib.ost_decode_bs1_launch.argtypes = LAUNCH_ARGTYPES
    lib.ost_decode_bs1_launch.restype = ctypes.c_int
    lib.ost_decode_bs1_smem_bytes.argtypes = [_I, _I]
    lib.ost_error_string.restype = ctypes.c_char_p
    lib.ost_error_string.argtypes = [_I]
    return lib
