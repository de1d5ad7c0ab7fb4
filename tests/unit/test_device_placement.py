"""The dense part on the device Ray assigned the ingress, tested up to the device call: on the
`meta` device (shapes only, no data), a whole step (embedding, attention for prefill and decode
chunks with the KV cache, routing, logits) must keep every tensor on that device: one created on
the CPU by mistake makes torch refuse to mix them. (No GPU here: the CUDA run is not tested.)"""

from __future__ import annotations

import torch

from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import Chunk, DenseModel, StepBatch
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.random_init import write_random_mixtral


def test_a_step_stays_on_the_dense_device(tmp_path):
    path = write_random_mixtral(tmp_path / "m", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=2, num_experts=4)
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    device = torch.device("meta")
    dense = DenseModel(cfg, ckpt.dense_state(), device)
    cache = PagedKVCache(cfg, 16, 4, cfg.dtype, device)
    assert dense.embed_tokens.device == device and dense.layers[1]["gate"].device == device
    assert cache.k[0].device == device and dense.inv_freq.device == device
    chunks = [Chunk(0, 0, [1, 2, 3, 4]), Chunk(1, 5, [7]), Chunk(2, 2, [9])]  # prefill + 2 decodes
    for c in chunks:
        assert cache.allocate() == c.slot
        cache.reserve(c.slot, c.start + len(c.tokens), c.start)
    batch = StepBatch(chunks)
    with torch.inference_mode():
        h = dense.embed(batch)
        assert h.device == device and batch.ids.device == device and batch.last_rows.device == device
        for layer in range(cfg.num_layers):
            h = dense.attention(layer, h, batch, cache)
            x, indices, weights = dense.route(layer, h)
            assert {t.device for t in (h, x, indices, weights)} == {device}
        logits = dense.logits(h, batch.last_rows)
    assert logits.device == device and tuple(logits.shape) == (3, cfg.vocab_size)

