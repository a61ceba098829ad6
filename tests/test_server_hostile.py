"""`ostinato serve` against hostile and odd requests: a body cap (413 before parsing), a character check
before templating and tokenizing, `n` capped and fair-shared, vLLM fields that would be silently dropped,
content types, the bearer scheme, /metrics before the first request, and a wrong model path.

The demonstrative test streams one client's reply while others send a 50 MB body, a 20 MB JSON prompt (under
the cap: parsed and refused off the event loop) and a request with `n` at the cap, and measures that the
stream's largest gap between chunks stays under 0.5 s.
"""

import json
import multiprocessing
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server_helpers import Server, metric

API_KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_N = 8
WINDOW = 3  # --max-choices-in-engine
MAX_RUNNING = 96  # SERVER_ARGS' --max-running-requests
MIB = 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_path):
    s = Server(tmp_path_factory.mktemp("server-hostile") / "server.log",
               [tiny_llama_path, "--api-key", API_KEY, "--max-n", str(MAX_N), "--max-choices-in-engine", str(WINDOW)],
               threads=1)
    yield s
    assert s.stop() == 0, s.log()
    assert "Traceback" not in s.log()


def post(server, path: str, body, headers=AUTH, timeout: float = 60) -> httpx.Response:
    content = body if not isinstance(body, dict) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json", **headers},
                      timeout=timeout)


