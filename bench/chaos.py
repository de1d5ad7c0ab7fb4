"""Overload and faults on the quickstart app under `moectl up`, each side by side with its own
steady state in one run. Ends with `figure: value` lines.

    python bench/chaos.py                  # overload, then faults
    python bench/chaos.py --only faults    # one of: overload, faults
    python bench/chaos.py --quick          # shorter phases
    python bench/chaos.py --kubernetes     # control-plane faults on the real apiserver (bench/chaos_k8s.py)

Overload:
1. The knee: closed-loop clients (`moectl bench`'s load generator) at rising concurrency, each
   level for --phase-s; the knee is the lowest concurrency whose goodput (answered requests per
   second) is within 5% of the best level's. A phase's goodput is counted over its steady window:
   requests answered after its first 5 s (a quarter of shorter phases) and before its clients
   stop sending; the drain after that is left out (printed as the whole run's goodput too).
2. Overload at --overload x the knee, and at --shed-clients (default 320: more than the app
   admits, batch 32 + wait queue 64, and than the proxy's gate can queue within its 4 s wait, so
   requests are refused), each twice: clients that honour the `Retry-After` of a 503, and
   clients that resend at once (`--hammer`). `overload-goodput-ratio` = the worse of the two
   goodputs at --overload x the knee / the knee's (the issue's target: 0.9 at 2.5x);
   `shed-goodput-ratio` the same at --shed-clients. Refused requests (503) are counted apart
   from failures (other errors, which must be 0).

Faults, one at a time under --fault-clients clients that honour Retry-After: --steady-s of load,
the fault, then load until the app is whole again (the victim's replacement running: a new
ExpertShard replica on the expert channel, a new Ingress process answering) and --settle-s more.
Each reports failed and refused requests, p99 latency while the fault lasts against the steady
state before it, the longest request, and seconds from the fault to full recovery:
- SIGKILL of one ExpertShard replica, with 1 and with 2 replicas per group;
- SIGKILL of the Ingress replica, with 1 and with 2 ingress replicas;
- one ExpertShard replica stalled (SIGSTOP for --stall-s, then SIGCONT), with 2 replicas per group;
- a hot-swap to a corrupt weights file (`moectl hot-swap --local --wait`: refused, the old
  version keeps serving), then its rollback; recovery is the time to the verdict;
- a rebalance asked for (`moectl rebalance --local --wait`: make-before-break when the planner
  finds a better placement, else "no rebalance"); recovery is the time until it serves.
Victims are found by pid: shard replicas from the app's /moe/v1/status, Ingress replicas by the
process title Ray gives an actor (`ray::ServeReplica:<ns>.<app>:Ingress` idle,
`ray::<app>:Ingress.<method>` in a call).

The app is the quickstart's (examples/standalone/quickstart.yaml: a random tiny Mixtral, 2 shard
groups, maxBatchSize 32, maxQueuedRequests 64), so past batch + queue the admission gate in the
Serve proxy (moe_workers/serve/proxy/gate.py) refuses with 503 before a replica sees the request.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator")]

import requests  # noqa: E402
from figures import scratch  # noqa: E402
import yaml  # noqa: E402

from moe_operator.loadgen import LoadGen, model_info, percentiles, summarize  # noqa: E402

MOECTL = str(Path(sys.executable).with_name("moectl"))
STEADY_SKIP_S = 5.0  # seconds at the start of a load phase left out of its goodput


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 s phases")
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds of load per phase")
    p.add_argument("--levels", default="8,16,32,64", help="concurrency levels searched for the knee")
    p.add_argument("--overload", type=float, default=2.5, help="overload concurrency as a multiple of the knee")
    p.add_argument("--shed-clients", type=int, default=320,
                   help="clients past what the app admits and the gate queues (so some are refused)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray head")
    p.add_argument("--only", choices=["overload", "faults"], help="run one part")
    p.add_argument("--kubernetes", action="store_true",
                   help="only the control-plane faults: operator SIGKILL mid-reconcile, apiserver stopped "
                        "(a MoEDeployment on scripts/testenv's apiserver, the operator and Ray local)")
    p.add_argument("--apiserver-down-s", type=float, default=30.0, help="seconds the apiserver stays stopped")
    p.add_argument("--fault-clients", type=int, default=8, help="clients during the fault runs")
    p.add_argument("--fault-num-cpus", type=int, default=4,
                   help="logical CPUs of the fault runs' Ray head (2 ingress x 0.5 + 4 shard replicas x 0.25 + "
                        "the StatusBoard do not fit in 2)")
    p.add_argument("--steady-s", type=float, default=15.0, help="seconds of load before each fault")
    p.add_argument("--settle-s", type=float, default=5.0, help="seconds of load after recovery")
    p.add_argument("--stall-s", type=float, default=20.0, help="seconds a stalled replica stays stopped")
    p.add_argument("--recovery-timeout-s", type=float, default=180.0)
    p.add_argument("--faults", help="comma-separated fault names to run (e.g. shard-kill-1-replica); default all")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"))
    return p.parse_args()


class StandaloneApp:
    """The quickstart manifest under `moectl up` on a fresh local Ray head, in its own state dir."""

    def __init__(self, work: Path, num_cpus: int, ingress_replicas: int = 1, replicas_per_group: int = 1):
        from moe_operator.standalone.local_ray import free_port

        self.work, self.port = work, free_port()
        run = work / f"ingress{ingress_replicas}-shards{replicas_per_group}"  # state and log of this app
        run.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "MOE_STATE_DIR": str(run / "state")}
        if not (work / "models" / "mixtral-tiny" / "config.json").exists():
            subprocess.run([MOECTL, "init-model", str(work / "models" / "mixtral-tiny")], env=self.env, check=True,
                           capture_output=True)
        manifest = yaml.safe_load((REPO / "examples" / "standalone" / "quickstart.yaml").read_text())
        manifest["spec"]["experts"]["tiers"]["cold"]["path"] = str(work / "models" / ".expert-cache")
        manifest["spec"]["ingress"]["replicas"] = ingress_replicas
        manifest["spec"]["experts"]["replicasPerGroup"] = replicas_per_group
        self.name = manifest["metadata"]["name"]
        self.ingress_replicas, self.replicas_per_group = ingress_replicas, replicas_per_group
        self.groups = int(manifest["spec"]["experts"]["groups"])
        self.warm_spares = int(manifest["spec"]["experts"].get("warmSpares", 1))
        app_file = work / f"{run.name}.yaml"  # beside the model: its directory is the allowed model root
        app_file.write_text(yaml.safe_dump(manifest))
        self.log = run / "up.log"
        self.proc = subprocess.Popen([MOECTL, "up", "-f", str(app_file), "--port", str(self.port),
                                      "--num-cpus", str(num_cpus)], env=self.env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_serving(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while "is serving at" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"moectl up did not serve:\n{self.log.read_text()}")
            time.sleep(1)

    def status(self) -> dict:
        return requests.get(self.url + "/moe/v1/status", timeout=10).json()

    def shard_pids(self) -> dict[str, list[int]]:
        """group -> pids of its replicas on the expert channel (as the answering ingress sees them)."""
        st = self.status()
        on_channel = {m["endpoint"] for ms in st["channel"]["members"].values() for m in ms if not m["down"]}
        out: dict[str, list[int]] = {}
        for r in st["replicas"]:
            if r.get("endpoint") in on_channel:
                out.setdefault(r["group"], []).append(r["pid"])
        return out

    def ingress_pids(self) -> list[int]:
        """Processes whose title Ray set to this app's Ingress replica actor."""
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                except OSError:
                    continue
                # idle: ray::ServeReplica:<ns>.<app>:Ingress; in a call: ray::<app>:Ingress.<method>
                if title.startswith("ray::") and re.search(rf"\b{re.escape(self.name)}:Ingress(\.|$)", title):
                    pids.append(int(d.name))
        return sorted(pids)

    def whole(self, gone: set[int]) -> bool:
        """Every replica the manifest asks for runs, none of them a victim, every shard replica
        on the channel, and the app answers."""
        try:
            shards = self.shard_pids()
            ingress = self.ingress_pids()
            requests.get(self.url + "/v1/models", timeout=5).raise_for_status()
        except (requests.RequestException, ValueError, KeyError):
            return False
        return (len(shards) == self.groups and all(len(p) == self.replicas_per_group for p in shards.values())
                and not gone & {p for ps in shards.values() for p in ps}
                and len(ingress) == self.ingress_replicas and not gone & set(ingress))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores; /proc/stat)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def phase(url: str, clients: int, seconds: float, a, vocab: int, hammer: bool = False) -> dict:
    load = LoadGen(url, clients, a.prompt_len, a.max_tokens, vocab, seed=clients, hammer=hammer, timeout_s=120)
    cpu0, own0 = machine_cpu_s(), time.process_time()
    t0 = time.monotonic()
    wall = load.run(seconds)
    cpu, own = machine_cpu_s() - cpu0, time.process_time() - own0
    # the steady window: after the clients' first requests have cycled, before they stop sending
    # (the drain that follows, requests in flight finishing with nobody sending more, runs ever
    # smaller batches and lasts as long as a request's latency, longer the more clients wait)
    skip = min(STEADY_SKIP_S, seconds / 4)
    steady = summarize(load.records, seconds - skip, since=t0 + skip, until=t0 + seconds)
    s = summarize(load.records, wall)  # every request's outcome and latency, the drain's too
    # the clients run on the same cores as the app: their share says what the server had left
    s.update(goodput_rps=steady["goodput_rps"], whole_run_goodput_rps=s["goodput_rps"],
             drain_s=round(wall - seconds, 2), clients=clients, hammer=hammer, machine_cpu_per_s=round(cpu / wall, 2),
             client_cpu_per_s=round(own / wall, 2))
    print(f"  {clients:4d} clients{' (hammer)' if hammer else ''}: goodput {s['goodput_rps']:.1f} req/s "
          f"(whole run {s['whole_run_goodput_rps']:.1f}, drain {s['drain_s']:.1f} s), "
          f"{s['ok']} answered, {s['refused']} refused, {s['failed']} failed, latency p50/p99 "
          f"{s['latency_s']['p50']:.2f}/{s['latency_s']['p99']:.2f} s; CPU busy {s['machine_cpu_per_s']:.2f} "
          f"cores, of which the clients {s['client_cpu_per_s']:.2f}", flush=True)
    return s


