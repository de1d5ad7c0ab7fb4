"""TieredExpertStore under concurrency, on CPU with a real (tiny) checkpoint.

Ray Serve runs a replica's sync methods in a thread pool and the expert channel computes each
connection on its own thread, so `use()` runs concurrently with other `use()` calls,
`configure()` (reconfigure), `prefetch()`, `swap()` and idle demotion. First the reproductions
that used to fail (regression tests), then a state machine that drives all of them from several
threads at once and checks the store's invariants after every step.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from safetensors.torch import save_file

from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.device import CpuOps
from moe_workers.store.policy import POLICIES
from moe_workers.store.slots import SlotPool
from moe_workers.store.store import HOT, WARM, StoreFull, TierConfig, TieredExpertStore
from moe_workers.store.versions import CHECKPOINT, SwapError, content_digest
from recording_ops import RecordingOps

LAYERS, EXPERTS = 3, 4
BOUND_S = 20.0  # no call may wait longer than this in these tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_random_mixtral(tmp_path_factory.mktemp("ckpt"), vocab_size=64, hidden_size=16,
                                intermediate_size=24, num_layers=LAYERS, num_experts=EXPERTS, num_heads=2,
                                num_kv_heads=1)


@pytest.fixture(scope="module")
def fp8_model_dir(tmp_path_factory) -> Path:
    """The same model as model_dir, written as an fp8 release ships it (blocks of 8): its warm
    tier holds the stored form, and experts promoted to hot keep a stored copy there."""
    return write_random_mixtral(tmp_path_factory.mktemp("ckpt-fp8"), vocab_size=64, hidden_size=16,
                                intermediate_size=24, num_layers=LAYERS, num_experts=EXPERTS, num_heads=2,
                                num_kv_heads=1, quantize="fp8", block=(8, 8))


def make_store(model_dir, tmp_path=None, **cfg) -> TieredExpertStore:
    if tmp_path is not None:
        cfg.setdefault("cold_dir", str(tmp_path / "cold"))
    return TieredExpertStore(Checkpoint(model_dir), torch.float32, TierConfig(**cfg))


def accounting_holds(s: TieredExpertStore) -> None:
    """What the store counts equals what it holds: used bytes per tier are the resident entries'
    (current ones, and removed ones still pinned), and each pool's allocated slots are exactly the
    slots held by entries plus its free list (checked when no call is under way)."""
    with s.cv:
        live = list(s.entries.values()) + list(s._retiring)
        for tier in (HOT, WARM):
            held = sum(e.tier == tier or tier == WARM and e.kept is not None for e in live)
            assert s.ledger.used[tier] == held * s.forms.nbytes(tier), tier
            held = sum(1 for e in live if e.tier == tier and e.slot is not None)
            held += sum(1 for e in live if tier == WARM and e.kept_slot is not None)
            pool = s.pools[tier]
            assert pool.allocated == held + len(pool.free) + len(pool.dropping), tier


class Gate:
    """Blocks one call of a hooked function until released (to hold a batch or a copy open)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def wait_here(self):
        self.entered.set()
        assert self.release.wait(BOUND_S)


def test_release_under_a_running_batch_waits_for_its_last_unpin(model_dir, tmp_path):
    """Reproduction: configure() dropping an expert a batch is computing with used to give its
    slot back at once; the next expert loaded into that slot overwrote the batch's weights."""
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=2 * n, warm_budget=0)
    k, other = (1, 0), (0, 0)
    s.configure([k])
    ref = Checkpoint(model_dir).expert(*k)
    gate, seen = Gate(), []

    def batch():
        with s.use([k]) as w:
            gate.wait_here()
            seen.append(w[k]["w1"].clone())

    t = threading.Thread(target=batch)
    t.start()
    assert gate.entered.wait(BOUND_S)
    s.configure([other, (0, 1)])  # k dropped, two others loaded: they need k's slot's room
    assert k not in s.entries
    accounting_holds(s)
    assert s.ledger.used[HOT] + s.ledger.reserved[HOT] <= 2 * n
    gate.release.set()
    t.join(BOUND_S)
    assert torch.equal(seen[0], ref["w1"])  # the batch kept the weights it pinned
    s.configure([other, (0, 1)])  # now there is room: both hot
    accounting_holds(s)
    assert not s._retiring and s.ledger.used[HOT] == 2 * n
    s.close()


