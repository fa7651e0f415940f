"""bench.mla_decode runs at toy sizes and prints both forms per batch, agreeing."""
from __future__ import annotations

from bench import mla_decode


def test_it_prints_a_median_and_p90_per_form_and_batch(capsys) -> None:
    mla_decode.main(["--hidden", "64", "--heads", "2", "--q-lora", "16", "--kv-lora", "32", "--rope", "8",
                     "--nope", "8", "--v", "8", "--context", "40", "--batches", "1,3", "--rounds", "2",
                     "--dtype", "float32", "--block-size", "16"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["1", "absorbed"], ["1", "expanded"], ["3", "absorbed"], ["3", "expanded"]]
    assert all(float(row[2]) > 0 and float(row[3]) >= float(row[2]) for row in rows)
    # 3 contexts of 40 tokens x (32 + 8) values x 4 bytes; the expanded form makes 2 x (8 + 8 + 8) per token.
    assert rows[2][4] == rows[3][4] == "0.0192" and rows[2][5] == "0" and rows[3][5] == "0.023"
    assert all(float(row[6]) < 1e-5 for row in rows)  # absorbed and expanded outputs agree
