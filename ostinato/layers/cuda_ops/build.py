"""Builds a CUDA C++ source of this project with nvcc into a shared library (once per source, its headers and the
toolkit, cached on disk), for ctypes to bind. No torch C++ extension: the kernels take raw device pointers and a
stream. Headers (*.cuh) live beside this module and are on the include path."""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HEADERS = Path(__file__).parent
ARCH = "sm_90a"  # bulk copies and mbarrier transaction counts: Hopper
FLAGS = ["-O3", "-lineinfo", "-std=c++17", f"-gencode=arch=compute_{ARCH[3:]},code={ARCH}", "--shared",
         "-Xcompiler", "-fPIC", f"-I{HEADERS}"]


def nvcc_path() -> str | None:
    """nvcc from CUDA_HOME / CUDA_PATH, else the PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    root = os.environ.get("OSTINATO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ostinato")
    return Path(root) / "cuda"


def build(source: Path, what: str, nvcc: str | None = None) -> Path:
    """The library built from `source`, compiling it first where the cache lacks this build. `what` names the user
    of the kernel in the error raised without nvcc."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise RuntimeError(f"{what} needs nvcc (CUDA_HOME, CUDA_PATH or PATH) to build its kernel")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(source.read_bytes() + version.encode() + " ".join(FLAGS).encode())
    for header in sorted(HEADERS.glob("*.cuh")):
        digest.update(header.read_bytes())
    out = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([nvcc, *FLAGS, "-o", str(tmp), str(source)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed on {source.name}:\n{done.stderr[-4000:]}")
        tmp.replace(out)  # atomic: another process building the same key sees a whole file or none
    return out
