"""TieredExpertStore on CPU with a real (tiny) safetensors checkpoint: budgets, moves, swaps."""

import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.store.policy import POLICIES
from moe_workers.store.store import (COLD, HOT, PREFETCH_EVICT_ACCURACY, SOURCE, WARM, StoreFull, TierConfig,
                                     TierConfigError, TieredExpertStore)
from moe_workers.store.versions import SwapError, content_digest, file_sha256, load_expert_file

LAYERS, EXPERTS = 2, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_random_mixtral(tmp_path_factory.mktemp("ckpt"), vocab_size=64, hidden_size=16,
                                intermediate_size=24, num_layers=LAYERS, num_experts=EXPERTS, num_heads=2,
                                num_kv_heads=1)


ALL = [(l, e) for l in range(LAYERS) for e in range(EXPERTS)]


def make_store(model_dir, tmp_path=None, **cfg) -> TieredExpertStore:
    ckpt = Checkpoint(model_dir)
    if tmp_path is not None and "cold_dir" not in cfg:
        cfg["cold_dir"] = str(tmp_path / "cold")
    store = TieredExpertStore(ckpt, torch.float32, TierConfig(**cfg))
    return store


def expert_bytes(store):
    return store.expert_bytes


def assert_within_budgets(store):
    for tier in (HOT, WARM):
        budget = store.ledger.budgets[tier]
        if budget is not None:
            assert store.ledger.used[tier] + store.ledger.reserved[tier] <= budget, tier
    # accounting matches the entries
    for tier in (HOT, WARM):
        held = sum(e.tier == tier or tier == WARM and e.kept is not None for e in store.entries.values())
        assert store.ledger.used[tier] == held * store.forms.nbytes(tier)
    if store.cold is not None and store.cold.budget is not None:
        assert store.cold.used() <= store.cold.budget
        on_disk = sum(p.stat().st_size for p in store.cold.dir.glob("*.safetensors"))
        assert on_disk <= store.cold.budget + 4096 * len(store.cold.files)  # file headers


def test_configure_fills_hot_then_warm_then_cold(model_dir, tmp_path):
    s = make_store(model_dir)
    n = s.expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=4 * n, warm_budget=2 * n)
    s.configure(ALL)
    res = s.residency()
    assert res[HOT] == {"experts": 4, "bytes": 4 * n, "form": "compute", "expert_bytes": n, "vs_compute": 1.0}  # no decoder
    assert res[WARM] == {"experts": 2, "bytes": 2 * n, "form": "compute", "expert_bytes": n, "vs_compute": 1.0}
    assert res[COLD]["experts"] == len(ALL)  # every expert has its cold file
    tiers = [v["tier"] for v in s.experts().values()]
    assert tiers.count(COLD) == len(ALL) - 6
    assert_within_budgets(s)


def test_weights_are_the_checkpoints_from_every_tier(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=EXPERTS * n, warm_budget=n)
    s.configure(ALL)
    ref = Checkpoint(model_dir)
    for layer in range(LAYERS):  # layer 1 starts cold or warm: promoted on demand
        keys = [(layer, e) for e in range(EXPERTS)]
        with s.use(keys) as w:
            for k in keys:
                for name, t in ref.expert(*k).items():
                    assert torch.equal(w[k][name], t), (k, name)
    assert s.stats.misses[HOT] > 0 and s.stats.hits[COLD] > 0
    assert_within_budgets(s)