def test_release_during_a_prefetch_copy_waits_for_the_copy(model_dir, tmp_path, monkeypatch):
    """Reproduction: while the prefetch thread copied an expert out of a warm slot, configure()
    released it and refilled that slot with another expert; the move then recorded bytes for an
    entry that no longer existed (hot `used` one slot too high for good)."""
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=2 * n, warm_budget=2 * n, pinned=False)
    k = (0, 0)
    s.configure([k, (0, 1), (1, 0), (1, 1)])  # 2 hot, 2 warm
    warm = [key for key, e in s.entries.items() if e.tier == WARM]
    k = warm[0]
    gate = Gate()
    real_fill = s.fill

    def slow_fill(tier, src, after=None):  # the warm -> hot copy (hot and warm differ: copied, not moved)
        if tier == HOT:
            gate.wait_here()
        return real_fill(tier, src, after=after)

    monkeypatch.setattr(s, "fill", slow_fill)
    monkeypatch.setattr(s, "_same_memory", lambda: False)
    done = threading.Event()
    threading.Thread(target=lambda: (s.promote(k, HOT), done.set()), daemon=True).start()
    assert gate.entered.wait(BOUND_S)
    t = threading.Thread(target=lambda: s.configure([(2, 0), (2, 1)]))  # everything else dropped
    t.start()
    time.sleep(0.2)
    gate.release.set()
    assert done.wait(BOUND_S)
    t.join(BOUND_S)
    monkeypatch.setattr(s, "fill", real_fill)
    accounting_holds(s)
    assert set(s.entries) == {(2, 0), (2, 1)} and not s._retiring
    assert s.ledger.used[HOT] + s.ledger.used[WARM] == 2 * n  # nothing counted for the expert that left
    s.close()


