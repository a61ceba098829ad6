"""What skipping captured kernels under a device-side IF (a conditional node, CUDA 12.4+) saves, through the
`graph_if_node.run_if` beside it (torch 2.11 cannot capture one itself).

The question behind it (#16, filters at bs 32): with top_p the cut search's launches (eight passes, a resolve, a
finish, the draw under the cut) stay in the sampler graph and run empty in a step where every row's draw stands.
This times N small kernels (an add over a [32, 1] column) captured plainly, and the same N under `run_if` with the
flag 0 and 1, for each N of --kernels (the set kernel and the IF node included), and an empty block (what the IF
node costs by itself); and checks that the block ran exactly when the flag was positive and that the work after it
saw the block's result.

    python benchmarks/probe_graph_if_node.py [--kernels 1 12 24] [--out F.json]
"""

import argparse
import json

import graph_if_node as conditional
import torch
from common import mean_replay_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, nargs="+", default=[1, 12, 24])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    result = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "torch_if_node": hasattr(torch._C._CUDAGraph, "begin_capture_to_if_node"),
              "run_if": conditional.available(device), "kernels": args.kernels}
    print(result)
    col = torch.randn(32, 1, device=device)
    counter = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)

    def body(n: int) -> None:
        for _ in range(n):
            col.add_(1e-3)
        if n:
            counter.add_(1)  # how often the block ran

    def capture(under_if: bool, n: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        body(n)  # warm-up outside the capture (and the set kernel compiled)
        with conditional.run_if(flag):
            pass
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            if under_if:
                with conditional.run_if(flag):
                    body(n)
            else:
                body(n)
            seen.copy_(counter)  # after the block: must see its add
        return graph

    gated = capture(True, args.kernels[-1])
    checks = {}
    for value in (0, 3, -1, 1):
        flag.fill_(value)
        before = counter.item()
        gated.replay()
        torch.cuda.synchronize()
        checks[str(value)] = {"ran": counter.item() - before, "seen_after": seen.item() == counter.item()}
    result["checks"] = checks
    result["correct"] = all(c["ran"] == (1 if int(v) > 0 else 0) and c["seen_after"] for v, c in checks.items())
    flag.fill_(0)
    result["empty_if_us"] = mean_replay_us(capture(True, 0))
    result["none_us"] = mean_replay_us(capture(False, 0))  # the copy after the block alone
    for n in args.kernels:
        plain, gated = capture(False, n), capture(True, n)
        flag.fill_(0)
        result[f"{n}"] = dict(plain_us=mean_replay_us(plain), if_false_us=mean_replay_us(gated))
        flag.fill_(1)
        result[f"{n}"]["if_true_us"] = mean_replay_us(gated)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
