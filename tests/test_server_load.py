"""Load: 64 concurrent streaming clients (asyncio + httpx), a quarter of them disconnecting midway, and
non-streaming clients that give up before their answer.

Every stream that is read to the end must equal the greedy non-streamed answer for its prompt; afterwards
no request is left in the engine, every KV page is free, and the server log holds no error.
"""

import asyncio
import json
import time

import httpx
import pytest
from test_server_helpers import Server, metric

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The best way to learn a new language is",
    "def fibonacci(n):",
    "My favourite fruit is",
    "In the year 2050, cities will",
    "The recipe for pancakes starts with",
    "Three reasons to exercise daily:",
]
NUM_CLIENTS = 64
MAX_TOKENS = 24
# A give-up client's answer: long enough that it cannot be ready within GIVE_UP_S even on a fast CPU (the tiny
# model decodes one request at ~1 ms a step at best, so this is ~2 s of work against a 1 s wait)
LONG_ANSWER = 2000
GIVE_UP_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_path):
    # room for the give-up clients' long answers (LONG_ANSWER tokens each) beside the streams
    s = Server(tmp_path_factory.mktemp("server-load") / "server.log",
               [tiny_llama_path, "--max-model-len", "2048", "--max-total-tokens", "16384"], threads=1)
    yield s
    assert s.stop() == 0, s.log()


def body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}


async def reference(http: httpx.AsyncClient, prompt: str) -> str:
    r = await http.post("/v1/completions", json=body(prompt, False))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def stream(http: httpx.AsyncClient, prompt: str, disconnect_after: int | None) -> tuple[str, str | None]:
    """The streamed text and finish reason; gives up (closing the connection) after `disconnect_after` chunks."""
    text, finish, chunks = "", None, 0
    async with http.stream("POST", "/v1/completions", json=body(prompt, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text += c["text"]
                finish = c["finish_reason"] or finish
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                return text, "disconnected"
    return text, finish


async def gone_before_answer(http: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
    """A non-streaming client that stops waiting (closes its connection) long before the answer is ready."""
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/v1/completions", json={**body(prompt, False), "max_tokens": LONG_ANSWER},
                        timeout=GIVE_UP_S)
    return "", "disconnected"


async def run_load(url: str) -> None:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(240.0)) as http:
        refs = await asyncio.gather(*(reference(http, p) for p in PROMPTS))
        assert all(len(t) > 0 for t in refs)
        jobs = [stream(http, PROMPTS[i % len(PROMPTS)], 3 if i % 4 == 0 else None) for i in range(NUM_CLIENTS)]
        jobs += [gone_before_answer(http, p) for p in PROMPTS[:4]]
        results = await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)
    for i, (text, finish) in enumerate(results):
        if i % 4 == 0 or i >= NUM_CLIENTS:
            assert finish == "disconnected"
        else:
            assert (text, finish) == (refs[i % len(PROMPTS)], "length"), f"client {i}"


def test_many_streams_with_disconnects(server):
    t0 = time.monotonic()
    asyncio.run(run_load(server.url))
    # the aborted streams leave nothing behind: no request in the engine, every KV page free
    deadline = time.monotonic() + 30
    while True:
        m = httpx.get(server.url + "/metrics", timeout=10).text
        idle = metric(m, "ostinato:num_requests_running") == 0 and metric(m, "ostinato:num_requests_waiting") == 0
        free = metric(m, "ostinato:kv_cache_free_pages") == metric(m, "ostinato:kv_cache_total_pages")
        if (idle and free) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle and free, m
    assert metric(m, "ostinato:req_slots_free") == 96
    finished = metric(m, "ostinato:e2e_request_latency_seconds_count")
    assert finished == len(PROMPTS) + NUM_CLIENTS * 3 // 4  # the disconnected ones were aborted, not finished
    log = server.log()
    for bad in ("Traceback", "ERROR", "Exception", "exception"):
        assert bad not in log, log
    print(f"load test: {NUM_CLIENTS} streams in {time.monotonic() - t0:.1f} s")
