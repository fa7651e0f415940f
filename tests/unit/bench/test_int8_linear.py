"""bench.int8_linear runs at toy sizes and prints a row per build and row count."""
from __future__ import annotations

import shutil

import pytest

from bench import int8_linear
from services.worker import int8_kernels


@pytest.mark.skipif(shutil.which("cc") is None or not int8_kernels.int8_linear_available(),
                    reason="no C compiler, or no int8 kernels for this CPU")
def test_it_prints_times_and_ratios_per_build_and_row_count(capsys) -> None:
    int8_linear.main(["--layers", "2", "--hidden", "64", "--intermediate", "128", "--qkv", "96", "--vocab", "256",
                      "--rows", "1", "3", "--rounds", "2", "--variants", "native"])
    lines = capsys.readouterr().out.splitlines()
    assert "threads" in lines[0] and lines[1].split()[:3] == ["build", "int8", "on"]
    rows = [line.split() for line in lines[2:]]
    assert [(row[0], row[2]) for row in rows] == [("native", "1"), ("native", "3")]
    assert all(row[1] == int8_kernels.int8_linear_isa() for row in rows)
    # Two times per kernel (one "-" for each of linear.c's where this CPU lacks them), then four ratios.
    assert all(len(row) in (3 + 4 * 2 + 4, 3 + 2 * 1 + 2 * 2 + 4) for row in rows)
    assert all(float(value) > 0 for row in rows for value in row[3:] if value != "-")
