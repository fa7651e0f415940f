"""Affinity bounded by load: the choice a router makes between places that
can serve a request (a scheduler's workers, a tokenizer's serving groups).

Only the places within `max_imbalance` of the least loaded are candidates;
among them the one that can reuse most of the request wins, then the least
loaded, then the first given (configuration order breaks ties). A large hit
on a busy place is passed over: the load bound keeps a popular prefix from
piling every request onto one place, as SGLang's cache-aware router and
llm-d's endpoint picker do.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def pick_bounded(places: Sequence[T], load: Callable[[T], int], reuse: Callable[[T], int],
                 max_imbalance: int) -> T:
    """The place to use among `places` (at least one): the most `reuse` among those whose
    `load` is at most `max_imbalance` above the least, then the least loaded."""
    if not places:
        raise ValueError("no place to pick from")
    loads = [load(p) for p in places]
    lowest = min(loads)
    candidates = [(p, n) for p, n in zip(places, loads) if n <= lowest + max_imbalance]
    # min() keeps the first of equals.
    return min(candidates, key=lambda item: (-reuse(item[0]), item[1]))[0]
