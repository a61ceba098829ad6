"""`ostinato serve` through the official openai client and raw HTTP: chat and completions, streaming and
not, stop strings, n with seeds, logprobs, usage, the Tokn batch endpoint, API key, and a table of bad inputs."""

import json
import re

import httpx
import openai
import pytest
from test_server_helpers import Server, metric

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server") / "server.log", ["--api-key", API_KEY])
    yield s
    assert s.stop() == 0, s.log()
    assert "Traceback" not in s.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat_text(client, content: str, **kw) -> tuple[str, object]:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)
    return r.choices[0].message.content, r


def stream_chat(client, content: str, **kw) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_greedy_stream_equals_non_stream_and_usage(client):
    q = "What is the capital of France?"
    text, r = chat_text(client, q, temperature=0, max_tokens=24, logprobs=True)
    assert "Paris" in text
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    n_tokens = len(r.choices[0].logprobs.content)  # one entry per generated token
    assert r.usage.completion_tokens == n_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    texts, finish, usage = stream_chat(client, q, temperature=0, max_tokens=24,
                                       stream_options={"include_usage": True})
    assert texts == {0: text} and finish == {0: r.choices[0].finish_reason}
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, n_tokens)


def test_completions_stream_equals_non_stream_and_usage(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=20, extra_body={"ignore_eos": True})
    r = client.completions.create(logprobs=2, **kw)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and len(c.text) > 10
    assert len(c.logprobs.tokens) == 20 and r.usage.completion_tokens == 20
    assert "".join(c.logprobs.tokens) == c.text
    text, usage = "", None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        text += "".join(ch.text for ch in chunk.choices)
        usage = chunk.usage or usage
    assert text == c.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, 20)
    # token-id prompts: prompt_tokens is their count
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens <= 3


def test_stop_strings(client):
    q = "Write a short poem about the sea."
    full, _ = chat_text(client, q, temperature=0, max_tokens=40)
    stop = full[12:17]
    text, r = chat_text(client, q, temperature=0, max_tokens=40, stop=[stop, "never-appears"])
    assert r.choices[0].finish_reason == "stop" and text == full[: full.index(stop)]
    texts, finish, _ = stream_chat(client, q, temperature=0, max_tokens=40, stop=stop)
    assert texts == {0: text} and finish == {0: "stop"}


def test_n_with_seed_is_reproducible(client):
    kw = dict(n=3, temperature=1.0, max_tokens=12, seed=7)
    _, a = chat_text(client, "Tell me a joke.", **kw)
    _, b = chat_text(client, "Tell me a joke.", **kw)
    ta = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert ta == [c.message.content for c in b.choices]
    assert len(set(ta)) > 1
    texts, _, _ = stream_chat(client, "Tell me a joke.", **kw)
    assert [texts[i] for i in range(3)] == ta
    _, other = chat_text(client, "Tell me a joke.", n=3, temperature=1.0, max_tokens=12, seed=8)
    assert [c.message.content for c in other.choices] != ta


def test_chat_logprobs_and_penalties(client):
    _, r = chat_text(client, "Count from one to ten.", temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token  # greedy: the sampled token is the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    kw = dict(temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    plain, _ = chat_text(client, "Say the word 'yes' many times.", **kw)
    penal, _ = chat_text(client, "Say the word 'yes' many times.", frequency_penalty=2.0, presence_penalty=1.0, **kw)
    assert plain != penal
    assert len(set(penal.split())) > len(set(plain.split()))  # penalties push towards new words
    repeat_kw = dict(kw, extra_body={"ignore_eos": True, "repetition_penalty": 1.5})  # vLLM's extra field
    repeat, _ = chat_text(client, "Say the word 'yes' many times.", **repeat_kw)
    assert repeat != plain and len(set(repeat.split())) > len(set(plain.split()))


def test_tokn_batch_endpoint(server, client):
    prompts = ["The capital of France is", "1, 2, 3,"]
    r = httpx.post(server.url + "/completions", json={"prompts": prompts, "temperature": 0, "max_tokens": 8},
                   headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"0", "1"}
    for i, p in enumerate(prompts):
        ref = client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8).choices[0].text
        assert out[str(i)] == ref