def test_a_hot_budget_below_one_tokens_experts_is_refused_and_a_larger_call_computes_in_waves(model_dir, tmp_path):
    """The hot tier must hold a token's top-k experts at once; a call needing more (4 experts of
    a layer, 2 hot slots) is computed two at a time, what is hot first, with the same outputs
    as all at once, the policy told of it once, budgets held throughout."""
    from moe_workers.model.experts import compute_rows
    from moe_workers.serve.expert_call import compute_call

    s = make_store(model_dir)
    n = s.expert_bytes
    assert s.model.top_k == 2
    with pytest.raises(TierConfigError, match=r"hot_budget.*one token's experts: layer 0 needs 2 experts.*top-2"):
        s.configure(ALL, TierConfig(hot_budget=n, warm_budget=0))
    s = make_store(model_dir, tmp_path, hot_budget=2 * n, warm_budget=n)
    s.configure(ALL)
    keys, counts = [(0, e) for e in range(EXPERTS)], [3, 1, 2, 2]
    x = torch.randn(sum(counts), 16)
    reference = make_store(model_dir)
    reference.configure(ALL)
    want = torch.empty_like(x)
    with reference.use(keys) as w:
        compute_rows(w, keys, counts, x, want, s.model)
    hot = [k for k in keys if s.entries[k].tier == HOT]
    assert s.call_waves(keys)[0] == [keys.index(k) for k in hot] and len(s.call_waves(keys)) == 2
    clock = s.policy.clock
    for _ in range(3):
        out = torch.full_like(x, float("nan"))
        compute_call(s, s.model, keys, counts, [(0, 2)], [], x, out)
        assert torch.equal(out, want)
        assert_within_budgets(s)
    assert s.policy.clock == clock + 3 * len(keys)  # told once per call, not per wave
    assert s.stats.as_dict()["waved_calls"] >= 3 and s.stats.as_dict()["ranked_calls"] == 3
    out = torch.empty_like(x[:3])
    compute_call(s, s.model, keys[:1], counts[:1], (), [], x[:3], out)  # fits: one wave, as before
    assert torch.equal(out, want[:3])


def test_unknown_tier_fields_and_policy_refused():
    with pytest.raises(TierConfigError, match="unknown field.*hot_bugdet"):
        TierConfig.from_dict({"hot_bugdet": 1})
    with pytest.raises(ValueError, match="unknown tier policy"):
        TierConfig.from_dict({"policy": "FIFO"})
    with pytest.raises(TierConfigError, match="warm_budget"):
        TierConfig.from_dict({"warm_budget": -1})


def test_pinned_experts_are_never_evicted(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=EXPERTS * n, warm_budget=0)
    s.configure(ALL)
    inside, release = threading.Event(), threading.Event()
    held = [(0, 0), (0, 1)]

    def batch():
        with s.use(held):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=batch)
    t.start()
    assert inside.wait(10)
    with s.use([(1, e) for e in range(2, 4)]):  # needs room: must evict others, not the pinned
        pass
    with s.use([(1, 0), (1, 1)]):
        pass
    assert all(s.entries[k].tier == HOT for k in held)
    release.set()
    t.join()
    assert_within_budgets(s)


