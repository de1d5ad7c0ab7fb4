"""Continuous batching engine with in-process experts (no Ray): same tokens as the reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

from checkpoints import make_family, make_mixtral
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.experts import LocalExperts
from moe_workers.model.family import SUPPORTED
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.sampling import SamplingParams
from moe_workers.engine import Engine, FinishReason, GenerationRequest, Overloaded
from moe_workers.serve.routing import ExpertRouter


def _engine(path, slots=4, max_batch=8, max_queued=16, blocks=None, block_size=16, **kw):
    """An engine running at most `slots` sequences at once (with room for each at the full
    context unless `blocks` says otherwise)."""
    ckpt = Checkpoint(path)
    dense = DenseModel(ckpt.config, ckpt.dense_state())
    experts = LocalExperts(ckpt, ckpt.config.dtype)

    def dispatch(layer, x, indices, weights):  # runs in the step's thread, as the expert channel does
        return experts.moe(layer, x, indices, weights)

    if blocks is None:
        blocks = slots * -(-ckpt.config.max_position_embeddings // block_size) + 1
    cache = PagedKVCache(ckpt.config, blocks, block_size, ckpt.config.dtype, prefix_caching=kw.pop("prefix_caching", True))
    return Engine(dense, cache, dispatch, min(slots, max_batch), max_queued, **kw)


async def _collect(req):
    out = []
    while (tok := await req.out.get()) is not None:
        out.append(tok)
    return out


def test_concurrent_requests_join_between_steps_and_match_reference(tmp_path):
    make_mixtral(tmp_path, num_local_experts=8, num_hidden_layers=3)
    reference = InProcessModel(tmp_path)
    prompts = [[3 + i, 10 + 2 * i, 7, 9 + i][: 2 + i % 3] * (1 + i % 4) for i in range(10)]
    expected = [reference.generate([p], max_tokens=6 + i % 3)[0] for i, p in enumerate(prompts)]

    async def main():
        engine = _engine(tmp_path, slots=3)  # fewer slots than requests: some wait, then join
        reqs = []
        for i, p in enumerate(prompts):
            reqs.append(engine.submit(GenerationRequest(prompt=p, max_tokens=6 + i % 3, stop_at_eos=False)))
            await asyncio.sleep(0.001 * (i % 3))
        results = await asyncio.gather(*(_collect(r) for r in reqs))
        return results, engine

    results, engine = asyncio.run(main())
    assert results == expected
    assert engine.cache.manager.num_used == 0 and not engine.cache.manager.seqs
    # batching happened: fewer steps than total tokens produced
    assert engine.timings.steps < sum(len(r) for r in results)
    # one forward pass a step (no micro-batches), in its thread: within the step's time on the loop
    t = engine.timings
    assert 0 < t.dense + t.experts <= t.forward <= t.step


def test_full_queue_refuses(tmp_path):
    make_mixtral(tmp_path)

    async def main():
        engine = _engine(tmp_path, slots=1, max_batch=1, max_queued=2)
        accepted = [engine.submit(GenerationRequest(prompt=[5, 6], max_tokens=3)) for _ in range(3)]
        with pytest.raises(Overloaded):
            engine.submit(GenerationRequest(prompt=[5, 6], max_tokens=3))
        await asyncio.gather(*(_collect(r) for r in accepted))
        # once drained, requests are accepted again
        again = engine.submit(GenerationRequest(prompt=[5, 6], max_tokens=2))
        return await _collect(again)

    assert len(asyncio.run(main())) == 2


def test_seeded_sampling_is_reproducible(tmp_path):
    make_mixtral(tmp_path)

    async def run_once():
        engine = _engine(tmp_path)
        r = engine.submit(GenerationRequest(prompt=[4, 5, 6], max_tokens=10, seed=7,
                                            sampling=SamplingParams(temperature=1.0, top_p=0.9),
                                            stop_at_eos=False))
        return await _collect(r)

    assert asyncio.run(run_once()) == asyncio.run(run_once())


def test_router_picks_least_loaded_copy():
    router = ExpertRouter({"ExpertShard-0": ["0.0", "0.1"], "ExpertShard-1": ["0.0", "0.2"]})
    assert router.missing(1, 3) == []
    assert router.missing(1, 4) == ["0.3"]
    # 0.1 must go to group 0, 0.2 to group 1; the replicated 0.0 goes where fewer tokens are
    plan = router.assign(0, {0: 5, 1: 10, 2: 1})
    assert plan == {"ExpertShard-0": [1], "ExpertShard-1": [0, 2]}
    router.begin("ExpertShard-1", 100)
    plan = router.assign(0, {0: 5})
    assert plan == {"ExpertShard-0": [0]}
    with pytest.raises(KeyError, match="no shard group hosts expert 0.3"):
        router.assign(0, {3: 1})


def test_router_alternates_copies_of_serial_dispatches():
    """Decode steps dispatch one after another: nothing is outstanding when the next decides, so
    the copies must share by tokens sent, not always the first one."""
    router = ExpertRouter({"ExpertShard-0": ["0.0"], "ExpertShard-1": ["0.0"], "ExpertShard-2": ["0.1"]})
    sent = {"ExpertShard-0": 0, "ExpertShard-1": 0}
    for _ in range(100):
        plan = router.assign(0, {0: 3})
        (group,) = plan
        router.begin(group, 3)
        router.end(group, 3)
        sent[group] += 3
    assert sent == {"ExpertShard-0": 150, "ExpertShard-1": 150}


def test_router_shares_copies_within_each_layer():
    """Two layers, each with a hot expert on two groups, dispatched one after another: every
    layer must use both of its copies (counted over all layers, layer 0 kept one copy and layer 1
    the other, and each layer waited for a group doing all of its hot expert's work)."""
    router = ExpertRouter({"ExpertShard-0": ["0.0", "1.0"], "ExpertShard-1": ["0.0", "1.0"]})
    per_layer = {(layer, g): 0 for layer in (0, 1) for g in ("ExpertShard-0", "ExpertShard-1")}
    for _ in range(50):
        for layer in (0, 1):
            (group,) = router.assign(layer, {0: 1})
            router.begin(group, 1)
            router.end(group, 1)
            per_layer[(layer, group)] += 1
    assert set(per_layer.values()) == {25}


def test_split_chunks_balances_tokens_and_keeps_order():
    from moe_workers.model.dense import Chunk
    from moe_workers.engine import split_chunks

    chunks = [Chunk(i, 0, [1] * n) for i, n in enumerate([1, 1, 1, 1, 100, 1, 1, 1])]
    parts = split_chunks(chunks, 2)
    assert [c for p in parts for c in p] == chunks and len(parts) == 2 and all(parts)
    assert split_chunks(chunks[:1], 4) == [chunks[:1]]
    assert len(split_chunks(chunks, 8)) == 8


def test_micro_batches_give_the_same_tokens(tmp_path):
    make_mixtral(tmp_path, num_local_experts=8, num_hidden_layers=3)
    reference = InProcessModel(tmp_path)
    prompts = [[3 + i, 9, 11 + i] for i in range(6)]
    expected = [reference.generate([p], max_tokens=5)[0] for p in prompts]

    async def main():
        engine = _engine(tmp_path, slots=6)
        engine.runner.micro_batches, engine.runner.micro_batch_min_tokens = 2, 1
        reqs = [engine.submit(GenerationRequest(prompt=p, max_tokens=5, stop_at_eos=False)) for p in prompts]
        return await asyncio.gather(*(_collect(r) for r in reqs))

    assert asyncio.run(main()) == expected


@pytest.mark.parametrize("family", SUPPORTED)
def test_decode_steps_split_in_two_micro_batches_match_transformers(tmp_path, family):
    """Ping-pong micro-batches on decode steps (`micro_batch_min_tokens` 1: every step of two or
    more sequences in two halves, one half's attention beside the other's experts): each
    sequence's greedy tokens are transformers' and their logprobs within fp32's tolerance."""
    ref = make_family(tmp_path, family)
    prompts = [[3 + i, 9, 11 + i, 40 - i][: 2 + i % 3] for i in range(5)]
    steps = 5
    expected, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            ids, toks, lps = list(p), [], []
            for _ in range(steps):
                row = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1].double(), -1)
                toks.append(int(row.argmax()))
                lps.append(float(row.max()))
                ids.append(toks[-1])
            expected.append(toks)
            logprobs.append(lps)

    async def main():
        engine = _engine(tmp_path, slots=5, micro_batches=2, micro_batch_min_tokens=1)
        forward = engine.runner._forward

        def counted(batch):
            forwards.append(batch)
            return forward(batch)

        engine.runner._forward = counted
        reqs = [engine.submit(GenerationRequest(prompt=p, max_tokens=steps, stop_at_eos=False, logprobs=0))
                for p in prompts]
        outs = await asyncio.gather(*(_collect(r) for r in reqs))
        return engine, reqs, outs

    forwards = []
    engine, reqs, outs = asyncio.run(main())
    assert outs == expected
    for req, lps in zip(reqs, logprobs):
        assert [lp for lp, _ in req.token_logprobs] == pytest.approx(lps, abs=1e-4)
    assert len(forwards) > engine.runner.timings.steps  # steps were split: two forwards for one step


