"""Small Linux process helpers shared by the engine's and the server's child processes."""

import ctypes
import signal
import sys

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


def _prctl(option: int, arg: int | bytes) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
        except (OSError, AttributeError):
            pass


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so a killed server leaves nothing behind."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def set_process_name(name: str) -> None:
    """Linux: the name `top` and /proc/<pid>/comm show (15 bytes at most)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])
