"""bench.moe_layer runs at toy sizes and prints a row per batch size."""
from __future__ import annotations

from bench import moe_layer


def test_it_prints_times_floors_and_ratios_per_batch_size(capsys) -> None:
    moe_layer.main(["--hidden", "64", "--experts", "8", "--top-k", "2", "--intermediate", "32",
                    "--tokens", "1", "5", "--rounds", "2", "--bandwidth-mib", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert "threads" in lines[0] and lines[1].split()[:2] == ["tokens", "experts"]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "5"]
    assert all(len(row) == 11 and all(float(value) > 0 for value in row) for row in rows)