def test_failed_step_fails_its_requests_and_frees_their_slots(tmp_path):
    make_mixtral(tmp_path)

    async def main():
        engine = _engine(tmp_path, slots=2)

        def broken(layer, x, indices, weights):
            raise RuntimeError("shard group unreachable")

        engine.runner.dispatch = broken
        reqs = [engine.submit(GenerationRequest(prompt=[5, 6], max_tokens=3)) for _ in range(3)]
        outs = await asyncio.gather(*(_collect(r) for r in reqs))
        return engine, reqs, outs

    engine, reqs, outs = asyncio.run(main())
    assert outs == [[], [], []]
    assert all(r.finish_reason == "error" and str(r.error) == "shard group unreachable" for r in reqs)
    assert all(isinstance(r.error, RuntimeError) for r in reqs)  # the HTTP layer picks 500 or 503 by type
    assert engine.cache.manager.num_used == 0 and engine.scheduler.running == [] and not engine.scheduler.waiting


def test_compute_rows_writes_each_experts_rows_in_place(tmp_path):
    """What a shard replica computes for one channel request: rows grouped by expert, outputs in
    the same order, written into the reply buffer."""
    from moe_workers.model.experts import compute_rows
    from moe_workers.model.layers import expert_mlp

    make_mixtral(tmp_path, num_local_experts=4, num_hidden_layers=2)
    ckpt = Checkpoint(tmp_path)
    experts = LocalExperts(ckpt, ckpt.config.dtype)
    keys, counts = [(1, 0), (1, 3)], [2, 3]
    x = torch.randn(5, ckpt.config.hidden_size)
    out = torch.full_like(x, float("nan"))
    compute_rows(experts.weights, keys, counts, x, out, ckpt.config)
    w0, w3 = experts.weights[(1, 0)], experts.weights[(1, 3)]
    assert torch.equal(out[:2], expert_mlp(x[:2], w0["w1"], w0["w2"], w0["w3"]))
    assert torch.equal(out[2:], expert_mlp(x[2:], w3["w1"], w3["w2"], w3["w3"]))