def test_a_batch_counts_its_hits_and_unpins_however_it_ends(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=EXPERTS * n, warm_budget=0)  # one layer's experts
    s.configure(ALL)
    hot = [k for k, e in s.entries.items() if e.tier == HOT]
    assert len(hot) == EXPERTS
    before = s.stats.hits[HOT]
    with pytest.raises(RuntimeError, match="in the batch"):
        with s.use(hot) as w:
            assert set(w) == set(hot) and all(s.entries[k].pins == 1 for k in hot)
            raise RuntimeError("in the batch")
    assert s.stats.hits[HOT] == before + EXPERTS  # an all-hot batch: a hit per expert
    assert all(e.pins == 0 for e in s.entries.values())
    # a batch that cannot load (its room is pinned by another batch) raises and gives everything back
    s.wait_timeout_s = 0.3
    inside, release = threading.Event(), threading.Event()

    def holder():
        with s.use(hot):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(10)
    cold = next(k for k in ALL if k not in hot)
    with pytest.raises(StoreFull):
        with s.use([cold]):
            pass
    assert s.entries[cold].pins == 0 and s.entries[cold].tier != HOT
    release.set()
    t.join(10)
    assert all(e.pins == 0 for e in s.entries.values())
    with s.use([cold]) as w:  # the admission was released: the next batch loads
        assert torch.equal(w[cold]["w1"], Checkpoint(model_dir).expert(*cold)["w1"])
    assert_within_budgets(s)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hot=st.integers(2, 8), warm=st.integers(0, 6), cold=st.one_of(st.none(), st.integers(0, 8)),
    policy=st.sampled_from(list(POLICIES)),
    ops=st.lists(st.tuples(st.sampled_from(["use", "prefetch", "idle"]), st.integers(0, LAYERS - 1),
                           st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=EXPERTS, unique=True)),
                 max_size=30),
)
def test_budgets_never_exceeded_under_random_access(model_dir, tmp_path_factory, hot, warm, cold, policy, ops):
    """Randomised access sequences: budgets hold after every step and weights stay correct."""
    probe = make_store(model_dir)
    n = probe.expert_bytes
    hot = max(hot, 2)
    s = make_store(model_dir, tmp_path_factory.mktemp("cold"), hot_budget=hot * n, warm_budget=warm * n,
                   cold_budget=None if cold is None else cold * (n + 4096), policy=policy, idle_demotion_s=1)
    hosted = [(l, e) for l in range(LAYERS) for e in range(EXPERTS) if e < min(hot, EXPERTS)]
    s.configure(hosted)
    ref = Checkpoint(model_dir)
    clock = time.monotonic()
    for op, layer, experts in ops:
        keys = [(layer, e) for e in experts if (layer, e) in s.entries]
        if op == "use" and keys:
            with s.use(keys) as w:
                assert_within_budgets(s)
                for k in keys:
                    assert torch.equal(w[k]["w2"], ref.expert(*k)["w2"])
        elif op == "prefetch":
            s.prefetch(keys)
            s.drain_prefetch()
        else:
            clock += 2
            s.demote_idle(clock)
        assert_within_budgets(s)
    s.close()


def test_the_store_tells_its_policy_which_experts_a_call_chose_first(model_dir, tmp_path):
    """The default policy is RankAware: a call's first choices (the channel's RANKED request)
    reach it, it learns how often they come again, and with the tokens' first choice kept from
    call to call it keeps the last one over an expert used more often before (RecencyFrequency,
    told the same calls, does the opposite)."""
    n = make_store(model_dir).expert_bytes
    kept = {}
    for policy in ("RankAware", "RecencyFrequency"):
        s = make_store(model_dir, tmp_path / policy, hot_budget=4 * n, warm_budget=0, policy=policy)
        s.configure(ALL)
        for i in range(240):
            first = (i // 20) % 3  # kept for runs of 20 calls; the second choice alternates
            with s.use([(0, first), (0, (first + 1 + i % 2) % 3)], [(0, first)]):
                pass
        with s.use([(0, 3), (0, 1)], [(0, 3)]):
            pass
        assert [e.tier for k, e in sorted(s.entries.items()) if k[0] == 0] == [HOT] * 4
        with s.use([(1, 0)]):  # one of layer 0's experts must leave hot
            pass
        kept[policy] = s.entries[(0, 3)].tier == HOT
        assert s.stats.as_dict()["ranked_calls"] == 241
        assert_within_budgets(s)
    assert make_store(model_dir).config.policy == "RankAware"
    assert kept == {"RankAware": True, "RecencyFrequency": False}
    assert s.policy_report() == {"name": "RecencyFrequency", "stay": None}


def test_prefetch_promotes_and_is_counted(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=EXPERTS * n, warm_budget=EXPERTS * n)
    s.configure(ALL)
    assert all(s.entries[(1, e)].tier == WARM for e in range(EXPERTS))
    s.prefetch([(1, 0), (1, 1)])
    s.drain_prefetch()
    assert s.entries[(1, 0)].tier == HOT and s.entries[(1, 1)].tier == HOT
    with s.use([(1, 0)]):
        pass
    st_ = s.stats.as_dict()
    assert st_["prefetch_issued"] == 2 and st_["prefetch_used"] == 1 and st_["prefetch_accuracy"] == 0.5
    s.close()


def test_warm_to_hot_exchanges_places_when_every_expert_fits_in_ram(model_dir, tmp_path):
    """Hot and warm together hold every expert: a layer's call moves its experts up and the hot
    ones down into the room they leave, and no expert is pushed to disk on the way."""
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=EXPERTS * n, warm_budget=(LAYERS - 1) * EXPERTS * n)
    s.configure(ALL)
    for step in range(3):
        for layer in range(LAYERS):
            with s.use([(layer, e) for e in range(EXPERTS)]):
                assert all(s.entries[(layer, e)].tier == HOT for e in range(EXPERTS))
            assert all(s.entries[k].tier in (HOT, WARM) for k in ALL), (step, layer)
            assert_within_budgets(s)
    assert s.stats.misses[WARM] == 0 and s.stats.hits[WARM] > 0  # every miss of hot found in RAM
    s.close()


