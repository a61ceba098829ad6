"""The engine process dies: pending requests get a 503 in OpenAI's format instead of hanging, /health
turns 503, new requests get 503, and the server exits with a non-zero status."""

import json
import os
import signal
import threading
import time

import httpx
import pytest
from test_server_helpers import Server, alive


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_path):
    s = Server(tmp_path_factory.mktemp("server-death") / "server.log", [tiny_llama_path], threads=1)
    yield s
    s.stop(timeout=10)


LONG = {"prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_engine_death(server):
    results: dict[str, object] = {}
    first_chunk = threading.Event()

    def streaming() -> None:
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk.set()
        results["stream"] = lines

    def blocking() -> None:
        results["blocking"] = httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)

    threads = [threading.Thread(target=streaming), threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    assert first_chunk.wait(60)
    engine = server.engine_pid()
    os.kill(engine, signal.SIGKILL)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a pending request hangs after the engine died"

    # the pending non-streaming request: 503 in OpenAI's error format
    r = results["blocking"]
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "server_error" and "engine" in r.json()["error"]["message"]
    # the pending stream: an error event, then [DONE]
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][6:])

    # /health and new requests: 503 until the server exits
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.returncode == 1, server.log()
    assert not alive(engine)
    assert "exiting with status 1" in server.log()
