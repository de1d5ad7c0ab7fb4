"""What `moectl profile` shows: a step's time by phase over a window, from two reads of an app's
/moe/v1/status (pure functions, no I/O; unit-tested without a cluster).

The Ingress reports its step's phases as cumulative seconds (`moe_workers.step_profile`), the
shard replicas their compute and promotion waits as cumulative seconds and each expert's p95
from sampled calls (`serve.expert_health`). `profile_diff` turns two reports into the window's
mean a step; `profile_tree` draws it. A group's compute is summed over its replicas and over a
step's layers, for the steps of every Ingress replica: with one Ingress replica it is this
step's; with more, the shards' share that another Ingress' steps caused is in it too.
"""

from __future__ import annotations

from rich.tree import Tree

from moe_workers.step_profile import PHASES, per_step

SLOWEST = 3  # experts named per group, slowest p95 first
OTHER = "other"  # the step's time outside the phases: scheduling, residual adds, the hand-off of tokens


def profile_diff(before: dict, after: dict, seconds: float | None = None) -> dict:
    """The window between two status reports: {"steps", "tokens_per_step", "step_ms",
    "phases": [{"name", "ms", "share", "parts": [...]}] (a step's mean, `OTHER` last),
    "groups": [{"group", "replicas", "compute_ms", "promotion_wait_ms", "slowest": [{"expert",
    "p95_ms", "samples"}]}]} (pure). ValueError when no step ran in the window."""
    b_prof = ((before.get("ingress") or {}).get("profile")) or {}
    a_prof = ((after.get("ingress") or {}).get("profile")) or {}
    steps, means = per_step(b_prof, a_prof)
    if steps == 0:
        raise ValueError("no step ran in the window: send some requests (moectl bench) or widen --seconds")
    restarted = a_prof.get("steps", 0) < b_prof.get("steps", 0)
    was = {} if restarted else b_prof
    step_s = max(0.0, a_prof.get("step_s", 0.0) - was.get("step_s", 0.0)) / steps
    tokens = (a_prof.get("tokens", 0) - was.get("tokens", 0)) / steps
    total = step_s or sum(v for k, v in means.items() if "." not in k) or 1e-12
    phases = []
    for name in [p for p in PHASES if p in means] + [p for p in means if p not in PHASES and "." not in p]:
        parts = [_phase(k.split(".", 1)[1], means[k], total) for k in means if k.startswith(name + ".")]
        phases.append({**_phase(name, means[name], total), "parts": parts})
    other = step_s - sum(p["ms"] for p in phases) / 1e3
    if step_s and other > 0:
        phases.append({**_phase(OTHER, other, total), "parts": []})
    return {"seconds": seconds, "steps": steps, "tokens_per_step": round(tokens, 2),
            "step_ms": round(step_s * 1e3, 4), "phases": phases, "groups": group_rows(before, after, steps)}


def _phase(name: str, seconds: float, total: float) -> dict:
    return {"name": name, "ms": round(seconds * 1e3, 4), "share": round(seconds / total, 4)}


def group_rows(before: dict, after: dict, steps: int) -> list[dict]:
    """Per shard group: its compute and its calls' waits for promotions, a step's mean over the
    window (summed over the group's replicas), and its slowest experts by sampled p95 (pure)."""
    was = {r.get("replica"): r for r in before.get("replicas") or []}
    groups: dict[str, dict] = {}
    for r in after.get("replicas") or []:
        if not r.get("group"):
            continue
        prev = was.get(r.get("replica"), {})
        g = groups.setdefault(r["group"], {"group": r["group"], "replicas": 0, "compute_s": 0.0, "wait_s": 0.0,
                                           "experts": {}})
        g["replicas"] += 1
        g["compute_s"] += _delta(prev.get("compute_s"), r.get("compute_s"))
        g["wait_s"] += _delta((prev.get("store") or {}).get("promotion_wait_s"),
                              (r.get("store") or {}).get("promotion_wait_s"))
        for eid, h in (r.get("health") or {}).items():
            if h.get("p95_ms") is not None:
                best = g["experts"].get(eid)
                if best is None or h["p95_ms"] > best["p95_ms"]:
                    g["experts"][eid] = {"expert": eid, "p95_ms": h["p95_ms"], "samples": h.get("samples", 0)}
    out = []
    for name in sorted(groups, key=_group_order):
        g = groups[name]
        slowest = sorted(g["experts"].values(), key=lambda e: -e["p95_ms"])[:SLOWEST]
        out.append({"group": name, "replicas": g["replicas"], "compute_ms": round(g["compute_s"] / steps * 1e3, 4),
                    "promotion_wait_ms": round(g["wait_s"] / steps * 1e3, 4), "slowest": slowest})
    return out


def _delta(before, after) -> float:
    """A cumulative counter's increase; a counter that went back (a restarted replica) from 0."""
    a, b = float(after or 0.0), float(before or 0.0)
    return a - b if a >= b else a


def _group_order(name: str) -> tuple:
    tail = name.rsplit("-", 1)[-1]
    return (0, int(tail), name) if tail.isdigit() else (1, 0, name)


def _line(label: str, ms: float, share: float | None, width: int = 22) -> str:
    pct = f"{100 * share:4.0f}%" if share is not None else ""
    return f"{label:<{width}} {ms:8.3f} ms  {pct}"


def profile_tree(diff: dict, title: str = "step") -> Tree:
    """`profile_diff`'s window as a tree: the step, its phases with ms a step and their share of
    the step, the exchange's parts, and under its wait each group's compute, promotion waits
    and slowest experts (pure)."""
    about = (f"{diff['steps']} steps, {diff['tokens_per_step']:g} tokens a step"
             + (f", over {diff['seconds']:g} s" if diff.get("seconds") else ""))
    tree = Tree(f"[bold]{_line(title, diff['step_ms'], 1.0, 26)}[/]  ({about})")  # (the columns line up)
    for phase in diff["phases"]:
        node = tree.add(_line(phase["name"], phase["ms"], phase["share"]))
        for part in phase["parts"]:
            sub = node.add(_line(part["name"], part["ms"], part["share"], 18))
            if phase["name"] == "exchange" and part["name"] == "wait":
                for g in diff["groups"]:
                    sub.add(group_line(g))
    return tree


def group_line(g: dict) -> str:
    """One group under the exchange's wait: 'ExpertShard-0 compute 0.900 ms (slowest: 3.5 0.31 ms, ...)'."""
    text = f"{g['group']} compute {g['compute_ms']:.3f} ms"
    if g["promotion_wait_ms"]:
        text += f", waited for promotions {g['promotion_wait_ms']:.3f} ms"
    if g["replicas"] > 1:
        text += f" ({g['replicas']} replicas)"
    if g["slowest"]:
        text += " (slowest p95: " + ", ".join(f"{e['expert']} {e['p95_ms']:.3f} ms" for e in g["slowest"]) + ")"
    return text