def test_prefetch_evicts_only_while_hints_mostly_come_true(model_dir, tmp_path):
    """Hints that keep missing stop evicting resident experts (a wrong hint would cost a read
    and the evicted expert's next use); they still fill free room, and evict again once they
    come true."""
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=EXPERTS * n, warm_budget=0)
    s.configure(ALL)  # layer 0 hot; layer 1 cold: a hot tier with no free room
    for _ in range(8):  # hints for layer 1 that its calls never use
        s.prefetch([(1, 0)])
        s.drain_prefetch()
        with s.use([(1, 1)]):
            pass
    assert s.hints.accuracy < PREFETCH_EVICT_ACCURACY
    before = s.stats.prefetch_skipped
    victim_layer_tiers = [s.entries[k].tier for k in ALL]
    s.prefetch([(1, 2)])
    s.drain_prefetch()
    assert s.entries[(1, 2)].tier == COLD and s.stats.prefetch_skipped == before + 1
    assert [s.entries[k].tier for k in ALL] == victim_layer_tiers  # nothing evicted for it
    assert s.stats.as_dict()["hint_accuracy"] == s.hints.accuracy
    for _ in range(50):  # hints that come true (about 44 bring an EWMA over 64 from 0 to 0.5)
        s.prefetch([(1, 3)])
        s.drain_prefetch()
        with s.use([(1, 3)]):
            pass
    assert s.hints.accuracy >= PREFETCH_EVICT_ACCURACY
    s.prefetch([(1, 2)])
    s.drain_prefetch()
    assert s.entries[(1, 2)].tier == HOT  # evicted another expert for it
    assert_within_budgets(s)
    s.close()


def test_idle_demotion_moves_down_one_tier_at_a_time(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=len(ALL) * n, warm_budget=len(ALL) * n, idle_demotion_s=10)
    s.configure(ALL)
    assert s.demote_idle() == 0
    time.sleep(0.3)
    with s.use([(0, 0)]):
        pass
    used_at = time.monotonic()
    assert s.demote_idle(used_at + 9.9) == len(ALL) - 1  # (0,0) was used 0.3 s after the others
    assert s.entries[(0, 1)].tier == WARM and s.entries[(0, 0)].tier == HOT
    s.demote_idle(used_at + 30)
    assert s.entries[(0, 1)].tier == COLD
    assert_within_budgets(s)


def test_without_cold_dir_experts_come_from_the_source(model_dir):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, hot_budget=EXPERTS * n, warm_budget=0)
    s.configure(ALL)
    assert s.experts()["1.3"]["tier"] == SOURCE
    with s.use([(1, 3)]):
        pass
    assert s.experts()["1.3"]["tier"] == HOT
    assert s.stats.misses[COLD] == 1


# -- hot-swap --------------------------------------------------------------------------------


def write_expert(path: Path, like: dict[str, torch.Tensor], scale: float = 2.0, short_names=True, **override):
    tensors = {(f"{w}.weight" if short_names else f"model.layers.0.block_sparse_moe.experts.1.{w}.weight"):
               (t * scale).contiguous() for w, t in like.items()}
    tensors.update(override)
    save_file(tensors, str(path))
    return path