def test_raw_sse_format(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


LONG = "word " * 600
BAD_INPUTS = [
    # (path, body (dict, or str sent raw), headers, status, message fragment, param)
    ("/v1/completions", '{"prompt": "hi",', AUTH, 400, "Malformed JSON", None),
    ("/v1/completions", "[1, 2]", AUTH, 400, "JSON object", None),
    ("/v1/completions", {"max_tokens": 3}, AUTH, 400, "Field required", "prompt"),
    ("/v1/chat/completions", {"model": MODEL}, AUTH, 400, "Field required", "messages"),
    ("/v1/chat/completions", {"messages": []}, AUTH, 400, "must not be empty", "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, AUTH, 400, "Field required", "messages.0.role"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, AUTH, 400, "temperature must be >= 0", "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, AUTH, 400, "valid number", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, AUTH, 400, "top_p must be in (0, 1]", "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, AUTH, 400, "top_k must be", "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, AUTH, 400, "min_p must be in [0, 1]", "min_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, AUTH, 400, "n must be an int >= 1", "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, AUTH, 400, "max_tokens must be >= 1", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, AUTH, 400, "in [-2, 2]", "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, AUTH, 400, "in [-2, 2]", "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, AUTH, 400, "must be > 0", "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, AUTH, 400, "at most 20", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, AUTH, 400, "non-empty strings", "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": "abc"}, AUTH, 400, "valid integer", "seed"),
    # ints past int64 (the engine's messages carry int64) are refused by name, not a 500 from the IPC layer
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, AUTH, 400, "[-2**63, 2**63 - 1]", "seed"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**70}, AUTH, 400, "top_k must be", "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, AUTH, 400, "[0, 2**63 - 1]", "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, AUTH, 400, "not supported", "suffix"),
    ("/v1/completions", {"prompt": ""}, AUTH, 400, "must not be empty", "prompt"),
    ("/v1/completions", {"prompt": [1, 49152]}, AUTH, 400, "outside the vocabulary", "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, AUTH, 400, "max_model_len=512", "max_tokens"),
    ("/v1/completions", {"prompt": LONG}, AUTH, 400, "max_model_len=512", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, AUTH, 400, "max_model_len=512",
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, AUTH,
     400, "max_completion_tokens must be >= 1", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 30}, AUTH, 400, "at most 20", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, AUTH, 400,
     "needs logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": 5}, AUTH, 400,
     "", "stream_options"),
    # a lone UTF-16 surrogate escape (valid JSON, not valid Unicode): a 400 naming where, not a tokenizer's 500
    ("/v1/completions", '{"prompt": "hi \\ud800"}', AUTH, 400, "not valid Unicode", "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": '
                             '[{"type": "text", "text": "\\udfff"}]}]}', AUTH, 400, "lone UTF-16 surrogate",
     "messages[1].content[0].text"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, AUTH, 400, "keys must be token ids", "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, AUTH, 400, "content: missing", "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": None}]},
     AUTH, 400, "required for a user message", "messages[1].content"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, AUTH, 400, "in [-100, 100]", "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"49152": 1}}, AUTH,
     400, "outside the vocabulary", "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     AUTH, 400, "response_format.type: one of text, json_object, json_schema", "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, AUTH, 400,
     "a JSON schema object is required", "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "("}, AUTH, 400, "the regex constraint does not compile",
     "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a"], "guided_regex": "b"}, AUTH, 400,
     "give one structured-output constraint", "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, AUTH, 400,
     "exactly one of", "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": True, "disable_whitespace": True}},
     AUTH, 400, "the fields are json, json_object, regex, choice, grammar, disable_any_whitespace",
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": True, "disable_any_whitespace": "y"}},
     AUTH, 400, "structured_outputs.disable_any_whitespace: a boolean", "structured_outputs"),
    ("/completions", {"max_tokens": 3}, AUTH, 400, "Field required", "prompts"),
    ("/completions", {"prompts": []}, AUTH, 400, "must not be empty", "prompts"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, AUTH, 404, "does not exist", "model"),
    ("/v1/completions", {"prompt": "hi"}, {}, 401, "API key", None),
    ("/v1/chat/completions", {"messages": []}, {"Authorization": "Bearer wrong"}, 401, "API key", None),
    ("/completions", {"prompts": ["hi"]}, {"Authorization": "wrong"}, 401, "API key", None),
    ("/tokenize", {"prompt": "hi"}, {}, 401, "API key", None),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, AUTH, 400, "give one of them",
     "prompt"),
    ("/tokenize", {}, AUTH, 400, "give one of them", "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     AUTH, 400, "text only", "messages"),
    ("/detokenize", {"tokens": [1, 49152]}, AUTH, 400, "outside the vocabulary", "tokens"),
    ("/detokenize", {"tokens": "abc"}, AUTH, 400, "valid list", "tokens"),
]


