"""Incremental detokenization that never emits broken UTF-8: a multi-byte
character split across tokens comes out whole, once its last byte arrives."""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Text completed by this token; empty while a character is still partial."""
        return self._stream.step(self._tokenizer, token_id) or ""
