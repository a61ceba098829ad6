"""Vision-language baseline (GPU, dummy weights at real shapes): vision-encoder ms and TTFT for one 448x448
image, one 1344x1344 image and 4 images of mixed sizes, and output tok/s for 64 image chats, offline through
`LLM` (the figures the ViT-graph issue must beat).

    python benchmarks/bench_vlm.py                       # qwen2.5-vl-3b and qwen3-vl-2b
    python benchmarks/bench_vlm.py --models qwen3-vl-2b --chats 64 --output-len 128
    python benchmarks/bench_vlm.py --enable-vit-cuda-graph  # the same with vision-encoder graphs

`--encoder-table` runs only the vision towers (no engine): eager vs graph ms for 1, 2, 4 and 8 images of 224-1344
px (`graphs/vit.py`), capture ms and graph memory per new key, beside a floor (FLOPs / measured bf16 matmul rate);
then the varlen attention kernel against SDPA per segment (the tower's attention before the kernel).
"""

import argparse
import itertools
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


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_model(name: str, args) -> dict:
    llm = LLM(name, load_format="dummy", max_model_len=args.max_model_len, seed=0,
              enable_vit_cuda_graph=args.enable_vit_cuda_graph)
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
            # with vision graphs: the engine's encoder, whose first sight of a size runs eagerly and second captures
            encode = runner.vit_graph_runner.encode if runner.vit_graph_runner else runner.model.encode_images
            warmup = 2 if runner.vit_graph_runner else 1
            for i in range(args.repeats + warmup):
                sync()
                t0 = time.perf_counter()
                encode(pixels, mm.image_grid_thw)
                sync()
                if i >= warmup:  # the first calls warm up
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


# ------------------------------------------------------------------------------------------ encoder table
def make_tower(preset: str):
    """The preset's vision tower alone, bf16 dummy weights on the GPU."""
    from transformers import AutoConfig

    from ostinato.loader import dummy_init_
    from ostinato.loader.dummy import preset_path
    from ostinato.models.registry import model_class

    cfg = AutoConfig.from_pretrained(preset_path(preset))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            tower = model_class(cfg).tower_cls(cfg.vision_config)
    finally:
        torch.set_default_dtype(default)
    tower.to(DEVICE)
    dummy_init_(tower, seed=0)
    return tower.eval()


def encoder_cases(tower) -> dict[str, list[tuple[int, int, int]]]:
    """(t, h, w) patch grids: a few fixed batches at <= 1024 patches, then 1, 2, 4, 8 images of random sizes in
    224-1344 px (seeded), each side rounded to whole merged tokens as the processor's resize does."""
    cfg = tower.cfg
    step = cfg.patch_size * cfg.spatial_merge_size

    def grid(w_px: int, h_px: int) -> tuple[int, int, int]:
        m = cfg.spatial_merge_size
        return (1, max(1, round(h_px / step)) * m, max(1, round(w_px / step)) * m)

    rng = np.random.default_rng(0)
    cases = {"1x224": [grid(224, 224)], "4x224": [grid(224, 224)] * 4, "1x448": [grid(448, 448)],
             "2x336+448": [grid(336, 336), grid(448, 336)]}
    for n in (1, 2, 4, 8):
        cases[f"{n}x224-1344"] = [grid(*(int(v) for v in rng.integers(224, 1345, 2))) for _ in range(n)]
    return cases


