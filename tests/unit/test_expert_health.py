"""Per-expert health on a shard replica (`serve.expert_health`): a sampled call (an expert at a
time, each timed) gives the grouped call's outputs bit for bit, on a real tiny checkpoint in a
real store (C kernels where they apply); p95 over a ring; errors and hot misses per expert."""

from pathlib import Path

import pytest
import torch

from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.serve.expert_call import compute_call
from moe_workers.serve.expert_health import ExpertHealth, p95
from moe_workers.store.store import HOT, TierConfig, TieredExpertStore

LAYERS, EXPERTS = 2, 4
ALL = [(l, e) for l in range(LAYERS) for e in range(EXPERTS)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_random_mixtral(tmp_path_factory.mktemp("ckpt"), vocab_size=64, hidden_size=32,
                                intermediate_size=48, num_layers=LAYERS, num_experts=EXPERTS, num_heads=2,
                                num_kv_heads=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts", [[1, 2, 1, 3], [3, 20, 1, 40]])  # decode rows (C kernels in bf16); prefill rows
def test_a_sampled_call_computes_the_same_bits_as_the_grouped_call(model_dir, dtype, counts):
    store = TieredExpertStore(Checkpoint(model_dir), dtype, TierConfig())
    store.configure(ALL)
    keys = [(1, e) for e in range(EXPERTS)]
    x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    grouped, sampled = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    compute_call(store, store.model, keys, counts, (), (), x, grouped)
    timed = []
    compute_call(store, store.model, keys, counts, (), (), x, sampled, timer=lambda k, s: timed.append((k, s)))
    assert torch.equal(grouped, sampled)
    assert [k for k, _ in timed] == keys and all(s > 0 for _, s in timed)


def test_a_sampled_call_in_waves_times_every_expert(model_dir):
    """A call with more experts than the hot tier holds is computed a wave at a time; sampled,
    each of its experts is timed once, and the outputs are the grouped call's."""
    n = TieredExpertStore(Checkpoint(model_dir), torch.float32, TierConfig()).expert_bytes
    store = TieredExpertStore(Checkpoint(model_dir), torch.float32, TierConfig(hot_budget=2 * n, warm_budget=n))
    store.configure(ALL)
    reference = TieredExpertStore(Checkpoint(model_dir), torch.float32, TierConfig())
    reference.configure(ALL)
    keys, counts = [(0, e) for e in range(EXPERTS)], [3, 1, 2, 2]
    x = torch.randn(sum(counts), 32)
    want, got = torch.empty_like(x), torch.empty_like(x)
    compute_call(reference, reference.model, keys, counts, (), (), x, want)
    timed = {}
    compute_call(store, store.model, keys, counts, (), (), x, got, timer=timed.__setitem__)
    assert torch.equal(want, got) and sorted(timed) == keys


def test_misses_are_counted_per_expert_and_calls_that_waited_for_promotions(model_dir):
    n = TieredExpertStore(Checkpoint(model_dir), torch.float32, TierConfig()).expert_bytes
    store = TieredExpertStore(Checkpoint(model_dir), torch.float32, TierConfig(hot_budget=2 * n, warm_budget=8 * n))
    store.configure(ALL)
    cold_keys = [k for k in ALL if store.entries[k].tier != HOT][:2]
    for key in cold_keys + cold_keys[:1]:  # the second use of the first may hit (it is hot now)
        with store.use([key]):
            pass
    by_key = store.misses_by_key()
    assert set(by_key) <= set(cold_keys) and by_key[cold_keys[1]] == 1
    assert sum(by_key.values()) == store.stats.misses[HOT]
    stats = store.stats.as_dict()
    assert stats["promotion_waits"] >= 2 and stats["promotion_wait_s"] > 0


def test_p95_is_the_nearest_rank_over_the_last_samples():
    assert p95([]) is None and p95([0.5]) == 0.5
    assert p95(range(1, 101)) == 95 and p95(range(1, 21)) == 19
    health = ExpertHealth(sample_every=4, kept=8)
    assert [health.sample_next() for _ in range(8)] == [False, False, False, True] * 2
    for i in range(20):  # only the last 8 are kept: 12..19 ms
        health.record((0, 1), (i + 1) / 1000)
    health.failed([(0, 1), (0, 2)])
    report = health.report([(0, 1), (0, 2)], {(0, 2): 3})
    assert report == {"0.1": {"p95_ms": 20.0, "samples": 8, "misses": 0, "errors": 1},
                      "0.2": {"p95_ms": None, "samples": 0, "misses": 3, "errors": 1}}
    assert health.fresh_p95_seconds() == {(0, 1): 0.02} and health.fresh_p95_seconds() == {}