def test_observer_sees_each_sequences_latencies_and_logprobs_are_the_models(tmp_path):
    """First token once, inter-token for the rest, finished once with the reason; a stop ends a
    sequence with that reason; logprobs are the log-softmax of the model's logits."""
    from moe_workers.engine import Observer

    make_mixtral(tmp_path, num_local_experts=4, num_hidden_layers=2)
    reference = InProcessModel(tmp_path)

    class Seen(Observer):
        def __init__(self):
            self.first, self.inter, self.done = [], [], []

        def first_token(self, s):
            self.first.append(s)

        def inter_token(self, s):
            self.inter.append(s)

        def finished(self, req, s):
            self.done.append((req.finish_reason, len(req.produced), s))

    async def main():
        engine = _engine(tmp_path)
        engine.scheduler.observer = seen = Seen()
        a = engine.submit(GenerationRequest(prompt=[5, 9, 11], max_tokens=4, stop_at_eos=False, logprobs=2))
        b = engine.submit(GenerationRequest(prompt=[7, 8], max_tokens=50, stop_at_eos=False))
        out_a = await _collect(a)
        await b.out.get()
        engine.cancel(b, "stop")
        while await b.out.get() is not None:
            pass
        return seen, a, out_a, b

    seen, a, out_a, b = asyncio.run(main())
    assert len(seen.first) == 2 and all(s >= 0 for s in seen.first)
    assert len(seen.inter) == len(a.produced) + len(b.produced) - 2
    assert sorted(r for r, _, _ in seen.done) == ["length", "stop"] and b.finish_reason == "stop"
    # logprobs: the chosen token's and the two best, from the model's own distribution (greedy: the best)
    assert out_a == reference.generate([[5, 9, 11]], 4)[0]
    for tok, (lp, alts) in zip(a.produced, a.token_logprobs):
        assert len(alts) == 2 and alts[0][0] == tok and alts[0][1] == pytest.approx(lp) and lp <= 0


def test_ingress_metrics_queue_the_engines_reports_and_record_them_on_flush():
    """The engine's observer calls (on the step's path) only queue; flush() records each one, in
    order, with its tags (Ray's record costs 50-175 us a call)."""
    import types

    from moe_workers.serve.metrics import IngressMetrics

    m = IngressMetrics("app", "r1")
    seen = []

    def metric(name):
        return types.SimpleNamespace(observe=lambda v, tags: seen.append((name, v, tags)),
                                     inc=lambda v, tags: seen.append((name, v, tags)))

    m.enabled = True
    m.ttft, m.itl, m.e2e = metric("ttft"), metric("itl"), metric("e2e")
    m.prompt_tokens, m.generation_tokens = metric("prompt"), metric("generated")
    m.first_token(0.5)
    m.inter_token(0.02)
    m.finished(types.SimpleNamespace(finish_reason=FinishReason.ERROR, prompt=[1, 2, 3], produced=[4, 5]), 1.5)
    assert seen == []
    assert m.flush() == 5 and m.flush() == 0
    base = {"app": "app", "replica": "r1"}
    assert seen == [("ttft", 0.5, base), ("itl", 0.02, base), ("e2e", 1.5, {**base, "finish_reason": "error"}),
                    ("prompt", 3, base), ("generated", 2, base)]