def test_swap_then_rollback(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=len(ALL) * n, warm_budget=0)
    s.configure(ALL)
    ref = Checkpoint(model_dir).expert(0, 1)
    old = s.experts()["0.1"]["digest"]
    f = write_expert(tmp_path / "new.safetensors", ref, short_names=False)
    cfg = s.model
    v = s.swap((0, 1), lambda: load_expert_file(f, 0, 1, cfg, [str(tmp_path)], file_sha256(f)), str(f))
    assert v.digest != old and s.experts()["0.1"] == {"digest": v.digest, "source": str(f), "tier": HOT}
    with s.use([(0, 1)]) as w:
        assert torch.equal(w[(0, 1)]["w1"], ref["w1"] * 2)
    # rollback: the checkpoint's own version, same digest as before the swap
    v2 = s.swap((0, 1), lambda: Checkpoint(model_dir).expert(0, 1), "checkpoint")
    assert v2.digest == old
    with s.use([(0, 1)]) as w:
        assert torch.equal(w[(0, 1)]["w1"], ref["w1"])
    assert_within_budgets(s)


def bad_files(tmp_path: Path, ref):
    other = tmp_path.parent / f"{tmp_path.name}-outside"
    other.mkdir()
    good = write_expert(tmp_path / "good.safetensors", ref)
    cases = {
        "missing file": (tmp_path / "nope.safetensors", None, "no such file"),
        "wrong shape": (write_expert(tmp_path / "shape.safetensors", ref, **{"w2.weight": torch.zeros(3, 3)}), None,
                        "w2 has shape"),
        "bad checksum": (good, "0" * 64, "sha256 is"),
        "pickle": (tmp_path / "x.pt", None, "not a .safetensors file"),
        "not safetensors": (tmp_path / "junk.safetensors", None, "not a valid safetensors file"),
        "outside roots": (write_expert(other / "o.safetensors", ref), None, "outside the allowed weight roots"),
        "non-finite": (write_expert(tmp_path / "nan.safetensors", ref, scale=float("nan")), None, "non-finite"),
        "wrong dtype": (write_expert(tmp_path / "half.safetensors", {k: v.half() for k, v in ref.items()}), None,
                        "float16, the model's dtype is float32"),
        "extra tensor": (write_expert(tmp_path / "extra.safetensors", ref, **{"bias": torch.zeros(2)}), None,
                         "unexpected tensor"),
        "missing tensor": (tmp_path / "w1only.safetensors", None, "missing tensor"),
    }
    torch.save(ref, tmp_path / "x.pt")
    (tmp_path / "junk.safetensors").write_bytes(b"definitely not safetensors")
    save_file({"w1.weight": ref["w1"]}, str(tmp_path / "w1only.safetensors"))
    return cases


def test_every_bad_swap_leaves_the_old_version_serving(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=len(ALL) * n, warm_budget=0)
    s.configure(ALL)
    ref = Checkpoint(model_dir).expert(0, 1)
    before = s.experts()["0.1"]
    for label, (path, sha, message) in bad_files(tmp_path, ref).items():
        with pytest.raises(SwapError, match=message):
            s.swap((0, 1), lambda: load_expert_file(path, 0, 1, s.model, [str(tmp_path)], sha), str(path))
        assert s.experts()["0.1"] == before, label
        with s.use([(0, 1)]) as w:
            assert torch.equal(w[(0, 1)]["w3"], ref["w3"]), label
        assert s.ledger.reserved == {HOT: 0, WARM: 0}, label
    assert_within_budgets(s)


