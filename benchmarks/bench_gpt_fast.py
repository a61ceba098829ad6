"""gpt-fast's decode beside ours: its own model.py and generate.py, compiled as its `main` compiles them
(decode_one_token under torch.compile, mode "reduce-overhead", fullgraph), on Llama-3.2-1B's shape with random
bf16 weights. Timed as `bench_generate.py` times Ostinato: ms per output token is the difference between a 288-
and a 32-token generation from a 128-token prompt, divided by the 256 extra tokens. gpt-fast always samples
(temperature, then top-k 200 by default); run `bench_generate.py --temperature 0.6 --top-k 200` for ours.

python benchmarks/bench_gpt_fast.py --gpt-fast PATH [--batch-sizes 1 32] [--temperature 0.6] [--out FILE]

PATH: a checkout of https://github.com/pytorch-labs/gpt-fast (model.py and generate.py; its tokenizer module is
not needed and is stubbed). GPU only.
"""

import argparse
import os
import sys
import time
import types

import torch
from common import RESULTS, device_tag, write_report

# Llama-3.2-1B in gpt-fast's ModelArgs terms (its table stops at Llama-3.1): 16 layers, 32 query and 8 KV heads
# of 64, the llama3 rope scaling of the HF config. The LM head is a separate weight (HF ties it to the
# embedding); the bytes a step reads are the same.
LLAMA_3_2_1B = dict(block_size=131072, n_layer=16, n_head=32, n_local_heads=8, dim=2048, intermediate_size=8192,
                    vocab_size=128256, rope_base=500000.0,
                    rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))


def load_gpt_fast(path: str) -> tuple[types.ModuleType, types.ModuleType]:
    """gpt-fast's (generate, model) modules from its checkout."""
    sys.modules.setdefault("tokenizer", types.SimpleNamespace(get_tokenizer=None))  # generate.py imports it
    sys.path.insert(0, os.path.abspath(path))
    import generate  # noqa: PLC0415
    import model  # noqa: PLC0415

    return generate, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpt-fast", required=True, help="a gpt-fast checkout")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-k", type=int, default=200, help="gpt-fast's default")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long", type=int, default=288)
    ap.add_argument("--repeats", type=int, default=3, help="each length is timed this often; the median counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen, gpt_model = load_gpt_fast(args.gpt_fast)
    gen.decode_one_token = torch.compile(gen.decode_one_token, mode="reduce-overhead", fullgraph=True)  # as its main
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        model = gpt_model.Transformer(gpt_model.ModelArgs(**LLAMA_3_2_1B)).to(torch.bfloat16).eval()
    prompt = torch.randint(100, 128000, (args.prompt_len,), device=dev)
    sampling = dict(temperature=args.temperature, top_k=args.top_k)
    rows = []
    for bs in args.batch_sizes:
        model.max_seq_length = model.max_batch_size = -1  # caches sized for this batch and the long run, then kept

        def run(n: int, bs: int = bs) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                gen.generate(model, prompt, n, bs, interactive=False, draft_model=None, **sampling)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        run(args.long)  # compiles, records the graphs, sizes the caches for both lengths
        run(args.short)
        med = {}
        for n in (args.short, args.long):
            times = sorted(run(n) for _ in range(args.repeats))
            med[n] = times[len(times) // 2]
        ms = (med[args.long] - med[args.short]) / (args.long - args.short) * 1e3
        rows.append(dict(batch_size=bs, ms_per_token=ms, **sampling))
        print(f"gpt-fast llama-3.2-1b bs {bs:>3} T={args.temperature:g} top_k {args.top_k}: {ms:.3f} ms/token",
              flush=True)
    report = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv), rows=rows)
    write_report(report, args.out or os.path.join(RESULTS, f"gpt-fast-{device_tag(dev)}.json"))


if __name__ == "__main__":
    main()