def test_a_final_only_request_hands_over_its_end_not_each_token(tmp_path):
    """A whole completion without stop strings needs its tokens at the end: its queue gets the
    None only (the event loop is not woken for every token), its tokens are the model's."""
    make_mixtral(tmp_path, num_local_experts=4, num_hidden_layers=2)
    reference = InProcessModel(tmp_path)

    async def main():
        engine = _engine(tmp_path)
        whole = engine.submit(GenerationRequest(prompt=[5, 9, 11], max_tokens=6, stop_at_eos=False, final_only=True))
        streamed = engine.submit(GenerationRequest(prompt=[5, 9, 11], max_tokens=6, stop_at_eos=False))
        items = [await whole.out.get()]
        return items, await _collect(streamed), whole

    items, streamed, whole = asyncio.run(main())
    assert items == [None] and whole.out.empty() and whole.finish_reason == "length"
    assert whole.produced == streamed == reference.generate([[5, 9, 11]], 6)[0]


def test_routing_statistics_count_each_requests_expert_tokens_under_its_key(tmp_path):
    """The API key id a request came with reaches the routing statistics with its chunks: what
    the anomaly detector attributes a surge with."""
    from moe_workers.serve.routing_stats import RoutingStats
    make_mixtral(tmp_path, num_local_experts=4, num_hidden_layers=2)
    stats = RoutingStats(2, 4, 4)

    async def main():
        engine = _engine(tmp_path, routing_stats=stats)
        reqs = [engine.submit(GenerationRequest(prompt=[5, 6, 7], max_tokens=3, stop_at_eos=False, key="k1")),
                engine.submit(GenerationRequest(prompt=[8, 9], max_tokens=2, stop_at_eos=False))]
        await asyncio.gather(*(_collect(r) for r in reqs))

    asyncio.run(main())
    w = stats.take()
    top_k = 2  # make_mixtral's routing
    # k1: 3 prompt tokens and 2 fed back (the last produced is never fed); anonymous: 2 + 1
    assert {k: sum(map(sum, v.values())) for k, v in w["keys"].items()} == {"k1": 5 * top_k * 2, "-": 3 * top_k * 2}
    assert sum(map(sum, w["selected"].values())) == 8 * top_k * 2


def test_step_phases_add_up_within_the_forward_time(tmp_path):
    """The profile's phases (`StepTimings.profile`) are each measured and together no more than
    the forward passes plus sampling (what `moectl profile` draws)."""
    make_mixtral(tmp_path, num_local_experts=4, num_hidden_layers=2)

    async def main():
        engine = _engine(tmp_path, slots=2)
        reqs = [engine.submit(GenerationRequest(prompt=[3, 4, 5], max_tokens=4, stop_at_eos=False)) for _ in range(2)]
        await asyncio.gather(*(_collect(r) for r in reqs))
        return engine

    profile = asyncio.run(main()).stats()["profile"]
    phases = profile["phases"]
    assert list(phases) == ["embed", "attention", "router", "local", "exchange", "logits", "sampling"]
    assert profile["steps"] >= 4 and profile["tokens"] >= 8
    assert all(phases[p] > 0 for p in ("embed", "attention", "router", "exchange", "logits", "sampling"))
    assert sum(v for p, v in phases.items() if p != "sampling") <= profile["forward_s"]
    assert sum(phases.values()) <= profile["step_s"]


def test_ingress_metrics_observe_each_phases_mean_a_step_once_a_read():
    """`IngressMetrics.phases` (the metrics thread, once a second): one observation a phase, the
    mean a step since the last read; none while no step ran."""
    import types

    from moe_workers.serve.metrics import IngressMetrics

    m = IngressMetrics("app", "r1")
    seen = []
    m.enabled, m._profile = True, None
    m.step_phase = types.SimpleNamespace(observe=lambda v, tags: seen.append((tags["phase"], v)))
    m.phases({"steps": 10, "phases": {"attention": 0.02, "exchange": 0.05, "exchange.wait": 0.04}})
    assert seen == [("attention", 0.002), ("exchange", 0.005), ("exchange.wait", 0.004)]
    seen.clear()
    m.phases({"steps": 10, "phases": {"attention": 0.02, "exchange": 0.05, "exchange.wait": 0.04}})
    assert seen == []  # an idle second
    m.phases({"steps": 14, "phases": {"attention": 0.03, "exchange": 0.07, "exchange.wait": 0.05}})
    assert seen == [("attention", pytest.approx(0.0025)), ("exchange", pytest.approx(0.005)),
                    ("exchange.wait", pytest.approx(0.0025))]