def test_two_batches_needing_each_others_room_both_finish(model_dir, tmp_path):
    """Reproduction: use() pinned all its keys, then promoted them one by one, waiting for room;
    two concurrent calls for different layers each held pins the other needed to evict, and both
    stalled until the timeout (then one failed with StoreFull). At the smallest hot budget
    check_budgets accepts (one token's experts: the 2 of a layer here, top-2), both must finish, and soon."""
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=2 * n, warm_budget=4 * n)
    a, b = [(0, 0), (0, 1)], [(1, 0), (1, 1)]
    s.configure(a + b)
    s.wait_timeout_s = 10.0
    # hot holds one key of each layer: each call finds one of its keys hot, one not
    for key in a + b:
        s.demote(key)
    s.promote(a[0])
    s.promote(b[0])
    assert {k for k, e in s.entries.items() if e.tier == HOT} == {a[0], b[0]}
    start, errors, elapsed = threading.Barrier(2), [], []

    def call(keys):
        start.wait()
        t0 = time.monotonic()
        try:
            for _ in range(20):
                with s.use(keys) as w:
                    assert set(w) == set(keys)
                    time.sleep(0.002)
        except Exception as err:  # noqa: BLE001 - recorded for the assertion
            errors.append(err)
        elapsed.append(time.monotonic() - t0)

    threads = [threading.Thread(target=call, args=(keys,)) for keys in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert not errors, errors
    assert max(elapsed) < 5.0, elapsed
    accounting_holds(s)
    s.close()


def test_a_failed_allocation_leaves_the_pool_count_right():
    """Reproduction: SlotPool.take() counted a slot before allocating it; an allocation error
    left the count one too high for good."""
    ops = CpuOps()
    pool = SlotPool(1 << 10, ops, host=True, capacity=2)
    calls = []

    def failing_alloc(nbytes, host):
        calls.append(1)
        raise RuntimeError("out of memory")

    real_alloc, ops.alloc = ops.alloc, failing_alloc
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            pool.take()
    finally:
        ops.alloc = real_alloc
    assert calls and pool.allocated == 0
    buf, after = pool.take()
    assert pool.allocated == 1 and buf.numel() == 1 << 10 and after == []


def test_a_swap_of_an_expert_removed_meanwhile_is_refused_and_frees_its_stage(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=3 * n, warm_budget=n)
    k = (0, 0)
    s.configure([k, (0, 1)])
    ref = Checkpoint(model_dir).expert(*k)
    gate, errors = Gate(), []

    def batch():
        with s.use([k]):
            gate.wait_here()

    def swap():
        try:
            s.swap(k, lambda: {w: t * 2 for w, t in ref.items()}, "test")
        except SwapError as err:
            errors.append(err)

    tb = threading.Thread(target=batch)
    tb.start()
    assert gate.entered.wait(BOUND_S)
    ts = threading.Thread(target=swap)
    ts.start()
    deadline = time.monotonic() + BOUND_S
    while not s.ledger.staged[HOT] + s.ledger.staged[WARM] and time.monotonic() < deadline:
        time.sleep(0.01)
    s.configure([(0, 1)])  # k removed while the swap waits for the batch
    gate.release.set()
    tb.join(BOUND_S)
    ts.join(BOUND_S)
    assert errors and "removed" in str(errors[0])
    assert s.ledger.staged == {HOT: 0, WARM: 0} and s.ledger.reserved == {HOT: 0, WARM: 0}
    accounting_holds(s)
    s.close()


# -- the state machine --------------------------------------------------------------------------


class ConcurrentStore(RuleBasedStateMachine):
    """Each step runs a few operations at once on threads (batches on random layers, with a
    configure, a prefetch, a swap or an idle demotion beside them), joins them within a bound and
    checks: budgets never exceeded, counts equal residency, every batch computed with the weights
    of the version it pinned."""

    model_dir: Path = None  # set by the test
    fp8_model_dir: Path = None
    tmp: Path = None

    def __init__(self):
        super().__init__()
        self.errors: list[BaseException] = []
        self.store: TieredExpertStore | None = None

    @initialize(hot=st.integers(0, 4), warm=st.integers(0, 4), cold=st.booleans(),
                policy=st.sampled_from(list(POLICIES)), gpu=st.booleans(), fp8=st.booleans())
    def setup(self, hot, warm, cold, policy, gpu, fp8):
        """gpu: the hot tier on a stand-in device (RecordingOps): hot and warm are then different
        memory, so moves copy, and demotions to warm release the lock for their copy. fp8: a
        quantized checkpoint (warm holds the stored form; hot experts keep a copy there; swaps in
        the compute dtype never enter warm)."""
        model = self.fp8_model_dir if fp8 else self.model_dir
        probe = make_store(model)
        self.n = n = probe.expert_bytes
        self.per_layer = 2  # each layer's experts on this shard: 2 of 4
        # the smallest hot budget check_budgets accepts is one token's experts (the 2 of a layer, top-2)
        self.hot, self.warm = (self.per_layer + hot) * n, warm * probe.forms.nbytes(WARM)
        self.ref = Checkpoint(model)
        self.versions = {}  # digest -> the weights of that version, per key
        cfg = dict(hot_budget=self.hot, warm_budget=self.warm, policy=policy, idle_demotion_s=1, pinned=False)
        if cold:
            cfg["cold_dir"] = str(self.tmp / f"cold-{id(self)}")
        ops = RecordingOps() if gpu else None
        self.store = TieredExpertStore(Checkpoint(model), torch.float32, TierConfig(**cfg), ops=ops)
        if ops is not None:
            ops.store = self.store
        self.store.wait_timeout_s = BOUND_S
        self.hosted = [(l, e) for l in range(LAYERS) for e in range(self.per_layer)]
        self.store.configure(self.hosted)
        for key in self.hosted:
            self.versions[(key, self.store.entries[key].version.digest)] = self.ref.expert(*key)
        self.clock = time.monotonic()

    def _batch(self, keys):
        try:
            with self.store.use(keys) as w:
                pinned = {k: self.store.entries[k].version.digest if k in self.store.entries else None for k in keys}
                time.sleep(0.001)
                for k in keys:
                    want = self.versions.get((k, pinned[k]))
                    if want is not None:
                        assert torch.equal(w[k]["w1"], want["w1"]) and torch.equal(w[k]["w2"], want["w2"]), k
        except KeyError:
            pass  # the expert left this replica between the pick and the call (configure beside it)
        except BaseException as err:  # noqa: BLE001 - checked in the invariant
            self.errors.append(err)

    def _run(self, jobs):
        threads = [threading.Thread(target=j, daemon=True) for j in jobs]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        assert not any(t.is_alive() for t in threads), "a call waited past the bound"
        assert time.monotonic() - t0 < BOUND_S

    def _keys(self, layer, data):
        hosted = [k for k in self.hosted if k[0] == layer]
        return data.draw(st.lists(st.sampled_from(hosted), min_size=1, max_size=len(hosted), unique=True)) if hosted else []

    @rule(layers=st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=3), data=st.data(),
          other=st.sampled_from(["configure", "prefetch", "swap", "rollback", "idle", "none"]))
    def step(self, layers, data, other):
        jobs = [lambda keys=self._keys(l, data): self._batch(keys) for l in layers]
        if other == "configure":
            layer_sets = data.draw(st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS, unique=True))
            experts = data.draw(st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=self.per_layer, unique=True))
            new = [(l, e) for l in layer_sets for e in experts]

            def reconfigure():
                try:
                    self.store.configure(new)
                    for key in new:
                        e = self.store.entries.get(key)
                        if e is not None and (key, e.version.digest) not in self.versions:
                            self.versions[(key, e.version.digest)] = self.ref.expert(*key)
                except StoreFull as err:
                    self.errors.append(err)

            self.hosted = new
            jobs.append(reconfigure)
        elif other == "prefetch":
            jobs.append(lambda keys=list(self.hosted): self.store.prefetch(keys))
        elif other in ("swap", "rollback"):
            key = data.draw(st.sampled_from(self.hosted))
            scale = 1.0 if other == "rollback" else float(data.draw(st.integers(2, 5)))
            weights = {w: (t * scale).contiguous() for w, t in self.ref.expert(*key).items()}
            self.versions[(key, content_digest(weights))] = weights
            source = CHECKPOINT
            if other == "swap":  # a demoted version is read back from its source file
                source = str(self.tmp / f"swap-{key[0]}.{key[1]}-{int(scale)}.safetensors")
                save_file(weights, source)

            def swap():
                try:
                    self.store.swap(key, lambda: weights, source)
                except SwapError:
                    pass  # no room to stage beside, or removed meanwhile: the old version serves
            jobs.append(swap)
        elif other == "idle":
            self.clock += 2
            jobs.append(lambda: self.store.demote_idle(self.clock))
        self._run(jobs)
        self.store.drain_prefetch(BOUND_S)

    @invariant()
    def holds(self):
        if self.store is None:
            return
        assert not self.errors, self.errors
        s = self.store
        with s.cv:
            assert s.ledger.used[HOT] + s.ledger.reserved[HOT] <= self.hot or s.ledger.staged[HOT]
            assert s.ledger.used[WARM] + s.ledger.reserved[WARM] <= self.warm or s.ledger.staged[WARM]
            assert not any(e.pins or e.busy for e in s.entries.values())  # every call has finished
            assert s.ledger.reserved == {HOT: 0, WARM: 0} and s.ledger.staged == {HOT: 0, WARM: 0}
            assert not s._retiring
        accounting_holds(s)

    def teardown(self):
        if self.store is not None:
            self.store.close()