def overload(url: str, a) -> dict:
    vocab = int(model_info(url).get("vocab_size", 256))
    phase(url, 4, min(5.0, a.phase_s), a, vocab)  # warm-up, not reported
    print("knee search:", flush=True)
    levels = [phase(url, c, a.phase_s, a, vocab) for c in (int(x) for x in a.levels.split(","))]
    best = max(s["goodput_rps"] for s in levels)
    knee = next(s for s in levels if s["goodput_rps"] >= 0.95 * best)
    over = max(knee["clients"] + 1, int(round(a.overload * knee["clients"])))
    print(f"knee: {knee['clients']} clients ({knee['goodput_rps']:.1f} req/s); overload: {over} clients", flush=True)
    runs = {}
    for label, clients in (("overload", over), ("shed", a.shed_clients)):
        runs[label] = {"honour": phase(url, clients, a.phase_s, a, vocab),
                       "hammer": phase(url, clients, a.phase_s, a, vocab, hammer=True)}
    def ratio(label: str) -> float:
        return round(min(s["goodput_rps"] for s in runs[label].values()) / knee["goodput_rps"], 3)
    return {"levels": levels, "knee": knee, **runs,
            "overload_goodput_ratio": ratio("overload"), "shed_goodput_ratio": ratio("shed"),
            "failed": sum(s["failed"] for s in levels) + sum(s["failed"] for r in runs.values() for s in r.values())}