@pytest.mark.parametrize("path,body,headers,status,fragment,param", BAD_INPUTS,
                         ids=[f"{i}-{b[0]}-{b[3]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input(server, path, body, headers, status, fragment, param):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + path, headers={"Content-Type": "application/json", **headers}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"]
    assert err["param"] == param


def test_null_fields_and_escaped_emoji_are_accepted(server):
    """What OpenAI's schema allows is not refused: null for n / stream / echo / logprobs (the defaults), and a
    surrogate pair escape (json.dumps writes an emoji that way) beside the lone ones refused above."""
    for path, body in (
        ("/v1/completions", {"prompt": "hi \U0001F600", "n": None, "stream": None, "echo": None, "max_tokens": 2,
                             "temperature": None, "stop": None, "seed": None, "logprobs": None}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \U0001F600"}], "n": None,
                                  "stream": None, "logprobs": None, "max_tokens": 2}),
    ):
        raw = json.dumps(body)  # ensure_ascii: the emoji as \ud83d\ude00
        assert "\\ud83d\\ude00" in raw
        r = httpx.post(server.url + path, headers={"Content-Type": "application/json", **AUTH}, content=raw, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1


def test_logit_bias_through_the_client(client, smollm_path):
    """OpenAI's logit_bias (token ids as string keys): +100 forces a token at every position, -100 on the
    greedy picks makes greedy take others, in completions and chat."""
    from ostinato.loader import load_model_source

    tok = load_model_source(smollm_path).tokenizer
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    picks = tok.encode(plain, add_special_tokens=False)
    banned = client.completions.create(**kw, logit_bias={str(t): -100 for t in picks}).choices[0].text
    assert not set(tok.encode(banned, add_special_tokens=False)) & set(picks), (plain, banned)
    x = tok.encode(" Paris", add_special_tokens=False)[0]
    forced = client.completions.create(**kw, logit_bias={str(x): 100}).choices[0].text
    assert forced == tok.decode([x] * 6), forced
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0.8, seed=1, logit_bias={str(x): 100})
    assert chat.choices[0].message.content == tok.decode([x] * 4)


def test_echo_with_logprobs_as_lm_eval_asks(client, hf_model):
    """`echo` with `logprobs` (lm-evaluation-harness's loglikelihood request: token ids, max_tokens 1): the
    prompt's tokens come back with their logprobs (null for the first), matching transformers' float32
    log_softmax; the text is the prompt's plus the completion's; streaming gives the same."""
    import torch

    ids = [504, 3458, 282, 4649, 314, 1392, 9054, 30, 2050, 44, 991, 4321]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1 : len(ids)], want, strict=True)) < 1e-3
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])

    prompt = "The capital of France is"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(**{**kw, "echo": False})
    echoed = client.completions.create(**kw)
    assert echoed.choices[0].text == prompt + plain.choices[0].text and echoed.choices[0].logprobs is None
    with_lp = client.completions.create(**kw, logprobs=1).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, logprobs=1, stream=True) if c.choices]
    assert chunks[0].text.startswith(prompt)
    assert "".join(c.text for c in chunks) == with_lp.text == echoed.choices[0].text
    streamed = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed == with_lp.logprobs.token_logprobs
    assert len(streamed) == len(with_lp.logprobs.tokens) > 4


