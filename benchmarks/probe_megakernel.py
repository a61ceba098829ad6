"""The one-launch bs-1 decode step alone (ostinato/megakernel): us a step from replayed graphs, and where a step's
time goes, from %globaltimer stamps every block takes at each operation's dependency, first weight tile and end.

    python benchmarks/probe_megakernel.py --models qwen3-0.6b llama-3.2-1b --contexts 128 1024

Per layer (mean over the middle layers), the critical path's pieces in us: each operation's wait (the last block's
end of the operation before -> the first block seeing its count), the ring's lag (dependency met -> first tile in,
the block's median), its work (dependency met -> the last block's end), attention's split work and merge."""

import argparse
import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, copy_bandwidth, device_tag, mean_replay_us, write_report  # noqa: E402

from ostinato.loader import dummy_init_  # noqa: E402
from ostinato.loader.dummy import preset_path  # noqa: E402
from ostinato.megakernel.build import NO_WAITS, RING_ONLY, TRACE_SLOTS  # noqa: E402
from ostinato.megakernel.decode_bs1 import DecodeBs1Megakernel  # noqa: E402
from ostinato.mem.kv_cache import MHATokenToKVPool  # noqa: E402
from ostinato.models.registry import model_class  # noqa: E402


def build(name: str, layers: int | None, max_context: int):
    config = transformers.AutoConfig.from_pretrained(preset_path(name))
    if layers:
        config.num_hidden_layers = layers
    dev = torch.device("cuda")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with dev:
            model = model_class(config)(config, max_context + 8).eval()
    finally:
        torch.set_default_dtype(default)
    model.to(dev)  # as the engine does: tables some rope types build on the CPU (llama3's) follow the parameters
    dummy_init_(model)
    model.after_load()
    attn = model.layers[0].self_attn
    kv = MHATokenToKVPool(max_context + 8, torch.bfloat16, attn.num_kv_heads, attn.head_dim, len(model.layers), dev)
    for i in range(len(model.layers)):
        for buf in kv.get_kv_buffer(i):
            buf.normal_()
    return model, kv


def summarize(trace: torch.Tensor, items: int) -> dict:
    """Mean over the middle layers, us: each operation's wait (the last block's end of the one before -> the first
    block's dependency met), the spread of the blocks' starts, a block's duration (median, max) and its ring lag
    (dependency met -> first tile, median; input staging included); attention over the item blocks."""
    t = trace.double()  # [blocks, layers, slots] ns
    layers = t.shape[1]
    pieces: dict[str, list[float]] = {}

    def add(k: str, v) -> None:
        pieces.setdefault(k, []).append(float(v) / 1e3)

    for layer in range(1, layers - 1):
        x = t[:, layer]
        prev_end = t[:, layer - 1, 14].max()
        att = x[:items]
        att = att[att[:, 3] > 0]  # blocks whose split had keys to wait for
        ops = [("qkv", x, 0, 1, 2), ("attn", att, 3, None, 4), ("o", x, 6, 7, 8), ("gu", x, 9, 10, 11),
               ("down", x, 12, 13, 14)]
        for name, rows, start, first, end in ops:
            add(f"{name} wait", rows[:, start].min() - prev_end)
            add(f"{name} spread", rows[:, start].max() - rows[:, start].min())
            dur = rows[:, end] - rows[:, start]
            add(f"{name} dur med", dur.median())
            add(f"{name} dur max", dur.max())
            if first is not None:
                add(f"{name} lag", (rows[:, first] - rows[:, start]).median())
            prev_end = rows[:, end].max()
            if name == "attn":
                add("merge", x[:items, 5].max() - prev_end)
                prev_end = x[:items, 5].max()
        for op, name in enumerate(("qkv", "o", "gate", "up", "down")):  # ns waited on weight tiles, a block
            add(f"{name} tile wait med", x[:, 16 + op].median())
        add("layer", t[:, layer, 14].max() - t[:, layer - 1, 14].max())
    return {k: sum(v) / len(v) for k, v in pieces.items()}


