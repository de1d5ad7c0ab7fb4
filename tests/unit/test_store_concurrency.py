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
from collections.abc import Callable
from dataclasses import dataclass
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
from moe_workers.store import coldio
from moe_workers.store.policy import POLICIES
from moe_workers.store.slots import SlotPool
from moe_workers.store.store import COLD, HOT, WARM, StoreFull, TierConfig, TieredExpertStore
from moe_workers.store.versions import CHECKPOINT, SwapError, content_digest
from recording_ops import Ev, RecordingOps

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


def _swap_removed_under_a_batch(s, model_dir, k, keep) -> list:
    """A swap of k waits for a batch that holds k; once its copy is staged, k leaves the replica
    (configure(keep)); then the batch ends. Returns the swap's errors."""
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
    s.configure(keep)  # k removed while the swap waits for the batch
    gate.release.set()
    tb.join(BOUND_S)
    ts.join(BOUND_S)
    return errors


def test_a_swap_of_an_expert_removed_meanwhile_is_refused_and_frees_its_stage(model_dir, tmp_path):
    n = make_store(model_dir).expert_bytes
    s = make_store(model_dir, tmp_path, hot_budget=3 * n, warm_budget=n)
    k = (0, 0)
    s.configure([k, (0, 1)])
    errors = _swap_removed_under_a_batch(s, model_dir, k, [(0, 1)])
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
        """gpu: the hot tier on a stand-in device (HeldStreamOps, its copies held until a batch or
        the host waits for them): hot and warm are then different memory, so moves copy, and
        demotions to warm release the lock for their copy; no slot may be reused or freed under a
        pending copy. fp8: a quantized checkpoint (warm holds the stored form; hot experts keep a
        copy there; swaps in the compute dtype never enter warm)."""
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
        ops = HeldStreamOps() if gpu else None
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
        assert not isinstance(self.store.ops, HeldStreamOps) or not self.store.ops.races, self.store.ops.races
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


