"""Incremental detokenization with the bundled model's real tokenizer."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.common.model_files import default_model_path, resolve_model
from services.tokenizer.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(default_model_path()))


@pytest.mark.parametrize("text", ["héllo wörld", "emoji 😀🎉 end", "世界你好", "mixed 👨‍👩‍👧 family ñ"])
def test_streamed_pieces_are_whole_characters_and_join_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Multi-byte characters really are split across tokens here, so the test bites.
    assert len(ids) > len(text.split())


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hi", add_special_tokens=False) + [eos]
    skipped = IncrementalDetokenizer(tokenizer.backend_tokenizer, skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer.backend_tokenizer, skip_special_tokens=False)
    assert "".join(skipped.step(i) for i in ids) == "hi"
    assert "".join(kept.step(i) for i in ids) == "hi" + tokenizer.eos_token