def time_us(mk: DecodeBs1Megakernel, call_args: tuple, iters: int) -> float:
    """us a launch, from a graph of 10 launches replayed `iters` times (after ten untimed)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            mk(*call_args)
    return mean_replay_us(graph, iters) / 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model's")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--slots", type=int, default=None, help="weight ring slots (default: as many as fit)")
    ap.add_argument("--splits", type=int, default=None)
    ap.add_argument("--h-copies", type=int, default=None,
                    help="copies of the residual stream that DOWN's atomics spread over (default: the launcher's)")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = []
    for name in args.models:
        model, kv = build(name, args.layers, max(args.contexts))
        extra = {} if args.h_copies is None else {"h_copies": args.h_copies}
        mk = DecodeBs1Megakernel(model, kv, dev, slots=args.slots, splits=args.splits, **extra)
        weight_bytes = sum(t.numel() * 2 for lw in mk._layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down))
        s = mk.shape
        copies = getattr(mk, "h_copies", 1)  # an older tree's launcher (an A/B's copy) has one
        print(f"{name}: {s.num_layers} layers, {mk.grid} blocks, {mk.slots} ring slots, {mk.splits} splits, "
              f"{copies} copies of h; layer "
              f"weights {weight_bytes / 1e9:.3f} GB ({weight_bytes / bw * 1e6:.1f} us at {bw / 1e12:.2f} TB/s)",
              flush=True)
        for ctx in args.contexts:
            table = torch.zeros(2, max(args.contexts) + 8, dtype=torch.int32, device=dev)
            table[1, :ctx] = torch.arange(1, ctx + 1, dtype=torch.int32, device=dev)
            ins = (torch.tensor([ctx - 1], device=dev), torch.tensor([ctx], device=dev),
                   torch.tensor([1], device=dev), torch.tensor([ctx], device=dev))
            x_in = model.embed_tokens(torch.tensor([7], device=dev))
            out = mk(x_in, *ins, table).float()
            torch.cuda.synchronize()
            assert torch.isfinite(out).all(), "non-finite output"
            us = time_us(mk, (x_in, *ins, table), args.iters)
            mk.flags = NO_WAITS  # the weight stream and the work without the dependencies' waits
            stream_us = time_us(mk, (x_in, *ins, table), args.iters)
            mk.flags = NO_WAITS | RING_ONLY  # the weight stream alone: tiles taken and freed unread
            ring_us = time_us(mk, (x_in, *ins, table), args.iters)
            mk.flags = 0
            kv_bytes = ctx * s.num_layers * 2 * s.kv_size * 2
            floor = (weight_bytes + kv_bytes) / bw * 1e6
            row = {"model": name, "context": ctx, "layers": s.num_layers, "slots": mk.slots, "splits": mk.splits,
                   "h_copies": copies, "us_per_step": us, "no_waits_us": stream_us, "ring_only_us": ring_us,
                   "floor_us": floor}
            print(f"  ctx {ctx}: {us:.1f} us a step (layers' floor {floor:.1f} us, {floor / us:.0%}); "
                  f"{us / s.num_layers:.2f} us a layer; without the waits {stream_us:.1f} us; the ring alone "
                  f"{ring_us:.1f} us", flush=True)
            if not args.no_trace:
                mk.trace = torch.zeros(mk.grid, s.num_layers, TRACE_SLOTS, dtype=torch.int64, device=dev)
                mk(x_in, *ins, table)
                torch.cuda.synchronize()
                used = min(mk.splits, max(1, -(-(ctx - 1) // 32)))
                pieces = summarize(mk.trace.cpu(), s.kv_heads * mk.splits)
                mk.trace = None
                row["pieces_us"] = pieces
                print("    " + ", ".join(f"{k} {v:.2f}" for k, v in pieces.items()) + f" ({used} splits used)",
                      flush=True)
            rows.append(row)
        del mk, model, kv
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(dev), "command": " ".join(["python"] + sys.argv),
              "copy_bandwidth_TBps": bw / 1e12, "rows": rows}
    write_report(report, args.out or os.path.join(RESULTS, f"probe-megakernel-{device_tag(dev)}.json"))
    print(json.dumps(rows[-1])[:200])


if __name__ == "__main__":
    main()
