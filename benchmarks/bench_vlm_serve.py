"""TTFT of image chats through `ostinato serve`, vision-encoder CUDA graphs off then on, in one run.

For each configuration the script starts `ostinato serve` as a subprocess, waits for /health, sends warm-up
chats (image sizes outside the measured set), then passes over one fixed set of images (seeded, several sizes in
224-1344 px, JPEG data: URLs), each request a streamed chat with one image and `max_tokens` tokens:

    c1-pass1..N   `--serial-requests` chats one at a time (each its own encoder batch: the graph key is one image)
    cK-pass1..N   `--num-requests` chats, `--concurrency` K at a time (encoder batches of several requests)

Graphs capture a key on its second sight, so pass 1 runs eagerly, pass 2 pays the captures and pass 3 replays;
the `captures` / `capture_ms` columns count the server's "captured a vision-encoder graph" log lines of the
pass. Every pass opens its prompts with its own text, so no pass reuses an earlier one's image K/V from the
prefix cache (the encoder runs for every request). TTFT is from sending the request to the first chunk that
carries a generated token (the role chunk before it does not count).

Dummy presets ship no tokenizer, and the server's chat endpoint needs one (its chat template and the image
placeholder tokens): for a preset the script writes a model dir, the preset's config.json plus a word-level
tokenizer built offline whose ids cover the whole vocabulary with Qwen's special tokens at Qwen's ids, and
serves it with `--load-format dummy` (the weights are the preset's dummy init; the image processor is the
one the server makes for a dir without preprocessor_config.json: the model's at the released bounds).

    python benchmarks/bench_vlm_serve.py                                   # qwen2.5-vl-3b, bf16, GPU
    python benchmarks/bench_vlm_serve.py --model qwen3-vl-2b
    python benchmarks/bench_vlm_serve.py --model /tmp/tiny-vl --load-format auto --device cpu --dtype float32 \\
        --num-requests 4 --serial-requests 2 --concurrency 2 --max-model-len 512   # a CPU smoke run

The client is the standard library only (http.client + threads): the server needs fastapi/uvicorn, the client
nothing.
"""

import argparse
import base64
import glob
import http.client
import io
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from common import device_tag
from PIL import Image

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SIDES = (224, 448, 672, 896, 1120, 1344)  # image sides in px: each image is a random (w, h) pair of these
WARMUP_SIZES = ((336, 336), (560, 392))  # not in the measured set (multiples of 28 and 16 alike)
# Qwen2/2.5/3-VL tokenizer ids of the special tokens the chat template and the image placeholders use
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                 "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655,
                 "<|video_pad|>": 151656}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CAPTURED = re.compile(r"captured a vision-encoder graph for (\d+) patches in ([\d.]+) ms")


