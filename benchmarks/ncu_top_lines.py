"""The source lines with the most warp-stall samples in an Nsight Compute report's source page (CSV on stdin,
from `ncu --import R --page source --csv --print-source cuda`): the top N, with their share of all samples.

    ncu --import rep.ncu-rep --page source --csv --print-source cuda | python benchmarks/ncu_top_lines.py 30
"""

import csv
import sys


def main() -> None:
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rows = list(csv.reader(sys.stdin))
    head = next(i for i, r in enumerate(rows) if any("Sampl" in c for c in r))
    cols = rows[head]
    sample_col = next(i for i, c in enumerate(cols) if "Sampl" in c and "Not" not in c)
    text_col = next((i for i, c in enumerate(cols) if c.lower() in ("source", "# source")), 1)
    line_col = next((i for i, c in enumerate(cols) if c.lower() in ("line", "#", "# line")), 0)
    body = [r for r in rows[head + 1 :] if len(r) > sample_col]

    def samples(r: list[str]) -> float:
        try:
            return float(r[sample_col].replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(samples(r) for r in body) or 1.0
    print(f"columns: {cols}")
    for r in sorted(body, key=samples, reverse=True)[:top]:
        print(f"{samples(r) / total:6.1%}  {r[line_col]:>6}  {r[text_col].strip()[:110]}")


if __name__ == "__main__":
    main()
