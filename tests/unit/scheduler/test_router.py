"""Placement across workers: most reusable prefix (of half the prompt or more) first, then the lowest load."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.errors import ServiceError
from services.scheduler.router import Router
from tests.unit.scheduler.test_policy import make_seq


@dataclass
class FakeEngine:
    load: int = 0
    cached: int = 0
    is_ready: bool = True
    is_draining: bool = False
    role: str = "both"

    @property
    def accepts_sequences(self) -> bool:
        return self.is_ready and not self.is_draining

    def num_cached_prefix_tokens(self, seq) -> int:
        return self.cached


def test_lowest_load_without_any_prefix_hit():
    engines = [FakeEngine(load=3), FakeEngine(load=1), FakeEngine(load=2)]
    assert Router(engines).place([make_seq(1)]) is engines[1]


def test_most_reusable_prefix_wins_over_a_slightly_lower_load():
    engines = [FakeEngine(load=0, cached=16), FakeEngine(load=2, cached=64), FakeEngine(load=1, cached=64)]
    assert Router(engines, max_imbalance=4).place([make_seq(1, prompt_len=100)]) is engines[2]


def test_a_hit_on_less_than_half_the_prompt_does_not_outweigh_load():
    # The chat template's first block, cached by the worker that served first.
    engines = [FakeEngine(load=1, cached=16), FakeEngine(load=0)]
    assert Router(engines).place([make_seq(1, prompt_len=100)]) is engines[1]
    # Half the prompt (a conversation's earlier turn) does.
    engines = [FakeEngine(load=1, cached=50), FakeEngine(load=0)]
    assert Router(engines).place([make_seq(1, prompt_len=100)]) is engines[0]


def test_a_prefix_hit_does_not_pile_everything_on_one_worker():
    engines = [FakeEngine(load=9, cached=64), FakeEngine(load=0)]
    assert Router(engines, max_imbalance=4).place([make_seq(1, prompt_len=100)]) is engines[1]


def test_only_ready_workers_and_unavailable_when_none():
    engines = [FakeEngine(is_ready=False), FakeEngine(load=5)]
    assert Router(engines).place([make_seq(1)]) is engines[1]
    with pytest.raises(ServiceError):
        Router([FakeEngine(is_ready=False)]).place([make_seq(1)])


def test_a_draining_worker_gets_no_new_sequence_even_with_the_best_prefix():
    engines = [FakeEngine(load=0, cached=100, is_draining=True), FakeEngine(load=3)]
    assert Router(engines).place([make_seq(1, prompt_len=100)]) is engines[1]
    assert Router(engines).ready_engines == [engines[1]]
    with pytest.raises(ServiceError):
        Router([FakeEngine(is_draining=True)]).place([make_seq(1)])