# ------------------------------------------------------------------------------------------ model dir
def preset_model_dir(preset: str, root: str) -> str:
    """A model dir for a dummy preset: its config and an offline word-level tokenizer covering every id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ostinato.loader.dummy import list_presets, preset_path

    path = preset_path(preset)
    if path is None:
        raise ValueError(f"model: {preset!r} is neither a directory nor a dummy preset ({', '.join(list_presets())})")
    with open(path) as f:
        config = json.load(f)
    for key, name in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                      ("vision_end_token_id", "<|vision_end|>")):
        if config.get(key) != QWEN_SPECIALS[name]:
            raise ValueError(f"{preset}: {key} is {config.get(key)}, not Qwen's {QWEN_SPECIALS[name]}")
    vocab_size = config.get("vocab_size") or config["text_config"]["vocab_size"]
    words = {i: f"t{i}" for i in range(vocab_size)}
    words.update({0: "<unk>", 1: "user", 2: "assistant", 3: "system"})
    words.update({i: t for t, i in QWEN_SPECIALS.items()})
    tok = Tokenizer(models.WordLevel({t: i for i, t in words.items()}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(QWEN_SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    out = os.path.join(root, preset)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    fast.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`ostinato serve` in its own process group, its output in `log_path`."""

    def __init__(self, model: str, args: list[str], log_path: str, timeout_s: float) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "ostinato", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               *args]
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.tail()}")
            try:
                status, _ = get(self.port, "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready in {timeout_s:.0f} s:\n{self.tail()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM to the server (it shuts its engine down), then SIGKILL to whatever of its group is left after
        60 s: the next configuration's server needs the GPU memory back."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 20
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self._log.close()


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group `pgid` (Linux /proc)."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------ client
def make_images(n: int, seed: int) -> list[tuple[tuple[int, int], str]]:
    """n ((w, h), JPEG data: URL) of random noise, sizes drawn from SIDES x SIDES."""
    rng = np.random.default_rng(seed)
    return [image_url(int(rng.choice(SIDES)), int(rng.choice(SIDES)), rng) for _ in range(n)]


def image_url(w: int, h: int, rng: np.random.Generator) -> tuple[tuple[int, int], str]:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return (w, h), "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(port: int, model: str, prefix: str, url: str, max_tokens: int) -> dict:
    """One streamed image chat: TTFT (to the first chunk with a generated token), latency, output tokens."""
    body = json.dumps({
        "model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [{"type": "text", "text": prefix},
                                                  {"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "describe the image"}]}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    ttft = None
    usage = None
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
        while line := r.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if ttft is None and "role" not in c["delta"] and ("content" in c["delta"] or c["finish_reason"]):
                    ttft = time.perf_counter() - t0
    finally:
        conn.close()
    if ttft is None or usage is None:
        raise RuntimeError("stream ended without a generated token or without usage")
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "output_tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation), of a non-empty list."""
    return float(np.percentile(np.asarray(xs), q))


def pass_prefixes(model_dir: str, n: int, words: int = 4) -> list[str]:
    """n texts of `words` words each, no word in two of them, every word one token of the served tokenizer: a
    pass's prompts open with its own text, so its images' K/V never comes from the prefix cache."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    vocab = sorted((i, t) for t, i in tok.get_vocab().items() if i not in special and re.fullmatch(r"[a-z0-9]+", t))
    pool = []
    for i, t in vocab:  # in id order, until enough
        if len(pool) == n * words:
            break
        if tok.encode(" " + t, add_special_tokens=False) == [i]:
            pool.append(t)
    if len(pool) < n * words:
        raise ValueError(f"model: its tokenizer has {len(pool)} plain one-token words, {n * words} needed")
    return [" ".join(pool[k * words:(k + 1) * words]) for k in range(n)]


def run_pass(server: Server, model: str, name: str, prefix: str, images: list, concurrency: int,
             max_tokens: int) -> dict:
    """All `images` as chats, `concurrency` at a time, each prompt opening with `prefix`."""
    log_start = len(server.log())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda u: chat(server.port, model, prefix, u[1], max_tokens), images))
    wall = time.perf_counter() - t0
    caps = [(int(p), float(ms)) for p, ms in CAPTURED.findall(server.log()[log_start:])]
    ttft = [r["ttft_s"] * 1e3 for r in res]
    n_out = sum(r["output_tokens"] for r in res)
    row = {"pass": name, "requests": len(res), "concurrency": concurrency, "seconds": round(wall, 3),
           "ttft_ms": {"mean": round(statistics.fmean(ttft), 2),
                       **{f"p{q}": round(pct(ttft, q), 2) for q in (50, 90, 99)}},
           "latency_ms_mean": round(statistics.fmean(r["latency_s"] for r in res) * 1e3, 2),
           "output_tokens": n_out, "output_tok_s": round(n_out / wall, 1),
           "prompt_tokens_mean": round(statistics.fmean(r["prompt_tokens"] for r in res), 1),
           "captures": len(caps), "capture_ms": round(sum(ms for _, ms in caps), 1),
           "captured_keys": sorted({p for p, _ in caps})}
    t = row["ttft_ms"]
    print(f"  {name:10s} {len(res):3d} req x{concurrency:<3d} {wall:7.2f} s  TTFT mean {t['mean']:8.1f}  p50 "
          f"{t['p50']:8.1f}  p90 {t['p90']:8.1f}  p99 {t['p99']:8.1f} ms  {row['output_tok_s']:7.1f} out tok/s  "
          f"captures {len(caps):2d} ({row['capture_ms']:.0f} ms)", flush=True)
    return row


def run_config(name: str, model: str, server_args: list[str], images: list, args, log_dir: str) -> dict:
    server = Server(model, server_args, os.path.join(log_dir, f"vlm_serve-server-{name}.log"), args.start_timeout)
    try:
        print(f"[{name}] server ready in {server.startup_s:.1f} s", flush=True)
        _, body = get(server.port, "/v1/models")
        served = json.loads(body)["data"][0]["id"]
        prefixes = iter(pass_prefixes(model, 2 + 2 * args.passes))
        rng = np.random.default_rng(args.seed + 1)
        warm = [image_url(w, h, rng) for w, h in WARMUP_SIZES]
        t0 = time.perf_counter()
        for _ in range(2):  # twice: with graphs, the second sight of the warm-up sizes captures them
            prefix = next(prefixes)
            for _, url in warm:
                chat(server.port, served, prefix, url, args.max_tokens)
        out = {"config": name, "server_args": server_args, "startup_s": round(server.startup_s, 1),
               "warmup_s": round(time.perf_counter() - t0, 2), "passes": []}
        serial = images[:args.serial_requests]
        for p in range(1, args.passes + 1):
            if serial:
                out["passes"].append(run_pass(server, served, f"c1-pass{p}", next(prefixes), serial, 1,
                                                  args.max_tokens))
        for p in range(1, args.passes + 1):
            out["passes"].append(run_pass(server, served, f"c{args.concurrency}-pass{p}", next(prefixes), images,
                                          args.concurrency, args.max_tokens))
        return out
    finally:
        server.stop()


def print_table(configs: list[dict]) -> None:
    print(f"\n{'config':8s} {'pass':12s} {'req':>4s} {'sec':>7s} {'TTFT mean':>10s} {'p50':>8s} {'p90':>8s} "
          f"{'p99':>8s} {'tok/s':>8s} {'capt':>5s} {'capt ms':>8s}")
    for c in configs:
        for r in c["passes"]:
            t = r["ttft_ms"]
            print(f"{c['config']:8s} {r['pass']:12s} {r['requests']:4d} {r['seconds']:7.2f} {t['mean']:10.1f} "
                  f"{t['p50']:8.1f} {t['p90']:8.1f} {t['p99']:8.1f} {r['output_tok_s']:8.1f} {r['captures']:5d} "
                  f"{r['capture_ms']:8.0f}")
    if len(configs) == 2:
        print("\nTTFT mean, graphs off / on:  " + "  ".join(
            f"{a['pass']} x{a['ttft_ms']['mean'] / b['ttft_ms']['mean']:.2f}"
            for a, b in zip(configs[0]["passes"], configs[1]["passes"], strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-vl-3b", help="a dummy VLM preset (qwen2.5-vl-3b, qwen3-vl-2b) or "
                    "a model dir with a tokenizer")
    ap.add_argument("--load-format", default=None, help="default: dummy for a preset, else auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--configs", nargs="+", choices=["off", "on"], default=["off", "on"],
                    help="vision-encoder CUDA graphs off and/or on (--enable-vit-cuda-graph)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--serial-requests", type=int, default=16, help="chats of the concurrency-1 passes (0: none)")
    ap.add_argument("--passes", type=int, default=3, help="passes over the same images per concurrency")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--server-args", default="", help="more `ostinato serve` arguments, one string")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # `timeout` sends SIGTERM: exit through the finally blocks that stop the server (its own session would
    # otherwise outlive this process and keep the GPU)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.serial_requests > args.num_requests:
        ap.error("--serial-requests: at most --num-requests")

    tmp = tempfile.TemporaryDirectory(prefix="bench-vlm-serve-")
    if os.path.isdir(args.model):
        model, load_format = args.model, args.load_format or "auto"
    else:
        model, load_format = preset_model_dir(args.model, tmp.name), args.load_format or "dummy"
    t0 = time.perf_counter()
    images = make_images(args.num_requests, args.seed)
    print(f"{len(images)} images ({', '.join(f'{w}x{h}' for (w, h), _ in images[:8])}, ...) encoded in "
          f"{time.perf_counter() - t0:.1f} s; {sum(len(u) for _, u in images) / 2**20:.1f} MiB of data: URLs",
          flush=True)
    base = ["--load-format", load_format, "--dtype", args.dtype, "--device", args.device,
            "--max-model-len", str(args.max_model_len), "--limit-mm-per-prompt", "1", *args.server_args.split()]
    log_dir = os.environ.get("OUT") or tmp.name
    configs = []
    t_all = time.perf_counter()
    for name in args.configs:
        server_args = base + (["--enable-vit-cuda-graph"] if name == "on" else [])
        configs.append(run_config(name, model, server_args, images, args, log_dir))
    print_table(configs)
    report = {"model": args.model, "argv": sys.argv[1:], "image_sizes": [list(s) for s, _ in images],
              "total_s": round(time.perf_counter() - t_all, 1), "configs": configs}
    # after the servers are gone: naming the GPU creates a CUDA context in this process
    dev = "cpu" if args.device == "cpu" or not torch.cuda.is_available() else device_tag(torch.device("cuda"))
    report |= {"device": dev, "torch": torch.__version__}
    name = f"vlm_serve_{os.path.basename(args.model.rstrip('/'))}_{dev}.json"
    path = args.out or os.path.join(os.environ.get("OUT") or RESULTS, name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}  (total {report['total_s']} s)")
    tmp.cleanup()


if __name__ == "__main__":
    main()
