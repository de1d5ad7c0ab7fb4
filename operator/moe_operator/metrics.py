"""The operator's own Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("moe_operator_reconciles_total", "Reconcile passes by outcome reason.", ["result"])
RECONCILE_SECONDS = Histogram("moe_operator_reconcile_seconds", "Duration of a reconcile pass.",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
RAY_APPLY_SECONDS = Histogram("moe_operator_ray_apply_seconds", "The Serve config read-merge-write of a pass (a PUT only on a change; nobody waits for RUNNING).",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
LOOP_TURNS = Counter("moe_operator_loop_turns_total", "Turns of the objects' loops: a whole pass, or a read of a serving app's live report (about one an object per 5 s when the operator keeps up).")
APPLIED_GENERATION = Gauge("moe_operator_applied_generation", "Last spec generation serving.", ["namespace", "name"])

def start_metrics_server(port: int, addr: str = "127.0.0.1") -> None:
    """Serve /metrics on addr:port (loopback unless configured otherwise); the operator's startup
    handler calls it once."""
    start_http_server(port, addr=addr)