def test_swap_commits_only_between_batches(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=len(ALL) * n + n, warm_budget=0)
    s.configure(ALL)
    ref = Checkpoint(model_dir).expert(0, 2)
    f = write_expert(tmp_path / "v2.safetensors", ref, scale=3.0)
    seen = []
    with s.use([(0, 2), (0, 3)]) as w:
        t = threading.Thread(target=lambda: s.swap(
            (0, 2), lambda: load_expert_file(f, 0, 2, s.model, [str(tmp_path)]), str(f)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive()  # waiting for the batch to end
        seen.append(w[(0, 2)]["w1"].clone())
    t.join(10)
    assert not t.is_alive()
    assert torch.equal(seen[0], ref["w1"])  # the batch used the old version throughout
    with s.use([(0, 2)]) as w:
        assert torch.equal(w[(0, 2)]["w1"], ref["w1"] * 3)


def test_concurrent_swaps_of_one_expert_never_tear(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=len(ALL) * n + 2 * n, warm_budget=n)
    s.configure(ALL)
    ref = Checkpoint(model_dir).expert(1, 0)
    files = [write_expert(tmp_path / f"v{i}.safetensors", ref, scale=float(i + 2)) for i in range(4)]
    digests = {content_digest({k: v * float(i + 2) for k, v in ref.items()}) for i in range(4)}
    threads = [threading.Thread(target=s.swap, args=((1, 0), (lambda f=f: load_expert_file(f, 1, 0, s.model,
                                                                                            [str(tmp_path)])), str(f)))
               for f in files]
    for t in threads:
        t.start()
    for _ in range(20):
        with s.use([(1, 0)]) as w:
            t_ = w[(1, 0)]
            scale = (t_["w1"] / ref["w1"]).flatten()[0].item()
            assert torch.allclose(t_["w2"], ref["w2"] * scale) and torch.allclose(t_["w3"], ref["w3"] * scale)
    for t in threads:
        t.join()
    assert s.experts()["1.0"]["digest"] in digests
    assert_within_budgets(s)


def test_unusable_cold_dir_degrades_to_the_source_and_says_so(model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, cold_dir=str(blocker / "cold"), hot_budget=EXPERTS * n, warm_budget=0)
    s.configure(ALL)
    assert s.cold is None and "cannot use" in s.cold_error and str(blocker) in s.cold_error
    with s.use([(1, 1)]) as w:
        assert torch.equal(w[(1, 1)]["w1"], Checkpoint(model_dir).expert(1, 1)["w1"])


def test_slots_are_reused_so_memory_stays_at_the_budgets(model_dir, tmp_path):
    """Every expert buffer comes from a per-tier pool capped at budget // expert size. Every call
    misses (each layer's experts were pushed out since its last call): slots move between the
    hot and warm pools and are reused, never freed and allocated again."""
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=EXPERTS * n, warm_budget=2 * n, prefetch=False)
    s.configure(ALL)
    for _ in range(5):
        for layer in range(LAYERS):
            with s.use([(layer, e) for e in range(EXPERTS)]):
                pass
    assert s.pools[HOT].allocated <= EXPERTS and s.pools[WARM].allocated <= 2
    assert s.stats.cold_reads["cache"] + s.stats.cold_reads["disk"] > LAYERS * EXPERTS  # it did thrash
    assert s.pools[HOT].allocations + s.pools[WARM].allocations <= EXPERTS + 2
    in_use = {id(e.slot) for e in s.entries.values() if e.slot is not None}
    assert len(in_use) == sum(1 for e in s.entries.values() if e.tier in (HOT, WARM))
    s.configure(ALL, TierConfig(hot_budget=EXPERTS * n, warm_budget=0, cold_dir=str(tmp_path / "cold")))
    assert s.pools[WARM].allocated == 0 and s.ledger.used[WARM] == 0


def test_registration_streams_digest_and_cold_file(model_dir, tmp_path):
    """One sequential pass: the digest is content_digest of the checkpoint's tensors and the cold
    file is a safetensors file holding exactly them."""
    from safetensors.torch import load_file

    s = make_store(model_dir, tmp_path)
    s.configure([(1, 2)])
    ref = Checkpoint(model_dir).expert(1, 2)
    digest = s.experts()["1.2"]["digest"]
    assert digest == content_digest(ref)
    path = s.cold.get((1, 2), digest)
    on_disk = load_file(str(path))
    assert sorted(on_disk) == ["w1", "w2", "w3"] and all(torch.equal(on_disk[w], ref[w]) for w in ref)
    assert not list(s.cold.dir.glob(".register-*"))  # no temp files left behind


def test_a_batch_that_pinned_the_expert_never_waits_on_the_swap_staged_beside_it(model_dir, tmp_path):
    """The swap reserves hot room for the new version, then waits for the batches that pinned
    the expert; a batch that pinned it and needs that room to promote it used to wait for the
    swap: each waited for the other until the timeout (a 30 s 503 under load, then a failed
    swap). Now the batch goes over the budget by the staged copy and the swap commits after it."""
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=2 * n, warm_budget=n)
    k, m = (0, 0), (0, 1)
    s.configure([k, m])
    s.demote(k)  # hot: m; warm: k
    assert s.entries[k].tier == WARM and s.entries[m].tier == HOT
    s.wait_timeout_s = 3.0
    ref = Checkpoint(model_dir).expert(*k)
    release, errors, used = threading.Event(), [], []

    def load():
        release.wait(10)
        return {w: t * 3 for w, t in ref.items()}

    def swap():
        try:
            s.swap(k, load, "test")
        except Exception as err:  # noqa: BLE001 - recorded for the assertion
            errors.append(("swap", err))

    def batch():
        try:
            with s.use([m, k]) as w:
                used.append(w[k]["w1"].clone())
        except Exception as err:  # noqa: BLE001
            errors.append(("batch", err))

    t_swap = threading.Thread(target=swap)
    t_swap.start()
    deadline = time.monotonic() + 10
    while s.ledger.reserved[HOT] != n and time.monotonic() < deadline:  # staged beside, in hot
        time.sleep(0.01)
    t_batch = threading.Thread(target=batch)
    t_batch.start()
    while s.entries[k].pins == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the batch now needs hot room for k
    release.set()
    t_batch.join(10)
    t_swap.join(10)
    assert not errors, errors
    assert torch.equal(used[0], ref["w1"])  # the batch that started before the swap used the old version
    with s.use([k]) as w:
        assert torch.equal(w[k]["w1"], ref["w1"] * 3)
    assert s.ledger.staged == {HOT: 0, WARM: 0} and s.ledger.reserved == {HOT: 0, WARM: 0}
    assert s.ledger.used[HOT] <= 2 * n  # back within the budget after the commit


