"""The one `system_fingerprint` of a build and a model, which the tokenizer sets
on every ChatChunk and the edge falls back on."""
from __future__ import annotations

from services.common import fingerprint


def test_system_fingerprint_names_the_build_and_the_model() -> None:
    one = fingerprint.system_fingerprint("SmolLM2", "/models/a")
    assert one == fingerprint.system_fingerprint("SmolLM2", "/models/a")
    assert len(one) == 13 and one.startswith("fp_") and int(one[3:], 16) >= 0
    assert one != fingerprint.system_fingerprint("SmolLM2", "/models/b")
    assert one != fingerprint.system_fingerprint("Other", "/models/a")
    assert fingerprint.stormserve_version() not in ("", "unknown")