# -- a copy stream the test holds: slots reused only after the device work on them ----------------


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlaps(a: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(a[0] < b[1] and b[0] < a[1] for b in spans)


@dataclass(eq=False)
class _Enqueued:
    """A copy or decode on the held stream: its event, the bytes it writes and reads, the work."""

    ev: Ev
    writes: list[tuple[int, int]]
    reads: list[tuple[int, int]]
    run: Callable[[], None]


class HeldStreamOps(RecordingOps):
    """RecordingOps whose copy stream the test holds. A copy or decode is only enqueued: its
    bytes move when the test lets them (`finish`) or when something waits for its event (`wait`:
    a batch's kernels; `host_wait`: the host before it writes a slot), and with it everything
    enqueued before it (one stream, in order, as CudaOps'); `query` says whether it has run.

    Every write into bytes (an enqueued copy or decode, or the host's, which the test reports
    with `host_write`), and every free of a buffer, while an earlier copy or decode into or out
    of those bytes is still pending and the new work is not ordered after it, is recorded in
    `races`. A copy is ordered after that work once the stream has waited (its `after`, now or
    for an earlier copy: a wait holds back everything enqueued after it) for that work's event or
    a later one: not merely by coming later on the stream, since the store orders a slot's reuse
    by the events it gave the slot back with. The host and a free are never ordered after pending
    work (they wait with `host_wait`). A source that is no slot (a mapped file, a checkpoint's
    tensor) is taken at enqueue, as a DMA from pageable memory is staged. The host's reads of
    cold files are reported by a probe (`_host_reads_probed`) to the latest one made."""

    latest: HeldStreamOps | None = None

    def __init__(self):
        super().__init__()
        HeldStreamOps.latest = self
        self.pending: list[_Enqueued] = []
        self.races: list[str] = []
        self._stream: dict[int, Ev] = {}  # id -> every event of the stream (kept alive: ids stay unique)
        self._buffers: dict[int, int] = {}  # live slots: start -> end
        self._waited = 0  # the latest event the stream has waited for: what it holds back after it
        self._mu = threading.RLock()  # the prefetch thread enqueues too

    def _event(self, what):
        ev = super()._event(what)
        ev.done = what == "batch"  # a batch's kernels are not modelled: its event is complete
        return ev

    def _slot(self, t: torch.Tensor) -> bool:
        start, end = _span(t)
        return any(b <= start and end <= e for b, e in self._buffers.items())

    def _check(self, what: str, writes, reads, waited: int = 0) -> None:
        """Record a race with each pending work on these bytes enqueued after event `waited`."""
        for op in self.pending:
            if op.ev.n <= waited:
                continue
            if any(_overlaps(w, op.writes + op.reads) for w in writes) or any(_overlaps(r, op.writes) for r in reads):
                self.races.append(f"{what} while {op.ev} was pending on those bytes")

    def _enqueue(self, what: str, writes, reads, after, run) -> Ev:
        with self._mu:
            self._waited = max([self._waited] + [e.n for e in after or () if id(e) in self._stream])
            self._check(what, writes, reads, self._waited)
            ev = self._event(what)
            self.pending.append(_Enqueued(ev, writes, reads, run))
            self._stream[id(ev)] = ev
            return ev

    def _complete(self, ev) -> None:
        """`ev` and all enqueued before it run."""
        with self._mu:
            if id(ev) not in self._stream:
                return
            while self.pending and self.pending[0].ev.n <= ev.n:
                op = self.pending.pop(0)
                op.run()
                op.ev.done = True

    def finish(self) -> None:
        """The stream runs everything enqueued, in order."""
        with self._mu:
            if self.pending:
                self._complete(self.pending[-1].ev)

    def host_write(self, buf: torch.Tensor, ranges=None) -> None:
        """The host writes `buf` (at `ranges`: (file offset, slot offset, bytes), else all of it)."""
        start = buf.data_ptr()
        spans = [(start + s, start + s + n) for _, s, n in ranges] if ranges else [_span(buf)]
        with self._mu:
            self._check("a host write", spans, [])

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        buf = super().alloc(nbytes, host)
        with self._mu:
            self._buffers[buf.data_ptr()] = buf.data_ptr() + nbytes
        return buf

    def free(self, buf: torch.Tensor, host: bool) -> None:
        with self._mu:
            self._check("a free", [_span(buf)], [])
            self._buffers.pop(buf.data_ptr(), None)
            self.log.append(("free", buf.data_ptr(), self._locked()))

    def copy(self, dst, src, after=()):
        assert src.dtype == dst.dtype, "dtype converted during the DMA"
        reads = [_span(src)] if self._slot(src) else []
        src = src if reads else src.clone()
        ev = self._enqueue("a copy", [_span(dst)], reads, after, lambda: dst.copy_(src))
        self.log.append(("copy", dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr(),
                         [e for e in after if e is not None], ev, self._locked()))
        return ev

    def decode(self, dst, src, quant, after=()):
        from moe_workers.model.dequant import decode_into

        reads = [_span(t) for t in src.values() if self._slot(t)]
        src = {k: t if self._slot(t) else t.clone() for k, t in src.items()}
        ev = self._enqueue("a decode", [_span(t) for t in dst.values()], reads, after,
                           lambda: decode_into(quant, src, dst))
        self.log.append(("decode", next(iter(dst.values())).untyped_storage().data_ptr(),
                         sum(t.numel() * t.element_size() for t in src.values()),
                         [e for e in after if e is not None], ev, self._locked()))
        return ev

    def wait(self, event) -> None:
        super().wait(event)
        self._complete(event)  # the batch's kernels read the weights once it has run

    def host_wait(self, events) -> None:
        super().host_wait(events)
        for ev in events or []:
            self._complete(ev)


@pytest.fixture(autouse=True)
def _host_reads_probed(monkeypatch):
    """The host's reads of cold files into slots are told to the latest HeldStreamOps (the real
    read follows)."""
    HeldStreamOps.latest = None
    real = coldio.read_ranges

    def read_ranges(fd, ranges, slot):
        if HeldStreamOps.latest is not None:
            HeldStreamOps.latest.host_write(slot, ranges)
        return real(fd, ranges, slot)

    monkeypatch.setattr(coldio, "read_ranges", read_ranges)


@pytest.fixture
def held() -> HeldStreamOps:
    return HeldStreamOps()


def _held_store(ops: HeldStreamOps, model_dir: Path, **cfg) -> TieredExpertStore:
    s = TieredExpertStore(Checkpoint(model_dir), torch.float32, TierConfig(**cfg), ops=ops)
    ops.store = s
    return s


def test_held_stream_records_unordered_work_on_the_same_bytes():
    """The double itself: work ordered by its events, or waited for, is no race; a write, a
    host write or a free of bytes a pending copy reads or writes is."""
    ops = HeldStreamOps()
    a, b, c, d = (ops.alloc(64, host=True).zero_() for _ in range(4))
    a.fill_(1)
    first = ops.copy(b, a)
    assert not first.query() and not b.any()
    ops.copy(c, b, after=[first])  # reads what the first writes, after it
    ops.copy(d[:32], a[:32])  # reads what the first reads
    ops.host_write(d, [(0, 32, 32)])  # bytes no pending work touches
    assert not ops.races, ops.races
    for race in (lambda: ops.host_write(a, [(0, 16, 8)]), lambda: ops.copy(b, d), lambda: ops.free(c, host=True)):
        ops.races.clear()
        race()
        assert ops.races
    ops.finish()
    assert first.query() and not ops.pending and bool(c.eq(1).all())


def test_a_warm_slot_leaves_for_its_pool_only_after_the_demotions_copy(model_dir, tmp_path, held):
    """Reproduction (#65): an expert demoted hot -> warm on a GPU is copied device -> host on
    the copy stream; evicted from warm to disk before that copy ran, its warm slot went back to
    the pool with no event, so the next cold read into the slot (the host writing it) raced the
    copy, which then overwrote the expert just read with the demoted one. The slot now carries
    the copy's event: the read waits for it. Real: the store, the checkpoint and its cold files;
    the device is HeldStreamOps."""
    ops = held
    n = make_store(model_dir).expert_bytes
    s = _held_store(ops, model_dir, hot_budget=2 * n, warm_budget=n, cold_dir=str(tmp_path / "cold"), pinned=False)
    a, b, c = (0, 0), (0, 1), (1, 0)
    s.configure([a, b, c])  # a, b hot; c warm
    assert [s.entries[k].tier for k in (a, b, c)] == [HOT, HOT, WARM]
    ops.finish()
    s.demote(c)  # warm -> cold: its slot is free
    s.demote(a)  # hot -> warm, into that slot: the copy is enqueued, and held
    assert s.entries[a].tier == WARM and ops.pending
    s.demote(a)  # warm -> cold while the copy still writes its slot
    s.promote(c, WARM)  # read from its cold file into the free warm slot
    assert not ops.races, ops.races
    ops.finish()
    ref = Checkpoint(model_dir).expert(*c)
    assert all(torch.equal(s.entries[c].tensors[w], t) for w, t in ref.items())
    accounting_holds(s)
    s.close()


def test_a_warm_slot_under_a_demotions_copy_is_freed_only_after_it(model_dir, tmp_path, held):
    """The same slot dropped instead of reused: the warm budget shrinks while the copy into it
    is pending; the pool keeps the slot (dropping) until the copy has run, then frees it."""
    ops = held
    n = make_store(model_dir).expert_bytes
    cfg = dict(hot_budget=2 * n, cold_dir=str(tmp_path / "cold"), pinned=False)
    s = _held_store(ops, model_dir, warm_budget=n, **cfg)
    a, b = (0, 0), (0, 1)
    s.configure([a, b])
    ops.finish()
    s.demote(a)
    s.demote(a)
    assert ops.pending
    s.configure([a, b], TierConfig(warm_budget=0, **cfg))  # the free warm slot is dropped
    assert not ops.races, ops.races
    assert len(s.pools[WARM].dropping) == 1 and not [op for op in ops.log if op[0] == "free"]
    accounting_holds(s)
    ops.finish()
    s.pools[WARM].take()  # (a pool reaps what it drops when it is next used)
    assert not s.pools[WARM].dropping and [op for op in ops.log if op[0] == "free"]
    s.close()


def test_a_hot_experts_kept_copy_goes_back_after_the_decode_that_read_it(fp8_model_dir, tmp_path, held):
    """A quantized expert promoted warm -> hot is decoded on the device from its warm slot,
    which it keeps; evicted from hot it is warm again on that slot. Both slots used to go back
    without the decode's event: the hot slot (the decode writes it) and the kept one (the decode
    reads it), so a cold read into the warm slot, or a decode into the hot one, raced it."""
    ops = held
    probe = make_store(fp8_model_dir)
    compute, stored = probe.forms.compute_bytes, probe.forms.stored_bytes
    s = _held_store(ops, fp8_model_dir, hot_budget=2 * compute, warm_budget=2 * stored,
                    cold_dir=str(tmp_path / "cold"), pinned=False)
    a, b, c = (0, 0), (0, 1), (1, 0)
    s.configure([a, b, c])  # a, b hot (decoded from their cold files); c warm
    ops.finish()
    s.demote(a)  # to disk, then read back into warm in its stored form (a refill)
    s.drain_prefetch(BOUND_S)
    assert s.entries[a].tier == WARM
    ops.finish()
    s.promote(a, HOT)  # decoded from its warm slot, which it keeps: the decode is held
    assert s.entries[a].kept is not None and ops.pending
    s.demote(a)  # warm again at once, on the slot the decode still reads
    s.demote(a)  # to disk: the slot is free
    s.promote(a, WARM)  # a cold read into it
    s.promote(c, HOT)  # a decode into the hot slot a left
    assert not ops.races, ops.races
    ops.finish()
    ckpt = Checkpoint(fp8_model_dir)
    for k in (b, c):
        with s.use([k]) as w:
            assert all(torch.equal(w[k][p], t.to(torch.float32)) for p, t in ckpt.expert(*k).items()), k
    accounting_holds(s)
    s.close()


def test_a_quantized_expert_read_for_hot_is_decoded_after_the_copy_into_its_kept_slot(fp8_model_dir, held):
    """A quantized expert read from its source for hot goes through a warm slot it keeps (copied
    there on the stream), then is decoded from it: the decode used to wait for nothing, the
    read's event dropped, so it could read the slot before the copy into it had run."""
    ops = held
    probe = make_store(fp8_model_dir)
    s = _held_store(ops, fp8_model_dir, hot_budget=3 * probe.forms.compute_bytes,
                    warm_budget=2 * probe.forms.stored_bytes, pinned=False)  # no cold files: from the source
    a, b, c = (0, 0), (0, 1), (1, 0)
    s.configure([a, b, c])  # all hot
    s.demote(c)  # to the source, then read back into warm (a refill)
    s.drain_prefetch(BOUND_S)
    s.demote(c)
    ops.finish()
    assert s.entries[c].tier == COLD
    s.promote(c, HOT)  # copied into a warm slot it keeps, decoded from there
    assert s.entries[c].kept is not None
    assert not ops.races, ops.races
    ops.finish()
    with s.use([c]) as w:
        assert all(torch.equal(w[c][p], t.to(torch.float32)) for p, t in Checkpoint(fp8_model_dir).expert(*c).items())
    accounting_holds(s)
    s.close()


def test_a_staging_buffer_is_read_into_only_after_the_decode_out_of_it(fp8_model_dir, tmp_path, held):
    """A quantized expert read from its cold file for a hot tier in host memory goes through a
    staging buffer, decoded from there into the hot slot: the next read into that buffer waits
    for the decode (it used to ignore the events the buffer was given back with). The decode is
    synchronous on the CPU (CpuOps); here it is held, as a device's would be."""
    ops = held
    ops.device = torch.device("cpu")  # a hot tier in host memory: cold files are read by the host
    probe = make_store(fp8_model_dir)
    s = _held_store(ops, fp8_model_dir, hot_budget=2 * probe.forms.compute_bytes, warm_budget=0,
                    cold_dir=str(tmp_path / "cold"), pinned=False)
    s.configure([(0, 0), (0, 1)])  # two reads through the staging buffer, each decoded from it
    assert not ops.races, ops.races
    s.close()


def test_a_refused_swap_gives_its_stage_back_after_the_copy_into_it(model_dir, tmp_path, held):
    """A swap staged beside the serving version (its copy enqueued) and refused because the
    expert left the replica meanwhile gives the staged slot back with the copy's event: dropped
    by a smaller budget, it is freed only once the copy has run."""
    ops = held
    n = make_store(model_dir).expert_bytes
    s = _held_store(ops, model_dir, hot_budget=3 * n, warm_budget=n, cold_dir=str(tmp_path / "cold"), pinned=False)
    k, other = (0, 0), (0, 1)
    s.configure([k, other])
    ops.finish()
    errors = _swap_removed_under_a_batch(s, model_dir, k, [other])
    assert errors and "removed" in str(errors[0]) and ops.pending  # the staged copy has not run
    s.configure([other], TierConfig(hot_budget=n, warm_budget=n, cold_dir=str(tmp_path / "cold"), pinned=False))
    assert not ops.races, ops.races
    ops.finish()
    accounting_holds(s)
    s.close()


def test_a_pool_frees_a_dropped_slot_only_after_its_pending_work():
    """SlotPool: a slot given back with a pending event and dropped (over capacity) is kept
    until the event completes; a slot taken again comes with that event for its next writer."""
    ops = HeldStreamOps()
    pool = SlotPool(64, ops, host=True, capacity=2)
    src = ops.alloc(64, host=True)
    buf, after = pool.take()
    ev = ops.copy(buf, src, after=after)
    pool.give(buf, [ev])
    again, after = pool.take()
    assert again is buf and after == [ev]  # the next writer waits for the copy
    pool.give(buf, [ev])
    pool.resize(0)  # dropped while the copy runs
    assert pool.dropping and pool.allocated == 1 and not ops.races
    pool.take()
    assert pool.dropping  # still pending
    ops.finish()
    pool.take()
    assert not pool.dropping and pool.allocated == 2 and not ops.races  # freed, and two taken since
