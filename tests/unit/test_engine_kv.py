"""The engine over its paged KV cache, against transformers (no Ray): prefix hits, chunked
prefill, preemption with recompute and a prefix cache reset give the tokens a cold, whole run
gives, for every family (transformers writes the checkpoints: its own config.json and layout)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from checkpoints import make_family, reference_greedy
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel
from moe_workers.model.experts import LocalExperts
from moe_workers.model.family import SUPPORTED
from moe_workers.model.kv_blocks import sequence_blocks
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.sampling import SamplingParams
from moe_workers.engine import Engine, FinishReason, GenerationRequest


def _engine(path, blocks=None, block_size=4, max_batch=8, budget=512, prefix_caching=True, prefill_only_factor=1):
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    dense = DenseModel(cfg, ckpt.dense_state())
    experts = LocalExperts(ckpt, cfg.dtype)
    if blocks is None:
        blocks = max_batch * sequence_blocks(cfg, block_size, cfg.max_position_embeddings) + 1
    cache = PagedKVCache(cfg, blocks, block_size, cfg.dtype, prefix_caching=prefix_caching)
    return Engine(dense, cache, lambda layer, x, i, w: experts.moe(layer, x, i, w), max_batch, 64,
                  max_num_batched_tokens=budget, prefill_only_factor=prefill_only_factor)


async def _run(engine, prompts, max_tokens, gap=0.0, **kw):
    def submit(p):
        return engine.submit(GenerationRequest(prompt=list(p), max_tokens=max_tokens, stop_at_eos=False, **kw))

    if gap:
        reqs = []
        for p in prompts:
            reqs.append(submit(p))
            await asyncio.sleep(gap)
    else:
        with engine.scheduler.lock:  # the engine thread finds them all queued at its next step
            reqs = [submit(p) for p in prompts]

    async def collect(r):
        while await r.out.get() is not None:
            pass
        assert r.error is None, r.error
        return r.produced

    return await asyncio.gather(*(collect(r) for r in reqs)), reqs


def _prompt(n, seed):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_path_of_the_paged_engine_gives_transformers_tokens(tmp_path, family):
    ref = make_family(tmp_path, family)  # gpt_oss: a sliding window of 32 in every other layer
    prefix = _prompt(41, 1)
    prompts = [prefix + _prompt(3 + i, 10 + i) for i in range(4)]
    want = [reference_greedy(ref, p, 8) for p in prompts]

    async def main():
        # a step budget of 16 tokens: each 44-token prompt takes 3 steps; the first request
        # computes the prefix, the others (sent after it) start after its 40 cached tokens
        engine = _engine(tmp_path, budget=16)
        first, _ = await _run(engine, prompts[:1], 8)
        rest, reqs = await _run(engine, prompts[1:], 8)
        assert engine.scheduler.kv.chunked_prefills >= 1
        assert [r.cached_tokens for r in reqs] == [40, 40, 40]
        assert engine.scheduler.kv.prefix_hit_tokens == 120 and engine.cache.manager.num_used == 0
        # blocks for one and a half of the four at once, each admitted with blocks for its first
        # chunk only: as they grow, the newest are preempted and recomputed
        tight = _engine(tmp_path, blocks=sequence_blocks(engine.cfg, 4, 52) * 3 // 2 + 1, budget=16,
                        prefix_caching=False)
        again, _ = await _run(tight, prompts, 8)
        assert tight.scheduler.kv.preemptions >= 1 and tight.cache.manager.num_used == 0
        return first + rest, again

    cached, preempted = asyncio.run(main())
    assert cached == want
    assert preempted == want


def test_seeded_sampling_is_the_same_with_the_prefix_cached_or_not(tmp_path):
    make_family(tmp_path, "qwen3_moe")
    prompt = _prompt(40, 3)

    async def main(prefix_caching):
        engine = _engine(tmp_path, prefix_caching=prefix_caching)
        warm, _ = await _run(engine, [prompt], 10, sampling=SamplingParams(temperature=1.0), seed=5)
        second, reqs = await _run(engine, [prompt], 10, sampling=SamplingParams(temperature=1.0), seed=5)
        return warm[0], second[0], reqs[0].cached_tokens

    cold_first, cold_second, cold_hit = asyncio.run(main(False))
    warm_first, warm_second, warm_hit = asyncio.run(main(True))
    assert cold_hit == 0 and warm_hit == 36
    assert cold_first == cold_second == warm_first == warm_second


def test_penalties_bias_min_tokens_and_stop_ids_match_transformers_generate_in_a_mixed_batch(tmp_path):
    ref = make_family(tmp_path, "qwen3_moe")
    eos = ref.config.eos_token_id
    prompt = _prompt(12, 4) + [7, 7, 9]
    shaped = SamplingParams(repetition_penalty=1.8, min_tokens=5, logit_bias=((eos, 9.0), (11, 1.5)))
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                            min_new_tokens=5, sequence_bias=[[[eos], 9.0], [[11], 1.5]], eos_token_id=eos,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert len(want) >= 6 and want[-1] == eos and eos not in want[:5]  # barred, then biased into coming
    plain = [_prompt(9, 5), _prompt(14, 6)]

    async def main():
        engine = _engine(tmp_path)
        with engine.scheduler.lock:  # one batch: the shaped row beside plain greedy ones
            reqs = [engine.submit(GenerationRequest(prompt=prompt, max_tokens=12, sampling=shaped))]
            reqs += [engine.submit(GenerationRequest(prompt=p, max_tokens=8, stop_at_eos=False)) for p in plain]
        for r in reqs:
            while await r.out.get() is not None:
                pass
        # a stop token id ends the sequence like the end of sequence, and is barred the same way
        stop = engine.submit(GenerationRequest(prompt=plain[0], max_tokens=8, stop_at_eos=False,
                                               stop_token_ids=frozenset({reqs[1].produced[2]})))
        while await stop.out.get() is not None:
            pass
        held = engine.submit(GenerationRequest(prompt=plain[0], max_tokens=8, stop_at_eos=False,
                                               stop_token_ids=frozenset({reqs[1].produced[0]}),
                                               sampling=SamplingParams(min_tokens=8)))
        while await held.out.get() is not None:
            pass
        return reqs, stop, held

    reqs, stop, held = asyncio.run(main())
    assert reqs[0].produced == want and reqs[0].finish_reason is FinishReason.STOP
    assert [r.produced for r in reqs[1:]] == [reference_greedy(ref, p, 8) for p in plain]
    cut = reqs[1].produced.index(reqs[1].produced[2]) + 1
    assert stop.produced == reqs[1].produced[:cut] and stop.finish_reason is FinishReason.STOP
    assert len(held.produced) == 8 and reqs[1].produced[0] not in held.produced


def test_a_prefix_cache_reset_computes_everything_again(tmp_path):
    """What a committed hot-swap does: blocks computed by the old weights are not reused."""
    make_family(tmp_path, "mixtral")
    prompt = _prompt(30, 4)

    async def main():
        engine = _engine(tmp_path)
        await _run(engine, [prompt], 4)
        engine.reset_prefix_cache()
        _, reqs = await _run(engine, [prompt], 4)
        hit_after_reset = reqs[0].cached_tokens
        _, reqs = await _run(engine, [prompt], 4)
        return hit_after_reset, reqs[0].cached_tokens

    assert asyncio.run(main()) == (0, 28)


def test_decode_tokens_run_beside_a_long_prompt_prefilled_in_chunks(tmp_path):
    """A running stream gets a token every step while a long prompt arrives (the budget splits
    the prompt), and each step computes at most the budget beyond its decode tokens."""
    make_family(tmp_path, "mixtral", max_position_embeddings=256)

    async def main():
        engine = _engine(tmp_path, budget=24)
        stream = engine.submit(GenerationRequest(prompt=_prompt(5, 1), max_tokens=30, stop_at_eos=False))
        while not stream.produced:
            await asyncio.sleep(0.001)
        steps_before = engine.timings.steps
        long = engine.submit(GenerationRequest(prompt=_prompt(200, 2), max_tokens=2, stop_at_eos=False))
        while await long.out.get() is not None:
            pass
        produced_meanwhile = len(stream.produced)
        while await stream.out.get() is not None:
            pass
        return engine, engine.timings.steps - steps_before, produced_meanwhile

    engine, steps, produced = asyncio.run(main())
    assert engine.scheduler.kv.chunked_prefills == 1
    assert steps >= 200 // 23  # the prompt took about 9 steps ...
    assert produced >= 200 // 23  # ... and the stream had a token in each of them
    assert engine.timings.computed_tokens <= engine.timings.steps * 24 + 30


def test_a_step_with_nothing_decoding_takes_more_prefill(tmp_path):
    """Prompts arriving together with no stream running are prefilled in larger steps (nothing
    waits on them); once a stream decodes, the budget holds."""
    make_family(tmp_path, "mixtral")
    prompts = [_prompt(40, 20 + i) for i in range(4)]

    async def main(factor):
        engine = _engine(tmp_path, budget=16, prefill_only_factor=factor)
        await _run(engine, prompts, 1)
        return engine.timings.steps, engine.scheduler.kv.chunked_prefills

    assert asyncio.run(main(16)) == (1, 0)  # 160 tokens in one step of up to 256
    steps, chunked = asyncio.run(main(1))
    assert steps == 10 and chunked == 4


def test_the_longest_sequence_a_request_may_ask_for_is_what_the_cache_holds(tmp_path):
    make_family(tmp_path / "full", "mixtral", max_position_embeddings=128)
    make_family(tmp_path / "window", "gpt_oss", max_position_embeddings=128, num_layers=4)  # 2 full, 2 window (32)
    assert _engine(tmp_path / "full", blocks=128 // 4 + 1).max_sequence_tokens() == 128
    assert _engine(tmp_path / "full", blocks=20 + 1).max_sequence_tokens() == 80  # 20 blocks of 4 tokens
    # a windowed group keeps its window's blocks (9 of 4 tokens), the full group the rest
    assert _engine(tmp_path / "window", blocks=9 + 20 + 1).max_sequence_tokens() == 80


def test_a_request_cancelled_while_it_is_admitted_ends_and_the_next_one_runs(tmp_path):
    """cancel() runs on the event loop while the engine thread admits: the request it removes
    from the queue must not take the next one's place (that one would never run)."""
    make_family(tmp_path, "mixtral")

    async def main():
        engine = _engine(tmp_path)
        first = GenerationRequest(prompt=_prompt(20, 1), max_tokens=2, stop_at_eos=False)
        second = GenerationRequest(prompt=_prompt(20, 2), max_tokens=2, stop_at_eos=False)
        admit = engine.cache.manager.admit

        def admit_while_cancelled(seq, tokens, chunk):
            if tokens[:20] == first.prompt:  # the client of `first` goes away just now
                engine.cancel(first)
            return admit(seq, tokens, chunk)

        engine.cache.manager.admit = admit_while_cancelled
        for r in (first, second):
            engine.submit(r)
        results = await asyncio.wait_for(asyncio.gather(*(_collect(r) for r in (first, second))), 60)
        return first, second, results, engine

    first, second, results, engine = asyncio.run(main())
    assert first.finish_reason == "cancelled" and results[0] == []
    assert second.finish_reason == "length" and len(results[1]) == 2
    assert engine.cache.manager.num_used == 0 and not engine.cache.manager.seqs


async def _collect(req):
    while await req.out.get() is not None:
        pass
    return req.produced


def test_the_engine_reports_its_queue_and_cache_in_stats(tmp_path):
    """What the Ingress' status and metrics read: the engine's own figures, not its internals."""
    make_family(tmp_path, "mixtral")
    prompt = _prompt(30, 5)

    async def main():
        engine = _engine(tmp_path)
        before = engine.stats()
        await _run(engine, [prompt], 4)
        await _run(engine, [prompt], 4)  # the second finds 28 of its tokens cached
        return engine, before, engine.stats()

    engine, before, after = asyncio.run(main())
    assert (before["steps"], before["kv"]["prefix_queried_tokens"]) == (0, 0)
    kv = after["kv"]
    assert after["running"] == after["waiting"] == 0 and after["steps"] >= 8
    assert (kv["prefix_queried_tokens"], kv["prefix_hit_tokens"]) == (60, 28)
    assert kv["blocks_used"] == 0 and kv["blocks_total"] == engine.cache.manager.pool.usable
    assert kv["attention"] == {"configured": "gather", "running": "gather", "fallbacks": 0, "error": ""}
    assert engine.kv_usage() == 0.0
