"""How `moectl get --local` shows a standalone app whose `moectl up` is gone (no Ray, no cluster)."""

from __future__ import annotations

import os
import subprocess
import sys

from moe_operator.api import conditions as cond
from moe_operator.names import OWNER_ANNOTATION
from moe_operator.standalone.runner import as_seen, owner_running, owner_tag


def _doc(tag):
    conditions = cond.set_condition([], cond.READY, True, cond.SERVING, "serving at http://127.0.0.1:8000/v1")
    return {"metadata": {"name": "m", "annotations": {OWNER_ANNOTATION: tag} if tag else {}},
            "status": {"endpoint": "http://127.0.0.1:8000/v1", "conditions": conditions}}


def test_an_app_whose_moectl_up_is_gone_is_shown_stopped_without_an_endpoint():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    tag = owner_tag(dead.pid)
    dead.wait()
    assert owner_running(owner_tag()) and not owner_running(tag)
    assert not owner_running(f"{os.getpid()}:1.00")  # the same pid with another start time: reused
    seen = as_seen(_doc(tag))
    ready = next(c for c in seen["status"]["conditions"] if c["type"] == cond.READY)
    assert ready["status"] == "False" and ready["reason"] == cond.STOPPED and f"pid {dead.pid}" in ready["message"]
    assert "endpoint" not in seen["status"]


def test_a_running_owner_or_no_owner_leaves_the_status_as_written():
    doc = _doc(owner_tag())
    assert as_seen(doc) == doc
    assert as_seen(_doc(None), running=lambda tag: False) == _doc(None)  # --once: the app outlives moectl