def test_structured_outputs_through_the_client(server, client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's guided_choice / structured_outputs, through
    the official client, streaming and not: the outputs obey their constraints."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": [" yes", " no"]})
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A year?"}], stream=True, max_tokens=10,
        extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}}) if c.choices)
    assert re.fullmatch("(19|20)[0-9]{2}", text), text
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{")
    # logprobs beside a mask: the alternatives it rules out have logprob -inf, which JSON cannot carry
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=4, temperature=0,
                                  logprobs=5, extra_body={"guided_choice": [" yes", " no"]})
    tops = [v for alts in r.choices[0].logprobs.top_logprobs for v in alts.values()]
    assert min(tops) == -9999.0 and all(v <= 0 for v in tops)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"guided_regex": "[0-9]"})
    assert min(t.logprob for c in r.choices[0].logprobs.content for t in c.top_logprobs) == -9999.0
    # a constraint that does not compile, in a stream (already begun: an error chunk), named as the client did
    raw = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "guided_regex": "[a-"}).text
    err = json.loads(raw.split("\n\n")[0].removeprefix("data: "))["error"]
    assert err["param"] == "guided_regex" and "does not compile" in err["message"] and raw.endswith("[DONE]\n\n")


def test_tokenize_and_detokenize(server, client, smollm_path):
    """vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize: the ids generation
    takes, and back; the chat form's count is the prompt_tokens a chat completion reports."""
    from ostinato.loader import load_model_source

    tok = load_model_source(smollm_path).tokenizer
    text = "The capital of France is Paris."
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=AUTH, timeout=30).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=AUTH, timeout=30).json()
    assert back == {"prompt": tok.decode(r["tokens"])}
    msgs = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, headers=AUTH, timeout=30).json()
    used = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens
    assert r["count"] == used


def test_client_errors_map_to_openai_exceptions(server, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_repeated_prompt_reports_cached_tokens(server, client):
    kw = dict(model=MODEL, prompt="A long shared preamble about the history of the Roman Empire and its roads. " * 3,
              temperature=0, max_tokens=4)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    n = second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < n - 1
    assert n - 1 - 16 < second.usage.prompt_tokens_details.cached_tokens <= n - 1  # all but the last (page-aligned)
    assert second.choices[0].text == first.choices[0].text
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": kw["prompt"]}],
                                       temperature=0, max_tokens=2)
    r2 = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": kw["prompt"]}],
                                        temperature=0, max_tokens=2)
    assert r2.usage.prompt_tokens_details.cached_tokens > r.usage.prompt_tokens_details.cached_tokens
    m = httpx.get(server.url + "/metrics").text
    assert 0 < metric(m, "ostinato:prefix_cache_hits_total") < metric(m, "ostinato:prefix_cache_queries_total")
    assert 0 < metric(m, "ostinato:prefix_cache_hit_rate") < 1
    assert metric(m, "ostinato:prefix_cache_evictable_tokens") > 0


def test_still_serves_after_bad_inputs(server, client):
    text, r = chat_text(client, "What is the capital of France?", temperature=0, max_tokens=16)
    assert "Paris" in text
    m = httpx.get(server.url + "/metrics").text
    assert metric(m, "ostinato:kv_cache_free_pages") == metric(m, "ostinato:kv_cache_total_pages")
    assert metric(m, "ostinato:num_requests_running") == 0
    assert metric(m, "ostinato:generation_tokens_total") > 0
    assert "ostinato:time_to_first_token_seconds_bucket" in m and "ostinato:e2e_request_latency_seconds_count" in m
