"""SIGTERM: in-flight requests finish, the engine process is shut down, the server exits 0, no child is left."""

import signal
import threading
import time

import httpx
import pytest
from test_server_helpers import Server, alive, children


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_path):
    s = Server(tmp_path_factory.mktemp("server-sigterm") / "server.log", [tiny_llama_path], threads=1)
    yield s
    s.stop(timeout=10)


def test_sigterm_shuts_down_cleanly(server):
    kids = children(server.proc.pid)
    engine = server.engine_pid()
    result: dict[str, httpx.Response] = {}
    body = {"prompt": "The history of Rome", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    started = threading.Event()

    def in_flight() -> None:
        started.set()
        result["r"] = httpx.post(server.url + "/v1/completions", json=body, timeout=120)

    t = threading.Thread(target=in_flight)
    t.start()
    started.wait(5)
    time.sleep(1.0)  # let the request reach the engine
    server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    r = result["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"  # it finished

    assert server.proc.wait(60) == 0, server.log()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in kids if alive(p)], "a child process outlived the server"
    assert not alive(engine)
    log = server.log()
    assert "engine core shutting down" in log and "server stopped" in log
    assert "Traceback" not in log and "ERROR" not in log
