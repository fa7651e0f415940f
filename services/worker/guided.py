"""Constrained decoding with llguidance: a sequence with a grammar (a JSON
schema, or `{"type": "object"}` for json_object) only ever samples tokens the
grammar allows, and ends with EOS once the grammar is complete. Masks are
computed on the CPU and applied to the batched logits in one call.

The mask is applied with plain torch ops rather than llguidance.torch, whose
kernel is a torch.compile function: importing it pulls in the compiler stack
(about 40 MB of resident memory in every worker) and the first grammar request
would wait for a C++ build."""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy
import torch

from services.common.json_grammar import JSON_OPTIONS

JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """What the request asked for: `kind` is "json_schema" (with `source`, the
    schema text), "json_object", or "lark" (a llguidance Lark grammar)."""

    kind: str
    source: str = ""


class GrammarError(ValueError):
    """The grammar or schema cannot be compiled."""


class GuidedDecoding:
    """One per model: the tokenizer view llguidance needs, and per-step masking."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=eos_token_ids[0] if eos_token_ids else None)

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        if spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=JSON_OPTIONS)
        elif spec.kind == "json_schema":
            try:
                json.loads(spec.source)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
        elif spec.kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.source)
        else:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        message = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if message:
            raise GrammarError(f"cannot compile the grammar: {message}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"cannot compile the grammar: {matcher.get_error()}")
        return matcher

    def mask_logits(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Forbid, in place, every token a row's grammar does not allow next."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), self.vocab_size)
        for slot, row in enumerate(rows):
            llguidance.numpy.fill_next_token_bitmask(matchers[row], bitmask, slot)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        allowed = _unpack_bits(torch.from_numpy(bitmask), logits.shape[-1]).to(logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token_id: int) -> None:
        """Feed the sampled token; a rejected token means a masking bug, not bad input."""
        if matcher.is_stopped():  # complete: only EOS was allowed, nothing left to track
            return
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"grammar rejected sampled token {token_id}: {matcher.get_error()}")


def _unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [rows, ceil(vocab / 32)], bit b of word w = token 32 w + b allowed
    -> bool [rows, vocab_size]; tokens past the mask's end are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
