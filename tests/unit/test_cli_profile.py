"""moectl profile's view (`cli.profile_view`): two status reports -> a step's mean by phase,
each group's compute and slowest experts, and the tree (pure, no cluster)."""

import pytest
from rich.console import Console

from moe_operator.cli.profile_view import OTHER, profile_diff, profile_tree


def status(steps, scale, compute=(0.0, 0.0), waited=0.0, pid=7):
    phases = {"embed": 0.1, "attention": 1.0, "router": 0.2, "local": 0.0, "exchange": 2.4, "logits": 0.3,
              "sampling": 0.1, "exchange.plan": 0.2, "exchange.gather": 0.1, "exchange.wait": 2.0,
              "exchange.combine": 0.1}
    return {"ingress": {"pid": pid, "profile": {"steps": steps, "tokens": 4 * steps, "forward_s": 4.0 * scale,
                                                "step_s": 4.5 * scale,
                                                "phases": {k: v * scale for k, v in phases.items()}}},
            "replicas": [
                {"group": "ExpertShard-0", "replica": "a", "compute_s": compute[0],
                 "store": {"promotion_wait_s": waited},
                 "health": {"0.1": {"p95_ms": 0.5, "samples": 9}, "0.2": {"p95_ms": 1.5, "samples": 3},
                            "0.3": {"p95_ms": None, "samples": 0}}},
                {"group": "ExpertShard-1", "replica": "b", "compute_s": compute[1], "store": {},
                 "health": {"1.0": {"p95_ms": 0.2, "samples": 4}}}]}


def test_the_window_is_the_difference_a_step():
    before = status(100, 1.0, compute=(1.0, 2.0), waited=0.5)
    after = status(300, 3.0, compute=(2.0, 2.5), waited=0.7)  # 200 steps of 2x the first read's totals
    diff = profile_diff(before, after, seconds=5)
    assert diff["steps"] == 200 and diff["tokens_per_step"] == 4
    assert diff["step_ms"] == pytest.approx(9000 / 200)
    phases = {p["name"]: p for p in diff["phases"]}
    assert [p["name"] for p in diff["phases"]] == ["embed", "attention", "router", "local", "exchange", "logits",
                                                   "sampling", OTHER]
    assert phases["attention"]["ms"] == pytest.approx(2000 / 200) 
    assert phases["attention"]["share"] == pytest.approx(2 / 9, abs=1e-4)
    assert [p["name"] for p in phases["exchange"]["parts"]] == ["plan", "gather", "wait", "combine"]
    assert phases[OTHER]["ms"] == pytest.approx((9.0 - 2 * 4.1) / 200 * 1e3)  # the step less its phases
    g0, g1 = diff["groups"]
    assert g0["group"] == "ExpertShard-0" and g0["compute_ms"] == pytest.approx(5.0)
    assert g0["promotion_wait_ms"] == pytest.approx(1.0)
    assert [e["expert"] for e in g0["slowest"]] == ["0.2", "0.1"]  # slowest first; unsampled left out
    assert g1["compute_ms"] == pytest.approx(2.5) and g1["promotion_wait_ms"] == 0


def test_a_restarted_ingress_counts_from_zero_and_an_idle_window_says_so():
    diff = profile_diff(status(500, 5.0), status(100, 1.0))
    assert diff["steps"] == 100 and diff["step_ms"] == pytest.approx(45.0)
    with pytest.raises(ValueError, match="no step ran"):
        profile_diff(status(100, 1.0), status(100, 1.0))


def test_the_tree_shows_phases_parts_and_groups_under_the_wait():
    diff = profile_diff(status(100, 1.0, compute=(1.0, 2.0)), status(300, 3.0, compute=(2.0, 2.5), waited=0.4))
    console = Console(width=200, record=True)
    console.print(profile_tree(diff))
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0].startswith("step") and "45.000 ms   100%" in lines[0] and "200 steps" in lines[0]
    assert any(line.startswith("├── attention") and "10.000 ms    22%" in line for line in lines)
    wait = next(i for i, line in enumerate(lines) if "── wait" in line)
    assert "ExpertShard-0 compute 5.000 ms, waited for promotions 2.000 ms" in lines[wait + 1]
    assert "(slowest p95: 0.2 1.500 ms, 0.1 0.500 ms)" in lines[wait + 1]
    assert "ExpertShard-1 compute 2.500 ms" in lines[wait + 2]
    assert lines[-1].startswith("└── other")


def test_the_command_reads_the_app_twice_and_prints_the_window(monkeypatch):
    """`moectl profile NAME --endpoint URL` against a real HTTP server answering the two reads
    (a later read reaching another Ingress replica is read again); -o json is the diff."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from typer.testing import CliRunner

    from moe_operator.cli.main import app

    answers = [status(100, 1.0), status(900, 9.0, pid=8), status(300, 3.0)]  # the middle one: another replica
    served = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answers[min(len(served), len(answers) - 1)]).encode()
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        done = CliRunner().invoke(app, ["profile", "m", "--endpoint", url, "--seconds", "0.2", "-o", "json"])
        assert done.exit_code == 0, done.output
        diff = json.loads(done.output)
        assert served == ["/moe/v1/status"] * 3 and diff["steps"] == 200 and diff["seconds"] == 0.2
        served.clear()
        answers[:] = [status(100, 1.0)]  # nothing ran in the window
        done = CliRunner().invoke(app, ["profile", "m", "--endpoint", url, "--seconds", "0.2"])
        assert done.exit_code == 1 and "no step ran in the window" in done.output
    finally:
        server.shutdown()
