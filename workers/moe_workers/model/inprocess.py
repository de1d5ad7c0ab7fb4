"""The whole model in one process: the reference our served app is compared and benchmarked against."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .dense import Chunk, DenseModel, StepBatch
from .experts import LocalExperts
from .kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache, kv_groups
from .sampling import SamplingParams, sample_batch


class InProcessModel:
    def __init__(self, path: str | Path, dtype: str | torch.dtype | None = None, max_len: int | None = None,
                 max_sequences: int = 8, family: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 device: torch.device | str = "cpu", attention: str | None = None):
        """`device`: where every weight, the KV cache and the compute live (the GPU kit runs the
        model on CUDA; the served app puts the dense part and each shard's hot tier there).
        `attention`: how decode reads the KV cache (`PagedKVCache`; default: the device's)."""
        self.ckpt = Checkpoint(path, family)
        self.cfg = self.ckpt.config.with_dtype(dtype)
        self.device = torch.device(device)
        self.dense = DenseModel(self.cfg, self.ckpt.dense_state(), self.device)
        self.experts = LocalExperts(self.ckpt, self.cfg.dtype, device=self.device)
        self.max_len = max_len or self.cfg.max_position_embeddings
        # room for max_sequences sequences of max_len tokens (no prefix sharing here)
        blocks = max_sequences * len(kv_groups(self.cfg)) * -(-self.max_len // block_size)
        self.cache = PagedKVCache(self.cfg, blocks + 1, block_size, self.cfg.dtype, self.device, prefix_caching=False,
                                  attention=attention)

    @torch.inference_mode()
    def step(self, chunks: list[Chunk], all_rows: bool = False) -> torch.Tensor:
        """Logits of each chunk's last token (or of every token with all_rows). Each chunk's
        sequence (from `cache.allocate()`) gets the blocks it needs."""
        for c in chunks:
            self.cache.reserve(c.slot, c.start + len(c.tokens), c.start)
        batch = StepBatch(chunks)
        h = self.dense.embed(batch)
        for layer in range(self.cfg.num_layers):
            h = self.dense.attention(layer, h, batch, self.cache)
            x, indices, weights = self.dense.route(layer, h)
            moe = None if indices is None else self.experts.moe(layer, x, indices, weights)
            h = self.dense.residual(h, moe, self.dense.local(layer, x))
        return self.dense.logits(h, None if all_rows else batch.last_rows)

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt, like transformers' model(ids).logits[0]."""
        seq = self.cache.allocate()
        try:
            return self.step([Chunk(seq, 0, list(ids))], all_rows=True)
        finally:
            self.cache.release(seq)

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = False) -> list[list[int]]:
        """Completions for several prompts decoded together (one step per token, all sequences)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        params = SamplingParams(temperature=temperature, top_p=top_p)
        seqs = [self.cache.allocate() for _ in prompts]
        try:
            outputs: list[list[int]] = [[] for _ in prompts]
            chunks = [Chunk(s, 0, list(p)) for s, p in zip(seqs, prompts)]
            active = list(range(len(prompts)))
            while active and max_tokens > 0:
                logits = self.step([chunks[i] for i in active])
                # the step's rows in one call: one read of the device a step, not one a row (a
                # seeded generator draws the rows in order, as it did row by row)
                toks = sample_batch(logits, [params] * len(active), [gen] * len(active))
                still = []
                for i, tok in zip(active, toks):
                    outputs[i].append(tok)
                    c = chunks[i]
                    chunks[i] = Chunk(c.slot, c.start + len(c.tokens), [tok])
                    done = len(outputs[i]) >= max_tokens or (stop_at_eos and tok in self.cfg.eos_token_ids)
                    if not done:
                        still.append(i)
                active = still
            return outputs
        finally:
            for s in seqs:
                self.cache.release(s)
