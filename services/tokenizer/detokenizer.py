"""Incremental detokenization that never emits broken UTF-8: a multi-byte
character split across tokens comes out whole, once its last byte arrives."""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 keep_special_ids: frozenset[int] = frozenset()):
        """`keep_special_ids`: special tokens that stay in the text although
        special tokens are skipped (output-parser markers such as DeepSeek's
        tool-call tokens)."""
        self._tokenizer = tokenizer
        self._skipped: frozenset[int] = frozenset()
        if skip_special_tokens and keep_special_ids:
            # Decode everything and drop the other special tokens here: the
            # stream itself can only skip all of them or none.
            self._skipped = frozenset(
                i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
            ) - keep_special_ids
            skip_special_tokens = False
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Text completed by this token; empty while a character is still partial."""
        if token_id in self._skipped:
            return ""
        return self._stream.step(self._tokenizer, token_id) or ""
