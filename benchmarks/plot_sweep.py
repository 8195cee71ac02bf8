"""Plot throughput vs concurrent requests from `throughput.py --sweep --json FILE` results.

    python -m benchmarks.plot_sweep gpu_out/sweep.json docs/throughput_vs_concurrency.png"""
from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    xs = [p["concurrency"] for p in data["sweep"]]
    ys = [p["out_tok_s"] for p in data["sweep"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o", label=f"Kestrel ({data.get('commit', '?')})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{data['shape']} on H200: throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