def assert_error(r: httpx.Response, status: int, param: str | None, fragment: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and fragment in err["message"], err
    return err


def test_metrics_report_real_totals_before_the_first_request(server):
    # the first test of the module: nothing has been sent to the engine yet
    deadline = time.monotonic() + 10
    while True:
        m = httpx.get(server.url + "/metrics").text
        if metric(m, "ostinato:kv_cache_total_pages") > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert metric(m, "ostinato:kv_cache_total_pages") == 8192 // 4  # --max-total-tokens 8192 --page-size 4
    assert metric(m, "ostinato:kv_cache_free_pages") == metric(m, "ostinato:kv_cache_total_pages")
    assert metric(m, "ostinato:req_slots_free") == MAX_RUNNING
    assert metric(m, "ostinato:kv_cache_usage_perc") == 0.0
    assert metric(m, "ostinato:num_requests_running") == 0


def test_body_over_the_cap_is_413_before_parsing(server):
    big = b"{" + b" " * (33 * MIB) + b"}"  # over the 32 MiB default; valid JSON, never parsed
    assert_error(post(server, "/v1/chat/completions", big), 413, None, f"limit of {32 * MIB} bytes")

    def chunked():  # no Content-Length: the bytes are counted as they stream in
        for _ in range(40):
            yield b" " * MIB

    err = assert_error(post(server, "/v1/completions", chunked()), 413, None, "--max-request-body-bytes")
    assert err["code"] == "request_too_large"


def test_text_longer_than_any_context_is_refused_before_tokenizing(server):
    huge = "word " * 200_000  # 1M characters for max_model_len=512
    for path, body, param in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ("/v1/completions", {"prompt": huge}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", huge]}, "prompt"),
        ("/completions", {"prompts": ["hi", huge]}, "prompts"),
    ]:
        err = assert_error(post(server, path, body), 400, param, "characters cannot fit")
        assert err["code"] == "context_length_exceeded" and "max_model_len=512" in err["message"]
    # below the character bound the tokenizer decides, as before
    assert_error(post(server, "/v1/completions", {"prompt": "word " * 600}), 400, "prompt", "tokens leave no room")


BAD = [
    ({"n": MAX_N + 1}, "n", f"at most {MAX_N}"),
    # structured outputs are served (tests/test_structured_outputs.py); constraints that cannot be are refused
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "the json constraint does not compile"),
    ({"guided_regex": "[a-z"}, "guided_regex", "the regex constraint does not compile"),
    ({"guided_choice": []}, "guided_choice", "a non-empty list"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "the grammar constraint does not compile"),
    ({"response_format": {"type": "yaml"}}, "response_format", "one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "a JSON schema object is required"),
    ({"use_beam_search": True}, "use_beam_search", "beam search"),
    ({"best_of": 3}, "best_of", "best_of == n"),
    ({"messages": [{"role": "banana", "content": "hi"}]}, "messages[0].role", "allowed: system, user"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("extra,param,fragment", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_refused_fields_name_themselves(server, path, extra, param, fragment):
    if path == "/v1/completions" and param.startswith("messages"):
        pytest.skip("chat only")
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    assert_error(post(server, path, {**base, "max_tokens": 2, **extra}), 400, param, fragment)


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_temperature_must_be_finite(server, value):
    r = post(server, "/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "temperature": {value}}}')
    assert_error(r, 400, "temperature", "finite")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_non_json_content_type_is_415(server, content_type):
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 2}),
                   headers={**AUTH, "Content-Type": content_type}, timeout=30)
    assert_error(r, 415, None, "application/json")


def test_bearer_scheme_is_case_insensitive(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert post(server, "/v1/completions", body, {"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    assert post(server, "/v1/completions", body, {"Authorization": f"Basic {API_KEY}"}).status_code == 401
    assert post(server, "/v1/completions", body, {"Authorization": "bearer wrong"}).status_code == 401
    # no Content-Type at all is taken as JSON (curl -d sends form-urlencoded, which is refused above)
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(body), headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def victim_stream(url: str, results, started, done) -> None:
    """One well-behaved client, in a process of its own (another client, not a thread sharing the hostile
    senders' interpreter): streamed completions one after another until `done`, recording the gaps between
    the chunks of each stream and each stream's time to its first chunk."""
    body = {"prompt": "The history of the printing press", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    gaps, first_chunk_s, texts = [], [], []
    while not done.is_set():
        t0 = time.monotonic()
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            assert r.status_code == 200
            last = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is None:
                    first_chunk_s.append(now - t0)
                else:
                    gaps.append(now - last)
                last = now
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                started.set()
    results.put((gaps, first_chunk_s, texts))


def test_stream_stays_smooth_under_hostile_requests(server):
    ctx = multiprocessing.get_context("fork")
    started, done, victim_results = ctx.Event(), ctx.Event(), ctx.Queue()
    victim = ctx.Process(target=victim_stream, args=(server.url, victim_results, started, done))
    victim.start()
    assert started.wait(60)
    results: dict[str, httpx.Response] = {}
    running: list[float] = []
    answer_s: list[float] = []

    def hostile(name: str, path: str, body) -> None:
        results[name] = post(server, path, body, timeout=240)

    fat_prompt = json.dumps({"prompt": "x" * (20 * MIB), "max_tokens": 2})  # under the cap: parsed, then refused
    jobs = [
        threading.Thread(target=hostile, args=("50MB", "/v1/chat/completions", b" " * (50 * MIB))),
        threading.Thread(target=hostile, args=("20MB", "/v1/completions", fat_prompt)),
        threading.Thread(target=hostile, args=("n", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Tell me a joke."}], "n": MAX_N, "max_tokens": 4,
            "temperature": 1.0, "ignore_eos": True, "seed": 1})),
    ]
    for j in jobs:
        j.start()
    while any(j.is_alive() for j in jobs):
        t = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        answer_s.append(time.monotonic() - t)
        m = httpx.get(server.url + "/metrics", timeout=30).text
        running.append(metric(m, "ostinato:num_requests_running"))
        time.sleep(0.05)
    for j in jobs:
        j.join()
    done.set()
    gaps, first_chunk_s, texts = victim_results.get(timeout=120)
    victim.join(30)
    assert_error(results["50MB"], 413, None, "--max-request-body-bytes")
    assert_error(results["20MB"], 400, "prompt", "characters cannot fit")
    r = results["n"]
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(MAX_N))
    assert all(c["finish_reason"] == "length" and c["message"]["content"] for c in choices)
    assert len({c["message"]["content"] for c in choices}) > 1  # independent samples
    # fair share: the n request never held more than WINDOW slots (+1: the victim)
    assert max(running) <= WINDOW + 1, running
    assert len(texts) >= 10 and gaps, texts
    gaps.sort()
    print(f"\nvictim: {len(gaps) + len(first_chunk_s)} chunks in {len(first_chunk_s)} streams; inter-chunk gap "
          f"p50 {gaps[len(gaps) // 2] * 1e3:.1f} ms, p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms, worst "
          f"{gaps[-1] * 1e3:.1f} ms; first chunk worst {max(first_chunk_s) * 1e3:.1f} ms; "
          f"/health worst {max(answer_s) * 1e3:.1f} ms")
    # The victim streamed from before the hostile requests began until after they were answered (its loop ends
    # only with a stream that finished after `done`), so its gaps span the whole attack. On 2 shared cores the
    # worst gap measured 89-165 ms (p50 4-5 ms) with the tiny model and one engine thread; before the fixes a
    # 50 MB body froze the stream and /health for 32-40 s. /health is timed from this process, whose GIL the
    # upload threads share, hence its looser bound (0.3-0.65 s measured).
    assert gaps[-1] < 0.5, f"largest inter-chunk gap {gaps[-1]:.3f} s; gaps {gaps[-5:]}"
    assert max(answer_s) < 2.0, f"/health answered in up to {max(answer_s):.3f} s"


def test_serve_with_a_missing_model_fails_before_starting_the_engine(tmp_path):
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ostinato", "serve", str(tmp_path / "nonexistent")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if "does not exist" in line]
    assert len(errors) == 1 and errors[0].startswith("ostinato: error: model:"), p.stderr
    assert "engine" not in p.stderr.lower()
    assert time.monotonic() - t < 60