def spare_pids(app) -> set[int]:
    """The warm spare workers the app keeps (pids on every node)."""
    return {p for n in app.status().get("spares", {}).get("nodes", {}).values() for p in n["spares"]}


def wait_spares(app, want: int, timeout_s: float = 180.0) -> float | None:
    """Until every node hosting shard replicas has its `want` warm spares (the app's steady
    state, which a fault then disturbs); seconds it took, None if they did not come."""
    t0 = time.monotonic()
    while want and time.monotonic() - t0 < timeout_s:
        try:
            nodes = app.status().get("spares", {}).get("nodes", {})
        except (requests.RequestException, ValueError):
            nodes = {}
        if nodes and all(len(n["spares"]) >= want and not n["starting"] for n in nodes.values()):
            return round(time.monotonic() - t0, 1)
        time.sleep(1)
    return None


def app_pids(app) -> set[int]:
    """Every replica process of the app: shard replicas on the channel, ingress replicas."""
    if not isinstance(app, StandaloneApp):
        return set()
    try:
        return {p for ps in app.shard_pids().values() for p in ps} | set(app.ingress_pids())
    except (requests.RequestException, ValueError, KeyError):
        return set()


def fault_run(app: StandaloneApp, label: str, inject, a, vocab: int) -> dict:
    """Steady load, `inject()` (returns the victim pids and, for a stall, when the app may be
    whole again), load until the app is whole and --settle-s more; the figures of each window."""
    spares_after_s = wait_spares(app, getattr(app, "warm_spares", 1))
    spares = spare_pids(app)
    before = app_pids(app)
    load = LoadGen(app.url, a.fault_clients, a.prompt_len, a.max_tokens, vocab, seed=7, timeout_s=120).start()
    started = time.monotonic()
    time.sleep(a.steady_s)
    t_fault = time.monotonic()
    victims, not_before, *detail = inject()
    recovered = None
    while time.monotonic() - t_fault < a.recovery_timeout_s:
        if time.monotonic() >= not_before and app.whole(set(victims)):
            recovered = time.monotonic()
            break
        time.sleep(0.25)
    started_in = sorted((app_pids(app) - before) & spares) if recovered else []  # replacements in warm spares
    time.sleep(a.settle_s)
    end = time.monotonic()
    load.stop()
    wall = time.monotonic() - started
    steady = summarize(load.records, t_fault - started - 2.0, since=started + 2.0, until=t_fault)
    during = summarize(load.records, (recovered or end) - t_fault, since=t_fault, until=recovered or end)
    # latency of the requests the fault touched: in flight at some point between fault and recovery
    touched = [r for r in load.records if r.end >= t_fault and r.start < (recovered or end)]
    during["latency_s"] = percentiles([r.end - r.start for r in touched if r.ok])
    after = summarize(load.records, end - (recovered or end), since=recovered or end)
    total = summarize(load.records, wall)
    longest = max((r.end - r.start for r in load.records), default=0.0)
    out = {"fault": label, "victims": victims, "recovery_s": round(recovered - t_fault, 2) if recovered else None,
           "failed": total["failed"], "refused": total["refused"], "answered": total["ok"],
           "errors": total["errors"], "longest_request_s": round(longest, 2),
           "steady_p99_s": steady["latency_s"]["p99"], "fault_p99_s": during["latency_s"]["p99"],
           "steady_goodput_rps": steady["goodput_rps"], "fault_goodput_rps": during["goodput_rps"],
           "after_goodput_rps": after["goodput_rps"], "ingress_replicas": app.ingress_replicas,
           "replicas_per_group": app.replicas_per_group, "spares_ready_after_s": spares_after_s,
           "spares": sorted(spares), "replacements_in_spares": started_in, **(detail[0] if detail else {})}
    rec = f"{out['recovery_s']:.1f} s" if recovered else f"not within {a.recovery_timeout_s:g} s"
    print(f"  {label}: {out['failed']} failed, {out['refused']} refused, {out['answered']} answered; p99 "
          f"{out['steady_p99_s']:.2f} s steady, {out['fault_p99_s']:.2f} s during; longest request "
          f"{longest:.1f} s; recovered in {rec}"
          f"{'; the replacement started in a warm spare' if started_in else ''}", flush=True)
    return out