def matmul_rate() -> float:
    """bf16 FLOP/s of a large matmul (median of 10)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (timed(lambda: a @ a, 10) / 1e3)


def timed(fn, repeats: int) -> float:
    """Median ms of fn() over `repeats` runs (after one warm-up), synchronized."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tower_flops(tower, grids) -> float:
    """Matmul FLOPs of the blocks and mergers plus attention (QK^T and PV) over each layer's segments."""
    from ostinato.models.vision import VisionTower

    n = sum(t * h * w for t, h, w in grids)
    unit = tower.merge**2
    block_params = sum(m.weight.numel() for m in tower.blocks.modules() if isinstance(m, torch.nn.Linear))
    merger_params = sum(m.weight.numel() for name, m in tower.named_modules()
                        if isinstance(m, torch.nn.Linear) and "merger" in name)
    flops = 2 * n * block_params + 2 * (n // unit) * merger_params
    full = VisionTower.image_segments(grids)
    window = tower.window_index(grids)[1] if hasattr(tower, "window_index") else full
    for i in range(len(tower.blocks)):
        cu = full if i in getattr(tower, "fullatt", range(len(tower.blocks))) else window
        flops += 4 * tower.cfg.hidden_size * sum((e - s) ** 2 for s, e in zip(cu[:-1], cu[1:], strict=True))
    return flops


@torch.inference_mode()
def encoder_table(preset: str, args, rate: float) -> dict:
    from ostinato.graphs.vit import VitGraphRunner, padded_patches

    tower = make_tower(preset)
    cfg = tower.cfg
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    runner = VitGraphRunner(tower, DEVICE, max_bytes=1 << 40, max_patches=1 << 20,
                            capture_on_sight=1)
    rows = []
    for case, grids in encoder_cases(tower).items():
        n = sum(t * h * w for t, h, w in grids)
        x = torch.randn(n, dim, device=DEVICE, dtype=tower.patch_embed.proj.weight.dtype)
        eager_ms = timed(lambda x=x, grids=grids: tower(x, grids), args.repeats)
        key = padded_patches(n)
        new_key = key not in runner.entries
        sync()
        t0 = time.perf_counter()
        runner.encode(x, grids)  # captures a new key
        sync()
        first_ms = (time.perf_counter() - t0) * 1e3
        graph_ms = timed(lambda x=x, grids=grids: runner.encode(x, grids), args.repeats)
        floor_ms = tower_flops(tower, grids) / rate * 1e3
        row = {"case": case, "images": len(grids), "patches": n, "key": key, "eager_ms": round(eager_ms, 3),
               "graph_ms": round(graph_ms, 3), "speedup": round(eager_ms / graph_ms, 3),
               "capture_ms": runner.stats.capture_ms[key] if new_key else None,
               "first_call_ms": round(first_ms, 2) if new_key else None,
               "graph_mib": round(runner.stats.graph_bytes[key] / 2**20, 1) if new_key else None,
               "floor_ms": round(floor_ms, 3), "grids": grids}
        rows.append(row)
        print(f"{preset:14s} {case:12s} {n:6d} patches (key {key:6d})  eager {eager_ms:8.2f} ms  graph {graph_ms:8.2f}"
              f" ms  x{eager_ms / graph_ms:5.2f}  capture {row['capture_ms'] or 0:8.1f} ms  graph mem "
              f"{row['graph_mib'] or 0:8.1f} MiB  floor {floor_ms:7.2f} ms")
    runner.entries.clear()
    return {"model": preset, "rows": rows}


@torch.inference_mode()
def kernel_table(args) -> list[dict]:
    """Triton varlen attention vs one SDPA call per segment (bf16), at the towers' head shapes."""
    from ostinato.layers.triton_ops.varlen_attention import varlen_attention
    from ostinato.models.vision import vision_attention_ref

    shapes = {"1 x 1024 full": [1024], "4 x 1024 full": [1024] * 4, "1 x 9216 full": [9216],
              "144 windows x 64": [64] * 144, "8 images mixed": [256, 1024, 2304, 4096, 576, 9216, 1600, 784]}
    rows = []
    for head_dim in (80, 64):
        for name, segs in shapes.items():
            n = sum(segs)
            q, k, v = torch.randn(n, 3, 16, head_dim, device="cuda", dtype=torch.bfloat16).unbind(1)
            cu_host = torch.tensor(list(itertools.accumulate(segs, initial=0)), dtype=torch.int32)
            cu = cu_host.cuda()
            tri = timed(lambda q=q, k=k, v=v, cu=cu: varlen_attention(q, k, v, cu), args.repeats * 3)
            sdpa = timed(lambda q=q, k=k, v=v, cu=cu_host: vision_attention_ref(q, k, v, cu), args.repeats * 3)
            flops = 4 * 16 * head_dim * sum(s * s for s in segs)
            rows.append({"head_dim": head_dim, "case": name, "tokens": n, "triton_ms": round(tri, 4),
                         "sdpa_per_segment_ms": round(sdpa, 4), "triton_tflops": round(flops / tri / 1e9, 1)})
            print(f"attention d={head_dim:3d} {name:18s} {n:6d} tokens  triton {tri:8.3f} ms ({flops / tri / 1e9:6.1f}"
                  f" TFLOP/s)  SDPA per segment {sdpa:8.3f} ms")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen2.5-vl-3b", "qwen3-vl-2b"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chats", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--enable-vit-cuda-graph", action="store_true", help="the engine runs with vision graphs")
    ap.add_argument("--encoder-table", action="store_true", help="only the towers: eager vs graph, and the kernel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"device": device_tag(dev), "torch": torch.__version__, "argv": sys.argv[1:]}
    if args.encoder_table:
        rate = matmul_rate()
        print(f"bf16 matmul rate {rate / 1e12:.0f} TFLOP/s (the floor column: FLOPs / this rate)")
        report |= {"matmul_tflops": round(rate / 1e12, 1),
                   "encoders": [], "attention": kernel_table(args)}
        for m in args.models:
            report["encoders"].append(encoder_table(m, args, rate))
            torch.cuda.empty_cache()
        name = f"vlm_encoder_{device_tag(dev)}.json"
    else:
        report["models"] = [bench_model(m, args) for m in args.models]
        name = f"vlm_{device_tag(dev)}{'_vitgraph' if args.enable_vit_cuda_graph else ''}.json"
    path = args.out or os.path.join(os.environ.get("OUT") or RESULTS, name)
    write_report(report, path)


if __name__ == "__main__":
    main()
