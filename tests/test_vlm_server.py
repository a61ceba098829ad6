"""A tiny Qwen2.5-VL behind `ostinato serve`, through the official openai client: image chats streamed and not,
two images in one message (a data: URL and an http URL served on 127.0.0.1), and the bad-input table."""

import base64
import functools
import http.server
import io
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

from test_server_helpers import Server  # noqa: E402

from tests.vlm_models import image, make_qwen2_5_vl  # noqa: E402


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A directory of images served over http on 127.0.0.1; yields (dir, base URL)."""
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(png(image(80, 120, 5)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory, media):
    model = make_qwen2_5_vl(str(tmp_path_factory.mktemp("vlm-model")))
    s = Server(tmp_path_factory.mktemp("vlm-server") / "server.log",
               [model, "--max-model-len", "64", "--chunked-prefill-size", "16", "--limit-mm-per-prompt", "2",
                "--allowed-local-media-path", str(media[0])])
    yield s, model
    s.stop()


@pytest.fixture(scope="module")
def client(vlm_server):
    return openai.OpenAI(base_url=vlm_server[0].url + "/v1", api_key="x", max_retries=0, timeout=120)


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": p[0]}}
               for p in parts]
    return [{"role": "user", "content": content}]


def test_image_chat_streamed_and_not_equal_offline(vlm_server, client):
    from ostinato import LLM, SamplingParams

    messages = user((data_url(image(100, 60, 1)),), " describe the image")
    full = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=5,
                                          temperature=0)
    stream = client.chat.completions.create(model=full.model, messages=messages, max_tokens=5, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content and full.usage.completion_tokens > 0
    offline = LLM(vlm_server[1], dtype="float32", device="cpu", max_total_tokens=256, max_model_len=64)
    ref = offline.chat(messages, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_two_images_in_one_message(client, media):
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=3, temperature=0,
        messages=user((data_url(image(56, 56, 2)),), " compare ", (f"{media[1]}/a.png",)))
    assert out.usage.prompt_tokens > 8 and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("urls, match", [
    (["data:image/png;base64," + base64.b64encode(b"not an image").decode()], "could not be decoded"),
    (["ftp://127.0.0.1/a.png"], "URL scheme 'ftp' is not allowed"),
    (["file:///etc/hostname"], "outside the allowed local media path"),
    (["HTTP/missing.png"], "could not fetch"),
    (["A", "A", "A"], "3 images, over the limit of 2"),
    (["BIG", "BIG"], "max_model_len=64"),
])
def test_bad_image_input_is_a_400(vlm_server, client, media, urls, match):
    big = data_url(image(1400, 1400, 3))
    sub = {"A": data_url(image(56, 56, 4)), "BIG": big, "HTTP/missing.png": f"{media[1]}/missing.png"}
    messages = user(*[(sub.get(u, u),) for u in urls], " hello")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=2)
    assert match in str(e.value) and e.value.body["param"] == "messages"
    # nothing leaked, the server still answers
    ok = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2,
                                        messages=user((sub["A"],), " hello"))
    assert ok.choices[0].message.content is not None
