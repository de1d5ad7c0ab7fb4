"""The paged KV cache's bookkeeping (moe_workers.model.kv_blocks): pure, no model, no torch.

Block reference counts, the free queue, prefix digests and sliding-window freeing, checked by
hand on small cases and against their invariants on random operation sequences (hypothesis).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_workers.model.family import Arch
from moe_workers.model.kv_blocks import (NULL_BLOCK, BlockPool, KVCacheManager, NoFreeBlocks, block_digests,
                                         budget_problem, kv_groups, sequence_blocks)


def _arch(**kw) -> Arch:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=4, num_heads=4, num_kv_heads=2,
                head_dim=8, num_experts=4, top_k=2, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096,
                tie_word_embeddings=False)
    return Arch(**{**base, **kw})


def test_digests_chain_over_everything_before_a_block():
    a = block_digests(list(range(12)), 4)
    b = block_digests(list(range(8)) + [99, 9, 10, 11], 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # the same block of tokens after a different prefix is another block
    assert block_digests([5] * 8, 4)[1] != block_digests([6] * 4 + [5] * 4, 4)[1]
    assert block_digests(list(range(8)), 4, salt=b"model-2") != block_digests(list(range(8)), 4)
    assert block_digests([1, 2, 3], 4) == []  # a partial block has no digest


def test_pool_hands_out_least_recently_freed_first_and_drops_its_cache_entry():
    pool = BlockPool(4)  # blocks 1..3
    a, b, c = pool.take(3)
    pool.register(0, b"x", a)
    pool.release([a])
    pool.release([c])
    assert pool.num_free == 2 and pool.lookup(0, b"x") == a
    (first,) = pool.take(1)  # a was freed first: it goes, with its cached digest
    assert first == a and pool.lookup(0, b"x") is None and pool.evictions == 1
    with pytest.raises(NoFreeBlocks):
        pool.take(2)
    assert NULL_BLOCK not in (a, b, c)


def test_a_cached_prefix_is_shared_and_held_by_both():
    m = KVCacheManager(num_blocks=20, block_size=4, windows=[None])
    tokens = list(range(10, 30))  # 5 full blocks
    assert m.admit(1, tokens, first_chunk=100) == 0
    m.commit(1, tokens, 20)
    assert m.cached_prefix(tokens) == 16  # the last token is always computed again
    again = tokens[:18] + [7, 7]
    assert m.admit(2, again, first_chunk=100) == 16
    shared = m.table(1, 0)[:4]
    assert m.table(2, 0)[:4] == shared and all(m.pool.refs[b] == 2 for b in shared)
    m.free(1)
    assert all(m.pool.refs[b] == 1 for b in shared)
    m.free(2)
    assert m.num_used == 0 and m.cached_prefix(tokens) == 16  # freed but still cached until handed out
    m.reset_prefix_cache()
    assert m.cached_prefix(tokens) == 0


def test_without_prefix_caching_nothing_is_shared():
    m = KVCacheManager(num_blocks=20, block_size=4, windows=[None], prefix_caching=False)
    tokens = list(range(12))
    m.admit(1, tokens, 100)
    m.commit(1, tokens, 12)
    assert m.admit(2, tokens, 100) == 0 and not set(m.table(1, 0)) & set(m.table(2, 0))


def test_a_sliding_window_group_frees_what_no_later_query_reads():
    m = KVCacheManager(num_blocks=64, block_size=4, windows=[None, 8])
    m.start(1)
    m.allocate(1, 40, 0)
    assert len(m.table(1, 0)) == 10 and len(m.table(1, 1)) == 10
    m.allocate(1, 41, 40)  # the query at 40 reads keys 33..40: blocks 8..10
    full, window = m.table(1, 0), m.table(1, 1)
    assert NULL_BLOCK not in full and len(full) == 11
    assert window[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in window[8:]
    assert m.num_used == 11 + 3


def test_a_window_hit_needs_only_the_blocks_its_next_query_reads():
    m = KVCacheManager(num_blocks=64, block_size=4, windows=[8])
    tokens = list(range(100, 140))
    m.admit(1, tokens, 100)
    m.commit(1, tokens, 40)
    m.allocate(1, 41, 40)  # frees the early blocks (they stay cached until handed out)
    m.free(1)
    m.pool.take(3)  # hand out the three least recently freed: the window's first blocks
    assert m.cached_prefix(tokens) == 36  # the next query (36) reads 29..36: blocks 7, 8 are cached


def test_admission_and_growth_refuse_without_holding_anything():
    m = KVCacheManager(num_blocks=5, block_size=4, windows=[None])  # 4 usable
    with pytest.raises(NoFreeBlocks):
        m.admit(1, list(range(20)), 100)
    assert m.num_used == 0 and 1 not in m.seqs
    m.admit(1, list(range(8)), 100)
    with pytest.raises(NoFreeBlocks):
        m.allocate(1, 24, 8)
    assert m.num_used == 2


def test_sizes_and_the_budget_check():
    gpt_oss_like = _arch(num_layers=4, sliding_window=128,
                         layer_types=("sliding_attention", "full_attention") * 2)
    assert [g.window for g in kv_groups(gpt_oss_like)] == [128, None]
    # full layers hold every token, windowed ones 128 tokens (+ a partial block on each side)
    assert sequence_blocks(gpt_oss_like, 16, 4096) == 256 + 9
    assert sequence_blocks(_arch(), 16, 4096) == 256
    per_block = 4 * 16 * 2 * 2 * 8 * 2  # 4 layers x 16 tokens x (k + v) x 2 heads x 8 dims x 2 bytes
    assert budget_problem(_arch(), 257 * per_block, 16, 2, 4096) is None
    problem = budget_problem(_arch(), 256 * per_block, 16, 2, 4096)
    assert "holds 255 blocks of 16 tokens" in problem and "needs 256" in problem


OPS = st.lists(st.tuples(st.sampled_from(["admit", "grow", "commit", "free", "reset"]), st.integers(0, 5),
                         st.integers(1, 40), st.integers(0, 3)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([[None], [None, 6], [5]]))
def test_invariants_hold_over_any_sequence_of_operations(ops, windows):
    bs = 4
    m = KVCacheManager(num_blocks=24, block_size=bs, windows=windows)
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [9] * 40, list(range(40)), [1, 2, 3, 4] + [0] * 36]
    tokens: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    for op, seq, n, which in ops:
        if op == "admit" and seq not in m.seqs:
            toks = prefixes[which][:n]
            try:
                computed[seq] = m.admit(seq, toks, first_chunk=3)
            except NoFreeBlocks:
                assert seq not in m.seqs
                continue
            tokens[seq] = toks
            assert computed[seq] % bs == 0 and computed[seq] < len(toks)
            # a hit is the same tokens: every block it took was registered under this prefix's digest
            digests = block_digests(toks, bs)
            for g, table in enumerate(m.seqs[seq].tables):
                for i in range(computed[seq] // bs):
                    if table[i] != NULL_BLOCK:
                        assert m.pool.digest[table[i]] == (g, digests[i])
        elif op == "grow" and seq in m.seqs:
            total = min(len(tokens[seq]), computed[seq] + 3)
            try:
                m.allocate(seq, total, computed[seq])
            except NoFreeBlocks:
                continue
            computed[seq] = total
        elif op == "commit" and seq in m.seqs:
            m.commit(seq, tokens[seq], computed[seq])
        elif op == "free":
            m.free(seq)
        elif op == "reset":
            m.reset_prefix_cache()
        # every block is held exactly as often as tables name it, or free; never both, never lost
        held: dict[int, int] = {}
        for state in m.seqs.values():
            for table in state.tables:
                for b in table:
                    if b != NULL_BLOCK:
                        held[b] = held.get(b, 0) + 1
        for b in range(1, m.pool.num_blocks):
            assert m.pool.refs[b] == held.get(b, 0)
            assert (b in m.pool.free) == (held.get(b, 0) == 0)
        assert m.num_used + m.num_free == m.pool.usable
        # the cache index and the blocks' digests agree
        assert all(m.pool.digest[b] == key for key, b in m.pool.cached.items())
    for seq in list(m.seqs):
        m.free(seq)
    assert m.num_free == m.pool.usable