TestConcurrentStore = ConcurrentStore.TestCase
TestConcurrentStore.settings = settings(max_examples=25, stateful_step_count=12, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _machine_paths(model_dir, fp8_model_dir, tmp_path):
    ConcurrentStore.model_dir = model_dir
    ConcurrentStore.fp8_model_dir = fp8_model_dir
    ConcurrentStore.tmp = tmp_path


# -- the GPU path, up to the device calls ---------------------------------------------------------


def test_device_is_what_ray_assigned():
    from moe_workers.device import assigned_device

    assert assigned_device([], True) == torch.device("cpu")  # asked Ray for no GPU: never touches one
    assert assigned_device([3], False) == torch.device("cpu")
    assert assigned_device(["3"], True) == torch.device("cuda", 0)  # Ray's CUDA_VISIBLE_DEVICES: first visible


def test_cpu_store_pins_nothing(model_dir):
    s = make_store(model_dir, pinned=True)
    assert s.device.type == "cpu" and not s.ops.pinned_host
    assert s.pools[WARM].host and s.pools[HOT].host


def test_pinned_warm_memory_is_registered_at_its_exact_size(monkeypatch):
    from moe_workers import device as dev

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister",))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    ops = object.__new__(dev.CudaOps)  # no CUDA here: the stream is not created
    ops.device, ops._pin = torch.device("cuda", 0), True
    nbytes = 336 * 2**20 + 12345  # not a power of two
    buf = ops.alloc(nbytes, host=True)
    assert buf.device.type == "cpu" and buf.numel() == nbytes
    assert calls == [("register", nbytes, 0)]  # exactly the slot, no caching allocator rounding
    ops.free(buf, host=True)
    assert calls[-1] == ("unregister",)


def test_gpu_path_orders_copies_and_batches_without_blocking_under_the_lock(model_dir, tmp_path):
    """Copies are enqueued with the events they must wait for; a batch's kernels wait for the
    copies of its experts; a slot is written again only after the batch that read it and the copy
    that read out of it; no device call (copy, or a host wait) is made while the store's lock is
    held, demotions to warm included; dtype conversion happens before the copy (the checkpoint is
    float32, compute bfloat16)."""
    ops = RecordingOps()
    n = TieredExpertStore(Checkpoint(model_dir), torch.bfloat16, TierConfig()).expert_bytes
    s = TieredExpertStore(Checkpoint(model_dir), torch.bfloat16,
                          TierConfig(hot_budget=2 * n, warm_budget=2 * n, cold_dir=str(tmp_path / "cold")), ops=ops)
    ops.store = s
    ref = Checkpoint(model_dir)
    keys = [(0, 0), (0, 1), (1, 0), (1, 1)]
    s.configure(keys)  # 2 hot (device), 2 warm (pinned host)
    assert {e.tier for e in s.entries.values()} == {HOT, WARM}
    for round_ in range(3):
        for layer in (0, 1):
            batch = [(layer, 0), (layer, 1)]
            start = len(ops.log)
            with s.use(batch) as w:
                for k in batch:
                    assert torch.equal(w[k]["w1"], ref.expert(*k)["w1"].to(torch.bfloat16)), (round_, k)
                waits = [op[1] for op in ops.log[start:] if op[0] == "wait"]
                # the compute stream waits for the copy that brought each expert in
                assert [s.entries[k].ready for k in batch if s.entries[k].ready is not None] == \
                    [e for e in waits if e is not None]
            assert ops.log[-1][0] == "record"
    # a slot written again waited for the last batch that read it, or the copy out of it
    reused = 0
    readers: dict[int, set] = {}  # slot -> events of the copies that read out of it
    slots: set[int] = set()
    batch_events = {op[1].n for op in ops.log if op[0] == "record"}
    for op in ops.log:
        if op[0] == "alloc":  # a fresh slot (possibly at a freed one's address): no reader yet
            slots.add(op[1])
            readers.pop(op[1], None)
        if op[0] != "copy":
            continue
        dst, src, after, ev, locked = op[1:]
        if dst in readers:  # the first copy into a slot that was read: ordered after its readers
            reused += 1
            assert {e.n for e in after} & (readers.pop(dst) | batch_events), (dst, after)
            # (the fill's next copies into the same slot follow on the same stream)
        if src in slots:
            readers.setdefault(src, set()).add(ev.n)
    assert reused > 0
    assert not [op for op in ops.log if op[0] == "host_wait" and op[2]], "the host waited under the lock"
    assert not [op for op in ops.log if op[0] == "copy" and op[5]], "a device copy issued under the lock"
    assert any(op[0] == "copy" and op[1] in slots for op in ops.log)  # (demotions to warm did copy)
    assert not [op for op in ops.log if op[0] == "wait" and op[2]], "a stream wait under the lock"
    s.close()