def test_a_swap_waits_for_room_while_every_expert_is_in_use(model_dir, tmp_path):
    """The swapped expert in warm (full with it), hot full of experts that batches hold (under
    load, at any one moment): the swap waits for one to be let go and stages there, instead of
    failing at once; held past the store's wait it fails, saying why, and the old version serves."""
    n = make_store(model_dir).expert_bytes
    k, m, w = (0, 0), (1, 0), (1, 1)
    ref = Checkpoint(model_dir).expert(*k)
    f = write_expert(tmp_path / "v2.safetensors", ref, scale=3.0)

    def full(wait_s: float) -> TieredExpertStore:
        s = make_store(model_dir, tmp_path, hot_budget=2 * n, warm_budget=n)
        s.configure([k, m, w])
        with s.use([m, w]):
            pass
        s.promote(k, WARM)
        assert [s.entries[x].tier for x in (k, m, w)] == [WARM, HOT, HOT]
        s.wait_timeout_s = wait_s
        return s

    def swap(s):
        return s.swap(k, lambda: load_expert_file(f, *k, s.model, [str(tmp_path)]), str(f))

    s = full(0.5)
    with s.use([m, w]):  # every other resident expert in use for longer than the store waits
        with pytest.raises(SwapError, match="stayed full of experts in use"):
            swap(s)
    with s.use([k]) as got:
        assert torch.equal(got[k]["w1"], ref["w1"])  # the old version serves

    s = full(10.0)
    done, errors = threading.Event(), []

    def run():
        try:
            swap(s)
        except Exception as err:  # noqa: BLE001 - recorded for the assertion
            errors.append(err)
        done.set()

    batch = s.use([m, w])
    batch.__enter__()
    try:
        t = threading.Thread(target=run)
        t.start()
        assert not done.wait(0.3)  # no room anywhere: it waits (it used to fail here)
    finally:
        batch.__exit__(None, None, None)
    t.join(10)
    assert done.is_set() and not errors, errors
    with s.use([k]) as got:
        assert torch.equal(got[k]["w1"], ref["w1"] * 3)
