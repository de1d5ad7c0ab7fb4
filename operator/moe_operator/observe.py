"""The live app's per-replica report (GET {endpoint}/moe/v1/status) -> the MoEDeployment status
fields that summarise it (pure): tier residency, overridden experts, the Ingress' KV cache, and the hot-swaps as the
spec asked for them (Serving on every replica hosting the expert, Failed with the replica's
reason, or Pending). Status stays small: aggregates only; details come from moectl."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from moe_operator.api import conditions as cond
from moe_operator.api.models import KVCacheStatus, MoEDeploymentSpec, TierSummary

MAX_SWAPS = 20
MAX_ANOMALIES, ANOMALIES_NAMED = 20, 3  # alerts kept in status; named in the condition's message
CHECKPOINT = "checkpoint"


def fetch_app_status(base_url: str, timeout_s: float = 5.0) -> dict | None:
    """The app's report, or None when it cannot be read now (the caller keeps what it had)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/moe/v1/status", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def tier_summary(replicas: list[dict]) -> dict[str, dict]:
    """Residency per tier summed over replicas, with one expert's bytes in the tier's form and
    their ratio to the compute dtype (the same on every replica of an app)."""
    out = {t: TierSummary() for t in ("hot", "warm", "cold")}
    for r in replicas:
        for tier, v in (r.get("tiers") or {}).items():
            if tier in out:
                out[tier].experts += int(v.get("experts", 0))
                out[tier].bytes += int(v.get("bytes", 0))
                if v.get("expert_bytes") is not None:
                    out[tier].form, out[tier].expert_bytes = v.get("form"), int(v["expert_bytes"])
                    out[tier].vs_compute = float(v.get("vs_compute", 1.0))
                if v.get("decoder"):
                    out[tier].decoder = str(v["decoder"])
    return {t: s.model_dump(by_alias=True, exclude_none=True) for t, s in out.items()}


def swap_records(spec: MoEDeploymentSpec, replicas: list[dict], previous: list[dict]) -> list[dict]:
    """One record per override in the spec, plus rollbacks of overrides no longer there;
    newest first. A record is Serving only when every replica hosting the expert serves the
    override's file."""
    records = []
    wanted = {o.expert: o for o in spec.experts.overrides}
    hosting: dict[str, list[dict]] = {}
    for r in replicas:
        for eid in (r.get("versions") or {}):
            hosting.setdefault(eid, []).append(r)
    for eid, o in wanted.items():
        reps = hosting.get(eid, [])
        rec = {"expert": eid, "outcome": "Pending", "reason": "", "digest": ""}
        attempts = [r.get("swaps", {}).get(eid) or {} for r in reps]
        mine = [a for a in attempts if a.get("path") == o.weights.path]
        failed = [(r, a) for r, a in zip(reps, attempts) if a.get("path") == o.weights.path and a.get("outcome") == "Failed"]
        serving = [r for r in reps if (r["versions"][eid].get("source") == o.weights.path)]
        if failed:
            r, a = failed[0]
            rec.update(outcome="Failed", reason=f"{r.get('group')} replica {r.get('replica')}: {a.get('reason', '')}")
        elif reps and len(serving) == len(reps):
            digests = {r["versions"][eid]["digest"] for r in serving}
            rec.update(outcome="Serving", digest=digests.pop() if len(digests) == 1 else "mixed")
        elif not reps:
            rec["reason"] = "no replica reports hosting this expert yet"
        else:
            rec["reason"] = f"serving on {len(serving)} of {len(reps)} replicas"
        if mine:
            rec["startedAt"] = min(a.get("started_at", "") for a in mine) or None
            if rec["outcome"] == "Serving":
                rec["durationSeconds"] = max(float(a.get("duration_s", 0.0)) for a in mine)
        records.append(rec)
    for eid, reps in sorted(hosting.items()):
        if eid in wanted:
            continue
        attempts = [r.get("swaps", {}).get(eid) or {} for r in reps]
        if not any(a.get("outcome") == "RolledBack" for a in attempts):
            continue
        done = all(r["versions"][eid].get("source") == CHECKPOINT for r in reps)
        rec = {"expert": eid, "outcome": "RolledBack" if done else "Pending",
               "digest": reps[0]["versions"][eid]["digest"] if done else "",
               "reason": "" if done else "rolling back",
               "startedAt": min(a.get("started_at", "") for a in attempts if a) or None}
        if done:
            rec["durationSeconds"] = max(float(a.get("duration_s", 0.0)) for a in attempts if a)
        records.append(rec)
    # keep older records of other experts (up to the limit), newest first
    seen = {r["expert"] for r in records}
    records += [p for p in previous if p.get("expert") not in seen]
    records.sort(key=lambda r: r.get("startedAt") or "", reverse=True)
    return [{k: v for k, v in r.items() if v not in (None, "")} | {"outcome": r["outcome"], "expert": r["expert"]}
            for r in records[:MAX_SWAPS]]


