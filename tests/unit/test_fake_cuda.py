"""The CUDA path, as far as a CPU proves it (tests/fake_cuda.py): every tensor on a fake `cuda`
device, so that an op mixing devices raises and every read of device data by the host counts.

A decode step on a GPU is fast only if the host never waits for the device inside it: the
in-process step (every family, prefill and decode chunks together) must read nothing; sampling
must run on the device's logits (it reads the chosen tokens, once)."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_family
from fake_cuda import HostReads, fake_cuda
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import Chunk, DenseModel, StepBatch
from moe_workers.model.family import SUPPORTED
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.sampling import History, SamplingParams, sample_batch
from moe_workers.serve.dispatch import ExpertDispatcher
from moe_workers.engine import Engine
from moe_workers.serve.routing import ExpertRouter


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny checkpoint a family (head_dim 16), written once for the module."""
    out = {}
    for family in SUPPORTED:
        path = tmp_path_factory.mktemp(family)
        make_family(path, family, hidden_size=64, num_layers=2)
        out[family] = path
    return out


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_in_process_step_never_waits_for_the_device(checkpoints, family):
    with fake_cuda():
        # gather attention: inductor's CUDA lowering of flex attention needs a driver
        model = InProcessModel(checkpoints[family], dtype="bfloat16", max_len=64, max_sequences=4, device="cuda",
                               attention="gather")
        seqs = [model.cache.allocate() for _ in range(3)]
        with HostReads() as reads:
            first = model.step([Chunk(seqs[0], 0, [1, 2, 3, 4, 5]), Chunk(seqs[1], 0, [3, 4])])
            # decode rows of two sequences beside a new prompt
            mixed = model.step([Chunk(seqs[0], 5, [7]), Chunk(seqs[1], 2, [8]), Chunk(seqs[2], 0, [1, 2, 3])])
        assert first.device.type == mixed.device.type == "cuda"
        assert tuple(mixed.shape) == (3, model.cfg.vocab_size)
        assert (reads.reads, reads.copies) == (0, 0), f"{family}: the step read the device {reads.reads} times"


class ShapesChannel:
    """The expert channel's answer in shape only (fake tensors carry no values)."""

    def exchange(self, layer, parts):
        return {group: torch.zeros_like(part.x) for group, part in parts.items()}


@pytest.mark.parametrize("family", SUPPORTED)
@pytest.mark.parametrize("lengths", [(1, 1), (1, 1, 20)], ids=["decode", "decode+prefill"])
def test_the_served_step_reads_the_device_once_a_moe_layer(checkpoints, family, lengths):
    """The Ingress' step (the engine's, with the expert exchange): the routing read once a MoE
    layer, what the exchange needs to address the groups; the prefetch hints ride in that read."""
    with fake_cuda():
        ckpt = Checkpoint(checkpoints[family])
        cfg = ckpt.config.with_dtype("bfloat16")
        dense = DenseModel(cfg, ckpt.dense_state(), "cuda")
        cache = PagedKVCache(cfg, 64, 16, cfg.dtype, "cuda", attention="gather")
        dispatcher = ExpertDispatcher(ShapesChannel(), dense.pick, cfg.sparse_layers, cfg.num_experts)
        placement = {"g0": [f"{l}.{e}" for l in cfg.sparse_layers for e in range(cfg.num_experts)]}
        dispatcher.configure(ExpertRouter(placement), prefetch_lookahead=1)
        engine = Engine(dense, cache, dispatcher, max_batch_size=4, max_queued=4)
        chunks = []
        for slot, n in enumerate(lengths):  # decode rows (routing planned in Python ints), or beside a prompt
            assert cache.allocate() == slot
            cache.reserve(slot, 8 + n, 8)
            chunks.append(Chunk(slot, 8, list(range(1, n + 1))))
        with HostReads() as reads, torch.inference_mode():
            logits = engine.runner.forward(StepBatch(chunks))
        assert tuple(logits.shape) == (len(lengths), cfg.vocab_size)
        assert reads.reads == len(cfg.sparse_layers), f"{family}: {reads.reads} reads, {len(cfg.sparse_layers)} MoE layers"


def test_the_experts_of_a_cuda_model_run_as_grouped_gemm(checkpoints):
    with fake_cuda():
        model = InProcessModel(checkpoints["qwen3_moe"], dtype="bfloat16", max_len=64, device="cuda",
                               attention="gather")
        layer = model.cfg.sparse_layers[0]
        x = torch.randn(3, model.cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        indices, _ = model.dense.pick(layer, x)
        assert model.experts.grouped(layer, x, indices)
        # one (E, ...) tensor a part; each expert's weights are views of it, not copies
        w1 = model.experts.stacked[layer]["w1"]
        assert w1.shape[0] == model.cfg.num_experts
        assert model.experts.weights[(layer, 1)]["w1"].untyped_storage()._cdata == w1.untyped_storage()._cdata


def test_sampling_runs_on_the_device_and_reads_only_the_tokens():
    vocab = 300
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=0.8, logit_bias=((3, 2.0),), frequency_penalty=0.5, presence_penalty=0.1,
                             repetition_penalty=1.2)]
    histories = [History(vocab, [1, 2, 3], [4, 4]) if p.penalized else None for p in params]
    generators = [torch.Generator().manual_seed(1) if i == 1 else None for i in range(len(params))]
    with fake_cuda():
        logits = torch.randn(len(params), vocab, device="cuda")
        allowed = [None] * len(params)
        allowed[2] = torch.ones(vocab, dtype=torch.bool)  # a grammar's mask comes from the host
        with HostReads() as reads:
            tokens = sample_batch(logits, params, generators, histories, barred=[()] * 5 + [(7,)], allowed=allowed)
    assert len(tokens) == len(params) and all(isinstance(t, int) for t in tokens)
    assert reads.reads >= 1  # the chosen tokens, read once at the end (and a few per sampling group)
