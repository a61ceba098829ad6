"""Whether this torch can put part of a CUDA graph under a device-side IF (a conditional node, CUDA 12.4+), and what
skipping kernels that way saves.

The question behind it (#16, filters at bs 32): with top_p the cut search's launches (eight passes, a resolve, a
finish, the draw under the cut) stay in the sampler graph and run empty in a step where every row's draw stands.
An IF node on "some row is searched" would skip them. This times N small kernels (an add over a Qwen3-vocabulary
[32, 151936] float32 row block's first column) captured plainly, and the same N inside an IF node whose predicate
is a device scalar, replayed with it false and true; and checks the IF body ran exactly when the predicate held.

    python benchmarks/probe_graph_if_node.py [--kernels 11] [--out F.json]
"""

import argparse
import json

import torch
from common import mean_replay_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=11)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "if_node": hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph")
              and hasattr(torch._C._CUDAGraph, "begin_capture_to_if_node")}
    print(result)
    if result["if_node"]:
        col = torch.randn(32, 1, device="cuda")
        counter = torch.zeros(1, device="cuda")
        pred = torch.zeros((), dtype=torch.bool, device="cuda")

        def body() -> None:
            for _ in range(args.kernels):
                col.add_(1e-3)
            counter.add_(1)  # how often the body ran

        torch.cuda.synchronize()
        plain, conditional, outside = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        body()  # warm up outside capture
        with torch.cuda.graph(plain):
            body()
        with torch.cuda.graph(conditional):
            graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
            graph.begin_capture_to_if_node(pred)
            body()
            graph.end_capture_to_conditional_node()
        with torch.cuda.graph(outside):  # the predicate's own cost: one kernel, as the IF graph's caller would add
            pred.copy_(counter[0] < 0)
        torch.cuda.synchronize()
        counter.zero_()
        pred.fill_(False)
        conditional.replay()
        torch.cuda.synchronize()
        skipped = counter.item() == 0
        pred.fill_(True)
        conditional.replay()
        torch.cuda.synchronize()
        ran = counter.item() == 1
        result.update(body_skipped_when_false=skipped, body_ran_when_true=ran, kernels=args.kernels,
                      plain_us=mean_replay_us(plain))
        pred.fill_(False)
        result["if_false_us"] = mean_replay_us(conditional)
        pred.fill_(True)
        result["if_true_us"] = mean_replay_us(conditional)
        result["one_kernel_us"] = mean_replay_us(outside)
        print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
