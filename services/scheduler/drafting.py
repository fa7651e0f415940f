"""Draft proposers for speculative decoding that need no second model: they guess
the next tokens of a sequence from tokens already seen.

- Prompt lookup (vLLM's n-gram, llama.cpp's lookup decoding): find the latest
  earlier occurrence of the sequence's last n tokens (longest n first) in its
  prompt and output, and propose the tokens that followed it there.
- Suffix decoding (ArcticInference, arXiv 2411.04975): count, for every context
  of up to `max_match` tokens, which token followed it — in this sequence
  (per-request) and in the outputs of finished sequences (global, bounded) —
  and propose the most frequent continuation of the longest matching context,
  token by token, while its estimated probability holds; the draft is no longer
  than the match that started it.

Both index a sequence's tokens incrementally (each token once, O(max n) dict
updates) the first time they are asked about it; nothing here touches the worker.
"""
from __future__ import annotations

from collections import deque

# Prompt lookup matches contexts of these lengths, longest first.
LOOKUP_MAX_N = 4
LOOKUP_MIN_N = 2
# Suffix decoding: the longest context counted, and a draft token is proposed only
# while the product of the chosen continuations' frequencies stays above this.
SUFFIX_MAX_MATCH = 6
SUFFIX_MIN_PROBABILITY = 0.1
# The global counts cover the outputs of at most this many tokens of finished sequences.
GLOBAL_MAX_TOKENS = 200_000


class LatestOccurrence:
    """For every n-gram (LOOKUP_MIN_N <= n <= LOOKUP_MAX_N) of a token list but its
    tail, the position just after its latest occurrence."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: list[int]) -> None:
        """Catch up with `token_ids`, a longer version of the list indexed so far."""
        tokens = self.tokens
        for token in token_ids[len(tokens):]:
            # The n-grams ending at the current last token get their continuation now.
            end = len(tokens)
            for n in range(LOOKUP_MIN_N, min(LOOKUP_MAX_N, end) + 1):
                self._after[tuple(tokens[end - n:end])] = end
            tokens.append(token)

    def propose(self, max_len: int) -> list[int]:
        tokens = self.tokens
        for n in range(min(LOOKUP_MAX_N, len(tokens)), LOOKUP_MIN_N - 1, -1):
            start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + max_len]
        return []


class ContinuationCounts:
    """For every context of 1..SUFFIX_MAX_MATCH tokens seen, how often each token followed it."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.num_tokens = 0

    def add(self, tokens: list[int], start: int) -> None:
        """Count the continuations of tokens[start:] (the contexts may reach before `start`)."""
        counts = self.counts
        for end in range(max(start, 1), len(tokens)):
            token = tokens[end]
            for n in range(1, min(SUFFIX_MAX_MATCH, end) + 1):
                followers = counts.setdefault(tuple(tokens[end - n:end]), {})
                followers[token] = followers.get(token, 0) + 1
        self.num_tokens += max(0, len(tokens) - start)

    def longest_match(self, context: list[int]) -> tuple[int, dict[int, int] | None]:
        for n in range(min(SUFFIX_MAX_MATCH, len(context)), 0, -1):
            followers = self.counts.get(tuple(context[-n:]))
            if followers:
                return n, followers
        return 0, None


class SuffixCounts:
    """One sequence's continuation counts, caught up on demand."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.own = ContinuationCounts()

    def extend(self, token_ids: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(token_ids[start:])
        self.own.add(self.tokens, start)


def most_frequent_path(context: list[int], sources: list[ContinuationCounts], max_len: int) -> list[int]:
    """Extend `context` token by token with the most frequent continuation of its
    longest matching context in any of `sources`; the draft is at most as long as
    the first match, and stops once its estimated probability falls below
    SUFFIX_MIN_PROBABILITY."""
    draft: list[int] = []
    probability = 1.0
    limit = max_len
    extended = list(context[-SUFFIX_MAX_MATCH:])
    while len(draft) < limit:
        best_n, best = 0, None
        for source in sources:
            n, followers = source.longest_match(extended)
            if followers is not None and n > best_n:
                best_n, best = n, followers
        if best is None:
            break
        if not draft:
            limit = min(max_len, best_n * 2)
        token, count = max(best.items(), key=lambda item: item[1])
        probability *= count / sum(best.values())
        if probability < SUFFIX_MIN_PROBABILITY:
            break
        draft.append(token)
        extended.append(token)
        del extended[0]
    return draft


class GlobalSuffixCounts:
    """Continuation counts over the outputs of recently finished sequences, bounded
    to GLOBAL_MAX_TOKENS: when full, the older half of the outputs is forgotten."""

    def __init__(self, max_tokens: int = GLOBAL_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.counts = ContinuationCounts()
        self._outputs: deque[list[int]] = deque()

    def add_output(self, output_token_ids: list[int]) -> None:
        if len(output_token_ids) < 2:
            return
        self._outputs.append(list(output_token_ids))
        self.counts.add(self._outputs[-1], 0)
        if self.counts.num_tokens > self.max_tokens:
            keep = list(self._outputs)[len(self._outputs) // 2:]
            self._outputs = deque(keep)
            self.counts = ContinuationCounts()
            for output in keep:
                self.counts.add(output, 0)
