"""Overload: goodput past the knee against goodput at the knee, on the quickstart app under
`moectl up`, side by side in one run. Ends with `figure: value` lines.

    python bench/chaos.py                  # the quickstart shape and limits
    python bench/chaos.py --quick          # shorter phases

1. The knee: closed-loop clients (`moectl bench`'s load generator) at rising concurrency, each
   level for --phase-s; the knee is the lowest concurrency whose goodput (answered requests per
   second) is within 5% of the best level's.
2. Overload at --overload x the knee, and at --shed-clients (default 160, more than the app
   admits: batch 32 + wait queue 64 + 8 in each replica, 32 in the proxy), each twice: clients
   that honour the `Retry-After` of a 503, and clients that resend at once (`--hammer`).
   `overload-goodput-ratio` = the worst of these goodputs / the knee's; refused requests (503)
   are counted apart from failures (other errors, which must be 0).

The app is the quickstart's (examples/standalone/quickstart.yaml: a random tiny Mixtral, 2 shard
groups, maxBatchSize 32, maxQueuedRequests 64), so past batch + headroom + queue the Serve proxy
refuses with 503 before a replica sees the request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator")]

import yaml  # noqa: E402

from moe_operator.loadgen import LoadGen, model_info, summarize  # noqa: E402

MOECTL = str(Path(sys.executable).with_name("moectl"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 s phases")
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds of load per phase")
    p.add_argument("--levels", default="8,16,32,64", help="concurrency levels searched for the knee")
    p.add_argument("--overload", type=float, default=2.5, help="overload concurrency as a multiple of the knee")
    p.add_argument("--shed-clients", type=int, default=160, help="clients past what the app admits")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray head")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"))
    return p.parse_args()


class StandaloneApp:
    """The quickstart manifest under `moectl up` on a fresh local Ray head, in its own state dir."""

    def __init__(self, work: Path, num_cpus: int):
        from moe_operator.standalone.local_ray import free_port

        self.work, self.port = work, free_port()
        self.env = {**os.environ, "MOE_STATE_DIR": str(work / "state")}
        subprocess.run([MOECTL, "init-model", str(work / "models" / "mixtral-tiny")], env=self.env, check=True,
                       capture_output=True)
        manifest = yaml.safe_load((REPO / "examples" / "standalone" / "quickstart.yaml").read_text())
        manifest["spec"]["experts"]["tiers"]["cold"]["path"] = str(work / "models" / ".expert-cache")
        (work / "app.yaml").write_text(yaml.safe_dump(manifest))
        self.log = work / "up.log"
        self.proc = subprocess.Popen([MOECTL, "up", "-f", str(work / "app.yaml"), "--port", str(self.port),
                                      "--num-cpus", str(num_cpus)], env=self.env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_serving(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while "is serving at" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"moectl up did not serve:\n{self.log.read_text()}")
            time.sleep(1)

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
    wall = load.run(seconds)
    cpu, own = machine_cpu_s() - cpu0, time.process_time() - own0
    s = summarize(load.records, wall)
    # the clients run on the same cores as the app: their share says what the server had left
    s.update(clients=clients, hammer=hammer, machine_cpu_per_s=round(cpu / wall, 2),
             client_cpu_per_s=round(own / wall, 2))
    print(f"  {clients:4d} clients{' (hammer)' if hammer else ''}: goodput {s['goodput_rps']:.1f} req/s, "
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
    worst = min(s["goodput_rps"] for r in runs.values() for s in r.values())
    return {"levels": levels, "knee": knee, **runs,
            "overload_goodput_ratio": round(worst / knee["goodput_rps"], 3),
            "failed": sum(s["failed"] for s in levels) + sum(s["failed"] for r in runs.values() for s in r.values())}


def main() -> int:
    a = parse_args()
    if a.quick:
        a.phase_s = 10.0
    work = Path(tempfile.mkdtemp(prefix="moe-bench-chaos-"))
    app = StandaloneApp(work, a.num_cpus)
    try:
        app.wait_serving()
        print(f"quickstart app serving at {app.url} (moectl up, local Ray head with {a.num_cpus} CPUs)", flush=True)
        result = {"overload": overload(app.url, a), "phase_s": a.phase_s, "prompt_len": a.prompt_len,
                  "max_tokens": a.max_tokens}
    finally:
        app.stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    o = result["overload"]
    print(f"overload-goodput-ratio: {o['overload_goodput_ratio']}")
    print(f"knee-clients: {o['knee']['clients']}")
    print(f"knee-goodput-rps: {o['knee']['goodput_rps']}")
    for label in ("overload", "shed"):
        for mode in ("honour", "hammer"):
            r = o[label][mode]
            print(f"{label}-{mode}-goodput-rps: {r['goodput_rps']} ({r['clients']} clients, {r['refused']} refused)")
    print(f"overload-failed-requests: {o['failed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
