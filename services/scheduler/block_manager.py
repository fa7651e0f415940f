"""KV block accounting for one worker's pool, owned by the scheduler.

The worker preallocates the pool and reports its size; every block id in it is
handed out from here. A sequence's block table grows on demand as its tokens
are scheduled and is freed when it finishes, is aborted, fails or is preempted.

Prefix caching: once a block is full and its KV computed, it is registered
under a hash chained over every token up to its end, so a later sequence whose
tokens start the same way reuses it (reference counted). A block whose last
reference goes stays cached but evictable; blocks are taken from the never- or
no-longer-cached ones first, then the least recently freed cached ones (LRU).
A vision-language model's image placeholder tokens are keyed with the image's
content hash (Sequence.cache_keys): the same text with another image never
shares KV, the same image does.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

from services.scheduler.sequence import Sequence

_ROOT_HASH = 0x5707  # parent of the first block of every chain


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is in the prefix cache: its chain hash and own tokens
    # (compared on lookup, so a hash collision is a miss, never wrong KV).
    hash: int | None = None
    token_ids: tuple[Hashable, ...] = ()


def chain_hashes(token_ids: list[Hashable], block_size: int) -> list[tuple[int, tuple[Hashable, ...]]]:
    """(chain hash, tokens) of every full block of `token_ids` (cache keys), in order."""
    chain, parent = [], _ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = tuple(token_ids[start : start + block_size])
        parent = hash((parent, tokens))
        chain.append((parent, tokens))
    return chain


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; oldest first
        self._cached: dict[int, int] = {}  # chain hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now (evicting cached ones if need be)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------
    def match_prefix(self, token_ids: list[Hashable]) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids` (cache keys; full blocks only).

        Never the whole sequence: at least its last token is left to compute, so
        the step that feeds it has logits to sample from."""
        matched = []
        for chain_hash, tokens in chain_hashes(token_ids[:-1], self.block_size):
            block_id = self._cached.get(chain_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
        return matched

    def num_cached_tokens(self, token_ids: list[Hashable]) -> int:
        """Tokens of `token_ids` a new sequence would find in the cache (read-only)."""
        return len(self.match_prefix(token_ids)) * self.block_size

    def allocate_prefix(self, seq: Sequence, use_cache: bool = True) -> int:
        """Start a sequence's table with its cached prefix; returns the cached token count."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        matched = self.match_prefix(seq.cache_keys) if use_cache else []
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(matched)
        seq.block_hashes = [self.blocks[b].hash for b in matched]  # type: ignore[misc]
        return len(matched) * self.block_size

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Start `child`'s table with `parent`'s first `num_blocks` blocks, shared by
        reference count: computed KV both read and neither writes again."""
        assert not child.block_table, f"seq {child.seq_id} already holds blocks"
        assert num_blocks <= len(parent.block_hashes), "only computed full blocks can be shared"
        shared = parent.block_table[:num_blocks]
        for block_id in shared:
            # The parent holds each, so none is in _free or _evictable.
            assert self.blocks[block_id].ref_count > 0
            self.blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        child.block_hashes = parent.block_hashes[:num_blocks]

    # -- growth and release ----------------------------------------------------
    def num_blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` holds `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_to_grow(seq, num_tokens) <= self.num_free_blocks

    def max_tokens_for(self, seq: Sequence) -> int:
        """The most tokens `seq` could hold in total with every free block."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend the table to hold `num_tokens`; the caller checked can_grow."""
        for _ in range(self.num_blocks_to_grow(seq, num_tokens)):
            block_id = self._take_block()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past those `num_tokens` tokens need (taken for drafted
        tokens that were rejected: private, never committed). The table becomes a
        new list: one changes in place only by growing (Sequence.sent_table)."""
        keep = max(self.blocks_for(num_tokens), len(seq.block_hashes))
        if len(seq.block_table) <= keep:
            return
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, f"block {block.block_id} is not a private tail"
            block.ref_count = 0
            self._free.append(block_id)
        seq.block_table = seq.block_table[:keep]

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes) * self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH
        keys, offset = seq.cache_keys_in(start, num_full * self.block_size), start
        for index in range(len(seq.block_hashes), num_full):
            tokens = tuple(keys[start - offset : start - offset + self.block_size])
            parent = hash((parent, tokens))
            block = self.blocks[seq.block_table[index]]
            # Two sequences may compute the same content at once: the first one
            # registered stays the cached copy; the other block stays private.
            if block.hash is None and parent not in self._cached:
                block.hash, block.token_ids = parent, tokens
                self._cached[parent] = block.block_id
            seq.block_hashes.append(parent)
            start += self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its cached blocks stay reusable until evicted."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block of `table` (a table no sequence holds any more)."""
        # Tail first: when evicting, the ends of chains go before their shared starts.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        block = self.blocks[block_id]
        del self._cached[block.hash]  # type: ignore[arg-type]
        block.hash, block.token_ids = None, ()
        return block_id
