"""Draw the TFLOP/s of every case and contender from a `bench.py` results.json.

Usage::

    python benchmarks/plot.py results.json results.png

One row of panels per sequence length; forward on the left, forward + backward on the right;
one group of bars per case, one bar per contender. Missing bars are contenders that did not
apply, were skipped or failed (RESULTS.md says which and why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot_results(results: dict[str, Any], png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    seq_lens = sorted({r["seq_len"] for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    modes = (("fwd_tflops", "forward"), ("fwdbwd_tflops", "forward + backward"))
    width = 0.8 / max(1, len(contenders))
    fig, axes = plt.subplots(
        len(seq_lens), len(modes), figsize=(7 * len(modes), 3.8 * len(seq_lens)), squeeze=False
    )
    for axes_row, seq_len in zip(axes, seq_lens, strict=True):
        for ax, (key, title) in zip(axes_row, modes, strict=True):
            for n, contender in enumerate(contenders):
                by_case = {
                    r["case"]: r[key]
                    for r in rows
                    if r["seq_len"] == seq_len and r["contender"] == contender
                }
                xs = [c + (n - (len(contenders) - 1) / 2) * width for c in range(len(cases))]
                heights = [by_case.get(case) or 0.0 for case in cases]
                ax.bar(xs, heights, width, label=contender)
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels(cases, rotation=20)
            ax.set_ylabel("TFLOP/s (attended pairs only)")
            ax.set_title(f"{title}, S = {seq_len}")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    env = results.get("environment", {})
    fig.suptitle(
        f"attnbias vs peers — {env.get('device', '?')}, torch {env.get('torch', '?')}, "
        f"{results.get('config', {}).get('dtype', '')}"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python benchmarks/plot.py results.json out.png")
    results = json.loads(Path(argv[0]).read_text())
    plot_results(results, Path(argv[1]))
    print(f"written: {argv[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
