"""The block allocator: tables that grow, reference counts, prefix hits, LRU eviction."""

from __future__ import annotations

from switchyard_xeon.block_manager import ROOT_HASH, BlockManager, PrefixHit, chain_hash

BS = 4


def _computed(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """Allocate ``seq_id`` from its prefix hits and mark all its tokens computed."""
    assert bm.allocate(seq_id, bm.lookup(tokens), len(tokens))
    bm.commit(seq_id, tokens, len(tokens))


def test_tables_grow_a_block_at_a_time_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.grow(1, 1) and bm.table(1) == [0]
    assert bm.grow(1, 4) and len(bm.table(1)) == 1  # still fits in one block
    assert bm.grow(1, 5) and len(bm.table(1)) == 2  # ceil(5 / 4)
    assert bm.grow(2, 9) and len(bm.table(2)) == 3
    assert bm.num_used_blocks == 5 and bm.num_free_blocks == 3
    assert bm.slots(1, 3, 2) == [bm.table(1)[0] * BS + 3, bm.table(1)[1] * BS]
    assert not bm.grow(1, 6 * BS)  # 4 more blocks, 3 free
    assert bm.grow(1, 5 * BS) and bm.num_free_blocks == 0
    bm.free(1)
    bm.free(1)  # twice: ignored
    bm.free(99)  # unknown: ignored
    assert bm.num_free_blocks == 5 and bm.table(1) == []  # sequence 2 keeps its 3
    bm.free(2)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_a_failed_grow_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    assert bm.grow(1, 8)
    assert not bm.grow(2, 5)  # needs 2 blocks, 1 free
    assert bm.table(2) == [] and bm.num_free_blocks == 1
    assert bm.room(1) == 3 * BS and bm.room(2) == BS


def test_recently_freed_blocks_are_reused_first():
    bm = BlockManager(num_blocks=8, block_size=BS, prefix_caching=False)
    bm.grow(1, 3 * BS)
    bm.free(1)
    bm.grow(2, 2 * BS)
    assert bm.table(2) == [0, 1]  # the pool's low end stays the hot end


def test_shared_prefix_is_found_and_reference_counted():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 112))  # three full blocks
    _computed(bm, 1, prefix + [7, 8])
    used = bm.num_used_blocks
    hit = bm.lookup(prefix + [9, 9, 9])
    assert hit.blocks == tuple(bm.table(1)[:3]) and hit.tokens == 12 and hit.evictable == 0
    assert bm.allocate(2, hit, 15)
    assert bm.table(2)[:3] == bm.table(1)[:3]
    assert bm.num_used_blocks == used + 1  # only the tail block is new
    bm.free(1)
    assert bm.num_used_blocks == 4  # the shared blocks live on with sequence 2
    assert bm.lookup(prefix + [1]).tokens == 12
    bm.free(2)
    assert bm.num_used_blocks == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))  # exactly two blocks
    _computed(bm, 1, tokens)
    assert bm.lookup(tokens).tokens == 4  # the last block is recomputed
    assert bm.lookup(tokens + [8]).tokens == 8


def test_hashes_chain_so_equal_blocks_after_different_prefixes_do_not_match():
    bm = BlockManager(num_blocks=8, block_size=BS)
    _computed(bm, 1, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.lookup([9, 9, 9, 9, 5, 6, 7, 8, 0]).tokens == 0
    assert bm.lookup([1, 2, 3, 4, 5, 6, 7, 9, 0]).tokens == 4
    assert chain_hash(ROOT_HASH, [5, 6, 7, 8]) != chain_hash(chain_hash(ROOT_HASH, [1, 2, 3, 4]),
                                                             [5, 6, 7, 8])


def test_only_computed_full_blocks_are_shared():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))
    assert bm.allocate(1, bm.lookup(tokens), 10)
    bm.commit(1, tokens, 6)  # one full block computed so far
    assert bm.lookup(tokens).tokens == 4
    bm.commit(1, tokens, 10)
    assert bm.lookup(tokens).tokens == 8


def test_freed_prefixes_stay_cached_until_the_free_blocks_run_out():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = list(range(8)) + [0], list(range(50, 58)) + [0]
    _computed(bm, 1, a)
    _computed(bm, 2, b)
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    hit = bm.lookup(a)
    assert hit.tokens == 8 and hit.evictable == 2
    assert bm.room(3, hit) == 6 * BS  # reusing cached blocks costs nothing extra
    bm.grow(3, 2 * BS)  # takes the two never-hashed blocks: nothing evicted
    assert bm.lookup(a).tokens == 8 and bm.lookup(b).tokens == 8
    bm.grow(4, BS)  # evicts the least recently used: the tail of a
    assert bm.lookup(a).tokens == 4 and bm.lookup(b).tokens == 8
    bm.grow(4, 2 * BS)  # then a's head
    assert bm.lookup(a).tokens == 0 and bm.lookup(b).tokens == 8
    assert bm.num_cached_blocks == 2


