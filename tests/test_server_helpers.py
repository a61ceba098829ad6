"""Start `ostinato serve` (SmolLM2 unless a model path is the first extra argument, CPU) as a subprocess on a free
loopback port; no tests here.

Every test module that needs a server starts one and shares it; all traffic goes to 127.0.0.1.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# one HTTP process unless a test asks for more (the default depends on the machine's cores)
SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--max-total-tokens", "8192", "--page-size", "4",
               "--max-model-len", "512", "--max-running-requests", "96", "--api-server-count", "1"]
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    def __init__(self, log_path: Path, extra_args: list[str] = (), threads: int | None = None) -> None:
        """`threads`: the server's torch/OpenMP threads (default: torch's choice). One keeps a tiny model's
        steps short on a small shared CPU, where a second OpenMP thread waits on a core other processes hold."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "ostinato", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *SERVER_ARGS, *extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        pids = [p for p in children(self.proc.pid) if "spawn_main" in cmdline(p)]
        assert len(pids) == 1, f"expected one engine process, found {pids}"
        return pids[0]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL past `timeout`; also kills any child left behind. Returns the exit code."""
        kids = children(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-or-single-series metric line `name{...} value`."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_engine_step_counters_in_metrics():
    from ostinato.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("m")
    base = {"running": 1, "waiting": 0, "kv_free_pages": 10, "kv_total_pages": 20, "req_slots_free": 3,
            "req_slots_total": 4, "num_retractions": 0}
    m.on_stats({**base, "extend_steps": 2, "decode_steps": 5, "extend_tokens": 300, "decode_tokens": 9,
                "extend_seconds": 0.5, "decode_seconds": 0.25})
    m.on_stats({**base, "extend_steps": 3, "decode_steps": 7, "extend_tokens": 310, "decode_tokens": 13,
                "extend_seconds": 0.75, "decode_seconds": 0.5})
    text = m.render().decode()
    assert 'ostinato:engine_steps_total{mode="decode",model_name="m"} 7.0' in text
    assert 'ostinato:engine_step_tokens_total{mode="extend",model_name="m"} 310.0' in text
    assert 'ostinato:engine_step_seconds_total{mode="decode",model_name="m"} 0.5' in text
