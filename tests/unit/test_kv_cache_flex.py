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
    return outs


def test_flex_decode_reads_what_gather_reads(tmp_path):
    outs = _attend_both_ways(tmp_path)
    assert outs["flex-used"] == ("flex", "")  # it ran (this torch compiles flex attention for the CPU)
    for a, b in zip(outs["gather"], outs["flex"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_failing_flex_path_falls_back_to_gather_and_says_why(tmp_path, monkeypatch):
    """(Seen on this CPU: inductor's C++ code for some shapes does not compile.)"""
    import moe_workers.model.kv_cache as kv_cache

    def broken(dynamic=False):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(kv_cache, "_flex", broken)
    outs = _attend_both_ways(tmp_path)
    assert outs["flex-used"] == ("gather", "RuntimeError: no kernel for this device")
    for a, b in zip(outs["gather"], outs["flex"]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
