"""Which serving group (a scheduler and its workers) gets a request.

By prefix affinity over the prompt's leading blocks, bounded by load, as
SGLang's router and llm-d's endpoint picker do: the prompt's first
`prefix_blocks` blocks of BLOCK_TOKENS tokens are hashed, each hash chained
to the ones before it, and every request records its hashes against the group
it went to. A new request's affinity to a group is how many of its leading
blocks that group was last given; it counts only when it covers at least half
of the hashed blocks (the next turn of a conversation, a long shared system
prompt) — every chat shares its template's first tokens, and chasing that
would send all conversations to one group. Among the groups within
`max_imbalance` in-flight requests of the least loaded (this tokenizer's own
count), the one with the most affinity wins, then the least loaded
(services/common/affinity.py, as the scheduler places sequences on workers);
equals go to the group holding fewest remembered blocks (SGLang's router sends
an unmatched prompt to its smallest tree), so new conversations alternate.

A group that is not serving (its health says so, or a call to it just failed
with UNAVAILABLE) gets no new requests while another serves; with none
serving, the least loaded of all is tried, and its error is the caller's.
`policy="random"` picks uniformly among the serving groups: the baseline the
bench compares affinity against.
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence

from services.common.affinity import pick_bounded

# Tokens per hashed block: the scheduler's default cacheBlockSize.
BLOCK_TOKENS = 16
DEFAULT_PREFIX_BLOCKS = 32
DEFAULT_MAX_IMBALANCE = 4
# Block hashes remembered (least recently used forgotten first): some MiB.
MAX_REMEMBERED_BLOCKS = 65536
MIN_HIT_FRACTION = 0.5
POLICIES = ("affinity", "random")


def prefix_hashes(token_ids: Sequence[int], prefix_blocks: int, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Chained hashes of the whole leading blocks (at most `prefix_blocks`): the i-th
    names the prompt's first i + 1 blocks."""
    hashes = []
    previous = b""
    for start in range(0, min(len(token_ids) // block_tokens, prefix_blocks) * block_tokens, block_tokens):
        block = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[start:start + block_tokens])
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


class GroupPicker:
    """Groups by name (their scheduler's address), their in-flight requests and the
    prefix blocks each was last given. Plain and synchronous; the client calls
    `pick`, then `finish` once per picked request."""

    def __init__(self, groups: Sequence[str] = (), prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE, policy: str = "affinity",
                 max_remembered: int = MAX_REMEMBERED_BLOCKS, rng: random.Random | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.prefix_blocks = prefix_blocks
        self.max_imbalance = max_imbalance
        self.policy = policy
        self.max_remembered = max_remembered
        self._rng = rng or random.Random()
        self.in_flight: dict[str, int] = {}
        self._serving: dict[str, bool] = {}
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> group
        self.num_blocks: dict[str, int] = {}  # remembered blocks per group
        for name in groups:
            self.add(name)

    @property
    def groups(self) -> list[str]:
        return list(self.in_flight)

    def add(self, name: str) -> None:
        """A group joins, serving until told otherwise."""
        self.in_flight.setdefault(name, 0)
        self.num_blocks.setdefault(name, 0)
        self._serving.setdefault(name, True)

    def remove(self, name: str) -> None:
        """A group is gone: nothing new goes there, and its prefixes are forgotten."""
        self.in_flight.pop(name, None)
        self.num_blocks.pop(name, None)
        self._serving.pop(name, None)
        for key in [k for k, owner in self._owner.items() if owner == name]:
            del self._owner[key]

    def set_serving(self, name: str, serving: bool) -> None:
        if name in self._serving:
            self._serving[name] = serving

    def is_serving(self, name: str) -> bool:
        return self._serving.get(name, False)

    def affinity(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per group, how many leading blocks of `hashes` it was last given (0 under
        the half-of-the-hashed-blocks threshold)."""
        matched: dict[str, int] = {}
        for depth, key in enumerate(hashes, 1):
            owner = self._owner.get(key)
            if owner is None:
                break  # chained: no deeper block can match either
            matched[owner] = depth
        return {name: n for name, n in matched.items() if n >= MIN_HIT_FRACTION * len(hashes)}

    def pick(self, token_ids: Sequence[int]) -> str:
        """The group for a request with this prompt; counts it in flight there."""
        if not self.in_flight:
            raise LookupError("no serving group known")
        places = [g for g in self.in_flight if self._serving[g]] or list(self.in_flight)
        places.sort(key=self.num_blocks.__getitem__)  # stable: then configuration order
        hashes = prefix_hashes(token_ids, self.prefix_blocks)
        if self.policy == "random":
            name = self._rng.choice(places)
        else:
            affinity = self.affinity(hashes)
            name = pick_bounded(places, self.in_flight.__getitem__, lambda g: affinity.get(g, 0),
                                self.max_imbalance)
        self._remember(hashes, name)
        self.in_flight[name] += 1
        return name

    def finish(self, name: str) -> None:
        """A request picked for `name` ended (whatever way)."""
        if self.in_flight.get(name, 0) > 0:
            self.in_flight[name] -= 1

    def _remember(self, hashes: Sequence[bytes], name: str) -> None:
        for key in hashes:
            self._count(self._owner.get(key), -1)
            self._owner[key] = name
            self._owner.move_to_end(key)
            self._count(name, 1)
        while len(self._owner) > self.max_remembered:
            self._count(self._owner.popitem(last=False)[1], -1)

    def _count(self, name: str | None, change: int) -> None:
        if name in self.num_blocks:
            self.num_blocks[name] += change
