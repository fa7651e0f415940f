"""BlockManager: on-demand tables, reference counts, prefix cache, LRU eviction."""
from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import ImageSpan, SamplingParams, Sequence, StoppingCriteria


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=list(tokens),
                    sampling=SamplingParams(), stopping=StoppingCriteria(max_tokens=4), arrival_us=1)


def computed(blocks: BlockManager, seq: Sequence) -> None:
    """As after a step that computed the whole sequence."""
    blocks.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    blocks.commit(seq)


def test_grow_and_free_return_every_block():
    blocks = BlockManager(num_blocks=10, block_size=4)
    a, b = seq_of(1, range(5)), seq_of(2, range(100, 104))
    assert blocks.allocate_prefix(a) == 0 and blocks.allocate_prefix(b) == 0
    blocks.grow(a, 5)
    blocks.grow(b, 4)
    assert len(a.block_table) == 2 and len(b.block_table) == 1 and blocks.num_free_blocks == 7
    assert blocks.num_blocks_to_grow(a, 8) == 0 and blocks.num_blocks_to_grow(a, 9) == 1
    assert not set(a.block_table) & set(b.block_table)
    assert not blocks.can_grow(a, 4 * 10)
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free_blocks == 10 and a.block_table == []


def test_full_computed_blocks_are_shared_by_a_later_sequence():
    blocks = BlockManager(num_blocks=10, block_size=4)
    first = seq_of(1, range(10))  # 2 full blocks + 2 tokens
    blocks.allocate_prefix(first)
    computed(blocks, first)
    assert blocks.num_cached_blocks == 2
    second = seq_of(2, list(range(8)) + [50, 51, 52])
    assert blocks.num_cached_tokens(second.prompt_token_ids) == 8
    assert blocks.allocate_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [blocks.blocks[b].ref_count for b in second.block_table] == [2, 2]
    different = seq_of(3, [99] + list(range(1, 10)))
    assert blocks.allocate_prefix(different) == 0  # the chain breaks at the first block
    blocks.free(first)
    blocks.free(second)
    blocks.free(different)
    assert blocks.num_free_blocks == 10 and blocks.num_cached_blocks == 2  # cached, evictable


def test_the_last_token_is_never_served_from_the_cache():
    blocks = BlockManager(num_blocks=10, block_size=4)
    first = seq_of(1, range(8))
    blocks.allocate_prefix(first)
    computed(blocks, first)
    blocks.free(first)
    again = seq_of(2, range(8))  # the same 2 full blocks: only the first is reused
    assert blocks.allocate_prefix(again) == 4
    blocks.free(again)


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    old, new = seq_of(1, [1, 2, 3]), seq_of(2, [7, 8, 9])
    for seq in (old, new):
        blocks.allocate_prefix(seq)
        computed(blocks, seq)
        blocks.free(seq)  # 1 cached block and 1 plain free block each
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 2
    taker = seq_of(3, [5, 5, 5, 5, 5])
    blocks.allocate_prefix(taker)
    blocks.grow(taker, 5)  # 3 blocks: the 2 uncached ones, then the older cached one
    assert blocks.num_cached_tokens([1, 2, 3]) == 0
    assert blocks.num_cached_tokens([7, 8, 9]) == 2
    blocks.free(taker)
    assert blocks.num_free_blocks == 4


def test_a_hit_on_an_evictable_block_takes_it_out_of_the_free_count():
    blocks = BlockManager(num_blocks=3, block_size=2)
    first = seq_of(1, [1, 2, 3])
    blocks.allocate_prefix(first)
    computed(blocks, first)
    blocks.free(first)
    second = seq_of(2, [1, 2, 4])
    assert blocks.allocate_prefix(second) == 2
    assert blocks.num_free_blocks == 2
    blocks.grow(second, 3)
    assert blocks.num_free_blocks == 1
    blocks.free(second)
    assert blocks.num_free_blocks == 3


def test_same_content_computed_twice_keeps_one_cached_copy():
    blocks = BlockManager(num_blocks=6, block_size=2)
    a, b = seq_of(1, [1, 2, 3]), seq_of(2, [1, 2, 3])
    for seq in (a, b):
        blocks.allocate_prefix(seq)
    computed(blocks, a)
    computed(blocks, b)
    assert blocks.num_cached_blocks == 1 and a.block_hashes == b.block_hashes
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free_blocks == 6


def _with_image(seq_id: int, content_hash: bytes) -> Sequence:
    """12 prompt tokens: text 0..2, an image's 6 placeholders (token 99) at 3..8, text 9..11."""
    seq = seq_of(seq_id, [0, 1, 2] + [99] * 6 + [9, 10, 11])
    seq.images = (ImageSpan(content_hash, 3, 6, message=None),)
    return seq


def test_image_blocks_are_keyed_by_the_image_content():
    blocks = BlockManager(num_blocks=20, block_size=4)
    first = _with_image(1, b"A" * 32)
    blocks.allocate_prefix(first)
    computed(blocks, first)
    # Same tokens, another image: only the block before the image is shared.
    other = _with_image(2, b"B" * 32)
    assert blocks.allocate_prefix(other) == 0  # block 0 holds position 3, an image token
    # The same image: every full block but the one holding the last token.
    same = _with_image(3, b"A" * 32)
    assert blocks.allocate_prefix(same) == 8
    assert same.block_table == first.block_table[:2]
    # A text-only prompt of the same token ids shares nothing with either.
    text = seq_of(4, [0, 1, 2] + [99] * 6 + [9, 10, 11])
    assert blocks.allocate_prefix(text) == 0