def test_a_hit_on_evictable_blocks_takes_them_back():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = list(range(8)) + [0]
    _computed(bm, 1, tokens)
    bm.free(1)
    hit = bm.lookup(tokens)
    assert bm.allocate(2, hit, 4 * BS)  # all four blocks: the two hits must not be evicted
    assert bm.table(2)[:2] == list(hit.blocks) and bm.num_free_blocks == 0
    assert not bm.allocate(3, PrefixHit(block_size=BS), 1)


def test_the_same_prefix_computed_twice_keeps_one_name():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(5))
    for seq_id in (1, 2):  # admitted together: neither saw the other's blocks
        assert bm.allocate(seq_id, bm.lookup(tokens), 5)
    bm.commit(1, tokens, 5)
    bm.commit(2, tokens, 5)
    assert bm.lookup(tokens + [5]).blocks == (bm.table(1)[0],)
    bm.free(1)
    bm.free(2)
    assert bm.num_cached_blocks == 1 and bm.num_free_blocks == 8


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, prefix_caching=False)
    _computed(bm, 1, list(range(9)))
    assert bm.lookup(list(range(9))).tokens == 0
    bm.free(1)
    assert bm.num_cached_blocks == 0



def test_text_hashes_are_the_token_ids_alone():
    """A block without an extra key hashes as before extra keys existed: SHA-256 of the
    parent's name and the ids as int64, so caches and tests of text models are unchanged."""
    import hashlib
    from array import array

    tokens = [1, 2, 3, 4]
    want = hashlib.sha256(ROOT_HASH + array("q", tokens).tobytes()).digest()
    assert chain_hash(ROOT_HASH, tokens) == want == chain_hash(ROOT_HASH, tokens, b"")
    assert chain_hash(want, [5, 6, 7, 8]) == hashlib.sha256(
        want + array("q", [5, 6, 7, 8]).tobytes()).digest()
    bm = BlockManager(num_blocks=8, block_size=BS)
    _computed(bm, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # A text sequence's keys function is None; one that gives b"" everywhere names the same.
    assert bm.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0], lambda i: b"").tokens == 8
    assert bm.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]).hashes == bm.lookup(
        [1, 2, 3, 4, 5, 6, 7, 8, 0], lambda i: b"").hashes


def test_extra_keys_split_equal_ids():
    """Equal ids with another extra key on block 1 share block 0 only; the same keys share
    every full block; a later block inherits the difference through the chain."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8, 0]

    def image(name: bytes):
        return lambda i: name if i == 1 else b""

    assert bm.allocate(1, bm.lookup(tokens, image(b"a")), len(tokens))
    bm.commit(1, tokens, len(tokens), image(b"a"))
    assert bm.lookup(tokens, image(b"b")).tokens == 4
    assert bm.lookup(tokens, image(b"a")).tokens == 12
    assert bm.lookup(tokens).tokens == 4
    # Committed under another key: the same ids get blocks of their own names.
    assert bm.allocate(2, bm.lookup(tokens, image(b"b")), len(tokens))
    bm.commit(2, tokens, len(tokens), image(b"b"))
    assert bm.table(2)[0] == bm.table(1)[0] and bm.table(2)[1:3] != bm.table(1)[1:3]
    assert bm.lookup(tokens, image(b"b")).tokens == 12


def test_sequence_block_keys_name_the_images_they_cover():
    """Blocks before and after an image's placeholders key on ids alone; every block that
    covers one of them names the image's hash and place."""
    from switchyard_spec import ImageInput
    from switchyard_xeon.sequence import image_block_key
    from tests.support.scheduler_sim import make_seq

    text = make_seq("t", 12)
    assert text.block_keys(BS) is None
    images = (ImageInput(offset=3, length=6, content_hash="aa", pixel_values=b"", shape=(1,)),
              ImageInput(offset=9, length=2, content_hash="bb", pixel_values=b"", shape=(1,)))
    keys = [image_block_key(images, i * BS, (i + 1) * BS) for i in range(4)]
    assert keys[0] == b"3:6:aa;" and keys[1] == b"3:6:aa;"
    assert keys[2] == b"3:6:aa;9:2:bb;" and keys[3] == b""
    other = (images[0], ImageInput(offset=9, length=2, content_hash="cc", pixel_values=b"",
                                   shape=(1,)))
    assert image_block_key(other, 0, BS) == keys[0]
    assert image_block_key(other, 2 * BS, 3 * BS) != keys[2]
    from switchyard_spec import EngineRequest, SamplingParams, StoppingParams
    from switchyard_xeon.sequence import Sequence

    request = EngineRequest(request_id="img", prompt_token_ids=tuple(range(16)),
                            sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=1),
                            images=images)
    seq = Sequence(request, lambda event: None, None,  # type: ignore[arg-type]
                   max_length=17, ignore_eos=True)
    block_keys = seq.block_keys(BS)
    assert block_keys is not None and [block_keys(i) for i in range(4)] == keys
