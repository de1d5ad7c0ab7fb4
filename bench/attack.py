"""A routing attack replayed against `moectl up`: a tenant's crafted prompts drive one rarely used
expert's load up; the time to detect it and to contain it (spec.routing.autoQuarantine), and the
other tenant's request latency before, during and after.

    python bench/attack.py            # hidden 1024, intermediate 3584, 8 experts, top-2, 4 layers, 2 groups
    python bench/attack.py --quick    # hidden 256, 2 layers

The attack is found as an attacker with the weights would find it (random weights here): in
process, the expert of the first MoE layer that plain traffic uses least is the target; every
vocabulary token is scored by the share of its layer-0 choices that go to the target when the
prompt is that token repeated, and the attack prompts are random strings of the best-scoring
tokens (the bench prints the share they reach in process against the target's baseline).

Served: `moectl up` on a local Ray with two API keys (tenant "normal", tenant "attacker") and
autoQuarantine on, the detector at its defaults. The normal tenant sends short prompts from 2
closed-loop clients throughout; after --before-s the attacker adds 2 closed-loop clients of
attack prompts until the end. Marks, in seconds from the first attack request, read from the
app's /moe/v1/status every 0.25 s: the detector names the target (`detect-s`), its router leaves
it out (`contain-s`). The normal tenant's p50 / p99 request latency is reported before the
attack, between its start and containment, and after containment (--after-s, the attack going
on); the RoutingAnomaly condition and its key are read from `moectl get`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import torch
import yaml

from figures import report, scratch
from serving import REPO, ensure_checkpoint, model_shape, prompts, wait_until_serving


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    p.add_argument("--before-s", type=float, default=30.0, help="normal traffic alone (the detector's baseline)")
    p.add_argument("--after-s", type=float, default=20.0, help="after containment, the attack going on")
    p.add_argument("--attack-timeout-s", type=float, default=120.0)
    p.add_argument("--candidates", type=int, default=2048, help="vocabulary tokens scored (the first N)")
    p.add_argument("--cache-dir", default=str(Path("/tmp/moe-bench")))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "attack.json"))
    return p.parse_args()


def layer_shares(model, layer: int, batch: list[list[int]]) -> torch.Tensor:
    """Each prompt's share of its `layer` choices per expert, (prompts, experts): the prompts run
    through the in-process model together, the layer's routing recorded on the way."""
    from moe_workers.model.dense import Chunk

    seen = {}
    moe = model.experts.moe

    def recording(l, x, indices, weights):
        if l == layer:
            seen["indices"] = indices.clone()
        return moe(l, x, indices, weights)

    model.experts.moe = recording
    slots = [model.cache.allocate() for _ in batch]
    try:
        model.step([Chunk(s, 0, list(p)) for s, p in zip(slots, batch)])
    finally:
        model.experts.moe = moe
        for s in slots:
            model.cache.release(s)
    indices, e = seen["indices"], model.cfg.num_experts
    out, row = [], 0
    for p in batch:
        picks = indices[row:row + len(p)].reshape(-1)
        out.append(torch.bincount(picks, minlength=e).double() / picks.numel())
        row += len(p)
    return torch.stack(out)


def find_attack(path: Path, candidates: int, seed: int = 0) -> dict:
    """The target (first MoE layer's least used expert under plain prompts) and attack prompts
    that send it most of that layer's choices."""
    from moe_workers.model.inprocess import InProcessModel

    model = InProcessModel(path, max_len=128, max_sequences=64)
    layer = model.cfg.sparse_layers[0]
    vocab = model.cfg.vocab_size
    plain = prompts(32, 32, vocab, 11)
    base = layer_shares(model, layer, plain).mean(0)
    target = int(base.argmin())
    scores = []
    for start in range(0, min(candidates, vocab), 64):
        toks = list(range(start, min(start + 64, candidates, vocab)))
        scores += list(zip(layer_shares(model, layer, [[t] * 16 for t in toks])[:, target].tolist(), toks))
    best = [t for _, t in sorted(scores, reverse=True)[:16]]
    rng = random.Random(seed)
    attack = [[rng.choice(best) for _ in range(64)] for _ in range(16)]
    reached = float(layer_shares(model, layer, attack)[:, target].mean())
    return {"layer": layer, "expert": target, "expert_id": f"{layer}.{target}", "baseline_share": float(base[target]),
            "attack_share": reached, "tokens": best, "prompts": attack}


