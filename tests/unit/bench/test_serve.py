"""The benchmark's own logic: a fixed dataset, honest percentiles, a plot."""
from __future__ import annotations

from bench.serve import level_prompts, make_prompts, percentiles, plot


def test_dataset_is_fixed_by_the_seed():
    assert make_prompts(4, 200, seed=1) == make_prompts(4, 200, seed=1)
    assert make_prompts(4, 200, seed=1) != make_prompts(4, 200, seed=2)
    assert len(set(make_prompts(8, 50, seed=0))) == 8


def test_percentiles():
    values = [float(v) for v in range(1, 101)]
    stats = percentiles(values)
    assert stats["p50"] == 50.5 and stats["p90"] == 91.0 and stats["p99"] == 100.0
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def test_plot_writes_a_png(tmp_path):
    level = lambda c, tps: {"concurrency": c, "output_tok_per_s": tps,  # noqa: E731
                            "ttft_s": {"p50": 0.1 * c, "p90": 0.2 * c}, "itl_s": {"p50": 0.05, "p90": 0.08}}
    path = tmp_path / "plot.png"
    plot({"us": [level(1, 10), level(8, 60)], "peer": [level(1, 50), level(8, 45)]}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_levels_share_no_prompt():
    warm_ups, measured = zip(*(level_prompts(8, 100, seed=0, level=i) for i in range(3)))
    everything = list(warm_ups) + [p for prompts in measured for p in prompts]
    assert all(len(prompts) == 8 for prompts in measured)
    assert len(set(everything)) == len(everything)
    assert level_prompts(8, 100, seed=0, level=1) == level_prompts(8, 100, seed=0, level=1)