def _moectl(app: StandaloneApp, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([MOECTL, *args], env=app.env, capture_output=True, text=True, timeout=timeout_s)


def _versions(app: StandaloneApp, eid: str) -> list[str]:
    """The digest of `eid` on every shard replica hosting it."""
    return sorted(r["versions"][eid]["digest"] for r in app.status()["replicas"] if eid in r.get("versions", {}))


def swap_corrupt(app: StandaloneApp, work: Path, eid: str = "1.0"):
    """A hot-swap of `eid` to a file cut in the middle of its tensors: refused on every replica,
    the old version serving throughout; then the rollback that clears the override."""
    from chaos_k8s import write_expert_file

    bad = write_expert_file(work / "models" / "mixtral-tiny", work / "weights" / f"expert-{eid}-corrupt.safetensors")
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    before = _versions(app, eid)
    swap = _moectl(app, "hot-swap", app.name, "--local", "--expert", eid, "--weights", str(bad), "--wait",
                   "--timeout", "120")
    after = _versions(app, eid)
    verdict = (swap.stderr.strip() or swap.stdout.strip()).splitlines()[-1:] or [""]
    back = _moectl(app, "hot-swap", app.name, "--local", "--expert", eid, "--rollback", "--wait", "--timeout", "120")
    if swap.returncode == 0 or after != before or back.returncode != 0:
        raise SystemExit(f"the corrupt hot-swap was not refused cleanly: rc {swap.returncode}, {verdict[0]}; "
                         f"digests {before} -> {after}; rollback rc {back.returncode}: {back.stderr.strip()}")
    return [], 0.0, {"operation": verdict[0][:300], "old_version_kept": after == before}


def ask_rebalance(app: StandaloneApp):
    """`moectl rebalance --local --wait`: what the planner decided, once it serves."""
    done = _moectl(app, "rebalance", app.name, "--local", "--wait", "--timeout", "240")
    line = (done.stdout.strip() or done.stderr.strip()).splitlines()[-1:] or [""]
    if done.returncode != 0:
        raise SystemExit(f"moectl rebalance failed ({done.returncode}): {done.stderr.strip()}")
    return [], 0.0, {"operation": line[0][:300], "rebalanced": line[0].startswith("rebalanced")}


def faults(work: Path, a) -> list[dict]:
    """Each fault on an app with one replica of everything, and on one with two."""
    runs = []
    wanted = set(a.faults.split(",")) if a.faults else None

    def run(label: str, inject) -> None:
        if wanted is None or label in wanted:
            runs.append(fault_run(app, label, inject, a, vocab))

    for ingress_replicas, per_group in ((1, 1), (2, 2)):
        suffix = "1-replica" if per_group == 1 else f"{per_group}-replicas"
        if wanted is not None and not any(w.endswith(suffix) for w in wanted):
            continue
        app = StandaloneApp(work, a.fault_num_cpus, ingress_replicas, per_group)
        try:
            app.wait_serving()
            deadline = time.monotonic() + 120
            while not app.whole(set()):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the app with {ingress_replicas} ingress and {per_group} replicas per group "
                                     f"never had all its replicas: {app.shard_pids()}, ingress {app.ingress_pids()}")
                time.sleep(1)
            vocab = int(model_info(app.url).get("vocab_size", 256))
            print(f"faults with {ingress_replicas} ingress replica(s), {per_group} replica(s) per shard group:",
                  flush=True)
            LoadGen(app.url, 2, a.prompt_len, a.max_tokens, vocab).run(3.0)  # warm-up, not reported

            def first_shard_pid() -> int:  # the first replica of the first group
                return sorted(app.shard_pids().items())[0][1][0]

            def kill(pid: int):
                os.kill(pid, signal.SIGKILL)
                return [pid], 0.0

            def stall_shard():
                pid = first_shard_pid()
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(a.stall_s, os.kill, (pid, signal.SIGCONT)).start()
                return [], time.monotonic() + a.stall_s  # the same process comes back

            run(f"shard-kill-{suffix}", lambda: kill(first_shard_pid()))
            run(f"ingress-kill-{suffix}", lambda: kill(app.ingress_pids()[0]))
            if per_group > 1:
                run(f"shard-stall-{suffix}", stall_shard)
            run(f"hotswap-corrupt-{suffix}", lambda: swap_corrupt(app, work))
            run(f"rebalance-{suffix}", lambda: ask_rebalance(app))
        finally:
            app.stop()
    return runs