def key_id(key: str) -> str:
    """The short id the Ingress names a key by (moe_workers.serve.auth.key_id)."""
    from moe_workers.serve.auth import key_id as short

    return short(f"Bearer {key}")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    a = parse_args()
    shape = model_shape(a.quick)
    path = ensure_checkpoint(a.cache_dir, shape)
    attack = find_attack(path, a.candidates)
    print(f"target {attack['expert_id']}: baseline share {attack['baseline_share']:.3f} of layer "
          f"{attack['layer']}'s choices; the attack prompts send it {attack['attack_share']:.3f} in process", flush=True)

    from moe_operator.standalone.local_ray import free_port

    moectl = str(Path(sys.executable).with_name("moectl"))
    work = scratch("moe-bench-attack-")
    env = {**os.environ, "MOE_STATE_DIR": str(work / "state")}
    keys = {"normal": "normal-tenant-key", "attacker": "attacker-tenant-key"}
    (work / "keys").write_text("\n".join(keys.values()) + "\n")
    os.symlink(path, work / "model")
    manifest = {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "attacked"},
                "spec": {"model": {"path": "model"}, "ingress": {"numCpus": 0.5},
                         "experts": {"groups": 2, "numCpus": 0.25,
                                     "tiers": {"hot": {"budget": "1Gi"}, "warm": {"budget": "1Gi"}}},
                         "routing": {"autoQuarantine": True}}}
    (work / "attacked.yaml").write_text(yaml.safe_dump(manifest))
    port = free_port()
    log = open(work / "up.log", "w+")
    proc = subprocess.Popen([moectl, "up", "-f", str(work / "attacked.yaml"), "--port", str(port), "--num-cpus", "4",
                             "--api-key-file", str(work / "keys"), "--allowed-root", str(path.parent),
                             "--allowed-root", str(work)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    latencies: list[tuple[float, float]] = []  # (end time, seconds) of the normal tenant's requests
    failed = {"normal": 0, "attacker": 0}
    vocab = shape["vocab_size"]

    def client(tenant: str, i: int) -> None:
        rng = random.Random(i)
        headers = {"Authorization": f"Bearer {keys[tenant]}"}
        while not stop.is_set():
            if tenant == "normal":
                body = {"prompt": [rng.randrange(3, vocab) for _ in range(16)], "max_tokens": 8}
            else:
                body = {"prompt": rng.choice(attack["prompts"]), "max_tokens": 2}
            t0 = time.monotonic()
            try:
                r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
                ok = r.status_code == 200
            except requests.RequestException:
                ok = False
            if not ok:
                failed[tenant] += 1
            elif tenant == "normal":
                latencies.append((time.monotonic(), time.monotonic() - t0))

    def app_status() -> dict:
        try:
            return requests.get(url + "/moe/v1/status", timeout=10).json()
        except (requests.RequestException, ValueError):
            return {}

    marks: dict[str, float] = {}
    try:
        wait_until_serving(proc, work / "up.log")
        threads = [threading.Thread(target=client, args=("normal", i), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        start = time.monotonic()
        time.sleep(a.before_s)
        onset = time.monotonic()
        attackers = [threading.Thread(target=client, args=("attacker", 100 + i), daemon=True) for i in range(2)]
        for t in attackers:
            t.start()
        last_print = 0.0
        while time.monotonic() - onset < a.attack_timeout_s and "contained" not in marks:
            routing = app_status().get("routing") or {}
            now = time.monotonic()
            if now - last_print >= 5:  # what the detector sees of the target, every window
                load = (routing.get("load") or {}).get(str(attack["layer"])) or {}
                share, base = (load.get("share") or [None] * 99), (load.get("baseline") or [None] * 99)
                print(f"{now - onset:5.1f} s: target share {share[attack['expert']]} baseline {base[attack['expert']]}; "
                      f"detector {routing.get('detector')}; anomalies {routing.get('anomalies')}; failed {failed}",
                      flush=True)
                last_print = now
            for found in routing.get("anomalies") or []:
                if (found.get("layer"), found.get("expert")) == (attack["layer"], attack["expert"]):
                    marks.setdefault("detected", now)
                    marks.setdefault("key", found.get("key"))
            if attack["expert_id"] in (routing.get("quarantined") or []):
                marks["contained"] = now
            time.sleep(0.25)
        if "contained" in marks:
            time.sleep(a.after_s)
        end = time.monotonic()
        stop.set()
        for t in threads + attackers:
            t.join(timeout=120)
        got = subprocess.run([moectl, "get", "attacked", "--local", "-o", "json"], env=env, capture_output=True,
                             text=True, timeout=60)
        status = json.loads(got.stdout)["status"] if got.returncode == 0 else {}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    if "contained" not in marks:
        print((work / "up.log").read_text()[-4000:])
        raise RuntimeError(f"not contained within {a.attack_timeout_s} s: {marks}; log {work / 'up.log'}")
    contained = marks["contained"]
    phases = {"before": [s for t, s in latencies if start + 5 <= t < onset],
              "during": [s for t, s in latencies if onset <= t < contained],
              "after": [s for t, s in latencies if contained <= t <= end]}
    condition = next((c for c in status.get("conditions") or [] if c.get("type") == "RoutingAnomaly"), {})
    figures = {"detect-s": marks["detected"] - onset, "contain-s": contained - onset,
               "attributed-to-attacker": float(marks.get("key") == key_id(keys["attacker"]))}
    for phase, values in phases.items():
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            v = percentile(values, q)
            if v is not None:
                figures[f"normal-{name}-{phase}-s"] = v
    if "normal-p99-before-s" in figures and "normal-p99-after-s" in figures:
        figures["normal-p99-after-over-before"] = figures["normal-p99-after-s"] / figures["normal-p99-before-s"]
    print(f"\ndetected {figures['detect-s']:.1f} s, contained {figures['contain-s']:.1f} s after the first attack "
          f"request; key named {marks.get('key')} (attacker {key_id(keys['attacker'])}); requests per phase "
          f"{ {k: len(v) for k, v in phases.items()} }, failed {failed}; RoutingAnomaly: "
          f"{condition.get('status')} {condition.get('reason')} {condition.get('message')!r}")
    return report(a.out, {"shape": {k: v for k, v in shape.items() if k != "max_position_embeddings"},
                          "attack": {k: v for k, v in attack.items() if k != "prompts"},
                          "requests": {k: len(v) for k, v in phases.items()}, "failed": failed,
                          "condition": condition, "auto_quarantined": status.get("autoQuarantined")}, figures)


if __name__ == "__main__":
    raise SystemExit(main())