def overridden_experts(replicas: list[dict]) -> int:
    return len({eid for r in replicas for eid, v in (r.get("versions") or {}).items()
                if v.get("source") != CHECKPOINT})


def kv_summary(engine: dict) -> dict | None:
    """status.kvCache from an Ingress replica's engine figures (None: an app that reports none)."""
    kv = engine.get("kv") if isinstance(engine, dict) else None
    if not isinstance(kv, dict):
        return None
    queried = kv.get("prefix_queried_tokens", 0)
    return KVCacheStatus(block_size=kv["block_size"], blocks_total=kv["blocks_total"], blocks_used=kv["blocks_used"],
                         max_sequence_tokens=kv["max_sequence_tokens"],
                         prefix_hit_rate=round(kv["prefix_hit_tokens"] / queried, 4) if queried else None,
                         preemptions=kv.get("preemptions", 0), chunked_prefills=kv.get("chunked_prefills", 0),
                         attention=attention_path(kv.get("attention"))).model_dump(by_alias=True, exclude_none=True)


def attention_path(path: dict | None) -> str | None:
    """'flex', 'gather', or 'gather (flex failed: why)' from an Ingress' kv.attention."""
    if not isinstance(path, dict) or "running" not in path:
        return None
    if path.get("running") != path.get("configured") and path.get("error"):
        return f"{path['running']} ({path['configured']} failed: {str(path['error'])[:200]})"
    return str(path["running"])


def summarise(spec: MoEDeploymentSpec, report: dict, previous_status: dict) -> dict:
    """Status fields from the app's report."""
    replicas = report.get("replicas") or []
    out = {
        "tiers": tier_summary(replicas),
        "overriddenExperts": overridden_experts(replicas),
        "lastSwaps": swap_records(spec, replicas, previous_status.get("lastSwaps") or []),
    }
    kv = kv_summary(report.get("ingress") or {})
    if kv is not None:
        out["kvCache"] = kv
    routing = report.get("routing") or {}
    quarantined = routing.get("quarantined")
    if quarantined is not None:  # an app that reports it: the experts its routers leave out now
        out["quarantinedExperts"] = list(quarantined)
    if "capacity_factor" in routing:  # the cap the routers apply now (None: exact)
        out["capacityFactor"] = routing["capacity_factor"]
    state, reason, message, records = routing_anomaly(routing)
    out["routingAnomalies"] = records or None  # None: removed when there are none
    out["conditions"] = cond.set_condition(previous_status.get("conditions") or [], cond.ROUTING_ANOMALY, state,
                                           reason, message, previous_status.get("observedGeneration"))
    return out


