"""The Performance page's figures, drawn from the recorded results.

bench/figures.json holds every figure set that docs/performance.md shows: the
command that made it, the date, the CPU, the peer it was measured against and
the numbers, as the rounds recorded them. This draws one PNG per set, named
after its id, 1000 × 600 px (matplotlib, Agg), with the drawer of the set's
kind (bench/figure_kinds.py):

    .venv/bin/python -m bench.plots --out docs/performance

Nothing is measured here: a new round goes into figures.json first (its numbers,
date and command replacing the set's old ones), then the page is redrawn.
Ratios are computed from the rounds where the set records them (the median of
the per-round ratios, as bench.interleaved and bench.step_ab print them).
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from bench.figure_kinds import DRAWERS  # noqa: E402  (each kind of set's drawer)

FIGURES = Path(__file__).with_name("figures.json")
SIZE_PX = (1000, 600)
DPI = 100


def load(path: Path = FIGURES) -> list[dict]:
    """The figure sets of a figures file, in page order."""
    return json.loads(path.read_text())["figure_sets"]


def draw(fs: dict, out_dir: Path) -> Path:
    """One figure set's PNG in `out_dir`, named after its id."""
    fig = plt.figure(figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI), dpi=DPI)
    try:
        how_to_read = DRAWERS[fs["kind"]](fig, fs)
        fig.suptitle(fs["title"], fontsize=13, fontweight="bold", y=0.985)
        footer = [*textwrap.wrap(how_to_read, 165), f"{fs['date']} · {fs['cpu']}"]
        for i, line in enumerate(reversed(footer)):
            fig.text(0.01, 0.01 + 0.027 * i, line, fontsize=8, color="#333333")
        top = 0.87 if fs["kind"] in ("peers", "disaggregation") else 0.93
        fig.tight_layout(rect=(0, 0.015 + 0.027 * len(footer), 1, top))
        path = out_dir / f"{fs['id']}.png"
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
    finally:
        plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/performance", help="directory for the PNGs")
    parser.add_argument("--figures", default=str(FIGURES), help="the figures file")
    parser.add_argument("--only", default="", help="comma list of figure set ids (default: all)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = set(filter(None, args.only.split(",")))
    for fs in load(Path(args.figures)):
        if not wanted or fs["id"] in wanted:
            print(draw(fs, out_dir), file=sys.stderr)


if __name__ == "__main__":
    main()
