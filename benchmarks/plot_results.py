"""PNG plots of benchmark JSON: decode ms/step (eager, graph, graph-sync, floor) by batch size.

python benchmarks/plot_results.py benchmarks/results/decode-h100.json
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_decode(path: str) -> str:
    report = json.load(open(path))
    rows = [r for r in report["rows"] if r["context"] == 128]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        series = defaultdict(dict)
        for r in rows:
            if r["model"] == model:
                series[r["mode"]][r["bs"]] = r["ms_per_step"]
                series["HBM floor"][r["bs"]] = r["floor_ms"]
        for name, pts in series.items():
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=name, linestyle="--" if name == "HBM floor" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (context 128)")
        ax.set_ylabel("ms / decode step")
        ax.set_title(f"{model} on {report['device']}")
        ax.grid(alpha=0.3)
        ax.legend()
    out = path.replace(".json", ".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(plot_decode(p))
