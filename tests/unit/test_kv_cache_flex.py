"""The paged cache's two ways of reading blocks for decode (moe_workers.model.kv_cache): FlexAttention
over the whole pool (the CUDA path) gives what gathering each sequence's blocks gives, on this CPU,
with blocks shared between sequences (a prefix hit) and with a sliding window. No GPU here: the
device call itself is the same one, on another device."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_family
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import Chunk, DenseModel, StepBatch
from moe_workers.model.kv_cache import PagedKVCache

pytest.importorskip("torch.nn.attention.flex_attention")


def _attend_both_ways(tmp_path):
    make_family(tmp_path, "mixtral", config_overrides={"sliding_window": 8})
    ckpt = Checkpoint(tmp_path)
    cfg = ckpt.config
    dense = DenseModel(cfg, ckpt.dense_state())
    outs = {}
    for way in ("gather", "flex"):
        cache = PagedKVCache(cfg, 40, 4, cfg.dtype, attention=way)
        for t in (*cache.k, *cache.v):
            t.normal_(generator=torch.Generator().manual_seed(2))
        # three sequences; the second shares the first's first two blocks (a prefix hit)
        for seq, total in ((0, 21), (1, 14), (2, 6)):
            assert cache.allocate() == seq
        cache.reserve(0, 21, 20)
        cache.manager.seqs[1].tables[0] = cache.manager.table(0, 0)[:2]
        for b in cache.manager.table(1, 0):
            cache.manager.pool.hold(b)
        cache.reserve(1, 14, 13)
        cache.reserve(2, 6, 5)
        batch = StepBatch([Chunk(0, 20, [5]), Chunk(1, 13, [7]), Chunk(2, 5, [9])])
        h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            dense.embed(batch)
            outs[way] = [dense.attention(layer, h, batch, cache) for layer in range(cfg.num_layers)]
        outs[way + "-used"] = (cache.attention, cache.flex_error)
        outs[way + "-path"] = cache.attention_path()
    return outs


def test_flex_decode_reads_what_gather_reads(tmp_path):
    outs = _attend_both_ways(tmp_path)
    assert outs["flex-used"] == ("flex", "")  # it ran (this torch compiles flex attention for the CPU)
    for a, b in zip(outs["gather"], outs["flex"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_failing_flex_path_falls_back_to_gather_and_says_so(tmp_path, monkeypatch, caplog):
    """(Seen on this CPU: inductor's C++ code for some shapes does not compile.) Not silently:
    logged once, counted, and in attention_path(), which the Ingress' status and metrics read."""
    import moe_workers.model.kv_cache as kv_cache

    def broken(dynamic=False):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(kv_cache, "_flex", broken)
    with caplog.at_level("WARNING", logger="moe_workers.model.kv_cache"):
        outs = _attend_both_ways(tmp_path)
    assert outs["flex-used"] == ("gather", "RuntimeError: no kernel for this device")
    assert outs["flex-path"] == {"configured": "flex", "running": "gather", "fallbacks": 1,
                                 "error": "RuntimeError: no kernel for this device"}
    assert [r.message for r in caplog.records if "flex attention failed" in r.message] == [
        "flex attention failed, decode gathers the KV blocks from now on: RuntimeError: no kernel for this device"]
    for a, b in zip(outs["gather"], outs["flex"]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("batch", [1, 17])  # one query; two blocks of 16 queries, the second padded
def test_flex_decode_at_batches_that_fill_query_blocks_partly(tmp_path, batch):
    make_family(tmp_path, "qwen3_moe", hidden_size=64)
    ckpt = Checkpoint(tmp_path)
    cfg = ckpt.config
    dense = DenseModel(cfg, ckpt.dense_state())
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 40, (batch,), generator=g).tolist()
    outs = {}
    for way in ("gather", "flex"):
        cache = PagedKVCache(cfg, 8 * batch + 4, 8, cfg.dtype, attention=way)
        for t in (*cache.k, *cache.v):
            t.normal_(generator=torch.Generator().manual_seed(2))
        for seq, n in enumerate(lengths):
            assert cache.allocate() == seq
            cache.reserve(seq, n + 1, n)
        batch_ = StepBatch([Chunk(seq, n, [5]) for seq, n in enumerate(lengths)])
        h = torch.randn(batch, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            dense.embed(batch_)
            outs[way] = dense.attention(0, h, batch_, cache)
        assert cache.attention == way, cache.flex_error
    torch.testing.assert_close(outs["gather"], outs["flex"], atol=1e-5, rtol=1e-5)


def test_the_flex_mask_costs_the_blocks_in_use_not_the_pool():
    """On CUDA (a fake one here) the mask lists each block of 16 queries' own blocks: a pool of a
    million blocks and four short sequences make a mask of a few entries."""
    from fake_cuda import fake_cuda
    from moe_workers.model.kv_cache import FLEX_Q_BLOCK, flex_block_mask, flex_kernel_options

    rows = [[7, 9], [7, 9, 11], [500_000], [3]]  # the first two share a prefix block
    with fake_cuda():
        logical = torch.full((1_000_000,), -1, dtype=torch.int32, device="cuda")
        mask = flex_block_mask(rows, [0, 0, 0, 0], [20, 40, 5, 3], None, 16, logical)
        assert tuple(mask.kv_indices.shape) == (1, 1, 1, 5)  # one block of queries, 5 distinct blocks
        assert mask.seq_lengths == (FLEX_Q_BLOCK, 16_000_000)
    assert flex_kernel_options(16) == {"BACKEND": "TRITON", "BLOCK_M": 16, "BLOCK_N": 16}