def kubernetes_faults(work: Path, a) -> list[dict]:
    from chaos_k8s import KubernetesApp

    app = KubernetesApp(work, a.fault_num_cpus, MOECTL)
    try:
        app.wait_serving()
        vocab = int(model_info(app.url).get("vocab_size", 256))
        print(f"MoEDeployment {app.name} Ready at {app.url} (operator and Ray local, apiserver {app.cp['MOE_TESTENV_SERVER']})",
              flush=True)
        LoadGen(app.url, 2, a.prompt_len, a.max_tokens, vocab).run(3.0)  # warm-up, not reported
        return [fault_run(app, "operator-kill-mid-reconcile", app.kill_operator_mid_reconcile, a, vocab),
                fault_run(app, f"apiserver-down-{a.apiserver_down_s:g}s", lambda: app.stop_apiserver(a.apiserver_down_s),
                          a, vocab)]
    finally:
        app.stop()


def fault_line(f: dict) -> str:
    """One fault run's figures on a line (with what the operation reported, if any)."""
    return (f"{f['fault']}: failed {f['failed']}, refused {f['refused']}, recovery-s {f['recovery_s']}, "
            f"p99 {f['steady_p99_s']} -> {f['fault_p99_s']} s, longest {f['longest_request_s']} s"
            + (f"; {f['operation']}" if f.get("operation") else ""))


