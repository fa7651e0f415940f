"""bench.key_gate_cost runs and prints a row per key count."""
from __future__ import annotations

import sys

from bench import key_gate_cost


def test_it_prints_a_median_and_p90_per_setup(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["key_gate_cost", "--keys", "1", "3", "--rounds", "2", "--calls", "20"])
    key_gate_cost.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[:-2] for row in rows] == [["keys", "off"], ["1", "keys"], ["3", "keys"]]
    assert all(float(row[-2]) > 0 and float(row[-1]) > 0 for row in rows)
