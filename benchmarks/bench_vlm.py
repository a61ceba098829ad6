"""Vision-language baseline (GPU, dummy weights at real shapes): vision-encoder ms and TTFT for one 448x448
image, one 1344x1344 image and 4 images of mixed sizes, and output tok/s for 64 image chats, offline through
`LLM` (the figures the ViT-graph issue must beat).

    python benchmarks/bench_vlm.py                       # qwen2.5-vl-3b and qwen3-vl-2b
    python benchmarks/bench_vlm.py --models qwen3-vl-2b --chats 64 --output-len 128
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from common import RESULTS, device_tag, write_report
from PIL import Image

from ostinato import LLM, SamplingParams

CASES = {"1x448x448": [(448, 448)], "1x1344x1344": [(1344, 1344)],
         "4x_mixed": [(448, 448), (1344, 896), (640, 480), (1024, 1024)]}


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def prompt(cfg, images: list, seed: int) -> dict:
    """Token ids of a one-turn chat (no tokenizer with dummy presets): placeholders from the config, random text."""
    vocab = cfg.get_text_config().vocab_size
    text = [int(t) for t in np.random.default_rng(seed).integers(vocab // 8, vocab // 2, 24)]
    ph = [cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id]
    ids = text[:4] + ph * len(images) + text[4:]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_model(name: str, args) -> dict:
    llm = LLM(name, load_format="dummy", max_model_len=args.max_model_len, seed=0)
    runner, proc, cfg = llm.engine.runner, llm.mm_processor, llm.source.hf_config
    out = {"model": name, "cases": {}}
    for case, sizes in CASES.items():
        imgs = [image(w, h, i) for i, (w, h) in enumerate(sizes)]
        t0 = time.perf_counter()
        ids, mm = proc.process(prompt(cfg, imgs, 0)["prompt_token_ids"], imgs)
        pre_ms = (time.perf_counter() - t0) * 1e3
        pixels = mm.pixel_values.to(runner.device)
        enc = []
        with torch.inference_mode():
            for i in range(args.repeats + 1):
                sync()
                t0 = time.perf_counter()
                runner.model.encode_images(pixels, mm.image_grid_thw)
                sync()
                if i:  # the first call warms up
                    enc.append((time.perf_counter() - t0) * 1e3)
        ttft = []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompt(cfg, imgs, i), SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            ttft.append((time.perf_counter() - t0) * 1e3)
        out["cases"][case] = {"image_tokens": mm.num_image_tokens, "prompt_tokens": len(ids),
                              "preprocess_ms": round(pre_ms, 2), "encoder_ms": round(statistics.median(enc), 2),
                              "ttft_ms": round(statistics.median(ttft), 2)}
        print(f"{name:14s} {case:12s} tokens {len(ids):5d} (image {mm.num_image_tokens:5d})  preprocess "
              f"{pre_ms:7.1f} ms  encoder {statistics.median(enc):7.1f} ms  TTFT {statistics.median(ttft):7.1f} ms")
    chats = [prompt(cfg, [image(448, 448, 100 + i)], i) for i in range(args.chats)]
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(chats[:2], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    res = llm.generate(chats, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    out["chats"] = {"num": args.chats, "output_len": args.output_len, "seconds": round(dt, 2),
                    "output_tok_s": round(n_out / dt, 1), "encoder": vars(runner.encoder_stats) | {"holders": None}}
    print(f"{name:14s} {args.chats} image chats x {args.output_len} tokens: {n_out / dt:8.1f} output tok/s "
          f"({dt:.1f} s, offline LLM.generate)")
    del llm
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen2.5-vl-3b", "qwen3-vl-2b"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chats", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"device": device_tag(dev), "torch": torch.__version__, "argv": sys.argv[1:],
              "models": [bench_model(m, args) for m in args.models]}
    path = args.out or os.path.join(os.environ.get("OUT") or RESULTS, f"vlm_{device_tag(dev)}.json")
    write_report(report, path)


if __name__ == "__main__":
    main()