def main() -> int:
    a = parse_args()
    if a.quick:
        a.phase_s, a.steady_s, a.stall_s = 10.0, 8.0, 10.0
    work = scratch("moe-bench-chaos-")
    result = {"phase_s": a.phase_s, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens}
    if a.kubernetes:
        a.only = "kubernetes"
        result["kubernetes"] = kubernetes_faults(work, a)
    if a.only in (None, "overload"):
        app = StandaloneApp(work, a.num_cpus)
        try:
            app.wait_serving()
            print(f"quickstart app serving at {app.url} (moectl up, local Ray head with {a.num_cpus} CPUs); "
                  f"its warm spares ready after {wait_spares(app, app.warm_spares)} s", flush=True)
            result["overload"] = overload(app.url, a)
        finally:
            app.stop()
    if a.only in (None, "faults"):
        result["faults"] = faults(work, a)
    out = Path(a.out)
    if out.exists():  # one part run alone keeps the other part's last figures, some faults the others'
        last = json.loads(out.read_text())
        if a.faults and "faults" in result:
            ran = {f["fault"] for f in result["faults"]}
            result["faults"] = [f for f in last.get("faults", []) if f["fault"] not in ran] + result["faults"]
        result = {**last, **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if "overload" in result and a.only in (None, "overload"):
        o = result["overload"]
        print(f"overload-goodput-ratio: {o['overload_goodput_ratio']}")
        print(f"shed-goodput-ratio: {o.get('shed_goodput_ratio')}")
        print(f"knee-clients: {o['knee']['clients']}")
        print(f"knee-goodput-rps: {o['knee']['goodput_rps']}")
        for label in ("overload", "shed"):
            for mode in ("honour", "hammer"):
                r = o[label][mode]
                print(f"{label}-{mode}-goodput-rps: {r['goodput_rps']} ({r['clients']} clients, {r['refused']} refused)")
        print(f"overload-failed-requests: {o['failed']}")
    if "faults" in result and a.only in (None, "faults"):
        fs = result["faults"]
        replica_faults = [f for f in fs if "kill" in f["fault"] or "stall" in f["fault"]]
        redundant = [f for f in replica_faults if f["replicas_per_group"] > 1]
        kills = [f for f in fs if "kill" in f["fault"]]
        operations = [f for f in fs if f["fault"].startswith(("hotswap", "rebalance"))]
        for f in fs:
            print(fault_line(f))
        print(f"failed-requests-with-redundancy: {sum(f['failed'] for f in redundant)}")
        print(f"refused-requests-with-redundancy: {sum(f['refused'] for f in redundant)}")
        if kills:
            print(f"worst-recovery-s: {max((f['recovery_s'] or float('inf')) for f in kills)}")
        print(f"longest-request-s: {max(f['longest_request_s'] for f in fs)}")
        stalls = [f for f in fs if "stall" in f["fault"]]
        if stalls:
            print(f"stall-p99-s: {max(f['fault_p99_s'] for f in stalls)} (steady {max(f['steady_p99_s'] for f in stalls)})")
        if operations:
            print(f"failed-requests-during-operations: {sum(f['failed'] for f in operations)}")
    if "kubernetes" in result and a.kubernetes:
        ks = result["kubernetes"]
        for f in ks:
            print(fault_line(f))
        print(f"control-plane-failed-requests: {sum(f['failed'] for f in ks)}")
        print(f"control-plane-worst-recovery-s: {max((f['recovery_s'] or float('inf')) for f in ks)}")
        print(f"redeployed-during-apiserver-outage: {any(f.get('redeployed_during_outage') for f in ks)}")
        for f in ks:
            if f.get("change_after_s") is not None and f["recovery_s"] is not None:
                print(f"converged-after-apiserver-back-s: {f['recovery_s'] - f['change_after_s']:.2f} "
                      f"(a change made once it answered)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
