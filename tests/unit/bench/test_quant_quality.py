"""bench.quant_quality scores the bundled model's variants on a short text."""
from __future__ import annotations

import math

from bench import quant_quality


def test_it_scores_each_variant_against_bfloat16(capsys) -> None:
    results = quant_quality.main(["--variants", "bfloat16", "w8a8_dynamic", "--text-tokens", "80",
                                  "--segment", "40", "--new-tokens", "4"])
    assert set(results) == {"bfloat16", "w8a8_dynamic"}
    assert results["bfloat16"]["identical"] == results["bfloat16"]["common_prefix"] == 1.0
    for r in results.values():
        assert math.isfinite(r["perplexity"]) and 1 < r["perplexity"] < 49152  # better than uniform
    assert "w8a8_dynamic" in capsys.readouterr().out


def test_agreement_counts_identical_continuations_and_common_prefixes() -> None:
    assert quant_quality.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 8]]) == (0.5, 0.625)
