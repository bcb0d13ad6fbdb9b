"""The prefix cache keys on the adapter: two adapters never share KV blocks for the same prompt."""

from __future__ import annotations

from switchyard_xeon.block_manager import BlockManager, rooted_keys

TOKENS = list(range(100, 117))  # four full blocks of 4, and one token more


def _commit(blocks: BlockManager, seq: int, root: bytes | None) -> None:
    keys = rooted_keys(None, root) if root is not None else None
    hit = blocks.lookup(TOKENS, keys)
    assert blocks.allocate(seq, hit, len(TOKENS))
    blocks.commit(seq, TOKENS, len(TOKENS), keys)
    blocks.free(seq)


def test_adapters_and_the_base_part_at_the_first_block() -> None:
    blocks = BlockManager(num_blocks=32, block_size=4)
    _commit(blocks, 1, b"lora:1:a")
    assert blocks.lookup(TOKENS, rooted_keys(None, b"lora:1:a")).tokens == 16  # same adapter
    assert blocks.lookup(TOKENS, rooted_keys(None, b"lora:2:b")).tokens == 0  # another
    assert blocks.lookup(TOKENS).tokens == 0  # the base model
    _commit(blocks, 2, None)
    assert blocks.lookup(TOKENS).tokens == 16
    assert blocks.lookup(TOKENS, rooted_keys(None, b"lora:2:b")).tokens == 0


def test_image_keys_still_count_under_a_root() -> None:
    def images(index: int) -> bytes:
        return b"img" if index == 2 else b""

    blocks = BlockManager(num_blocks=32, block_size=4)
    keys = rooted_keys(images, b"lora:1:a")
    hit = blocks.lookup(TOKENS, keys)
    assert blocks.allocate(1, hit, len(TOKENS))
    blocks.commit(1, TOKENS, len(TOKENS), keys)
    blocks.free(1)
    assert blocks.lookup(TOKENS, keys).tokens == 16
    assert blocks.lookup(TOKENS, rooted_keys(None, b"lora:1:a")).tokens == 8  # parts at block 2