def routing_anomaly(routing: dict) -> tuple[str, str, str, list[dict]]:
    """Condition RoutingAnomaly (status, reason, message) and status.routingAnomalies from the
    Ingress' report `routing` (its "detector" and "anomalies"). The message names layer, expert and
    key, and only what changes when the alerts change (the shares go into the Event), so a lasting
    alert writes no status. Unknown when the report has no detector or it cannot read a window."""
    detector = routing.get("detector")
    if not isinstance(detector, dict):
        return ("Unknown", cond.DETECTOR_UNAVAILABLE, "the app's status report has no routing.detector "
                "(an app older than the detector, or one that routed nothing yet)", [])
    if not detector.get("ok", False):
        return "Unknown", cond.DETECTOR_UNAVAILABLE, f"the routing anomaly detector: {detector.get('reason') or 'unavailable'}", []
    found = [a for a in routing.get("anomalies") or [] if isinstance(a, dict)]
    if not found:
        return "False", cond.NO_ANOMALY, detector.get("reason") or "no routing anomaly", []
    records = [{"expert": f"{a['layer']}.{a['expert']}", "kind": a["kind"], "key": a.get("key") or "-",
                "since": a.get("since")} for a in found[:MAX_ANOMALIES]]
    reason = cond.EXPERT_SURGE if any(r["kind"] == "surge" for r in records) else cond.ENTROPY_DROP
    named = [_alert(r) for r in records[:ANOMALIES_NAMED]]
    more = f"; and {len(found) - ANOMALIES_NAMED} more (status.routingAnomalies)" if len(found) > ANOMALIES_NAMED else ""
    return "True", reason, "; ".join(named) + more, records


def _alert(r: dict) -> str:
    layer, expert = r["expert"].split(".")
    what = "share surged" if r["kind"] == "surge" else "routing entropy dropped (its most chosen expert)"
    return f"layer {layer} expert {expert}: {what}, mostly from key {r['key']} (since {r.get('since') or '?'})"


def anomaly_events(before: list[dict], after: list[dict], routing: dict) -> list[tuple[str, str, str]]:
    """A Warning when RoutingAnomaly turns True or names other alerts (`before`, `after`: the
    conditions), with each alert's share, baseline and key share from the report `routing`."""
    now, was = cond.get_condition(after, cond.ROUTING_ANOMALY), cond.get_condition(before, cond.ROUTING_ANOMALY)
    if now is None or now.get("status") != "True":
        return []
    if was is not None and was.get("status") == "True" and was.get("message") == now.get("message"):
        return []
    details = [f"layer {a['layer']} expert {a['expert']} {a['kind']}: share {a.get('share', 0):.3f} against a baseline "
               f"of {a.get('baseline', 0):.3f}" + (f", entropy {a['entropy']:.3f}" if a.get("entropy") is not None else "")
               + f", {100 * a.get('key_share', 0):.0f}% of its tokens from key {a.get('key') or '-'}"
               for a in (routing.get("anomalies") or [])[:ANOMALIES_NAMED]]
    return [(cond.WARNING, now["reason"], "; ".join(details) or now["message"])]


def swaps_settled(status: dict) -> bool:
    return all(r.get("outcome") != "Pending" for r in status.get("lastSwaps") or [])


def swap_transitions(before: list[dict], after: list[dict]) -> list[tuple[str, str, str]]:
    """Events (type, reason, message) for swaps that reached an outcome since `before`."""
    old = {r["expert"]: r.get("outcome") for r in before}
    events = []
    for r in after:
        if r["outcome"] == old.get(r["expert"]) or r["outcome"] == "Pending":
            continue
        if r["outcome"] == "Failed":
            events.append((cond.WARNING, cond.HOT_SWAP_FAILED, f"expert {r['expert']}: {r.get('reason', '')}"))
        elif r["outcome"] == "Serving":
            events.append((cond.NORMAL, cond.HOT_SWAP_SERVING, f"expert {r['expert']} serves {r.get('digest', '')} on every "
                           f"replica ({r.get('durationSeconds', 0):.2f} s)"))
        else:
            events.append((cond.NORMAL, cond.HOT_SWAP_ROLLED_BACK, f"expert {r['expert']} back to the checkpoint's version"))
    return events
